"""The drafting arithmetic in both backends: ``score="exact"`` is exact for every count a cache can
hold (products beyond int64 included), ``score="int32"`` wraps every ``int`` sum and product of
llama.cpp's ``ngram-cache.cpp`` (GCC, x86-64), and ``n_draft = 0`` drafts nothing, like llama.cpp.

Each case is checked against the NumPy reference, the mlx backend's array tables and the
conformance oracle (an independent transcription of the rules)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mlx_backend.ngram.api as api
import reference.ngram.api as ref
from conformance import oracle
from mlx_backend.ngram.hash_table import _cmp_products
from mlx_backend.cli import main
from reference.ngram.draft import draft
from reference.ngram.cache import NgramCache
from reference.ngram.tokens import write_tokens

INT32_MAX = 2**31 - 1


def all_backends(inp, n_draft, c_dyn=None, c_st=None, score="exact"):
    """``(reference, mlx, oracle)`` drafts after ``inp`` (``c_ctx`` = the n-grams of ``inp``)."""
    c_ctx = NgramCache()
    c_ctx.update(list(inp), len(inp))
    want = draft(list(inp), n_draft, c_ctx, c_dyn, c_st, score=score)
    mine = api.NgramDrafter(c_st=c_st, c_dyn=c_dyn, score=score)
    mine.reset(inp)
    indep = oracle.draft(inp, n_draft, oracle.counts(inp), c_dyn and c_dyn.counts, c_st and c_st.counts,
                         wrap_int32=score == "int32")
    return want, mine.draft(n_draft), indep


def test_exact_scores_beyond_int64():
    """``c * 100 * c_st`` = (2^31 - 1) * 100 * 5e7 > 2^63: an int64 score overflowed and the mlx backend
    drafted 5 where exact integers draft 3 (3's score is the larger)."""
    c_dyn = NgramCache({(2,): {3: INT32_MAX, 4: 1}})
    c_st = NgramCache({(1, 2): {3: 50_000_000, 5: 50_000_001}})
    assert all_backends([1, 2], 1, c_dyn, c_st) == ([3], [3], [3])


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**63 - 1), st.integers(0, 2**63 - 1), st.integers(0, 2**63 - 1), st.integers(0, 2**63 - 1))
def test_products_compare_exactly(a, b, c, d):
    assert _cmp_products(a, b, c, d) == (a * b > c * d) - (a * b < c * d)
    assert _cmp_products(a, b, a, b) == 0


def test_int32_sum_wraps_in_the_primary_levels():
    """F = (2^31 - 1) + 1 wraps to -2^31 < a_1 in llama.cpp's int sum: the dynamic level fails."""
    c_dyn = NgramCache({(2,): {3: INT32_MAX, 4: 1}})
    assert all_backends([1, 2], 1, c_dyn, None, "exact") == ([3], [3], [3])
    assert all_backends([1, 2], 1, c_dyn, None, "int32") == ([], [], [])


@pytest.mark.parametrize("count, drafts_in_int32", [(21_474_836, True), (21_474_837, False)])
def test_int32_static_only_share_test_wraps(count, drafts_in_int32):
    """Static-only: ``100 * c_max < 50 * sum`` in int: 100 * 21,474,837 > 2^31 - 1 wraps negative, so
    llama.cpp stops drafting from a 2-gram once its top count passes 21,474,836."""
    c_st = NgramCache({(1, 2): {7: count}})
    assert all_backends([1, 2], 1, None, c_st, "exact") == ([7], [7], [7])
    want = [7] if drafts_in_int32 else []
    assert all_backends([1, 2], 1, None, c_st, "int32") == (want, want, want)


# Counts near the int32 limit (the largest a cache file holds) and small ones, on a 4-token vocabulary
# so that n-grams meet: products overflow int64 (exact) and int32 (wrapped), sums wrap in int32.
COUNTS = st.one_of(st.integers(1, 4), st.integers(2**24, INT32_MAX), st.just(INT32_MAX))
TOKEN = st.integers(0, 3)
FOLLOWERS = st.dictionaries(TOKEN, COUNTS, min_size=1, max_size=4)


def caches(sizes):
    ngram = st.one_of(*[st.tuples(*[TOKEN] * n) for n in sizes])
    return st.dictionaries(ngram, FOLLOWERS, max_size=8)


@st.composite
def sequence_and_caches(draw):
    """A sequence, and dynamic / static caches that hold its last n-grams (so the first draft
    position always meets them), plus random other n-grams."""
    inp = draw(st.lists(TOKEN, min_size=2, max_size=12))
    dyn, static = dict(draw(caches((1, 2, 3, 4)))), dict(draw(caches((2,))))  # copies: drawn values stay as drawn
    for n in draw(st.sets(st.integers(1, min(4, len(inp))))):
        dyn[tuple(inp[-n:])] = draw(FOLLOWERS)
    if draw(st.booleans()):
        static[tuple(inp[-2:])] = draw(FOLLOWERS)
    return inp, dyn, static


@settings(max_examples=150, deadline=None)
@given(sequence_and_caches(), st.integers(1, 6), st.sampled_from(["exact", "int32"]))
def test_huge_counts_both_backends_draft_alike(case, n_draft, score):
    inp, dyn, static = case
    c_dyn = NgramCache(dyn) if dyn else None
    c_st = NgramCache(static) if static else None
    want, mine, indep = all_backends(inp, n_draft, c_dyn, c_st, score)
    assert mine == want == indep


@settings(max_examples=30, deadline=None)
@given(st.lists(TOKEN, min_size=0, max_size=40), caches((1, 2, 3, 4)), caches((2,)), st.integers(2, 12),
       st.integers(1, 4), st.sampled_from(["exact", "int32"]))
def test_huge_counts_replays_alike(tokens, dyn, static, n_ctx, n_draft, score):
    c_dyn = NgramCache(dyn) if dyn else None
    c_st = NgramCache(static) if static else None
    got, want = [], []
    a = api.replay(tokens, n_ctx, n_draft, c_st=c_st, c_dyn=c_dyn, on_draft=lambda p, d: got.append((p, d)),
                   score=score)
    b = ref.replay(tokens, n_ctx, n_draft, c_st=c_st, c_dyn=c_dyn, on_draft=lambda p, d: want.append((p, d)),
                   score=score)
    assert got == want and (a.n_drafted, a.n_accept) == (b.n_drafted, b.n_accept)


def test_n_draft_zero_drafts_nothing():
    """llama.cpp's draft loop runs while fewer than n_draft tokens are drafted: with 0, none (and
    lookup-stats replays every token as "sampled"). Both backends do the same instead of refusing."""
    inp = [1, 2, 3, 1, 2, 3, 1, 2]
    assert all_backends(inp, 0) == ([], [], [])
    assert all_backends(inp, 1) == ([3], [3], [3])  # the same sequence drafts with n_draft = 1
    for backend in (ref, api):
        stats = backend.replay(inp * 4, n_ctx=16, n_draft=0)
        assert (stats.n_chunks, stats.n_draft_calls, stats.n_drafted, stats.n_accept) == (1, 15, 0, 0)


@pytest.mark.parametrize("backend", ["reference", "mlx"])
def test_stats_n_draft_zero(tmp_path, capsys, backend):
    toks = tmp_path / "t.i32"
    write_tokens(toks, [1, 2, 3] * 10)
    assert main(["stats", str(toks), "--n-ctx", "8", "--n-draft", "0", "--json", "--backend", backend]) == 0
    out = capsys.readouterr().out
    assert '"n_drafted": 0' in out and '"n_draft": 0' in out
