"""Benchmark (``pytest --benchmark-only tests/mlx_backend/distributed/test_bench_distributed.py``): speculation on a model
sharded over 2 local ranks (``mlx.launch -n 2 --backend ring``), tensor and pipeline parallel.

The ranks (:mod:`tests.dist_bench_worker`) time mlx-lm's plain ``generate_step`` on the shards, our
generator in plain mode and speculative generation (acceptance ~0.9, ``draft_max=3``) alternately in
each round, and count the collectives per generated token, the figure that matters on a real
network, where each one costs a round trip. extra_info holds the worker's JSON; the benchmark's
own time is the whole launch.
"""
from __future__ import annotations

import json

import pytest

from test_distributed import launch


@pytest.mark.parametrize("mode", ["tensor", "pipeline"])
def test_bench_sharded_speculation(benchmark, mode, tmp_path):
    out = tmp_path / "bench.json"
    proc = benchmark.pedantic(launch, args=(["tests/mlx_backend/distributed/dist_bench_worker.py", mode, str(out)], tmp_path),
                              rounds=1, iterations=1)
    assert out.exists(), f"the launch wrote no result:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    data = json.loads(out.read_text())
    benchmark.group = "sharded-2-ranks"
    benchmark.extra_info.update(data)
    runs = data["runs"]
    spec = runs["speculative (draft_max=3, acceptance ~0.9)"]
    assert spec["tokens_per_forward"] > 1.5
    assert spec["collectives_per_token"] < runs["mlx-lm plain"]["collectives_per_token"]
