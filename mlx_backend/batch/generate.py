"""A small batched speculative decoder: several requests, each with its own drafter, verified in one forward.

:class:`BatchSpeculativeDecoder` keeps one batched mlx-lm prompt cache for its active rows (the
per-layer caches of mlx-lm's ``BatchGenerator``), or, while a row is alone, that row's per-request caches
(:class:`_LoneRow`: what the solo loop decodes on). :meth:`~BatchSpeculativeDecoder.add` prefills a new
request alone in a fresh prompt cache and joins it to the batch with the caches' own ``merge`` and
``extend``; :meth:`~BatchSpeculativeDecoder.step` runs ONE forward over every active row (its last
token, then up to its own draft length of drafts; a row without drafts still advances a token),
accepts per row by the solo rule (:func:`mlx_backend.decode.sampling.verify_rows`, one wait for all
rows; greedy: the drafts up to the first one that is not the argmax, then the model's own token; a
sampler: the same exact speculative sampling as the solo path) and cuts every row back to its accepted prefix with
:class:`mlx_backend.batch.verify.BatchVerifyCache` (no second forward). Rows finish at their
``max_tokens`` or at a token of ``eos_token_ids`` and leave the batch (``filter``);
:meth:`~BatchSpeculativeDecoder.remove` drops one early, the others untouched.

Drafting follows the solo loop (:class:`mlx_backend.decode.generate._Run`): no drafts for a row's first
token, later a proposal of at most ``min(k_max, max_tokens - emitted - 1)`` (``k_max``: the row's
``draft_max``, or :data:`~mlx_backend.decode.draft_policy.DEFAULT_K_MAX` for ``draft_max=None``); the
drafter is reset on the prompt and taught every emitted token. How much of the proposals a step
verifies is one width S for all rows (:mod:`mlx_backend.batch.policy`: the forward costs B S token rows,
padding included): the S with the most expected tokens per cost, from each cost-aware row's acceptance
(learned per match length from all its proposals, as alone) and the verify-cost curve generation learns
on this model and machine; rows with a fixed ``draft_max`` verify their whole proposal, as alone. While
``burst()`` says nobody waits to join (a server's queue is empty), the width is the policy's burst rule
instead: the S that saves the most time per cost until the last row ends (from each row's tokens left).
``max_batch_tokens`` caps ``B S``, so one row's long draft cannot starve the others; each row keeps at
least its own token (a budget below the number of rows still advances every row by one).

For a server (:mod:`mlx_backend.batch.server_batch`): :meth:`~BatchSpeculativeDecoder.join` starts a row
from a per-request prompt cache that already holds all its tokens but the last (a prompt cache reused
from mlx-lm's LRU, then prefilled); each row may carry mlx-lm logits processors (they see the row's
tokens so far, as :func:`~mlx_backend.decode.sampling.verify_drafts` gives them);
:attr:`~BatchSpeculativeDecoder.last_logprobs` holds the log-probability vector of every token the
last step emitted; :meth:`~BatchSpeculativeDecoder.extract` copies one row's cache out (mlx-lm's
``extract``), and with ``keep_finished_caches`` a row that finishes leaves its cache in
:attr:`~BatchSpeculativeDecoder.finished_caches`. Not here: the cost-aware draft-length policy.
"""
from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from mlx_backend.batch.policy import expected_tokens, leave_plain, relative_costs, width
from mlx_backend.batch.verify import BatchVerifyCache
from mlx_backend.decode.draft_policy import DEFAULT_K_MAX, DraftPolicy, learned_costs
from mlx_backend.decode.generate import check_prompt, run_drafter, vocab_size
from mlx_backend.decode.rollback import RollbackUnsupported, VerifyCache, detach
from mlx_backend.decode.sampling import greedy, verify_rows
from reference.drafter import Drafter
from reference.speculative import in_vocab


def check_batchable(cache: list[Any]) -> None:
    """Refuse a per-request prompt cache with a layer mlx-lm has no batched form of (no ``merge``)."""
    for i, c in enumerate(cache):
        if not hasattr(c, "merge"):
            raise RollbackUnsupported(f"cache {i} ({type(c).__name__}) has no batched form in mlx-lm (no "
                                      f"merge): decode this model one request at a time (mlx_backend.decode.generate)")


def check_batch_model(model: nn.Module) -> None:
    """Refuse (RollbackUnsupported, naming the cache) a model whose caches cannot be batched and cut back
    per row: :func:`check_batchable` and :class:`BatchVerifyCache` on its empty prompt cache merged."""
    cache = make_prompt_cache(model)
    check_batchable(cache)
    BatchVerifyCache(model, [c.merge([c]) for c in cache]).close(align=False)


class _LoneRow:
    """A batch of one row kept on its per-request caches (``KVCache``, ``RotatingKVCache``, ``ArraysCache``):
    the solo :class:`~mlx_backend.decode.rollback.VerifyCache` behind :class:`BatchVerifyCache`'s interface.

    Why: a batch cache of one row (``BatchKVCache``: a per-row offset array, an array mask) made a request
    that is alone about 1 % slower than the one-at-a-time server on SmolLM2 (2026-12-05, one CPU core: the
    attention graph and its compute, cProfile). The decoder merges the row into batch caches when a second
    request joins and extracts it again when it is alone (:meth:`BatchSpeculativeDecoder.join`, ``_drop``):
    one copy of the row's cache per change, none per step.
    """

    batch_size = 1

    def __init__(self, model: nn.Module, cache: list[Any], gdn_path: Optional[str]):
        self.cache, self.solo = cache, VerifyCache(model, cache, gdn_path)

    def check_state(self) -> None:
        """Nothing to check: per-request caches have no padded prefill in progress."""

    def forward(self, tokens, lengths) -> mx.array:
        """Logits ``[1, S, vocab]`` of the row's ``lengths[0]`` real tokens (there is no padding)."""
        return self.solo.forward(list(tokens[0])[:int(lengths[0])])[None]

    def keep(self, m) -> None:
        self.solo.keep(int(m[0]))

    def copy(self) -> list[Any]:
        """A copy of the row's caches, of mlx-lm's own classes (as ``extract`` gives)."""
        cache = copy.deepcopy(self.cache)
        for c in cache:
            for part in (c.caches if hasattr(c, "caches") else [c]):
                detach(part)
        return cache

    def close(self, align: bool = True) -> None:
        self.solo.close()


@dataclass
class _Row:
    """One request in the batch: its tokens so far (``history``; the last one is the next step's input)."""

    uid: int
    history: list[int]
    max_tokens: int
    drafter: Any
    draft_max: Optional[int]   # None: the cost-aware width (mlx_backend.batch.policy), drafts up to DEFAULT_K_MAX
    sampler: Optional[Callable]
    logits_processors: Optional[list] = None
    policy: Optional[DraftPolicy] = None   # the row's acceptance by match length (cost-aware rows)
    match: int = 0                         # the drafter's match length for the last proposal
    proposal: list[int] = field(default_factory=list)
    n_out: int = 0
    n_drafted: int = 0
    n_accept: int = 0
    output: list[int] = field(default_factory=list)
    fed: bool = False   # whether history[-1] is in the cache too (a plain step in flight consumed it)

    def room(self) -> int:
        """Drafts this row may verify in the next step (the solo loop's rule, ``_Run.room``)."""
        if self.n_out == 0 or self.drafter is None:
            return 0
        k_max = DEFAULT_K_MAX if self.draft_max is None else self.draft_max
        return max(0, min(k_max, self.max_tokens - self.n_out - 1))

    def pipelinable(self) -> bool:
        """Whether the row may take pipelined plain steps: no logits processors (they would need the
        in-flight token) and no fixed draft length (it verifies every proposal where it is made, as alone)."""
        return not self.logits_processors and (self.policy is not None or self.drafter is None)

    def expected_after_guess(self) -> list[float]:
        """``E(n + 1) - a_1`` for n = 0..len(proposal) - 1 while the row's next token is in flight (the
        proposal's first token guesses it); ``[1]`` without a cost-aware proposal."""
        if self.policy is None or not self.proposal:
            return [1.0]
        a = self.policy.acceptance(self.match)
        e = expected_tokens(a, len(self.proposal))
        return [x - a[0] for x in e[1:]]

    def expected(self) -> list[float]:
        """E(0..n) for this step's proposal of n tokens (a fixed-length row: 1 whatever n, it does not choose)."""
        if self.policy is None:
            return [1.0] * (len(self.proposal) + 1)
        return expected_tokens(self.policy.acceptance(self.match), len(self.proposal))


class BatchSpeculativeDecoder:
    """Speculative decoding of several requests at once with ``model`` (see the module docstring).

    ``eos_token_ids``: tokens that end a row (the EOS is part of its output). ``max_batch_tokens``: the
    per-step cap on the forward's tokens, rows times width (None: no cap). ``gdn_path``: :data:`mlx_backend.decode.rollback.GDN_PATHS`.
    ``burst``: called before each width choice, True when no request waits to join the rows (the burst
    rule of :mod:`mlx_backend.batch.policy`); None: never (the summed rate always).
    """

    def __init__(self, model: nn.Module, *, eos_token_ids: Iterable[int] = (), max_batch_tokens: Optional[int] = None,
                 prefill_step_size: int = 2048, gdn_path: Optional[str] = None, keep_finished_caches: bool = False,
                 burst: Optional[Callable[[], bool]] = None):
        if max_batch_tokens is not None and max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1 or None, got {max_batch_tokens}")
        if prefill_step_size < 1:
            raise ValueError(f"prefill_step_size must be >= 1, got {prefill_step_size}")
        self.model, self.eos = model, set(int(t) for t in eos_token_ids)
        self.max_batch_tokens, self.prefill_step_size, self.gdn_path = max_batch_tokens, prefill_step_size, gdn_path
        self.n_vocab = vocab_size(model)
        self.rows: list[_Row] = []          # the active rows, in batch order
        self.cache: Optional[list[Any]] = None   # batch caches; a lone row's per-request caches (_LoneRow)
        self.verifier: Optional[Union[BatchVerifyCache, _LoneRow]] = None
        self._checked = False   # check_batch_model passed
        self.finished: dict[int, str] = {}  # uid -> "length" | "stop"
        self.keep_finished_caches = keep_finished_caches
        self.burst = burst
        self.finished_caches: dict[int, tuple[list[Any], list[int]]] = {}   # uid -> (its cache at its finish, the tokens it holds)
        self._pending: Optional[tuple[mx.array, mx.array]] = None   # plain mode: tokens [B'] and logprobs in flight
        self._settle = False   # a row joined while plain steps were in flight: read them, start no more
        self.last_logprobs: dict[int, list[mx.array]] = {}  # uid -> [V] log-probabilities of each token of the last step
        self.n_forward = self.n_drafted = self.n_accept = 0   # forwards; drafts verified / accepted
        self.n_plain = 0   # of the forwards, pipelined plain steps
        self._uids = itertools.count()
        self.step_costs = learned_costs(model, DEFAULT_K_MAX + 1, gdn_path)   # c(S), shared with solo generation

    @property
    def active(self) -> list[int]:
        """The uids of the rows still decoding, in batch order."""
        return [r.uid for r in self.rows]

    def add(self, prompt_ids, *, max_tokens: int, drafter: Union[Drafter, str, None] = None,
            draft_max: Optional[int] = None,
            sampler: Optional[Callable] = None, logits_processors: Optional[list] = None) -> int:
        """Prefill a new request alone and join it to the batch; returns its uid. ``drafter``: None
        (``"auto"``), a name (``"auto"``, ``"lookup"``, ``"suffix"``) or a Drafter; ``draft_max``: None the
        cost-aware width, k verify every proposal of up to k tokens, 0 no drafts."""
        prompt = [int(t) for t in (prompt_ids.tolist() if isinstance(prompt_ids, mx.array) else prompt_ids)]
        check_prompt(prompt, self.model)
        self._check_args(max_tokens, draft_max)
        d = run_drafter(drafter, draft_max)   # before touching the batch: an unknown name changes nothing
        cache = make_prompt_cache(self.model)
        check_batchable(cache)
        for start in range(0, len(prompt) - 1, self.prefill_step_size):
            chunk = prompt[start:min(start + self.prefill_step_size, len(prompt) - 1)]
            self.model(mx.array(chunk, mx.uint32)[None], cache=cache)
            mx.eval([c.state for c in cache])
        return self.join(cache, prompt, max_tokens=max_tokens, drafter=d, draft_max=draft_max, sampler=sampler,
                         logits_processors=logits_processors)

    @staticmethod
    def _check_args(max_tokens: int, draft_max: Optional[int]) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if draft_max is not None and draft_max < 0:
            raise ValueError(f"draft_max must be >= 0 or None (the cost-aware width), got {draft_max}")

    def join(self, cache: list[Any], history: list[int], *, max_tokens: int, drafter: Optional[Drafter],
             draft_max: Optional[int], sampler: Optional[Callable] = None,
             logits_processors: Optional[list] = None) -> int:
        """Join a row whose per-request prompt cache ``cache`` (``make_prompt_cache``'s kinds) holds
        ``history[:-1]`` (its whole prompt but the last token, which the row's first step feeds); returns its
        uid. ``drafter``: a Drafter (reset here on ``history``) or None (no drafts)."""
        history = [int(t) for t in history]
        check_prompt(history, self.model)
        self._check_args(max_tokens, draft_max)
        check_batchable(cache)
        if not self._checked:   # before anything changes: an unsupported cache raises here
            check_batch_model(self.model)
            self._checked = True
        if self.cache is None:   # alone: its own caches
            self.cache, self.verifier = cache, _LoneRow(self.model, cache, self.gdn_path)
        else:
            if isinstance(self.verifier, _LoneRow):   # the lone row becomes a batch of one
                self.verifier.close()
                self.cache = [c.merge([c]) for c in self.cache]
                self.verifier = BatchVerifyCache(self.model, self.cache, self.gdn_path)
            for c, new in zip(self.cache, cache):
                c.extend(new.merge([new]))
        if drafter is not None:
            drafter.reset(list(history))
        policy = DraftPolicy([1.0] * (DEFAULT_K_MAX + 1)) if drafter is not None and draft_max is None else None
        row = _Row(next(self._uids), history, max_tokens, drafter, draft_max, sampler, logits_processors, policy)
        self.rows.append(row)
        self._settle = self._pending is not None   # the in-flight steps cover the other rows only
        return row.uid

    def extract(self, uid: int) -> list[Any]:
        """A copy of row ``uid``'s cache as per-request caches (mlx-lm's ``extract``: ``KVCache``,
        ``RotatingKVCache``, ``ArraysCache``), holding :meth:`cached_tokens`."""
        index = [i for i, r in enumerate(self.rows) if r.uid == uid]
        if not index:
            raise KeyError(f"no active row {uid}")
        return self._copy_row(index[0])

    def _copy_row(self, i: int) -> list[Any]:
        if isinstance(self.verifier, _LoneRow):
            return self.verifier.copy()
        return [c.extract(i) for c in self.cache]

    def cached_tokens(self, uid: int) -> list[int]:
        """The tokens row ``uid``'s cache holds: its ``history`` but the last token, or all of it while a plain
        step is in flight (that step fed the last token; its output is not read yet)."""
        row = next((r for r in self.rows if r.uid == uid), None)
        if row is None:
            raise KeyError(f"no active row {uid}")
        return list(row.history if row.fed else row.history[:-1])

    def remove(self, uid: int) -> None:
        """Drop row ``uid`` from the batch (the other rows' caches are untouched)."""
        index = [i for i, r in enumerate(self.rows) if r.uid == uid]
        if not index:
            raise KeyError(f"no active row {uid}")
        self._drop(index)

    def _drop(self, index: list[int]) -> None:
        keep = [i for i in range(len(self.rows)) if i not in index]
        self.rows = [self.rows[i] for i in keep]
        if not keep:   # mlx-lm's filter cannot leave zero rows: start afresh at the next add
            if self.verifier is not None:
                self.verifier.close(align=False)
            self.cache = self.verifier = None
            self._pending, self._settle = None, False
            return
        if len(keep) == 1:   # alone again: back to its own caches (_LoneRow)
            lone = [c.extract(keep[0]) for c in self.cache]
            self.verifier.close(align=False)
            self.cache, self.verifier = lone, _LoneRow(self.model, lone, self.gdn_path)
        else:
            for c in self.cache:
                c.filter(mx.array(keep))
        if self._pending is not None:   # in flight for the first rows (those that joined before it)
            tokens, logprobs = self._pending
            kept = [i for i in keep if i < tokens.shape[0]]
            self._pending = (tokens[mx.array(kept)], logprobs[mx.array(kept)]) if kept else None
            self._settle = self._settle and self._pending is not None

    def _propose(self) -> None:
        """Each row's proposal for this step (``row.proposal``) and the match length it was drafted on."""
        for r in self.rows:
            n = r.room()
            r.proposal = in_vocab([int(t) for t in r.drafter.draft(n)[:n]], self.n_vocab) if n else []
            r.match = (getattr(r.drafter, "match_length", 0) or 0) if r.proposal else 0

    def _width(self) -> int:
        """The step's width S (:func:`mlx_backend.batch.policy.width`): rows with a fixed draft length verify
        their whole proposal, the others as much as pays at the learned costs."""
        n = [len(r.proposal) for r in self.rows]
        s_min = 1 + max((k for r, k in zip(self.rows, n) if r.policy is None), default=0)
        rel = relative_costs(self.step_costs, len(n) * (1 + max(n)))
        return width([r.expected() for r in self.rows], n, rel, s_min=s_min, max_batch_tokens=self.max_batch_tokens,
                     remaining=self._remaining(0))

    def _remaining(self, flying: int) -> Optional[list[int]]:
        """Each row's tokens left (``max_tokens`` - emitted - ``flying``) in a burst (``burst()``), else None."""
        if self.burst is None or not self.burst():
            return None
        return [r.max_tokens - r.n_out - flying for r in self.rows]

    def step(self) -> dict[int, list[int]]:
        """One forward for every active row; returns each row's new tokens (uid -> tokens). Rows that
        finish (max_tokens, EOS) leave the batch; :attr:`finished` says why.

        Where no row's drafts pay (the width is 1) it decodes plainly, pipelined like mlx-lm's
        ``BatchGenerator``: the next one-token step of every row is launched on the lazy tokens of the step
        before (``mx.async_eval``) before those are read, until some rows' proposals make a verify step pay
        (:func:`mlx_backend.batch.policy.leave_plain`), a row joins or every row ends. Rows with logits
        processors or a fixed draft length keep the batch out of plain mode. A row that joins then emits
        nothing in the step that reads the others' in-flight tokens."""
        if not self.rows:
            return {}
        if self._pending is not None:
            return self._plain_step()
        self._propose()
        S = self._width()
        if S == 1 and all(r.pipelinable() for r in self.rows):
            self._pending = self._launch(mx.array([r.history[-1] for r in self.rows], mx.uint32))
            return self._plain_step(proposed=True)
        drafts = [r.proposal[:S - 1] for r in self.rows]
        lengths = [1 + len(d) for d in drafts]
        S = max(lengths)
        tokens = [[r.history[-1]] + d + [0] * (S - 1 - len(d)) for r, d in zip(self.rows, drafts)]
        logits = self.verifier.forward(tokens, lengths)
        self.n_forward += 1
        rows = verify_rows(logits, drafts, [r.sampler for r in self.rows], [r.logits_processors for r in self.rows],
                           [r.history for r in self.rows])
        accepted = [(emitted, n_accept) for emitted, _, n_accept in rows]
        self.last_logprobs = {r.uid: logprobs for r, (_, logprobs, _) in zip(self.rows, rows)}
        self.verifier.keep([1 + n for _, n in accepted])
        return self._learn(drafts, accepted)

    def _launch(self, inputs: mx.array) -> tuple[mx.array, mx.array]:
        """Launch one plain step of every row on ``inputs`` ([B], possibly not computed yet): each row's next
        token (its own sampler; greedy without) and log-probabilities, lazy (mlx-lm's ``GenerationBatch._step``)."""
        self.verifier.check_state()
        logits = self.model(inputs[:, None], cache=self.cache)[:, -1, :]
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        samplers = [r.sampler for r in self.rows]
        if all(f is None for f in samplers):
            tokens = greedy(logprobs)
        else:
            tokens = mx.concatenate([(f or greedy)(logprobs[b:b + 1]).reshape(1) for b, f in enumerate(samplers)])
        mx.async_eval(tokens, logprobs)
        self.n_forward += 1
        self.n_plain += 1
        return tokens, logprobs

    def _leave_plain(self) -> bool:
        """Whether to start no more plain steps: a row joined, every row's in-flight token is its last, or a
        verify step pays (:func:`mlx_backend.batch.policy.leave_plain` on the rows' proposals)."""
        if self._settle or all(r.n_out + 1 >= r.max_tokens for r in self.rows):
            return True
        expected = [r.expected_after_guess() for r in self.rows]
        n = [len(e) - 1 for e in expected]
        if not any(n):
            return False
        B = len(self.rows)
        rel = relative_costs(self.step_costs, B * (1 + max(n)))
        estimate = self.step_costs.estimate()
        c1, c_p = (estimate[0][0], estimate[1]) if estimate is not None else (1.0, 1.0)
        return leave_plain(expected, n, rel, rel_plain=c_p / c1 * rel[B - 1], rel_restart=max(c1 - c_p, 0.0) / c1,
                           max_batch_tokens=self.max_batch_tokens, remaining=self._remaining(1))

    def _plain_step(self, proposed: bool = False) -> dict[int, list[int]]:
        """Read the plain step in flight (launching the next one first unless :meth:`_leave_plain`)."""
        if not proposed:
            self._propose()   # each proposal's first token guesses the row's in-flight token
        tokens, logprobs = self._pending
        n_flying = tokens.shape[0]
        go_on = not self._leave_plain()
        self._pending = self._launch(tokens) if go_on else None
        self._settle = False
        emitted = tokens.tolist()
        self.last_logprobs = {r.uid: [logprobs[b]] for b, r in enumerate(self.rows[:n_flying])}
        for r in self.rows[:n_flying]:
            r.fed = go_on
        # a row that joined meanwhile (after the others' in-flight step) emits nothing yet
        accepted = [([t], 0) for t in emitted] + [None] * (len(self.rows) - n_flying)
        return self._learn([[] for _ in self.rows], accepted)

    def _learn(self, drafts, accepted) -> dict[int, list[int]]:
        out, done = {}, []
        for i, (r, d, step) in enumerate(zip(self.rows, drafts, accepted)):
            if step is None:
                continue
            emitted, n_accept = step
            r.n_drafted += len(d)
            r.n_accept += n_accept
            self.n_drafted += len(d)
            self.n_accept += n_accept
            if r.policy is not None:
                r.policy.observe(r.proposal, emitted, r.match)
            if r.drafter is not None:
                r.drafter.extend(emitted)
            r.history.extend(emitted)
            cut = next((j + 1 for j, t in enumerate(emitted) if t in self.eos), len(emitted))
            new = emitted[:min(cut, r.max_tokens - r.n_out)]
            r.n_out += len(new)
            r.output.extend(new)
            out[r.uid] = new
            if new and new[-1] in self.eos:
                self.finished[r.uid] = "stop"
            elif r.n_out >= r.max_tokens:
                self.finished[r.uid] = "length"
            if r.uid in self.finished:
                done.append(i)
        if done:
            if self.keep_finished_caches:
                for i in done:
                    r = self.rows[i]
                    self.finished_caches[r.uid] = (self._copy_row(i), list(r.history if r.fed else r.history[:-1]))
            self._drop(done)
        return out

    def close(self) -> None:
        """Give the model's GDN layers their own class back (the decoder is unusable afterwards)."""
        if self.verifier is not None:
            self.verifier.close()
        self.rows, self.cache, self.verifier = [], None, None
