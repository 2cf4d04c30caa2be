"""Greedy decoding, plain and speculative with n-gram drafts: the model-agnostic loop.

``model`` is anything with ``make_cache()`` and ``forward(tokens, cache) -> logits [S, vocab]`` whose
cache has ``keep(m)`` (:mod:`reference.models`); ``drafter`` anything with ``reset(prompt)``,
``extend(tokens)`` and ``draft(n) -> list[int]`` (:class:`reference.ngram.drafter.NgramDrafter`).

The prompt but its last token is run first (one prefill forward; none for a one-token prompt), then
every step runs ``[last, d_1..d_k]`` with ``last`` the newest token (the prompt's last token at the first
step; emitted, not yet fed to the model), like llama.cpp's lookup (lookup.cpp decodes ``inp[0..n-2]``,
then ``inp[n-1]``) and mlx-lm's ``generate_step``::

    k         = 0 at the first step (the prompt's token, as llama.cpp's lookup), else
                min(draft_max, max_tokens - emitted - 1)                 drafts and the model's own token fit
    d_1..d_k  = drafter.draft(k), cut before any id outside the vocabulary     k may be 0
    logits    = model.forward([last, d_1..d_k])                          one forward, S = k + 1
    p_i       = argmax logits[i]                 p_i is greedy's token after [.., last, d_1..d_i]
    n         = largest n with d_1..d_n == p_0..p_{n-1}                  accepted drafts
    step        d_1..d_n, then the model's own token p_n                 n + 1 tokens
    cache.keep(1 + n)                            the state after last, d_1..d_n; p_n becomes last

A step is counted and learned whole (``n_drafted += k``, ``n_accept += n``, ``drafter.extend(step)``),
as llama.cpp's lookup does even past an EOS inside an accepted run; emission stops at the first EOS
token, and ``max_tokens`` never cuts a step (k leaves room for it; llama.cpp drafts ``n_draft`` to the
end and overshoots ``-n``). Every emitted token is the greedy
token for its prefix, so the output equals :func:`greedy_generate` token for token (exactly, for the
NumPy reference, whose forward is batch-invariant). The MLX backend
(:func:`mlx_backend.decode.generate.ngram_speculative_generate_step`) follows the same rule, so both give the
same tokens and the same counts (``tests/mlx_backend/decode/test_mlx_generate_reference.py``, and the
conformance suite's ``greedy`` area for both backends).
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np

from reference.ngram.tokens import is_whole

REFERENCE_DRAFT_MAX = 16  # the reference's fixed draft length: llama.cpp's --draft-max default
#: The largest fixed draft length a generation takes (``generate --draft-max``, ``serve --draft-max``, the mlx
#: backend's ``draft_max``): a verify forward over 1 + k tokens holds (1 + k) x vocabulary float32 logits and k
#: positions of every layer's state (at 1024 and a 152 k vocabulary, 620 MB of logits alone); past it memory,
#: not speed, decides (draft_max = 10^5 ran a 24 GB machine out of memory, 10^9 asked for a 3.7 GiB draft
#: buffer), and no drafter's draft has been worth more than 64 (docs/suffix.md).
DRAFT_MAX_LIMIT = 1024


@dataclass
class SpecStats:
    """Counts of one generation.

    ``steps``: forward passes that emit tokens (the first token's included); ``n_forward``: all forward
    passes, the prompt's prefill included; ``n_drafted``: draft tokens sent to verification;
    ``n_accept``: drafted tokens the verification accepted; ``tokens_per_forward``: generated tokens /
    ``steps`` (plain greedy: 1.0).
    """

    steps: int = 0
    n_forward: int = 0
    n_drafted: int = 0
    n_accept: int = 0
    tokens_per_forward: float = 0.0

    @property
    def accept(self) -> float:
        """Accepted / drafted, in percent (llama.cpp's ``accept``); 0 when nothing was drafted."""
        return 100.0 * self.n_accept / self.n_drafted if self.n_drafted else 0.0


def _check(prompt: Sequence[int], max_tokens: int, eos: Iterable[int]) -> tuple[list[int], set[int]]:
    """The arguments both loops share, checked: ``prompt`` a non-empty sequence of integer token ids (a float
    is refused, not truncated), ``max_tokens`` a whole number >= 1, ``eos`` a collection of token ids."""
    prompt = list(prompt)
    if not prompt:
        raise ValueError("the prompt is empty: generation needs at least one prompt token")
    bad = next((i for i, t in enumerate(prompt) if not isinstance(t, numbers.Integral)), None)
    if bad is not None:
        raise ValueError(f"the prompt must be token ids (integers): item {bad} is {prompt[bad]!r}; "
                         "tokenize text first")
    if not is_whole(max_tokens) or max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1 (a whole number), got {max_tokens!r}")
    if isinstance(eos, numbers.Integral):
        raise ValueError(f"eos must be a collection of token ids, e.g. eos=[{eos}], not one id")
    return [int(t) for t in prompt], {int(t) for t in eos}


def _prefill(model, prompt: list[int], cache) -> int:
    """Run every prompt token but the last (the first step's input); returns the forwards run (0 or 1)."""
    if len(prompt) == 1:
        return 0
    model.forward(prompt[:-1], cache)
    return 1


def in_vocab(drafts: list[int], vocab_size: int | None) -> list[int]:
    """``drafts`` up to the first id outside ``0..vocab_size - 1``: the model never emits such an id,
    so no draft from there on can be accepted (a cache from another vocabulary drafts them)."""
    for i, t in enumerate(drafts):
        if t < 0 or (vocab_size is not None and t >= vocab_size):
            return drafts[:i]
    return drafts


OnTokens = Callable[[list[int]], None]


def greedy_generate(model, prompt: Sequence[int], max_tokens: int, eos: Iterable[int] = (),
                    on_tokens: OnTokens | None = None) -> list[int]:
    """Plain greedy decoding: up to ``max_tokens`` tokens after ``prompt``, one forward each, stopping after EOS.

    ``on_tokens(new_tokens)`` (optional) is called as tokens are emitted, e.g. to advance a progress bar.
    """
    prompt, eos = _check(prompt, max_tokens, eos)
    cache = model.make_cache()
    _prefill(model, prompt, cache)
    tokens, last = [], prompt[-1]
    while not tokens or (tokens[-1] not in eos and len(tokens) < max_tokens):
        last = int(np.argmax(model.forward([last], cache)[-1]))
        tokens.append(last)
        if on_tokens:
            on_tokens([last])
    return tokens


def speculative_generate(model, prompt: Sequence[int], max_tokens: int, drafter, draft_max: int,
                         eos: Iterable[int] = (), on_tokens: OnTokens | None = None) -> tuple[list[int], SpecStats]:
    """Greedy decoding verified from drafts; returns the same tokens as :func:`greedy_generate` and the counts.

    ``on_tokens(new_tokens)`` (optional) is called with the tokens of each step as they are emitted.
    """
    prompt, eos = _check(prompt, max_tokens, eos)
    if not is_whole(draft_max) or draft_max < 0:
        raise ValueError(f"draft_max must be a whole number >= 0 (the reference has no cost-aware choice), "
                         f"got {draft_max!r}")
    stats = SpecStats()
    cache = model.make_cache()
    drafter.reset(prompt)
    stats.n_forward = _prefill(model, prompt, cache)
    tokens, last = [], prompt[-1]
    while not tokens or (tokens[-1] not in eos and len(tokens) < max_tokens):
        k = min(draft_max, max_tokens - len(tokens) - 1) if tokens else 0
        drafts = in_vocab([int(t) for t in drafter.draft(k)][:k], getattr(model, "vocab_size", None)) if k else []
        predicted = [int(t) for t in np.argmax(model.forward([last, *drafts], cache), axis=-1)]
        n = 0
        while n < len(drafts) and drafts[n] == predicted[n]:
            n += 1
        cache.keep(1 + n)
        step = [*drafts[:n], predicted[n]]
        stats.steps += 1
        stats.n_drafted += len(drafts)
        stats.n_accept += n
        drafter.extend(step)
        emitted = step[:next((i + 1 for i, t in enumerate(step) if t in eos), len(step))]
        tokens.extend(emitted)
        if on_tokens:
            on_tokens(emitted)
        last = step[-1]

    stats.n_forward += stats.steps
    stats.tokens_per_forward = len(tokens) / stats.steps
    return tokens, stats
