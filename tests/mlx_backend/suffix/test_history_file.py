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


A, B = bytes(range(32)), bytes(range(1, 33))     # two tokenizers' fingerprints


def test_a_history_of_another_tokenizer_is_refused_by_name(tmp_path):
    """Before: read silently whatever tokenizer it was written with (``serve --history`` after switching models):
    its ids meant other text, and every draft from it was rejected. Now the cache files' rule: another recorded
    vocabulary size or fingerprint is a ``ValueError`` naming the file, both tokenizers and the fix."""
    from mlx_backend.suffix.history_file import read_history

    saved = SuffixHistory(100)
    saved.add([1, 2, 3])
    path = tmp_path / "history"
    save_history(path, saved, vocab_size=50, fingerprint=A)
    for facts, words in (((50, B), f"fingerprint {A.hex()[:16]}..., in use {B.hex()[:16]}..."),
                         ((60, A), "built for a vocabulary of 50 tokens, the tokenizer in use has 60")):
        for read in (lambda: load_history(path, SuffixHistory(100), *facts), lambda: read_history(path, *facts)):
            with pytest.raises(ValueError, match="give --history another path, or delete the file") as info:
                read()
            assert str(info.value).startswith(f"{path}: ") and words in str(info.value), info.value


def test_a_history_of_the_same_tokenizer_loads_with_its_sequences(tmp_path):
    saved = SuffixHistory(100)
    saved.add([1, 2, 3])
    saved.add([49, 0])
    path = tmp_path / "history"
    save_history(path, saved, vocab_size=50, fingerprint=A)
    with np.load(path) as archive:
        assert int(archive["vocab_size"]) == 50 and archive["fingerprint"].tobytes() == A
    assert load_history(path, SuffixHistory(100), 50, A, n_vocab=64).sequences == [[1, 2, 3], [49, 0]]
    assert load_history(path, SuffixHistory(100)).sequences == [[1, 2, 3], [49, 0]]     # no tokenizer known


def test_a_history_written_before_tokenizers_were_recorded_still_loads(tmp_path):
    """A file of two arrays records no tokenizer: read with any, as a cache file whose fingerprint is all zero
    (unknown); only its ids can show it is another's, and an id neither the tokenizer nor the model has is
    refused."""
    path = tmp_path / "history"
    _npz(path, tokens=np.array([1, 2, 3, 63], np.int32), lengths=np.array([3, 1]))
    assert load_history(path, SuffixHistory(100), 50, A, n_vocab=64).sequences == [[1, 2, 3], [63]]
    with pytest.raises(ValueError, match="token id 63 is outside the ids the tokenizer and model in use take "
                                         r"\(0..49\): .*give --history another path") as info:
        load_history(path, SuffixHistory(100), 50, A)
    assert str(info.value).startswith(f"{path}: ")
