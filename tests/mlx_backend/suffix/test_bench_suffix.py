"""Benchmarks of the fast suffix drafter: ``pytest tests/mlx_backend/suffix/test_bench_suffix.py --benchmark-only``.

At contexts of 1k, 10k, 100k and 1M tokens: the append cost per token (one-token ``extend`` calls, as
generation makes them; and ``reset`` with the whole context, per token, table doublings included), the
draft cost per drafted token in a live loop (draft 16, accept the matching prefix, extend by it and the
next token), and the state memory per token. Both should be flat in the context length (targets:
drafting <= 5 us per drafted token at 100k; append O(1) amortized).

The text is ``reference/data/persuasion.i32`` (115,861 tokens) repeated with the token ids of copy ``r``
shifted by ``r * VOCAB``: each copy has the book's statistics, and no match spans two copies, so a long
context is long text, not a repetition the drafter copies wholesale. ``extra_info`` holds the figures
(``--benchmark-json``) and the machine.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("numba")

from mlx_backend.suffix.drafter import SuffixDrafter  # noqa: E402

PERSUASION = Path(__file__).resolve().parents[3] / "reference" / "data" / "persuasion.i32"
VOCAB = 49_152          # SmolLM2's vocabulary: the book's ids are below it
CONTEXTS = [1_000, 10_000, 100_000, 1_000_000]
N_DRAFT, ROUNDS, STEP_TOKENS = 16, 5, 2_000
TARGET_DRAFT_US = 5.0


def cpu_model() -> str:
    """The CPU's model name, as the BLAS verdicts name it."""
    from mlx_backend.machine.blas import cpu_identity

    return cpu_identity()["model"]


@pytest.fixture(scope="module")
def text() -> np.ndarray:
    book = np.fromfile(PERSUASION, "<i4").astype(np.int64)
    copies = -(-(max(CONTEXTS) + 3 * ROUNDS * STEP_TOKENS) // book.size)
    return np.concatenate([book + r * VOCAB for r in range(copies)]).astype(np.int32)


@pytest.fixture(scope="module")
def drafters(text):
    """A drafter per context length, reset with the first ``n`` tokens (seconds per token recorded)."""
    made = {}

    def at(n: int):
        if n not in made:
            d = SuffixDrafter()
            d.reset(text[:100])   # numba's cached kernels loaded before the clock starts
            t = time.perf_counter()
            d.reset(text[:n])
            made[n] = (d, (time.perf_counter() - t) / n)
        return made[n]
    return at


def info(benchmark, d: SuffixDrafter, **kw) -> None:
    n = d.tokens.size
    state = d._buf.nbytes + d._hash.nbytes + d._index.slots.nbytes
    benchmark.extra_info.update(machine=f"{os.cpu_count()} CPUs, {cpu_model()}", context_tokens=int(n),
                                state_bytes_per_token=round(state / n, 1),
                                table_bytes_per_token=round(d._index.slots.nbytes / n, 1),
                                keys_per_token=round(int(d._index.meta[0]) / n, 2), **kw)


@pytest.mark.parametrize("n", CONTEXTS, ids=[f"{n // 1000}k" for n in CONTEXTS])
def test_bench_append(benchmark, text, drafters, n):
    """``extend`` one token at a time, ``STEP_TOKENS`` per round, after a context of ``n`` tokens."""
    d, reset_s_per_token = drafters(n)

    def extend_one_by_one():
        lo = d.tokens.size
        for t in text[lo:lo + STEP_TOKENS].tolist():
            d.extend([t])

    benchmark.pedantic(extend_one_by_one, rounds=ROUNDS, iterations=1, warmup_rounds=1)
    info(benchmark, d, us_per_appended_token=round(1e6 * benchmark.stats.stats.median / STEP_TOKENS, 3),
         reset_us_per_token=round(1e6 * reset_s_per_token, 3))


@pytest.mark.parametrize("n", CONTEXTS, ids=[f"{n // 1000}k" for n in CONTEXTS])
def test_bench_draft(benchmark, text, drafters, n):
    """The live loop over the next ``STEP_TOKENS`` tokens; the time inside ``draft`` per drafted token."""
    d, _ = drafters(n)
    in_draft, drafted, calls = [], [], []

    def live():
        lo = d.tokens.size
        X = text[lo:lo + STEP_TOKENS].tolist()
        secs, n_drafted, n_calls, i = 0.0, 0, 0, 0
        while i < len(X):
            t = time.perf_counter()
            D = d.draft(N_DRAFT)
            secs += time.perf_counter() - t
            n_drafted, n_calls = n_drafted + len(D), n_calls + 1
            m = 0
            while m < len(D) and i + m < len(X) and D[m] == X[i + m]:
                m += 1
            d.extend(X[i:i + m + 1])
            i += m + 1
        in_draft.append(secs)
        drafted.append(n_drafted)
        calls.append(n_calls)

    benchmark.pedantic(live, rounds=ROUNDS, iterations=1)
    j = int(np.argsort(in_draft)[len(in_draft) // 2])   # the median round
    info(benchmark, d, us_per_drafted_token=round(1e6 * in_draft[j] / max(drafted[j], 1), 3),
         us_per_draft_call=round(1e6 * in_draft[j] / calls[j], 3), drafted_per_call=round(drafted[j] / calls[j], 2),
         target_us_per_drafted_token=TARGET_DRAFT_US)
