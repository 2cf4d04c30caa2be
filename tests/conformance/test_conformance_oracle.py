"""The suite's own oracle (conformance/oracle.py) reproduces llama.cpp's golden outputs.

The property checks of the conformance suite compare backends with this oracle; here it is held to
llama.cpp's draft dumps, totals and saved dynamic caches, so the oracle itself cannot be wrong
silently. Cases cover the edge cases, the negative-start rule (e8), dense ties (s1's first chunks),
a static cache (s3), wrapping int32 scores (o1) and a dynamic cache across chunks (e5, dyn-a-build).
"""
import hashlib

import pytest

from conformance import golden, llama_format, oracle, vectors

SMALL = ["e1-len1-c4096-d16", "e2-len2-c4096-d16", "e3-len5-c4096-d16", "e6-rep5-c4-d16", "e7-rep5-c2-d16",
         "e8-neg-dyn-c8-d16", "edge-neg-dyn-build"]
LARGE = ["e5-len8193-c4096-d16", "o1-ovf-static-c4096-d8", "s3-syn-v8-rep-static-c2048-d8", "dyn-a-build"]


def oracle_replay(case, n_chunks=None):
    tokens = golden.tokens(case.tokens)
    if n_chunks is not None:
        tokens = tokens[:n_chunks * case.n_ctx + 1]
    return oracle.replay(tokens, case.n_ctx, case.n_draft,
                         golden.oracle_cache(case.static) if case.static else None,
                         golden.oracle_cache(case.dynamic) if case.dynamic else None,
                         wrap_int32=bool(case.int32_overflow_products))


def check_case(name):
    case = vectors.load_case(name)
    r = oracle_replay(case)
    assert [golden.dump_line(p, d) for p, d in r.calls] == vectors.dump_body(case)
    assert (r.n_chunks, len(r.calls), r.n_drafted, r.n_accept) == (
        case.n_chunks, case.n_draft_calls, case.n_drafted, case.n_accept)
    if case.saved_dynamic:
        text = "".join(" ".join(map(str, row)) + "\n" for row in oracle.rows(r.dyn)).encode()
        assert hashlib.sha256(text).hexdigest() == case.saved_dynamic["canonical_sha256"]


@pytest.mark.parametrize("name", SMALL)
def test_oracle_reproduces_small_cases(name):
    check_case(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", LARGE)
def test_oracle_reproduces_large_cases(name):
    check_case(name)


def test_oracle_reproduces_dense_ties():
    case = vectors.load_case("s1-syn-v3-nostatic-c4096-d16")
    r = oracle_replay(case, n_chunks=1)
    want = vectors.dump_body(case)[:len(r.calls)]
    assert [golden.dump_line(p, d) for p, d in r.calls] == want


def test_without_int32_wrapping_the_overflow_case_differs():
    """o1 is sensitive to the score arithmetic: exact scores change some of its draft calls."""
    case = vectors.load_case("o1-ovf-static-c4096-d8")
    tokens = golden.tokens(case.tokens)[:case.n_ctx + 1]
    st = golden.oracle_cache(case.static)
    wrapped = oracle.replay(tokens, case.n_ctx, case.n_draft, st, wrap_int32=True)
    exact = oracle.replay(tokens, case.n_ctx, case.n_draft, st)
    assert [golden.dump_line(p, d) for p, d in wrapped.calls] == vectors.dump_body(case)[:len(wrapped.calls)]
    assert exact.calls != wrapped.calls


@pytest.mark.parametrize("name", ["syn-static.bin", "edge-neg-dyn.bin", "ovf-static.bin"])
def test_llama_format_reader_matches_canonical_text(name):
    cache = llama_format.from_bytes(vectors.read_bytes(name))
    assert [" ".join(map(str, r)) for r in oracle.rows(cache)] == vectors.canonical_text_lines(name)
    assert oracle.rows(llama_format.from_bytes(llama_format.to_bytes(cache))) == oracle.rows(cache)
