"""Verify cost of SmolLM2-135M for S = 1..8 rows, per weight dtype, under the BLAS this process loaded.

One forward of S tokens on top of a context of ``--context`` tokens, timed as the fastest of
``--repeats`` runs (the KV cache is trimmed back after each run; the minimum, because on a shared
machine other processes only ever add time; S values interleaved), printed relative to S = 1. Run it
twice to compare BLAS libraries::

    python benchmarks/smollm2_verify_cost.py
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 OPENBLAS_NUM_THREADS=1 \\
        python benchmarks/smollm2_verify_cost.py
"""
from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from mlx_backend.machine.blas import blas_in_use
from mlx_backend.models.gguf import DTYPES, read_gguf, default_model_path, model_from_gguf


def verify_cost(model, context: int, s_max: int, repeats: int) -> dict[int, float]:
    """Fastest seconds of one forward over S new tokens after ``context`` cached tokens.

    The S values are interleaved within each repeat, so a burst of load from other processes hits
    all of them alike; the first repeat only warms up (graph building, allocation).
    """
    cache = make_prompt_cache(model)
    mx.eval(model(mx.arange(1, context + 1)[None] % 1000 + 100, cache=cache))
    times = {s: [] for s in range(1, s_max + 1)}
    for _ in range(repeats + 1):
        for s in times:
            tokens = mx.arange(s)[None] + 500
            t0 = time.perf_counter()
            mx.eval(model(tokens, cache=cache))
            times[s].append(time.perf_counter() - t0)
            trim_prompt_cache(cache, s)
    return {s: min(t[1:]) for s, t in times.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", default=["quantized", "float32", "float16"], choices=list(DTYPES))
    parser.add_argument("--s-max", type=int, default=8, help="time S = 1..S_MAX new tokens (>= 1; default %(default)s)")
    parser.add_argument("--context", type=int, default=128, help="cached tokens before them (>= 1; default %(default)s)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per S, after one warm-up "
                                                               "(>= 1; default %(default)s)")
    parser.add_argument("--json", action="store_true", help="one JSON record per dtype")
    args = parser.parse_args(argv)
    for flag, value, what in (("--s-max", args.s_max, "the largest S timed"), ("--context", args.context, "cached tokens"),
                              ("--repeats", args.repeats, "timed runs per S")):
        if value < 1:   # before the model loads: no S, an empty context or no timed run has no cost to print
            parser.error(f"{flag} {value}: must be >= 1 ({what})")
    tensors, metadata = read_gguf(default_model_path())
    blas = blas_in_use()
    for dtype in args.dtypes:
        model = model_from_gguf(dict(tensors), metadata, dtype)
        cost = verify_cost(model, args.context, args.s_max, args.repeats)
        if args.json:
            print(json.dumps({"blas": blas, "dtype": dtype, "ms": {s: round(t * 1e3, 2) for s, t in cost.items()}}))
        else:
            row = "  ".join(f"S={s}: {t * 1e3:6.1f} ms ({t / cost[1]:.2f}x)" for s, t in cost.items())
            print(f"[{blas}] {dtype:9s} {row}", flush=True)


if __name__ == "__main__":
    main()
