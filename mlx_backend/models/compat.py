"""Compatibility matrix: speculative greedy vs mlx-lm's plain greedy on every mlx-lm architecture.

``python -m mlx_backend.models.compat [--out docs/compatibility.md] [ARCH ...]`` builds, for every
architecture module of the installed ``mlx_lm.models``, a tiny random model with mlx-lm's own
``Model`` / ``ModelArgs`` classes (:func:`tiny_config`: tiny widths, 4 layers, windows and chunks
of 8 tokens; weights from :func:`mlx_backend.models.tiny.randomize`), and runs on a repeating prompt
that wraps any window:

* plain: ``mlx_lm.generate.generate_step`` with an argmax sampler and the model's own cache;
* speculative, three ways: a scripted drafter that proposes plain's continuation with forced
  mistakes (drafts accepted and rejected at every length up to 6), the default drafter (``auto``:
  suffix match, else llama.cpp's lookup) with ``draft_max=4``, and the default cost-aware policy (``draft_max=None``, with the cost curve
  :data:`POLICY_COSTS` instead of a measurement).

Each architecture gets one verdict (:data:`VERDICTS`): ``identical``; ``near-tie`` (the first
difference is at a token whose top-2 log-probability gap in the plain run is below
:data:`NEAR_TIE`); ``refused`` (``RollbackUnsupported``, its message); ``plain fails``
(mlx-lm's own plain ``generate_step`` fails on the tiny model, its error); ``no tiny config`` (mlx-lm's classes reject the tiny
config, the error); ``DIVERGES`` / ``error`` (a bug of ours: never in a committed table).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import importlib
import io
import multiprocessing
import pkgutil
import platform
import sys
import time
import traceback
from pathlib import Path

import mlx.core as mx
import mlx_lm
import mlx_lm.models
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import CacheList, make_prompt_cache

from mlx_backend.decode.draft_policy import DEFAULT_K_MAX, DraftPolicy
from mlx_backend.decode.generate import SpecStats, ngram_speculative_generate_step
from mlx_backend.decode.rollback import RollbackUnsupported, VerifyCache
from mlx_backend.models.tiny import randomize

NEAR_TIE = 1e-3          # log-probability gap under which two top tokens count as tied (float32)
VOCAB = 64
PROMPT = [5, 6, 7, 8, 9, 10] * 3 + [5, 6]     # 20 tokens: wraps a window of 8, repeats for drafts
MAX_TOKENS = 24
#: verify cost c(S) / c(1) given to the default policy (a device where rows are cheap, so it drafts,
#: and a pipelining gain, so it enters and leaves plain mode); not measured per architecture, which
#: would take seconds each (tests/mlx_backend/models/test_mlx_compat.py runs the measured default too)
POLICY_COSTS = [1.0 + 0.1 * s for s in range(DEFAULT_K_MAX + 1)]
SCRIPT = [(6, None), (6, 2), (3, 0), (6, 5), (1, None), (0, None)]   # (drafts, forced-wrong index)
VERDICTS = ("identical", "near-tie", "refused", "plain fails", "no tiny config", "DIVERGES", "error")

#: Tiny values for config fields, by field name (mlx-lm's ModelArgs spell the same things alike).
TINY = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=2,
    num_key_value_heads=1, head_dim=16, num_hidden_layers=4, max_position_embeddings=4096,
    rope_theta=10000.0, rotary_dim=8, rms_norm_eps=1e-6, layer_norm_eps=1e-5, norm_eps=1e-5,
    # windows and chunks smaller than the prompt
    sliding_window=8, sliding_window_size=8, attention_window_size=8, window_size=8,
    attention_chunk_size=8, loop_window_size=8,
    sliding_window_pattern=2, full_attention_interval=2,
    # mixtures of experts
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=32, shared_expert_intermediate_size=32, n_shared_experts=1,
    first_k_dense_replace=1, n_group=1, topk_group=1, moe_topk=2, moe_top_k=2, num_shared_experts=1,
    # GatedDeltaNet / linear attention / SSM
    linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
    linear_value_head_dim=16, linear_conv_kernel_dim=4, conv_kernel=4, state_size=8,
    ssm_state_size=8, mamba_d_state=8, mamba_d_conv=4, mamba_n_heads=4, mamba_d_head=16,
    mamba_n_groups=1, n_groups=1, time_step_rank=4, expand=2, mamba_expand=2,
    # low-rank attention (MLA)
    q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
    # gpt-2 style names
    n_embd=32, n_head=2, n_layer=4, n_positions=4096, n_inner=64, n_ctx=4096, d_model=32,
    num_layers=4, num_heads=2, dim=32, n_heads=2, n_layers=4, n_kv_heads=1,
)
#: Size-like field names whose (non-tiny) defaults are shrunk: (substring, tiny value).
SHRINK = (("layers", 4), ("heads", 2), ("experts", 4), ("vocab", VOCAB), ("head_dim", 16),
          ("intermediate", 64), ("hidden", 32), ("size", 32), ("dim", 16), ("rank", 16))


def architectures() -> list[str]:
    """Every module of ``mlx_lm.models`` that defines ``Model`` and ``ModelArgs``."""
    names = []
    for info in pkgutil.iter_modules(mlx_lm.models.__path__):
        source = Path(mlx_lm.models.__path__[0], info.name + ".py")
        if source.exists() and "class Model(" in source.read_text() and "class ModelArgs" in source.read_text():
            names.append(info.name)
    return sorted(names)


#: A layer-type list for models that need one spelled out: sliding-window and full attention.
LAYER_TYPES = ["sliding_attention", "full_attention"] * (TINY["num_hidden_layers"] // 2)


def _tiny_value(name: str, default):
    if name in TINY:
        return TINY[name]
    if name == "layer_types" and default == []:
        return LAYER_TYPES
    if isinstance(default, int) and not isinstance(default, bool) and default > 64:
        for part, value in SHRINK:
            if part in name:
                return value
    return default


def tiny_config(module) -> dict:
    """A config for ``module.ModelArgs`` with every size-like field tiny (see :data:`TINY`), plus
    the module's entry in :data:`OVERRIDES`. A nested ``text_config`` gets a tiny config of the
    module's text-arguments class (``TextArgs``, ``TextConfig``, ...)."""
    name = module.__name__.rsplit(".", 1)[1]
    config = {**_tiny_fields(module.ModelArgs), "model_type": name}   # a checkpoint names its module
    nested = [cls for attr, cls in vars(module).items() if attr != "ModelArgs" and "Text" in attr
              and dataclasses.is_dataclass(cls)]
    for field in ("text_config", "llm_config", "language_config"):
        if field in config or any(f.name == field for f in dataclasses.fields(module.ModelArgs)):
            config[field] = {"model_type": name, **(_tiny_fields(nested[0]) if nested else {}),
                             **TINY, **(config.get(field) or {})}
    for key, value in OVERRIDES.get(name, {}).items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key] = {**config[key], **value}
        else:
            config[key] = value
    return config


def _tiny_fields(args_cls) -> dict:
    config = {}
    for f in dataclasses.fields(args_cls):
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        value = _tiny_value(f.name, default)
        if value is not None:
            config[f.name] = value
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            config[f.name] = _required_guess(f)
    return config


#: Per-architecture config fields the generic rule cannot guess, one entry per architecture: what its
#: class reads without a usable default (layer-type lists, per-layer tables, RoPE scaling dicts, widths
#: tied to each other). Values are those of a real checkpoint's config.json (or the class's own
#: defaults), scaled down: an entry describes a config such a checkpoint could have, never a way round
#: the code under test.
OVERRIDES: dict[str, dict] = {
    "afm7": dict(hidden_dim=32),   # hidden_dim is the model width (the guess 2 gave 1-wide heads)
    "dbrx": dict(ffn_config=dict(ffn_hidden_size=64, moe_num_experts=4, moe_top_k=2),
                 attn_config=dict(kv_n_heads=1, rope_theta=10000.0, clip_qkv=8.0)),
    "deepseek_v2": dict(rope_scaling=dict(   # its attention always reads yarn rope_scaling (V2-Lite's)
        type="yarn", factor=40, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1,
        mscale=0.707, mscale_all_dim=0.707)),
    "exaone4": dict(sliding_window_pattern="LLLG"),
    "exaone_moe": dict(is_moe_layer=[False, True, True, True]),   # one flag per layer (the first dense)
    "falcon_h1": dict(mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_chunk_size=8),
    "gemma3n": dict(text_config=dict(   # per-layer sparsity, AltUp / LAuReL widths (gemma-3n-E2B's shape)
        activation_sparsity_pattern=[0.95, 0.0, 0.0, 0.0], vocab_size_per_layer_input=64,
        hidden_size_per_layer_input=16, num_kv_shared_layers=2, rope_local_base_freq=10000.0,
        final_logit_softcapping=30.0, altup_num_inputs=4, altup_coef_clip=120.0,
        altup_correct_scale=True, altup_active_idx=0, laurel_rank=8)),
    "gemma4": dict(text_config=dict(num_kv_shared_layers=2)),   # the default 20 shared layers > 4 layers
    "gemma4_text": dict(num_kv_shared_layers=2),                # the same
    "glm_moe_dsa": dict(   # GLM-5's rope_parameters and router; its sparse indexer keeps 8 < the context
        rope_parameters=dict(rope_theta=1000000.0, rope_type="default"), index_head_dim=16,
        index_n_heads=2, index_topk=8, topk_method="noaux_tc", scoring_func="sigmoid",
        norm_topk_prob=True, routed_scaling_factor=2.5, moe_layer_freq=1),
    "granitemoehybrid": dict(layer_types=["mamba", "attention", "mamba", "attention"],
                             mamba_proj_bias=False, mamba_conv_bias=True, shared_intermediate_size=32,
                             embedding_multiplier=1.0, attention_multiplier=0.25,
                             logits_scaling=1.0, residual_multiplier=1.0),
    "hunyuan": dict(   # its RoPE always reads rope_scaling['alpha']; Hunyuan-Large's cross-layer KV sharing
        rope_scaling=dict(alpha=1000.0, factor=1.0, type="dynamic"), use_cla=True,
        cla_share_factor=2, use_qk_norm=True, use_mixed_mlp_moe=True, num_shared_expert=1),
    "jamba": dict(attn_layer_offset=1, attn_layer_period=2, expert_layer_offset=1,
                  expert_layer_period=2),
    "kimi_k3": dict(text_config=dict(   # its layers always read linear_attn_config (kimi_linear's entry)
        linear_attn_config=dict(kda_layers=[1, 2, 3], full_attn_layers=[4], num_heads=2, head_dim=16,
                                short_conv_kernel_size=4),
        num_experts_per_token=2)),   # the default 16 > 4 experts
    "kimi_linear": dict(linear_attn_config=dict(kda_layers=[1, 2, 3], full_attn_layers=[4],
                                                num_heads=2, head_dim=16, short_conv_kernel_size=4),
                        model_max_length=4096, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16),
    "lfm2": dict(full_attn_idxs=[1, 3], conv_L_cache=3, block_dim=32, block_multiple_of=16,
                 block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=False),
    "lfm2-vl": dict(text_config=dict(full_attn_idxs=[1, 3], conv_L_cache=3, conv_bias=False,
                                     block_dim=32, block_multiple_of=16, block_ffn_dim_multiplier=1.0,
                                     block_auto_adjust_ff_dim=False)),
    "lfm2_moe": dict(full_attn_idxs=[1, 3], conv_L_cache=3, num_dense_layers=1),
    # its MLP width is 256 * round(8/3 * n_embd / 256): 0 below n_embd 48 (256 here)
    "lille-130m": dict(n_embd=64, n_head=4, block_size=4096),
    "llama4": dict(text_config=dict(num_experts_per_tok=1, interleave_moe_layer_step=2)),
    "llama4_text": dict(no_rope_layers=[1, 1, 1, 0], num_experts_per_tok=1),
    # LongCat-Flash's MLA scales (with False mlx-lm leaves the attribute unset), its zero (identity) experts
    "longcat_flash": dict(
        mla_scale_q_lora=True, mla_scale_kv_lora=True, attention_method="MLA",
        zero_expert_type="identity", zero_expert_num=2, ffn_hidden_size=64, expert_ffn_hidden_size=32),
    "longcat_flash_ngram": dict(   # the same
        mla_scale_q_lora=True, mla_scale_kv_lora=True, attention_method="MLA",
        zero_expert_type="identity", zero_expert_num=2, ffn_hidden_size=64, expert_ffn_hidden_size=32),
    "mamba2": dict(num_heads=4, head_dim=16, time_step_limit=(0.0, float("inf")), time_step_rank=4),
    "mellum": dict(layer_types=["sliding_attention", "full_attention"] * 2,   # and RoPE per layer type
                   rope_parameters=dict(full_attention=dict(rope_theta=1000000.0, rope_type="default"),
                                        sliding_attention=dict(rope_theta=10000.0, rope_type="default"))),
    "mimo_v2_flash": dict(   # MiMo-V2-Flash's router, and its sliding-window layers' own heads and widths
        hybrid_layer_pattern=[1, 0, 1, 0], moe_layer_freq=[0, 1, 1, 1], topk_method="noaux_tc",
        scoring_func="sigmoid", norm_topk_prob=True, swa_head_dim=16, swa_v_head_dim=16,
        swa_num_attention_heads=2, swa_num_key_value_heads=1, swa_rope_theta=10000.0,
        partial_rotary_factor=0.5, add_swa_attention_sink_bias=True),
    "minicpm3": dict(rope_scaling=dict(   # its RoPE always reads longrope factors (one per rotated pair)
        type="longrope", original_max_position_embeddings=4096, short_factor=[1.0, 1.1, 1.2, 1.3],
        long_factor=[1.0, 1.5, 2.0, 3.0])),
    "ministral3": dict(rope_parameters=dict(rope_theta=10000.0, llama_4_scaling_beta=0.1,
                                            original_max_position_embeddings=4096),
                       layer_types=["sliding_attention", "full_attention"] * 2),
    "mistral4": dict(rope_parameters=dict(   # its forward always reads the llama-4 attention scaling (yarn)
        rope_type="yarn", rope_theta=10000.0, factor=128.0, original_max_position_embeddings=4096,
        beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0, llama_4_scaling_beta=0.1)),
    "muse_spark": dict(text_config=dict(   # sparse MLPs only (shared experts are refused), RoPE per layer
        num_shared_experts=0, rope_parameters=dict(rope_theta=500000.0),
        layer_rope_theta=[500000.0, 500000.0, 500000.0, 0.0], moe_hidden_size=16,
        final_logit_softcapping=30.0)),
    "nemotron-nas": dict(block_configs=[   # one block config per layer: attention, no-op, linear, no FFN
        dict(attention=dict(n_heads_in_group=2), ffn=dict(ffn_mult=2.0)),
        dict(attention=dict(no_op=True), ffn=dict(ffn_mult=2.0)),
        dict(attention=dict(replace_with_linear=True), ffn=dict(replace_with_linear=True)),
        dict(attention=dict(n_heads_in_group=1), ffn=dict(no_op=True))]),
    "nemotron_h": dict(hybrid_override_pattern=["M", "*", "M", "-"], mamba_num_heads=4,
                       mamba_head_dim=16, num_hidden_layers=4),
    "openelm": dict(num_transformer_layers=4, model_dim=32, head_dim=16, num_query_heads=[2] * 4,
                    num_kv_heads=[1] * 4, ffn_multipliers=[1.0] * 4, ffn_dim_divisor=16),
    # its forward sets the logits of its tokenizer's dummy ids 100256..100351 to -inf: a smaller vocabulary is
    # written out of bounds (the crash, exit -6/-11); the guess 2 for ff_intermediate_size gave a 1-wide MLP
    "phi3small": dict(vocab_size=100352, ff_intermediate_size=64, gegelu_limit=20.0),
    "plamo": dict(n_shared_head=2),   # query heads per KV head (KV heads = ceil(heads / it), tiled back)
    "qwen": dict(kv_channels=16),     # the head width, hidden_size / num_attention_heads
    "qwen3_vl": dict(text_config=dict(tie_word_embeddings=True)),
    "qwen3_vl_moe": dict(text_config=dict(tie_word_embeddings=True, decoder_sparse_step=1,
                                          mlp_only_layers=[], norm_topk_prob=True)),
    "recurrent_gemma": dict(block_types=["recurrent", "recurrent", "attention"], conv1d_width=4,
                            logits_soft_cap=30.0),
    "spark2_5": dict(rope_parameters=dict(   # RoPE per layer type
        full_attention=dict(rope_theta=1000000.0, rope_type="default"),
        sliding_attention=dict(rope_theta=10000.0, rope_type="default"))),
}

#: Why an architecture stays unchecked here, where its own error does not say: added to its detail.
UNCHECKED = {
    "prism_hadamard_qwen35": "a 2-bit Hadamard-rotated weight pack of qwen3_5 (its config is a packed "
                             "checkpoint's manifest: quantized modules with widths multiple of 128, sign "
                             "vectors); random tiny weights are no such pack. Its caches are qwen3_5's",
}


def _required_guess(f) -> object:
    """A value for a required field that :data:`TINY` does not name, from its annotation."""
    kind = str(f.type)
    if f.name == "layer_types":
        return LAYER_TYPES
    if "List" in kind or "list" in kind:
        return []
    if "Dict" in kind or "dict" in kind:
        return {}
    if "bool" in kind:
        return False
    if "float" in kind:
        return 1e-5 if "eps" in f.name else 1.0
    if "int" in kind:
        return 2
    if "str" in kind:
        return ""
    return None


def _first_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
    return text[:200].replace("|", "/")


def _failure(exc: BaseException) -> str:
    """:func:`_first_line`, and for a custom Metal kernel on a machine without Metal, the mlx-lm file
    that runs it (the innermost frame under ``mlx_lm``)."""
    text = _first_line(exc)
    if "No Metal back-end" in str(exc):
        root = Path(mlx_lm.__file__).parent
        files = [Path(frame.f_code.co_filename) for frame, _ in traceback.walk_tb(exc.__traceback__)]
        inside = [f.relative_to(root.parent).as_posix() for f in files if f.is_relative_to(root)]
        if inside:
            text += f" ({inside[-1]} runs a custom Metal kernel: Apple silicon only)"
    return text


class _Scripted:
    """Proposes plain's continuation following :data:`SCRIPT` (some drafts forced wrong)."""

    def __init__(self, truth):
        self.truth, self.calls = truth, 0

    def reset(self, prompt):
        self.n_prompt, self.n = len(prompt), len(prompt)

    def extend(self, tokens):
        self.n += len(tokens)

    def draft(self, n_max):
        n, wrong = SCRIPT[self.calls % len(SCRIPT)]
        self.calls += 1
        pos = self.n - self.n_prompt
        d = (self.truth[pos:pos + min(n, n_max)] + [0] * n)[:min(n, n_max)]
        if wrong is not None and wrong < len(d):
            d[wrong] = (d[wrong] + 1) % VOCAB
        return d


def _compare(plain: list[int], logprobs: list[mx.array], spec: list[int]) -> tuple[str, str]:
    for i, (a, b) in enumerate(zip(plain, spec)):
        if a != b:
            top2 = mx.sort(logprobs[i])[-2:].tolist()
            gap = top2[1] - top2[0]
            if gap < NEAR_TIE and logprobs[i][b].item() >= top2[0]:
                return "near-tie", f"token {i}: top-2 gap {gap:.2g}"
            return "DIVERGES", f"token {i}: plain {a}, speculative {b} (top-2 gap {gap:.3g})"
    if len(spec) != len(plain):
        return "DIVERGES", f"{len(spec)} tokens instead of {len(plain)}"
    return "identical", ""


def _cache_kinds(cache) -> str:
    names = []
    for c in cache:
        name = type(c).__name__ if not isinstance(c, CacheList) else \
            "CacheList(" + ", ".join(type(x).__name__ for x in c.caches) + ")"
        if name not in names:
            names.append(name)
    return ", ".join(names)


def build(arch: str, seed: int = 0):
    """A tiny random model of the mlx-lm architecture module ``arch`` (:func:`tiny_config`)."""
    module = importlib.import_module(f"mlx_lm.models.{arch}")
    mx.random.seed(seed)
    return randomize(module.Model(module.ModelArgs.from_dict(tiny_config(module))))


def check(arch: str, phase=lambda verdict_if_it_crashes: None) -> dict:
    """The verdict for one architecture (a dict: arch, verdict, detail, caches, rollback, counts).

    ``phase`` is told, before each stage, the verdict a crash of the process there would mean."""
    row = dict(arch=arch, verdict="error", detail="", caches="", rollback="")
    printed = io.StringIO()
    try:
        phase("no tiny config")
        with contextlib.redirect_stdout(printed):   # what a module prints before it exits
            model = build(arch)
        make = lambda: make_prompt_cache(model)
        row["caches"] = _cache_kinds(make())
        if not row["caches"]:
            return dict(row, verdict="no tiny config", detail="the tiny model has no layer with a cache")
    except SystemExit as exc:   # a module that exits when an optional package is missing
        said = printed.getvalue().strip().replace("|", "/")
        return dict(row, verdict="plain fails", detail=f"importing it exits ({exc.code}): it needs "
                    f"a package mlx-lm does not install" + (f" (it says: {said[:150]})" if said else ""))
    except Exception as exc:
        note = f"; {UNCHECKED[arch]}" if arch in UNCHECKED else ""
        return dict(row, verdict="no tiny config", detail=_first_line(exc) + note)
    try:
        phase("plain fails")
        out = list(generate_step(mx.array(PROMPT), model, max_tokens=MAX_TOKENS,
                                 sampler=lambda x: mx.argmax(x, axis=-1), prompt_cache=make()))
        plain, logprobs = [int(t) for t, _ in out], [lp for _, lp in out]
    except Exception as exc:
        return dict(row, verdict="plain fails", detail=_failure(exc))
    try:
        phase("error")
        vc = VerifyCache(model, make())
        row["rollback"] = _rollback_kind(vc)
        vc.close()
        verdicts, drafted, accepted = [], 0, 0
        for name, kwargs in (("scripted", dict(draft_max=6, drafter=_Scripted(plain))),
                             ("auto k=4", dict(draft_max=4)),
                             ("policy", dict(draft_max=None,
                                             draft_policy=DraftPolicy(POLICY_COSTS, plain_cost=0.95)))):
            stats = SpecStats()
            spec = [t for t, _, _ in ngram_speculative_generate_step(
                mx.array(PROMPT), model, max_tokens=MAX_TOKENS, prompt_cache=make(), stats=stats,
                **kwargs)]
            drafted, accepted = drafted + stats.n_drafted, accepted + stats.n_accept
            verdict, detail = _compare(plain, logprobs, spec)
            verdicts.append((VERDICTS.index(verdict), verdict, f"{name}: {detail}" if detail else ""))
        worst = max(verdicts)
        return dict(row, verdict=worst[1], detail="; ".join(v[2] for v in verdicts if v[2]),
                    drafted=drafted, accepted=accepted)
    except RollbackUnsupported as exc:
        return dict(row, verdict="refused", detail=_first_line(exc))
    except Exception as exc:
        return dict(row, verdict="error", detail=_first_line(exc))


_WHERE = {"no tiny config": "building the model", "plain fails": "in mlx-lm's generate_step",
          "error": "in speculative decoding"}


def _work(archs: list[str], send) -> None:
    for arch in archs:
        send.send(("row", check(arch, lambda verdict: send.send(("phase", verdict)))))


def start_method() -> str:
    """``spawn`` everywhere (the worker imports mlx and mlx-lm itself: a few seconds, once per worker). A forked
    child of a process that has evaluated anything with mlx hangs at its own first evaluation (mlx 0.32 on
    Linux: every architecture "timed out ... building the model" when the caller had run mlx before, a test
    process for one); on macOS this process has loaded Metal and the Objective-C runtime by now (importing
    ``mlx_lm.generate`` makes its generation stream), which a forked child cannot use safely either."""
    return "spawn"


def check_all(archs: list[str], timeout: float):
    """Yield :func:`check` of each architecture, run in a worker process (:func:`start_method`) that
    handles one architecture after another (sharing mlx's compiled kernels). A crash, or a stage that
    takes over ``timeout`` seconds, becomes that architecture's verdict (by the stage it happened in),
    and a new worker takes the rest."""
    ctx = multiprocessing.get_context(start_method())
    todo = list(archs)
    while todo:
        receive, send = ctx.Pipe(duplex=False)
        worker = ctx.Process(target=_work, args=(list(todo), send))
        worker.start()
        send.close()   # so that a dead worker reads as end of file here
        stage = "error"
        while todo:
            hung = not receive.poll(timeout)
            try:
                message = None if hung else receive.recv()
            except EOFError:
                message = None
            if message is None:
                if hung:
                    worker.kill()
                worker.join()
                how = f"timed out after {timeout:.0f} s" if hung else \
                    f"the process crashed (exit code {worker.exitcode})"
                yield dict(arch=todo.pop(0), verdict=stage, detail=f"{how} {_WHERE[stage]}",
                           caches="", rollback="")
                break
            kind, value = message
            if kind == "phase":
                stage = value
            else:
                todo.pop(0)
                yield value
        else:
            worker.join()
        receive.close()


def _rollback_kind(vc: VerifyCache) -> str:
    kinds = []
    if vc.trimmed:
        kinds.append("trim")
    if vc.rotating:
        kinds.append("ring")
    if vc.gdn:
        kinds.append("GDN record")
    if vc.conv:
        kinds.append("conv record")
    if vc.replayed:
        kind = "layer replay" if vc.layer_replay else "replay"
        kinds.append(kind + " (" + ", ".join(sorted(vc.replayed_layers)) + ")")
    return " + ".join(kinds)


def render(rows: list[dict], seconds: float) -> str:
    counts = {v: sum(r["verdict"] == v for r in rows) for v in VERDICTS}
    lines = [
        "# Compatibility with mlx-lm's architectures",
        "",
        f"Generated by `python -m mlx_backend.models.compat` on {datetime.date.today().isoformat()}: "
        f"mlx-lm {mlx_lm.__version__}, mlx {mx.__version__}, {platform.machine()} "
        f"({seconds:.0f} s). Do not edit by hand; rerun the command.",
        "",
        "Each architecture module of the installed `mlx_lm.models` is built as a tiny random model "
        "with mlx-lm's own classes (hidden 32, 4 layers, windows and chunks of 8 tokens, weights "
        "scaled so logits are peaked) and decoded greedily for "
        f"{MAX_TOKENS} tokens after a {len(PROMPT)}-token repeating prompt, plainly "
        "(`mlx_lm.generate.generate_step`, the model's own cache) and speculatively three ways "
        "(scripted drafts accepted and rejected, the default `auto` drafter with `draft_max=4`, the default "
        "policy). Verdicts: **identical** (all three equal plain token for token); **near-tie** "
        f"(the first difference is at a token whose top-2 log-probability gap is below {NEAR_TIE}); "
        "**refused** (speculation refuses with `RollbackUnsupported`: the reason); **plain fails** "
        "(mlx-lm's own plain `generate_step` fails on the tiny model on this machine: its error, "
        "a platform limit or a config the generic rule got wrong); **no tiny config** (mlx-lm's classes "
        "reject the generic tiny config: its error; the architecture is untested here, not refused). "
        "Rollback: `trim` (offset-addressed KV caches), `ring` (RotatingKVCache, exact "
        "single-step mask), `GDN record` (per-token GatedDeltaNet states, no second forward), "
        "`conv record` (a short conv's cache, its window, cut from the conv's recorded input, no second "
        "forward), "
        "`layer replay (layer classes)` (ArraysCache checkpoint restored and, on partial acceptance, "
        "only the decoder layers holding it re-run on the accepted tokens' recorded inputs: no second "
        "forward), `replay (layer classes)` (the same checkpoint, and the accepted tokens re-run "
        "through the whole model: a second forward on partial acceptance).",
        "",
        "| verdict | architectures |",
        "|---|---|",
    ]
    lines += [f"| {v} | {counts[v]} |" for v in VERDICTS if counts[v]]
    lines += ["", "| architecture | verdict | caches | rollback | drafts accepted / verified | detail |",
              "|---|---|---|---|---|---|"]
    for r in rows:
        acc = f"{r['accepted']} / {r['drafted']}" if "drafted" in r else ""
        lines.append(f"| {r['arch']} | {r['verdict']} | {r['caches']} | {r['rollback']} | {acc} | {r['detail']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mlx_backend.models.compat", description=__doc__.split("\n")[0])
    parser.add_argument("arch", nargs="*", help="architecture modules to check (default: all)")
    parser.add_argument("--out", help="write the markdown table here (default: print it)")
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="seconds per architecture (default 60); they run in a worker process")
    args = parser.parse_args(argv)
    archs = args.arch or architectures()
    t0 = time.perf_counter()
    rows = []
    for row in check_all(archs, args.timeout):
        arch = row["arch"]
        print(f"{arch:28s} {row['verdict']:18s} {row['detail'][:100]}", file=sys.stderr, flush=True)
        rows.append(row)
    text = render(rows, time.perf_counter() - t0)
    if args.out:
        from reference.atomic import atomic_write

        with atomic_write(args.out, "w") as f:   # no half-written table, no temporary left by Ctrl-C
            f.write(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
