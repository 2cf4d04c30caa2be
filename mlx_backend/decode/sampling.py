"""Verifying drafted tokens so that the output distribution is exactly plain sampling's.

The n-gram drafter proposes one token ``d`` per position deterministically (a point mass), so
speculative sampling (Leviathan et al. 2023; Chen et al. 2023) reduces to: with ``p`` the model's
distribution at that position,

* accept ``d`` with probability ``p(d)``;
* otherwise emit a token drawn from ``p`` with ``d`` removed and renormalised.

The emitted token is then distributed exactly as ``p``: ``P(d) = p(d)`` and, for ``t != d``,
``P(t) = (1 - p(d)) * p(t) / (1 - p(d)) = p(t)``. :func:`accept_or_resample` implements this
for samplers that expose their distribution (:class:`Sampler`, mlx-lm's ``make_sampler`` with the same
arguments and the same law). For an opaque mlx-lm sampler (``make_sampler`` itself) the equivalent
rule is used: draw ``t`` with the sampler and accept ``d`` iff ``t == d`` (same acceptance
probability ``p(d)``, same residual law). Greedy decoding (``sampler=None``) accepts ``d`` iff it is
the argmax.

>>> s = Sampler(temp=1.0)
>>> p = s.probs(mx.log(mx.array([[0.5, 0.25, 0.25]])))
>>> [round(x, 3) for x in p[0].tolist()]
[0.5, 0.25, 0.25]
>>> accept_or_resample(mx.array([[0.0, 1.0, 0.0]]), 1)   # p(d) = 1: always accepted
(1, True)
>>> accept_or_resample(mx.array([[0.0, 0.0, 1.0]]), 1)   # p(d) = 0: resampled from the rest
(2, False)
"""
from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_sampler

from reference.sampling import check_sampling


def greedy(logprobs: mx.array) -> mx.array:
    """mlx-lm's default sampler: the argmax token."""
    return mx.argmax(logprobs, axis=-1)


@dataclass(frozen=True)
class Sampler:
    """``mlx_lm.sample_utils.make_sampler(temp, top_p, min_p, min_tokens_to_keep, top_k)`` whose
    distribution is available (:meth:`probs`): the same arguments, the same law, the same draws.

    As in mlx-lm, top-p, min-p and top-k cut the model's own distribution (before the temperature),
    in that order, and ``temp == 0`` is greedy. Arguments are checked: ``temp >= 0``,
    ``0 < top_p <= 1`` (1, the default, is off; ``make_sampler`` also reads 0 as off, which is refused
    here as a likely mistake), ``0 <= min_p <= 1``, ``min_tokens_to_keep >= 1``, ``top_k >= 0`` (0: off).
    """

    temp: float = 0.0
    top_p: float = 1.0
    min_p: float = 0.0
    min_tokens_to_keep: int = 1
    top_k: int = 0

    def __post_init__(self):
        check_sampling(self.temp, self.top_p, self.min_p, self.top_k, self.min_tokens_to_keep)
        object.__setattr__(self, "_draw", make_sampler(self.temp, self.top_p, self.min_p, self.min_tokens_to_keep,
                                                       top_k=self.top_k))

    def probs(self, logprobs: mx.array) -> mx.array:
        """The distribution ``make_sampler`` draws from: softmax(cut(logprobs) / temp)."""
        if self.temp == 0:
            return (mx.arange(logprobs.shape[-1]) == greedy(logprobs)[..., None]).astype(mx.float32)
        if 0 < self.top_p < 1:
            logprobs = apply_top_p(logprobs, self.top_p)
        if self.min_p != 0:
            logprobs = apply_min_p(logprobs, self.min_p, self.min_tokens_to_keep)
        if self.top_k > 0:
            logprobs = apply_top_k(logprobs, self.top_k)
        return mx.softmax(logprobs.astype(mx.float32) / self.temp, axis=-1)

    def __call__(self, logprobs: mx.array) -> mx.array:
        return self._draw(logprobs)


def accept_or_resample(p: mx.array, d: int) -> tuple[int, bool]:
    """``(d, True)`` with probability ``p[0, d]``, else ``(t, False)``, t ~ p without d, renormalised."""
    u = mx.random.uniform().item()
    if u < p[0, d].item():
        return d, True
    residual = p.at[0, d].multiply(0.0)
    return int(mx.random.categorical(mx.log(residual), axis=-1).item()), False


def verify_drafts(logits: mx.array, drafts: list[int], sampler=None, logits_processors=None,
                  history: list[int] | None = None) -> tuple[list[int], list[mx.array], int]:
    """Check ``drafts`` against the verify logits ``[k + 1, V]``; returns ``(emitted, logprobs, n_accept)``.

    ``emitted`` is the accepted drafts followed by one token from the model (the correction at the
    first rejection, or the bonus token after all k); ``logprobs[i]`` is the ``[V]`` log-probability
    vector that produced ``emitted[i]``. ``logits_processors`` see ``history`` (prompt and output so
    far) extended by the drafts before each position, as in mlx-lm (row i only matters when the
    drafts before it were accepted, i.e. emitted).

    Greedy and opaque samplers draw all k + 1 rows in one call (one evaluation): rows are
    independent draws and those after the first rejection are discarded, so this is the same law as
    drawing row by row. A :class:`Sampler` goes row by row through :func:`accept_or_resample`.
    """
    k = len(drafts)
    if logits_processors:
        rows = []
        for i in range(k + 1):
            row = logits[i:i + 1]
            seen = mx.array(list(history or []) + drafts[:i])
            for processor in logits_processors:
                row = processor(seen, row)
            rows.append(row)
        logits = mx.concatenate(rows, axis=0)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    if isinstance(sampler, Sampler) and sampler.temp > 0:
        emitted = []
        for i in range(k + 1):
            p = sampler.probs(logprobs[i:i + 1])
            if i == k:
                emitted.append(int(mx.random.categorical(mx.log(p), axis=-1).item()))
                break
            t, accepted = accept_or_resample(p, drafts[i])
            emitted.append(t)
            if not accepted:
                break
        n = len(emitted) - 1
    else:
        tokens = (sampler or greedy)(logprobs).tolist()
        n = 0
        while n < k and tokens[n] == drafts[n]:
            n += 1
        emitted = drafts[:n] + [tokens[n]]
    return emitted, [logprobs[i] for i in range(n + 1)], n


def verify_rows(logits: mx.array, drafts: list[list[int]], samplers: list, logits_processors: list,
                histories: list[list[int]]) -> list[tuple[list[int], list[mx.array], int]]:
    """:func:`verify_drafts` for every row of a batched verify forward (``logits [B, S, V]``; row b holds
    ``1 + len(drafts[b])`` real positions, the rest padding): one ``(emitted, logprobs, n_accept)`` per row,
    each the same as :func:`verify_drafts` on that row alone.

    Rows drawn in one call (greedy, an opaque sampler; no logits processors) are drawn for all rows
    first and evaluated together, so the batch waits for the device once instead of once per row; a
    :class:`Sampler` with ``temp > 0`` (accept-or-resample, row by row) or logits processors go
    through :func:`verify_drafts` itself.
    """
    out: list = [None] * len(drafts)
    lazy = {}
    logprobs = None
    for b, (d, sampler, processors) in enumerate(zip(drafts, samplers, logits_processors)):
        if processors or (isinstance(sampler, Sampler) and sampler.temp > 0):
            out[b] = verify_drafts(logits[b, :len(d) + 1], d, sampler, processors, histories[b])
            continue
        if logprobs is None:
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        lazy[b] = (sampler or greedy)(logprobs[b, :len(d) + 1])
    if lazy:
        mx.eval(list(lazy.values()))
    for b, drawn in lazy.items():
        tokens, d = drawn.tolist(), drafts[b]
        n = 0
        while n < len(d) and tokens[n] == d[n]:
            n += 1
        out[b] = (d[:n] + [tokens[n]], [logprobs[b, i] for i in range(n + 1)], n)
    return out
