"""One rank of tests/mlx_backend/distributed/test_distributed.py: ``mlx.launch -n 2 --backend ring -- python tests/mlx_backend/distributed/dist_worker.py ARCH OUT``.

For each sharding mode mlx-lm offers for ARCH it builds the tiny model (same seed on every rank),
computes the single-process references on the whole model, shards it with mlx-lm's own method and
runs :func:`mlx_backend.distributed.sharded.sharded_generate_step` for draft lengths 0..8, the cost-aware
policy, and two sampled runs. Rank 0 writes everything the test asserts on to OUT (JSON); every
per-rank fact is all-gathered first (token hashes, logits bits), so OUT shows whether the ranks agree.
"""
from __future__ import annotations

import hashlib
import json
import sys

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler

from mlx_backend.distributed.sharded import settle, shard_model, sharded_generate_step
from mlx_backend.decode.generate import SpecStats, ngram_speculative_generate_step
from mlx_backend.models.tiny import tiny_model

VOCAB = 64
MAX_TOKENS = 20
PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]
MODES = {"qwen3_5": ("tensor", "pipeline"), "qwen3_next": ("pipeline",), "llama": ("tensor",)}
# heads must split over 2 ranks under mlx-lm's llama shard()
OVERRIDES = {"llama": dict(num_key_value_heads=2)}
TEMP = 0.2   # peaked enough that the greedy drafts are sometimes accepted
SEED = 7


class TruthDrafter:
    """Proposes the known greedy continuation, with the token at every output position p where
    ``p % 7 == 3`` made wrong, so steps see drafts accepted and rejected. Deterministic."""

    def __init__(self, truth):
        self.truth = list(truth)

    def reset(self, prompt):
        self.n_prompt, self.tokens = len(prompt), list(prompt)

    def extend(self, tokens):
        self.tokens.extend(tokens)

    def draft(self, n):
        pos = len(self.tokens) - self.n_prompt
        d = (self.truth[pos:pos + n] + [0] * n)[:n]
        return [(t + 1) % VOCAB if (pos + j) % 7 == 3 else t for j, t in enumerate(d)]


def all_ranks(value, group) -> list:
    """``value`` (JSON-able) hashed on each rank, all-gathered: one 32-bit word per rank."""
    settle()
    h = int.from_bytes(hashlib.blake2b(json.dumps(value).encode(), digest_size=4).digest(), "little")
    return mx.distributed.all_gather(mx.array([h], mx.uint32), group=group, stream=mx.cpu).tolist()


def run(arch: str, mode: str, group) -> dict:
    full = tiny_model(arch, vocab_size=VOCAB, seed=1, **OVERRIDES.get(arch, {}))
    plain = list(generate_step(mx.array(PROMPT), full, max_tokens=MAX_TOKENS,
                               sampler=lambda x: mx.argmax(x, axis=-1)))
    truth = [int(t) for t, _ in plain]
    gaps = [b - a for a, b in (mx.sort(lp)[-2:].tolist() for _, lp in plain)]
    mx.random.seed(SEED)
    ref_sampled = [int(t) for t, _, _ in ngram_speculative_generate_step(
        mx.array(PROMPT), full, max_tokens=MAX_TOKENS, sampler=make_sampler(TEMP), draft_max=3,
        drafter=TruthDrafter(truth))]
    full_logits = full(mx.array([PROMPT]))[0]

    model = shard_model(tiny_model(arch, vocab_size=VOCAB, seed=1, **OVERRIDES.get(arch, {})), mode, group)
    logits = model(mx.array([PROMPT]))[0]
    bits = all_ranks(logits.astype(mx.float32).tolist(), group)
    sharded_plain = [int(t) for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=MAX_TOKENS,
                                                       sampler=lambda x: mx.argmax(x, axis=-1))]
    out = {"arch": arch, "mode": mode, "truth": truth, "top2_gap": gaps, "sharded_plain": sharded_plain,
           "logits_bits_per_rank": bits,
           "max_abs_logit_diff_vs_single": float(mx.abs(logits - full_logits).max().item()), "runs": []}

    def spec(name, **kwargs):
        stats = SpecStats()
        tokens = [int(t) for t, _, _ in sharded_generate_step(PROMPT, model, max_tokens=MAX_TOKENS,
                                                              group=group, stats=stats, timeout=300, **kwargs)]
        out["runs"].append({"name": name, "tokens": tokens, "tokens_per_rank": all_ranks(tokens, group),
                            "n_drafted": stats.n_drafted, "n_accept": stats.n_accept, "steps": stats.steps})

    for k in range(9):
        spec(f"greedy k={k}", draft_max=k, drafter=TruthDrafter(truth))
    # the GDN rollback's other path (re-running the recurrence over the kept prefix), on the shards
    spec("greedy k=4, gdn_path=replay", draft_max=4, drafter=TruthDrafter(truth), gdn_path="replay")
    if mode == MODES[arch][0]:   # the policy measures verify costs: once per launch is enough
        spec("greedy policy, n-gram drafter", draft_max=None)
    mx.random.seed(SEED)
    spec("sampled, same seed on all ranks", draft_max=3, drafter=TruthDrafter(truth), sampler=make_sampler(TEMP))
    mx.random.seed(SEED + 1000 * group.rank())
    spec("sampled, other seeds on ranks > 0", draft_max=3, drafter=TruthDrafter(truth),
         sampler=make_sampler(TEMP))
    out["ref_sampled"] = ref_sampled
    return out


def main(arch: str, out_path: str) -> None:
    group = mx.distributed.init()
    results = [run(arch, mode, group) for mode in MODES[arch]]
    if group.rank() == 0:
        with open(out_path, "w") as f:
            json.dump({"size": group.size(), "results": results}, f)


if __name__ == "__main__":
    main(*sys.argv[1:3])
