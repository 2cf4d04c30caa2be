"""Cache files: our memory-mapped format (docs/cache-format.md) and llama.cpp's, round trips and errors."""
from __future__ import annotations

import struct
import zlib
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mlx_backend.ngram.api as api
import reference.ngram.api as ref
from mlx_backend.ngram import cache_file as sf
from reference.ngram.cache_file import CacheFileError
from reference.ngram.cache import NgramCache, pad


@st.composite
def caches(draw):
    """A reference cache with n-grams of sizes 1..4 (a replayed dynamic cache) or 2-grams only."""
    n = draw(st.integers(0, 200))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    v = draw(st.sampled_from([3, 50, 70_000]))
    s = rng.integers(0, v, n).tolist()
    c = NgramCache()
    if draw(st.booleans()):
        c.update(s, len(s), 2, 2)
    else:
        c.update(s, len(s))
    return c


@settings(max_examples=30, deadline=None)
@given(caches())
def test_round_trips_both_formats(tmp_path_factory, c):
    d = tmp_path_factory.mktemp("rt")
    mine = api.as_sorted(c)
    api.save_cache(mine, d / "a.ngc", format="ours")
    if not c.counts:  # llama.cpp's format has no empty file: both backends refuse to write one
        for save in (lambda: api.save_cache(mine, d / "a.bin", format="llama"), lambda: ref.save_cache(c, d / "r.bin")):
            with pytest.raises(ValueError, match="the cache is empty: nothing to write"):
                save()
        assert api.load_cache(d / "a.ngc", verify=True).entries() == ref.load_cache(d / "a.ngc").entries() == []
        return
    api.save_cache(mine, d / "a.bin", format="llama")
    ref.save_cache(c, d / "r.bin")
    assert (d / "a.bin").read_bytes() == (d / "r.bin").read_bytes()  # same record order as the reference
    ours = api.load_cache(d / "a.ngc", verify=True)
    assert ours.entries() == c.entries()
    assert api.load_cache(d / "a.bin").entries() == c.entries()
    assert ref.load_cache(d / "a.bin") == c
    assert ref.load_cache(d / "a.ngc") == c  # the reference reads our format too


def test_ours_is_memory_mapped_and_smaller(tmp_path):
    s = np.random.default_rng(0).integers(0, 1000, 50_000).astype(np.int32)
    c = api.build_static(s)
    api.save_cache(c, tmp_path / "c.ngc", format="ours")
    api.save_cache(c, tmp_path / "c.bin", format="llama")
    loaded = api.load_cache(tmp_path / "c.ngc")
    assert isinstance(loaded.section(2).tokens.base, np.memmap) or isinstance(loaded.section(2).tokens, np.memmap)
    assert (tmp_path / "c.ngc").stat().st_size < (tmp_path / "c.bin").stat().st_size


def test_header_records_vocab_size_and_fingerprint(tmp_path):
    c = api.build_static([1, 2, 3, 1, 2, 4])
    c.vocab_size, c.fingerprint = 10, sf.vocab_fingerprint({"a": 0})
    api.save_cache(c, tmp_path / "c.ngc", format="ours")
    got = api.load_cache(tmp_path / "c.ngc", vocab_size=10, fingerprint=c.fingerprint)
    assert (got.vocab_size, got.fingerprint) == (10, c.fingerprint)
    with pytest.raises(sf.CacheFormatError, match="vocabulary of 10 tokens.*has 11"):
        api.load_cache(tmp_path / "c.ngc", vocab_size=11)
    with pytest.raises(sf.CacheFormatError, match="another tokenizer"):
        api.load_cache(tmp_path / "c.ngc", fingerprint=sf.vocab_fingerprint({"b": 0}))


@pytest.fixture
def ours_file(tmp_path):
    c = api.as_sorted(NgramCache({(1,): {2: 3}, (1, 2): {3: 1, 4: 2}, (5, 6, 7): {1: 1}, (1, 2, 3, 4): {9: 9}}))
    path = tmp_path / "c.ngc"
    api.save_cache(c, path, format="ours")
    return path


@pytest.fixture(params=["mlx", "reference"])
def load(request):
    """Either backend's loader of our format: mlx's memory map (every array checked) or the reference's plain reader."""
    return (lambda path: api.load_cache(path, verify=True)) if request.param == "mlx" else ref.load_cache


def test_truncated_file_error_names_offset(ours_file, load):
    """A truncated file of our format is named as one (before, the reference's message ended "not an n-gram cache
    file in llama.cpp's format, or truncated/corrupt", for a file that starts with our magic)."""
    data = ours_file.read_bytes()
    ours_file.write_bytes(data[:-3])
    with pytest.raises(CacheFileError, match=rf"truncated file.*at byte offset {len(data) - 3}") as error:
        load(ours_file)
    assert "llama.cpp" not in str(error.value)
    ours_file.write_bytes(data[:100])
    with pytest.raises(CacheFileError, match="truncated header") as error:
        load(ours_file)
    assert "llama.cpp" not in str(error.value)


def test_wrong_version_error(ours_file, load):
    data = bytearray(ours_file.read_bytes())
    data[8:12] = struct.pack("<I", 2)
    ours_file.write_bytes(bytes(data))
    with pytest.raises(CacheFileError, match="unsupported version 2"):
        load(ours_file)


def test_wrong_endianness_error(ours_file, load):
    data = bytearray(ours_file.read_bytes())
    data[12:16] = struct.pack(">I", sf.BOM)
    ours_file.write_bytes(bytes(data))
    with pytest.raises(CacheFileError, match="wrong endianness"):
        load(ours_file)


def test_corrupt_header_error(ours_file, load):
    data = bytearray(ours_file.read_bytes())
    data[70] ^= 1  # inside the section table
    ours_file.write_bytes(bytes(data))
    with pytest.raises(CacheFileError, match="checksum"):
        load(ours_file)


def test_trailing_bytes_error(ours_file, load):
    ours_file.write_bytes(ours_file.read_bytes() + b"\0" * 8)
    with pytest.raises(CacheFileError, match="8 unexpected trailing bytes"):
        api.load_cache(ours_file)


def test_verify_finds_corrupt_arrays(ours_file):
    """A flipped count (header intact) loads lazily but fails the full check (convert/--verify)."""
    c = api.load_cache(ours_file)
    off = struct.unpack_from("<8Q", ours_file.read_bytes(), sf.PREFIX.size + 1 * sf.SECTION.size)[6]
    data = bytearray(ours_file.read_bytes())
    data[off:off + 4] = struct.pack("<i", -4)
    ours_file.write_bytes(bytes(data))
    del c
    with pytest.raises(sf.CacheFormatError, match="non-positive count"):
        api.load_cache(ours_file, verify=True)


@pytest.mark.parametrize("array, index, value, problem", [
    ("counts", 1, -4, "negative token or non-positive count"),
    ("tokens", 1, 3, "followers are not strictly increasing"),    # (1, 2) -> {3, 4} becomes {3, 3}
    ("top", 0, 4, "stored static-only drafts disagree"),
])
def test_a_corrupt_array_is_reported_at_the_byte_of_its_first_bad_element(tmp_path, array, index, value, problem):
    """The error names where the damage is: the byte of the first bad element, found from the section table.
    Before, every such error said "at byte offset 0" (found by a probe: 64 bytes overwritten in the middle of
    a 1.4 MB cache, reported at offset 0)."""
    path = tmp_path / "c.ngc"
    api.save_cache(api.build_static([1, 2, 3, 1, 2, 4, 1, 2, 3]), path, format="ours")
    data = bytearray(path.read_bytes())
    fields = struct.unpack_from("<8Q", data, sf.PREFIX.size + 1 * sf.SECTION.size)  # n = 2: (1, 2) -> {3: 2, 4: 1}
    byte = fields[{"tokens": 5, "counts": 6, "top": 7}[array]] + 4 * index
    data[byte:byte + 4] = struct.pack("<i", value)
    path.write_bytes(bytes(data))
    with pytest.raises(sf.CacheFormatError, match=f"section n=2: {problem}.* at byte offset {byte}$"):
        sf.open_ours(path, verify=True)


def test_header_crc_recomputed_section_overflow_is_caught(ours_file, load):
    """A section table pointing past the end (with a valid checksum) is reported as truncation."""
    data = bytearray(ours_file.read_bytes())
    at = sf.PREFIX.size
    fields = list(struct.unpack_from("<8Q", data, at))
    fields[1] += 1000  # n_entries of n=1
    data[at:at + sf.SECTION.size] = struct.pack("<8Q", *fields)
    data[sf.CRC_AT:sf.CRC_AT + 4] = struct.pack("<I", zlib.crc32(bytes(data[:sf.CRC_AT])))
    ours_file.write_bytes(bytes(data))
    with pytest.raises(CacheFileError, match="truncated file: section n=1"):
        load(ours_file)


LLAMA_ERRORS = [
    (b"\x01\x00\x00\x00" * 3, "truncated record"),
    (struct.pack("<5i", 1, 2, -1, -1, 0), "non-positive follower count"),
    (struct.pack("<5i", 1, 2, -1, -1, 2) + struct.pack("<2i", 3, 1), "truncated record"),
    (struct.pack("<7i", 1, -1, 2, -1, 1, 3, 1), "invalid n-gram"),
    (struct.pack("<7i", -1, -1, -1, -1, 1, 3, 1), "invalid n-gram"),
    (struct.pack("<7i", 1, 2, -1, -1, 1, -3, 1), "negative follower token"),
    (struct.pack("<7i", 1, 2, -1, -1, 1, 3, 0), "non-positive count"),
    (struct.pack("<9i", 1, 2, -1, -1, 2, 3, 1, 3, 2), "duplicate follower"),
    (struct.pack("<7i", 1, 2, -1, -1, 1, 3, 1) * 2, "duplicate n-gram"),
    (struct.pack("<7i", 1, 2, -1, -1, 1, 3, 1) + b"\0\0", "not a multiple of 4"),
]


@pytest.mark.parametrize("data,problem", LLAMA_ERRORS, ids=[p for _, p in LLAMA_ERRORS])
def test_llama_format_errors_match_reference(tmp_path, data, problem):
    """Corrupt llama.cpp files: the same problem at the same byte offset as the reference reader."""
    path = tmp_path / "bad.bin"
    path.write_bytes(data)
    with pytest.raises(CacheFileError) as theirs:
        ref.load_cache(path)
    with pytest.raises(CacheFileError, match=problem) as mine:
        api.load_cache(path)
    assert mine.value.offset == theirs.value.offset
    assert problem in theirs.value.problem


@pytest.mark.parametrize("backend", [api, ref])
def test_empty_files(tmp_path, backend):
    """A 0-byte file is refused by both backends' loaders (it was taken as an empty cache); an empty cache
    of our format is a header, not an empty file, and loads."""
    (tmp_path / "e.bin").write_bytes(b"")
    with pytest.raises(CacheFileError, match=r"e\.bin: empty file \(0 bytes\)"):
        backend.load_cache(tmp_path / "e.bin")
    api.save_cache(api.as_sorted(None), tmp_path / "e.ngc", format="ours")
    assert api.load_cache(tmp_path / "e.ngc", verify=True).entries() == []


def test_unknown_format_rejected(tmp_path):
    with pytest.raises(ValueError, match="unknown cache format"):
        api.save_cache(api.as_sorted(None), tmp_path / "x", format="json")


def test_counts_beyond_int32_rejected():
    """Sorted caches hold int32 counts (as both file formats do): a merge that overflows is refused."""
    with pytest.raises(ValueError, match=r"2\*\*31-1"):
        api.merge_caches([NgramCache({(1, 2): {3: 2**31 - 1}}), NgramCache({(1, 2): {3: 1}})])


def test_cache_format_doc_examples_run():
    """The ```python blocks of docs/cache-format.md run as written."""
    import pathlib
    import re

    doc = pathlib.Path(__file__).resolve().parents[3] / "docs" / "cache-format.md"
    blocks = re.findall(r"```python\n(.*?)```", doc.read_text(), re.S)
    assert blocks
    for block in blocks:
        exec(compile(block, str(doc), "exec"), {})


def test_merge_keeps_or_refuses_tokenizer_records():
    a, b = api.build_static([1, 2, 3, 1]), api.build_static([1, 2, 4, 1])
    a.vocab_size, a.fingerprint = 10, sf.vocab_fingerprint({"x": 0})
    m = api.merge_caches([a, b])  # b records nothing: the known record is kept
    assert (m.vocab_size, m.fingerprint) == (10, a.fingerprint)
    b.vocab_size = 11
    with pytest.raises(ValueError, match="different tokenizers"):
        api.merge_caches([a, b])


def test_drafter_refuses_cache_of_another_tokenizer(tmp_path):
    vocab = {"a": 0, "b": 1, "c": 2, "d": 3, "e": 4}
    size, fp = sf.tokenizer_fingerprint(vocab)
    assert size == 5
    c = api.build_static([1, 2, 3, 1, 2, 4])
    c.vocab_size, c.fingerprint = size, fp
    api.save_cache(c, tmp_path / "c.ngc", format="ours")
    d = api.NgramDrafter(c_st=str(tmp_path / "c.ngc"), vocab_size=size, fingerprint=fp)
    d.reset([1, 2])
    assert d.draft(1) == [3]
    other = sf.tokenizer_fingerprint({"z": 0, "b": 1, "c": 2, "d": 3, "e": 4})
    with pytest.raises(sf.CacheFormatError, match="another tokenizer"):
        api.NgramDrafter(c_st=str(tmp_path / "c.ngc"), vocab_size=other[0], fingerprint=other[1])
    with pytest.raises(sf.CacheFormatError, match="vocabulary of 5"):
        api.NgramDrafter(c_dyn=str(tmp_path / "c.ngc"), vocab_size=6)


# ----------------------------------------------------------------------------- llama.cpp files in any order


@st.composite
def wide_caches(draw):
    """A reference cache of mixed sizes where some n-grams have many followers (> the loader's
    ``SMALL``, sorted by NumPy there) and most have a few."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    counts = {}
    for _ in range(draw(st.integers(1, 40))):
        n = int(rng.integers(1, 5))
        eta = tuple(rng.integers(0, 70_000 if rng.random() < 0.5 else 5, n).tolist())
        f = int(rng.choice([1, 2, 5, sf.SMALL, sf.SMALL + 1, 300]))
        ys = rng.choice(100_000, f, replace=False).tolist()
        counts[eta] = {y: int(rng.integers(1, 2**31 - 1 if rng.random() < 0.1 else 9)) for y in ys}
    return NgramCache(counts)


def llama_bytes(cache: NgramCache, rng) -> bytes:
    """``cache`` in llama.cpp's format with records and followers in random order (llama.cpp writes
    them in ``unordered_map`` order, not sorted like ``save_cache``)."""
    records = []
    for eta, part in cache.counts.items():
        items = list(part.items())
        rng.shuffle(items)
        records.append(list(pad(eta)) + [len(items)] + [v for yc in items for v in yc])
    rng.shuffle(records)
    return np.asarray([w for r in records for w in r], "<i4").tobytes()


def assert_same_arrays(mine, expected):
    assert mine.sizes() == expected.sizes()
    for n, s in expected.sections.items():
        for name, a, b in zip(s._fields[1:], mine.section(n)[1:], s[1:]):
            assert a.dtype == b.dtype and np.array_equal(a, b), (n, name)


# the reader's step (words) and sort batch (entries): as shipped, or small enough that the steps run
# in parallel and the long follower lists span several batches
READER_SIZES = st.sampled_from([dict(CHUNK_WORDS=sf.CHUNK_WORDS, SORT_BATCH=sf.SORT_BATCH),
                                dict(CHUNK_WORDS=7, SORT_BATCH=5), dict(CHUNK_WORDS=100, SORT_BATCH=400)])


@settings(max_examples=40, deadline=None)
@given(st.one_of(caches(), wide_caches()), st.randoms(use_true_random=False), READER_SIZES)
def test_llama_file_in_any_order_loads_to_the_same_arrays(tmp_path_factory, c, rnd, sizes):
    """A file in llama.cpp's record order loads to exactly the arrays of the same counts built from
    rows (``as_sorted`` of the reference's parse: the multiset sorted and summed by NumPy)."""
    if not c.counts:
        return
    path = tmp_path_factory.mktemp("any") / "c.bin"
    path.write_bytes(llama_bytes(c, rnd))
    assert ref.load_cache(path) == c
    with mock.patch.multiple(sf, **sizes):
        assert_same_arrays(api.load_cache(path), api.as_sorted(c))


KINDS = ("file size", "empty file", "truncated record", "invalid n-gram", "non-positive follower count",
         "negative follower token", "non-positive count", "duplicate n-gram", "duplicate follower")


@st.composite
def damaged(draw):
    """A llama.cpp file (records in random order) with one to three words overwritten, a record
    repeated, or its end cut off."""
    c = draw(st.one_of(caches(), wide_caches()).filter(lambda c: c.counts))
    rnd = draw(st.randoms(use_true_random=False))
    words = np.frombuffer(llama_bytes(c, rnd), "<i4").copy()
    how = draw(st.sampled_from(["overwrite", "repeat", "cut"]))
    if how == "overwrite":
        for _ in range(draw(st.integers(1, 3))):
            at = draw(st.integers(0, len(words) - 1))
            words[at] = draw(st.sampled_from([-5, -1, 0, 1, 2, 3, int(words[draw(st.integers(0, len(words) - 1))]),
                                              2**31 - 1]))
        return words.tobytes()
    if how == "repeat":
        at = draw(st.integers(0, len(words)))
        n = draw(st.integers(1, 40))
        return np.concatenate([words[:at], words[max(0, at - n):at], words[at:]]).tobytes()
    return words.tobytes()[:draw(st.integers(0, 4 * len(words) - 1))]


@settings(max_examples=80, deadline=None)
@given(damaged(), READER_SIZES)
def test_damaged_llama_files_fail_like_the_reference(tmp_path_factory, data, sizes):
    """Any damage: the same first problem at the same byte offset as the reference reader, or both
    load the same counts (the damage made another valid file)."""
    path = tmp_path_factory.mktemp("bad") / "c.bin"
    path.write_bytes(data)
    try:
        theirs = ref.load_cache(path)
    except CacheFileError as e:
        with pytest.raises(CacheFileError) as mine, mock.patch.multiple(sf, **sizes):
            api.load_cache(path)
        kind = [k for k in KINDS if e.problem.startswith(k)]
        assert (mine.value.offset, mine.value.problem.startswith(kind[0])) == (e.offset, True), (mine.value, e)
        assert (mine.value.needed, mine.value.left) == (e.needed, e.left), (mine.value, e)
        return
    assert_same_arrays(api.load_cache(path), api.as_sorted(theirs))


# ----------------------------------------------------------------------------- converted copies (issue 15)


def _copies(user_cache):
    return sorted((user_cache / "converted").glob("*.ngc")) if (user_cache / "converted").is_dir() else []


def test_converted_copy_follows_the_file(tmp_path, monkeypatch):
    """The second load of an unchanged llama.cpp-format file maps the copy; a rewritten file is read
    again and its copy replaced (one copy per path); a damaged copy is deleted and rewritten; the
    content is always the file's."""
    user = tmp_path / "user"
    monkeypatch.setenv("NGRAM_SPEC_CACHE_DIR", str(user))
    path = tmp_path / "static.bin"
    a = api.build_static(np.array([1, 2, 3, 1, 2, 4, 1, 2, 3], np.int32))
    b = api.build_static(np.array([5, 6, 7, 5, 6, 7], np.int32))
    api.save_cache(a, path)
    first, second = api.load_cache(path), api.load_cache(path)
    assert (first.converted_copy[1], second.converted_copy[1]) == ("written", "reused")
    assert first == second == a and _copies(user) == [first.converted_copy[0]]
    api.save_cache(b, path)  # same path, new content
    third = api.load_cache(path)
    assert third.converted_copy[1] == "written" and third == b and _copies(user) == [third.converted_copy[0]]
    third.converted_copy[0].write_bytes(third.converted_copy[0].read_bytes()[:100])  # a truncated copy
    fourth = api.load_cache(path)
    assert fourth.converted_copy[1] == "written" and fourth == b and api.load_cache(path).converted_copy[1] == "reused"


def test_converted_copy_off_unwritable_or_bad_file(tmp_path, monkeypatch):
    """No copy: when switched off, where the cache directory cannot be written (the load still works),
    and for a file that fails to load."""
    path = tmp_path / "static.bin"
    c = api.build_static(np.array([1, 2, 3, 1, 2, 4], np.int32))
    api.save_cache(c, path)
    monkeypatch.setenv("NGRAM_SPEC_CACHE_DIR", str(tmp_path / "user"))
    monkeypatch.setenv("NGRAM_SPEC_NO_CONVERTED_COPY", "1")
    assert api.load_cache(path).converted_copy is None and _copies(tmp_path / "user") == []
    monkeypatch.delenv("NGRAM_SPEC_NO_CONVERTED_COPY")
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("NGRAM_SPEC_CACHE_DIR", str(blocker))
    loaded = api.load_cache(path)
    assert loaded == c and loaded.converted_copy is None
    monkeypatch.setenv("NGRAM_SPEC_CACHE_DIR", str(tmp_path / "user"))
    bad = tmp_path / "bad.bin"
    bad.write_bytes(path.read_bytes()[:-4])
    with pytest.raises(CacheFileError):
        api.load_cache(bad)
    assert _copies(tmp_path / "user") == []


def test_the_converted_copies_folder_keeps_the_recently_used_copies_within_its_bound(tmp_path, monkeypatch):
    """Copies of three files a, b, c under a bound that holds two: after a, b, a reused (touched), c written,
    b (the least recently used) is gone and a, c are kept; a bound of 0 keeps the copy just written only; a
    bound that is not a byte count is refused before the file is read. Before: every copy stayed for good."""
    import os

    from mlx_backend.ngram import converted_copy

    user = tmp_path / "user"
    monkeypatch.setenv("NGRAM_SPEC_CACHE_DIR", str(user))
    paths = {}
    for i, name in enumerate("abc"):
        paths[name] = tmp_path / f"{name}.bin"
        api.save_cache(api.build_static(np.array([1, 2, 3 + i] * 40, np.int32)), paths[name])
    copy = {name: converted_copy.copy_path(p) for name, p in paths.items()}
    api.load_cache(paths["a"]), api.load_cache(paths["b"])
    size = {name: copy[name].stat().st_size for name in "ab"}
    past = copy["a"].stat().st_mtime_ns - 10 ** 9   # mtime resolution: make the order plain
    os.utime(copy["a"], ns=(past - 10 ** 9, past - 10 ** 9))
    os.utime(copy["b"], ns=(past, past))
    assert api.load_cache(paths["a"]).converted_copy[1] == "reused"             # a is now the most recent
    monkeypatch.setenv(converted_copy.ENV_MAX_BYTES, str(size["a"] + size["b"] + 8))
    assert api.load_cache(paths["c"]).converted_copy[1] == "written"
    assert _copies(user) == sorted([copy["a"], copy["c"]])
    monkeypatch.setenv(converted_copy.ENV_MAX_BYTES, "0")
    api.save_cache(api.build_static(np.array([7, 8, 9] * 40, np.int32)), paths["b"])
    assert api.load_cache(paths["b"]).converted_copy[1] == "written"
    assert _copies(user) == [converted_copy.copy_path(paths["b"])]
    monkeypatch.setenv(converted_copy.ENV_MAX_BYTES, "4GiB")
    with mock.patch.object(converted_copy, "read_llama") as read:
        with pytest.raises(ValueError, match="NGRAM_SPEC_CONVERTED_MAX_BYTES='4GiB'.*number of bytes"):
            api.load_cache(paths["c"])
    assert not read.called


def test_header_size_field_is_checked(ours_file, load):
    """A header whose header-size field is not 384 (its checksum recomputed, so only that field is wrong) is
    refused: the arrays' offsets are read against a header of the documented size."""
    data = bytearray(ours_file.read_bytes())
    data[16:24] = struct.pack("<Q", sf.HEADER_SIZE + sf.ALIGN)
    data[sf.CRC_AT:sf.CRC_AT + 4] = struct.pack("<I", zlib.crc32(bytes(data[:sf.CRC_AT])))
    ours_file.write_bytes(bytes(data))
    with pytest.raises(CacheFileError, match="checksum"):
        load(ours_file)


def _save_section(path, n, keys, offsets, tokens, counts, vocab_size=0):
    """A file of our format holding one hand-made section (the writer copies the arrays as given)."""
    from mlx_backend.ngram.sorted_cache import Section, SortedCache, static_top

    offsets, tokens, counts = (np.array(offsets, np.uint32), np.array(tokens, np.int32),
                               np.array(counts, np.int32))
    section = Section(n, np.array(keys, np.int64), offsets, tokens, counts, static_top(offsets, tokens, counts))
    sf.save_ours(SortedCache({n: section}, vocab_size=vocab_size), path)


def test_verify_refuses_an_n_gram_without_followers(tmp_path, load):
    """Offsets ``[0, 0, 1]``: the first 2-gram has no follower, which no cache holds (docs/cache-format.md:
    offsets strictly increasing)."""
    path = tmp_path / "c.ngc"
    _save_section(path, 2, [1 << 32 | 2, 3 << 32 | 4], [0, 0, 1], [5], [1])
    with pytest.raises(CacheFileError):
        load(path)
    _save_section(path, 2, [1 << 32 | 2, 3 << 32 | 4], [0, 1, 2], [5, 6], [1, 1])  # the same, well formed
    assert load(path).entries() == [(2, 1, 2, -1, -1, 5, 1), (2, 3, 4, -1, -1, 6, 1)]


def test_verify_refuses_a_token_equal_to_the_vocabulary_size(tmp_path):
    """A vocabulary of V tokens holds ids 0..V-1: a follower V is outside it, V-1 is not."""
    path = tmp_path / "c.ngc"
    c = api.build_static([1, 2, 3, 1, 2, 4])  # largest follower: 4
    c.vocab_size = 4
    api.save_cache(c, path, format="ours")
    with pytest.raises(sf.CacheFormatError, match="token 4 >= vocab size 4"):
        api.load_cache(path, verify=True)
    c.vocab_size = 5
    api.save_cache(c, path, format="ours")
    assert api.load_cache(path, verify=True).entries() == c.entries()


def test_verify_checks_the_converted_copy_too(tmp_path, monkeypatch):
    """``load_cache(path, verify=True)`` of a llama.cpp-format file whose converted copy was damaged past its
    header (a count made negative, the checksum still good): the copy is refused and the file read again,
    as its plain load would be, instead of the damaged counts being returned."""
    user = tmp_path / "user"
    monkeypatch.setenv("NGRAM_SPEC_CACHE_DIR", str(user))
    path = tmp_path / "static.bin"
    c = api.build_static(np.array([1, 2, 3, 1, 2, 4, 1, 2, 3], np.int32))
    api.save_cache(c, path)
    copy = api.load_cache(path).converted_copy[0]
    data = bytearray(copy.read_bytes())
    counts_at = struct.unpack_from("<8Q", data, sf.PREFIX.size + 1 * sf.SECTION.size)[6]  # n=2's counts
    data[counts_at:counts_at + 4] = struct.pack("<i", -4)
    copy.write_bytes(bytes(data))
    loaded = api.load_cache(path, verify=True)
    assert loaded.converted_copy[1] == "written" and loaded == c
    assert api.load_cache(path, verify=True).converted_copy[1] == "reused"


def test_a_damaged_dynamic_file_stops_the_run(tmp_path):
    """``load_dynamic`` checks every array: a dynamic cache file of our format with a count made negative past
    its intact header is refused, not merged into the file written back at the end of the run."""
    from mlx_backend.ngram.dynamic_cache import load_dynamic

    path = tmp_path / "dyn.ngc"
    c = api.build_static([1, 2, 3, 1, 2, 4])
    api.save_cache(c, path, format="ours")
    assert load_dynamic(path, api) == c
    data = bytearray(path.read_bytes())
    counts_at = struct.unpack_from("<8Q", data, sf.PREFIX.size + 1 * sf.SECTION.size)[6]  # n=2's counts
    data[counts_at:counts_at + 4] = struct.pack("<i", -4)
    path.write_bytes(bytes(data))
    with pytest.raises(sf.CacheFormatError, match="non-positive count"):
        load_dynamic(path, api)


def test_a_section_total_that_disagrees_with_the_counts_is_refused(ours_file):
    """The section table's ``total`` is the sum of the section's counts (docs/cache-format.md): a file whose
    total says otherwise (checksum recomputed) is refused by the reference reader, which reads every field,
    and by the fast one when asked to verify (as a converted copy or a dynamic cache is read; before, it read
    the field and dropped it)."""
    data = bytearray(ours_file.read_bytes())
    at = sf.PREFIX.size + 1 * sf.SECTION.size  # n = 2: (1, 2) -> {3: 1, 4: 2}, total 3
    fields = list(struct.unpack_from("<8Q", data, at))
    assert fields[2] == 1 + 2
    fields[2] += 1
    data[at:at + sf.SECTION.size] = struct.pack("<8Q", *fields)
    data[sf.CRC_AT:sf.CRC_AT + 4] = struct.pack("<I", zlib.crc32(bytes(data[:sf.CRC_AT])))
    ours_file.write_bytes(bytes(data))
    with pytest.raises(CacheFileError, match="section n=2: offsets or total disagree"):
        ref.load_cache(ours_file)
    with pytest.raises(sf.CacheFormatError, match=r"section n=2: total 4 is not the sum of its counts \(3\)"):
        sf.open_ours(ours_file, verify=True)


def test_a_repeated_key_is_refused(tmp_path, load):
    """Keys are strictly increasing (docs/cache-format.md): the same 2-gram twice, each with its own follower,
    is a corrupt file, not two n-grams. Written by hand through the writer, which copies arrays as given."""
    from mlx_backend.ngram.sorted_cache import Section, SortedCache, static_top

    offsets, tokens, counts = np.array([0, 1, 2], np.uint32), np.array([5, 6], np.int32), np.ones(2, np.int32)
    keys = np.array([1 << 32 | 2, 1 << 32 | 2], np.int64)
    path = tmp_path / "c.ngc"
    sf.save_ours(SortedCache({2: Section(2, keys, offsets, tokens, counts, static_top(offsets, tokens, counts))}),
                 path)
    with pytest.raises(CacheFileError, match="(?i)(not strictly increasing|invalid or out of order)"):
        load(path)


def test_converted_copy_sees_a_change_in_the_files_last_mib(tmp_path, monkeypatch):
    """A file's identity hashes its first and its last MiB: a rewrite that changes only the end of a file of
    over 2 MiB, keeping its size and modification time, is read again (the copy of the old content is not)."""
    import os

    from mlx_backend.ngram.converted_copy import PART

    monkeypatch.setenv("NGRAM_SPEC_CACHE_DIR", str(tmp_path / "user"))
    path = tmp_path / "static.bin"
    s = np.arange(3 * PART // 28 + 10, dtype=np.int32)  # distinct 2-grams: one 28-byte record each
    api.save_cache(api.build_static(s), path)
    size, stat = path.stat().st_size, path.stat()
    assert size > 2 * PART
    first = api.load_cache(path)
    data = bytearray(path.read_bytes())
    assert struct.unpack_from("<i", data, size - 4)[0] == 1  # the last record's count
    data[size - 4:size] = struct.pack("<i", 2)
    path.write_bytes(bytes(data))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    second = api.load_cache(path)
    assert (first.converted_copy[1], second.converted_copy[1]) == ("written", "written")
    n = len(s)
    assert second.total() == first.total() + 1
    assert second.entries()[-1] == (2, n - 3, n - 2, -1, -1, n - 1, 2)  # the last 2-gram's count, now 2


def test_tokenizer_mismatch_names_the_header_field(tmp_path):
    """The error's byte offset is the header field that disagrees: the vocabulary size at 24, the
    fingerprint at 32 (docs/cache-format.md, the header table)."""
    c = api.build_static([1, 2, 3, 1, 2, 4])
    c.vocab_size, c.fingerprint = 10, sf.vocab_fingerprint({"a": 0})
    api.save_cache(c, tmp_path / "c.ngc", format="ours")
    assert sf.PREFIX.unpack_from((tmp_path / "c.ngc").read_bytes())[4:] == (10, c.fingerprint)
    with pytest.raises(sf.CacheFormatError) as vocab:
        api.load_cache(tmp_path / "c.ngc", vocab_size=11)
    with pytest.raises(sf.CacheFormatError) as fingerprint:
        api.load_cache(tmp_path / "c.ngc", fingerprint=sf.vocab_fingerprint({"b": 0}))
    assert (vocab.value.offset, fingerprint.value.offset) == (24, 32)
    assert struct.calcsize("<8sIIQ") == 24 and struct.calcsize("<8sIIQQ") == 32


def test_an_array_offset_inside_the_header_is_refused(ours_file, load):
    """An array offset must lie past the 384-byte header: one pointing at byte 320 (aligned, so only that
    rule catches it; checksum recomputed) would read the header as counts."""
    data = bytearray(ours_file.read_bytes())
    at = sf.PREFIX.size  # n = 1: (1,) -> {2: 3}
    fields = list(struct.unpack_from("<8Q", data, at))
    fields[6] = 5 * sf.ALIGN  # its counts at byte 320, inside the header
    assert fields[6] < sf.HEADER_SIZE and fields[6] % sf.ALIGN == 0
    data[at:at + sf.SECTION.size] = struct.pack("<8Q", *fields)
    data[sf.CRC_AT:sf.CRC_AT + 4] = struct.pack("<I", zlib.crc32(bytes(data[:sf.CRC_AT])))
    ours_file.write_bytes(bytes(data))
    with pytest.raises(CacheFileError, match="misaligned array offset 320"):
        load(ours_file)


def test_a_stored_static_draft_where_the_rule_drafts_nothing_is_refused(tmp_path, load):
    """``top`` is the static-only draft or -1: (1, 2) -> {3: 1} has F = 1 < 2, so its ``top`` must be -1; a
    file storing 3 there (as if it drafted) is refused by both readers. Stored -1, it loads."""
    from mlx_backend.ngram.sorted_cache import Section, SortedCache

    path = tmp_path / "c.ngc"
    for top, ok in ((3, False), (-1, True)):
        section = Section(2, np.array([1 << 32 | 2], np.int64), np.array([0, 1], np.uint32), np.array([3], np.int32),
                          np.array([1], np.int32), np.array([top], np.int32))
        sf.save_ours(SortedCache({2: section}), path)
        if ok:
            assert load(path).entries() == [(2, 1, 2, -1, -1, 3, 1)]
        else:
            with pytest.raises(CacheFileError, match="static"):
                load(path)
