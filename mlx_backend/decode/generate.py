"""n-gram self-speculative generation for mlx-lm models, in mlx-lm's generator shape.

:func:`ngram_speculative_generate_step` is a drop-in for ``mlx_lm.generate.speculative_generate_step``
without a draft model: drafts come from an n-gram drafter (llama.cpp's lookup: context, dynamic
and static caches), one forward verifies ``[last, d1..dk]``, and the prompt cache is cut back to
the accepted prefix exactly (:mod:`mlx_backend.decode.rollback`), hybrid GatedDeltaNet models included.
Where drafting does not pay, it decodes plainly, pipelined like ``mlx_lm.generate.generate_step``.
:func:`stream_generate` is ``mlx_lm.stream_generate`` on top of it.
"""
from __future__ import annotations

import contextlib
import functools
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, Optional, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START, GenerationResponse, generation_stream, wired_limit
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.tokenizer_utils import TokenizerWrapper

from mlx_backend.decode.draft_policy import DEFAULT_K_MAX, DraftPolicy, FixedDraftLength, learned_costs, save_costs
from mlx_backend.decode.rollback import GDN_PATHS, VerifyCache
from mlx_backend.decode.sampling import greedy, verify_drafts
from reference.drafter import Drafter
from reference.ngram.tokens import is_whole
from reference.suffix.auto import DEFAULT_DRAFTER, DRAFTERS
from reference.speculative import DRAFT_MAX_LIMIT, in_vocab


@dataclass
class SpecStats:
    """Counters of one speculative run, filled in place while it generates.

    ``steps`` decode forwards (each verifies 0..k drafts) produced ``n_tokens`` tokens;
    ``n_forward`` also counts prefill chunks. ``n_drafted`` draft tokens were verified and
    ``n_accept`` of them accepted. ``draft_lengths`` counts the chosen k per step; ``policy`` is
    the cost-aware policy's summary (auto draft length only). ``plain_steps`` of the steps ran
    pipelined in plain mode, entered ``enter_plain`` times and left ``leave_plain`` times for a
    verify step (not counting the end of the run). Times are seconds.
    """

    steps: int = 0
    n_forward: int = 0
    n_tokens: int = 0
    n_drafted: int = 0
    n_accept: int = 0
    n_proposed: int = 0
    draft_lengths: dict[int, int] = field(default_factory=dict)
    plain_steps: int = 0
    enter_plain: int = 0
    leave_plain: int = 0
    policy: Optional[dict] = None
    t_draft: float = 0.0
    t_rollback: float = 0.0
    t_total: float = 0.0

    @property
    def tokens_per_forward(self) -> float:
        return self.n_tokens / self.steps if self.steps else 0.0

    @property
    def accept(self) -> float:
        """Accepted / drafted, in percent (llama.cpp's ``accept``, as in the reference); 0 when nothing was drafted."""
        return 100.0 * self.n_accept / self.n_drafted if self.n_drafted else 0.0

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d.update(tokens_per_forward=self.tokens_per_forward, accept=self.accept)
        return d


def vocab_size(model: nn.Module) -> Optional[int]:
    """The token ids ``model`` takes: the rows of its ``embed_tokens`` (else ``model.args.vocab_size``,
    else None). An id outside them reads past the embedding: garbage, or a crash."""
    for name, module in model.named_modules():
        if isinstance(module, (nn.Embedding, nn.QuantizedEmbedding)) and name.endswith("embed_tokens"):
            return int(module.weight.shape[0])
    return getattr(getattr(model, "args", None), "vocab_size", None)


def as_token_ids(prompt) -> list[int]:
    """The prompt (an ``mx.array`` or a sequence) as a list of ints; anything but a 1-D run of integers is a
    ``TypeError`` (before: float ids were truncated silently, a 2-D array failed inside ``int()``)."""
    if isinstance(prompt, mx.array) and prompt.ndim != 1:
        raise TypeError(f"the prompt must be a 1-D sequence of integer token ids, got an array of shape {prompt.shape}")
    values = prompt.tolist() if isinstance(prompt, mx.array) else list(prompt)
    bad = next((t for t in values if not is_whole(t)), None)
    if bad is not None:
        raise TypeError(f"the prompt must be a 1-D sequence of integer token ids, got {type(bad).__name__} {bad!r}")
    return [int(t) for t in values]


def check_prompt(prompt_ids: list[int], model: nn.Module) -> None:
    """Refuse an empty prompt or a token id outside the model's vocabulary (ValueError naming both)."""
    if not prompt_ids:
        raise ValueError("the prompt must hold at least one token")
    n_vocab = vocab_size(model)
    for i, t in enumerate(prompt_ids):
        if t < 0 or (n_vocab is not None and t >= n_vocab):
            raise ValueError(f"prompt token id {t} (position {i}) is outside the model's vocabulary of "
                             f"{n_vocab} tokens (ids 0..{n_vocab - 1}): was the prompt made with another tokenizer?")


def run_drafter(drafter, draft_max, *, c_st=None, c_dyn=None, history=None):
    """The run's drafter: ``drafter`` itself if it is one, else the drafter it names (None: ``"auto"``) from
    :func:`mlx_backend.ngram.default.make_drafter` (None with ``draft_max=0``: nothing to draft). An unknown
    name is a ``ValueError`` naming the choices, and so is a cache the drafter would not read: ``c_st`` or
    ``c_dyn`` (lookup's) with ``"suffix"``, ``history`` (suffix's) with ``"lookup"``, any of them with a
    drafter object (it holds its own); ``"auto"`` reads all three."""
    given = [name for name, value in (("c_st", c_st), ("c_dyn", c_dyn), ("history", history)) if value is not None]
    if drafter is not None and not isinstance(drafter, str):
        if isinstance(drafter, type):
            raise TypeError(f"drafter must be a drafter object, got the class {drafter.__name__}: make one, e.g. "
                            f"{drafter.__name__}()")
        if not isinstance(drafter, Drafter):
            raise TypeError(f"drafter must be one of {', '.join(DRAFTERS)}, None (auto) or a Drafter (reset, draft, "
                            f"extend: reference/drafter.py), got {type(drafter).__name__}")
        if given:
            raise ValueError(f"{' and '.join(given)}: the caches of a drafter made by name, unused by the "
                             f"{type(drafter).__name__} given: drop {_them(given)}, or give {_them(given)} to the "
                             "drafter when you make it")
        return drafter
    from mlx_backend.ngram.default import make_drafter   # its tables' compiled loops load only when used

    name = DEFAULT_DRAFTER if drafter is None else drafter
    if name not in DRAFTERS:
        raise ValueError(f"unknown drafter {name!r}: choose one of {', '.join(DRAFTERS)}")
    unread, whose, other = _UNREAD.get(name, ((), "", ""))
    unused = [n for n in given if n in unread]
    if unused:
        raise ValueError(f"{' and '.join(unused)}: {whose}, unused by drafter={name!r}: drop {_them(unused)}, or "
                         f"use drafter={other!r} or 'auto'")
    return None if draft_max == 0 else make_drafter(name, c_st=c_st, c_dyn=c_dyn, history=history)


#: Per drafter name: the arguments it does not read, whose they are, the drafter that reads them ("auto" reads all).
_UNREAD = {"suffix": (("c_st", "c_dyn"), "the lookup drafter's caches", "lookup"),
           "lookup": (("history",), "the suffix drafter's history", "suffix")}


def _them(names: list[str]) -> str:
    return "it" if len(names) == 1 else "them"


def mlx_lm_draft_max(draft_max, num_draft_tokens=None, kv_bits=None, input_embeddings=None):
    """The run's ``draft_max`` once mlx-lm's keywords are read: ``num_draft_tokens`` (its
    ``speculative_generate_step``'s draft length) is taken as ``draft_max`` (both, disagreeing: a
    ``ValueError``); ``kv_bits`` and ``input_embeddings`` other than None are a ``ValueError`` naming the keyword
    and the way out (``kv_group_size`` and ``quantized_kv_start`` are read only with ``kv_bits``, as in mlx-lm).
    The rule: a keyword of mlx-lm's is honoured or refused, never accepted and ignored."""
    if kv_bits is not None:
        raise ValueError("kv_bits: mlx-lm's switch to a quantized KV cache during generation is not mirrored; "
                         "pass a prompt_cache of QuantizedKVCache layers instead (rolled back exactly), or drop it")
    if input_embeddings is not None:
        raise ValueError("input_embeddings: n-gram speculation drafts and verifies token ids, so a prompt given as "
                         "embeddings (images, ...) is not supported; pass token ids, or use mlx_lm.stream_generate")
    if num_draft_tokens is not None:
        if draft_max is not None and draft_max != num_draft_tokens:
            raise ValueError(f"num_draft_tokens={num_draft_tokens} and draft_max={draft_max} disagree: give one "
                             "of them")
        return num_draft_tokens
    return draft_max


class _Run:
    """The state of one speculative run: the cache and its verifier, the drafter, the draft-length policy,
    the tokens so far (``history``; its last one is the next step's input) and the counters.

    Drafting and counting follow :mod:`reference.speculative`: the first token (the prompt's last token's
    step) is not drafted for, later steps draft at most ``max_tokens - emitted - 1``, and a step counts
    (``stats``) and teaches the drafter all its tokens, even past an EOS the consumer stops at."""

    match = 0   # the drafter's match length for the last proposal (propose)

    def __init__(self, prompt, model, *, max_tokens, sampler, logits_processors, prompt_cache, prefill_step_size,
                 draft_max, drafter, c_st, c_dyn, stats, draft_policy, gdn_path, suffix_history=None,
                 max_kv_size=None, prompt_progress_callback=None, stream=generation_stream):
        if not callable(model) or not hasattr(model, "layers"):   # mlx-lm's models (and wrappers of them) list layers
            raise TypeError(f"model must be an mlx-lm language model (the first value of mlx_backend.load or "
                            f"mlx_lm.load: an nn.Module with layers), got {type(model).__name__}")
        self.prompt = as_token_ids(prompt)
        check_prompt(self.prompt, model)
        if draft_max is not None and not is_whole(draft_max):
            raise TypeError(f"draft_max must be a whole number or None (auto), got {draft_max!r}")
        if draft_max is not None and not 0 <= draft_max <= DRAFT_MAX_LIMIT:
            raise ValueError(f"draft_max must be in 0..{DRAFT_MAX_LIMIT} (the verify forward's memory grows with it; "
                             f"reference.speculative.DRAFT_MAX_LIMIT) or None (auto), got {draft_max}")
        if gdn_path is not None and gdn_path not in GDN_PATHS:   # checked with draft_max=0 too: not ignored unseen
            raise ValueError(f"gdn_path must be one of {GDN_PATHS} or None (by device), got {gdn_path!r}")
        if draft_max is not None and draft_policy is not None:
            raise ValueError("draft_max fixes the draft length and draft_policy chooses it: give one of them "
                             "(draft_max=None with a draft_policy)")
        for name, value in (("max_tokens", max_tokens), ("prefill_step_size", prefill_step_size)):
            if not is_whole(value):
                raise TypeError(f"{name} must be a whole number, got {value!r}")
        if prefill_step_size < 1:
            raise ValueError(f"prefill_step_size must be >= 1, got {prefill_step_size}")
        if max_kv_size is not None:
            if not is_whole(max_kv_size):
                raise TypeError(f"max_kv_size must be a whole number or None (keep every position), "
                                f"got {max_kv_size!r}")
            if max_kv_size < 1:   # the rule of generate's --max-kv-size
                raise ValueError(f"max_kv_size must be at least 1 or None (keep every position), got {max_kv_size}")
            if prompt_cache is not None or hasattr(model, "make_cache"):
                # mlx-lm's generate_step takes it and ignores it in both cases: refused, never accepted and ignored
                raise ValueError("max_kv_size sizes the cache the run makes, and " + (
                    "prompt_cache was given: make that cache with make_prompt_cache(model, max_kv_size)"
                    if prompt_cache is not None else "this model makes its own caches (model.make_cache), whose "
                    "size mlx-lm's make_prompt_cache does not set") + "; drop max_kv_size")
        if stats is not None and not isinstance(stats, SpecStats):
            raise TypeError(f"stats must be a SpecStats (mlx_backend.decode.generate), got {type(stats).__name__}")
        if draft_policy is not None and not hasattr(draft_policy, "choose"):
            raise TypeError(f"draft_policy must be a DraftPolicy (mlx_backend.decode.draft_policy), got "
                            f"{type(draft_policy).__name__}")
        self.model, self.max_tokens, self.prefill_step_size = model, max_tokens, prefill_step_size
        self.stream = stream   # every forward runs on it (mlx-lm's generate_step's `stream`)
        self.sampler, self.logits_processors = sampler or greedy, logits_processors
        self.progress = prompt_progress_callback or (lambda done, total: None)
        self.n_vocab = vocab_size(model)
        self.stats = stats if stats is not None else SpecStats()
        self.cache = prompt_cache if prompt_cache is not None else make_prompt_cache(model, max_kv_size)
        self.callers_cache = prompt_cache is not None   # only then is the last token fed at the end (finish)
        self.verifier = VerifyCache(model, self.cache, gdn_path) if draft_max != 0 else None
        self.drafter = run_drafter(drafter, draft_max, c_st=c_st, c_dyn=c_dyn, history=suffix_history)
        self.learned = None   # the step costs this run learns from its own timed steps, kept for later runs
        if draft_max is not None:
            self.policy = FixedDraftLength(draft_max)
        elif draft_policy is not None:
            self.policy = draft_policy
        else:
            self.learned = learned_costs(model, DEFAULT_K_MAX + 1, gdn_path)
            self.policy = DraftPolicy(step_costs=self.learned)
        self.stats.policy = self.policy.summary()
        self.history = list(self.prompt)
        self.n_out = 0
        # this run's tokens in the cache; when the run ends it must hold the prompt and the n_out tokens the
        # consumer got, history[:len(prompt) + n_out] (a step's tokens are learned before they are yielded)
        self.n_cached = 0
        self.t_start = time.perf_counter()
        self.t_before = self.stats.t_total   # a SpecStats given to several runs adds them all up

    def more(self) -> bool:
        return self.max_tokens < 0 or self.n_out < self.max_tokens

    def prefill(self) -> None:
        """Every prompt token but the last into the cache, in chunks (mlx-lm's generate_step); the drafter
        starts on the whole prompt."""
        ids, step = self.prompt, self.prefill_step_size
        self.progress(0, len(ids))
        for start in range(0, len(ids) - 1, step):
            end = min(start + step, len(ids) - 1)
            self.model(mx.array(ids[start:end], mx.uint32)[None], cache=self.cache)
            mx.eval([c.state for c in self.cache])
            self.stats.n_forward += 1
            self.progress(end, len(ids))
        self.n_cached = len(ids) - 1
        if self.drafter is not None:
            self.drafter.reset(ids)

    def room(self, n_done: int) -> int:
        """How many drafts a verify step may hold once ``n_done`` tokens have been emitted: none for the
        first token (the prompt's, as llama.cpp's lookup), then as many as fit with the model's own token
        (the rule of :mod:`reference.speculative`)."""
        if n_done == 0:
            return 0
        return self.policy.k_max if self.max_tokens < 0 else min(self.policy.k_max, self.max_tokens - n_done - 1)

    def propose(self, n: int) -> list[int]:
        """Up to ``n`` drafted tokens, cut before any id outside the model's vocabulary."""
        t0 = time.perf_counter()
        proposal = []
        if self.drafter is not None and n > 0:
            drafted = self.drafter.draft(n)
            if not hasattr(drafted, "__getitem__") or isinstance(drafted, (str, bytes)):  # a drafter of the caller's
                raise TypeError(f"the drafter's draft(n) must return a sequence of token ids (a list, [] for none), "
                                f"got {type(drafted).__name__}")
            proposal = in_vocab([int(t) for t in drafted[:n]], self.n_vocab)
        # the suffix match it was drafted on (0: none, or a drafter without one): the policy's acceptance key
        self.match = (getattr(self.drafter, "match_length", 0) or 0) if proposal else 0
        self.stats.t_draft += time.perf_counter() - t0
        return proposal

    def keep(self, m: int) -> float:
        """Keep the first ``m`` positions of the verify forward; returns the seconds it took."""
        t0 = time.perf_counter()
        self.verifier.keep(m)
        self.n_cached += m
        seconds = time.perf_counter() - t0
        self.stats.t_rollback += seconds
        return seconds

    def give(self) -> None:
        """Count the next token as the consumer's, just before it is yielded (the first: the prompt is done)."""
        if self.n_out == 0:
            self.progress(len(self.prompt), len(self.prompt))
        self.n_out += 1

    def learn(self, proposal: list[int], emitted: list[int]) -> None:
        """One step done: the policy, the drafter and the history learn its tokens; the step is counted."""
        t0 = time.perf_counter()
        self.policy.observe(proposal, emitted, self.match)
        if self.drafter is not None:
            self.drafter.extend(emitted)
        self.history.extend(emitted)
        stats = self.stats
        stats.t_draft += time.perf_counter() - t0
        stats.steps += 1
        stats.n_forward += 1
        stats.n_proposed += len(proposal)
        stats.n_tokens += len(emitted)
        stats.t_total = self.t_before + time.perf_counter() - self.t_start

    def count_verify(self, k: int, n_accept: int, seconds: float) -> None:
        self.policy.observe_cost(1 + k, seconds)
        self.stats.n_drafted += k
        self.stats.n_accept += n_accept
        self.stats.draft_lengths[k] = self.stats.draft_lengths.get(k, 0) + 1

    def plain_step(self, y: mx.array, seen: list[int]) -> tuple[mx.array, mx.array]:
        """Launch one plain step on ``y`` ([1], possibly not computed yet) that follows ``seen``,
        like ``mlx_lm.generate.generate_step``: the next token and its log-probabilities, lazy."""
        logits = self.model(y.reshape(1, 1), cache=self.cache)[:, -1, :]
        self.n_cached += 1
        if self.logits_processors:
            tokens = mx.concatenate([mx.array(seen, mx.uint32), y.astype(mx.uint32)])
            for processor in self.logits_processors:
                logits = processor(tokens, logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        token = self.sampler(logprobs)
        mx.async_eval(token, logprobs)
        return token, logprobs.squeeze(0)

    def plain_mode(self, proposal: list[int]):
        """Plain mode: whenever the cost-aware policy drafts nothing (and always with ``draft_max=0``),
        one-token steps, each launched on the lazy token of the step before (``mx.async_eval``), as in
        mlx-lm's ``generate_step``, until the policy's ``leave_plain`` says a verify step pays (see
        :mod:`mlx_backend.decode.draft_policy`) or the run ends. A fixed ``draft_max=k > 0`` verifies
        every proposal where it is made, so its steps are not pipelined. A consumer that stops early in
        plain mode leaves the last yielded token in the cache too, as with ``generate_step``."""
        stats, policy = self.stats, self.policy
        stats.enter_plain += 1
        t_last = None
        token, logprobs = self.plain_step(mx.array(self.history[-1:], mx.uint32), self.history[:-1])
        while True:
            # `token` (the n_out + 1-th) is in flight; proposal[0] is the drafter's guess of it
            at_end = 0 <= self.max_tokens <= self.n_out + 1
            leave = at_end or policy.leave_plain(len(proposal), self.match)
            if not leave:
                next_token, next_logprobs = self.plain_step(token, self.history)
            t = token.item()
            # c_p is timed token to token, not for the run's first token (it also pays for what came before)
            # nor its last (launched a whole step before it is waited for, with no next step built in
            # between: measured at 0.1-0.2 of a step, which made verify steps look 5-10x dearer)
            if t_last is not None and not leave:
                policy.observe_cost(0, time.perf_counter() - t_last)
            t_last = time.perf_counter()
            stats.plain_steps += 1
            stats.draft_lengths[0] = stats.draft_lengths.get(0, 0) + 1
            self.learn(proposal, [t])
            self.give()
            yield t, logprobs, False
            if leave:
                if not at_end:
                    stats.leave_plain += 1
                return
            token, logprobs = next_token, next_logprobs
            proposal = self.propose(1 + self.room(self.n_out + 1)) if policy.k_max else []   # draft_max=0: no drafter calls

    def emit(self, proposal: list[int], k: int, emitted: list[int], logprobs: list, n_accept: int, seconds: float):
        """After a verify step of ``seconds`` over ``k`` drafts: learn its tokens, yield them (the first
        ``n_accept`` are drafts), then keep the forward's first ``1 + n_accept`` positions, or ``1 + got`` if
        the consumer stopped after ``got`` of the drafts; the policy learns the step's cost, the keep's too."""
        self.learn(proposal, emitted)
        got = 0
        try:
            for i, (token, lp) in enumerate(zip(emitted, logprobs)):
                self.give()
                got += 1
                yield token, lp, i < n_accept
        finally:
            self.count_verify(k, n_accept, seconds + self.keep(min(1 + n_accept, 1 + got)))

    def finish(self) -> None:
        """At the run's end (exhausted, or closed by its consumer): a cache the caller gave holds the prompt and
        every token the consumer got, as ``mlx_lm.generate.generate_step`` leaves it, so that a next turn
        feeds only its new tokens. The last token is fed if no step had fed it (one more forward, as
        ``generate_step`` runs one for its last token)."""
        n_seen = len(self.prompt) + self.n_out
        if self.callers_cache and self.n_cached == n_seen - 1:
            with mx.stream(self.stream):
                self.model(mx.array([[self.history[n_seen - 1]]], mx.uint32), cache=self.cache)
                mx.async_eval([c.state for c in self.cache])   # as generate_step's: waited for at the next use
            self.n_cached += 1

    def close(self) -> None:
        self.stats.t_total = self.t_before + time.perf_counter() - self.t_start
        self.stats.policy = self.policy.summary()   # at the end: ~0.2 ms a step if done every step (k = 64)
        if self.verifier is not None:
            self.verifier.close()
        if self.learned is not None:
            save_costs(self.learned)


#: prompt_cache[0] -> the generator of the run that last started on that cache (weakly: collected runs drop out)
_RUN_ON_CACHE: "weakref.WeakKeyDictionary[Any, weakref.ref]" = weakref.WeakKeyDictionary()


def _one_open_run_per_cache(steps):
    """A run that starts on a ``prompt_cache`` first closes the run still open on it, if any: one kept in a
    variable and left by a ``break`` stays open until collected, its cache holding drafts it verified but never
    yielded, and the next turn on that cache would read them (a probe: different tokens from mlx-lm's). Closed,
    that run cuts the cache back to what it yielded (:meth:`_Run.finish`) and yields nothing more."""
    @functools.wraps(steps)
    def start(*args, **kwargs):
        gen = steps(*args, **kwargs)
        cache = kwargs.get("prompt_cache")
        try:
            key = cache[0] if cache else None
            before = _RUN_ON_CACHE.get(key) if key is not None else None
            if key is not None:
                _RUN_ON_CACHE[key] = weakref.ref(gen)
        except TypeError:   # a cache entry that takes no weak reference: nothing to track
            return gen
        stale = before() if before is not None else None
        if stale is not None:
            stale.close()
        return gen
    return start


@_one_open_run_per_cache
def ngram_speculative_generate_step(
    prompt: mx.array,
    model: nn.Module,
    *,
    max_tokens: int = 256,
    sampler: Optional[Callable[[mx.array], mx.array]] = None,
    logits_processors: Optional[list[Callable]] = None,
    max_kv_size: Optional[int] = None,
    prompt_cache: Optional[list[Any]] = None,
    prefill_step_size: int = 2048,   # mlx-lm generate_step's: prompt chunks matter once a window wraps
    prompt_progress_callback: Optional[Callable[[int, int], None]] = None,
    stream=generation_stream, num_draft_tokens: Optional[int] = None, input_embeddings: Optional[mx.array] = None,
    kv_bits: Optional[int] = None, kv_group_size: int = 64, quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START,
    draft_max: Optional[int] = None, drafter: Union[Drafter, str, None] = None,
    c_st=None, c_dyn=None, history=None,   # the caches of a drafter given by name (run_drafter)
    stats: Optional[SpecStats] = None, draft_policy: Optional[DraftPolicy] = None, gdn_path: Optional[str] = None,
) -> Generator[tuple[int, mx.array, bool], None, None]:
    """Yield ``(token, logprobs, from_draft)`` like ``mlx_lm.generate.speculative_generate_step``.

    ``draft_max``: drafts per step (``0``: plain decoding, any model; ``None``: the cost-aware policy of
    :mod:`mlx_backend.decode.draft_policy`). ``drafter``: a Drafter, or a name (lookup, suffix, auto:
    :func:`run_drafter` over ``c_st`` / ``c_dyn`` / ``history``, an unread one refused). A ``prompt_cache`` given
    holds the prompt and every token yielded when the generator ends (exhausted, or closed by its consumer), as after
    ``generate_step`` (:meth:`_Run.finish`); else the run makes one (rotating with ``max_kv_size`` >= 1). mlx-lm's
    other keywords: every forward runs on ``stream``; the rest as :func:`mlx_lm_draft_max`. ``gdn_path`` forces a
    rollback path. A prompt id outside the vocabulary is a ``ValueError`` at the first ``next``; drafts are cut before
    any such id. Drafting and counting follow :mod:`reference.speculative` (:class:`_Run`).
    """
    draft_max = mlx_lm_draft_max(draft_max, num_draft_tokens, kv_bits, input_embeddings)
    run = _Run(prompt, model, max_tokens=max_tokens, sampler=sampler, logits_processors=logits_processors,
               prompt_cache=prompt_cache, max_kv_size=max_kv_size, prefill_step_size=prefill_step_size,
               prompt_progress_callback=prompt_progress_callback, draft_max=draft_max, drafter=drafter, c_st=c_st,
               c_dyn=c_dyn, suffix_history=history, stats=stats, draft_policy=draft_policy, gdn_path=gdn_path,
               stream=stream)
    try:
        with mx.stream(stream):
            run.prefill()
            while run.more():   # the cache holds every token before run.history[-1]
                proposal = run.propose(run.room(run.n_out))   # draft: up to room() tokens after the history
                k = run.policy.choose(len(proposal), run.match)
                if k == 0 and run.policy.pipelined:
                    yield from run.plain_mode(proposal)
                    continue
                drafts, t_step = proposal[:k], time.perf_counter()
                # verify: one forward over [last, d1..dk] scores the token after each of its k + 1 prefixes
                logits = run.verifier.forward(run.history[-1:] + drafts)
                # accept: the drafts up to the first one the model would not have produced (greedy: not its
                # argmax; sampling: rejected by the speculative-sampling test), n_accept of them; then the
                # bonus token, the model's own token after the accepted prefix: 1 + n_accept tokens a forward
                emitted, logprobs, n_accept = verify_drafts(logits, drafts, sampler, logits_processors, run.history)
                # keep(m): cut the cache back to [last, d1..d_n_accept], m = 1 + n_accept positions (exact: KV
                # entries trimmed, GatedDeltaNet / conv states taken at position m, no second forward), once
                # the consumer has the tokens: to the drafts it got if it stopped before the last (emit)
                yield from run.emit(proposal, k, emitted, logprobs, n_accept, time.perf_counter() - t_step)
            run.finish()
    except GeneratorExit:   # the consumer stopped (stream_generate at an EOS, a break): the run's end too
        run.finish()
        raise
    finally:
        run.close()


def generate(model: nn.Module, tokenizer, prompt, verbose: bool = False, **kwargs) -> Optional[str]:
    """``mlx_lm.generate`` with n-gram speculative decoding: the whole response's text. ``kwargs`` go to
    :func:`stream_generate`. With ``verbose``, mlx-lm's printout (the text as it comes, then the prompt and
    generation token rates and the peak memory; nothing returned when no text came, as mlx-lm) and one line of
    the drafts: accepted of drafted, tokens per forward pass (from ``stats``, a :class:`SpecStats` made here
    unless given)."""
    stats = kwargs.setdefault("stats", SpecStats()) if verbose else None
    if verbose:
        print("=" * 10)
    text, response = "", None
    for response in stream_generate(model, tokenizer, prompt, **kwargs):
        if verbose:
            print(response.text, end="", flush=True)
        text += response.text
    if verbose:
        print()
        print("=" * 10)
        if len(text) == 0:
            print("No text generated for this prompt")
            return None
        print(f"Prompt: {response.prompt_tokens} tokens, {response.prompt_tps:.3f} tokens-per-sec")
        print(f"Generation: {response.generation_tokens} tokens, {response.generation_tps:.3f} tokens-per-sec")
        print(f"Drafts: {stats.n_accept} of {stats.n_drafted} accepted, {stats.tokens_per_forward:.2f} tokens per "
              f"forward pass")
        print(f"Peak memory: {response.peak_memory:.3f} GB")
    return text


def stream_generate(model: nn.Module, tokenizer, prompt, max_tokens: int = 256, draft_model: Optional[nn.Module] = None,
                    stream=generation_stream, **kwargs) -> Generator[GenerationResponse, None, None]:
    """``mlx_lm.stream_generate`` with n-gram speculative decoding; yields ``GenerationResponse``.

    mlx-lm's signature, positions included (a draft model passed fifth is refused, not read as another
    argument). ``kwargs`` go to :func:`ngram_speculative_generate_step` (``draft_max``, ``sampler``, ``stats``,
    ``max_kv_size``, ``prompt_progress_callback``, ...): every forward runs on ``stream``, ``num_draft_tokens`` is
    taken as ``draft_max``, and ``kv_bits`` or ``input_embeddings`` is a ``ValueError`` (:func:`mlx_lm_draft_max`),
    as is a ``draft_model``: the drafts come from the text. A ``tokenizer`` that is none (no ``encode`` /
    ``decode``) or a ``prompt`` that is neither text nor token ids is a ``TypeError``. Stops at the tokenizer's EOS
    tokens like mlx-lm (the EOS token is not yielded as text).
    """
    if max_tokens == 0:
        raise ValueError("max_tokens must be non-zero (use -1 for no limit)")
    if draft_model is not None:
        raise ValueError("draft_model (by name, or the fifth argument as in mlx-lm): ngram-spec drafts from the text "
                         "itself, not from a draft model; drop it (draft_max sets the draft length; max_kv_size and "
                         "the rest go by name)")
    if not isinstance(tokenizer, TokenizerWrapper):
        if not (hasattr(tokenizer, "encode") and hasattr(tokenizer, "decode")):
            raise TypeError(f"tokenizer must be mlx-lm's TokenizerWrapper or a Hugging Face tokenizer (the second "
                            f"value of mlx_backend.load or mlx_lm.load), got {type(tokenizer).__name__}")
        tokenizer = TokenizerWrapper(tokenizer)
    if isinstance(prompt, (bytes, bytearray)) or not isinstance(prompt, (str, mx.array, Iterable)):
        raise TypeError(f"the prompt must be text, an mx.array or a sequence of integer token ids, got "
                        f"{type(prompt).__name__}")
    if not isinstance(prompt, mx.array):
        if isinstance(prompt, str):
            add_special = tokenizer.bos_token is None or not prompt.startswith(tokenizer.bos_token)
            prompt = tokenizer.encode(prompt, add_special_tokens=add_special)
        prompt = mx.array(prompt)
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    steps = ngram_speculative_generate_step(prompt, model, max_tokens=max_tokens, stream=stream, **kwargs)
    n, token, logprobs, from_draft = 0, None, None, False
    # as mlx_lm.stream_generate: on Metal the weights are wired (the device's recommended working set) while it
    # runs, so a large model is not paged out between steps; a no-op on the CPU. The steps are closed on leaving,
    # a consumer's close included, not when collected: a cache the caller gave holds its tokens once this returns
    with wired_limit(model, [stream]), contextlib.closing(steps):
        tic = time.perf_counter()
        prompt_tps = 0.0
        for n, (token, logprobs, from_draft) in enumerate(steps):
            if n == 0:
                prompt_tps = prompt.size / (time.perf_counter() - tic)
                tic = time.perf_counter()
            if token in tokenizer.eos_token_ids:
                break
            detokenizer.add_token(token)
            if n + 1 == max_tokens:
                break
            yield GenerationResponse(text=detokenizer.last_segment, token=token, logprobs=logprobs,
                                     from_draft=from_draft, prompt_tokens=prompt.size,
                                     prompt_tps=prompt_tps, generation_tokens=n + 1,
                                     generation_tps=(n + 1) / (time.perf_counter() - tic),
                                     peak_memory=mx.get_peak_memory() / 1e9, finish_reason=None)
    detokenizer.finalize()
    yield GenerationResponse(text=detokenizer.last_segment, token=token, logprobs=logprobs,
                             from_draft=from_draft, prompt_tokens=prompt.size, prompt_tps=prompt_tps,
                             generation_tokens=n + 1,
                             generation_tps=(n + 1) / max(time.perf_counter() - tic, 1e-9),
                             peak_memory=mx.get_peak_memory() / 1e9,
                             finish_reason="stop" if token in tokenizer.eos_token_ids else "length")
