"""Greedy decoding, plain and speculative with n-gram drafts: the model-agnostic loop.

``model`` is anything with ``make_cache()`` and ``forward(tokens, cache) -> logits [S, vocab]`` whose
cache has ``keep(m)`` (:mod:`reference.models`); ``drafter`` anything with ``reset(prompt)``,
``extend(tokens)`` and ``draft(n) -> list[int]`` (:class:`reference.drafter.NgramDrafter`).

One speculative step, with ``last`` the newest token (emitted, not yet fed to the model)::

    d_1..d_k  = drafter.draft(min(draft_max, tokens still wanted))       k may be 0
    logits    = model.forward([last, d_1..d_k])                          one forward, S = k + 1
    p_i       = argmax logits[i]                 p_i is greedy's token after [.., last, d_1..d_i]
    n         = largest n with d_1..d_n == p_0..p_{n-1}                  accepted drafts
    emit        d_1..d_n, then the bonus token p_n                       n + 1 tokens
    cache.keep(1 + n)                            the state after last, d_1..d_n; p_n becomes last

Every emitted token is the greedy token for its prefix, so the output equals :func:`greedy_generate`
token for token (exactly, for the NumPy reference, whose forward is batch-invariant). Emission stops
at an EOS token or at ``max_tokens``, also in the middle of an accepted run.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np


@dataclass
class SpecStats:
    """Counts of one generation.

    ``n_forward``: model forward passes, the prompt's included; ``steps``: decode steps after the prompt
    (``n_forward - 1``); ``n_drafted``: draft tokens sent to verification; ``n_accept``: drafted tokens
    accepted and emitted; ``tokens_per_forward``: generated tokens / ``n_forward`` (plain greedy: 1.0).
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


def _check(prompt: Sequence[int], max_tokens: int) -> list[int]:
    prompt = [int(t) for t in prompt]
    if not prompt:
        raise ValueError("the prompt is empty: generation needs at least one prompt token")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    return prompt


OnTokens = Callable[[list[int]], None]


def greedy_generate(model, prompt: Sequence[int], max_tokens: int, eos: Iterable[int] = (),
                    on_tokens: OnTokens | None = None) -> list[int]:
    """Plain greedy decoding: up to ``max_tokens`` tokens after ``prompt``, one forward each, stopping after EOS.

    ``on_tokens(new_tokens)`` (optional) is called as tokens are emitted, e.g. to advance a progress bar.
    """
    prompt, eos = _check(prompt, max_tokens), set(eos)
    cache = model.make_cache()
    token = int(np.argmax(model.forward(prompt, cache)[-1]))
    tokens = [token]
    while True:
        if on_tokens:
            on_tokens([token])
        if token in eos or len(tokens) >= max_tokens:
            return tokens
        token = int(np.argmax(model.forward([token], cache)[-1]))
        tokens.append(token)


def speculative_generate(model, prompt: Sequence[int], max_tokens: int, drafter, draft_max: int,
                         eos: Iterable[int] = (), on_tokens: OnTokens | None = None) -> tuple[list[int], SpecStats]:
    """Greedy decoding verified from drafts; returns the same tokens as :func:`greedy_generate` and the counts.

    ``on_tokens(new_tokens)`` (optional) is called with the tokens of each step as they are emitted.
    """
    prompt, eos = _check(prompt, max_tokens), set(eos)
    if draft_max < 0:
        raise ValueError(f"draft_max must be >= 0, got {draft_max}")
    stats = SpecStats()
    cache = model.make_cache()
    drafter.reset(prompt)

    last = int(np.argmax(model.forward(prompt, cache)[-1]))
    stats.n_forward = 1
    tokens = [last]
    drafter.extend([last])
    if on_tokens:
        on_tokens([last])
    done = last in eos or len(tokens) >= max_tokens
    while not done:
        n_draft = min(draft_max, max_tokens - len(tokens))  # no drafts beyond the tokens still wanted
        drafts = [int(t) for t in drafter.draft(n_draft)][:n_draft] if n_draft else []  # draft_max 0: plain
        logits = model.forward([last, *drafts], cache)
        stats.n_forward += 1
        stats.n_drafted += len(drafts)
        predicted = [int(t) for t in np.argmax(logits, axis=-1)]
        n = 0
        while n < len(drafts) and drafts[n] == predicted[n]:
            n += 1
        cache.keep(1 + n)

        emitted = []
        for i, token in enumerate([*drafts[:n], predicted[n]]):
            emitted.append(token)
            if i < n:
                stats.n_accept += 1
            if token in eos or len(tokens) + len(emitted) >= max_tokens:
                done = True
                break
        tokens.extend(emitted)
        drafter.extend(emitted)
        if on_tokens:
            on_tokens(emitted)
        last = emitted[-1]

    stats.steps = stats.n_forward - 1
    stats.tokens_per_forward = len(tokens) / stats.n_forward
    return tokens, stats
