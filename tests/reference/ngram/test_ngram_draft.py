"""The drafting rules of llama.cpp's common_ngram_cache_draft (spec section 3), one hand-worked example
each: thresholds at their boundaries, the cache order, the static weight, the tie rule, the skipped
negative-start n-grams and the int32 score."""
from __future__ import annotations

import pytest

from reference.ngram.draft import draft, try_primary, try_static, wrap_int32, LAX, STRICT
from reference.ngram.cache import NgramCache


def C(counts):
    return NgramCache(counts)


EMPTY = C({})


@pytest.mark.parametrize("part, thr, n, expected", [
    ({7: 1}, LAX, 1, None),            # F = 1 < a_1 = 2
    ({7: 2}, LAX, 1, 7),               # F = 2, 100 %
    ({7: 2, 8: 1}, LAX, 1, 7),         # 2/3: 200 >= 66*3 = 198
    ({7: 2, 8: 1, 9: 1}, LAX, 1, None),  # 2/4: 200 < 264
    ({7: 1, 8: 1}, LAX, 2, 7),         # 50 % passes p_2 = 50, tie -> 7
    ({7: 1}, LAX, 3, 7),               # a_3 = 1
    ({7: 3, 8: 1}, STRICT, 1, 7),      # F = 4 >= 4, 300 >= 75*4
    ({7: 2, 8: 1}, STRICT, 1, None),   # F = 3 < a_1 = 4
    ({7: 2, 8: 1}, STRICT, 2, 7),      # F = 3 >= 3, 200 >= 66*3
    ({7: 1, 8: 1}, STRICT, 4, None),   # 50 % < 66 %
])
def test_threshold_boundaries(part, thr, n, expected):
    eta = tuple(range(100, 100 + n))
    ngrams = [eta[-m:] if m <= n else None for m in range(1, 5)]
    assert try_primary(C({eta: part}), ngrams, {}, thr) == expected


def test_largest_n_first_and_fallthrough():
    # X_4 and X_2 are absent; X_3 passes (a_3 = 1), so X_1 is never consulted
    cache = C({(2, 3, 4): {9: 1}, (4,): {5: 5}})
    assert try_primary(cache, [(4,), (3, 4), (2, 3, 4), (1, 2, 3, 4)], {}, LAX) == 9
    # a failing larger level does not stop the search: X_3 fails (1 of 3 < 50 %), X_1 passes
    cache = C({(2, 3, 4): {9: 1, 8: 1, 7: 1}, (4,): {5: 5}})
    assert try_primary(cache, [(4,), (3, 4), (2, 3, 4), (1, 2, 3, 4)], {}, LAX) == 5


def test_context_then_dynamic_then_static():
    inp = [1, 2, 3]
    c_ctx = C({(3,): {4: 2}})
    c_dyn = C({(3,): {5: 4}})
    c_st = C({(2, 3): {6: 2}})
    assert draft(inp, 1, c_ctx, c_dyn, c_st) == [4]
    assert draft(inp, 1, EMPTY, c_dyn, c_st) == [5]
    assert draft(inp, 1, EMPTY, None, c_st) == [6]
    assert draft(inp, 1, EMPTY, C({(3,): {5: 3}}), c_st) == [6]  # dynamic needs F >= 4 at n = 1


def test_static_weight_changes_the_argmax_but_the_percentage_uses_the_primary_count():
    # c = {7: 3, 8: 1}: without static, y* = 7. With c_st(X_2, 8) = 1, s(8) = 100 > s(7) = 3,
    # so y* = 8, whose primary count 1 of 4 fails the lax n = 1 test (25 % < 66 %): nothing drafted.
    inp = [2, 3]
    c_ctx = C({(3,): {7: 3, 8: 1}})
    assert draft(inp, 1, c_ctx) == [7]
    assert draft(inp, 1, c_ctx, None, C({(2, 3): {8: 1}})) == []
    # a static count on the leader only keeps it: s(7) = 300
    assert draft(inp, 1, c_ctx, None, C({(2, 3): {7: 1}})) == [7]


def test_weighted_tie_goes_to_the_smallest_id():
    # s(7) = 2 * 100 = 200, s(5) = 1 * 200 = 200: tie -> 5, whose primary count 1 of 3 fails 50 % at n = 2
    part_st = {7: 1, 5: 2}
    cache = C({(2, 3): {7: 2, 5: 1}})
    assert try_primary(cache, [None, (2, 3)], part_st, LAX) is None
    cache = C({(2, 3): {7: 1, 5: 1}})  # s(7) = 100 < s(5) = 200 -> 5 at 50 %
    assert try_primary(cache, [None, (2, 3)], part_st, LAX) == 5


def test_static_only_fallback():
    assert try_static({4: 1, 9: 1}) == 4      # tie -> smallest id, 50 % passes
    assert try_static({4: 1, 9: 2, 6: 1}) == 9  # 2 of 4 = 50 %
    assert try_static({4: 1, 9: 1, 6: 1}) is None  # 33 %
    assert try_static({4: 1}) is None         # F = 1 < 2


def test_drafted_tokens_extend_the_ngrams_but_not_the_caches():
    c_ctx = C({(3,): {4: 2}, (3, 4): {5: 1}, (4,): {1: 5}})
    before = c_ctx.copy()
    # 3 -> 4 (n = 1); then X_2 = (3, 4) -> 5 (n = 2, F = 1 < a_2: fails), X_1 = (4,) -> 1; then (1,) unknown
    assert draft([2, 3], 5, c_ctx) == [4, 1]
    assert c_ctx == before


def test_negative_start_ngrams_are_skipped():
    # |S| = 2: the 3- and 4-grams would start before S[0]. A cache whose 3-gram matches the
    # wrapped-around tokens (3, 2, 3) or a clamped start must not be used.
    c_dyn = C({(3, 2, 3): {9: 5}, (2, 3): {9: 1}})
    assert draft([2, 3], 3, EMPTY, c_dyn) == []
    # once |S| = 3 the 3-gram exists
    assert draft([3, 2, 3], 1, EMPTY, c_dyn) == [9]


def test_int32_score_wraps_like_llama_cpp():
    assert wrap_int32(2**31 - 1) == 2**31 - 1 and wrap_int32(2**31) == -(2**31)
    # c_st(X_2, 1) = 3,000,000 -> w(1) = 3e8; c(X_1, 1) = 8 -> s(1) = 2.4e9 wraps to -1,894,967,296 < 0,
    # so token 2 (s = 1) wins in int32 and fails 1 of 9 < 66 %; exact scores draft 1 (8 of 9).
    # (Three equal static followers: the static-only fallback, 33 %, drafts nothing.)
    c_ctx = C({(1,): {1: 8, 2: 1}})
    c_st = C({(1, 1): {1: 3_000_000, 3: 3_000_000, 4: 3_000_000}})
    assert draft([1, 1], 1, c_ctx, None, c_st) == [1]
    assert draft([1, 1], 1, c_ctx, None, c_st, score="int32") == []
