"""Per-token time of plain decoding three ways on SmolLM2, interleaved: mlx-lm's ``generate_step``
(pipelined with ``mx.async_eval``), ``ngram_speculative_generate_step`` with ``draft_max=0`` (the
speculative loop drafting nothing) and with the cost-aware policy, on the free-writing demo prompt.
The gap between the first two is the loop's fixed cost per step, which a free-writing run pays
when the policy drafts nothing.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 OPENBLAS_NUM_THREADS=1 \\
        python benchmarks/smollm2_step_overhead.py
"""
from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler

from mlx_backend.cli import demo as cli
from mlx_backend.decode.generate import SpecStats, ngram_speculative_generate_step
from mlx_backend.cli.prompts import prompt_tokens
from mlx_backend.machine.blas import blas_in_use
from mlx_backend.models.loading import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default=None, help="GGUF weights (default: the CLI's choice for this BLAS)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    model, tokenizer, desc = load_model(None, args.dtype)
    prompt = mx.array(prompt_tokens(tokenizer, cli.DEMO_PROMPTS[-1].text))
    greedy = make_sampler(0.0)
    ways = {
        "mlx_lm.generate_step": lambda: generate_step(prompt, model, max_tokens=args.max_tokens, sampler=greedy),
        "spec loop, draft_max=0": lambda: ngram_speculative_generate_step(
            prompt, model, max_tokens=args.max_tokens, sampler=greedy, draft_max=0),
        "spec loop, auto": lambda: ngram_speculative_generate_step(
            prompt, model, max_tokens=args.max_tokens, sampler=greedy, stats=SpecStats()),
    }
    times = {name: [] for name in ways}
    for _ in range(args.rounds + 1):  # the first round warms up
        for name, make in ways.items():
            t0 = time.perf_counter()
            n = sum(1 for _ in make())
            times[name].append((time.perf_counter() - t0) / n)
    print(f"{desc}, BLAS: {blas_in_use()}, {args.max_tokens} tokens, median of {args.rounds} rounds")
    base = statistics.median(times["mlx_lm.generate_step"][1:])
    for name, ts in times.items():
        t = statistics.median(ts[1:])
        print(f"  {name:24s} {t * 1e3:7.1f} ms/token  ({t / base:.3f}x)")


if __name__ == "__main__":
    main()
