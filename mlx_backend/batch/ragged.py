"""Attention layers (``BatchKVCache``) whose rows end at their own column: a batched cut back that moves no keys.

mlx-lm's ``BatchKVCache`` keeps every row's keys right-aligned at one column ``_idx`` (row b's real keys
in ``left_padding[b] .. _idx - 1``). After a verify forward the rows keep different numbers of tokens
(row b ``m[b]`` of the S it ran), so to stay right-aligned every row but the longest would have to be
rolled right by its surplus (``prepare(right_padding=...)``, ``finalize()``): a copy of the whole cache,
every layer, every verify step. Measured on SmolLM2-135M (4 rows of ~1,000 cached tokens, float32, one
CPU core) that copy cost 120-155 ms, more than a whole one-token step of the batch (~110 ms).

:class:`_RaggedKV` (given to the verifier's attention caches with :func:`mlx_backend.decode.rollback.attach`)
lets row b end at its own column ``ends[b]`` instead (``_ngram_ends``; None while all rows end at ``_idx``,
mlx-lm's own layout, which every method then keeps exactly):

* the cut back is bookkeeping: ``ends[b]`` and ``offset[b]`` (the RoPE position of the row's next token)
  go back by row b's surplus (:meth:`_RaggedKV.trim_rows`);
* a forward of N tokens writes row b's keys and values at ``ends[b] .. ends[b] + N - 1``
  (:meth:`_RaggedKV.update_and_fetch`) and returns columns ``0 .. max(ends) + N - 1``;
* the mask (:meth:`_RaggedKV.make_mask`) lets query i of row b see column j iff
  ``left_padding[b] <= j <= ends[b] + i`` (and ``j > ends[b] + i - window_size`` with a window): exactly
  the row's real keys up to itself, as in mlx-lm's layout; the columns after a row's end (its rejected
  drafts, other rows' tokens) are masked like left padding.

Before mlx-lm's own operations that assume right alignment (``extend``: a request joins) the rows are
aligned once with mlx-lm's roll (:meth:`_RaggedKV.align`); ``filter`` and ``extract`` read the ends
directly. A request joining or leaving is rare next to verify steps, so the copy is paid per request,
not per step.
"""
from __future__ import annotations

from typing import Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache


class _RaggedKV(BatchKVCache):
    """A ``BatchKVCache`` whose rows may end at different columns (module docstring)."""

    _ngram_ends: Optional[list[int]] = None   # per-row end column; None: every row ends at _idx

    def _set_ends(self, ends: list[int]) -> None:
        self._idx = max(ends)
        self._ngram_ends = None if all(e == ends[0] for e in ends) else ends

    def trim_rows(self, surplus: Sequence[int]) -> None:
        """Drop the last ``surplus[b]`` keys of row b (its rejected tokens): ends and offsets go back."""
        surplus = [int(s) for s in surplus]
        ends = self._ngram_ends or [self._idx] * len(surplus)
        self.offset = self.offset - mx.array(surplus)
        self._set_ends([e - s for e, s in zip(ends, surplus)])

    def trim(self, n):
        if self._ngram_ends is None:
            return super().trim(n)
        n = min(n, min(self._ngram_ends))
        self.trim_rows([n] * len(self._ngram_ends))
        return n

    def update_and_fetch(self, keys, values):
        ends = self._ngram_ends
        if ends is None:
            return super().update_and_fetch(keys, values)
        B, H, N, Dk = keys.shape
        top = max(ends) + N
        if top > self.keys.shape[2]:   # grow as mlx-lm does: zeros in whole steps
            n_steps = (top - self.keys.shape[2] + self.step - 1) // self.step
            self.keys = mx.concatenate([self.keys, mx.zeros((B, H, n_steps * self.step, Dk), keys.dtype)], axis=2)
            self.values = mx.concatenate(
                [self.values, mx.zeros((B, H, n_steps * self.step, values.shape[3]), values.dtype)], axis=2)
        for b, e in enumerate(ends):
            self.keys[b:b + 1, :, e:e + N, :] = keys[b:b + 1]
            self.values[b:b + 1, :, e:e + N, :] = values[b:b + 1]
        self.offset = self.offset + N
        self._set_ends([e + N for e in ends])
        return self.keys[..., :top, :], self.values[..., :top, :]

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None, **kwargs):
        ends = self._ngram_ends
        if ends is None:
            return super().make_mask(N, return_array=return_array, window_size=window_size, **kwargs)
        cols = mx.arange(max(ends) + N)[None, None, None, :]
        last = mx.array(ends)[:, None, None, None] + mx.arange(N)[None, None, :, None]   # query i's own column
        mask = (cols >= self.left_padding[:, None, None, None]) & (cols <= last)
        if window_size is not None:
            mask = mask & (cols > last - window_size)
        return mask

    def align(self) -> None:
        """Right-align every row at ``max(ends)`` (mlx-lm's layout), rolling the shorter rows right by
        their difference: mlx-lm's own ``prepare(right_padding=...)`` and ``finalize()``, which also count
        that difference out of ``offset``; the offsets here are already right, so they are kept."""
        ends = self._ngram_ends
        if ends is None:
            return
        offset = self.offset
        self.prepare(right_padding=[self._idx - e for e in ends])
        self.finalize()
        self.offset, self._ngram_ends = offset, None

    def extend(self, other):
        self.align()
        super().extend(other)

    def filter(self, batch_indices):
        ends, before = self._ngram_ends, self._idx
        super().filter(batch_indices)   # may shift every row left by the padding all of them share
        if ends is not None:
            kept = batch_indices.tolist() if isinstance(batch_indices, mx.array) else list(batch_indices)
            if kept:
                self._set_ends([ends[int(i)] - (before - self._idx) for i in kept])

    def extract(self, idx):
        ends = self._ngram_ends
        if ends is None:
            return super().extract(idx)
        cache = KVCache()
        start = int(self.left_padding[idx].item())
        cache.keys = mx.contiguous(self.keys[idx:idx + 1, :, start:ends[idx]])
        cache.values = mx.contiguous(self.values[idx:idx + 1, :, start:ends[idx]])
        cache.offset = cache.keys.shape[2]
        return cache
