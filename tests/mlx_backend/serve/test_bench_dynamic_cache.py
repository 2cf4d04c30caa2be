"""Benchmark: the server-wide dynamic cache at its bound (``--dynamic-max-entries``, docs/server.md): learning one
response (``NgramSpeculator.finish``) and building a drafter when the cache is full, and one cut
(``HashTable.keep_most_counted``: N - N/4 of N + a response kept). No model; random tokens, every n-gram new
(the worst case). ``extra_info``: the cache's entries and bytes, the cut's seconds.

Run: ``python3 -m pytest --benchmark-only tests/mlx_backend/serve/test_bench_dynamic_cache.py``;
``NGRAM_SPEC_BENCH_DYN_ENTRIES`` sets N (default the server's, 2^21).
"""
from __future__ import annotations

import numpy as np
import pytest
from bench_knobs import whole_number

pytest.importorskip("mlx_lm")

from mlx_backend.ngram.dynamic_cache import DYNAMIC_MAX_ENTRIES  # noqa: E402
from mlx_backend.serve.server import NgramSpeculator, RequestSpec  # noqa: E402

N = whole_number("NGRAM_SPEC_BENCH_DYN_ENTRIES", DYNAMIC_MAX_ENTRIES)
PROMPT, RESPONSE = 192, 256


def requests(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 49_152, PROMPT + RESPONSE).tolist() for _ in range(n)]


@pytest.fixture(scope="module")
def full():
    """A speculator whose cache was cut once (room for N/4 more entries before the next cut)."""
    speculator = NgramSpeculator(dynamic_max_entries=N)
    for tokens in requests(N // (4 * RESPONSE) + 2):   # random text: ~4 entries per learned token
        speculator.finish(RequestSpec(True, 8, None), tokens, PROMPT, completed=True)
    while not speculator.stats()["dynamic_entries_dropped"]:
        speculator.finish(RequestSpec(True, 8, None), requests(1, seed=len(speculator.c_dyn[None]))[0], PROMPT,
                          completed=True)
    return speculator


def _info(benchmark, speculator):
    cache = speculator.stats()["dynamic_caches"]["server"]
    benchmark.extra_info.update(max_entries=N, entries=cache["entries"], bytes=cache["bytes"])


def test_bench_learn_a_response_at_the_bound(benchmark, full):
    todo = iter(requests(200, seed=1))
    benchmark.pedantic(lambda: full.finish(RequestSpec(True, 8, None), next(todo), PROMPT, completed=True),
                       rounds=200, iterations=1)
    _info(benchmark, full)


def test_bench_drafter_at_the_bound(benchmark, full):
    prompt = requests(1, seed=2)[0]

    def draft():
        drafter = full.drafter(None, [], set(), "lookup")
        drafter.reset(prompt)
        return drafter.draft(8)

    benchmark.pedantic(draft, rounds=50, iterations=1)
    _info(benchmark, full)


def test_bench_cut_at_the_bound(benchmark):
    tokens = np.random.default_rng(3).integers(0, 49_152, N // 4 + RESPONSE, dtype=np.int32)

    def setup():
        speculator = NgramSpeculator(dynamic_max_entries=0)
        speculator.dynamic_for(None).update(tokens)        # ~N entries + a response's
        return (speculator.dynamic_for(None),), {}

    benchmark.pedantic(lambda table: table.keep_most_counted(N - N // 4, room=N // 2), setup=setup, rounds=3)
    benchmark.extra_info.update(max_entries=N)
