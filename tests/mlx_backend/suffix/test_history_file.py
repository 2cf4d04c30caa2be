"""``mlx_backend.suffix.history_file``: a suffix history written to a file reads back as the same sequences,
into the reference's history and the fast one alike, and a file that is not one is refused by name."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

pytest.importorskip("numba")

from mlx_backend.suffix.drafter import SuffixHistory  # noqa: E402
from mlx_backend.suffix.history_file import load_history, save_history  # noqa: E402
from reference.suffix.drafter import SuffixHistory as ReferenceHistory  # noqa: E402

sequences = st.lists(st.lists(st.integers(0, 2**31 - 1), min_size=0, max_size=12), max_size=8)


@settings(max_examples=60, deadline=None)
@given(sequences, st.integers(0, 40), st.integers(0, 40))
def test_a_saved_history_reads_back_as_one_that_saw_the_same_sequences(tmp_path_factory, seqs, bound, read_bound):
    """Saved from a history bounded by ``bound`` and read into one bounded by ``read_bound``: the sequences
    of a live history with that bound that was given the kept sequences in order (the newest kept)."""
    path = tmp_path_factory.mktemp("h") / "history"
    saved = SuffixHistory(bound)
    for s in seqs:
        saved.add(s)
    save_history(path, saved)
    for kind in (SuffixHistory, ReferenceHistory):
        live = kind(read_bound)
        for s in saved.sequences:
            live.add(s)
        loaded = load_history(path, kind(read_bound))
        assert loaded.sequences == live.sequences and loaded.n_tokens == live.n_tokens


def test_the_loaded_history_drafts_what_the_saved_one_drafted(tmp_path):
    from mlx_backend.suffix.drafter import SuffixDrafter

    saved = SuffixHistory(100)
    saved.add([7, 8, 9, 10, 11])
    save_history(tmp_path / "h", saved)
    drafters = [SuffixDrafter(h) for h in (saved, load_history(tmp_path / "h", SuffixHistory(100)))]
    for d in drafters:
        d.reset([1, 8, 9])
    assert drafters[0].draft(4) == drafters[1].draft(4) == [10, 11]


def test_a_missing_file_is_an_empty_history(tmp_path):
    assert load_history(tmp_path / "none", SuffixHistory(10)).sequences == []


def _npz(path, **arrays):
    with open(path, "wb") as f:
        np.savez(f, **arrays)


def _npy(path, array):
    """A single array (``np.save``): before, ``TypeError`` (not a context manager), a traceback at start."""
    with open(path, "wb") as f:
        np.save(f, array)


@pytest.mark.parametrize("write, words", [
    (lambda p: p.write_bytes(b""), "not a suffix history file"),
    (lambda p: p.write_bytes(b"\x01\x02 not an archive"), "not a suffix history file"),
    (lambda p: p.write_bytes(b"x"), "not a zip archive"),
    (lambda p: _npy(p, np.arange(3)), "not a suffix history file"),
    (lambda p: _npz(p, tokens=np.arange(3, dtype=np.int32)), "not a suffix history file"),
    (lambda p: _npz(p, tokens=np.zeros((2, 2), np.int32), lengths=np.array([4])), "1-D integer arrays"),
    (lambda p: _npz(p, tokens=np.arange(3.0), lengths=np.array([3])), "1-D integer arrays"),
    (lambda p: _npz(p, tokens=np.arange(3, dtype=np.int32), lengths=np.array([2])), "must add up"),
    (lambda p: _npz(p, tokens=np.arange(3, dtype=np.int32), lengths=np.array([3, 0])), "must add up"),
    (lambda p: _npz(p, tokens=np.array([1, -1], np.int64), lengths=np.array([2])), "token id outside"),
    (lambda p: _npz(p, tokens=np.array([1, 2**31], np.int64), lengths=np.array([2])), "token id outside"),
], ids=["empty", "not-npz", "one-byte", "npy", "no-lengths", "2-D", "floats", "short", "zero-length", "negative", "too-large"])
def test_a_file_that_is_not_a_history_is_refused_by_name(tmp_path, write, words):
    path = tmp_path / "h"
    write(path)
    with pytest.raises(ValueError, match=words) as info:
        load_history(path, SuffixHistory(10))
    assert str(path) in str(info.value)
    assert "pickle" not in str(info.value)     # numpy's advice to load the file unsafely is not passed on
