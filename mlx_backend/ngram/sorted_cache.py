"""Sorted, immutable n-gram caches: the in-memory (or memory-mapped) form of a cache file.

A :class:`SortedCache` holds one :class:`Section` per n-gram size n (1..4)::

    keys     int64 [K] (n <= 2: w0) or [K, 2] (n >= 3: w0, w1)   n-gram key words, strictly increasing
    offsets  uint32 [K+1]   followers of key i are entries offsets[i]:offsets[i+1]
    tokens   int32 [E]      follower tokens, increasing within a key
    counts   int32 [E]      c(eta, y) > 0
    top      int32 [K]      the static-only draft of the key: the most frequent follower (ties to the
                            smallest id) if F >= 2 and 100 * c >= 50 * F, else -1 (ngram-cache.cpp:65-94)

(key words: :func:`mlx_backend.ngram.hash_table.ngram_words`). Everything here is vectorized: building the
static cache of a token stream packs each (2-gram, follower) into one integer, sorts and counts chunk
by chunk and merges the sorted chunks; merging caches merges sorted entry rows.

>>> c = build_static(np.array([1, 2, 3, 1, 2, 4], np.int32))
>>> c.entries()
[(2, 1, 2, -1, -1, 3, 1), (2, 1, 2, -1, -1, 4, 1), (2, 2, 3, -1, -1, 1, 1), (2, 3, 1, -1, -1, 2, 1)]
>>> merge_caches([c, c]).entries()[0]
(2, 1, 2, -1, -1, 3, 2)
"""
from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import numpy as np

from mlx_backend.machine.numba_cache import njit
from mlx_backend.ngram.hash_table import canonical_rows, empty_static, HashTable, NGRAM_MAX, ngram_size
from mlx_backend.ngram.radix_sort import radix_sort

INT32_MAX = 2**31 - 1
PACK_BITS = 21  # 2-gram + follower packed into one int64 when every token id < 2**21
BUILD_CHUNK = 1 << 22  # tokens per sorted chunk of the static build (bounded memory)


class Section(NamedTuple):
    """The n-grams of one size ``n`` (see the module docstring)."""

    n: int
    keys: np.ndarray
    offsets: np.ndarray
    tokens: np.ndarray
    counts: np.ndarray
    top: np.ndarray

    @property
    def n_keys(self) -> int:
        return len(self.top)

    @property
    def n_entries(self) -> int:
        return len(self.tokens)

    def key_words(self) -> tuple[np.ndarray, np.ndarray]:
        """``(w0, w1)`` per key."""
        if self.keys.ndim == 1:
            return self.keys, np.full(len(self.keys), -1, np.int64)
        return self.keys[:, 0], self.keys[:, 1]

    def rows(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(w0, w1, token, count)`` per entry, sorted."""
        w0, w1 = self.key_words()
        f = np.diff(self.offsets.astype(np.int64))
        return np.repeat(w0, f), np.repeat(w1, f), self.tokens, self.counts


class SortedCache:
    """An immutable n-gram cache of sorted sections (sizes 1..4); ``vocab_size`` (0: unknown) and the
    tokenizer ``fingerprint`` (32 bytes, zeros: unknown) travel with it into files of our format."""

    def __init__(self, sections: dict[int, Section] | None = None, vocab_size: int = 0,
                 fingerprint: bytes = bytes(32), source: str | None = None):
        self.sections = {n: s for n, s in sorted((sections or {}).items()) if s.n_keys}
        self.vocab_size, self.fingerprint, self.source = vocab_size, fingerprint, source

    def section(self, n: int) -> Section | None:
        return self.sections.get(n)

    def static_arrays(self) -> tuple[np.ndarray, ...]:
        """The 2-gram section as the drafting kernel's static table ``(keys, offsets, tokens, counts, top)``."""
        s = self.sections.get(2)
        return readonly(*(empty_static() if s is None else (s.keys, s.offsets, s.tokens, s.counts, s.top)))

    def rows(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(w0, w1, token, count)`` of every entry, sorted by size then key then token."""
        parts = [s.rows() for s in self.sections.values()]
        if not parts:
            return (np.zeros(0, np.int64),) * 2 + (np.zeros(0, np.int32),) * 2
        return tuple(np.concatenate(p) for p in zip(*parts))

    def to_hash_table(self) -> HashTable:
        """A mutable copy (for the dynamic cache of a replay)."""
        t = HashTable(max(16, len(self)), max(16, self.n_entries()))
        if self.n_entries():
            t.add_rows(*self.rows())
        return t

    def canonical_array(self) -> np.ndarray:
        """Canonical rows ``(n, t0, t1, t2, t3, token, count)`` as an int64 array ``[E, 7]``."""
        return canonical_rows(*self.rows())

    def entries(self) -> list[tuple[int, ...]]:
        """Canonical sorted rows, like ``NgramCache.entries()``."""
        return [tuple(r) for r in self.canonical_array().tolist()]

    def canonical_sha256(self) -> str:
        """SHA-256 of the canonical text (the ``canonical_sha256`` of the conformance vectors)."""
        h = hashlib.sha256()
        rows = self.canonical_array()
        for i in range(0, len(rows), 1 << 18):
            h.update("".join(" ".join(map(str, r)) + "\n" for r in rows[i:i + (1 << 18)].tolist()).encode())
        return h.hexdigest()

    def __len__(self) -> int:
        return sum(s.n_keys for s in self.sections.values())

    def n_entries(self) -> int:
        return sum(s.n_entries for s in self.sections.values())

    def total(self) -> int:
        return sum(int(s.counts.sum(dtype=np.int64)) for s in self.sections.values())

    def sizes(self) -> set[int]:
        return set(self.sections)

    def __eq__(self, other: object) -> bool:
        """Multiset equality of ``(n-gram, token, count)``."""
        if not isinstance(other, SortedCache):
            return NotImplemented
        return np.array_equal(self.canonical_array(), other.canonical_array())

    __hash__ = None

    def __repr__(self) -> str:
        return f"SortedCache({len(self)} n-grams, {self.n_entries()} entries, sizes {sorted(self.sections)})"


# ----------------------------------------------------------------------------- building sections


def section_from_sorted(n: int, w0, w1, tokens, counts) -> Section:
    """A section from entry rows sorted by ``(w0, w1, token)`` with no repeated ``(key, token)``."""
    E = len(tokens)
    if E >= 2**32:
        raise ValueError(f"a section holds at most 2**32-1 entries, got {E}")
    counts = np.asarray(counts)
    if E and (counts.max() > INT32_MAX or counts.min() <= 0):
        raise ValueError(f"counts must be in [1, 2**31-1] (int32 in cache files); got {counts.min()}..{counts.max()}")
    new_key = np.ones(E, bool)
    if E:
        new_key[1:] = w0[1:] != w0[:-1]
        if n > 2:
            new_key[1:] |= w1[1:] != w1[:-1]
    starts = np.flatnonzero(new_key)
    offsets = np.append(starts, E).astype(np.uint32)
    keys = w0[starts] if n <= 2 else np.column_stack([w0[starts], w1[starts]])
    counts32 = counts.astype(np.int32)
    return Section(n, np.ascontiguousarray(keys, np.int64), offsets, np.ascontiguousarray(tokens, np.int32),
                   counts32, static_top(offsets, tokens, counts32))


def readonly(*arrays: np.ndarray) -> tuple[np.ndarray, ...]:
    """Read-only views of ``arrays``. numba compiles a kernel once per argument types, and an array
    that is read-only (a memory-mapped cache file) is another type than a writable one (a cache just
    read or built): the kernels that only read a cache get read-only views, so one compilation,
    cached by ``ngram-spec precompile``, serves both."""
    views = tuple(a.view() for a in arrays)
    for v in views:
        v.flags.writeable = False
    return views


def static_top(offsets: np.ndarray, tokens: np.ndarray, counts: np.ndarray, threads: int = 1) -> np.ndarray:
    """Per key: the most frequent follower (smallest id among ties) if ``F >= 2`` and
    ``100 * c >= 50 * F``, else -1 -- the static-only draft rule (ngram-cache.cpp:65-94).
    ``threads``: each takes a range of keys, about equal in entries."""
    top = np.empty(len(offsets) - 1, np.int32)
    offsets, tokens, counts = readonly(offsets, tokens, counts)
    if threads == 1:
        _static_top(offsets, tokens, counts, top)
        return top
    split = (np.arange(1, threads) * int(offsets[-1]) // threads).astype(offsets.dtype)  # offsets' type: no conversion
    cuts = [0, *np.searchsorted(offsets, split).tolist(), len(top)]
    spans = [(a, b) for a, b in zip(cuts, cuts[1:]) if a < b]
    with ThreadPoolExecutor(threads) as pool:  # the compiled loop releases the GIL
        list(pool.map(lambda ab: _static_top(offsets[ab[0]:ab[1] + 1], tokens, counts, top[ab[0]:ab[1]]), spans))
    return top


@njit(cache=True, nogil=True)
def _static_top(offsets, tokens, counts, top):
    for i in range(top.size):
        F, best, y = 0, 0, -1
        for j in range(offsets[i], offsets[i + 1]):  # followers sorted: the first maximum is the smallest id
            c = np.int64(counts[j])
            F += c
            if c > best:
                best, y = c, tokens[j]
        top[i] = y if F >= 2 and 2 * best >= F else -1


def cache_from_rows(w0, w1, tokens, counts, **meta) -> SortedCache:
    """A cache from unsorted entry rows; rows with equal (n-gram, token) are summed."""
    w0, w1 = np.asarray(w0, np.int64), np.asarray(w1, np.int64)
    tokens, counts = np.asarray(tokens, np.int64), np.asarray(counts, np.int64)
    n = ngram_size(w0, w1) if len(w0) else np.zeros(0, np.int64)
    sections = {}
    for size in range(1, NGRAM_MAX + 1):
        m = n == size
        if not m.any():
            continue
        a0, a1, t, c = w0[m], w1[m], tokens[m], counts[m]
        order = np.lexsort((t, a1, a0))
        a0, a1, t, c = a0[order], a1[order], t[order], c[order]
        new = np.ones(len(t), bool)
        new[1:] = (a0[1:] != a0[:-1]) | (a1[1:] != a1[:-1]) | (t[1:] != t[:-1])
        starts = np.flatnonzero(new)
        sections[size] = section_from_sorted(size, a0[starts], a1[starts], t[starts], np.add.reduceat(c, starts))
    return SortedCache(sections, **meta)


def from_table(table: HashTable, **meta) -> SortedCache:
    """The sorted form of a context/dynamic :class:`HashTable`."""
    return cache_from_rows(*table.arrays(), **meta)


@njit(cache=True)
def _merge_sorted_packed(a, ca, b, cb):
    """Merge two sorted unique int64 arrays with counts, summing equal keys."""
    out = np.empty(a.size + b.size, np.int64)
    cout = np.empty(a.size + b.size, ca.dtype)
    i = j = m = 0
    while i < a.size or j < b.size:
        if j >= b.size or (i < a.size and a[i] < b[j]):
            out[m], cout[m] = a[i], ca[i]
            i += 1
        elif i >= a.size or b[j] < a[i]:
            out[m], cout[m] = b[j], cb[j]
            j += 1
        else:
            out[m], cout[m] = a[i], ca[i] + cb[j]
            i += 1
            j += 1
        m += 1
    return out[:m], cout[:m]


def _count_sorted(x: np.ndarray, dtype) -> tuple[np.ndarray, np.ndarray]:
    """Unique values and counts of a sorted array."""
    if not len(x):
        return x, np.zeros(0, dtype)
    new = np.ones(len(x), bool)
    new[1:] = x[1:] != x[:-1]
    starts = np.flatnonzero(new)
    return x[starts], np.diff(np.append(starts, len(x))).astype(dtype)


def build_static(tokens, *, chunk: int = BUILD_CHUNK, progress=None, **meta) -> SortedCache:
    """The static cache of a token stream, as ``llama-lookup-create`` builds it (lookup-create.cpp:30-37):
    ``c_st((t[i-2], t[i-1]), t[i]) += 1`` for ``i = 2..N-1``, 2-grams only.

    Each chunk's (2-gram, follower) triples are packed into one int64 (21 bits per token), radix-sorted and
    counted; the sorted chunk counts are merged pairwise (like a merge sort), so memory stays
    proportional to the distinct triples plus one chunk. ``progress(done, total)`` (optional) is called
    after each chunk with the tokens counted so far.
    """
    t = np.asarray(tokens)
    if t.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {t.shape}")
    if t.size and int(t.min()) < 0:
        i = int(np.argmax(t < 0))
        raise ValueError(f"negative token id {int(t[i])} at index {i}; token ids must be >= 0")
    N = t.size
    if N < 3:
        return SortedCache({}, **meta)
    if int(t.max()) >= 1 << PACK_BITS:
        w0 = (t[:-2].astype(np.int64) << 32) | t[1:-1].astype(np.int64)
        return cache_from_rows(w0, np.full(N - 2, -1, np.int64), t[2:], np.ones(N - 2, np.int64), **meta)
    stack: list[tuple[np.ndarray, np.ndarray]] = []
    scratch = np.empty(min(chunk, N - 2), np.int64)
    for lo in range(2, N, chunk):
        hi = min(N, lo + chunk)
        packed = (t[lo - 2:hi - 2].astype(np.int64) << 2 * PACK_BITS) | (t[lo - 1:hi - 1].astype(np.int64) << PACK_BITS)
        packed |= t[lo:hi]
        radix_sort(packed, 0, scratch)
        run = _count_sorted(packed, np.int32 if N < 2**31 else np.int64)  # counts <= N
        del packed
        while stack and len(stack[-1][0]) <= 2 * len(run[0]):
            run = _merge_sorted_packed(*stack.pop(), *run)
        stack.append(run)
        if progress is not None:
            progress(hi, N)
    keys, counts = stack.pop()
    while stack:
        keys, counts = _merge_sorted_packed(*stack.pop(), keys, counts)
    if counts.size and counts.max() > INT32_MAX:
        raise ValueError("a count exceeds 2**31-1 (int32 in cache files)")
    section = Section(2, *_unpack_2grams(keys, counts, PACK_BITS))
    del keys, counts
    return SortedCache({2: section._replace(top=static_top(section.offsets, section.tokens, section.counts))}, **meta)


@njit(cache=True)
def _unpack_2grams(packed, counts, bits):
    """Section arrays (keys, offsets, tokens, counts, top placeholder) of sorted packed 2-gram triples."""
    E = packed.size
    K = 0
    for j in range(E):
        if j == 0 or (packed[j] >> bits) != (packed[j - 1] >> bits):
            K += 1
    keys = np.empty(K, np.int64)
    offsets = np.empty(K + 1, np.uint32)
    tokens = np.empty(E, np.int32)
    counts32 = np.empty(E, np.int32)
    mask = (1 << bits) - 1
    k = -1
    for j in range(E):
        key = packed[j] >> bits
        if j == 0 or key != (packed[j - 1] >> bits):
            k += 1
            keys[k] = ((key >> bits) << 32) | (key & mask)
            offsets[k] = j
        tokens[j] = packed[j] & mask
        counts32[j] = counts[j]
    offsets[K] = E
    return keys, offsets, tokens, counts32, np.empty(0, np.int32)


@njit(cache=True)
def _merge_rows(a0, a1, at, ac, b0, b1, bt, bc):
    """Merge two row sets sorted by (w0, w1, token), summing equal rows."""
    n = a0.size + b0.size
    o0, o1 = np.empty(n, np.int64), np.empty(n, np.int64)
    ot, oc = np.empty(n, np.int32), np.empty(n, np.int64)
    i = j = m = 0
    while i < a0.size or j < b0.size:
        if j >= b0.size:
            cmp = -1
        elif i >= a0.size:
            cmp = 1
        elif a0[i] != b0[j]:
            cmp = -1 if a0[i] < b0[j] else 1
        elif a1[i] != b1[j]:
            cmp = -1 if a1[i] < b1[j] else 1
        elif at[i] != bt[j]:
            cmp = -1 if at[i] < bt[j] else 1
        else:
            cmp = 0
        if cmp < 0:
            o0[m], o1[m], ot[m], oc[m] = a0[i], a1[i], at[i], ac[i]
            i += 1
        elif cmp > 0:
            o0[m], o1[m], ot[m], oc[m] = b0[j], b1[j], bt[j], bc[j]
            j += 1
        else:
            o0[m], o1[m], ot[m], oc[m] = a0[i], a1[i], at[i], ac[i] + bc[j]
            i += 1
            j += 1
        m += 1
    return o0[:m], o1[:m], ot[:m], oc[:m]


def merge_caches(caches, **meta) -> SortedCache:
    """A new cache with the counts of all ``caches`` summed (``llama-lookup-merge``); sections are
    merged as sorted rows. Accepts :class:`SortedCache` and :class:`HashTable` inputs."""
    caches = [from_table(c) if isinstance(c, HashTable) else c for c in caches]
    sections = {}
    for n in range(1, NGRAM_MAX + 1):
        acc = None
        for c in caches:
            s = c.section(n)
            if s is None:
                continue
            w0, w1, t, cnt = s.rows()
            rows = (w0, w1, t, cnt.astype(np.int64))
            acc = rows if acc is None else _merge_rows(*readonly(*acc, *rows))
        if acc is not None:
            sections[n] = section_from_sorted(n, *acc)
    if not meta:
        meta = merged_tokenizer(caches)
    return SortedCache(sections, **meta)


def merged_tokenizer(caches) -> dict:
    """The tokenizer record of a merge: the one the inputs record (unknown ones are ignored); inputs
    built for different tokenizers cannot be merged."""
    vocab = {c.vocab_size for c in caches if c.vocab_size}
    prints = {bytes(c.fingerprint) for c in caches if any(c.fingerprint)}
    if len(vocab) > 1 or len(prints) > 1:
        raise ValueError(f"cannot merge caches built for different tokenizers (vocabulary sizes {sorted(vocab)}, "
                         f"{len(prints)} fingerprints)")
    return {"vocab_size": vocab.pop() if vocab else 0, "fingerprint": prints.pop() if prints else bytes(32)}
