"""Cache files: our memory-mapped format (``docs/cache-format.md``) and llama.cpp's format.

:func:`detect_format` tells the two apart by the first 8 bytes (ours starts with the magic
``NGRAMSPC``; llama.cpp's format has no magic). Opening our format maps the file and checks the
header only -- nothing is parsed or copied, the arrays are views of the mapping. llama.cpp's format is
read into the same sorted arrays (vectorized), checked like ``reference.ngram.cache_file`` checks it.
Either format, any kind of cache: :mod:`mlx_backend.ngram.caches`.

>>> import tempfile, os
>>> from mlx_backend.ngram.sorted_cache import build_static
>>> d = tempfile.mkdtemp()
>>> c = build_static(np.array([1, 2, 3, 1, 2, 4], np.int32))
>>> save_ours(c, os.path.join(d, "c.ngc"))
>>> save_llama(c, os.path.join(d, "c.bin"))
>>> detect_format(os.path.join(d, "c.ngc")), detect_format(os.path.join(d, "c.bin"))
('ours', 'llama')
>>> open_ours(os.path.join(d, "c.ngc")) == read_llama(os.path.join(d, "c.bin")) == c
True
"""
from __future__ import annotations

import mmap
import os
import queue
import struct
import sys
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from mlx_backend.machine.numba_cache import njit
from mlx_backend.ngram.hash_table import NGRAM_MAX, words_to_slots
from mlx_backend.ngram.radix_sort import radix_sort, radix_sort_threads
from mlx_backend.ngram.sorted_cache import INT32_MAX, Section, SortedCache, static_top
from reference.atomic import atomic_write
from reference.ngram.file_errors import EMPTY_CACHE, EMPTY_FILE, CacheFileError
from reference.ngram.tokens import read_bytes
# the layout's constants (docs/cache-format.md) are shared with the reference's plain reader
from reference.ngram.ours_file import (ALIGN, BOM, CRC_AT, HEADER_SIZE, MAGIC, PREFIX, SECTION, VERSION,  # noqa: F401
                                 detect_format, tokenizer_fingerprint, tokenizer_mismatch, vocab_fingerprint)

FORMATS = ("ours", "llama")


class CacheFormatError(CacheFileError):
    """A cache file of our format that is truncated, corrupt, of another version, or built for another tokenizer."""

    def __init__(self, path, offset: int, problem: str):
        self.path, self.offset, self.problem = str(path), offset, problem
        ValueError.__init__(self, f"cache file {path}: {problem} at byte offset {offset}")


def _align(x: int) -> int:
    return -(-x // ALIGN) * ALIGN


# ----------------------------------------------------------------------------- our format


def save_ours(cache: SortedCache, path: str | os.PathLike) -> None:
    """Write ``cache`` in our format (docs/cache-format.md)."""
    if sys.byteorder != "little":
        raise OSError("writing cache files needs a little-endian machine")
    layout, pos, table = [], HEADER_SIZE, []
    for n in range(1, NGRAM_MAX + 1):
        s = cache.section(n)
        arrays = ((np.zeros(0, np.int64), np.zeros(1, np.uint32), np.zeros(0, np.int32), np.zeros(0, np.int32),
                   np.zeros(0, np.int32)) if s is None else (s.keys, s.offsets, s.tokens, s.counts, s.top))
        offs = []
        for a in arrays:
            pos = _align(pos)
            offs.append(pos)
            layout.append((pos, np.ascontiguousarray(a)))
            pos += a.nbytes
        total = 0 if s is None else int(s.counts.sum(dtype=np.int64))
        table.append(SECTION.pack(len(arrays[4]), len(arrays[2]), total, *offs))
    fp = bytes(cache.fingerprint or bytes(32))
    if len(fp) != 32:
        raise ValueError(f"tokenizer fingerprint must be 32 bytes, got {len(fp)}")
    head = PREFIX.pack(MAGIC, VERSION, BOM, HEADER_SIZE, int(cache.vocab_size or 0), fp) + b"".join(table)
    head += struct.pack("<I", zlib.crc32(head))
    with atomic_write(path) as f:
        f.write(head.ljust(HEADER_SIZE, b"\0"))
        for off, a in layout:
            f.write(b"\0" * (off - f.tell()))
            a.tofile(f)


def open_ours(path: str | os.PathLike, verify: bool = False) -> SortedCache:
    """Map a file of our format; only the header is read (``verify=True`` also checks every array and each
    section's ``total``)."""
    size = os.path.getsize(path)
    if size < HEADER_SIZE:
        raise CacheFormatError(path, size, f"truncated header: {size} bytes, the header needs {HEADER_SIZE}")
    if sys.byteorder != "little":
        raise CacheFormatError(path, 0, "memory-mapping needs a little-endian machine")
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    head = bytes(mm[:HEADER_SIZE])
    magic, version, bom, header_size, vocab_size, fingerprint = PREFIX.unpack_from(head)
    if magic != MAGIC:
        raise CacheFormatError(path, 0, f"bad magic {magic!r} (expected {MAGIC!r})")
    if bom != BOM:
        raise CacheFormatError(path, 12, f"byte-order mark {bom:#010x} (expected {BOM:#010x}): wrong endianness")
    if version != VERSION:
        raise CacheFormatError(path, 8, f"unsupported version {version} (this build reads version {VERSION}); "
                                        "rebuild the cache or convert it with a matching ngram-spec")
    (crc,) = struct.unpack_from("<I", head, CRC_AT)
    if crc != zlib.crc32(head[:CRC_AT]) or header_size != HEADER_SIZE:
        raise CacheFormatError(path, CRC_AT, "header checksum mismatch (corrupt header)")
    sections, totals, array_at = {}, {}, {}
    end = HEADER_SIZE
    for n in range(1, NGRAM_MAX + 1):
        at = PREFIX.size + (n - 1) * SECTION.size
        K, E, total, k_off, o_off, t_off, c_off, top_off = SECTION.unpack_from(head, at)
        totals[n] = (total, at)
        kw = 1 if n <= 2 else 2
        spans = ((k_off, K * kw, np.int64), (o_off, K + 1, np.uint32), (t_off, E, np.int32),
                 (c_off, E, np.int32), (top_off, K, np.int32))
        arrays = []
        array_at[n] = dict(zip(Section._fields[1:], (off for off, _, _ in spans)))   # keys, offsets, .., top
        for off, count, dtype in spans:
            nbytes = count * np.dtype(dtype).itemsize
            if off % ALIGN or off < HEADER_SIZE:
                raise CacheFormatError(path, at, f"section n={n}: misaligned array offset {off}")
            if off + nbytes > size:
                raise CacheFormatError(path, size, f"truncated file: section n={n} needs bytes up to {off + nbytes}, "
                                                   f"the file has {size}")
            arrays.append(mm[off:off + nbytes].view(dtype))
            end = max(end, off + nbytes)
        if kw == 2:
            arrays[0] = arrays[0].reshape(K, 2)
        if K:
            sections[n] = Section(n, *arrays)
    if size != end:
        raise CacheFormatError(path, end, f"{size - end} unexpected trailing bytes")
    cache = SortedCache(sections, vocab_size=vocab_size, fingerprint=fingerprint, source=str(path))
    if verify:
        verify_cache(cache, path, array_at)
        for n, (total, at) in totals.items():   # the section table's total: the sum of the section's counts
            counted = int(sections[n].counts.sum(dtype=np.int64)) if n in sections else 0
            if total != counted:
                raise CacheFormatError(path, at, f"section n={n}: total {total} is not the sum of its counts "
                                                 f"({counted})")
    return cache


def verify_cache(cache: SortedCache, path: str | os.PathLike = "<memory>", at: dict | None = None) -> None:
    """Check every array of a cache: keys strictly increasing, offsets consistent, followers
    strictly increasing per key, counts positive, ``top`` equal to the static-only rule. ``at[n]``: the byte
    offset of section n's arrays in the file (``keys``, ``offsets``, ``tokens``, ``counts``, ``top``), so an
    error names the byte of the first bad element (0 when unknown)."""
    for n, s in cache.sections.items():
        where = f"section n={n}"

        def fail(array: str, index, problem: str):
            a = getattr(s, array)
            byte = at[n][array] + int(index) * a.itemsize * (a.shape[1] if a.ndim == 2 else 1) if at else 0
            raise CacheFormatError(path, byte, f"{where}: {problem}")

        off = s.offsets.astype(np.int64)
        bad = np.flatnonzero(np.diff(off) <= 0)
        if off[0] != 0 or bad.size or off[-1] != s.n_entries:
            fail("offsets", 0 if off[0] != 0 else bad[0] + 1 if bad.size else len(off) - 1,
                 f"offsets are not increasing from 0 to {s.n_entries}")
        k = s.keys if s.keys.ndim == 2 else s.keys[:, None]
        if len(k) > 1:
            d = k[1:] != k[:-1]
            first = np.argmax(d, axis=1)
            r = np.arange(len(first))
            bad = np.flatnonzero(~(d.any(axis=1) & (k[1:][r, first] > k[:-1][r, first])))
            if bad.size:
                fail("keys", bad[0] + 1, "n-gram keys are not strictly increasing")
        for array, bad in (("tokens", s.tokens < 0), ("counts", s.counts <= 0)):
            if np.any(bad):
                fail(array, np.argmax(bad), "negative token or non-positive count")
        same_key = np.ones(s.n_entries, bool)
        same_key[off[:-1]] = False
        bad = np.flatnonzero(same_key[1:] & (s.tokens[1:] <= s.tokens[:-1]))
        if bad.size:
            fail("tokens", bad[0] + 1, "followers are not strictly increasing")
        bad = np.flatnonzero(static_top(s.offsets, s.tokens, s.counts) != s.top)
        if bad.size:
            fail("top", bad[0], "stored static-only drafts disagree with the counts")
        if cache.vocab_size and s.n_entries and (int(s.tokens.max()) >= cache.vocab_size):
            fail("tokens", np.argmax(s.tokens >= cache.vocab_size),
                 f"token {int(s.tokens.max())} >= vocab size {cache.vocab_size}")


# ----------------------------------------------------------------------------- llama.cpp's format


CHUNK_WORDS = 1 << 20  # the file is read in 4 MiB steps; pages read are released from the process
THREADS = 4  # at most, for the steps that place followers
SORT_BATCH = 1 << 18  # entries of long follower lists sorted at once (2 MiB)


@njit(cache=True)
def _scan_llama(words, o, stop, r, w0, w1, size, nt):
    """Walk the records of a llama.cpp cache file (int32 words) that start in ``[o, stop)``, checking
    each record's n-gram, follower count and length as ``reference.ngram.cache_file.load_cache`` does (the
    followers are checked where they are placed, :func:`_place_followers`; repeats after sorting), and
    store record r's key words (``w1`` for n >= 3 only; it is -1 otherwise), n-gram size and follower
    count. Returns ``(o, r, error, error_word, bad_value)``: the next record's word and index; error 0
    = ok, 1 = truncated header, 2 = invalid n-gram, 3 = ntokens <= 0, 4 = truncated followers (record
    r-1, stored with no followers)."""
    W = words.size
    while o < stop:
        if o + 5 > W:
            return o, r, 1, o, 0
        n = 4
        for i in range(4):
            if words[o + i] == -1:
                n = i
                break
        ok = n > 0
        for i in range(4):
            if (i < n and words[o + i] < 0) or (i >= n and words[o + i] != -1):
                ok = False
        if not ok:
            return o, r, 2, o, 0
        f = np.int64(words[o + 4])
        if f <= 0:
            return o, r, 3, o + 4, f
        w0[r] = (np.int64(words[o]) << 32) | (np.int64(words[o + 1]) & 0xFFFFFFFF)
        if n > 2:
            w1[r] = (np.int64(words[o + 2]) << 32) | (np.int64(words[o + 3]) & 0xFFFFFFFF)
        size[r] = n
        nt[r] = f
        r += 1
        if o + 5 + 2 * f > W:
            nt[r - 1] = 0
            return o, r, 4, o + 5, f
        o += 5 + 2 * f
    return o, r, 0, 0, 0


def _sort_keys(a0: np.ndarray, rec: np.ndarray, nt: np.ndarray, offsets: np.ndarray, dst: np.ndarray,
               pool: ThreadPoolExecutor, threads: int):
    """``(keys, order)``: the key words ``a0`` (n <= 2; of records ``rec``, or of all records if it is
    empty) sorted, and the index of each; equal keys keep their order. The follower lists are laid
    out as :func:`_layout` does. Where ``(t0, t1, index)`` fits in one int64 (token ids below
    ``2**21`` for 4 M records) that packing, made in ``a0``'s place, is radix-sorted by its ``(t0,
    t1)`` bits, with each record's follower count in spare bits where they hold it (so laying out
    reads no other array); else ``a0`` is argsorted. Sorting and laying out run on ``pool``'s threads."""
    R = len(a0)
    hi, lo = _max_halves(a0)
    rb, hb, lb = max(1, (R - 1).bit_length()), hi.bit_length(), lo.bit_length()
    if rb + hb + lb > 63:
        order = np.argsort(a0, kind="stable")
        _layout(order, rec, nt, offsets, dst)
        return a0[order], order
    cb = min(8, 63 - rb - hb - lb)  # bits for the follower count; a count that does not fit is read from nt
    _pack_keys(a0, rec, nt, lb, cb, rb)
    keys = np.empty_like(a0)  # the sort's scratch, then the keys
    radix_sort_threads(a0, cb + rb, keys, threads)
    bounds = np.linspace(0, R, threads + 1).astype(np.int64)  # each thread lays out a range of keys
    spans = list(zip(bounds[:-1], bounds[1:]))
    first = np.cumsum([0, *pool.map(lambda ab: _entries(a0[ab[0]:ab[1]], rec, nt, cb, rb), spans[:-1])])
    ends = pool.map(lambda i: _unpack_keys(a0[spans[i][0]:spans[i][1]], rec, nt, lb, cb, rb,
                                           offsets[spans[i][0]:spans[i][1]], dst, keys[spans[i][0]:spans[i][1]],
                                           first[i]), range(len(spans)))
    offsets[R] = list(ends)[-1]
    return keys, a0


@njit(cache=True)
def _max_halves(a0):
    """The largest high and low 32-bit halves of the key words (without temporaries)."""
    hi = lo = 0
    for x in a0:
        hi, lo = max(hi, x >> 32), max(lo, x & 0xFFFFFFFF)
    return hi, lo


@njit(cache=True)
def _pack_keys(a0, rec, nt, lb, cb, rb):
    """Each key word becomes ``t0, t1, min(follower count, 2**cb - 1), index`` in ``hb + lb + cb + rb`` bits."""
    cap = (np.int64(1) << cb) - 1
    for i in range(a0.size):
        f = min(np.int64(nt[i if rec.size == 0 else rec[i]]), cap)
        a0[i] = ((((a0[i] >> 32) << lb | (a0[i] & 0xFFFFFFFF)) << cb | f) << rb) | i


@njit(cache=True, nogil=True, inline="always")
def _followers(x, rec, nt, rb, low, cap):
    """``(record, follower count)`` of packed key ``x`` (``low``: its ``rb`` index bits; ``cap``: the
    largest count its spare bits hold, which means the count is read from ``nt``)."""
    i = x & low
    r = i if rec.size == 0 else rec[i]
    f = (x >> rb) & cap
    return r, nt[r] if f == cap else f


@njit(cache=True, nogil=True)
def _entries(packed, rec, nt, cb, rb):
    """The number of followers of the packed keys ``packed``."""
    low, cap = (np.int64(1) << rb) - 1, (np.int64(1) << cb) - 1
    total = 0
    for x in packed:
        total += _followers(x, rec, nt, rb, low, cap)[1]
    return total


@njit(cache=True, nogil=True)
def _unpack_keys(packed, rec, nt, lb, cb, rb, offsets, dst, keys, off):
    """The key words of sorted packed keys into ``keys``, laid out as :func:`_layout` does from
    entry ``off`` on (``offsets``: one per key); ``packed`` is left holding the index of each.
    Returns the entry after the last follower."""
    low, cap = (np.int64(1) << rb) - 1, (np.int64(1) << cb) - 1
    for k in range(packed.size):
        x = packed[k]
        r, f = _followers(x, rec, nt, rb, low, cap)
        offsets[k] = off
        dst[r] = off
        off += f
        packed[k] = x & low
        x >>= cb + rb
        keys[k] = (x >> lb) << 32 | (x & ((np.int64(1) << lb) - 1))
    return off


@njit(cache=True)
def _layout(order, rec, nt, offsets, dst):
    """Follower offsets of the sorted keys (``order``: record of each, through ``rec`` unless empty)
    and each record's first entry ``dst``."""
    off = 0
    for k in range(order.size):
        r = order[k] if rec.size == 0 else rec[order[k]]
        offsets[k] = off
        dst[r] = off
        off += nt[r]
    offsets[order.size] = off


SMALL = 64  # followers sorted in the placing loop; longer lists are radix-sorted in batches afterwards


@njit(cache=True, nogil=True)
def _place_followers(words, o, r, R, cut, dst, size, base, tokens, counts, big, n_big):
    """Copy the followers of records r..R-1 (file order, record r at word ``o``; record ``cut``, if
    any, is truncated: none are read) to ``base[n] + dst[r]`` onward, checking each as the reference
    does; lists of up to ``SMALL`` are sorted by token here (an insertion sort of ``token << 32 |
    count`` in a local buffer), longer ones are listed in ``big[n_big..]`` as ``(first entry, length,
    word)`` for :func:`_sort_big`, which places them. Stops at the first problem: returns ``(n_big,
    word, problem)``, problem 0 = none, 5 = negative follower token, 6 = non-positive count (both after
    the repeats among the record's earlier followers), 7 = a repeated follower in a short list (its
    first repeat in file order)."""
    buf = np.empty(SMALL, np.int64)
    while r < R:
        f = 0 if r == cut else np.int64(words[o + 4])
        b = o + 5
        d = base[size[r]] + dst[r]
        for k in range(f):
            y, c = words[b + 2 * k], words[b + 2 * k + 1]
            if y < 0 or c <= 0:
                rep = _first_repeat(words[b:b + 2 * k:2])
                if rep >= 0:
                    return n_big, b + 2 * rep, 7
                return n_big, b + 2 * k + (y >= 0), 5 if y < 0 else 6
            if f <= SMALL:  # counts are positive: the packing orders by token, then count
                x = np.int64(y) << 32 | np.int64(c)
                i = k
                while i > 0 and buf[i - 1] > x:
                    buf[i] = buf[i - 1]
                    i -= 1
                buf[i] = x
        if f > SMALL:
            big[n_big, 0], big[n_big, 1], big[n_big, 2] = d, f, b
            n_big += 1
        else:
            for k in range(f):
                y = buf[k] >> 32
                if k and y == buf[k - 1] >> 32:  # a repeat: find the first one in file order
                    return n_big, b + 2 * _first_repeat(words[b:b + 2 * f:2]), 7
                tokens[d + k], counts[d + k] = y, buf[k] & 0xFFFFFFFF
        o = b + 2 * np.int64(words[o + 4])
        r += 1
    return n_big, -1, 0


@njit(cache=True)
def _first_repeat(t):
    """Index of the first element of ``t`` equal to an earlier one."""
    for a in range(1, t.size):
        for p in range(a):
            if t[a] == t[p]:
                return a
    return -1


@njit(cache=True, nogil=True)
def _sort_big(words, big, tokens, counts, x, tmp):
    """Place the long follower lists ``big`` (read from the file's ``words``) sorted by token, many
    lists per radix sort of up to ``x.size`` entries (scratch ``x``, ``tmp``: at least the longest
    list): entry ``(y, c)`` of the ``q``-th list of a batch as ``(q * V + y) << 32 | c``, V = 1 + the
    largest token, ``q * V + y < 2**31``. Returns the word of the first repeated follower in file
    order among them, or -1."""
    L = big.shape[0]
    if L == 0:
        return -1
    V = np.int64(_max_token(big, words)) + 1
    lists = max(1, INT32_MAX // V)
    i = 0
    while i < L:
        j, n = i + 1, big[i, 1]
        while j < L and j - i < lists and n + big[j, 1] <= x.size:
            n += big[j, 1]
            j += 1
        _pack_lists(big[i:j], words, V, x[:n])
        radix_sort(x[:n], 32, tmp)
        q = _unpack_lists(big[i:j], x[:n], tokens, counts, V)
        if q >= 0:
            b, f = big[i + q, 2], big[i + q, 1]
            return b + 2 * _first_repeat(words[b:b + 2 * f:2])
        i = j
    return -1


@njit(cache=True)
def _max_token(big, words):
    m = 0
    for i in range(big.shape[0]):
        for k in range(big[i, 1]):
            m = max(m, words[big[i, 2] + 2 * k])
    return m


@njit(cache=True)
def _pack_lists(big, words, V, x):
    p = 0
    for q in range(big.shape[0]):
        b = big[q, 2]
        for k in range(big[q, 1]):
            x[p] = (q * V + np.int64(words[b + 2 * k])) << 32 | words[b + 2 * k + 1]
            p += 1


@njit(cache=True)
def _unpack_lists(big, x, tokens, counts, V):
    """Write back the sorted batch ``x``; returns the first list holding a repeated token, or -1."""
    p = 0
    for q in range(big.shape[0]):
        d = big[q, 0]
        for k in range(d, d + big[q, 1]):
            tokens[k], counts[k] = (x[p] >> 32) - q * V, x[p] & 0xFFFFFFFF
            if k > d and tokens[k] == tokens[k - 1]:
                return q
            p += 1
    return -1


@njit(cache=True)
def _record_start(words, r):
    """Word offset of record ``r`` (records before it are well formed)."""
    o = 0
    for _ in range(r):
        o += 5 + 2 * np.int64(words[o + 4])
    return o


def _open_words(path: Path):
    """``(words, mapping)``: the file as little-endian int32 words, memory-mapped (``mapping``, or
    None for ``.xz``, which is decompressed into memory)."""
    mapping = None
    if path.suffix == ".xz":
        data = np.frombuffer(read_bytes(path), np.uint8)
    else:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None
        data = np.frombuffer(mapping, np.uint8) if size else np.zeros(0, np.uint8)
    if len(data) % 4:
        raise CacheFileError(path, len(data) - len(data) % 4,
                             f"file size {len(data)} is not a multiple of 4: a truncated int32", needed=4,
                             left=len(data) % 4)
    if not len(data):
        raise CacheFileError(path, 0, EMPTY_FILE)
    return data.view("<i4").astype(np.int32, copy=False), mapping


def _release(mapping, start_word: int, end_word: int) -> None:
    """Drop the mapped pages of words ``[start, end)`` from the process (the page cache keeps them)."""
    lo, hi = -(-4 * start_word // mmap.PAGESIZE) * mmap.PAGESIZE, 4 * end_word // mmap.PAGESIZE * mmap.PAGESIZE
    if mapping is not None and hi > lo and hasattr(mapping, "madvise"):
        mapping.madvise(mmap.MADV_DONTNEED, lo, hi - lo)


def read_llama(path: str | os.PathLike) -> SortedCache:
    """Read llama.cpp's format (``common_ngram_cache_load``, ngram-cache.cpp:222-258) into sorted
    arrays with the checks of :func:`reference.ngram.cache_file.load_cache`, reporting the same first
    problem at the same byte offset (the smallest offset among the first problem of each kind).

    Two compiled passes over the mapped file in 4 MiB steps (pages are released behind them): the
    first checks the records and stores their keys, the second checks and places the followers; one
    radix sort of the keys per n-gram size, and batched radix sorts of the long follower lists. All
    but the first pass run on up to ``THREADS`` threads; no per-entry Python objects. Besides the
    result, memory holds per record the key word, follower count, size and first entry (arrays sized
    by the ``len // 28`` bound on the records are touched only as far as records exist)."""
    threads = min(THREADS, os.cpu_count() or 1)
    with ThreadPoolExecutor(threads) as pool:  # numba's compiled loops release the GIL
        return _read_llama(Path(path), pool, threads)


def _scan_problem(err: int, words: np.ndarray, at: int, value: int) -> tuple[str, dict]:
    """The message and sizes of :func:`_scan_llama`'s error code ``err`` at word ``at`` (the first of each
    kind is reported, in file order)."""
    left = 4 * (words.size - at)
    return {1: lambda: ("truncated record header", dict(needed=20, left=left)),
            2: lambda: (f"invalid n-gram {words[at:at + 4].tolist()} (expected 1..4 token ids >= 0 then -1)", {}),
            3: lambda: (f"non-positive follower count ntokens={value}", {}),
            4: lambda: (f"truncated record: ntokens={value} followers", dict(needed=8 * value, left=left))}[err]()


def _read_llama(path: Path, pool: ThreadPoolExecutor, threads: int) -> SortedCache:
    words, mapping = _open_words(path)
    W = words.size
    bound = W // 7 + 1  # a record has at least 7 words
    w0, w1, nt = np.empty(bound, np.int64), np.empty(bound, np.int64), np.empty(bound, np.int32)
    size = np.empty(bound, np.uint8)
    o = R = err = 0
    steps = []  # (first word, first record) of each step
    while o < W and not err:
        steps.append((o, R))
        o, R, err, at, value = _scan_llama(words, o, min(W, o + CHUNK_WORDS), R, w0, w1, size, nt)
        _release(mapping, steps[-1][0], o)
    steps.append((o, R))
    first = [(4 * at, *_scan_problem(err, words, at, value))] if err else []  # (byte offset, problem, sizes)
    w0, w1, size, nt = w0[:R], w1[:R], size[:R], nt[:R]
    sizes = [n for n in range(1, NGRAM_MAX + 1) if np.any(size == n)]
    base = np.zeros(NGRAM_MAX + 2, np.int64)  # first entry of each size's section; the total last
    dst = np.empty(R, np.uint32)
    sections = {}
    for n in sizes:
        rec = np.flatnonzero(size == n) if len(sizes) > 1 else np.zeros(0, np.int64)
        a0 = w0[rec] if len(rec) else w0
        E = int(nt[rec].sum(dtype=np.int64) if len(rec) else nt.sum(dtype=np.int64))
        if E >= 2**32:
            raise ValueError(f"a section holds at most 2**32-1 entries, got {E}")
        offsets = np.empty(len(a0) + 1, np.uint32)
        if n <= 2:
            keys, order = _sort_keys(a0, rec, nt, offsets, dst, pool, threads)
            same = keys[1:] == keys[:-1]
        else:
            order = np.lexsort((w1[rec] if len(rec) else w1, a0))
            keys = np.column_stack([a0[order], (w1[rec] if len(rec) else w1)[order]])
            same = (keys[1:] == keys[:-1]).all(axis=1)
            _layout(order, rec, nt, offsets, dst)
        if same.any():  # a repeated n-gram: report its first repeat in file order (both sorts are stable)
            r = int(order[1:][same].min())
            r = int(rec[r]) if len(rec) else r
            o = _record_start(words, r)
            first.append((4 * o, f"duplicate n-gram {tuple(words[o:o + n].tolist())}", {}))
        del a0, same, order, rec
        sections[n] = (keys, offsets, E)
        base[n + 1:] += E
    del w0, w1
    tokens, counts = np.empty(base[-1], np.int32), np.empty(base[-1], np.int32)
    n_big = np.cumsum([0] + [np.count_nonzero(nt[r0:r1] > SMALL) for (_, r0), (_, r1) in zip(steps, steps[1:])])
    big = np.empty((int(n_big[-1]), 3), np.int64)
    cut = R - 1 if err == 4 else -1  # a truncated last record: its followers are not read
    longest = int(nt.max(initial=0))
    scratch = queue.SimpleQueue()  # one pair of sort buffers per thread, allocated here: memory freed in a
    for _ in range(threads):  # worker thread's arena is not reused by the main thread
        scratch.put(np.empty((2, max(SORT_BATCH, longest)), np.int64))
    del nt  # the placing reads each record's follower count from the file

    def place(i):  # the steps run in parallel, each writing its own records' entries and rows of big
        (o0, r0), (o1, r1) = steps[i], steps[i + 1]
        end, at, problem = _place_followers(words, o0, r0, r1, cut, dst, size, base, tokens, counts, big, n_big[i])
        x = scratch.get()
        dup = _sort_big(words, big[n_big[i]:end], tokens, counts, *x)  # the long lists before any problem
        scratch.put(x)
        _release(mapping, o0, o1)
        return (dup, 7) if dup >= 0 and (not problem or dup < at) else (at, problem)

    placed = list(pool.map(place, range(len(steps) - 1)))
    at, problem = next((p for p in placed if p[1]), (-1, 0))  # the first problem in file order
    del scratch
    if problem:
        first.append((4 * at, {5: "negative follower token", 6: "non-positive count",
                               7: "duplicate follower"}[problem] + f" {int(words[at])}", {}))
    if first:
        offset, problem, sizes = min(first, key=lambda e: e[:2])
        raise CacheFileError(path, offset, problem, **sizes)
    del dst, size
    out = {}
    for n, (keys, offsets, E) in sections.items():
        t, c = tokens[base[n]:base[n] + E], counts[base[n]:base[n] + E]
        out[n] = Section(n, keys, offsets, t, c, static_top(offsets, t, c, threads))
    return SortedCache(out, source=str(path))


def save_llama(cache: SortedCache, path: str | os.PathLike) -> None:
    """Write llama.cpp's format: records sorted by size then n-gram, followers by token (the order
    ``reference.ngram.cache_file.save_cache`` uses, so both backends write identical bytes)."""
    parts = []
    for n, s in cache.sections.items():
        w0, w1 = s.key_words()
        K, E = s.n_keys, s.n_entries
        f = np.diff(s.offsets.astype(np.int64))
        rec_len = 5 + 2 * f
        rec_start = np.cumsum(rec_len) - rec_len
        out = np.empty(5 * K + 2 * E, np.int32)
        slots = words_to_slots(w0, w1)
        for c in range(4):
            out[rec_start + c] = slots[:, c]
        out[rec_start + 4] = f
        j = np.repeat(rec_start + 5, f) + 2 * (np.arange(E) - np.repeat(s.offsets[:-1].astype(np.int64), f))
        out[j] = s.tokens
        out[j + 1] = s.counts
        parts.append(out)
    if not parts:
        raise ValueError(EMPTY_CACHE)
    data = np.concatenate(parts)
    data = data.astype("<i4")
    with atomic_write(path) as f:
        data.tofile(f)


# ----------------------------------------------------------------------------- either format


def check_tokenizer(cache: SortedCache, path, vocab_size: int | None, fingerprint: bytes | None) -> None:
    """Refuse a cache built for another tokenizer (as far as the file records it;
    ``reference.ngram.ours_file.tokenizer_mismatch`` states the rule)."""
    problem = tokenizer_mismatch(cache.vocab_size, cache.fingerprint, vocab_size, fingerprint)
    if problem:
        raise CacheFormatError(path, 24 if problem.startswith("built for a vocabulary") else 32, problem)
