"""n-gram self-speculative generation for mlx-lm models, in mlx-lm's generator shape.

:func:`ngram_speculative_generate_step` is a drop-in for ``mlx_lm.generate.speculative_generate_step``
without a draft model: drafts come from an n-gram drafter (llama.cpp's lookup: context, dynamic
and static caches), one forward verifies ``[last, d1..dk]``, and the prompt cache is cut back to
the accepted prefix exactly (:mod:`mlx_backend.rollback`), hybrid GatedDeltaNet models included.
Where drafting does not pay, it decodes plainly, pipelined like ``mlx_lm.generate.generate_step``.
:func:`stream_generate` is ``mlx_lm.stream_generate`` on top of it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import GenerationResponse, generation_stream
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.tokenizer_utils import TokenizerWrapper

from mlx_backend.draft_policy import DEFAULT_K_MAX, DraftPolicy, FixedDraftLength, learned_costs, save_costs
from mlx_backend.rollback import VerifyCache
from mlx_backend.sampling import greedy, verify_drafts
from reference.speculative import in_vocab


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


def ngram_api():
    """The n-gram module used by default: ``mlx_backend.api`` (array-based) if present, else ``reference.api``."""
    try:
        import mlx_backend.api as api
    except ImportError:
        import reference.api as api
    return api


def default_drafter(c_st=None, c_dyn=None):
    """A drafter over ``c_st`` / ``c_dyn`` (caches or cache file paths) from :func:`ngram_api`."""
    return ngram_api().NgramDrafter(c_st=c_st, c_dyn=c_dyn)


def vocab_size(model: nn.Module) -> Optional[int]:
    """The token ids ``model`` takes: the rows of its ``embed_tokens`` (else ``model.args.vocab_size``,
    else None). An id outside them reads past the embedding: garbage, or a crash."""
    for name, module in model.named_modules():
        if isinstance(module, (nn.Embedding, nn.QuantizedEmbedding)) and name.endswith("embed_tokens"):
            return int(module.weight.shape[0])
    return getattr(getattr(model, "args", None), "vocab_size", None)


def check_prompt(prompt_ids: list[int], model: nn.Module) -> None:
    """Refuse an empty prompt or a token id outside the model's vocabulary (ValueError naming both)."""
    if not prompt_ids:
        raise ValueError("the prompt must hold at least one token")
    n_vocab = vocab_size(model)
    for i, t in enumerate(prompt_ids):
        if t < 0 or (n_vocab is not None and t >= n_vocab):
            raise ValueError(f"prompt token id {t} (position {i}) is outside the model's vocabulary of "
                             f"{n_vocab} tokens (ids 0..{n_vocab - 1}): was the prompt made with another tokenizer?")


def ngram_speculative_generate_step(
    prompt: mx.array,
    model: nn.Module,
    *,
    max_tokens: int = 256,
    sampler: Optional[Callable[[mx.array], mx.array]] = None,
    logits_processors: Optional[list[Callable]] = None,
    prompt_cache: Optional[list[Any]] = None,
    prefill_step_size: int = 2048,   # mlx-lm generate_step's: prompt chunks matter once a window wraps
    draft_max: Optional[int] = None,
    drafter=None,
    c_st=None,
    c_dyn=None,
    stats: Optional[SpecStats] = None,
    draft_policy: Optional[DraftPolicy] = None,
    gdn_path: Optional[str] = None,
) -> Generator[tuple[int, mx.array, bool], None, None]:
    """Yield ``(token, logprobs, from_draft)`` like ``mlx_lm.generate.speculative_generate_step``.

    ``draft_max``: drafts per step (``0``: plain decoding, any model; ``None``: the cost-aware
    policy of :mod:`mlx_backend.draft_policy`, up to ``DEFAULT_K_MAX``). ``drafter``: an object
    with ``reset(prompt)``, ``extend(tokens)``, ``draft(n) -> list[int]``; by default
    :func:`default_drafter` over ``c_st`` / ``c_dyn`` (caches or cache file paths).
    ``prompt_cache`` is updated in place; once the generator is exhausted it holds every token
    but the last. ``gdn_path`` forces a rollback path (see :mod:`mlx_backend.rollback`).
    A prompt token id outside the model's vocabulary is a ``ValueError`` (raised at the first
    ``next``); drafts are cut before any such id.

    Drafting and counting follow :mod:`reference.speculative`: the first token (the prompt's last
    token's step) is not drafted for, later steps draft at most ``max_tokens - emitted - 1``, and a
    verify step counts (``stats``) and teaches the drafter all its tokens, even past an EOS the
    consumer stops at; so both backends give the same tokens, ``n_drafted`` and ``n_accept``.

    Whenever the cost-aware policy drafts nothing (and always with ``draft_max=0``) the generator
    runs in *plain mode*: one-token steps, each launched on the lazy token of the step before
    (``mx.async_eval``), as in mlx-lm's ``generate_step``; it leaves plain mode when the policy's
    ``leave_plain`` says a verify step pays (see :mod:`mlx_backend.draft_policy`). A fixed
    ``draft_max=k > 0`` verifies every proposal where it is made, so its steps are not pipelined. A consumer that stops early in plain mode leaves
    the last yielded token in the cache too, as with ``generate_step``.
    """
    prompt_ids = [int(t) for t in (prompt.tolist() if isinstance(prompt, mx.array) else prompt)]
    check_prompt(prompt_ids, model)
    n_vocab = vocab_size(model)
    if draft_max is not None and draft_max < 0:
        raise ValueError(f"draft_max must be >= 0 or None (auto), got {draft_max}")
    if prefill_step_size < 1:
        raise ValueError(f"prefill_step_size must be >= 1, got {prefill_step_size}")
    stats = stats if stats is not None else SpecStats()
    cache = prompt_cache if prompt_cache is not None else make_prompt_cache(model)
    verifier = VerifyCache(model, cache, gdn_path) if draft_max != 0 else None
    if drafter is None and draft_max != 0:
        drafter = default_drafter(c_st, c_dyn)
    learned = None   # the step costs this run learns from its own timed steps, kept for later runs
    if draft_max is not None:
        policy = FixedDraftLength(draft_max)
    elif draft_policy is not None:
        policy = draft_policy
    else:
        learned = learned_costs(model, DEFAULT_K_MAX + 1, gdn_path)
        policy = DraftPolicy(step_costs=learned)
    stats.policy = policy.summary()
    history = list(prompt_ids)     # every token so far; the last one is the next step's input

    def room(n_done: int) -> int:
        """How many drafts a verify step may hold once ``n_done`` tokens have been emitted: none for the
        first token (the prompt's, as llama.cpp's lookup), then as many as fit with the model's own token
        (the rule of :mod:`reference.speculative`)."""
        if n_done == 0:
            return 0
        return policy.k_max if max_tokens < 0 else min(policy.k_max, max_tokens - n_done - 1)

    def propose(n: int) -> list[int]:
        t0 = time.perf_counter()
        proposal = in_vocab([int(t) for t in drafter.draft(n)[:n]], n_vocab) if drafter is not None and n > 0 else []
        stats.t_draft += time.perf_counter() - t0
        return proposal

    def learn(proposal: list[int], emitted: list[int]) -> None:
        t0 = time.perf_counter()
        policy.observe(proposal, emitted)
        if drafter is not None:
            drafter.extend(emitted)
        history.extend(emitted)
        stats.t_draft += time.perf_counter() - t0
        stats.steps += 1
        stats.n_forward += 1
        stats.n_proposed += len(proposal)
        stats.n_tokens += len(emitted)
        stats.policy = policy.summary()

    def plain_step(y: mx.array, seen: list[int]) -> tuple[mx.array, mx.array]:
        """Launch one plain step on ``y`` ([1], possibly not computed yet) that follows ``seen``,
        like ``mlx_lm.generate.generate_step``: the next token and its log-probabilities, lazy."""
        logits = model(y.reshape(1, 1), cache=cache)[:, -1, :]
        if logits_processors:
            tokens = mx.concatenate([mx.array(seen, mx.uint32), y.astype(mx.uint32)])
            for processor in logits_processors:
                logits = processor(tokens, logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        token = (sampler or greedy)(logprobs)
        mx.async_eval(token, logprobs)
        return token, logprobs.squeeze(0)

    t_start = time.perf_counter()
    try:
        with mx.stream(generation_stream):
            for start in range(0, len(prompt_ids) - 1, prefill_step_size):
                chunk = prompt_ids[start:min(start + prefill_step_size, len(prompt_ids) - 1)]
                model(mx.array(chunk, mx.uint32)[None], cache=cache)
                mx.eval([c.state for c in cache])
                stats.n_forward += 1
            if drafter is not None:
                drafter.reset(prompt_ids)
            n_out = 0
            while max_tokens < 0 or n_out < max_tokens:
                # the cache holds every token before history[-1]
                proposal = propose(room(n_out))
                k = policy.choose(len(proposal))
                if k > 0 or not policy.pipelined:   # [last, d1..dk] in one forward, then cut back
                    drafts = proposal[:k]
                    t_step = time.perf_counter()
                    logits = verifier.forward(history[-1:] + drafts)
                    emitted, logprobs, n_accept = verify_drafts(logits, drafts, sampler,
                                                                logits_processors, history)
                    t0 = time.perf_counter()
                    verifier.keep(1 + n_accept)
                    stats.t_rollback += time.perf_counter() - t0
                    policy.observe_cost(1 + k, time.perf_counter() - t_step)
                    stats.n_drafted += k
                    stats.n_accept += n_accept
                    stats.draft_lengths[k] = stats.draft_lengths.get(k, 0) + 1
                    learn(proposal, emitted)
                    stats.t_total = time.perf_counter() - t_start
                    for i, (token, lp) in enumerate(zip(emitted, logprobs)):
                        n_out += 1
                        yield token, lp, i < n_accept
                    continue
                # plain mode: one-token steps, each launched before the previous token is read
                stats.enter_plain += 1
                t_last = None   # c_p is timed token to token; the run's first step also pays for what came before
                token, logprobs = plain_step(mx.array(history[-1:], mx.uint32), history[:-1])
                while True:
                    # `token` (the n_out + 1-th) is in flight; proposal[0] is the drafter's guess of it
                    at_end = 0 <= max_tokens <= n_out + 1
                    leave = at_end or policy.leave_plain(len(proposal))
                    if not leave:
                        next_token, next_logprobs = plain_step(token, history)
                    t = token.item()
                    if t_last is not None:
                        policy.observe_cost(0, time.perf_counter() - t_last)
                    t_last = time.perf_counter()
                    stats.plain_steps += 1
                    stats.draft_lengths[0] = stats.draft_lengths.get(0, 0) + 1
                    learn(proposal, [t])
                    stats.t_total = time.perf_counter() - t_start
                    n_out += 1
                    yield t, logprobs, False
                    if leave:
                        if not at_end:
                            stats.leave_plain += 1
                        break
                    token, logprobs = next_token, next_logprobs
                    proposal = propose(1 + room(n_out + 1)) if policy.k_max else []   # draft_max=0: no drafter calls
    finally:
        stats.t_total = time.perf_counter() - t_start
        if verifier is not None:
            verifier.close()
        if learned is not None:
            save_costs(learned)


def stream_generate(model: nn.Module, tokenizer, prompt, max_tokens: int = 256,
                    max_kv_size: Optional[int] = None, **kwargs) -> Generator[GenerationResponse, None, None]:
    """``mlx_lm.stream_generate`` with n-gram speculative decoding; yields ``GenerationResponse``.

    ``kwargs`` go to :func:`ngram_speculative_generate_step` (``draft_max``, ``sampler``, ``stats``,
    ...). Stops at the tokenizer's EOS tokens like mlx-lm (the EOS token is not yielded as text).
    """
    if max_tokens == 0:
        raise ValueError("max_tokens must be non-zero (use -1 for no limit)")
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    if not isinstance(prompt, mx.array):
        if isinstance(prompt, str):
            add_special = tokenizer.bos_token is None or not prompt.startswith(tokenizer.bos_token)
            prompt = tokenizer.encode(prompt, add_special_tokens=add_special)
        prompt = mx.array(prompt)
    if max_kv_size is not None and kwargs.get("prompt_cache") is None:
        kwargs["prompt_cache"] = make_prompt_cache(model, max_kv_size)
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    steps = ngram_speculative_generate_step(prompt, model, max_tokens=max_tokens, **kwargs)
    tic = time.perf_counter()
    prompt_tps = 0.0
    n, token, logprobs, from_draft = 0, None, None, False
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
    steps.close()
    detokenizer.finalize()
    yield GenerationResponse(text=detokenizer.last_segment, token=token, logprobs=logprobs,
                             from_draft=from_draft, prompt_tokens=prompt.size, prompt_tps=prompt_tps,
                             generation_tokens=n + 1,
                             generation_tps=(n + 1) / max(time.perf_counter() - tic, 1e-9),
                             peak_memory=mx.get_peak_memory() / 1e9,
                             finish_reason="stop" if token in tokenizer.eos_token_ids else "length")
