"""Bad input gets a clear error naming the problem (and, for files, the file and byte offset)."""
from __future__ import annotations

import re

import numpy as np
import pytest

from reference.ngram.cache_file import CacheFileError, load_cache, save_cache
from reference.ngram.draft import draft
from reference.ngram.drafter import NgramDrafter
from reference.ngram.cache import NgramCache
from reference.ngram.replay import replay
from reference.ngram.tokens import read_tokens, write_tokens


def words(*ints):
    return np.asarray(ints, dtype="<i4").tobytes()


GOOD = words(1, 2, -1, -1, 2, 7, 3, 8, 1)  # (1, 2) -> {7: 3, 8: 1}: 36 bytes


def expect_cache_error(tmp_path, data, offset, pattern):
    path = tmp_path / "c.bin"
    path.write_bytes(data)
    with pytest.raises(CacheFileError, match=pattern) as info:
        load_cache(path)
    assert info.value.offset == offset
    assert str(path) in str(info.value) and f"byte offset {offset}" in str(info.value)


def test_good_file_loads(tmp_path):
    path = tmp_path / "c.bin"
    path.write_bytes(GOOD + words(5, -1, -1, -1, 1, 5, 2))
    assert load_cache(path).counts == {(1, 2): {7: 3, 8: 1}, (5,): {5: 2}}


SECOND = words(3, 4, 5, -1, 1, 6, 1)  # (3, 4, 5) -> {6: 1}: 28 bytes


@pytest.mark.parametrize("cut, offset, pattern", [
    (1, 36, "file size 37 is not a multiple of 4"),
    (15, 48, "file size 51 is not a multiple of 4"),
    (4, 36, r"truncated record header \(20 bytes needed, 4 left\)"),
    (16, 36, r"truncated record header \(20 bytes needed, 16 left\)"),
    (20, 56, r"truncated record for n-gram \(3, 4, 5\): ntokens=1 followers \(8 bytes needed, 0 left\)"),
    (24, 56, r"\(8 bytes needed, 4 left\)"),
])
def test_truncated_file(tmp_path, cut, offset, pattern):
    expect_cache_error(tmp_path, GOOD + SECOND[:cut], offset, pattern)


def test_truncated_followers(tmp_path):
    expect_cache_error(tmp_path, GOOD[:-8], 20, r"ntokens=2 followers \(16 bytes needed, 8 left\)")


@pytest.mark.parametrize("data, offset, pattern", [
    (words(1, 2, -1, -1, 0), 16, "non-positive follower count ntokens=0"),
    (words(1, 2, -1, -1, -3), 16, "non-positive follower count"),
    (words(1, 2, -1, -1, 1, 7, 0), 24, "non-positive count 0"),
    (words(1, 2, -1, -1, 1, 7, -5), 24, "non-positive count -5"),
    (words(1, 2, -1, -1, 1, -7, 1), 20, "negative follower token -7"),
    (words(-1, -1, -1, -1, 1, 7, 1), 0, "invalid n-gram"),
    (words(1, -1, 2, -1, 1, 7, 1), 0, "invalid n-gram"),
    (words(-5, 2, -1, -1, 1, 7, 1), 0, "invalid n-gram"),
    (words(1, 2, -1, -1, 2, 7, 1, 7, 2), 28, "duplicate follower 7"),
    (GOOD + GOOD, 36, r"duplicate n-gram \(1, 2\)"),
])
def test_corrupt_file(tmp_path, data, offset, pattern):
    expect_cache_error(tmp_path, data, offset, pattern)


def test_cannot_save_count_beyond_int32(tmp_path):
    with pytest.raises(ValueError, match=r"counts must be in \[1, 2\*\*31-1\]"):
        save_cache(NgramCache({(1,): {2: 2**31}}), tmp_path / "c.bin")


def test_token_file_size_not_multiple_of_4(tmp_path):
    path = tmp_path / "t.i32"
    path.write_bytes(words(1, 2, 3) + b"\x01\x02")
    with pytest.raises(ValueError, match=re.escape(f"token file {path} has 14 bytes, not a multiple of 4")):
        read_tokens(path)


def test_negative_token_ids(tmp_path):
    path = tmp_path / "t.i32"
    path.write_bytes(words(1, 2, -3, 4))
    with pytest.raises(ValueError, match=r"negative token id -3 at index 2"):
        read_tokens(path)
    with pytest.raises(ValueError, match=r"invalid token id -1 at index 1"):
        NgramDrafter().reset([5, -1])
    with pytest.raises(ValueError, match=r"invalid token id"):
        replay([1, 2, -4, 5], n_ctx=2)
    with pytest.raises(ValueError, match=r"invalid token id"):
        write_tokens(tmp_path / "u.i32", [1, -2])


def test_npy_must_be_1d_integers(tmp_path):
    path = tmp_path / "t.npy"
    np.save(path, np.array([1.5, 2.0]))
    with pytest.raises(ValueError, match="1-D integer array"):
        read_tokens(path)
    np.save(path, np.array([1, 2**40]))
    with pytest.raises(ValueError, match=r"is outside \[0, 2\*\*31-1\]"):
        read_tokens(path)
    path.write_bytes(np.array([1, 2], dtype="<i4").tobytes())  # raw int32 named .npy
    with pytest.raises(ValueError, match=r"t.npy: not a .npy file .* name raw little-endian int32 token files .i32"):
        read_tokens(path)


def test_npy_round_trip(tmp_path):
    write_tokens(tmp_path / "t.npy", [4, 0, 2**31 - 1])
    assert read_tokens(tmp_path / "t.npy").tolist() == [4, 0, 2**31 - 1]


@pytest.mark.parametrize("n_ctx", [1, 0, -4])
def test_n_ctx_below_2(n_ctx):
    with pytest.raises(ValueError, match=f"n_ctx must be >= 2.*got {n_ctx}"):
        replay([1, 2, 3], n_ctx=n_ctx)


@pytest.mark.parametrize("n_draft", [-1, -5])
def test_negative_n_draft(n_draft):
    with pytest.raises(ValueError, match=f"n_draft must be >= 0, got {n_draft}"):
        replay([1, 2, 3], n_ctx=2, n_draft=n_draft)
    with pytest.raises(ValueError, match="n_draft must be >= 0"):
        draft([1, 2, 3], n_draft, NgramCache())


def test_unknown_score():
    with pytest.raises(ValueError, match="score must be one of"):
        NgramDrafter(score="int64")


def test_empty_input(tmp_path):
    stats = replay([], n_ctx=4, n_draft=3)
    assert (stats.n_chunks, stats.n_draft_calls, stats.n_drafted, stats.n_accept) == (0, 0, 0, 0)
    assert stats.accept == 0.0 and stats.us_per_drafted_token == 0.0
    (tmp_path / "empty.i32").write_bytes(b"")
    assert read_tokens(tmp_path / "empty.i32").size == 0
    (tmp_path / "empty.bin").write_bytes(b"")
    with pytest.raises(CacheFileError, match=r"empty\.bin: empty file \(0 bytes\)"):
        load_cache(tmp_path / "empty.bin")  # not an empty cache: llama.cpp's format has no empty file a user means
    d = NgramDrafter()
    d.reset([])
    assert d.draft(4) == []


def test_static_cache_must_hold_2_grams_only():
    dyn = NgramCache()
    dyn.update([1, 2, 3, 1, 2, 3], 6)
    with pytest.raises(ValueError, match=r"sizes \[1, 2, 3, 4\]; a static cache must hold 2-grams only"):
        replay([1, 2, 3], n_ctx=2, c_st=dyn)
    with pytest.raises(ValueError, match="must hold 2-grams only"):
        NgramDrafter(c_st=dyn)
    NgramDrafter(c_dyn=dyn)  # fine as the dynamic cache


def test_reference_reads_our_format_and_checks_its_header(tmp_path):
    """The reference reads our memory-mapped format (it refused it before) and checks its header."""
    path = tmp_path / "ours.bin"
    path.write_bytes(b"NGRAMSPC" + bytes(376))
    with pytest.raises(CacheFileError, match=r"byte-order mark 0x00000000 .*wrong endianness"):
        load_cache(path)


def test_loading_a_cache_file_reports_progress_over_its_bytes(tmp_path):
    """``progress(done, total)`` is called after every record, and reaches every byte of the file."""
    path = tmp_path / "c.bin"
    path.write_bytes(GOOD + SECOND)
    calls = []
    load_cache(path, progress=lambda done, total: calls.append((done, total)))
    assert calls == [(len(GOOD), 64), (64, 64)]


@pytest.mark.parametrize("bad", [-2**32 + 5, -1, 2**31, 2**33 + 5])
def test_npy_ids_outside_int32_are_refused_before_the_cast(tmp_path, bad):
    """An int64 .npy id outside [0, 2**31-1] is refused, both bounds (-2**32+5 became 5 by the cast before)."""
    path = tmp_path / "t.npy"
    np.save(path, np.array([1, 2, bad, 3], np.int64))
    with pytest.raises(ValueError, match=rf"token id {bad} at index 2 is outside \[0, 2\*\*31-1\]"):
        read_tokens(path)
    with pytest.raises(ValueError, match=rf"token id {bad} at index 2 is outside"):
        write_tokens(tmp_path / "u.i32", np.array([1, 2, bad, 3], np.int64))
    np.save(path, np.array([0, 2**31 - 1], np.uint64))
    assert read_tokens(path).tolist() == [0, 2**31 - 1]  # both bounds themselves are ids


@pytest.mark.parametrize("bad, index", [([1.7, 2], 0), ([1, 2.0], 1), ([3, "4"], 1), (np.array([1.5, 2.0]), 0)])
def test_token_ids_that_are_not_integers_are_refused_not_truncated(bad, index):
    """Before: ``int()`` of each id, so 1.7 drafted as token 1 and "4" as token 4, silently; every drafter and
    the replay take their tokens through ``check_token_list`` (the fast suffix drafter too)."""
    from mlx_backend.suffix.drafter import SuffixDrafter as FastSuffixDrafter
    from reference.suffix.drafter import SuffixDrafter

    for drafter in (NgramDrafter(), SuffixDrafter(), FastSuffixDrafter()):
        with pytest.raises(ValueError, match=rf"token id .* at index {index} is not an integer"):
            drafter.reset(bad)
    with pytest.raises(ValueError, match=rf"at index {index} is not an integer"):
        replay(bad, n_ctx=2, n_draft=2)
    drafter = NgramDrafter()
    drafter.reset(np.array([1, 2, 3], np.int64))   # integer types of every kind are ids
    drafter.extend([np.int32(1), 2])
    assert drafter.tokens == [1, 2, 3, 1, 2]
