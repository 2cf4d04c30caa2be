"""The array backend against llama.cpp's golden vectors (conformance/vectors/): every drafting case's
dump line for line, the saved dynamic caches and the create/merge outputs as canonical multisets."""
from __future__ import annotations

import functools
import hashlib

import pytest

import mlx_backend.ngram.api as api
from conformance import vectors
from mlx_backend.ngram.caches import load_cache


@functools.cache
def vector_cache(name: str):
    """A vector cache file read once (llama.cpp's format; the big one via the memory-mapped copy below)."""
    return load_cache(vectors.local_path(name))


@functools.cache
def tokens(name: str):
    return api.read_tokens(vectors.local_path(name))


CASES = vectors.drafting_cases()


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_drafting_case_dump_identical(case):
    lines = []
    c_st = vector_cache(case.static) if case.static else None
    c_dyn = vector_cache(case.dynamic) if case.dynamic else None
    # o1 is the int32-overflow case: llama.cpp's wrapping product decides 482 of its draft calls.
    score = "int32" if case.int32_overflow_products else "exact"
    stats = api.replay(tokens(case.tokens), case.n_ctx, case.n_draft, c_st=c_st, c_dyn=c_dyn,
                       on_draft=lambda pos, d: lines.append(f"{pos} {len(d)}" + "".join(f" {t}" for t in d)),
                       score=score)
    body = "".join(line + "\n" for line in lines).encode()
    if hashlib.sha256(body).hexdigest() != case.body_sha256:
        expected = vectors.dump_body(case)
        first = next((i for i, (a, b) in enumerate(zip(lines, expected)) if a != b), min(len(lines), len(expected)))
        pytest.fail(f"dump differs from llama.cpp's first at call {first}: "
                    f"got {lines[first:first + 1]}, expected {expected[first:first + 1]}")
    assert (stats.n_chunks, stats.n_draft_calls, stats.n_drafted, stats.n_accept) == (
        case.n_chunks, case.n_draft_calls, case.n_drafted, case.n_accept)
    if case.saved_dynamic:
        assert api.as_sorted(stats.c_dyn).canonical_sha256() == case.saved_dynamic["canonical_sha256"]


def test_int64_scores_differ_on_the_overflow_case():
    """The o1 case needs llama.cpp's wrapping int32 product: exact scores give another dump."""
    case = vectors.load_case("o1-ovf-static-c4096-d8")
    lines = []
    api.replay(tokens(case.tokens), case.n_ctx, case.n_draft, c_st=vector_cache(case.static),
               on_draft=lambda pos, d: lines.append(f"{pos} {len(d)}" + "".join(f" {t}" for t in d)))
    assert hashlib.sha256("".join(x + "\n" for x in lines).encode()).hexdigest() != case.body_sha256


@pytest.mark.parametrize("name", ["create-syn-static", "create-ovf-static", "create-static-small"])
def test_create_case_canonical(name):
    case = vectors.load_case(name)
    src = case.inputs[0]
    built = api.build_static(tokens(src))
    assert built.canonical_sha256() == case.output["canonical_sha256"]
    assert built.n_entries() == case.output["canonical_lines"]


def test_merge_case_canonical():
    case = vectors.load_case("m1-merge-dyn-a-static-small")
    merged = api.merge_caches([vector_cache("dyn-a.bin"), vector_cache("static-small.bin")])
    assert merged.canonical_sha256() == case.output["canonical_sha256"]
    reverse = api.merge_caches([vector_cache("static-small.bin"), vector_cache("dyn-a.bin")])
    assert reverse == merged


@pytest.mark.parametrize("name", ["syn-static.bin", "ovf-static.bin", "edge-neg-dyn.bin"])
def test_shipped_canonical_text(name):
    rows = [" ".join(map(str, r)) for r in api.cache_entries(vector_cache(name))]
    assert rows == vectors.canonical_text_lines(name)
