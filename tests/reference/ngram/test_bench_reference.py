"""Baseline benchmarks of the reference (``pytest --benchmark-only``): drafting microseconds per drafted
token on llama.cpp's conformance replays, and the cache load time, for the fast backend to beat.

The reference is pure Python (dicts); NumPy only reads files, so no BLAS routine runs. The BLAS NumPy
was built with is reported anyway, as every benchmark here must say which BLAS ran.
"""
from __future__ import annotations

import platform

import numpy as np
import pytest

from conformance import vectors
from reference.ngram.cache_file import load_cache
from reference.ngram.drafter import NgramDrafter
from reference.ngram.replay import replay


def machine_info() -> dict:
    try:
        blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        blas = f"{blas.get('name')} {blas.get('version')} (linked by NumPy; unused: the reference runs no BLAS)"
    except Exception:  # older NumPy without mode="dicts"
        blas = "unknown (unused: the reference runs no BLAS)"
    return {"blas": blas, "machine": platform.machine(), "python": platform.python_version(),
            "processor": platform.processor() or "unknown"}


CASES = ["a1-text-a-nostatic-c4096-d16", "a2-text-a-static-c4096-d16"]


@pytest.mark.parametrize("name", CASES)
def test_bench_reference_replay(benchmark, name, vector_cache, vector_tokens):
    """lookup-stats replay of a conformance case; t_draft (draft calls + context updates) per drafted token."""
    case = vectors.load_case(name)
    tokens = vector_tokens(case.tokens)
    c_st = vector_cache(case.static) if case.static else None
    runs = []

    def run():
        stats = replay(tokens, n_ctx=case.n_ctx, n_draft=case.n_draft, c_st=c_st)
        runs.append(stats)
        return stats

    stats = benchmark.pedantic(run, rounds=3, iterations=1)
    assert stats.n_drafted == case.n_drafted  # the benchmark replays the real thing
    us = sorted(s.us_per_drafted_token for s in runs)
    benchmark.extra_info.update(machine_info())
    benchmark.extra_info.update(case=name, backend="reference", n_drafted=stats.n_drafted,
                                us_per_drafted_token=us[len(us) // 2], us_per_drafted_token_min=us[0])


def test_bench_reference_live_drafting(benchmark, vector_tokens):
    """The per-step call of generation: extend by the accepted tokens + 1, then draft (no static cache)."""
    tokens = vector_tokens("text-a.i32")[:8192].tolist()

    def run():
        d = NgramDrafter()
        d.reset(tokens[:1])
        n_drafted = 0
        pos = 1
        while pos < len(tokens):
            drafts = d.draft(16)
            n_drafted += len(drafts)
            n_ok = 0
            while n_ok < len(drafts) and pos + n_ok < len(tokens) and drafts[n_ok] == tokens[pos + n_ok]:
                n_ok += 1
            step = tokens[pos:pos + n_ok + 1]
            d.extend(step)
            pos += len(step)
        return n_drafted

    n_drafted = benchmark.pedantic(run, rounds=3, iterations=1)
    assert n_drafted > 0
    benchmark.extra_info.update(machine_info())
    benchmark.extra_info.update(backend="reference", n_drafted=n_drafted,
                                us_per_drafted_token=benchmark.stats.stats.median * 1e6 / n_drafted)


def test_bench_reference_load_static(benchmark):
    """Loading llama.cpp's static cache file static-small.bin (19 MB, 1,063,798 entries) into dicts."""
    path = vectors.local_path("static-small.bin")
    cache = benchmark.pedantic(load_cache, args=(path,), rounds=3, iterations=1)
    assert cache.n_entries() == 1063798
    benchmark.extra_info.update(machine_info())
    benchmark.extra_info.update(backend="reference", file_bytes=path.stat().st_size,
                                load_ms=benchmark.stats.stats.median * 1e3)
