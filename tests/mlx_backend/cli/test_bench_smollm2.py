"""Benchmarks (``pytest --benchmark-only``): SmolLM2-135M-Instruct, speculative vs plain greedy, side by side.

Each round runs every prompt of a kind plain (mlx-lm's ``generate_step``, in pedantic's untimed
setup, timed by hand) and then speculative (the timed function), so both see the same machine load.
``extra_info`` holds the medians: plain/spec tokens/s, the speedup, acceptance, tokens per forward,
the share of drafting and rollback in the speculative time, the BLAS and the weight dtype.
Targets (issue 6): speedup >= 1.6 on input-grounded prompts, >= 0.97 on free writing.

The BLAS is the process's: run once as is (mlx's bundled reference BLAS) and once with OpenBLAS
interposed (the bandwidth-bound configuration); the weights are float32 on the CPU
(``mlx_backend.models.gguf.default_dtype``)::

    pytest --benchmark-only tests/mlx_backend/cli/test_bench_smollm2.py
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 OPENBLAS_NUM_THREADS=1 \\
        pytest --benchmark-only tests/mlx_backend/cli/test_bench_smollm2.py

``NGRAM_SPEC_BENCH_DTYPE`` overrides the dtype, ``NGRAM_SPEC_BENCH_TOKENS`` the tokens per prompt (96),
``NGRAM_SPEC_BENCH_ROUNDS`` the rounds (5; the speedup is the median of the per-round ratios).

``test_bench_generate_default_vs_no_spec`` times the command a user runs, end to end (process start,
model loading, BLAS re-execution, generation): ``ngram-spec generate`` with its defaults (cost-aware
draft length) against ``--no-spec`` on the free-writing prompt, once with an empty step-cost cache
(a first run) and once with a cache that earlier runs filled (a later run), for ``--blas bundled`` and
``--blas wheel`` (the ngsolve-openblas wheel). Each round runs the three commands in one of the six orders
(round i takes order i mod 6), so no command always runs first or last in a round. Target (issue 10): both
<= 1.03x the ``--no-spec`` time.
"""
from __future__ import annotations

import itertools
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
from bench_knobs import whole_number

mx = pytest.importorskip("mlx.core")
import mlx_backend.models.gguf  # noqa: E402
from mlx_backend.cli import demo as mlx_cli  # noqa: E402
from mlx_backend.machine.blas import blas_in_use, wheel_openblas  # noqa: E402
from mlx_backend.decode.generate import SpecStats, ngram_speculative_generate_step  # noqa: E402
from mlx_backend.ngram.default import lookup_drafter
from mlx_backend.cli.prompts import prompt_tokens  # noqa: E402
from mlx_backend.models.loading import load_model  # noqa: E402

TARGET = {"input-grounded": 1.6, "free writing": 0.97}
ROUNDS = whole_number("NGRAM_SPEC_BENCH_ROUNDS", 5)


@pytest.fixture(scope="module")
def smollm2():
    dtype = os.environ.get("NGRAM_SPEC_BENCH_DTYPE") or mlx_backend.models.gguf.default_dtype()
    try:
        model, tokenizer, desc = load_model(None, dtype)
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    return model, tokenizer, desc


def _plain(model, prompt, max_tokens, eos, sampler):
    from mlx_lm.generate import generate_step

    out = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens, sampler=sampler):
        out.append(int(token))
        if token in eos:
            break
    return out


def _spec(model, prompt, max_tokens, eos, sampler, stats):
    out = []
    for token, _, _ in ngram_speculative_generate_step(mx.array(prompt), model, max_tokens=max_tokens,
                                                       sampler=sampler, drafter=lookup_drafter(), stats=stats):
        out.append(int(token))
        if token in eos:
            break
    return out


@pytest.mark.parametrize("kind", ["input-grounded", "free writing"])
def test_bench_smollm2_spec_vs_plain(benchmark, smollm2, kind):
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer, desc = smollm2
    max_tokens = whole_number("NGRAM_SPEC_BENCH_TOKENS", 96)
    eos, sampler = set(tokenizer.eos_token_ids), make_sampler(0.0)
    prompts = [prompt_tokens(tokenizer, p.text) for p in mlx_cli.DEMO_PROMPTS if p.kind == kind]
    _spec(model, prompts[0], 4, eos, sampler, SpecStats())  # warm-up
    plain_rates, spec_rates, ratios, reference, stats_rounds = [], [], [], None, []

    def plain_round():  # untimed by pytest-benchmark, timed here: the side-by-side baseline
        t0 = time.perf_counter()
        outs = [_plain(model, p, max_tokens, eos, sampler) for p in prompts]
        plain_rates.append(sum(map(len, outs)) / (time.perf_counter() - t0))
        nonlocal reference
        reference = outs

    def spec_round():
        stats = [SpecStats() for _ in prompts]
        t0 = time.perf_counter()
        outs = [_spec(model, p, max_tokens, eos, sampler, s) for p, s in zip(prompts, stats)]
        spec_rates.append(sum(map(len, outs)) / (time.perf_counter() - t0))
        ratios.append(spec_rates[-1] / plain_rates[-1])
        stats_rounds.append(stats)
        return outs

    outs = benchmark.pedantic(spec_round, setup=plain_round, rounds=ROUNDS, iterations=1)
    assert outs == reference, "greedy speculative output differs from plain greedy"

    last = stats_rounds[-1]
    n = lambda attr: sum(getattr(s, attr) for s in last)  # noqa: E731
    t_total = sum(s.t_total for s in last)
    speedup = statistics.median(ratios)
    benchmark.extra_info.update({
        "model": desc, "blas": blas_in_use(), "kind": kind, "prompts": len(prompts),
        "max_tokens": max_tokens, "tokens": sum(map(len, outs)),
        "plain_tok_s": round(statistics.median(plain_rates), 2),
        "spec_tok_s": round(statistics.median(spec_rates), 2),
        "speedup": round(speedup, 3), "speedups": [round(r, 3) for r in ratios],
        "target": TARGET[kind], "target_met": speedup >= TARGET[kind],
        "accept": round(n("n_accept") / max(n("n_drafted"), 1), 4),
        "tokens_per_forward": round(n("n_tokens") / max(n("steps"), 1), 3),
        "draft_share": round(sum(s.t_draft for s in last) / t_total, 5),
        "rollback_share": round(sum(s.t_rollback for s in last) / t_total, 5),
        "plain_share": round(n("plain_steps") / max(n("steps"), 1), 3),
        "enter_leave_plain": [n("enter_plain"), n("leave_plain")],
        "verify_cost_rel": last[-1].policy["cost_rel"],   # learned from the steps of the runs
    })


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _generate_command(blas: str, cache_dir: Path, *extra: str) -> tuple[float, float, list[int], str]:
    """Wall and CPU seconds of ``ngram-spec generate`` on the free-writing prompt, end to end (the CPU time
    of the process and its re-executed child), its tokens and its BLAS."""
    free = next(p.text for p in mlx_cli.DEMO_PROMPTS if p.kind == "free writing")
    max_tokens = str(whole_number("NGRAM_SPEC_BENCH_TOKENS", 96))
    env = {**os.environ, "NGRAM_SPEC_CACHE_DIR": str(cache_dir)}
    cpu0, t0 = _children_cpu(), time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "mlx_backend.cli", "generate", "--prompt", free, "--max-tokens", max_tokens,
                          "--blas", blas, "--json", *extra], capture_output=True, text=True, env=env, timeout=900,
                         cwd=Path(__file__).parents[3])
    seconds, cpu = time.perf_counter() - t0, _children_cpu() - cpu0
    assert out.returncode == 0, out.stderr[-2000:]
    record = json.loads(out.stdout.splitlines()[-1])
    return seconds, cpu, record["tokens"], record["blas"]


@pytest.mark.parametrize("blas", ["bundled", "wheel"])
def test_bench_generate_default_vs_no_spec(benchmark, smollm2, blas, tmp_path):
    if blas == "wheel" and wheel_openblas() is None:
        pytest.skip("the ngsolve-openblas wheel is not installed")
    times = {"no_spec": [], "first": [], "later": []}
    cpu = {"no_spec": [], "first": [], "later": []}
    tokens, blas_used = {}, {}
    orders = list(itertools.permutations(times))
    n_round = iter(range(ROUNDS))
    later_cache = tmp_path / "later"   # the step costs of every earlier run, as on a user's machine
    no_spec_cache = tmp_path / "no-spec"
    _generate_command(blas, later_cache)   # untimed: the runs before the first "later" and "no_spec" ones
    _generate_command(blas, no_spec_cache, "--no-spec")

    def run(name, cache, *extra):
        seconds, cpu_seconds, tokens[name], blas_used[name] = _generate_command(blas, cache, *extra)
        times[name].append(seconds)
        cpu[name].append(cpu_seconds)

    def one_round():   # timed here per command; pytest-benchmark's own time is the whole round
        i = next(n_round)
        commands = {"first": (tmp_path / f"first{i}", ()),   # an empty cache: a first run on this machine
                    "later": (later_cache, ()), "no_spec": (no_spec_cache, ("--no-spec",))}
        for name in orders[i % len(orders)]:
            run(name, commands[name][0], *commands[name][1])

    benchmark.pedantic(one_round, rounds=ROUNDS, iterations=1)
    assert tokens["first"] == tokens["no_spec"] == tokens["later"], "default generate changed the greedy output"
    ratio = {k: [t / n for t, n in zip(times[k], times["no_spec"])] for k in ("first", "later")}
    cpu_ratio = {k: [t / n for t, n in zip(cpu[k], cpu["no_spec"])] for k in ("first", "later")}
    benchmark.extra_info.update({
        "blas": blas_used["later"], "model": smollm2[2], "machine": f"{os.cpu_count()} CPUs",
        "orders": [",".join(orders[i % len(orders)]) for i in range(ROUNDS)],
        "load_average": [round(x, 2) for x in os.getloadavg()], "tokens": len(tokens["no_spec"]),
        **{f"{k}_s": round(statistics.median(v), 2) for k, v in times.items()},
        **{f"{k}_vs_no_spec": round(statistics.median(v), 3) for k, v in ratio.items()},
        **{f"{k}_ratios": [round(r, 3) for r in v] for k, v in ratio.items()},
        **{f"{k}_cpu_s": round(statistics.median(v), 2) for k, v in cpu.items()},
        **{f"{k}_cpu_vs_no_spec": round(statistics.median(v), 3) for k, v in cpu_ratio.items()},
        "target": 1.03,
    })
