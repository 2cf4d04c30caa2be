"""The fast stateful drafter for generation: ``reference.ngram.drafter.NgramDrafter`` on array tables.

Same interface and the same drafts as the reference: ``reset(prompt)``, ``extend(tokens)`` (the
context cache ``c_ctx`` is updated token by token, lookup.cpp:54 and after every emitted token) and
``draft(n_draft)``. The work of each call is one numba kernel call.

>>> d = NgramDrafter()
>>> d.reset([1, 2, 3, 1, 2, 3])
>>> d.draft(4)
[1, 2, 3, 1]
>>> d.extend([7])
>>> d.tokens[-3:].tolist(), d.draft(4)
([2, 3, 7], [])
"""
from __future__ import annotations

import os
from collections.abc import Iterable

import numpy as np

from mlx_backend.ngram.hash_table import NGRAM_MAX, HashTable, update_range, update_then_draft, update_then_draft_no_dyn
from reference.ngram.draft import SCORES
from reference.ngram.drafter import check_static

INT32_MAX = 2**31 - 1


class NgramDrafter:
    """Drafts from ``c_ctx`` (this sequence), ``c_dyn`` (earlier text) and ``c_st`` (a corpus).

    ``c_st``/``c_dyn`` are caches of either backend or cache file paths (either format); they are
    only read (``c_dyn`` is copied into a hash table once, unless ``share_dyn`` and it already is one: then
    the drafter reads that table as its owner changes it, which must not happen during a :meth:`draft`). ``score``: ``"exact"`` or ``"int32"``.
    ``vocab_size``/``fingerprint`` (:func:`mlx_backend.ngram.cache_file.tokenizer_fingerprint`): the
    tokenizer in use; a cache file that records another one is refused.
    :attr:`tokens` is a read-only int32 view of the sequence.
    """

    def __init__(self, c_st=None, c_dyn=None, score: str = "exact", *, vocab_size: int | None = None,
                 fingerprint: bytes | None = None, share_dyn: bool = False):
        from mlx_backend.ngram.caches import as_sorted, as_table
        from mlx_backend.ngram.cache_file import check_tokenizer

        if score not in SCORES:
            raise ValueError(f"score must be one of {SCORES}, got {score!r}")
        self.score = score
        self._int32 = score == "int32"
        self.c_st = None if c_st is None else as_sorted(c_st)
        check_static(self.c_st)
        self._st = as_sorted(self.c_st).static_arrays()
        dyn = c_dyn if c_dyn is None or isinstance(c_dyn, HashTable) else as_sorted(c_dyn)
        for cache, given in ((self.c_st, c_st), (dyn, c_dyn)):  # refuse caches of another tokenizer
            if cache is not None and not isinstance(cache, HashTable):
                where = given if isinstance(given, (str, os.PathLike)) else "<cache>"
                check_tokenizer(cache, where, vocab_size, fingerprint)
        self.c_dyn = None if dyn is None else as_table(dyn, copy=not share_dyn)
        self._ctx = HashTable()
        self._buf = np.zeros(1024, np.int32)
        self._n = 0  # len(tokens)
        self._counted = 0  # positions < _counted are in c_ctx; the rest are counted by the next draft
        self._out = np.zeros(16, np.int32)

    @property
    def tokens(self) -> np.ndarray:
        v = self._buf[: self._n]
        v.flags.writeable = False
        return v

    @property
    def c_ctx(self) -> HashTable:
        """The context cache (every token so far counted)."""
        if self._counted < self._n:
            update_range(self._ctx.T, self._buf, self._counted, self._n)
            self._counted = self._n
        return self._ctx

    def reset(self, prompt) -> None:
        """Start a new sequence: ``tokens = prompt``, ``c_ctx`` = its n-grams of sizes 1..4."""
        self._n = self._counted = 0
        self._ctx.clear()
        self.extend(prompt)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append emitted tokens one by one, updating ``c_ctx`` after each (``nnew = 1``; the counting
        itself happens in the next :meth:`draft` call, in the same kernel call)."""
        if isinstance(tokens, np.ndarray):
            t = tokens.reshape(-1)
            if t.size and t.dtype.kind not in "iu":
                raise ValueError(f"token ids must be integers, got an array of {t.dtype}")
            if t.size and (int(t.min()) < 0 or int(t.max()) > INT32_MAX):
                bad = t[(t < 0) | (t > INT32_MAX)]
                raise ValueError(f"invalid token id {bad.tolist()[0]}; token ids must be in [0, 2**31-1]")
        else:
            t = list(tokens)
            for x in t:
                if not (isinstance(x, (int, np.integer)) and 0 <= x <= INT32_MAX):
                    raise ValueError(f"invalid token id {x!r}; token ids must be in [0, 2**31-1]")
        m = len(t)
        if not m:
            return
        n = self._n
        if n + m > self._buf.size:
            buf = np.zeros(max(2 * self._buf.size, n + m), np.int32)
            buf[:n] = self._buf[:n]
            self._buf = buf
        if m == 1:
            self._buf[n] = t[0]
        else:
            self._buf[n : n + m] = t
        self._n = n + m
        pending = NGRAM_MAX * (self._n - self._counted)
        if not self._ctx.has_room(pending, pending):
            self._ctx.reserve(pending, pending)

    def draft(self, n_draft: int) -> list[int]:
        """Up to ``n_draft`` tokens predicted to follow :attr:`tokens` (``reference.ngram.draft.draft``; none
        for ``n_draft = 0``)."""
        if n_draft < 0:
            raise ValueError(f"n_draft must be >= 0, got {n_draft}")
        if n_draft > self._out.size:
            self._out = np.zeros(n_draft, np.int32)
        if self.c_dyn is None:
            k = update_then_draft_no_dyn(self._buf, self._counted, self._n, self._out, n_draft, self._ctx.T,
                                         self._st, self._int32)
        else:
            k = update_then_draft(self._buf, self._counted, self._n, self._out, n_draft, self._ctx.T,
                                  self.c_dyn.T, self._st, self._int32)
        self._counted = self._n
        return self._out[:k].tolist()
