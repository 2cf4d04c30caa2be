"""Cache files: our memory-mapped format (``docs/cache-format.md``) and llama.cpp's format.

``load_cache(path)`` tells the two apart by the first 8 bytes (ours starts with the magic
``NGRAMSPC``; llama.cpp's format has no magic). Opening our format maps the file and checks the
header only -- nothing is parsed or copied, the arrays are views of the mapping. llama.cpp's format is
read into the same sorted arrays (vectorized), checked like ``reference.cache_file`` checks it.

>>> import tempfile, os
>>> from mlx_backend.tables_sorted import build_static
>>> d = tempfile.mkdtemp()
>>> c = build_static(np.array([1, 2, 3, 1, 2, 4], np.int32))
>>> save_cache(c, os.path.join(d, "c.ngc"), format="ours")
>>> save_cache(c, os.path.join(d, "c.bin"), format="llama")
>>> detect_format(os.path.join(d, "c.ngc")), detect_format(os.path.join(d, "c.bin"))
('ours', 'llama')
>>> load_cache(os.path.join(d, "c.ngc")) == load_cache(os.path.join(d, "c.bin")) == c
True
"""
from __future__ import annotations

import lzma
import os
import struct
import sys
import zlib
from pathlib import Path

import numpy as np
from numba import njit

from mlx_backend.ngram_tables import NGRAM_MAX, words_to_slots
from mlx_backend.tables_sorted import INT32_MAX, Section, SortedCache, cache_from_rows, static_top
from reference.atomic import atomic_write
from reference.cache_file import EMPTY_CACHE, EMPTY_FILE, CacheFileError
# the layout's constants (docs/cache-format.md) are shared with the reference's plain reader
from reference.ours_file import (ALIGN, BOM, CRC_AT, HEADER_SIZE, MAGIC, PREFIX, SECTION, VERSION,  # noqa: F401
                                 tokenizer_fingerprint, tokenizer_mismatch, vocab_fingerprint)

FORMATS = ("ours", "llama")


class CacheFormatError(CacheFileError):
    """A cache file of our format that is truncated, corrupt, of another version, or built for another tokenizer."""

    def __init__(self, path, offset: int, problem: str):
        self.path, self.offset, self.problem = str(path), offset, problem
        ValueError.__init__(self, f"cache file {path}: {problem} at byte offset {offset}")


def detect_format(path: str | os.PathLike) -> str:
    """``"ours"`` if the file starts with our magic, else ``"llama"`` (which has no magic)."""
    with open(path, "rb") as f:
        head = f.read(len(MAGIC))
    return "ours" if head == MAGIC else "llama"


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
    """Map a file of our format; only the header is read (``verify=True`` also checks every array)."""
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
    sections = {}
    end = HEADER_SIZE
    for n in range(1, NGRAM_MAX + 1):
        at = PREFIX.size + (n - 1) * SECTION.size
        K, E, total, k_off, o_off, t_off, c_off, top_off = SECTION.unpack_from(head, at)
        kw = 1 if n <= 2 else 2
        spans = ((k_off, K * kw, np.int64), (o_off, K + 1, np.uint32), (t_off, E, np.int32),
                 (c_off, E, np.int32), (top_off, K, np.int32))
        arrays = []
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
        verify_cache(cache, path)
    return cache


def verify_cache(cache: SortedCache, path: str | os.PathLike = "<memory>") -> None:
    """Check every array of a cache: keys strictly increasing, offsets consistent, followers
    strictly increasing per key, counts positive, ``top`` equal to the static-only rule."""
    for n, s in cache.sections.items():
        where = f"section n={n}"
        off = s.offsets.astype(np.int64)
        if off[0] != 0 or off[-1] != s.n_entries or np.any(np.diff(off) <= 0):
            raise CacheFormatError(path, 0, f"{where}: offsets are not increasing from 0 to {s.n_entries}")
        k = s.keys if s.keys.ndim == 2 else s.keys[:, None]
        if len(k) > 1:
            d = k[1:] != k[:-1]
            first = np.argmax(d, axis=1)
            r = np.arange(len(first))
            if not np.all(d.any(axis=1) & (k[1:][r, first] > k[:-1][r, first])):
                raise CacheFormatError(path, 0, f"{where}: n-gram keys are not strictly increasing")
        if np.any(s.tokens < 0) or np.any(s.counts <= 0):
            raise CacheFormatError(path, 0, f"{where}: negative token or non-positive count")
        same_key = np.ones(s.n_entries, bool)
        same_key[off[:-1]] = False
        if np.any(same_key[1:] & (s.tokens[1:] <= s.tokens[:-1])):
            raise CacheFormatError(path, 0, f"{where}: followers are not strictly increasing")
        if not np.array_equal(static_top(s.offsets, s.tokens, s.counts), s.top):
            raise CacheFormatError(path, 0, f"{where}: stored static-only drafts disagree with the counts")
        if cache.vocab_size and s.n_entries and (int(s.tokens.max()) >= cache.vocab_size):
            raise CacheFormatError(path, 0, f"{where}: token {int(s.tokens.max())} >= vocab size {cache.vocab_size}")


# ----------------------------------------------------------------------------- llama.cpp's format


@njit(cache=True)
def _walk_records(words):
    """Record starts of a llama.cpp cache file (in int32 words). Returns ``(starts, n_records, error,
    error_word)`` with error 0 = ok, 1 = truncated header, 2 = ntokens <= 0, 3 = truncated followers."""
    starts = np.empty(words.size // 7 + 1, np.int64)
    o = 0
    r = 0
    while o < words.size:
        if o + 5 > words.size:
            return starts, r, 1, o
        nt = words[o + 4]
        if nt <= 0:
            return starts, r, 2, o + 4
        if o + 5 + 2 * np.int64(nt) > words.size:
            return starts, r, 3, o + 5
        starts[r] = o
        r += 1
        o += 5 + 2 * np.int64(nt)
    return starts, r, 0, 0


def read_llama(path: str | os.PathLike) -> SortedCache:
    """Read llama.cpp's format (``common_ngram_cache_load``, ngram-cache.cpp:222-258) into sorted
    arrays, with the checks of :func:`reference.cache_file.load_cache` (byte offsets in errors)."""
    path = Path(path)
    if path.suffix == ".xz":
        with lzma.open(path) as f:
            data = np.frombuffer(f.read(), np.uint8)
    else:
        data = np.fromfile(path, np.uint8)
    if len(data) % 4:
        raise CacheFileError(path, len(data) - len(data) % 4,
                             f"file size {len(data)} is not a multiple of 4 (truncated int32)")
    if not len(data):
        raise CacheFileError(path, 0, EMPTY_FILE)
    words = data.view("<i4").astype(np.int32, copy=False)
    starts, R, err, at = _walk_records(words)
    if err == 1:
        raise CacheFileError(path, 4 * at, f"truncated record: {4 * (len(words) - at)} bytes left, a record header needs 20")
    if err == 2:
        raise CacheFileError(path, 4 * at, f"non-positive follower count ntokens={int(words[at])}")
    if err == 3:
        raise CacheFileError(path, 4 * at, f"truncated record: ntokens={int(words[at - 1])} needs "
                                           f"{8 * int(words[at - 1])} bytes, {4 * (len(words) - at)} left")
    starts = starts[:R]
    slots = words[starts[:, None] + np.arange(4)].astype(np.int64)
    n = np.argmax(np.column_stack([slots == -1, np.ones(R, bool)]), axis=1)  # first -1 slot
    valid = (n > 0) & ~np.any((np.arange(4) < n[:, None]) & (slots < 0), axis=1) & np.all(
        (np.arange(4) >= n[:, None]) == (slots == -1), axis=1)
    if not valid.all():
        r = int(np.argmin(valid))
        raise CacheFileError(path, 4 * int(starts[r]), f"invalid n-gram {slots[r].tolist()} "
                                                       "(expected 1..4 token ids >= 0 then -1)")
    nt = words[starts + 4].astype(np.int64)
    rec = np.repeat(np.arange(R), nt)
    first = np.repeat(starts + 5, nt)
    j = first + 2 * (np.arange(len(rec)) - np.repeat(np.cumsum(nt) - nt, nt))  # word of each follower token
    tok, cnt = words[j], words[j + 1]
    if np.any(tok < 0):
        e = int(np.argmax(tok < 0))
        raise CacheFileError(path, 4 * int(j[e]), f"negative follower token {int(tok[e])}")
    if np.any(cnt <= 0):
        e = int(np.argmax(cnt <= 0))
        raise CacheFileError(path, 4 * int(j[e] + 1), f"non-positive count {int(cnt[e])}")
    w0 = (slots[:, 0] << 32) | (slots[:, 1] & 0xFFFFFFFF)
    w1 = (slots[:, 2] << 32) | (slots[:, 3] & 0xFFFFFFFF)
    _check_duplicates(path, w0, w1, starts, rec, tok, j)
    return cache_from_rows(w0[rec], w1[rec], tok, cnt, source=str(path))


def _check_duplicates(path, w0, w1, starts, rec, tok, j) -> None:
    """llama.cpp keeps the first of a repeated n-gram or follower; it never writes one, so a repeat
    means a corrupt or concatenated file (the same rule as ``reference.cache_file``)."""
    order = np.lexsort((starts, w1, w0))
    dup = (w0[order][1:] == w0[order][:-1]) & (w1[order][1:] == w1[order][:-1])
    if dup.any():
        r = order[1:][dup].min()
        raise CacheFileError(path, 4 * int(starts[r]), "duplicate n-gram")
    order = np.lexsort((j, tok, rec))
    dup = (rec[order][1:] == rec[order][:-1]) & (tok[order][1:] == tok[order][:-1])
    if dup.any():
        e = order[1:][dup].min()
        raise CacheFileError(path, 4 * int(j[e]), f"duplicate follower {int(tok[e])}")


def save_llama(cache: SortedCache, path: str | os.PathLike) -> None:
    """Write llama.cpp's format: records sorted by size then n-gram, followers by token (the order
    ``reference.cache_file.save_cache`` uses, so both backends write identical bytes)."""
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


def load_cache(path: str | os.PathLike, *, verify: bool = False, vocab_size: int | None = None,
               fingerprint: bytes | None = None) -> SortedCache:
    """A cache file of either format, detected from its first bytes. ``vocab_size``/``fingerprint``:
    the tokenizer the caller uses; a file of our format that records a different one is refused."""
    if str(path).endswith(".xz") or detect_format(path) == "llama":
        cache = read_llama(path)
    else:
        cache = open_ours(path, verify=verify)
    check_tokenizer(cache, path, vocab_size, fingerprint)
    return cache


def check_tokenizer(cache: SortedCache, path, vocab_size: int | None, fingerprint: bytes | None) -> None:
    """Refuse a cache built for another tokenizer (as far as the file records it;
    ``reference.ours_file.tokenizer_mismatch`` states the rule)."""
    problem = tokenizer_mismatch(cache.vocab_size, cache.fingerprint, vocab_size, fingerprint)
    if problem:
        raise CacheFormatError(path, 24 if problem.startswith("built for a vocabulary") else 32, problem)


def save_cache(cache, path: str | os.PathLike, format: str = "llama") -> None:
    """Write ``cache`` (a :class:`SortedCache`, a ``HashTable`` or a reference ``NgramCache``) in
    ``format`` ``"llama"`` (llama.cpp's, the default: a drop-in for the reference) or ``"ours"``."""
    from mlx_backend.api import as_sorted

    cache = as_sorted(cache)
    if format == "ours":
        save_ours(cache, path)
    elif format == "llama":
        for s in cache.sections.values():
            if s.n_entries and int(s.counts.max()) > INT32_MAX:
                raise ValueError("counts must fit in int32")
        save_llama(cache, path)
    else:
        raise ValueError(f"unknown cache format {format!r}; choose one of {', '.join(FORMATS)}")
