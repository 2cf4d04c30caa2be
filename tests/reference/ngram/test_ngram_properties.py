"""Invariants of the n-gram reference that follow from llama.cpp's definitions (spec sections 2-5),
checked with hypothesis on random streams (small vocabularies, so that n-grams repeat and tie)."""
from __future__ import annotations

import collections

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from reference.ngram.cache_file import load_cache, save_cache
from reference.ngram.draft import LAX, draft
from reference.ngram.drafter import NgramDrafter
from reference.ngram.cache import NgramCache
from reference.ngram.replay import replay

SETTINGS = settings(max_examples=60, deadline=None)

streams = st.lists(st.integers(0, 5), min_size=0, max_size=80)
token_ids = st.integers(0, 2**31 - 1)
counts = st.integers(1, 2**31 - 1)
ngrams = st.lists(token_ids, min_size=1, max_size=4).map(tuple)
caches = st.dictionaries(ngrams, st.dictionaries(token_ids, st.integers(1, 1000), min_size=1, max_size=4),
                         max_size=12).map(NgramCache)


def occurrences(inp, n_min, n_max):
    """Independent count: every (n-gram, next token) pair of the stream."""
    return collections.Counter((tuple(inp[i - n:i]), inp[i]) for n in range(n_min, n_max + 1)
                               for i in range(n, len(inp)))


def as_counter(cache):
    return collections.Counter({(eta, y): c for eta, part in cache.counts.items() for y, c in part.items()})


@SETTINGS
@given(streams, st.integers(1, 4), st.integers(0, 3))
def test_counts_sum_to_positions_inserted(inp, n_min, extra):
    n_max = min(4, n_min + extra)
    c = NgramCache()
    c.update(inp, len(inp), n_min, n_max)
    assert c.total() == sum(max(0, len(inp) - n) for n in range(n_min, n_max + 1))
    assert as_counter(c) == occurrences(inp, n_min, n_max)
    assert all(cnt > 0 for part in c.counts.values() for cnt in part.values())


@SETTINGS
@given(streams, st.lists(st.integers(0, 80), max_size=6))
def test_incremental_updates_equal_one_batch(inp, cuts):
    """update(inp, n_new) over growing prefixes counts each occurrence exactly once (h:71-72)."""
    batch = NgramCache()
    batch.update(inp, len(inp))
    step = NgramCache()
    done = 0
    for end in sorted({min(c, len(inp)) for c in cuts} | {len(inp)}):
        step.update(inp[:end], end - done)
        done = end
    assert step == batch


@SETTINGS
@given(caches, caches, caches)
def test_merge_is_associative_and_commutative(a, b, c):
    def merged(*cs):
        out = NgramCache()
        for x in cs:
            out.merge(x)
        return out
    assert merged(a, b) == merged(b, a)
    assert merged(merged(a, b), c) == merged(a, merged(b, c))
    assert as_counter(merged(a, b)) == as_counter(a) + as_counter(b)
    assert merged(a, NgramCache()) == a


@SETTINGS
@given(st.dictionaries(ngrams, st.dictionaries(token_ids, counts, min_size=1, max_size=4), min_size=1, max_size=12))
def test_save_load_round_trip(tmp_path_factory, counts_dict):
    """A non-empty cache round-trips (an empty one is refused: tests/mlx_backend/ngram/test_static_file.py::test_empty_files)."""
    cache = NgramCache(counts_dict)
    path = tmp_path_factory.mktemp("rt") / "c.bin"
    save_cache(cache, path)
    assert path.stat().st_size == sum(20 + 8 * len(p) for p in counts_dict.values())
    loaded = load_cache(path)
    assert loaded == cache
    assert loaded.entries() == cache.entries()


@SETTINGS
@given(st.lists(st.integers(0, 3), min_size=0, max_size=60), st.integers(1, 12), caches, caches,
       st.sampled_from(["exact", "int32"]))
def test_drafts_never_exceed_n_draft(inp, n_draft, c_dyn, c_st, score):
    c_ctx = NgramCache()
    c_ctx.update(inp, len(inp))
    d = draft(inp, n_draft, c_ctx, c_dyn, c_st, score=score)
    assert len(d) <= n_draft
    assert (len(inp) >= 2) or d == []


@SETTINGS
@given(st.lists(st.integers(0, 3), min_size=2, max_size=60), st.integers(1, 12),
       st.dictionaries(st.tuples(st.integers(0, 3), st.integers(0, 3)),
                       st.dictionaries(st.integers(0, 3), st.integers(1, 50), min_size=1), max_size=16))
def test_int32_equals_exact_without_overflow(inp, n_draft, st_counts):
    """Scores below 2**31 never wrap, so both arithmetics draft the same (counts here stay small)."""
    c_ctx = NgramCache()
    c_ctx.update(inp, len(inp))
    c_st = NgramCache(st_counts)
    assert draft(inp, n_draft, c_ctx, c_ctx, c_st) == draft(inp, n_draft, c_ctx, c_ctx, c_st, score="int32")


@SETTINGS
@given(st.lists(st.integers(0, 4), max_size=40), st.lists(st.integers(0, 4), max_size=20), st.integers(1, 6))
def test_drafter_is_the_draft_function_with_a_live_context_cache(prompt, emitted, n_draft):
    d = NgramDrafter()
    d.reset(prompt)
    d.extend(emitted)
    c_ctx = NgramCache()
    c_ctx.update(prompt + emitted, len(prompt + emitted))
    assert d.tokens == prompt + emitted
    assert d.c_ctx == c_ctx
    assert d.draft(n_draft) == draft(prompt + emitted, n_draft, c_ctx)


@SETTINGS
@given(st.lists(st.integers(0, 3), min_size=0, max_size=300), st.integers(2, 60), st.integers(1, 8))
def test_replay_counts_follow_from_the_dump(inp, n_ctx, n_draft):
    """n_drafted, n_accept and the chunking follow from the dump and the tokens alone (vectors README 3.3),
    and the dynamic cache ends up holding exactly the n-grams of the replayed chunks."""
    lines = []
    stats = replay(inp, n_ctx=n_ctx, n_draft=n_draft, on_draft=lambda pos, d: lines.append((pos, d)))
    n_chunks = max(0, (len(inp) - 1) // n_ctx)
    assert stats.n_chunks == n_chunks
    assert stats.n_draft_calls == len(lines)
    assert stats.n_drafted == sum(len(d) for _, d in lines)
    n_accept = 0
    for pos, d in lines:
        chunk_end = (pos // n_ctx + 1) * n_ctx if pos % n_ctx else pos  # pos is never a chunk start
        for j, t in enumerate(d):
            if pos + j >= chunk_end or inp[pos + j] != t:
                break
            n_accept += 1
        assert len(d) <= n_draft
    assert stats.n_accept == n_accept
    expected_dyn = NgramCache()
    for k in range(n_chunks):
        chunk = inp[k * n_ctx:(k + 1) * n_ctx]
        expected_dyn.update(chunk, len(chunk))
    assert stats.c_dyn == expected_dyn


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 12), st.integers(1, 16), st.integers(0, 2**20), st.data())
def test_a_repeating_period_is_drafted_and_accepted(p, n_draft, seed, data):
    """Once a period of distinct tokens has been seen and 3 more tokens emitted, the 3-gram (seen once,
    a_3 = 1) predicts the period: every later draft call drafts the next n_draft tokens of the period,
    and all of them that lie inside the chunk are accepted."""
    base = np.random.default_rng(seed).permutation(1000)[:p].tolist()
    reps = -(-(2 * n_draft + 8) // p) + 2 + data.draw(st.integers(0, 4))
    inp = base * reps + base[:1]
    n_ctx = len(inp) - 1  # one chunk: everything but the last token
    lines = []
    stats = replay(inp, n_ctx=n_ctx, n_draft=n_draft, on_draft=lambda pos, d: lines.append((pos, d)))
    late = [(pos, d) for pos, d in lines if pos >= p + 3]
    assert late, "the stream is long enough to reach the periodic regime"
    for pos, d in late:
        assert d == [base[(pos + j) % p] for j in range(n_draft)]
    assert stats.n_accept >= sum(min(n_draft, n_ctx - pos) for pos, _ in late) > 0


def test_thresholds_table():
    """The lax thresholds of the spec's table (ngram-cache.cpp:59-62), spelled out once more."""
    assert [LAX.a_n[n - 1] for n in (1, 2, 3, 4)] == [2, 2, 1, 1]
    assert [LAX.p_n[n - 1] for n in (1, 2, 3, 4)] == [66, 50, 50, 50]


@SETTINGS
@given(st.lists(st.integers(0, 3), max_size=120), st.integers(2, 30), caches)
def test_replay_adds_the_chunks_to_a_copy_of_the_dynamic_cache(inp, n_ctx, c_dyn):
    before = c_dyn.copy()
    stats = replay(inp, n_ctx=n_ctx, n_draft=4, c_dyn=c_dyn)
    assert c_dyn == before
    chunks = NgramCache()
    for k in range(max(0, (len(inp) - 1) // n_ctx)):
        chunk = inp[k * n_ctx:(k + 1) * n_ctx]
        chunks.update(chunk, len(chunk))
    assert stats.c_dyn == before.copy().merge(chunks)


@SETTINGS
@given(st.dictionaries(ngrams, st.dictionaries(token_ids, counts, min_size=1, max_size=4), min_size=1, max_size=12),
       st.randoms(use_true_random=False))
def test_equal_caches_save_to_equal_bytes_in_the_documented_order(tmp_path_factory, counts_dict, rnd):
    """cache_file's promise: records sorted (n-grams by size then tokens, followers by token), so that equal
    caches give equal files whatever order they were built in. Before, only the size and the loaded counts
    were checked: a save in insertion order passed."""
    def shuffled(d):
        items = list(d.items())
        rnd.shuffle(items)
        return dict(items)

    a = NgramCache({eta: dict(sorted(part.items())) for eta, part in counts_dict.items()})
    b = NgramCache({eta: shuffled(part) for eta, part in shuffled(counts_dict).items()})
    folder = tmp_path_factory.mktemp("order")
    save_cache(a, folder / "a.bin")
    save_cache(b, folder / "b.bin")
    data = (folder / "b.bin").read_bytes()
    assert (folder / "a.bin").read_bytes() == data
    words, o, keys = np.frombuffer(data, "<i4").tolist(), 0, []
    while o < len(words):
        slots, nt = words[o:o + 4], words[o + 4]
        followers = words[o + 5:o + 5 + 2 * nt:2]
        assert followers == sorted(followers) and len(set(followers)) == nt
        keys.append((4 - slots.count(-1), slots))
        o += 5 + 2 * nt
    assert keys == sorted(keys) and len(keys) == len(counts_dict)
