"""One rank of tests/mlx_backend/distributed/test_distributed.py's layer-replay tests: ``mlx.launch -n 2 --backend ring
-- python tests/mlx_backend/distributed/replay_worker.py ARCH MODE FORCE``.

Builds the tiny mlx-lm model ARCH (same seed on every rank), shards it (MODE: tensor or pipeline), decodes
16 greedy tokens plainly on the shards, then speculatively with drafts of that output made wrong at every
output position p with p % 7 == 3. FORCE ``rank1-differs``: rank 1's layer-replay check finds other caches
than the full replay (its forwards still run). Each rank prints one JSON line: the tokens equal, the drafts
accepted and verified, and whether it used the layer replay.
"""
from __future__ import annotations

import json
import sys

import mlx.core as mx
from mlx_lm.generate import generate_step

from mlx_backend.decode import rollback
from mlx_backend.decode.generate import SpecStats
from mlx_backend.distributed.sharded import shard_model, sharded_generate_step
from mlx_backend.models.compat import build

from dist_worker import TruthDrafter   # right except at every output position p with p % 7 == 3

PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]
MAX_TOKENS = 16


def main(arch: str, mode: str, force: str) -> None:
    group = mx.distributed.init()
    model = shard_model(build(arch, seed=1), mode, group)
    plain = [int(t) for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=MAX_TOKENS,
                                             sampler=lambda x: mx.argmax(x, axis=-1))]
    if force == "rank1-differs" and group.rank() == 1:
        rollback._same_caches = lambda mine, theirs: False
    stats = SpecStats()
    spec = [int(t) for t, _, _ in sharded_generate_step(mx.array(PROMPT), model, group=group, draft_max=4,
                                                          max_tokens=MAX_TOKENS, drafter=TruthDrafter(plain),
                                                          stats=stats, timeout=120)]
    sys.stdout.write(json.dumps({"rank": group.rank(), "equal": spec == plain, "n_drafted": stats.n_drafted,
                                 "n_accept": stats.n_accept, "layer_replay": rollback.layer_replay_qualifies(model)})
                     + "\n")   # one write: the other rank's line cannot land inside it (see test_distributed.launch)


if __name__ == "__main__":
    main(*sys.argv[1:4])
