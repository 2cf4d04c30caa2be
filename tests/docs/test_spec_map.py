"""docs/spec-map.md lists every deliberate difference from llama.cpp with the test that pins it: the
named tests exist, and the differences pinned nowhere else are pinned here."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import numpy as np
import pytest

import mlx_backend.ngram.api as mlx_api
import reference.ngram.api as ref_api
from reference.ngram.cache_file import CacheFileError
from reference.ngram.cache import NgramCache

ROOT = Path(__file__).resolve().parents[2]
SPEC_MAP = (ROOT / "docs" / "spec-map.md").read_text()
BACKENDS = {"reference": ref_api, "mlx": mlx_api}


def differences() -> list[str]:
    """The numbered items of the section "Deliberate differences from llama.cpp"."""
    section = SPEC_MAP.split("## Deliberate differences from llama.cpp", 1)[1].split("\n## ", 1)[0]
    return re.split(r"\n(?=\d+\. )", section.split("\n1. ", 1)[1])


def test_every_difference_names_tests_that_exist():
    items = differences()
    assert len(items) >= 11
    for item in items:
        named = re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", item)
        assert named, f"no test pins: {item[:80]}"
        for path, name in named:
            tree = ast.parse((ROOT / path).read_text())
            defined = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
            assert name in defined, f"{path}::{name} (named in docs/spec-map.md) does not exist"


RECORD = np.asarray([1, 2, -1, -1, 1, 7, 3], "<i4").tobytes()  # (1, 2) -> {7: 3}: 28 bytes


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("extra", range(1, 16))
def test_trailing_bytes_are_refused_by_both_backends(tmp_path, backend, extra):
    """llama.cpp loads a file with 1-15 stray bytes after its last record (it stops at the first
    incomplete 16-byte n-gram read); both backends refuse it, at the first stray byte's word."""
    path = tmp_path / "c.bin"
    path.write_bytes(RECORD)
    assert BACKENDS[backend].load_cache(path).entries() == [(2, 1, 2, -1, -1, 7, 3)]
    path.write_bytes(RECORD + bytes(range(1, extra + 1)))
    with pytest.raises(CacheFileError) as info:
        BACKENDS[backend].load_cache(path)
    assert info.value.offset == len(RECORD) + (extra // 4) * 4 * (extra % 4 != 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_n_ctx_is_the_chunk_length_not_padded(backend):
    """llama-lookup-stats -c 1000 replays chunks of llama_n_ctx() = 1024 tokens; --n-ctx 1000 here
    means chunks of exactly 1000: floor((N-1)/n_ctx) chunks, 3 for N = 3001 (2 with 1024)."""
    tokens = np.arange(3001, dtype=np.int32) % 50
    assert BACKENDS[backend].replay(tokens, n_ctx=1000, n_draft=1).n_chunks == 3
    assert BACKENDS[backend].replay(tokens, n_ctx=1024, n_draft=1).n_chunks == 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_saved_records_are_sorted(tmp_path, backend):
    """n-grams by size then tokens, followers by token, whatever order the counts arrived in."""
    cache = NgramCache({(9, 1): {5: 1, 2: 4}, (3,): {8: 2, 1: 1}, (1, 2): {7: 3}})
    path = tmp_path / "c.bin"
    api = BACKENDS[backend]
    api.save_cache(cache if backend == "reference" else api.as_sorted(cache), path)
    words = np.fromfile(path, "<i4").tolist()
    assert words == [3, -1, -1, -1, 2, 1, 1, 8, 2,
                     1, 2, -1, -1, 1, 7, 3,
                     9, 1, -1, -1, 2, 2, 4, 5, 1]
