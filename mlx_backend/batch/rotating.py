"""Sliding-window layers (``BatchRotatingKVCache``) in a batched verify forward, and their exact cut back.

The rule for a query is the solo one-token step's (``RotatingKVCache`` with ``keep=0``, the cache
mlx-lm's ``make_prompt_cache`` gives sliding-window layers): the token at position p sees the tokens
at positions ``p - W < q <= p``, ``W = min(window_size or max_size, max_size)`` (the ring holds the
last ``max_size`` tokens, and ``make_mask(1, window_size)`` narrows that to ``window_size``).

During a verify forward the ring is not written. :meth:`_VerifyingRotating.update_and_fetch` returns
the ring's rows in temporal order (``L`` columns; row b's real tokens in columns
``max(0, left_padding[b]) .. L - 1``, the most recent last, as mlx-lm's ``extract`` reads them)
followed by the S new ones, and :meth:`_VerifyingRotating.make_mask` gives each row the mask of the
rule above (:func:`verify_mask`), so every query sees exactly what its one-token step would.

``keep(m)`` (:func:`keep_rows`) then rebuilds the cache in the state mlx-lm's own
``BatchRotatingKVCache.merge`` builds from per-request caches: row b's last ``min(n_b, max_size)``
real tokens (its old ones, then the first m[b] new ones) right-aligned in ``L'`` columns (the largest
of those counts), ``left_padding = L' - count``, ``offset`` = the row's real length,
``_idx = _offset = L'``, not rotated. mlx-lm's one-token ``BatchRotatingKVCache`` step is never used
by the batched verifier (every step, one token or more, goes through this path); the rebuilt state is
what ``merge`` gives, so ``extend``, ``filter`` and ``extract`` work on it as mlx-lm defines them.
"""
from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import BatchRotatingKVCache


def temporal(c: BatchRotatingKVCache) -> tuple[mx.array, mx.array, int] | None:
    """``(keys, values, L)``: the ring's rows in temporal order (None for an empty cache)."""
    if c.keys is None:
        return None
    if c.rotated:
        return mx.roll(c.keys, -c._idx, axis=2), mx.roll(c.values, -c._idx, axis=2), c.keys.shape[2]
    L = c._idx
    return c.keys[..., :L, :], c.values[..., :L, :], L


def verify_mask(left_padding: mx.array, L: int, S: int, window: int) -> mx.array:
    """``[B, 1, S, L + S]`` bool: query i of row b sees old column j iff ``j >= left_padding[b]`` and
    ``j > L + i - window``, and new column ``L + t`` iff ``i - window < t <= i`` (positions relative
    to the row's own: old column j is ``L - j`` tokens before the first new one)."""
    i = mx.arange(S)[:, None]
    j = mx.arange(L + S)[None]
    t = j - L
    allowed = (t <= i) & (t > i - window)                                # [S, L + S], the same for all rows
    valid = j >= mx.maximum(left_padding, 0)[:, None]                    # [B, L + S]
    valid = valid | (j >= L)
    return (allowed[None] & valid[:, None, :])[:, None]


class _VerifyingRotating:
    """Mixin put in front of a ``BatchRotatingKVCache``'s class, per instance (``rollback.attach``).
    With ``_ngram_verify`` off every call is mlx-lm's."""

    _ngram_verify = False
    _ngram_new = None

    def make_mask(self, N, window_size=None, return_array=False):
        if not self._ngram_verify:
            return super().make_mask(N, window_size=window_size, return_array=return_array)
        window = min(window_size or self.max_size, self.max_size)
        old = temporal(self)
        L = 0 if old is None else old[2]
        return verify_mask(self.left_padding, L, N, window)

    def update_and_fetch(self, keys, values):
        if not self._ngram_verify:
            return super().update_and_fetch(keys, values)
        self._ngram_new = (keys, values)
        return self.keys_and_values()

    def keys_and_values(self):
        """During a verify forward, once the new rows are given: what ``update_and_fetch`` returned (a
        layer sharing this cache reads it so after the owner's update: gemma3n's KV-shared layers)."""
        if not (self._ngram_verify and self._ngram_new is not None):
            return super().keys_and_values()
        keys, values = self._ngram_new
        old = temporal(self)
        if old is None:
            return keys, values
        return mx.concatenate([old[0], keys], axis=2), mx.concatenate([old[1], values], axis=2)


def keep_rows(c: BatchRotatingKVCache, m: list[int]) -> None:
    """Rebuild ``c`` as ``merge`` would leave it after each row's first ``m[b]`` new tokens (module docstring)."""
    keys, values = c._ngram_new
    c._ngram_new = None
    old = temporal(c)
    L = 0 if old is None else old[2]
    if old is not None:
        keys, values = mx.concatenate([old[0], keys], axis=2), mx.concatenate([old[1], values], axis=2)
    pad = [max(0, p) for p in c.left_padding.tolist()] if L else [0] * len(m)
    count = [min(L - p + a, c.max_size) for p, a in zip(pad, m)]
    Lp = max(count)
    # slot s of row b (right-aligned) holds column L + m[b] - Lp + s; slots before Lp - count[b] are padding
    src = mx.array(m)[:, None] + (L - Lp) + mx.arange(Lp)[None]
    src = mx.clip(src, 0, keys.shape[2] - 1)[:, None, :, None]
    B, H, _, D = keys.shape
    c.keys = mx.take_along_axis(keys, mx.broadcast_to(src, (B, H, Lp, 1)), axis=2)
    c.values = mx.take_along_axis(values, mx.broadcast_to(src, (B, H, Lp, 1)), axis=2)
    c.left_padding = mx.array([Lp - n for n in count])
    c.offset = c.offset + mx.array(m)
    c._idx = c._offset = Lp
    c.rotated, c._lengths = False, None
