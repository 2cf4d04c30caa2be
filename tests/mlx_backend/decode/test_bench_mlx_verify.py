"""Benchmarks (``pytest --benchmark-only tests/mlx_backend/decode/test_bench_mlx_verify.py``) of the verify step on random
qwen3_5 models: the verify cost curve c(S) for S = 1..16, plain vs speculative generation side by
side (speedup at the measured acceptance), and rollback / drafting time relative to a step.

Every benchmark reports the BLAS that mlx ran on (``extra_info["blas"]``): the mlx-cpu wheel's
vendored reference BLAS, or OpenBLAS swapped in with ``LD_PRELOAD``.
"""
from __future__ import annotations

import functools
import random
import statistics
import time

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from mlx_backend.machine.blas import blas_in_use
from mlx_backend.decode.draft_policy import DraftPolicy
from mlx_backend.decode.generate import SpecStats, ngram_speculative_generate_step
from mlx_backend.decode.rollback import VerifyCache
from mlx_backend.models.tiny import tiny_model

# "tiny": the test model (per-call overhead dominates); "small": a ~40M-parameter qwen3_5 shape
# where the weights dominate, as for real models.
SIZES = {
    "tiny": dict(vocab_size=64),
    "small": dict(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=64, linear_num_value_heads=8,
                  linear_num_key_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
                  full_attention_interval=4),
}
S_VALUES = (1, 2, 3, 4, 6, 8, 12, 16)


@functools.cache
def model_of(size: str):
    return tiny_model("qwen3_5", seed=0, **SIZES[size])


def _info(benchmark, **kw):
    benchmark.extra_info.update(blas=blas_in_use(), device=str(mx.default_device()), **kw)


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("S", S_VALUES)
def test_bench_verify_forward(benchmark, size, S):
    """One verify forward of S tokens (recording for rollback) and keep(0); the cost curve c(S)."""
    model = model_of(size)
    cache = make_prompt_cache(model)
    model(mx.arange(64).reshape(1, -1) % 50, cache=cache)
    mx.eval([c.state for c in cache])
    vc = VerifyCache(model, cache)
    tokens = mx.arange(S, dtype=mx.uint32) % 50

    def verify():
        logits = vc.forward(tokens, record=True)
        mx.eval(logits, [c.state for c in cache])
        vc.keep(0)

    benchmark.group = f"verify-{size}"
    benchmark.pedantic(verify, rounds=8 if size == "small" else 30, warmup_rounds=2)
    _info(benchmark, size=size, S=S)
    vc.close()


class NoisyOracle:
    """Drafts the known plain continuation, each token replaced with probability ``1 - a`` (seeded):
    a drafter with acceptance about ``a`` per position on any model, random ones included."""

    def __init__(self, truth, a, seed=0):
        self.truth, self.a, self.rng = truth, a, random.Random(seed)

    def reset(self, prompt):
        self.n_prompt, self.n = len(prompt), len(prompt)

    def extend(self, tokens):
        self.n += len(tokens)

    def draft(self, k):
        pos = self.n - self.n_prompt
        return [t if self.rng.random() < self.a else t + 1 for t in self.truth[pos:pos + k]]


def _plain(model, prompt, n):
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n,
                                             sampler=lambda x: mx.argmax(x, axis=-1))]


def _spec(model, prompt, n, drafter_kind, truth, draft_max, stats=None):
    drafter = None if drafter_kind == "ngram" else NoisyOracle(truth, float(drafter_kind.split("-")[1]))
    gen = ngram_speculative_generate_step(mx.array(prompt), model, max_tokens=n, draft_max=draft_max,
                                          drafter=drafter, stats=stats)
    return [t for t, _, _ in gen]


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("drafter_kind", ["ngram", "oracle-0.7", "oracle-0.95"])
@pytest.mark.parametrize("draft_max", [None, 3])
def test_bench_speculative_vs_plain(benchmark, size, drafter_kind, draft_max):
    """Plain greedy and speculative greedy on the same prompt, timed alternately in one run.

    ``ngram``: the real n-gram drafter (a random model's output is not repetitive: acceptance ~0, so
    this shows the cost of trying); ``oracle-a``: drafts with per-token acceptance ~a. extra_info:
    tokens/s both ways, speedup, measured acceptance, tokens per forward, the chosen draft lengths,
    the pipelined plain mode (steps, entries / exits, c_p / c(1)), and rollback / drafting time per
    step relative to a step.
    """
    model = model_of(size)
    prompt = ([5, 6, 7, 8, 9, 10, 11, 12] * 6)[:44]
    n = 32 if size == "small" else 64
    truth = _plain(model, prompt, n)
    assert _spec(model, prompt, n, drafter_kind, truth, draft_max) == truth   # warm-up; the policy learns c(S) from these steps
    plain_t, spec_t = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        _plain(model, prompt, n)
        plain_t.append(time.perf_counter() - t0)
        stats = SpecStats()
        t0 = time.perf_counter()
        _spec(model, prompt, n, drafter_kind, truth, draft_max, stats)
        spec_t.append(time.perf_counter() - t0)
    benchmark.group = f"generate-{size}"
    benchmark.pedantic(lambda: _spec(model, prompt, n, drafter_kind, truth, draft_max), rounds=1,
                       warmup_rounds=0)
    step = min(spec_t) / stats.steps
    policy = stats.policy or {}
    _info(benchmark, size=size, drafter=drafter_kind, draft_max=str(draft_max),
          plain_tok_s=round(n / min(plain_t), 1), spec_tok_s=round(n / min(spec_t), 1),
          speedup=round(statistics.median(p / s for p, s in zip(plain_t, spec_t)), 3), accept=round(stats.accept, 1),
          tokens_per_forward=round(stats.tokens_per_forward, 3),
          draft_lengths=dict(stats.draft_lengths), cost_rel=policy.get("cost_rel"),
          plain_cost_rel=policy.get("plain_cost_rel"), plain_steps=stats.plain_steps,
          enter_leave_plain=[stats.enter_plain, stats.leave_plain],
          rollback_per_step_rel=round(stats.t_rollback / stats.steps / step, 4),
          draft_per_step_rel=round(stats.t_draft / stats.steps / step, 4))


@pytest.mark.parametrize("size", list(SIZES))
def test_bench_policy_prediction(benchmark, size):
    """The policy's predicted token rate E(n)/c(n+1) relative to plain, for acceptance 0.5 .. 0.95."""
    from mlx_backend.decode.draft_policy import measure_verify_cost
    costs = benchmark.pedantic(lambda: measure_verify_cost(model_of(size), 17, reps=2), rounds=1,
                               warmup_rounds=0)
    table = {}
    for a in (0.5, 0.7, 0.8, 0.9, 0.95):
        p = DraftPolicy(costs, prior=a)
        n = p.choose(16)
        table[a] = {"n": n, "predicted_speedup": round(p.expected_tokens(n) / p.costs[n] * p.costs[0], 3)}
    benchmark.group = f"policy-{size}"
    _info(benchmark, size=size, cost_rel=[round(c / costs[0], 3) for c in costs], by_acceptance=table)


@functools.cache
def granite_hybrid():
    """A ~30M-parameter granitemoehybrid (Mamba2 layers, one attention layer in four) with mlx-lm's init."""
    from mlx_lm.models import granitemoehybrid as g
    from mlx_backend.models.compat import tiny_config
    config = dict(tiny_config(g), vocab_size=32000, hidden_size=512, intermediate_size=1024,
                  shared_intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=2, mamba_n_heads=16, mamba_d_head=64, mamba_d_state=64,
                  layer_types=["mamba", "mamba", "mamba", "attention"] * 2)
    mx.random.seed(0)
    model = g.Model(g.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    return model


@pytest.mark.parametrize("S", [16, 32])
@pytest.mark.parametrize("replay", ["full", "layer"])
def test_bench_keep_replayed_layers(benchmark, replay, S):
    """keep(S // 2) after a verify forward of S tokens on a Mamba2 hybrid: the full replay (the model over
    the m kept tokens again) vs the layer-local one (only the Mamba2 layers, on their recorded input)."""
    model = granite_hybrid()
    tokens = mx.arange(S, dtype=mx.uint32) % 50
    prompt = mx.arange(64).reshape(1, -1) % 50
    state = {}

    def setup():
        cache = make_prompt_cache(model)
        model(prompt, cache=cache)
        vc = VerifyCache(model, cache, layer_replay=replay == "layer")
        mx.eval(vc.forward(tokens, record=True), [c.state for c in cache])
        state.update(vc=vc, cache=cache)

    def keep():
        state["vc"].keep(S // 2)
        mx.eval([c.state for c in state["cache"]])

    benchmark.group = f"keep-hybrid-S{S}"
    benchmark.pedantic(keep, setup=setup, rounds=8, warmup_rounds=1)
    assert state["vc"].n_layer_replays == (replay == "layer")
    _info(benchmark, S=S, replay=replay)


@pytest.mark.parametrize("mode", ["plain", "full replay", "layer replay"])
def test_bench_hybrid_decode(benchmark, mode, monkeypatch):
    """32 greedy tokens on the Mamba2 hybrid after a 16-token prompt: plain ``generate_step`` and
    speculative decoding with drafts of 8 that are wrong at their 5th token (5 tokens per forward, every
    step a partial acceptance), rolled back by the full replay and by the layer-local one. The
    speculative output is asserted equal to plain's."""
    from mlx_backend.decode import rollback
    from test_mlx_generate import ScriptedDrafter
    model, n = granite_hybrid(), 32
    prompt = [int(t) for t in mx.arange(16) % 50]
    plain = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n,
                                             sampler=lambda x: mx.argmax(x, axis=-1))]
    if mode == "full replay":
        monkeypatch.setattr(rollback, "layer_replay_qualifies", lambda model: False)
    out = {}

    def run():
        if mode == "plain":
            out["tokens"] = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n,
                                                              sampler=lambda x: mx.argmax(x, axis=-1))]
            return
        stats = SpecStats()
        out["tokens"] = [int(t) for t, _, _ in ngram_speculative_generate_step(
            mx.array(prompt), model, max_tokens=n, draft_max=8, stats=stats,
            drafter=ScriptedDrafter(plain, [(8, 4)]))]
        out["stats"] = stats

    benchmark.group = "hybrid-decode"
    benchmark.pedantic(run, rounds=3, warmup_rounds=1)
    assert out["tokens"] == plain
    _info(benchmark, mode=mode, tokens=n,
          steps=out["stats"].steps if "stats" in out else n,
          t_rollback_s=round(out["stats"].t_rollback, 3) if "stats" in out else 0.0)
