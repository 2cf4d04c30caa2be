"""A stable least-significant-digit radix sort of non-negative int64 values by their high bits.

``radix_sort(x, lo, tmp)`` orders ``x`` by ``x >> lo``, keeping the order of values whose high bits
are equal (so packing an index or payload into the low ``lo`` bits carries it along). One read of
``x`` counts the digits of every pass; each pass then moves every value once (a counting sort by
one digit of at most ``DIGIT_BITS`` bits by default); a pass whose digit is the same for all values
is skipped.
NumPy's comparison sort of int64 costs about 60 ns per value on the 2-core VMs this project is
measured on; these passes cost a few ns per value each (docs/benchmarks-ngram.md).

>>> x = np.array([5 << 8 | 0, 3 << 8 | 1, 5 << 8 | 2, 0 << 8 | 3], np.int64)
>>> radix_sort(x, 8, np.empty_like(x))
>>> (x >> 8).tolist(), (x & 255).tolist()
([0, 3, 5, 5], [3, 1, 0, 2])
"""
from __future__ import annotations

import numpy as np
from numba import njit

DIGIT_BITS = 11  # 2,048 counters per pass: they and the pass's write positions stay in the L1/L2 cache


@njit(cache=True, nogil=True)
def radix_sort(x, lo, tmp, digit_bits=DIGIT_BITS):
    """Sort the non-negative int64 array ``x`` in place, stably, by ``x >> lo`` (``tmp``: scratch of
    at least ``x.size`` int64; passes of at most ``digit_bits`` bits). Plain loops, no array
    expressions: they cost seconds of compilation on a cold start."""
    n = x.size
    top = 0
    for i in range(n):
        v = x[i] >> lo
        if v > top:
            top = v
    bits = 0
    while top >> bits:
        bits += 1
    passes = -(-bits // digit_bits)
    if n < 2 or passes == 0:
        return
    width = -(-bits // passes)
    B = np.int64(1) << width
    mask = B - 1
    count = np.zeros(passes * B, np.int64)  # pass p's counter of digit d at p * B + d
    for i in range(n):
        v = x[i] >> lo
        for p in range(passes):
            count[p * B + ((v >> (p * width)) & mask)] += 1
    src, dst = x, tmp
    for p in range(passes):
        total, same = 0, False
        for d in range(p * B, p * B + B):
            c = count[d]
            same = same or c == n  # one digit value for all: the order is unchanged
            count[d] = total
            total += c
        if same:
            continue
        shift = lo + p * width
        for i in range(n):
            d = p * B + ((src[i] >> shift) & mask)
            dst[count[d]] = src[i]
            count[d] += 1
        src, dst = dst, src
    if src is not x:
        for i in range(n):
            x[i] = src[i]
