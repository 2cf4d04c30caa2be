"""Drafting: llama.cpp's ``common_ngram_cache_draft`` (ngram-cache.cpp:145-197).

For each position to draft, with ``S`` the context followed by the tokens drafted so far:

1. the **context** cache ``c_ctx`` with the lax thresholds, n = 4, 3, 2, 1;
2. then the **dynamic** cache ``c_dyn`` with the strict thresholds, n = 4, 3, 2, 1;
3. then the **static** cache ``c_st`` alone (2-gram, ``a = 2``, ``p = 50 %``).

A level with n-gram ``X_n`` (the last n tokens of S) picks ``y* = argmax_y s(y)``, the score
``s(y) = c(X_n, y) * w(y)`` with the weight ``w(y) = 100 * c_st(X_2, y)`` if that count is positive,
else 1, and drafts ``y*`` iff ``F(X_n) >= a_n`` and ``100 * c(X_n, y*) >= p_n * F(X_n)`` (integers;
``F(X_n) = sum_y c(X_n, y)``). Drafting stops at the first position where nothing passes, or after
``n_draft`` tokens. Drafted tokens extend ``S`` but never enter a cache.

Where llama.cpp is undefined, this module defines (docs/spec-map.md, "Deliberate differences"):

* **ties -> smallest token id.** llama.cpp keeps the first maximum in ``std::unordered_map``
  iteration order, which depends on the C++ library and on how the cache was built or loaded.
* **negative-start n-grams are skipped.** For n larger than ``len(S)`` llama.cpp reads before the
  start of its draft vector (heap-buffer-overflow, ngram-cache.cpp:173-176); here the size is absent.
* **score arithmetic.** ``score="exact"`` (default) computes in Python integers. ``score="int32"``
  reproduces llama.cpp's ``int`` arithmetic built with GCC on x86-64 (formally signed-overflow UB):
  the score ``c * w`` (cpp:125), the sum ``F`` and both sides of the share test ``100 * c < p * F``
  (cpp:114-136, and the static-only cpp:65-94) wrap to 32-bit two's complement; a wrapped score
  <= 0 is never selected. So int32 mode differs from exact once a score passes 2**31-1, a count
  ``c`` passes 21,474,836 (``100 * c`` wraps: the static-only fallback stops drafting) or ``p * F``
  passes 2**31-1.

>>> from reference.ngram.cache import NgramCache
>>> c_ctx = NgramCache(); inp = [1, 2, 3, 1, 2, 3, 1, 2]
>>> c_ctx.update(inp, len(inp))
>>> draft(inp, 4, c_ctx)
[3, 1, 2, 3]
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from reference.ngram.cache import LLAMA_NGRAM_MAX, LLAMA_NGRAM_MIN, NgramCache

SCORES = ("exact", "int32")


class Thresholds(NamedTuple):
    """Per n-gram size n (index n-1): minimum sample size ``a_n`` and minimum percentage ``p_n``
    (llama.cpp's ``draft_min_sample_size_*`` and ``draft_min_percent_*``, ngram-cache.cpp:59-62)."""

    a_n: tuple[int, int, int, int]
    p_n: tuple[int, int, int, int]


# ngram-cache.cpp:59-62. llama.cpp indexes them by position in the n-gram list (n - ngram_min);
# that equals n - 1 because every caller passes ngram_min = 1.
LAX = Thresholds(a_n=(2, 2, 1, 1), p_n=(66, 50, 50, 50))  # context cache
STRICT = Thresholds(a_n=(4, 3, 2, 2), p_n=(75, 66, 66, 66))  # dynamic cache
STATIC_A, STATIC_P = LAX.a_n[1], LAX.p_n[1]  # static-only fallback: the lax 2-gram level (cpp:65-94)


def wrap_int32(x: int) -> int:
    """``x`` reduced to 32-bit two's complement, like an overflowing ``int32 * int32`` on x86-64.

    >>> wrap_int32(2**31), wrap_int32(8 * 300_000_000)
    (-2147483648, -1894967296)
    """
    return (x + 2**31) % 2**32 - 2**31


def arithmetic(score: str):
    """The integer arithmetic of ``score``: the identity (exact) or :func:`wrap_int32` (llama.cpp)."""
    return wrap_int32 if score == "int32" else int


def weight(y: int, part_st: dict[int, int]) -> int:
    """``w(y) = 100 * c_st(X_2, y)`` if ``y`` follows the current static 2-gram, else 1 (cpp:120-123)."""
    c_st = part_st.get(y, 0)
    return 100 * c_st if c_st > 0 else 1


def try_primary(cache: NgramCache, ngrams: Sequence[tuple[int, ...] | None], part_st: dict[int, int],
                thr: Thresholds, score: str = "exact") -> int | None:
    """The first passing level of a context or dynamic cache, largest n first (cpp:97-143).

    ``ngrams[n-1]`` is ``X_n`` (``None`` if skipped). Returns the drafted token or ``None``.

    >>> c = NgramCache({(4,): {1: 1, 2: 1}})
    >>> try_primary(c, [(4,)], {}, LAX) is None   # 50 % < p_1 = 66 %
    True
    >>> try_primary(c, [(4,)], {2: 1}, LAX)        # w(2) = 100: y* = 2, yet c(X_1, 2) = 1 is 50 %
    >>> c = NgramCache({(3, 4): {1: 1, 2: 1}})
    >>> try_primary(c, [(4,), (3, 4)], {}, LAX)   # tie at 50 % passes n = 2; smallest id wins
    1
    """
    arith = arithmetic(score)
    for n in range(len(ngrams), 0, -1):
        eta = ngrams[n - 1]
        part = cache.counts.get(eta) if eta is not None else None
        if part is None:
            continue
        y_best, s_best = None, 0
        for y, c in part.items():
            s = arith(c * weight(y, part_st))  # s(y) = c(X_n, y) * w(y)
            if s > s_best or (s == s_best and y_best is not None and y < y_best):
                y_best, s_best = y, s
        F = arith(sum(part.values()))  # F(X_n) = sum_y c(X_n, y)
        if y_best is None or F < thr.a_n[n - 1]:
            continue
        if arith(100 * part[y_best]) < arith(thr.p_n[n - 1] * F):  # the primary count of the weighted argmax
            continue
        return y_best
    return None


def try_static(part_st: dict[int, int], score: str = "exact") -> int | None:
    """Static-only fallback (cpp:65-94): the most frequent follower of the static 2-gram, ties to the
    smallest id, drafted iff ``C_st(X_2) >= 2`` and ``100 * c_st(X_2, y*) >= 50 * C_st(X_2)``.

    >>> try_static({5: 2, 3: 2}), try_static({5: 1}), try_static({})
    (3, None, None)
    >>> try_static({7: 30_000_000}), try_static({7: 30_000_000}, "int32")  # 100 * 3e7 wraps negative
    (7, None)
    """
    if not part_st:
        return None
    arith = arithmetic(score)
    y_best = min(part_st, key=lambda y: (-part_st[y], y))
    F = arith(sum(part_st.values()))
    if F >= STATIC_A and arith(100 * part_st[y_best]) >= arith(STATIC_P * F):
        return y_best
    return None


def draft(inp: Sequence[int], n_draft: int, c_ctx: NgramCache, c_dyn: NgramCache | None = None,
          c_st: NgramCache | None = None, *, score: str = "exact") -> list[int]:
    """Up to ``n_draft`` tokens predicted to follow ``inp`` (``common_ngram_cache_draft``).

    ``inp`` is the whole sequence so far (the prompt and every emitted token); nothing is drafted
    when it holds fewer than 2 tokens (cpp:152) or when ``n_draft`` is 0 (the loop condition of
    cpp:156, as llama.cpp with ``--draft-max 0``). The caches are only read.

    >>> c_ctx = NgramCache({(9,): {4: 3}})
    >>> draft([1, 9], 3, c_ctx)   # X_1 = (9,) -> 4; then X_1 = (4,) is unknown: stop
    [4]
    >>> draft([9], 3, c_ctx), draft([1, 9], 0, c_ctx)
    ([], [])
    """
    if n_draft < 0:
        raise ValueError(f"n_draft must be >= 0, got {n_draft}")
    if score not in SCORES:
        raise ValueError(f"score must be one of {SCORES}, got {score!r}")
    L = len(inp)  # |S|
    if L < 2:
        return []
    empty: dict[int, int] = {}
    window = [int(t) for t in inp[-LLAMA_NGRAM_MAX:]]  # the tail of S that the n-grams reach
    drafted: list[int] = []
    while len(drafted) < n_draft:
        X_2 = (window[-2], window[-1])
        part_st = c_st.counts.get(X_2, empty) if c_st is not None else empty
        # X_n = the last n tokens of S; sizes starting before S[0] (n > |S|) are skipped.
        ngrams = [tuple(window[-n:]) if n <= L else None for n in range(LLAMA_NGRAM_MIN, LLAMA_NGRAM_MAX + 1)]
        y = try_primary(c_ctx, ngrams, part_st, LAX, score)
        if y is None and c_dyn is not None:
            y = try_primary(c_dyn, ngrams, part_st, STRICT, score)
        if y is None:
            y = try_static(part_st, score)
        if y is None:
            break
        drafted.append(y)
        window = window[1:] + [y] if len(window) == LLAMA_NGRAM_MAX else window + [y]
        L += 1
    return drafted
