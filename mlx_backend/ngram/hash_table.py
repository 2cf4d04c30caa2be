"""Array-based n-gram tables and the drafting kernel (numba, CPU).

Every n-gram is two int64 *words* with llama.cpp's -1 padding (``common_ngram``, ngram-cache.h:15-38)::

    w0 = t0 << 32 | (t1 & 0xFFFFFFFF)        w1 = t2 << 32 | (t3 & 0xFFFFFFFF)

so sizes 1..4 are distinct keys of one table, and within one size the words order like the tokens.

``HashTable`` is a mutable count table ``c(eta, y)`` for the context cache ``c_ctx`` and the dynamic
cache ``c_dyn``: open addressing on the n-gram (-> key id) and on ``(key id, y)`` (-> entry id), each
key's followers chained in a list, with ``F(eta) = sum_y c(eta, y)`` and ``max_y c(eta, y)`` kept per key.
An update is O(1) amortised; a level whose ``F < a_n`` or ``100 * max < p_n * F`` is rejected without
reading its followers (it cannot pass: ``c(eta, y*) <= max``).

The static cache ``c_st`` is a sorted 2-gram section of :mod:`mlx_backend.ngram.sorted_cache` (memory-mapped):
the 2-gram is found by binary search, the followers are sorted by token, and ``w(y)`` is a fixed-length
branch-free binary search over them (the layout of the seed ``000_b543da7ce10ed48f``).

Drafting follows ``reference.ngram.draft`` exactly (ties to the smallest token id, negative-start n-grams
skipped, ``score="exact"`` compares 128-bit products, ``score="int32"`` wraps every sum and product
like llama.cpp's ``int``); ``tests/mlx_backend/ngram/test_tables*.py`` check it.
"""
from __future__ import annotations

import numpy as np

from mlx_backend.machine.numba_cache import njit
from reference.ngram.draft import LAX, STATIC_A, STATIC_P, STRICT

NGRAM_MAX = 4
LO32 = np.int64(0xFFFFFFFF)
# Thresholds by table (0: context/lax, 1: dynamic/strict), index n-1.
A_N = np.array([LAX.a_n, STRICT.a_n], dtype=np.int64)
P_N = np.array([LAX.p_n, STRICT.p_n], dtype=np.int64)
assert (STATIC_A, STATIC_P) == (2, 50)  # the static-only rule baked into ``top`` (sorted_cache.static_top)


def ngram_words(ngram) -> tuple[int, int]:
    """The two key words of an n-gram (a tuple of 1..4 tokens).

    >>> ngram_words((1, 2)), ngram_words((1,))[1]
    ((4294967298, -1), -1)
    """
    t = list(ngram) + [-1] * (NGRAM_MAX - len(ngram))
    return (t[0] << 32) | (t[1] & 0xFFFFFFFF), (t[2] << 32) | (t[3] & 0xFFFFFFFF)


def words_to_slots(w0: np.ndarray, w1: np.ndarray) -> np.ndarray:
    """The 4 padded token slots ``[K, 4]`` (int64) of key words (vectorized inverse of :func:`ngram_words`)."""
    lo = lambda w: ((w & LO32) ^ 0x80000000) - 0x80000000  # noqa: E731 - sign-extend the low half
    return np.stack([w0 >> 32, lo(w0), w1 >> 32, lo(w1)], axis=1)


def canonical_rows(w0, w1, tokens, counts) -> np.ndarray:
    """Rows ``(n, t0, t1, t2, t3, token, count)`` sorted ascending (conformance README, section 3.4).

    >>> canonical_rows(np.array([4 << 32 | 0xFFFFFFFF]), np.array([-1]), np.array([7]), np.array([2]))
    array([[ 1,  4, -1, -1, -1,  7,  2]])
    """
    slots = words_to_slots(np.asarray(w0, np.int64), np.asarray(w1, np.int64))
    n = (slots >= 0).sum(axis=1)
    rows = np.column_stack([n, slots, np.asarray(tokens, np.int64), np.asarray(counts, np.int64)])
    order = np.lexsort((rows[:, 5], rows[:, 4], rows[:, 3], rows[:, 2], rows[:, 1], rows[:, 0]))
    return rows[order]


def ngram_size(w0: np.ndarray, w1: np.ndarray) -> np.ndarray:
    """The size n of each key (the number of slots not equal to -1)."""
    return (words_to_slots(w0, w1) >= 0).sum(axis=1)


# ----------------------------------------------------------------------------- hash table kernels
# A table is the tuple T = (slots, K, eslots, E, meta), rows laid out so that one probe touches one
# cache line of key data:
#   slots  int64 [2^a]      -1, or tag << 32 | key id (tag: high hash bits, checked before the row)
#   K      int64 [Kcap, 8]  per key: w0, w1, F = sum of counts, max count, argmax token (smallest id
#                           among ties), number of followers, first entry (-1: none), unused
#   eslots int64 [2^b]      -1, or tag << 32 | entry id, hashed on (key id, token)
#   E      int64 [Ecap, 4]  per entry: key id, token, count, next entry of the same key (-1: last)
#   meta   int64 [2]        number of keys, number of entries
KW0, KW1, KSUM, KMAX, KTOP, KNUM, KHEAD = range(7)
EKEY, ETOK, ECNT, ENEXT = range(4)

# The kernels of the drafting and counting loops allocate nothing and are compiled without numba's
# reference counting (its option ``_nrt=False``, with which numba compiles its own string helpers): the
# atomic increments and decrements of every array passed to a call or taken from a table's tuple were
# 70 % of a replay's time (perf: NRT_incref / NRT_decref), removing them made the replay 3.5x faster.
# A kernel that allocates fails to compile under it.
no_refcount = njit(cache=True, _nrt=False)


@njit(inline="always")
def _mix(a, b):
    h = (np.uint64(a) * np.uint64(0x9E3779B97F4A7C15)) ^ (np.uint64(b) * np.uint64(0xC2B2AE3D27D4EB4F))
    h ^= h >> np.uint64(31)
    h *= np.uint64(0xD6E8FEB86659FD93)
    return h ^ (h >> np.uint64(32))


@njit(inline="always")
def _tag(h):
    return np.int64(h >> np.uint64(33))  # 31 bits, so tag << 32 | id stays positive


@no_refcount
def _slot(slots, rows, col_a, col_b, a, b):
    """Open addressing: the slot of the row whose columns ``col_a, col_b`` hold ``(a, b)``, or the empty
    slot where that row belongs. A slot packs ``tag << 32 | row id``; -1 is empty."""
    mask = slots.size - 1
    h = _mix(a, b)
    tag = _tag(h)
    i = np.int64(h & np.uint64(mask))
    while True:
        v = slots[i]
        if v < 0:
            return i
        if (v >> 32) == tag:
            r = v & 0xFFFFFFFF
            if rows[r, col_a] == a and rows[r, col_b] == b:
                return i
        i = (i + 1) & mask


@no_refcount
def find_key(T, w0, w1):
    """The key id of n-gram ``(w0, w1)``, or -1."""
    v = T[0][_slot(T[0], T[1], KW0, KW1, w0, w1)]
    return v & 0xFFFFFFFF if v >= 0 else -1


@no_refcount
def find_entry(T, k, y):
    """The entry id of follower ``y`` of key ``k``, or -1."""
    v = T[2][_slot(T[2], T[3], EKEY, ETOK, k, y)]
    return v & 0xFFFFFFFF if v >= 0 else -1


@no_refcount
def add(T, w0, w1, y, c):
    """``c(eta, y) += c``; the caller reserved room (:meth:`HashTable.reserve`)."""
    slots, K, eslots, E, meta = T
    i = _slot(slots, K, KW0, KW1, w0, w1)
    if slots[i] < 0:  # a new n-gram
        k = meta[0]
        meta[0] += 1
        slots[i] = (_tag(_mix(w0, w1)) << 32) | k
        K[k, KW0] = w0
        K[k, KW1] = w1
        K[k, KSUM] = 0
        K[k, KMAX] = 0
        K[k, KTOP] = -1
        K[k, KNUM] = 0
        K[k, KHEAD] = -1
    else:
        k = slots[i] & 0xFFFFFFFF
    j = _slot(eslots, E, EKEY, ETOK, k, y)
    if eslots[j] < 0:  # a new follower of it
        e = meta[1]
        meta[1] += 1
        eslots[j] = (_tag(_mix(k, y)) << 32) | e
        E[e, EKEY] = k
        E[e, ETOK] = y
        E[e, ECNT] = 0
        E[e, ENEXT] = K[k, KHEAD]
        K[k, KHEAD] = e
        K[k, KNUM] += 1
    else:
        e = eslots[j] & 0xFFFFFFFF
    cnt = E[e, ECNT] + c
    E[e, ECNT] = cnt
    K[k, KSUM] += c
    if cnt > K[k, KMAX] or (cnt == K[k, KMAX] and y < K[k, KTOP]):  # counts only grow
        K[k, KMAX] = cnt
        K[k, KTOP] = y


@no_refcount
def update_range(T, S, start, end):
    """``common_ngram_cache_update(T, 1, 4, S[:i+1], 1)`` for ``i = start..end-1`` (ngram-cache.cpp:11-51):
    the n-grams ending at ``S[i-1]`` (n <= i) are followed by ``S[i]``."""
    for i in range(max(start, 1), end):
        y = S[i]
        for n in range(1, min(NGRAM_MAX, i) + 1):
            w0, w1 = _words_at(S, S, i, i, n)
            add(T, w0, w1, y, 1)


@no_refcount
def add_entries(T, w0, w1, tok, cnt):
    for e in range(tok.size):
        add(T, w0[e], w1[e], tok[e], cnt[e])


@no_refcount
def merge_into(T, U):
    """Add every count of table ``U`` to table ``T`` (``common_ngram_cache_merge``, ngram-cache.cpp:260-285)."""
    UK, UE = U[1], U[3]
    for e in range(U[4][1]):
        k = UE[e, EKEY]
        add(T, UK[k, KW0], UK[k, KW1], UE[e, ETOK], UE[e, ECNT])


@njit(cache=True)
def clear(T):
    T[0][:] = -1
    T[2][:] = -1
    T[4][:] = 0


@njit(cache=True)
def rehash(T):
    """Rebuild both slot arrays (after the caller resized them)."""
    slots, K, eslots, E, meta = T
    slots[:] = -1
    eslots[:] = -1
    mask, emask = slots.size - 1, eslots.size - 1
    for k in range(meta[0]):
        h = _mix(K[k, KW0], K[k, KW1])
        i = np.int64(h & np.uint64(mask))
        while slots[i] >= 0:
            i = (i + 1) & mask
        slots[i] = (_tag(h) << 32) | k
    for e in range(meta[1]):
        h = _mix(E[e, EKEY], E[e, ETOK])
        j = np.int64(h & np.uint64(emask))
        while eslots[j] >= 0:
            j = (j + 1) & emask
        eslots[j] = (_tag(h) << 32) | e


def _pow2_at_least(n: int) -> int:
    return 1 << max(4, int(n - 1).bit_length())


class HashTable:
    """A mutable count table ``c(eta, y)`` over n-grams of sizes 1..4 (the context or dynamic cache).

    >>> t = HashTable()
    >>> t.update(np.array([5, 6, 5, 6, 5], dtype=np.int32))
    >>> len(t), t.n_entries(), t.total(), t.sizes()
    (7, 7, 10, {1, 2, 3, 4})
    >>> t.entries()[:2]
    [(1, 5, -1, -1, -1, 6, 2), (1, 6, -1, -1, -1, 5, 2)]
    """

    MAX_ROWS = 2**32 - 1  # ids live in the low 32 bits of a slot

    def __init__(self, keys: int = 64, entries: int = 64):
        self.meta = np.zeros(2, np.int64)
        self.T = None
        self._alloc(keys, entries)

    def _alloc(self, kcap: int, ecap: int) -> None:
        if max(kcap, ecap) > self.MAX_ROWS:
            raise ValueError(f"a table holds at most {self.MAX_ROWS} n-grams and entries")
        n_k, n_e = len(self), self.n_entries()
        K, E = np.empty((kcap, 8), np.int64), np.empty((ecap, 4), np.int64)
        if self.T is not None:
            K[:n_k] = self.T[1][:n_k]
            E[:n_e] = self.T[3][:n_e]
        slots = np.full(_pow2_at_least(2 * kcap), -1, np.int64)
        eslots = np.full(_pow2_at_least(2 * ecap), -1, np.int64)
        self.T = (slots, K, eslots, E, self.meta)
        if n_k or n_e:
            rehash(self.T)

    def __len__(self) -> int:
        """The number of distinct n-grams."""
        return int(self.meta[0])

    def n_entries(self) -> int:
        """The number of (n-gram, follower) pairs."""
        return int(self.meta[1])

    def sizes(self) -> set[int]:
        """The n-gram sizes present."""
        K = self.T[1][: len(self)]
        return set(ngram_size(K[:, KW0], K[:, KW1]).tolist())

    def has_room(self, more_keys: int, more_entries: int) -> bool:
        return len(self) + more_keys <= len(self.T[1]) and self.n_entries() + more_entries <= len(self.T[3])

    def reserve(self, more_keys: int, more_entries: int) -> None:
        """Make room for ``more_keys`` keys and ``more_entries`` entries (load factor <= 1/2)."""
        if not self.has_room(more_keys, more_entries):
            kcap, ecap = len(self.T[1]), len(self.T[3])
            need_k, need_e = len(self) + more_keys, self.n_entries() + more_entries
            self._alloc(max(need_k, 2 * kcap if need_k > kcap else kcap), max(need_e, 2 * ecap if need_e > ecap else ecap))

    def clear(self) -> None:
        clear(self.T)

    def update(self, S: np.ndarray, start: int = 0, end: int | None = None) -> None:
        """Count every position ``i`` in ``[start, end)`` of ``S`` (sizes 1..4, see :func:`update_range`)."""
        end = len(S) if end is None else end
        n = max(0, end - max(start, 1))
        self.reserve(NGRAM_MAX * n, NGRAM_MAX * n)
        update_range(self.T, np.asarray(S, np.int32), start, end)

    def add_rows(self, w0: np.ndarray, w1: np.ndarray, tokens: np.ndarray, counts: np.ndarray) -> None:
        """``c(eta, y) += count`` for arrays of key words, tokens and counts."""
        self.reserve(len(tokens), len(tokens))
        add_entries(self.T, np.asarray(w0, np.int64), np.asarray(w1, np.int64), np.asarray(tokens, np.int64),
                    np.asarray(counts, np.int64))

    def merge(self, other: HashTable) -> HashTable:
        """Add every count of ``other``; returns ``self``."""
        self.reserve(len(other), other.n_entries())
        merge_into(self.T, other.T)
        return self

    def copy(self) -> HashTable:
        out = HashTable(max(len(self), 16), max(self.n_entries(), 16))
        return out.merge(self)

    def keep_most_counted(self, n: int, room: int = 0) -> int:
        """Keep the ``n`` entries with the largest counts, the latest learned first among equal counts (an
        entry's age is its insertion order), drop the others and the n-grams left without a follower; the
        kept counts are unchanged. Rebuilt in place (the arrays are replaced, in insertion order) with room
        for ``room`` more entries and n-grams. Returns how many entries were dropped.

        >>> t = HashTable()
        >>> t.update(np.array([5, 6, 5, 6, 7], dtype=np.int32))
        >>> t.n_entries(), t.keep_most_counted(3)
        (9, 6)
        >>> [r[1:] for r in t.entries()]     # (5)->6 twice, then the two learned last
        [(5, -1, -1, -1, 6, 2), (6, 5, 6, -1, 7, 1), (5, 6, 5, 6, 7, 1)]
        """
        n_e = self.n_entries()
        if n_e <= n:
            return 0
        n = max(n, 0)
        w0, w1, tok, cnt = self.arrays()
        # count, then insertion order, in one int64: the n largest are the entries kept
        rank = (np.minimum(cnt, 2**31 - 1) << 32) | np.arange(n_e, dtype=np.int64)
        keep = np.sort(np.argpartition(rank, n_e - n)[n_e - n:]) if n else np.zeros(0, np.int64)
        used = np.zeros(len(self), np.bool_)
        used[self.T[3][keep, EKEY]] = True
        kept = HashTable(max(int(used.sum()) + room, 16), max(n + room, 16))
        kept.add_rows(w0[keep], w1[keep], tok[keep], cnt[keep])
        self.T, self.meta = kept.T, kept.meta
        return n_e - n

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(w0, w1, token, count)`` of every entry, in insertion order."""
        K, E = self.T[1], self.T[3][: self.n_entries()]
        k = E[:, EKEY]
        return K[k, KW0], K[k, KW1], E[:, ETOK].copy(), E[:, ECNT].copy()

    def total(self) -> int:
        return int(self.T[3][: self.n_entries(), ECNT].sum())

    def entries(self) -> list[tuple[int, ...]]:
        """Canonical sorted rows ``(n, t0, t1, t2, t3, token, count)`` (like ``NgramCache.entries``)."""
        return [tuple(r) for r in canonical_rows(*self.arrays()).tolist()]

    def __repr__(self) -> str:
        return f"HashTable({len(self)} n-grams, {self.n_entries()} entries)"


# ----------------------------------------------------------------------------- drafting kernel
# Constants passed between kernels are typed (np.int64(0), np.bool_(True)): numba compiles a callee once per
# literal argument value it is called with, and the literals gave _try_primary ten specializations (a first
# `stats` compiled for 55 s instead of 19 s, same code and speed).
# The static cache enters as ST = (keys2, offsets, tokens, counts, top): its 2-gram section.


@njit(inline="always")
def _at(P, D, L, i):
    """``S[i]`` of ``S = P[:L] ++ D``."""
    return P[i] if i < L else D[i - L]


@njit(inline="always")
def _words_at(P, D, L, end, n):
    """Key words of the n-gram ``S[end-n:end]`` (``S = P[:L] ++ D``), n >= 1."""
    t0 = np.int64(_at(P, D, L, end - n))
    t1 = np.int64(_at(P, D, L, end - n + 1)) if n >= 2 else np.int64(-1)
    t2 = np.int64(_at(P, D, L, end - n + 2)) if n >= 3 else np.int64(-1)
    t3 = np.int64(_at(P, D, L, end - n + 3)) if n >= 4 else np.int64(-1)
    return (t0 << 32) | (t1 & LO32), (t2 << 32) | (t3 & LO32)


@njit(inline="always")
def _search(arr, lo, hi, x):
    """Index of ``x`` in the sorted ``arr[lo:hi]`` or -1: fixed-length branch-free binary search
    (the number of steps depends only on ``hi - lo``)."""
    n = hi - lo
    if n <= 0:
        return -1
    base = lo
    while n > 1:
        half = n >> 1
        base = base + half * np.int64(arr[base + half] <= x)
        n -= half
    return base if arr[base] == x else -1


@no_refcount
def static_find(ST, t0, t1):
    """The index of 2-gram ``(t0, t1)`` in the static section, or -1."""
    keys2 = ST[0]
    return _search(keys2, 0, keys2.size, (np.int64(t0) << 32) | np.int64(t1))


@njit(inline="always")
def _wrap32(x):
    """``x`` reduced to 32-bit two's complement (llama.cpp's ``int`` arithmetic on GCC x86-64)."""
    return ((x + 0x80000000) & 0xFFFFFFFF) - 0x80000000


U32 = np.uint64(0xFFFFFFFF)
SH32 = np.uint64(32)


@njit(inline="always")
def _mul128(a, b):
    """The product of non-negative int64 ``a * b`` as 128 bits ``(high, low)`` (two uint64 words)."""
    a, b = np.uint64(a), np.uint64(b)
    a0, a1, b0, b1 = a & U32, a >> SH32, b & U32, b >> SH32
    p00, p01, p10 = a0 * b0, a0 * b1, a1 * b0
    mid = (p00 >> SH32) + (p01 & U32) + (p10 & U32)  # < 3 * 2^32: no overflow
    return a1 * b1 + (p01 >> SH32) + (p10 >> SH32) + (mid >> SH32), (p00 & U32) | (mid << SH32)


@njit(inline="always")
def _cmp_products(a, b, c, d):
    """The sign of ``a * b - c * d`` for non-negative int64 operands, exactly (no overflow)."""
    if a < 0x80000000 and c < 0x80000000 and b <= 0xFFFFFFFF and d <= 0xFFFFFFFF:  # both below 2^63
        x, y = a * b, c * d
        return 1 if x > y else (-1 if x < y else 0)
    xh, xl = _mul128(a, b)
    yh, yl = _mul128(c, d)
    if xh != yh:
        return 1 if xh > yh else -1
    return 1 if xl > yl else (-1 if xl < yl else 0)


@no_refcount
def _argmax(T, kid, st_lo, st_hi, ST, int32):
    """``(y*, c(eta, y*))``: the follower of key ``kid`` with the largest score ``c * w``, ties to the
    smallest id (cpp:114-131), or ``(-1, 0)`` if no score is positive.

    Exact scores are compared as 128-bit products (``c`` and ``w = 100 * c_st`` are int64, their
    product is not). They need only the followers that also follow the static 2-gram
    (``w = 100 * c_st >= 100``) and the most frequent follower ``KTOP`` (the best of those with
    ``w = 1``, beaten by any weighted one): the smaller of the two follower lists is walked. Wrapping
    int32 scores walk every follower."""
    K, E = T[1], T[3]
    st_tok, st_cnt = ST[2], ST[3]
    best_y, best_c, best_w, best_s = np.int64(-1), np.int64(0), np.int64(1), np.int64(0)
    if not int32:
        top, cmax = K[kid, KTOP], K[kid, KMAX]
        if st_hi == st_lo:
            return top, cmax
        if _search(st_tok, st_lo, st_hi, top) < 0:
            best_y, best_c = top, cmax
        if st_hi - st_lo < K[kid, KNUM]:  # walk the static followers, look each up in this key
            for j in range(st_lo, st_hi):
                e = find_entry(T, kid, st_tok[j])
                if e >= 0:
                    y, c, w = E[e, ETOK], E[e, ECNT], 100 * np.int64(st_cnt[j])
                    order = _cmp_products(c, w, best_c, best_w)
                    if order > 0 or (order == 0 and y < best_y):
                        best_y, best_c, best_w = y, c, w
            return best_y, best_c
    e = K[kid, KHEAD]
    while e >= 0:
        y, c = E[e, ETOK], E[e, ECNT]
        j = _search(st_tok, st_lo, st_hi, y)
        w = 100 * np.int64(st_cnt[j]) if j >= 0 else np.int64(1)
        if int32:
            s = _wrap32(_wrap32(c) * _wrap32(w))  # int32 * int32 wrapped: the factors are reduced first
            if s > best_s or (s == best_s and best_y >= 0 and y < best_y):
                best_y, best_c, best_s = y, c, s
        else:
            order = _cmp_products(c, w, best_c, best_w)
            if order > 0 or (order == 0 and y < best_y):
                best_y, best_c, best_w = y, c, w
        e = E[e, ENEXT]
    return best_y, best_c


@njit(inline="always")
def _percent_fails(c, F, p, int32):
    """``100 * c < p * F``: the level's share test (cpp:136), exact or in wrapping int32."""
    if int32:
        return _wrap32(100 * _wrap32(c)) < _wrap32(p * _wrap32(F))
    return _cmp_products(100, c, p, F) < 0


@no_refcount
def _try_primary(T, which, P, D, L, k, st_lo, st_hi, ST, int32):
    """The first passing level of table ``T`` (n = 4..1) at ``S = P[:L] ++ D[:k]``, or -1 (cpp:97-143).

    int32: ``F`` and both sides of the share test wrap like llama.cpp's ``int`` sums and products."""
    K = T[1]
    if T[4][0] == 0:
        return -1
    Lk = L + k
    for n in range(min(NGRAM_MAX, Lk), 0, -1):  # n > |S|: negative start, skipped
        w0, w1 = _words_at(P, D, L, Lk, n)
        kid = find_key(T, w0, w1)
        if kid < 0:
            continue
        F = _wrap32(K[kid, KSUM]) if int32 else K[kid, KSUM]
        a, p = A_N[which, n - 1], P_N[which, n - 1]
        if F < a:
            continue
        if not int32 and _percent_fails(K[kid, KMAX], F, p, False):  # cannot pass: c(eta, y*) <= max
            continue
        y, c = _argmax(T, kid, st_lo, st_hi, ST, int32)
        if y >= 0 and not _percent_fails(c, F, p, int32):
            return y
    return -1


@no_refcount
def _next_token(P, D, L, k, C, Y, has_dyn, ST, int32):
    """The token drafted after ``S = P[:L] ++ D[:k]`` (context, then dynamic, then static-only), or -1
    (one iteration of ``common_ngram_cache_draft``, ngram-cache.cpp:158-196)."""
    Lk = L + k
    si = static_find(ST, _at(P, D, L, Lk - 2), _at(P, D, L, Lk - 1))
    st_lo = np.int64(ST[1][si]) if si >= 0 else np.int64(0)
    st_hi = np.int64(ST[1][si + 1]) if si >= 0 else np.int64(0)
    y = _try_primary(C, np.int64(0), P, D, L, k, st_lo, st_hi, ST, int32)
    if y < 0 and has_dyn:
        y = _try_primary(Y, np.int64(1), P, D, L, k, st_lo, st_hi, ST, int32)
    if y < 0 and si >= 0:
        y = _static_int32(ST, st_lo, st_hi) if int32 else ST[4][si]
    return y


@no_refcount
def _static_int32(ST, st_lo, st_hi):
    """The static-only draft (cpp:65-94) in wrapping int32: the first strictly larger count (followers
    sorted: the smallest id among ties), drafted iff ``F >= 2`` and ``100 * c >= 50 * F`` where ``F``,
    ``100 * c`` and ``50 * F`` wrap (``100 * c`` does once ``c`` > 21,474,836)."""
    st_tok, st_cnt = ST[2], ST[3]
    F, best, y = np.int64(0), np.int64(0), np.int64(-1)
    for j in range(st_lo, st_hi):
        c = np.int64(st_cnt[j])
        F = _wrap32(F + c)
        if c > best:
            best, y = c, np.int64(st_tok[j])
    if F < STATIC_A or _percent_fails(best, F, STATIC_P, True):
        return np.int64(-1)
    return y


@no_refcount
def draft_into(P, L, D, n_draft, C, Y, has_dyn, ST, int32):
    """Draft up to ``n_draft`` tokens after ``P[:L]`` into ``D``; returns how many
    (``common_ngram_cache_draft``, ngram-cache.cpp:145-197)."""
    if L < 2:
        return 0
    k = np.int64(0)
    while k < n_draft:
        y = _next_token(P, D, L, k, C, Y, has_dyn, ST, int32)
        if y < 0:
            break
        D[k] = y
        k += 1
    return k


@no_refcount
def draft_length(P, L, D, k, n_draft, C, Y, has_dyn, ST, int32, W):
    """The final length of a draft after ``P[:L]`` that holds ``D[:k]`` so far (``L + k >= 4``) and has not
    stopped, walked without storing it, at a cost that does not grow with ``n_draft`` once it cycles.

    The caches do not change during a draft, and each token depends only on the last 4 tokens of
    ``S`` (the n-grams of sizes 1..4 and the static 2-gram end there): the draft is a walk through
    4-token states. Once a state repeats (Brent's cycle detection: compare with a state saved at
    power-of-two steps), the draft is periodic and never stops, so its length is ``n_draft``.
    ``W``: room for two states (``2 * NGRAM_MAX`` tokens): the current one, then the saved one."""
    for i in range(NGRAM_MAX):
        W[i] = W[NGRAM_MAX + i] = _at(P, D, L, L + k - NGRAM_MAX + i)
    power = lam = 1
    while k < n_draft:
        y = _next_token(W, W, np.int64(NGRAM_MAX), np.int64(0), C, Y, has_dyn, ST, int32)
        if y < 0:
            return k
        for i in range(NGRAM_MAX - 1):
            W[i] = W[i + 1]
        W[NGRAM_MAX - 1] = y
        k += 1
        same = True
        for i in range(NGRAM_MAX):
            same = same and W[i] == W[NGRAM_MAX + i]
        if same:
            return n_draft
        if lam == power:  # Brent: move the saved state forward, double the window
            for i in range(NGRAM_MAX):
                W[NGRAM_MAX + i] = W[i]
            power *= 2
            lam = 0
        lam += 1
    return k


@njit(cache=True)
def update_then_draft(P, start, L, D, n_draft, C, Y, ST, int32):
    """Count the positions ``start..L-1`` into ``C``, then :func:`draft_into` (one call per generation step)."""
    update_range(C, P, start, L)
    return draft_into(P, L, D, n_draft, C, Y, np.bool_(True), ST, int32)


@njit(cache=True)
def update_then_draft_no_dyn(P, start, L, D, n_draft, C, ST, int32):
    """:func:`update_then_draft` without a dynamic cache (five arrays fewer to pass per call)."""
    update_range(C, P, start, L)
    return draft_into(P, L, D, n_draft, C, C, np.bool_(False), ST, int32)


@njit(cache=True)
def replay_chunk(X, n_draft, C, Y, ST, int32, i_start, rec_pos, rec_k, rec_d, n_calls, record_drafts):
    """lookup-stats on one chunk ``X`` (lookup-stats.cpp:78-125) with ``C`` empty at the start:
    draft, accept the matching prefix, append the "sampled" token, counting each appended token into
    ``C``. Call ``n_calls + c`` records its position and draft count in ``rec_pos``/``rec_k`` and,
    if ``record_drafts``, its tokens in ``rec_d``, one call after the other (grown as needed).
    Without recording and with ``n_draft`` above the chunk, a draft is kept only while it matches the
    chunk (what can be accepted) and the rest is only measured (:func:`draft_length`), so a large
    ``n_draft`` costs nothing beyond that.
    Returns ``(n_calls after the chunk, n_drafted, n_accept, rec_d)``."""
    n_ctx = X.size
    keep_all = record_drafts or n_draft <= n_ctx + NGRAM_MAX
    D = np.empty(n_draft if keep_all else n_ctx + NGRAM_MAX, np.int32)
    W = np.empty(2 * NGRAM_MAX, np.int32)  # draft_length's states
    n_drafted = n_accept = 0
    used = 0  # tokens in rec_d
    L = np.int64(1)
    has_dyn = np.bool_(True)
    while L < n_ctx:
        if keep_all or L < 2:
            k = draft_into(X, L, D, n_draft, C, Y, has_dyn, ST, int32)
        else:  # keep the draft while it matches the chunk (and S has 4 tokens), then only measure it
            k = np.int64(0)
            while k < n_draft:
                y = _next_token(X, D, L, k, C, Y, has_dyn, ST, int32)
                if y < 0:
                    break
                D[k] = y
                k += 1
                if (L + k - 1 >= n_ctx or y != X[L + k - 1]) and L + k >= NGRAM_MAX:
                    if k < n_draft:
                        k = draft_length(X, L, D, k, n_draft, C, Y, has_dyn, ST, int32, W)
                    break
        rec_pos[n_calls] = i_start + L
        rec_k[n_calls] = k
        if record_drafts:
            if used + k > rec_d.size:
                grown = np.empty(max(2 * rec_d.size, used + k), np.int32)
                for j in range(used):  # element loops: slice assignments cost seconds of compile time
                    grown[j] = rec_d[j]
                rec_d = grown
            for j in range(k):
                rec_d[used + j] = D[j]
            used += k
        n_calls += 1
        n_drafted += k
        for j in range(k):
            if L == n_ctx or D[j] != X[L]:
                break
            n_accept += 1
            L += 1
            update_range(C, X, L - 1, L)
        if L < n_ctx:
            L += 1
            update_range(C, X, L - 1, L)
    return n_calls, n_drafted, n_accept, rec_d


def empty_static() -> tuple[np.ndarray, ...]:
    """A static section with no 2-grams (drafting without ``c_st``)."""
    return (np.zeros(0, np.int64), np.zeros(1, np.uint32), np.zeros(0, np.int32), np.zeros(0, np.int32),
            np.zeros(0, np.int32))
