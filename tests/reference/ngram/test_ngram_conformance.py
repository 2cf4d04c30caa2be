"""The reference against llama.cpp's own outputs (conformance/vectors/, produced by llama.cpp's
ngram-cache.cpp with ties -> smallest token id and negative-start n-grams skipped)."""
from __future__ import annotations

import hashlib

import pytest

from conformance import vectors
from reference.ngram.api import build_static, merge_caches
from reference.ngram.cache_file import load_cache, save_cache
from reference.ngram.replay import replay

DRAFTING = vectors.drafting_cases()
BIG = {"a1-text-a-nostatic-c4096-d16", "a2-text-a-static-c4096-d16", "a3-text-a-static-c1024-d8",
       "a4-text-a-static-dyn-c4096-d16"}


def replay_case(case, vector_cache, vector_tokens, score):
    """Replay a drafting case; returns (stats, dump lines)."""
    lines: list[str] = []
    stats = replay(
        vector_tokens(case.tokens), n_ctx=case.n_ctx, n_draft=case.n_draft,
        c_st=vector_cache(case.static) if case.static else None,
        c_dyn=vector_cache(case.dynamic) if case.dynamic else None,
        on_draft=lambda pos, drafts: lines.append(" ".join(map(str, [pos, len(drafts), *drafts]))),
        score=score)
    return stats, lines


def assert_same_dump(lines, expected, name):
    if lines != expected:
        first = next((i for i, (a, b) in enumerate(zip(lines, expected)) if a != b), min(len(lines), len(expected)))
        pytest.fail(f"{name}: dump differs from llama.cpp's first at line {first}: "
                    f"got {lines[first:first + 1]}, expected {expected[first:first + 1]} "
                    f"({len(lines)} vs {len(expected)} lines)")


@pytest.mark.parametrize("case", [pytest.param(c, id=c.name, marks=[pytest.mark.slow] if c.name in BIG else [])
                                  for c in DRAFTING])
def test_drafting_case(case, vector_cache, vector_tokens):
    """Draft for draft, count for count. Cases without int32 overflow use the default exact score
    (equivalent there); the overflow case o1 needs llama.cpp's wrapping int32 product."""
    score = "int32" if case.int32_overflow_products else "exact"
    stats, lines = replay_case(case, vector_cache, vector_tokens, score)
    expected = vectors.dump_body(case)
    assert_same_dump(lines, expected, case.name)
    body = "".join(line + "\n" for line in lines).encode()
    assert hashlib.sha256(body).hexdigest() == case.body_sha256
    assert (stats.n_chunks, stats.n_draft_calls, stats.n_drafted, stats.n_accept) == (
        case.n_chunks, case.n_draft_calls, case.n_drafted, case.n_accept)
    printed = case.data["results"]["lookup_stats"]["accept_percent_printed"]
    assert (f"{stats.accept:.3f}%" if stats.n_drafted else "-nan%") == printed
    saved = case.saved_dynamic
    if saved:  # the dynamic cache after the replay, as llama.cpp saved it (compared as a multiset)
        assert stats.c_dyn.canonical_sha256() == saved["canonical_sha256"]
        assert stats.c_dyn.n_entries() == saved["canonical_lines"]


def test_int32_wrap_matters_on_overflow_case(vector_cache, vector_tokens):
    """With exact scores the overflow case differs from llama.cpp at exactly the 482 of 6,678 draft-call
    positions the vectors' README reports; with int32 it matches (test_drafting_case)."""
    case = vectors.load_case("o1-ovf-static-c4096-d8")
    _, lines = replay_case(case, vector_cache, vector_tokens, "exact")
    ours = {line.split()[0]: line for line in lines}
    expected = vectors.dump_body(case)
    assert len(expected) == 6678
    assert sum(ours.get(line.split()[0]) != line for line in expected) == 482


@pytest.mark.parametrize("case", [pytest.param(c, id=c.name, marks=[pytest.mark.slow] if "small" in c.name else [])
                                  for c in vectors.all_cases() if c.kind == "create"])
def test_create_case(case, vector_cache, vector_tokens):
    """``create`` (llama-lookup-create) gives llama.cpp's static cache as a multiset."""
    (src,) = case.inputs
    built = build_static(vector_tokens(src))
    out = case.output
    assert built.canonical_sha256() == out["canonical_sha256"]
    assert built.sizes() == {2}
    assert built == vector_cache(out["file"])


@pytest.mark.slow
def test_merge_case(vector_cache):
    """lookup-merge of dyn-a.bin and static-small.bin, in both orders, as a multiset."""
    case = vectors.load_case("m1-merge-dyn-a-static-small")
    a, b = (vector_cache(name) for name in case.inputs)
    merged = merge_caches([a, b])
    assert merged.canonical_sha256() == case.output["canonical_sha256"]
    assert merged.total() == case.output["sum_counts"]
    assert merge_caches([b, a]) == merged


@pytest.mark.parametrize("name", ["ovf-static.bin", "syn-static.bin", "dyn-a.bin", "edge-neg-dyn.bin",
                                  pytest.param("static-small.bin", marks=pytest.mark.slow)])
def test_shipped_caches_load(name, vector_cache, tmp_path):
    """Every shipped llama.cpp cache file loads to its recorded canonical multiset and survives save/load."""
    info = next(e for e in __import__("json").loads(vectors.read_bytes("inputs.json"))["cache_files"]
                if e["file"] == name)
    cache = vector_cache(name)
    assert cache.canonical_sha256() == info["canonical_sha256"]
    for n, per in info["per_n"].items():
        sized = [part for eta, part in cache.counts.items() if len(eta) == int(n)]
        assert (len(sized), sum(map(len, sized)), sum(sum(p.values()) for p in sized)) == (
            per["ngrams"], per["entries"], per["sum_counts"])
    if name != "static-small.bin":
        canon = vectors.canonical_text_lines(name) if name != "dyn-a.bin" else None
        if canon is not None:
            assert cache.canonical_bytes().decode().splitlines() == canon
        path = tmp_path / name
        save_cache(cache, path)
        assert path.stat().st_size == info["bytes"]  # same records, maybe another order
        assert load_cache(path) == cache


def test_vector_files_sha256():
    """Every shipped vector file (decompressed) has the SHA-256 recorded by the vector set."""
    expected = vectors.expected_sha256()
    checked = 0
    for path in sorted(vectors.VECTOR_DIR.rglob("*")):
        if not path.is_file() or path.name in ("SHA256SUMS", "README.md"):
            continue
        rel = path.relative_to(vectors.VECTOR_DIR).as_posix()
        if rel in expected:  # shipped as the set shipped it
            assert hashlib.sha256(path.read_bytes()).hexdigest() == expected[rel], rel
        else:  # compressed here: check the decompressed content
            name = rel.removesuffix(".xz")
            assert rel.endswith(".xz") and name in expected, f"{rel}: no recorded SHA-256"
            assert hashlib.sha256(vectors.read_bytes(name)).hexdigest() == expected[name], rel
        checked += 1
    assert checked >= 60
