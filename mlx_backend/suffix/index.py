""""Latest end" indexes of a token corpus and the suffix drafting kernel (numba, CPU).

A corpus is a token array ``S`` (int32; the history's holds ``SEP`` after each sequence) with its prefix
hashes ``P[i] = sum_{j<i} (S[j] + 1) * BASE^(i-1-j)`` (mod 2^64), so that the window ``S[e-m:e]`` hashes in
O(1) as ``P[e] - P[e-m] * BASE^m``. Its index answers, for a ladder length ``m`` and ``m`` tokens ``s``,
the latest end ``e`` with ``S[e-m:e] == s`` and ``S[e]`` a token (the window was followed by one): an
open-addressing table (linear probing) keyed by ``key = mix((window hash & hash_mask) ^ m * GOLDEN)``,
each slot packing ``tag << 32 | e`` (``tag``: the key's high 31 bits; -1: empty). Indexing position ``e``
(``S[e]`` a token) writes ``e`` into the slot of every window ``S[e-m:e]`` that lies inside its sequence
(``m`` in the ladder): the first slot along the key's probe chain that is empty or holds its tag.

Positions are indexed in increasing order, so a slot holds the largest end of every window written
there. A lookup therefore answers exactly, even when two windows share a slot (same probe chain and
tag; with 64-bit keys about once in 2^32 comparisons, or often under a test's tiny ``hash_mask``):

- an empty slot: the window never occurred;
- a slot whose end ``e`` is below ``lo`` (the first live position): no occurrence at or after ``lo``;
- an end whose tokens equal the window: it is the window's latest end;
- otherwise (the slot's latest writer was another window) the corpus is scanned backwards, hash first,
  tokens then: :func:`scan`.

The drafting kernel :func:`draft` applies :mod:`reference.suffix.drafter`'s rule with one lookup per
ladder length in the sequence's index and one in the history's: O(len(LADDER) + max_match + k),
independent of the context length.
"""
from __future__ import annotations

import numpy as np

from mlx_backend.machine.numba_cache import njit

SEP = -1                          # after each history sequence: never a token, so no match crosses it
BASE = np.uint64(0xA0761D6478BD642F)  # the polynomial hash's base (odd)
GOLDEN = np.uint64(0x9E3779B97F4A7C15)
HASH_MASK = -1                    # the window-hash bits a key keeps, as int64 (-1: all; tests shrink it)
MAX_LOAD = 0.7                    # a table doubles before more than this fraction of its slots is used
LO32 = np.int64(0xFFFFFFFF)

# Like mlx_backend.ngram.hash_table's loops, these kernels allocate nothing and are compiled without
# numba's reference counting (the increments and decrements of every array passed dominated small calls).
no_refcount = njit(cache=True, _nrt=False)


def powers(m_max: int) -> np.ndarray:
    """``BASE^m`` mod 2^64 for ``m = 0 .. m_max``."""
    out, p = [], 1
    for _ in range(m_max + 1):
        out.append(p)
        p = p * int(BASE) % (1 << 64)
    return np.array(out, np.uint64)


@njit(inline="always")
def _window(P, POW, e, m):
    """The polynomial hash of ``S[e-m:e]``."""
    return P[e] - P[e - m] * POW[m]


@njit(inline="always")
def _key(w, m, hash_mask):
    """The table key of window hash ``w`` at length ``m`` (murmur3's 64-bit finalizer)."""
    h = (w & np.uint64(hash_mask)) ^ (np.uint64(m) * GOLDEN)
    h ^= h >> np.uint64(33)
    h *= np.uint64(0xFF51AFD7ED558CCD)
    h ^= h >> np.uint64(33)
    h *= np.uint64(0xC4CEB9FE1A85EC53)
    return h ^ (h >> np.uint64(33))


@njit(inline="always")
def _slot(slots, key):
    """The first slot along ``key``'s probe chain that is empty or holds its tag."""
    mask = slots.size - 1
    tag = np.int64(key >> np.uint64(33))
    i = np.int64(key & np.uint64(mask))
    while True:
        v = slots[i]
        if v < 0 or (v >> 32) == tag:
            return i, tag
        i = (i + 1) & mask


@no_refcount
def index_range(slots, meta, S, P, POW, lengths, hash_mask, start, end, run, limit):
    """Index positions ``start .. end-1`` of ``S`` (computing ``P[e+1]`` as it goes), ``run`` being the
    number of tokens of ``S[start]``'s sequence before it (a ``SEP`` resets it). Stops early, returning
    the first position not indexed, before the number of used slots ``meta[0]`` could pass ``limit``;
    else returns ``end``."""
    n_lengths = lengths.size
    for e in range(start, end):
        if S[e] < 0:
            run = 0
        else:
            if meta[0] + n_lengths > limit:
                return e
            for j in range(n_lengths):
                m = lengths[j]
                if m > run:
                    break
                i, tag = _slot(slots, _key(_window(P, POW, e, m), m, hash_mask))
                if slots[i] < 0:
                    meta[0] += 1
                slots[i] = (tag << 32) | e
            run += 1
        P[e + 1] = P[e] * BASE + np.uint64(S[e] + 1)
    return end


@njit(inline="always")
def _same(S, e, T, n, m):
    """``S[e-m:e] == T[n-m:n]``."""
    for j in range(1, m + 1):
        if S[e - j] != T[n - j]:
            return False
    return True


@no_refcount
def scan(S, P, POW, lo, hi, T, n, m, w):
    """The largest ``e`` in ``[lo + m, hi)`` with ``S[e]`` a token and ``S[e-m:e] == T[n-m:n]`` (window hash
    ``w``), or -1: the exact answer where the table's slot was last written by another window."""
    for e in range(hi - 1, lo + m - 1, -1):
        if S[e] >= 0 and _window(P, POW, e, m) == w and _same(S, e, T, n, m):
            return e
    return -1


@no_refcount
def latest_end(C, POW, T, n, m, w):
    """The latest end in corpus ``C = (S, P, slots, hash_mask, lo, hi)`` (positions ``[lo, hi)``) of the
    window ``T[n-m:n]`` whose hash is ``w``, or -1 (the module docstring's four cases)."""
    S, P, slots, hash_mask, lo, hi = C
    v = slots[_slot(slots, _key(w, m, hash_mask))[0]]
    if v < 0 or (v & LO32) < lo:
        return -1
    e = v & LO32
    if _same(S, e, T, n, m):
        return e
    return scan(S, P, POW, lo, hi, T, n, m, w)


@njit(inline="always")
def _match_length(S, e, T, n, limit):
    """The largest ``l <= limit`` with ``S[e-l:e] == T[n-l:n]`` (stopping at either start and at ``SEP``)."""
    l = 0
    while l < limit and l < e and l < n and S[e - 1 - l] == T[n - 1 - l]:
        l += 1
    return l


@no_refcount
def draft(T, TP, n, slots, hash_mask, H, HP, h_slots, h_hash_mask, h_lo, h_hi, POW, lengths_desc, max_match, factor,
          k, out):
    """:func:`reference.suffix.drafter.find_match` over ``lengths_desc`` (the ladder's lengths up to
    ``max_match``, longest first) and the copy: writes the draft to ``out`` (room for
    ``min(k, factor * max_match)`` tokens) and returns ``(n_d, L)``. The sequence ``T[:n]`` (prefix hashes
    ``TP``, table ``slots``) and the history's corpus come as arrays and numbers (a tuple argument costs
    microseconds of type checking per call)."""
    seq = (T, TP, slots, hash_mask, np.int64(0), n)
    hist = (H, HP, h_slots, h_hash_mask, h_lo, h_hi)
    for j in range(lengths_desc.size):
        m = lengths_desc[j]
        if m > n:
            continue
        w = _window(TP, POW, n, m)
        e = latest_end(seq, POW, T, n, m, w)
        if e >= 0:
            L = _match_length(T, e, T, n, max_match)
            n_d = max(0, min(k, np.int64(factor * L)))
            for i in range(n_d):  # LZ77: past the end the draft copies itself
                out[i] = T[e + i] if e + i < n else out[e + i - n]
            return n_d, L
        e = latest_end(hist, POW, T, n, m, w)
        if e >= 0:
            L = _match_length(H, e, T, n, max_match)
            n_d = max(0, min(k, np.int64(factor * L)))
            i = 0
            while i < n_d and H[e + i] >= 0:  # the draft stops at the sequence's end
                out[i] = H[e + i]
                i += 1
            return i, L
    return 0, 0


class LatestEnds:
    """The index of one corpus over ladder ``lengths``: its table (``slots``, ``meta[0]`` slots used),
    grown by doubling and re-indexing (amortized O(len(lengths)) per position)."""

    def __init__(self, lengths, capacity: int = 1024):
        self.lengths = np.array(sorted(set(lengths)), np.int64)
        self.pow = powers(int(self.lengths.max(initial=0)))
        self.hash_mask = int(HASH_MASK)
        self.meta = np.zeros(1, np.int64)
        self.clear(capacity)

    def clear(self, capacity: int) -> None:
        """Empty the table, resized to the power of two of at least ``capacity`` (and 1024) slots."""
        self.slots = np.full(1 << max(10, int(capacity - 1).bit_length()), -1, np.int64)
        self.meta[0] = 0
        self.limit = int(MAX_LOAD * self.slots.size)

    def add(self, S: np.ndarray, P: np.ndarray, start: int, end: int, run: int, first: int) -> None:
        """Index positions ``[start, end)`` (no ``SEP`` before ``end - 1``; ``run`` as in :func:`index_range`);
        ``first`` (a sequence's start) is where the live positions begin, re-indexed when the table grows."""
        while True:
            e = index_range(self.slots, self.meta, S, P, self.pow, self.lengths, self.hash_mask, start, end, run,
                            self.limit)
            if e == end:
                return
            self.rebuild(S, P, first, e, 2 * self.slots.size)
            run += e - start
            start = e

    def rebuild(self, S: np.ndarray, P: np.ndarray, first: int, end: int, capacity: int) -> None:
        """Index positions ``[first, end)`` afresh (``first`` a sequence's start) in a table of ``capacity``
        slots, doubled until they fit."""
        while True:
            self.clear(capacity)
            if index_range(self.slots, self.meta, S, P, self.pow, self.lengths, self.hash_mask, first, end, 0,
                           self.limit) == end:
                return
            capacity *= 2
