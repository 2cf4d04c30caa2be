"""llama.cpp's n-gram cache file format (``common_ngram_cache_save/load``, ngram-cache.cpp:199-258).

No header, no magic, no version; little-endian int32 fields; records until end of file::

    int32 tokens[4]     the n-gram of size n in tokens[0..n-1], -1 in the other 4-n slots
    int32 ntokens       number of followers, > 0
    ntokens x { int32 token; int32 count }      count > 0

llama.cpp writes records in ``unordered_map`` iteration order, which is not canonical; this module
writes them sorted (n-grams by size then tokens, followers by token), so equal caches give equal
files. Files from ``llama-lookup-create``/``llama-lookup`` load here and ours load there.

>>> import tempfile, os
>>> from reference.ngram.cache import NgramCache
>>> path = os.path.join(tempfile.mkdtemp(), "c.bin")
>>> save_cache(NgramCache({(1, 2): {3: 4}}), path)
>>> os.path.getsize(path)   # 20 bytes of header + 8 per follower
28
>>> load_cache(path).counts
{(1, 2): {3: 4}}
"""
from __future__ import annotations

import os

from collections.abc import Callable

import numpy as np

from reference.atomic import atomic_write
from reference.ngram.cache import LLAMA_NGRAM_MAX, TOKEN_NULL, NgramCache, pad
from reference.ngram.file_errors import EMPTY_CACHE, EMPTY_FILE, OURS_MAGIC, CacheFileError
from reference.ngram.ours_file import read_ours, tokenizer_mismatch
from reference.ngram.tokens import INT32_MAX, read_bytes

RECORD_HEAD = LLAMA_NGRAM_MAX + 1  # int32 fields before the followers: tokens[4], ntokens


def load_cache(path: str | os.PathLike, *, vocab_size: int | None = None, fingerprint: bytes | None = None,
               progress: Callable[[int, int], None] | None = None) -> NgramCache:
    """Read a cache file (``.xz`` is decompressed on the fly) into an :class:`NgramCache`.

    Checks what ``common_ngram_cache_load`` asserts (``ntokens > 0``, ``count > 0``, no truncation),
    plus: the n-gram is 1..4 non-negative tokens followed by -1 padding, follower ids are
    non-negative, and no n-gram or follower repeats. (llama.cpp silently keeps the first of a
    duplicate key; llama.cpp never writes one, so a duplicate means a corrupt or concatenated file.)
    A file in our memory-mapped format (it starts with ``NGRAMSPC``) is read by
    :func:`reference.ngram.ours_file.read_ours`; if it records a tokenizer other than ``vocab_size`` /
    ``fingerprint`` (the one in use, where known), it is refused. An empty file is refused: llama.cpp's
    format has no empty file a user means (an empty cache is never written by ``create``).
    ``progress(done, total)`` (optional) is called after each record with the bytes parsed so far.
    """
    data = read_bytes(path)
    if not data:
        raise CacheFileError(path, 0, EMPTY_FILE)
    if data.startswith(OURS_MAGIC):
        cache = read_ours(path, data)
        problem = tokenizer_mismatch(cache.vocab_size, cache.fingerprint, vocab_size, fingerprint)
        if problem:
            raise ValueError(f"cache file {path}: {problem}")
        return cache
    if len(data) % 4:
        raise CacheFileError(path, len(data) - len(data) % 4,
                             f"file size {len(data)} is not a multiple of 4: a truncated int32", needed=4,
                             left=len(data) % 4)
    words = np.frombuffer(data, dtype="<i4").tolist()
    counts: dict[tuple[int, ...], dict[int, int]] = {}
    o = 0  # position in int32 words; the byte offset is 4 * o
    while o < len(words):
        if o + RECORD_HEAD > len(words):
            raise CacheFileError(path, 4 * o, "truncated record header", needed=4 * RECORD_HEAD,
                                 left=4 * (len(words) - o))
        slots, ntokens = words[o:o + LLAMA_NGRAM_MAX], words[o + LLAMA_NGRAM_MAX]
        n = next((i for i, t in enumerate(slots) if t == TOKEN_NULL), LLAMA_NGRAM_MAX)
        eta = tuple(slots[:n])
        if n == 0 or any(t < 0 for t in eta) or any(t != TOKEN_NULL for t in slots[n:]):
            raise CacheFileError(path, 4 * o, f"invalid n-gram {slots} (expected 1..4 token ids >= 0 then -1)")
        if ntokens <= 0:
            raise CacheFileError(path, 4 * (o + LLAMA_NGRAM_MAX), f"non-positive follower count ntokens={ntokens}")
        if eta in counts:
            raise CacheFileError(path, 4 * o, f"duplicate n-gram {eta}")
        body = o + RECORD_HEAD
        end = body + 2 * ntokens
        if end > len(words):
            raise CacheFileError(path, 4 * body, f"truncated record for n-gram {eta}: ntokens={ntokens} "
                                                  "followers", needed=8 * ntokens, left=4 * (len(words) - body))
        part: dict[int, int] = {}
        for j in range(body, end, 2):
            y, c = words[j], words[j + 1]
            if y < 0:
                raise CacheFileError(path, 4 * j, f"negative follower token {y} of n-gram {eta}")
            if c <= 0:
                raise CacheFileError(path, 4 * (j + 1), f"non-positive count {c} of n-gram {eta}, token {y}")
            if y in part:
                raise CacheFileError(path, 4 * j, f"duplicate follower {y} of n-gram {eta}")
            part[y] = c
        counts[eta] = part
        if progress is not None:
            progress(4 * end, len(data))
        o = end
    return NgramCache(counts)


def save_cache(cache: NgramCache, path: str | os.PathLike) -> None:
    """Write ``cache`` in llama.cpp's format, records sorted (deterministic bytes); an empty cache is
    refused (its file would be empty, which every loader refuses)."""
    if not cache.counts:
        raise ValueError(EMPTY_CACHE)
    words: list[int] = []
    for eta in sorted(cache.counts, key=lambda eta: (len(eta), eta)):
        part = cache.counts[eta]
        words += pad(eta)
        words.append(len(part))
        for y in sorted(part):
            c = part[y]
            if not 0 < c <= INT32_MAX:
                raise ValueError(f"cannot save count {c} of n-gram {eta}, token {y}: "
                                 "counts must be in [1, 2**31-1] (int32 in the file)")
            words += (y, c)
    data = np.asarray(words, dtype="<i4")
    with atomic_write(path) as f:
        data.tofile(f)
