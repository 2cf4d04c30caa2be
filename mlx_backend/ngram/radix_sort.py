"""A stable least-significant-digit radix sort of non-negative int64 values by their high bits.

``radix_sort(x, lo, tmp)`` orders ``x`` by ``x >> lo``, keeping the order of values whose high bits
are equal (so packing an index or payload into the low ``lo`` bits carries it along). One read of
``x`` counts the digits of every pass; each pass then moves every value once (a counting sort by
one digit of at most ``DIGIT_BITS`` bits by default); a pass whose digit is the same for all values
is skipped. ``radix_sort_threads`` splits each pass between threads.
NumPy's comparison sort of int64 costs about 60 ns per value on the 2-core VMs this project is
measured on; these passes cost a few ns per value each (docs/benchmarks-ngram.md).

>>> x = np.array([5 << 8 | 0, 3 << 8 | 1, 5 << 8 | 2, 0 << 8 | 3], np.int64)
>>> radix_sort(x, 8, np.empty_like(x))
>>> (x >> 8).tolist(), (x & 255).tolist()
([0, 3, 5, 5], [3, 1, 0, 2])
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np

from mlx_backend.machine.numba_cache import njit

DIGIT_BITS = 11  # 2,048 counters per pass: they and the pass's write positions stay in the L1/L2 cache


@njit(cache=True, nogil=True)
def _plan(top, digit_bits):
    """``(passes, width)``: the fewest passes of at most ``digit_bits`` bits that cover ``top``'s bits."""
    bits = 0
    while top >> bits:
        bits += 1
    passes = -(-bits // digit_bits)
    return passes, -(-bits // max(passes, 1))


@njit(cache=True, nogil=True)
def _move(src, dst, shift, mask, pos):
    """One pass: each value of ``src`` to ``dst[pos[d]]``, ``d`` its digit ``(v >> shift) & mask``."""
    for i in range(src.size):
        d = (src[i] >> shift) & mask
        dst[pos[d]] = src[i]
        pos[d] += 1


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
    passes, width = _plan(top, digit_bits)
    if n < 2 or passes == 0:
        return
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
        _move(src[:n], dst, lo + p * width, mask, count[p * B:p * B + B])
        src, dst = dst, src
    if src is not x:
        for i in range(n):
            x[i] = src[i]


@njit(cache=True, nogil=True)
def _count_digits(x, shift, mask):
    count = np.zeros(mask + 1, np.int64)
    for i in range(x.size):
        count[(x[i] >> shift) & mask] += 1
    return count


def radix_sort_threads(x: np.ndarray, lo: int, tmp: np.ndarray, threads: int, digit_bits: int = DIGIT_BITS) -> None:
    """:func:`radix_sort`, each pass split between ``threads`` threads: thread t counts and moves the
    t-th slice of the values, writing them after those of the slices before it in each digit's
    range, which keeps the sort stable."""
    n = x.size
    passes, width = _plan(int(x.max(initial=0)) >> lo, digit_bits)
    if n < 2 or passes == 0:
        return
    mask = (1 << width) - 1
    bounds = np.linspace(0, n, threads + 1).astype(np.int64)
    slices = [slice(a, b) for a, b in zip(bounds, bounds[1:])]
    src, dst = x, tmp[:n]
    with ThreadPoolExecutor(threads) as pool:  # the compiled loops release the GIL
        for p in range(passes):
            shift = lo + p * width
            count = np.stack(list(pool.map(lambda s: _count_digits(src[s], shift, mask), slices)))  # (slice, digit)
            if count.sum(axis=0).max() == n:  # one digit value for all: the order is unchanged
                continue
            ends = np.cumsum(count.T).reshape(count.T.shape)  # digit by digit, slice by slice within a digit
            pos = (ends - count.T).T.copy()
            list(pool.map(lambda t: _move(src[slices[t]], dst, shift, mask, pos[t]), range(threads)))
            src, dst = dst, src
    if src is not x:
        x[:] = src
