"""``stats --n-draft`` far above the chunk: the fast replay's cost does not grow with ``n_draft`` beyond
the tokens it must keep, and its counts stay those of the reference (mlx_backend.ngram.hash_table.draft_length)."""
from __future__ import annotations

import json

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import mlx_backend.ngram.api as fast
import reference.ngram.api as ref
from mlx_backend.cli import main
from reference.ngram.cache import NgramCache

VOCAB = 5  # 5**4 = 625 four-token states: a draft longer than that has repeated a state, so it never stops


@st.composite
def streams(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    tokens = rng.integers(0, draw(st.integers(2, VOCAB)), draw(st.integers(0, 120))).astype(np.int32)
    corpus = rng.integers(0, VOCAB, draw(st.integers(0, 60))).tolist()
    return tokens, (ref.build_static(corpus) if draw(st.booleans()) else None)


def per_call(tokens, n_ctx, n_draft, c_st):
    """Reference draft lengths, call by call."""
    ks = []
    stats = ref.replay(tokens, n_ctx=n_ctx, n_draft=n_draft, c_st=c_st, on_draft=lambda pos, d: ks.append(len(d)))
    return stats, ks


@settings(max_examples=40, deadline=None)
@given(streams(), st.integers(2, 24), st.integers(1, 900))
def test_long_drafts_count_like_the_reference(case, n_ctx, n_draft):
    """Above ``n_ctx`` the fast replay keeps only the tokens that can be accepted and measures the
    rest; the counts equal the reference's, with and without recording the drafts."""
    tokens, c_st = case
    want, ks = per_call(tokens, n_ctx, n_draft, c_st)
    got = fast.replay(tokens, n_ctx=n_ctx, n_draft=n_draft, c_st=c_st)
    recorded = []
    dumped = fast.replay(tokens, n_ctx=n_ctx, n_draft=n_draft, c_st=c_st, on_draft=lambda p, d: recorded.append(len(d)))
    for stats in (got, dumped):
        assert (stats.n_draft_calls, stats.n_drafted, stats.n_accept) == (want.n_draft_calls, want.n_drafted,
                                                                         want.n_accept)
    assert recorded == ks


@settings(max_examples=15, deadline=None)
@given(streams(), st.integers(2, 24))
def test_a_huge_n_draft_costs_no_more_than_the_drafts_it_keeps(case, n_ctx):
    """``n_draft = 10**12``: a draft that cycles counts ``n_draft`` tokens without walking them (before,
    the kernel allocated ``n_draft`` slots per chunk and walked every token: a MemoryError here, minutes
    for ``--n-draft 100000``). Every reference draft of 1000 tokens has repeated a 4-token state, so it
    is endless and counts 10**12."""
    tokens, c_st = case
    huge = 10**12
    _, ks = per_call(tokens, n_ctx, 1000, c_st)
    got = fast.replay(tokens, n_ctx=n_ctx, n_draft=huge, c_st=c_st)
    assert got.n_drafted == sum(k if k < 1000 else huge for k in ks)


def test_stats_cli_with_a_huge_n_draft(tmp_path, capsys):
    path = tmp_path / "t.i32"
    np.random.default_rng(0).integers(0, 50, 3000).astype("<i4").tofile(path)
    assert main(["stats", str(path), "--n-ctx", "1000", "--n-draft", str(10**12), "--json", "--backend", "mlx"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["n_draft_calls"] == 1998 and summary["n_drafted"] % 10**12 == 0 and summary["n_drafted"] > 0


def test_a_draft_that_stops_is_not_taken_for_a_cycle():
    """Hand-made: the dynamic cache drafts "4 3 4 3" after "1 2 3" and then nothing (no n-gram ends in
    "4 3 4 3" or its suffixes). The 4-token states "2 3 4 3" and "4 3 4 3" share their last three tokens
    but are different states: the draft stops after 4 tokens, it does not run to n_draft.

    Chunk "1 2 3 5 6" (n_ctx 5 of 6 tokens): calls at 1, 2 (nothing known), 3 (the draft "4 3 4 3", whose
    first token misses 5, so the fast replay measures the rest without keeping it) and 4 (nothing)."""
    c_dyn = NgramCache({(1, 2, 3): {4: 2}, (1, 2, 3, 4): {3: 2}, (2, 3, 4, 3): {4: 2}, (3, 4, 3, 4): {3: 2}})
    tokens = [1, 2, 3, 5, 6, 7]
    want = [(1, []), (2, []), (3, [4, 3, 4, 3]), (4, [])]
    calls = []
    ref.replay(tokens, n_ctx=5, n_draft=100, c_dyn=c_dyn, on_draft=lambda pos, d: calls.append((pos, d)))
    assert calls == want
    got = fast.replay(np.array(tokens, np.int32), n_ctx=5, n_draft=100, c_dyn=c_dyn)
    assert (got.n_draft_calls, got.n_drafted, got.n_accept) == (4, 4, 0)
