"""The array tables and the fast drafter against the reference (``reference/``), on random streams:
small vocabularies (dense ties, thresholds at their boundaries) and Zipf-like ones (realistic)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mlx_backend.ngram.api as api
import reference.ngram.api as ref
from mlx_backend.ngram.hash_table import HashTable
from reference.ngram.cache import NgramCache

SETTINGS = settings(max_examples=40, deadline=None)


@st.composite
def streams(draw, min_size=0, max_size=300):
    """A token stream: uniform over a tiny vocabulary, or Zipf-like over a larger one."""
    n = draw(st.integers(min_size, max_size))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    if draw(st.booleans()):
        v = draw(st.integers(1, 5))
        return rng.integers(0, v, n).astype(np.int32)
    v = draw(st.integers(5, 200))
    return np.minimum(rng.zipf(1.3, n) - 1, v).astype(np.int32)


def ref_cache(tokens, n_min=1, n_max=4) -> NgramCache:
    c = NgramCache()
    c.update([int(t) for t in tokens], len(tokens), n_min, n_max)
    return c


@SETTINGS
@given(streams())
def test_context_table_counts_equal_reference(s):
    t = HashTable()
    t.update(s)
    assert t.entries() == ref_cache(s).entries()


@SETTINGS
@given(streams(), st.integers(1, 50))
def test_token_by_token_update_equals_bulk(s, split):
    """O(1) per-token updates (extend) give the counts of one bulk update."""
    d = api.NgramDrafter()
    d.reset(s[:split])
    for t in s[split:]:
        d.extend([int(t)])
    assert d.c_ctx.entries() == ref_cache(s).entries()
    assert d.tokens.tolist() == s.tolist()


@SETTINGS
@given(streams())
def test_build_static_equals_reference(s):
    built = api.build_static(s)
    assert built.entries() == ref.build_static(s.tolist()).entries()


def test_build_static_chunked_equals_unchunked():
    rng = np.random.default_rng(7)
    s = np.minimum(rng.zipf(1.2, 20_000) - 1, 3000).astype(np.int32)
    from mlx_backend.ngram.sorted_cache import build_static

    one = build_static(s)
    for chunk in (3, 100, 4097):
        assert build_static(s, chunk=chunk) == one
    assert one.entries() == ref.build_static(s.tolist()).entries()


def test_build_static_large_token_ids_equal_reference():
    """Ids >= 2**21 do not fit the packed build; the fallback sorts rows."""
    s = np.array([2**30, 5, 2**30, 5, 2**30, 7, 2**21], np.int32)
    assert api.build_static(s).entries() == ref.build_static(s.tolist()).entries()


@SETTINGS
@given(st.lists(streams(max_size=120), min_size=0, max_size=4))
def test_merge_equals_reference(parts):
    mine = [api.build_static(p) for p in parts] + [api.as_sorted(ref_cache(p)) for p in parts]
    theirs = [ref.build_static(p.tolist()) for p in parts] + [ref_cache(p) for p in parts]
    assert api.merge_caches(mine).entries() == ref.merge_caches(theirs).entries()


@SETTINGS
@given(streams(max_size=200), streams(max_size=200), streams(max_size=200), st.integers(1, 8),
       st.sampled_from(["exact", "int32"]), st.integers(1, 60))
def test_live_drafter_equals_reference(prompt, static_src, dyn_src, n_draft, score, seed):
    """Step by step like generation: draft, accept a prefix, extend with the accepted and a new token."""
    c_st = ref.build_static(static_src.tolist()) if len(static_src) % 3 else None
    c_dyn = ref_cache(dyn_src) if len(dyn_src) % 2 else None
    mine = api.NgramDrafter(c_st=c_st, c_dyn=c_dyn, score=score)
    theirs = ref.NgramDrafter(c_st=c_st, c_dyn=c_dyn, score=score)
    mine.reset(prompt[:seed])
    theirs.reset(prompt[:seed].tolist())
    rng = np.random.default_rng(seed)
    for _ in range(25):
        d = mine.draft(n_draft)
        assert d == theirs.draft(n_draft)
        m = int(rng.integers(0, len(d) + 1))
        step = d[:m] + [int(rng.integers(0, 6))]
        mine.extend(step)
        theirs.extend(step)
    assert mine.tokens.tolist() == theirs.tokens


def test_drafter_int32_scores_wrap_like_llama_cpp():
    """``w(1) = 100 * 3e6``: with ``c_ctx((1, 1), 1) = 10`` the product 3e9 wraps negative in int32, so
    llama.cpp's scoring drops token 1 and falls back to the static cache's 2; exact scores draft 1."""
    c_st = NgramCache({(1, 1): {1: 3_000_000, 2: 3_000_001}})
    prompt = [1] * 12 + [2, 1, 1]
    first = {}
    for score in ("exact", "int32"):
        mine, theirs = api.NgramDrafter(c_st=c_st, score=score), ref.NgramDrafter(c_st=c_st, score=score)
        mine.reset(prompt)
        theirs.reset(prompt)
        first[score] = mine.draft(4)
        assert first[score] == theirs.draft(4)
    assert (first["exact"][0], first["int32"][0]) == (1, 2)


@settings(max_examples=25, deadline=None)
@given(streams(min_size=0, max_size=400), streams(max_size=300), streams(max_size=200), st.integers(2, 90),
       st.integers(1, 6), st.sampled_from(["exact", "int32"]))
def test_replay_equals_reference(s, static_src, dyn_src, n_ctx, n_draft, score):
    c_st = ref.build_static(static_src.tolist()) if len(static_src) % 2 else None
    c_dyn = ref_cache(dyn_src) if len(dyn_src) % 3 else None
    got, want = [], []
    a = api.replay(s, n_ctx, n_draft, c_st=c_st, c_dyn=c_dyn, on_draft=lambda p, d: got.append((p, d)), score=score)
    b = ref.replay(s.tolist(), n_ctx, n_draft, c_st=c_st, c_dyn=c_dyn, on_draft=lambda p, d: want.append((p, d)),
                   score=score)
    assert got == want
    assert (a.n_chunks, a.n_draft_calls, a.n_drafted, a.n_accept) == (b.n_chunks, b.n_draft_calls, b.n_drafted, b.n_accept)
    assert api.cache_entries(a.c_dyn) == b.c_dyn.entries()


def test_replay_does_not_modify_given_dynamic_cache():
    c_dyn = api.as_table(ref_cache([1, 2, 3, 1, 2, 3]))
    before = c_dyn.entries()
    api.replay(np.array([1, 2, 3] * 10, np.int32), 8, 4, c_dyn=c_dyn)
    assert c_dyn.entries() == before


def test_hash_table_growth_keeps_counts():
    """Many more keys than the initial capacity: rehashing keeps every count."""
    rng = np.random.default_rng(3)
    s = rng.integers(0, 5000, 30_000).astype(np.int32)
    t = HashTable(4, 4)
    for lo in range(0, len(s), 997):
        t.update(s, lo, min(len(s), lo + 997))
    assert t.entries() == ref_cache(s).entries()


@SETTINGS
@given(streams(min_size=2), streams(), st.integers(0, 400), st.integers(0, 64))
def test_keep_most_counted_keeps_the_largest_counts_latest_first(s, more, n, room):
    """``serve --dynamic-max-entries``' rule: the ``n`` entries of the largest counts, the latest learned first
    among equal counts, their counts unchanged; the rebuilt table then learns as a table built from them."""
    t = HashTable()
    t.update(s)
    w0, w1, tok, cnt = t.arrays()                  # insertion order: the latest learned last
    order = sorted(range(len(tok)), key=lambda e: (-cnt[e], -e))[:n]
    kept = HashTable()
    kept.add_rows(w0[order], w1[order], tok[order], cnt[order])
    assert t.keep_most_counted(n, room) == max(0, len(tok) - n)
    assert t.entries() == kept.entries() and len(t) == len(kept) and t.n_entries() == min(n, len(tok))
    t.update(more)
    kept.update(more)
    assert t.entries() == kept.entries()


@pytest.mark.parametrize("bad", [[-1], [2**31], [1, -5]])
def test_negative_or_huge_token_ids_rejected(bad):
    d = api.NgramDrafter()
    with pytest.raises(ValueError, match="token id"):
        d.reset(bad)
    with pytest.raises(ValueError, match="token id"):
        api.replay(np.array(bad, np.int64), 4, 2)


def test_bad_arguments_rejected():
    with pytest.raises(ValueError, match="n_draft"):
        api.NgramDrafter().draft(-1)
    with pytest.raises(ValueError, match="score"):
        api.NgramDrafter(score="float")
    with pytest.raises(ValueError, match="n_ctx"):
        api.replay([1, 2, 3], n_ctx=1)



@pytest.mark.parametrize("backend", [api, ref], ids=["mlx", "reference"])
def test_static_cache_of_other_sizes_is_refused_like_the_reference(backend):
    """A static cache holds 2-grams only; drafting would silently ignore the rest (a dynamic cache passed as static)."""
    wrong = NgramCache({(1, 2, 3): {4: 1}, (1, 2): {3: 1}})
    if backend is api:
        wrong = api.as_sorted(wrong)
    with pytest.raises(ValueError, match=r"sizes \[2, 3\]; a static cache must hold 2-grams only"):
        backend.NgramDrafter(c_st=wrong)
    with pytest.raises(ValueError, match="must hold 2-grams only"):
        backend.replay([1, 2, 3, 1, 2, 3], n_ctx=4, c_st=wrong)

def test_build_static_from_token_file_is_memory_mapped(tmp_path):
    s = np.random.default_rng(5).integers(0, 40, 5000).astype(np.int32)
    path = tmp_path / "t.i32"
    s.astype("<i4").tofile(path)
    assert api.build_static(str(path)) == api.build_static(s)
    (tmp_path / "bad.i32").write_bytes(b"\x01\x00\x00")
    with pytest.raises(ValueError, match="not a multiple of 4"):
        api.build_static(str(tmp_path / "bad.i32"))
    np.array([3, -2, 4], "<i4").tofile(tmp_path / "neg.i32")
    with pytest.raises(ValueError, match="negative token id -2 at index 1"):
        api.build_static(str(tmp_path / "neg.i32"))


def test_extend_rejects_bad_arrays_and_accepts_numpy_ids():
    d = api.NgramDrafter()
    with pytest.raises(ValueError, match="integers"):
        d.extend(np.array([1.5]))
    with pytest.raises(ValueError, match="invalid token id -3"):
        d.extend(np.array([1, -3], np.int64))
    with pytest.raises(ValueError, match="invalid token id 'a'"):
        d.extend(["a"])
    d.extend(np.array([4, 5, 4, 5], np.int64))
    d.extend([np.int32(4)])
    assert d.tokens.tolist() == [4, 5, 4, 5, 4]
    assert d.draft(2) == ref_drafts([4, 5, 4, 5, 4], 2)


def ref_drafts(tokens, n_draft):
    r = ref.NgramDrafter()
    r.reset(tokens)
    return r.draft(n_draft)


@pytest.mark.parametrize("top", [2**21 - 1, 2**21, 2**21 + 1])
def test_build_static_at_the_packing_bound_counts_every_triple(top):
    """Ids below ``2**21`` are packed 21 bits each; one equal to ``2**21`` needs 22 bits, so it must take the
    row-sorting path. Expected counts: a plain dictionary of (t[i-2], t[i-1], t[i]) triples."""
    s = np.array([top, 5, top, 5, 7, top, 5, top, 0, top], np.int32)
    counts = {}
    for i in range(2, len(s)):
        key = (int(s[i - 2]), int(s[i - 1]), int(s[i]))
        counts[key] = counts.get(key, 0) + 1
    want = sorted((2, a, b, -1, -1, y, c) for (a, b, y), c in counts.items())
    assert api.build_static(s).entries() == want


@pytest.mark.parametrize("backend", [api, ref], ids=["mlx", "reference"])
def test_replay_progress_ends_at_the_tokens_replayed(backend):
    """``progress(done, total)`` after each chunk: 10 tokens in chunks of 4 replay 2 chunks (starts 0 and 4:
    ``i_start + n_ctx < N``), so 8 tokens, not the 10 of the input."""
    calls = []
    backend.replay(list(range(10)), n_ctx=4, n_draft=2, progress=lambda done, total: calls.append((done, total)))
    assert calls == [(4, 8), (8, 8)]


@pytest.mark.parametrize("backend", [api, ref], ids=["mlx", "reference"])
def test_a_score_tie_among_static_followers_goes_to_the_smallest_id(backend):
    """Hand-made tie between two followers that both follow the static 2-gram: c_dyn((9,)) = {1: 6, 2: 1,
    3: 1}, c_st((7, 9)) = {1: 1, 2: 6}: s(1) = 6 * 100 = s(2) = 1 * 600. Ties go to the smallest id, 1,
    which passes the strict 1-gram share (100 * 6 >= 75 * 8), so 1 is drafted. (Token 2 would fail it
    and fall back to the static cache, which drafts its most frequent follower, 2.) The key has more
    followers than the 2-gram (3 > 2): the fast kernel walks the static followers."""
    c_dyn = NgramCache({(9,): {1: 6, 2: 1, 3: 1}})
    c_st = NgramCache({(7, 9): {1: 1, 2: 6}})
    d = backend.NgramDrafter(c_st=c_st, c_dyn=c_dyn)
    d.reset([7, 9])  # c_ctx: (7,) -> 9 only, nothing ends in 9
    assert d.draft(1) == [1]
