"""Benchmark (``pytest --benchmark-only``): several requests at once on SmolLM2, batched speculation against
mlx-lm's plain batching and against one request at a time.

Each workload is ``C`` concurrent requests (C = 1, 2, 4), all present from the start, greedy, up to
``NGRAM_SPEC_BENCH_TOKENS`` (96) tokens each, through SmolLM2-135M-Instruct's chat template:

    edits        real edits of ``benchmarks/data/edit-traces.jsonl.xz`` (an instruction and a file; the
                 answer is the file back), as in ``tests/mlx_backend/decode/test_bench_edit_drafters.py``
    free         free-writing prompts (the demo's, and three others)

and each is decoded three ways, side by side in this one process (the order rotating per workload):

    plain batched   mlx-lm's ``batch_generate`` (its ``BatchGenerator``: one forward for all rows, one token
                    a row): what plain ``mlx_lm.server`` does with concurrent requests
    one at a time   ``ngram_speculative_generate_step`` per request, one after the other (the cost-aware
                    policy, ``auto`` drafter): what ``ngram-spec serve`` did before batching
    spec batched    :class:`mlx_backend.batch.generate.BatchSpeculativeDecoder` (``auto`` drafter, the
                    cost-aware width of :mod:`mlx_backend.batch.policy`; ``NGRAM_SPEC_BENCH_K=k``: a fixed
                    draft length k instead): one verify forward for all rows

``extra_info`` holds per workload and C the aggregate tokens/s of each (all tokens / wall seconds), the
ratios of spec batched to the other two, and the batched decoder's verify forwards and accepted drafts.
Every spec-batched output must equal the same request's one-at-a-time output (which the decode tests hold
equal to plain greedy); whether plain batching's outputs equal them too is reported, not asserted
(``batch_generate`` pads rows, which may change the last bits of a logit).

``test_bench_lone_request_vs_one_at_a_time`` times C = 1 more closely: every prompt alone, batched (a batch
of one row) and one at a time back to back, ``NGRAM_SPEC_BENCH_ROUNDS`` (2) rounds, the median per-prompt ratio.

Run it with OpenBLAS interposed for the bandwidth-bound configuration (the BLAS that ran is recorded)::

    LD_PRELOAD=$(python3 -c 'from mlx_backend.machine.blas import wheel_openblas; print(wheel_openblas())') \\
        LD_LIBRARY_PATH=$(python3 -c 'from mlx_backend.machine.blas import gfortran_folder; print(gfortran_folder())') \\
        OPENBLAS_NUM_THREADS=1 python3 -m pytest --benchmark-only -s tests/mlx_backend/batch/test_bench_batch.py
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import pytest
from bench_knobs import whole_number

mx = pytest.importorskip("mlx.core")
from mlx_lm.generate import batch_generate  # noqa: E402

from mlx_backend.batch.generate import BatchSpeculativeDecoder  # noqa: E402
from mlx_backend.cli import demo  # noqa: E402
from mlx_backend.cli.prompts import prompt_tokens  # noqa: E402
from mlx_backend.decode.generate import ngram_speculative_generate_step  # noqa: E402
from mlx_backend.machine.blas import blas_in_use  # noqa: E402
from mlx_backend.models.loading import load_model  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "decode"))
from test_bench_edit_drafters import edit_prompts  # noqa: E402

MAX_TOKENS = whole_number("NGRAM_SPEC_BENCH_TOKENS", 96)
DRAFT_MAX = whole_number("NGRAM_SPEC_BENCH_K", None)  # None: the cost-aware width
CONCURRENCY = (1, 2, 4)
FREE = ("Write a short poem about the sea at night.",
        "Explain in a few paragraphs how a bicycle's gears work.",
        "Describe a busy morning at a fish market.")


@pytest.fixture(scope="module")
def smollm2():
    try:
        return load_model(None)
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


def one_at_a_time(model, prompts, eos):
    outs = []
    for p in prompts:
        out = []
        for t, _, _ in ngram_speculative_generate_step(mx.array(p), model, max_tokens=MAX_TOKENS):
            out.append(int(t))
            if int(t) in eos:
                break
        outs.append(out)
    return outs, {}


def spec_batched(model, prompts, eos):
    dec = BatchSpeculativeDecoder(model, eos_token_ids=eos)
    uids = [dec.add(p, max_tokens=MAX_TOKENS, draft_max=DRAFT_MAX) for p in prompts]
    outs = {u: [] for u in uids}
    rows = 0
    while dec.active:
        rows += len(dec.active)
        for u, toks in dec.step().items():
            outs[u].extend(toks)
    dec.close()
    return [outs[u] for u in uids], {"forwards": dec.n_forward, "rows_per_forward": round(rows / dec.n_forward, 2),
                                     "drafted": dec.n_drafted, "accepted": dec.n_accept}


def plain_batched(model, tokenizer, prompts):
    r = batch_generate(model, tokenizer, prompts, max_tokens=MAX_TOKENS, return_token_ids=True)
    return [list(t) for t in r.token_ids], {}


def test_bench_batched_speculation(benchmark, smollm2):
    model, tokenizer, desc = smollm2
    eos = set(tokenizer.eos_token_ids)
    free_texts = [next(p.text for p in demo.DEMO_PROMPTS if p.kind == "free writing"), *FREE]
    workloads = {"edits": [prompt_tokens(tokenizer, t) for _, t in edit_prompts()],
                 "free": [prompt_tokens(tokenizer, t) for t in free_texts]}
    ways = {"plain batched": lambda ps: plain_batched(model, tokenizer, ps),
            "one at a time": lambda ps: one_at_a_time(model, ps, eos),
            "spec batched": lambda ps: spec_batched(model, ps, eos)}
    spec_batched(model, workloads["free"][:2], eos)   # warm-up: kernels, graphs
    report = {}

    def run_all():
        for w, (name, pool) in enumerate(workloads.items()):
            for c in CONCURRENCY:
                prompts = [pool[i % len(pool)] for i in range(c)]
                order = list(ways)[(w + c) % 3:] + list(ways)[:(w + c) % 3]
                cell = report.setdefault(name, {}).setdefault(f"C={c}", {})
                outs = {}
                for way in order:
                    t0 = time.perf_counter()
                    outs[way], info = ways[way](prompts)
                    seconds = time.perf_counter() - t0
                    cell[way] = round(sum(map(len, outs[way])) / seconds, 2)
                    cell.update({f"{way} {k}": v for k, v in info.items()})
                assert outs["spec batched"] == outs["one at a time"], f"{name} C={c}: batched output differs"
                cell["plain batched equal"] = outs["plain batched"] == outs["one at a time"]
                cell["spec batched / plain batched"] = round(cell["spec batched"] / cell["plain batched"], 3)
                cell["spec batched / one at a time"] = round(cell["spec batched"] / cell["one at a time"], 3)

    benchmark.pedantic(run_all, rounds=1, iterations=1)
    benchmark.extra_info.update(report=report, model=desc, blas=blas_in_use(), max_tokens=MAX_TOKENS,
                                draft_max="auto" if DRAFT_MAX is None else DRAFT_MAX, machine=f"{platform.machine()}, {os.cpu_count()} CPUs",
                                load_average=[round(x, 2) for x in os.getloadavg()])
    print(json.dumps(report, indent=1))


ROUNDS = whole_number("NGRAM_SPEC_BENCH_ROUNDS", 2)


def test_bench_lone_request_vs_one_at_a_time(benchmark, smollm2):
    """Issue 28's "C = 1 no slower than today's serve", below the server: each prompt (the edits and the free
    writing above) alone through the batched decoder (a batch of one row) and through the single-sequence
    loop, back to back in an order that alternates, ``NGRAM_SPEC_BENCH_ROUNDS`` (2) rounds; the median and
    the spread of the per-prompt time ratios, batched / one at a time (> 1: the batched path is slower)."""
    model, tokenizer, desc = smollm2
    eos = set(tokenizer.eos_token_ids)
    free_texts = [next(p.text for p in demo.DEMO_PROMPTS if p.kind == "free writing"), *FREE]
    prompts = [prompt_tokens(tokenizer, t) for t in [t for _, t in edit_prompts()] + free_texts]
    ways = {"one at a time": lambda p: one_at_a_time(model, [p], eos)[0],
            "spec batched": lambda p: spec_batched(model, [p], eos)[0]}
    spec_batched(model, prompts[-2:], eos)   # warm-up: kernels, graphs
    seconds = {way: [] for way in ways}

    def run_all():
        for r in range(ROUNDS):
            for i, p in enumerate(prompts):
                outs = {}
                for way in list(ways)[(i + r) % 2:] + list(ways)[:(i + r) % 2]:
                    t0 = time.perf_counter()
                    outs[way] = ways[way](p)
                    seconds[way].append(time.perf_counter() - t0)
                assert outs["spec batched"] == outs["one at a time"], f"prompt {i}: batched output differs"

    benchmark.pedantic(run_all, rounds=1, iterations=1)
    ratios = sorted(b / s for b, s in zip(seconds["spec batched"], seconds["one at a time"]))
    report = {"pairs": len(ratios), "time ratio batched / one at a time": {
        "median": round(statistics.median(ratios), 4),
        "min": round(ratios[0], 4), "max": round(ratios[-1], 4),
        "total": round(sum(seconds["spec batched"]) / sum(seconds["one at a time"]), 4)}}
    benchmark.extra_info.update(report=report, model=desc, blas=blas_in_use(), max_tokens=MAX_TOKENS,
                                machine=f"{platform.machine()}, {os.cpu_count()} CPUs",
                                load_average=[round(x, 2) for x in os.getloadavg()])
    print(json.dumps(report, indent=1))
