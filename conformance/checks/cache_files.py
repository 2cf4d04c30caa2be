"""Cache files: llama.cpp's format (no header; little-endian int32 ``tokens[4]`` padded with -1,
``ntokens``, then ``ntokens`` pairs ``(token, count)``; records in any order). Files llama.cpp wrote
must load with the same counts, files the backend writes must parse as that format, and damaged
files must be refused with an error, never read as something else."""
from __future__ import annotations

import hashlib
import os
import tempfile

import numpy as np
from hypothesis import strategies as st

from conformance import golden, llama_format, oracle, vectors
from conformance.registry import check
from conformance.runner import current_options
from conformance.strategies import streams

SMALL_FILES = ("syn-static.bin", "edge-neg-dyn.bin", "ovf-static.bin")


def int32_hex(data: bytes) -> str:
    """``data`` in hex, a group per little-endian int32 field counted from the first byte (``bytes.hex(' ', 4)``
    counts its groups from the last byte: a file of 65 bytes read ``01 00000002 ...`` for ``01000000 02...``)."""
    return data.hex(" ", -4)


def _rows(impl, cache):
    return sorted(tuple(int(x) for x in row) for row in impl.cache_entries(cache))


def _canonical_sha256(rows) -> str:
    return hashlib.sha256("".join(" ".join(map(str, r)) + "\n" for r in rows).encode()).hexdigest()


@check("cache_files", needs=("load_cache", "cache_entries"))
def golden_files_load(impl):
    """Cache files written by llama.cpp load with exactly the counts llama.cpp saved (canonical form)."""
    for name in SMALL_FILES:
        want = [tuple(map(int, line.split())) for line in vectors.canonical_text_lines(name)]
        got = _rows(impl, golden.backend_cache(impl, name))
        assert got == want, (f"{name}: loaded {len(got)} entries, llama.cpp saved {len(want)}; "
                             f"first loaded rows {got[:3]}, expected {want[:3]}")
    big = ["dyn-a.bin"] + (["static-small.bin"] if current_options().thorough else [])
    for name in big:
        info = next(f for f in vectors_inputs()["cache_files"] if f["file"] == name)
        got = _canonical_sha256(_rows(impl, golden.backend_cache(impl, name)))
        assert got == info["canonical_sha256"], f"{name}: canonical SHA-256 {got}, llama.cpp's is {info['canonical_sha256']}"


def vectors_inputs() -> dict:
    import json

    return json.loads(vectors.read_bytes("inputs.json"))


@st.composite
def caches(draw):
    """A non-empty cache of n-gram sizes 1..4 counted from a stream (counts > 1 included); 3 tokens hold a
    2-gram and its follower. (An empty cache has no file in llama.cpp's format that our backends accept.)"""
    tokens = draw(streams(min_size=3))
    sizes = draw(st.sampled_from([(2,), (1, 2, 3, 4)]))
    return oracle.counts(tokens, sizes)


@check("cache_files", needs=("load_cache", "save_cache", "cache_entries"),
       given=dict(cache=caches(), order=st.randoms(use_true_random=False)), examples=80)
def saved_files_are_llama_format(impl, cache, order):
    """A loaded cache (records in any order) saves as llama.cpp's little-endian format with the same counts."""
    records = [llama_format.to_bytes({eta: part}) for eta, part in cache.items()]
    order.shuffle(records)
    with tempfile.TemporaryDirectory(prefix="ngram-spec-conformance-") as tmp:
        src, out = os.path.join(tmp, "in.bin"), os.path.join(tmp, "out.bin")
        with open(src, "wb") as f:
            f.write(b"".join(records))
        loaded = impl.load_cache(src)
        assert _rows(impl, loaded) == oracle.rows(cache), (
            f"loading a file holding {oracle.rows(cache)[:4]}... gave {_rows(impl, loaded)[:4]}...")
        impl.save_cache(loaded, out)
        with open(out, "rb") as f:
            data = f.read()
    try:
        saved = llama_format.from_bytes(data)
    except ValueError as exc:
        raise AssertionError(f"the saved file is not in llama.cpp's format ({exc}); its first bytes: "
                             f"{int32_hex(data[:24])}") from None
    assert oracle.rows(saved) == oracle.rows(cache), (
        f"the saved file holds {oracle.rows(saved)[:4]}..., expected {oracle.rows(cache)[:4]}... "
        f"(first bytes {int32_hex(data[:24])}; fields are little-endian int32)")


# a truncation: (bytes the record header, followers or int32 at the offset need, bytes left from there)
TRUNCATED = {"truncated in the middle of a record": (8, 0), "truncated inside a record header": (20, 12),
             "truncated inside the followers of a record": (16, 8),
             "size not a multiple of 4": (4, 1), "4 trailing bytes after the last record": (20, 4)}


def _damaged_files() -> list[tuple[str, bytes, int]]:
    """``(what, file bytes, offset)``: the byte offset of the damage, the first byte of the word or record
    at fault (a record is 4 n-gram words, ntokens, then ntokens (token, count) pairs: the good file's
    first record, (1, 2) with 2 followers, spans bytes 0..35, the second, (7,), bytes 36..63); the sizes
    of the truncations are in :data:`TRUNCATED`."""
    good = llama_format.to_bytes({(1, 2): {3: 4, 5: 6}, (7,): {8: 9}})
    words = np.frombuffer(good, dtype=llama_format.INT32_LE).tolist()

    def pack(ws):
        return np.asarray(ws, dtype=llama_format.INT32_LE).tobytes()

    three_records = llama_format.to_bytes({(1,): {2: 1}, (3,): {4: 1}, (5,): {6: 1}})  # 28 bytes each

    return [
        ("no bytes at all (an empty file)", b"", 0),
        ("truncated in the middle of a record", good[:-8], 56),  # the second record's followers start at 56
        ("truncated inside a record header", good[:12], 0),
        ("truncated inside the followers of a record", good[:28], 20),  # (1, 2)'s 2 followers start at 20
        ("size not a multiple of 4", good + b"\x01", 64),
        ("ntokens = 0", pack(words[:4] + [0] + words[5 + 2 * words[4]:]), 16),
        ("ntokens = -1", pack(words[:4] + [-1] + words[5 + 2 * words[4]:]), 16),
        ("ntokens = 0 in the third record (at byte 56)", three_records[:56 + 16] + pack([0]), 72),
        ("a count of 0", pack(words[:6] + [0] + words[7:]), 24),
        ("a negative count", pack(words[:6] + [-5] + words[7:]), 24),
        # malformed records the format can still hold (the reference refuses each; llama.cpp never writes one)
        ("the same n-gram in two records", good + pack(words[:4] + [1] + words[5:7]), 64),
        ("the same follower twice in a record", pack(words[:4] + [2] + words[5:7] + words[5:7]), 28),
        ("an n-gram with a gap (1, -1, 2, -1)", pack([1, -1, 2, -1] + [1] + words[5:7]), 0),
        ("an n-gram of size 0 (all slots -1)", pack([-1, -1, -1, -1] + [1] + words[5:7]), 0),
        ("a negative token in the n-gram", pack([1, -7, -1, -1] + [1] + words[5:7]), 0),
        ("a negative follower token", pack(words[:5] + [-3] + words[6:]), 20),
        ("the follower token -1", pack(words[:5] + [-1] + words[6:]), 20),
        ("4 trailing bytes after the last record", good + pack([0]), 64),
    ]


@check("cache_files", needs=("load_cache",))
def damaged_files_are_refused(impl):
    """Truncated or corrupt cache files (also malformed records: duplicate keys, gaps, negative ids, trailing bytes)
    raise an error (ValueError or OSError) instead of loading; an error that names the byte offset of the
    damage (an ``offset`` attribute, optional) names the right one, and one that says how much a
    truncation lacks (``needed`` and ``left``, optional) gives the bytes needed at that offset and the
    bytes the file has from there."""
    with tempfile.TemporaryDirectory(prefix="ngram-spec-conformance-") as tmp:
        path = os.path.join(tmp, "damaged.bin")
        for what, data, offset in _damaged_files():
            with open(path, "wb") as f:
                f.write(data)
            try:
                cache = impl.load_cache(path)
            except (ValueError, OSError) as exc:
                got = getattr(exc, "offset", None)
                assert got is None or got == offset, (
                    f"a cache file with {what} ({len(data)} bytes: {int32_hex(data)}) was refused naming byte "
                    f"offset {got}, but the damage is at byte {offset}: {exc}")
                sizes = (getattr(exc, "needed", None), getattr(exc, "left", None))
                assert sizes == (None, None) or sizes == TRUNCATED.get(what), (
                    f"a cache file with {what} ({len(data)} bytes: {int32_hex(data)}) was refused saying "
                    f"(needed, left) = {sizes} bytes, expected {TRUNCATED.get(what, '(None, None): not a truncation')}: "
                    f"{exc}")
                continue
            rows = _rows(impl, cache) if getattr(impl, "cache_entries", None) else "?"
            raise AssertionError(f"a cache file with {what} ({len(data)} bytes: {int32_hex(data)}) loaded "
                                 f"without an error, as {rows}")
        try:
            impl.load_cache(os.path.join(tmp, "missing.bin"))
        except (ValueError, OSError):
            return
        raise AssertionError("loading a cache file that does not exist raised no error")
