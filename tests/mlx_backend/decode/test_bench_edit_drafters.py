"""Benchmark (``pytest --benchmark-only``): SmolLM2 end to end on real edits, every drafter side by side.

The prompts are real edits of ``benchmarks/data/edit-traces.jsonl.xz`` (issue 27: an instruction and a file
from a PyPI or npm release; the model is asked for the whole file back), chosen by size (``EDITS`` of them
whose file is 1,200-2,600 characters, a Python and a JavaScript one first), and a free-writing prompt of the
demo, through SmolLM2-135M-Instruct's chat template, greedy. Each round runs every configuration on every
prompt, in an order that rotates from round to round, all in this one process:

    plain              mlx-lm's ``generate_step`` (one token a forward)
    lookup             llama.cpp's lookup drafter, the cost-aware draft length (``draft_max=None``)
    auto               the default: ``auto`` drafter, cost-aware draft length (up to k = 64)
    suffix k=K         the suffix drafter at a fixed draft length K (8, 16, 32, 64)

``extra_info`` holds, per prompt, the median tokens/s of each configuration, its ratio to plain, tokens per
forward, and whether ``auto`` is within 5 % of the best fixed k (issue 27's target); the BLAS that ran and
the machine. Every speculative output must equal plain greedy's.

The BLAS is the process's: for the bandwidth-bound configuration run it with OpenBLAS interposed, e.g. the
``ngsolve-openblas`` wheel's library::

    LD_PRELOAD=$(python3 -c 'from mlx_backend.machine.blas import wheel_openblas; print(wheel_openblas())') \\
        LD_LIBRARY_PATH=$(python3 -c 'from mlx_backend.machine.blas import gfortran_folder; print(gfortran_folder())') \\
        OPENBLAS_NUM_THREADS=2 python3 -m pytest --benchmark-only tests/mlx_backend/decode/test_bench_edit_drafters.py

``NGRAM_SPEC_BENCH_TOKENS`` (256) caps the tokens per prompt, ``NGRAM_SPEC_BENCH_ROUNDS`` (2) the rounds,
``NGRAM_SPEC_BENCH_EDITS`` (2) the edit prompts.
"""
from __future__ import annotations

import json
import lzma
import os
import platform
import statistics
import time
from pathlib import Path

import pytest
from bench_knobs import whole_number

mx = pytest.importorskip("mlx.core")
from mlx_backend.cli import demo  # noqa: E402
from mlx_backend.cli.prompts import prompt_tokens  # noqa: E402
from mlx_backend.decode.generate import SpecStats, ngram_speculative_generate_step  # noqa: E402
from mlx_backend.machine.blas import blas_in_use  # noqa: E402
from mlx_backend.models.loading import load_model  # noqa: E402

TRACES = Path(__file__).resolve().parents[3] / "benchmarks" / "data" / "edit-traces.jsonl.xz"
MAX_TOKENS = whole_number("NGRAM_SPEC_BENCH_TOKENS", 256)
ROUNDS = whole_number("NGRAM_SPEC_BENCH_ROUNDS", 2)
EDITS = whole_number("NGRAM_SPEC_BENCH_EDITS", 2)
FIXED_K = (8, 16, 32, 64)
CONFIGS = {"plain": None, "lookup": dict(drafter="lookup", draft_max=None),
           "auto": dict(drafter="auto", draft_max=None),
           **{f"suffix k={k}": dict(drafter="suffix", draft_max=k) for k in FIXED_K}}


def edit_prompts() -> list[tuple[str, str]]:
    """``(name, text)`` of ``EDITS`` real edits of a ``.py`` or ``.js`` file of 1,200-2,600 characters,
    alternating the two."""
    with lzma.open(TRACES, "rt") as f:
        rows = [json.loads(line) for line in f]
    fits = sorted((r for r in rows if 1200 <= len(r["output"]) <= 2600 and r["path"].endswith((".py", ".js"))),
                  key=lambda r: (r["package"], r["path"]))
    by_language = {}
    for r in fits:
        by_language.setdefault(Path(r["path"]).suffix, []).append(r)
    picked = [r for group in zip(*by_language.values()) for r in group][:EDITS]
    return [(f"edit {r['package']} {r['path']}", r["prompt"]) for r in picked]


@pytest.fixture(scope="module")
def smollm2():
    try:
        model, tokenizer, desc = load_model(None)
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    return model, tokenizer, desc


def run(model, prompt: list[int], eos: set[int], config: dict | None) -> tuple[list[int], float, SpecStats | None]:
    """Greedy tokens up to EOS or ``MAX_TOKENS``, the seconds taken, the speculative counters."""
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    stats, sampler, out = SpecStats(), make_sampler(0.0), []
    t0 = time.perf_counter()
    steps = (generate_step(mx.array(prompt), model, max_tokens=MAX_TOKENS, sampler=sampler) if config is None else
             ((t, lp) for t, lp, _ in ngram_speculative_generate_step(mx.array(prompt), model, max_tokens=MAX_TOKENS,
                                                                      sampler=sampler, stats=stats, **config)))
    for token, _ in steps:
        out.append(int(token))
        if int(token) in eos:
            break
    return out, time.perf_counter() - t0, None if config is None else stats


def summary(times: dict, stats: dict, n_tokens: int) -> dict:
    rate = {name: n_tokens / statistics.median(t) for name, t in times.items()}
    best_fixed = max(rate[f"suffix k={k}"] for k in FIXED_K)
    return {"tokens": n_tokens,
            "tok_s": {name: round(r, 2) for name, r in rate.items()},
            "vs_plain": {name: round(r / rate["plain"], 3) for name, r in rate.items()},
            "tokens_per_forward": {name: round(s.tokens_per_forward, 2) for name, s in stats.items()},
            "auto_vs_best_fixed_k": round(rate["auto"] / best_fixed, 3),
            "auto_vs_lookup": round(rate["auto"] / rate["lookup"], 3)}


def test_bench_edits_and_free_writing_every_drafter(benchmark, smollm2):
    model, tokenizer, desc = smollm2
    eos = set(tokenizer.eos_token_ids)
    free = next(p.text for p in demo.DEMO_PROMPTS if p.kind == "free writing")
    prompts = [(name, prompt_tokens(tokenizer, text)) for name, text in [*edit_prompts(), ("free writing", free)]]
    run(model, prompts[0][1][:64], eos, CONFIGS["auto"])  # warm-up: compile the drafters' kernels
    times = {name: {c: [] for c in CONFIGS} for name, _ in prompts}
    stats, outputs = {name: {} for name, _ in prompts}, {}

    def rounds():
        for r in range(ROUNDS):
            for i, (name, prompt) in enumerate(prompts):
                order = list(CONFIGS)[(r + i) % len(CONFIGS):] + list(CONFIGS)[:(r + i) % len(CONFIGS)]
                for config in order:
                    out, seconds, s = run(model, prompt, eos, CONFIGS[config])
                    times[name][config].append(seconds)
                    if s is not None:
                        stats[name][config] = s
                    outputs.setdefault(name, {})[config] = out

    benchmark.pedantic(rounds, rounds=1, iterations=1)
    report = {}
    for name, _ in prompts:
        plain = outputs[name]["plain"]
        for config, out in outputs[name].items():
            assert out == plain, f"{name}: {config}'s greedy output differs from plain greedy"
        report[name] = summary(times[name], stats[name], len(plain))
    benchmark.extra_info.update(report=report, model=desc, blas=blas_in_use(), max_tokens=MAX_TOKENS, rounds=ROUNDS,
                                machine=f"{platform.machine()}, {os.cpu_count()} CPUs",
                                load_average=[round(x, 2) for x in os.getloadavg()])
    print(json.dumps(report, indent=1))
