"""One rank of tests/mlx_backend/distributed/test_bench_distributed.py: ``mlx.launch -n 2 --backend ring -- python
tests/mlx_backend/distributed/dist_bench_worker.py MODE OUT``.

Shards the "small" random qwen3_5 of tests/mlx_backend/decode/test_bench_mlx_verify.py (same seed on every rank) with
mlx-lm's ``MODE`` sharding and times, alternately in each round, mlx-lm's plain ``generate_step``
on the shards, our generator in plain mode (``draft_max=0``) and speculative generation with a drafter
of per-token acceptance ~0.9 (``draft_max=3``). Collectives are counted by wrapping the
``mx.distributed`` functions the models and our sampler call (one count per collective built; in
decoding every one built is run). Rank 0 writes the figures to OUT (JSON).
"""
from __future__ import annotations

import json
import sys
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import generate_step

from mlx_backend.machine.blas import blas_in_use
from mlx_backend.distributed.sharded import settle, shard_model, sharded_generate_step
from mlx_backend.decode.generate import SpecStats
from mlx_backend.models.tiny import tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "decode"))  # the verify benchmark's models live there
from test_bench_mlx_verify import SIZES, NoisyOracle  # noqa: E402

COLLECTIVES = ("all_sum", "all_gather", "send", "recv", "recv_like", "all_max", "all_min", "sum_scatter")
PROMPT = ([5, 6, 7, 8, 9, 10, 11, 12] * 6)[:44]
N = 32
ROUNDS = 3


@contextmanager
def counting(counts: Counter):
    """Count every ``mx.distributed`` collective called while inside."""
    originals = {name: getattr(mx.distributed, name) for name in COLLECTIVES}

    def wrap(name, fn):
        def counted(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return counted

    for name, fn in originals.items():
        setattr(mx.distributed, name, wrap(name, fn))
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(mx.distributed, name, fn)


def main(mode: str, out_path: str) -> None:
    group = mx.distributed.init()
    model = shard_model(tiny_model("qwen3_5", seed=0, **SIZES["small"]), mode, group)
    greedy = lambda x: mx.argmax(x, axis=-1)   # noqa: E731
    truth = [int(t) for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=N, sampler=greedy)]

    def plain():
        return [int(t) for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=N, sampler=greedy)]

    def ours(draft_max, stats):
        drafter = NoisyOracle(truth, 0.9) if draft_max else None
        return [t for t, _, _ in sharded_generate_step(PROMPT, model, group=group, max_tokens=N, draft_max=draft_max,
                                                       drafter=drafter, stats=stats, timeout=600)]

    runs = {"mlx-lm plain": lambda s: plain(), "ours plain (draft_max=0)": lambda s: ours(0, s),
            "speculative (draft_max=3, acceptance ~0.9)": lambda s: ours(3, s)}
    times = {name: [] for name in runs}
    info = {}
    for r in range(ROUNDS + 1):   # round 0 warms up and counts
        for name, fn in runs.items():
            settle()
            stats, counts = SpecStats(), Counter()
            with counting(counts) if r == 0 else _nothing():
                t0 = time.perf_counter()
                tokens = fn(stats)
                settle()
                elapsed = time.perf_counter() - t0
            if r == 0:
                assert tokens == truth, (name, tokens, truth)
                forwards = stats.steps if stats.steps else N   # mlx-lm: one decode forward per token
                info[name] = {"collectives_per_token": round(sum(counts.values()) / N, 2),
                              "collectives": dict(counts), "decode_forwards": forwards,
                              "tokens_per_forward": round(N / forwards, 2)}
            else:
                times[name].append(elapsed)
    base = min(times["mlx-lm plain"])
    for name in runs:
        info[name].update(tok_s=round(N / min(times[name]), 2), speedup_vs_mlx_lm=round(base / min(times[name]), 3))
    if group.rank() == 0:
        with open(out_path, "w") as f:
            json.dump({"mode": mode, "ranks": group.size(), "tokens": N, "rounds": ROUNDS, "blas": blas_in_use(),
                       "model": "random qwen3_5 'small' (test_bench_mlx_verify.SIZES)", "runs": info}, f)


@contextmanager
def _nothing():
    yield


if __name__ == "__main__":
    main(*sys.argv[1:3])
