"""The fast suffix drafter (``mlx_backend.suffix``) drafts exactly what the reference's does
(``reference.suffix.drafter``), step by step: draft and match length, with a history that drops
sequences, with hash collisions forced, across requests."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("numba")

import mlx_backend.suffix.index as index  # noqa: E402
import reference.suffix.drafter as ref  # noqa: E402
from mlx_backend.ngram.default import DRAFTERS, make_drafter  # noqa: E402
from mlx_backend.suffix.drafter import SuffixDrafter, SuffixHistory  # noqa: E402
from reference.drafter import Drafter  # noqa: E402
from reference.suffix.auto import AutoDrafter  # noqa: E402

SETTINGS = settings(max_examples=120, deadline=None)
ROOT = Path(__file__).resolve().parents[3]
PERSUASION = ROOT / "reference" / "data" / "persuasion.i32"


@st.composite
def runs(draw):
    """A small alphabet (so that matches happen), a history bound small enough to drop sequences, the
    history's sequences, a prompt, and steps: (k, tokens emitted, a sequence added to the history or None)."""
    alphabet = draw(st.integers(2, 6))
    seq = st.lists(st.integers(0, alphabet - 1), max_size=24)
    return {
        "max_tokens": draw(st.integers(0, 48)),
        "history": draw(st.lists(seq, max_size=6)),
        "prompt": draw(st.lists(st.integers(0, alphabet - 1), max_size=40)),
        "steps": draw(st.lists(st.tuples(st.integers(0, 80), st.lists(st.integers(0, alphabet - 1), max_size=12),
                                         st.none() | seq), max_size=25)),
        "ladder": draw(st.sampled_from([ref.LADDER, (1, 2, 3, 5, 8), (2, 7)])),
        "max_match": draw(st.sampled_from([ref.MAX_MATCH, 6, 1])),
        "factor": draw(st.sampled_from([ref.FACTOR, 0.5, 3.0])),
    }


def check_run(run) -> None:
    """Both drafters, each with its history, follow ``run``; every step's draft and match length agree."""
    hf, hr = SuffixHistory(run["max_tokens"]), ref.SuffixHistory(run["max_tokens"])
    for s in run["history"]:
        hf.add(s)
        hr.add(s)
    kw = {k: run[k] for k in ("ladder", "max_match", "factor")}
    fast, slow = SuffixDrafter(hf, **kw), ref.SuffixDrafter(hr, **kw)
    fast.reset(run["prompt"])
    slow.reset(run["prompt"])
    for step, (k, emitted, added) in enumerate(run["steps"]):
        assert (fast.draft(k), fast.match_length) == (slow.draft(k), slow.match_length), step
        fast.extend(emitted)
        slow.extend(emitted)
        if added is not None:
            hf.add(added)
            hr.add(added)
        assert hf.sequences == hr.sequences and hf.n_tokens == hr.n_tokens
    assert fast.tokens.tolist() == slow.tokens
    assert (fast.draft(80), fast.match_length) == (slow.draft(80), slow.match_length)


@SETTINGS
@given(runs())
def test_drafts_equal_the_reference(run):
    check_run(run)


@settings(max_examples=60, deadline=None)
@given(runs(), st.sampled_from([0, 1, 3]))
def test_hash_collisions_still_give_the_reference_draft(run, hash_mask):
    """With keys made from 0..2 bits of the window hash, nearly every lookup lands on another window's
    slot: the tokens are checked and the corpus scanned, and the drafts stay the reference's."""
    with mock.patch.object(index, "HASH_MASK", hash_mask):
        check_run(run)


def test_forced_collisions_reach_the_scan():
    """The collision test above is not vacuous: under a zero mask every window of a length shares one
    slot, which holds the latest window of that length, not the suffix's occurrence ("1 2" ends at 2)."""
    with mock.patch.object(index, "HASH_MASK", 0):
        d = SuffixDrafter()
        d.reset([1, 2, 3, 9, 2, 3, 1, 2])
    assert d._index.meta[0] <= len(ref.LADDER)
    assert d.draft(4) == [3, 9, 2, 3] and d.match_length == 2


def counting(f, calls: dict, name: str):
    """``f``, counting its calls in ``calls[name]``."""
    def counted(*args):
        calls[name] += 1
        return f(*args)
    return counted


def test_long_text_with_history_equals_the_reference(monkeypatch):
    """Real text: tables grow (doubling, re-indexing: counted) and the history compacts (counted); sampled
    steps agree."""
    text = np.fromfile(PERSUASION, "<i4")[:6000].astype(np.int32)
    hf, hr = SuffixHistory(2500), ref.SuffixHistory(2500)
    calls = {"_compact": 0, "rebuild": 0}
    for cls, name in ((SuffixHistory, "_compact"), (index.LatestEnds, "rebuild")):
        monkeypatch.setattr(cls, name, counting(getattr(cls, name), calls, name))
    for lo in range(0, 4000, 700):
        hf.add(text[lo:lo + 700])
        hr.add(text[lo:lo + 700].tolist())
    fast, slow = SuffixDrafter(hf), ref.SuffixDrafter(hr)
    fast.reset(text[3000:3500])
    slow.reset(text[3000:3500].tolist())
    for lo in range(3500, 6000, 50):
        assert (fast.draft(32), fast.match_length) == (slow.draft(32), slow.match_length), lo
        fast.extend(text[lo:lo + 50])
        slow.extend(text[lo:lo + 50].tolist())
    assert calls["_compact"] >= 1 and calls["rebuild"] >= 3


def test_reset_keeps_the_history_and_drafting_does_not_change_it():
    h = SuffixHistory(100)
    d = SuffixDrafter(h)
    d.reset([4, 5, 6, 7, 4, 5])
    assert d.draft(3) == [6, 7, 4]
    h.add(d.tokens.tolist() + [8, 9])
    before = (h.sequences, h.n_tokens)
    d.reset([1, 6, 7])
    assert d.tokens.tolist() == [1, 6, 7]
    assert d.draft(8) == [4, 5, 8, 9] and d.match_length == 2    # from the history sequence, to its end
    assert (h.sequences, h.n_tokens) == before


def test_drafters_share_one_history_with_different_ladders():
    h = SuffixHistory()
    a, b = SuffixDrafter(h), SuffixDrafter(h, ladder=(5,), max_match=5)  # b's length 5 is indexed too
    h.add([1, 2, 3, 4, 5, 6, 7])
    a.reset([0, 1, 2, 3, 4, 5])
    b.reset([0, 1, 2, 3, 4, 5])
    assert a.draft(4) == [6, 7] and a.match_length == 5
    assert b.draft(4) == [6, 7] and b.match_length == 5
    b.reset([9, 2, 3, 4, 5])
    assert b.draft(4) == [] and b.match_length == 0      # only 4 tokens match: below b's one length


def test_the_drafter_is_a_drafter_and_checks_its_input():
    d = SuffixDrafter()
    assert isinstance(d, Drafter)
    d.reset(np.array([3, 3, 3], np.int64))
    assert d.draft(5) == [3, 3, 3, 3, 3] and d.tokens.dtype == np.int32
    for bad in ([-1], [2**31], np.array([-2]), np.array([2**31])):
        with pytest.raises(ValueError):
            d.extend(bad)
    # the reference's class has the same name: the message names its module (it said "got SuffixHistory")
    with pytest.raises(TypeError, match=r"must be a mlx_backend\.suffix\.drafter\.SuffixHistory, got "
                                        r"reference\.suffix\.drafter\.SuffixHistory"):
        SuffixDrafter(ref.SuffixHistory())
    with pytest.raises(ValueError):
        SuffixHistory(-1)
    with pytest.raises(ValueError):
        SuffixDrafter(factor=0)


def test_make_drafter_builds_the_fast_drafters():
    from mlx_backend.ngram.drafter import NgramDrafter

    assert DRAFTERS == ("lookup", "suffix", "auto")
    h = SuffixHistory()
    assert isinstance(make_drafter("lookup"), NgramDrafter)
    assert isinstance(make_drafter("suffix", history=h), SuffixDrafter)
    auto = make_drafter("auto", history=h, min_match=2)
    assert isinstance(auto, AutoDrafter) and isinstance(auto.suffix, SuffixDrafter)
    assert isinstance(auto.lookup, NgramDrafter) and auto.min_match == 2 and auto.suffix.history is h
    with pytest.raises(ValueError, match="lookup, suffix, auto"):
        make_drafter("sufix")


USE_AFTER_PRECOMPILE = """
import numpy as np
from mlx_backend.suffix.drafter import SuffixDrafter, SuffixHistory
h = SuffixHistory(1000)
h.add(np.arange(300, dtype=np.int64) % 7)
h.add((3, 4, 5))
for d in (SuffixDrafter(h), SuffixDrafter(h, ladder=(2, 5, 9), max_match=9, factor=1.5), SuffixDrafter()):
    d.reset(list(range(5)) * 40)
    for k in (0, 1, 16, 80):
        d.draft(k)
        d.extend(np.array([1, 2, 3], np.int32))
"""


def test_precompile_compiles_every_suffix_kernel(tmp_path):
    """After :func:`mlx_backend.cli.precompile.compile_suffix_kernels`, drafting with other inputs (arrays of
    other dtypes, tuples, other ladders, no history) compiles nothing: numba's cache gains no file."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    compile_ = "from mlx_backend.cli.precompile import compile_suffix_kernels; compile_suffix_kernels()"
    subprocess.run([sys.executable, "-c", compile_], env=env, cwd=ROOT, check=True, timeout=600)
    before = sorted(p.name for p in tmp_path.rglob("*") if p.is_file())
    assert any(name.startswith("index.draft") for name in before)
    subprocess.run([sys.executable, "-c", USE_AFTER_PRECOMPILE], env=env, cwd=ROOT, check=True, timeout=600)
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == before


def test_the_history_bound_is_inclusive():
    """``max_tokens`` may be anything from 0 to ``MAX_HISTORY_TOKENS`` (both allowed); one more is refused."""
    from mlx_backend.suffix.drafter import MAX_HISTORY_TOKENS

    assert MAX_HISTORY_TOKENS == (1 << 32) // 8
    assert SuffixHistory(MAX_HISTORY_TOKENS).max_tokens == MAX_HISTORY_TOKENS
    assert SuffixHistory(0).max_tokens == 0
    with pytest.raises(ValueError, match="max_tokens"):
        SuffixHistory(MAX_HISTORY_TOKENS + 1)


def test_a_sequence_may_fill_every_position(monkeypatch):
    """Positions are stored in 32 bits: a sequence of exactly ``MAX_POSITIONS`` tokens fits, one more does
    not (the bound made small here to test it)."""
    import mlx_backend.suffix.drafter as fast

    monkeypatch.setattr(fast, "MAX_POSITIONS", 8)
    d = SuffixDrafter()
    d.reset([1, 2, 3, 1, 2, 3, 1])
    d.extend([2])  # 8 tokens: every position used
    assert d.tokens.tolist() == [1, 2, 3, 1, 2, 3, 1, 2]
    with pytest.raises(ValueError, match="at most 8 tokens"):
        d.extend([3])
    with pytest.raises(ValueError, match="at most 8 tokens"):
        SuffixDrafter().reset(list(range(9)))
