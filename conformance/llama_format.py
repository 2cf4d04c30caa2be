"""llama.cpp's n-gram cache file layout, read and written independently of any backend.

``common_ngram_cache_save`` writes, with no header, records until end of file, every field a
little-endian int32: ``tokens[4]`` (the n-gram padded with -1), ``ntokens``, then ``ntokens``
pairs ``(token, count)`` (conformance vectors' README, section 3.2). The cache-file checks use this
to read what a backend saved and to write files a backend must load.

>>> data = to_bytes({(1, 2): {3: 4}})
>>> len(data), from_bytes(data)
(28, {(1, 2): {3: 4}})
"""
from __future__ import annotations

import numpy as np

from conformance.oracle import Cache

INT32_LE = np.dtype("<i4")


def from_bytes(data: bytes) -> Cache:
    """Parse a cache file; ``ValueError`` names the byte offset of a malformed record."""
    words = np.frombuffer(data[: len(data) // 4 * 4], dtype=INT32_LE).tolist()
    if len(data) % 4:
        raise ValueError(f"{len(data)} bytes is not a whole number of int32 fields")
    cache: Cache = {}
    i = 0
    while i < len(words):
        if i + 5 > len(words):
            raise ValueError(f"truncated record header at byte {4 * i}")
        slots, ntokens = words[i:i + 4], words[i + 4]
        n = next((k for k, t in enumerate(slots) if t == -1), 4)
        if n == 0 or any(t != -1 for t in slots[n:]) or ntokens <= 0:
            raise ValueError(f"malformed record at byte {4 * i}: tokens {slots}, ntokens {ntokens}")
        pairs = words[i + 5:i + 5 + 2 * ntokens]
        if len(pairs) < 2 * ntokens:
            raise ValueError(f"truncated record at byte {4 * i}")
        cache[tuple(slots[:n])] = dict(zip(pairs[0::2], pairs[1::2]))
        i += 5 + 2 * ntokens
    return cache


def to_bytes(cache: Cache) -> bytes:
    """The file bytes of ``cache`` (records in sorted n-gram order; any order is valid)."""
    words: list[int] = []
    for eta in sorted(cache):
        part = cache[eta]
        words += list(eta) + [-1] * (4 - len(eta)) + [len(part)]
        for y in sorted(part):
            words += [y, part[y]]
    return np.asarray(words, dtype=INT32_LE).tobytes()
