"""Tiny random mlx-lm models built in memory (no files), for tests and benchmarks.

The models are the real mlx-lm classes (:data:`ARCHITECTURES`, :data:`WINDOWED`) with tiny
dimensions and seeded random weights; :func:`tiny_model` is all a test needs.

>>> model = tiny_model("qwen3_5", seed=0)
>>> type(model).__module__
'mlx_lm.models.qwen3_5'
>>> logits = model(mx.array([[1, 2, 3]]))
>>> logits.shape
(1, 3, 64)
"""
from __future__ import annotations

import importlib

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map

ARCHITECTURES = ("qwen3_5", "qwen3_next", "llama")   # the full-attention and hybrid models
WINDOWED = ("gemma3_text", "ministral3", "llama4")     # sliding-window and chunked attention

_COMMON = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2,
               num_key_value_heads=1, rms_norm_eps=1e-6)
_GDN = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
            linear_value_head_dim=16, linear_conv_kernel_dim=4, full_attention_interval=2,
            head_dim=16)
CONFIGS = {
    "qwen3_5": dict(model_type="qwen3_5", **_COMMON, **_GDN, num_hidden_layers=4,
                    tie_word_embeddings=False,
                    rope_parameters={"type": "default", "rope_theta": 10000,
                                     "partial_rotary_factor": 0.5}),
    "qwen3_next": dict(model_type="qwen3_next", **_COMMON, **_GDN, num_hidden_layers=4,
                       num_experts=0, num_experts_per_tok=0, decoder_sparse_step=1,
                       shared_expert_intermediate_size=0, mlp_only_layers=[],
                       moe_intermediate_size=0, rope_theta=10000.0,
                       partial_rotary_factor=0.5, max_position_embeddings=4096),
    "llama": dict(model_type="llama", **_COMMON, num_hidden_layers=2, head_dim=16,
                  tie_word_embeddings=True),
    # sliding-window attention (RotatingKVCache): local layers, then one global layer
    "gemma3_text": dict(model_type="gemma3_text", **_COMMON, num_hidden_layers=3, head_dim=16,
                        query_pre_attn_scalar=16, sliding_window=8, sliding_window_pattern=3),
    "ministral3": dict(model_type="ministral3", **_COMMON, num_hidden_layers=2, head_dim=16,
                       layer_types=["sliding_attention", "full_attention"], sliding_window=8,
                       rope_parameters={"rope_theta": 10000.0, "llama_4_scaling_beta": 0.1,
                                        "original_max_position_embeddings": 4096}),
    # chunked attention (ChunkedKVCache) in 3 of every 4 layers
    "llama4": dict(model_type="llama4", text_config=dict(
        model_type="llama4_text", **_COMMON, num_hidden_layers=4, head_dim=16, attention_bias=False,
        attention_chunk_size=8, interleave_moe_layer_step=2, intermediate_size_mlp=64,
        max_position_embeddings=4096, num_experts_per_tok=1, num_local_experts=2,
        rope_scaling=None, rope_theta=10000.0, use_qk_norm=True)),
}


def tiny_model(arch: str, *, vocab_size: int = 64, seed: int = 0, dtype=mx.float32,
               logit_scale: float = 4.0, **overrides) -> nn.Module:
    """A random ``arch`` model (one of :data:`ARCHITECTURES` or :data:`WINDOWED`) from mlx-lm's own ``Model`` class.

    Weights are drawn with ``mx.random.seed(seed)`` (:func:`randomize`). ``overrides`` change
    config fields.
    """
    if arch not in CONFIGS:
        raise ValueError(f"unknown architecture {arch!r}; choose one of {ARCHITECTURES + WINDOWED}")
    config = {**CONFIGS[arch], "vocab_size": vocab_size, **overrides}
    if "text_config" in config:
        config["text_config"] = {**config["text_config"], "vocab_size": vocab_size}
    module = importlib.import_module(f"mlx_lm.models.{arch}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    return randomize(model, logit_scale=logit_scale, dtype=dtype)


def randomize(model: nn.Module, *, logit_scale: float = 4.0, dtype=mx.float32) -> nn.Module:
    """Redraw every floating-point weight of ``model`` from the global mlx seed and sharpen its output.

    mlx-lm's random init leaves GDN decay/gates in a narrow range; matrices become normal with
    variance 1 / fan-in, vectors uniform in [-1, 1], so states, gates and convolutions all carry
    signal; ``logit_scale`` multiplies the output layer so the next-token distribution is peaked
    rather than flat (fewer near-ties in greedy decoding).
    """
    params = tree_map(lambda p: p if not mx.issubdtype(p.dtype, mx.floating) else
                      mx.random.normal(p.shape) * (p.shape[-1] ** -0.5) if p.ndim > 1
                      else mx.random.uniform(-1, 1, p.shape), model.parameters())
    model.update(params)
    head = getattr(model, "lm_head", None)
    if isinstance(head, mx.array):     # the output matrix as a bare parameter (talkie's lm_head)
        model.lm_head = head * logit_scale
    else:
        out = _output_layer(model)
        out.weight = out.weight * logit_scale
    if dtype != mx.float32:
        model.set_dtype(dtype, predicate=getattr(model, "cast_predicate", None))
    mx.eval(model.parameters())
    return model


def _output_layer(model: nn.Module) -> nn.Module:
    """The module whose weight produces the logits: ``lm_head`` (or another output head's name),
    else the tied input embedding (``embed_tokens``, ``embeddings``, ``wte``, ...). (A model whose
    ``lm_head`` is a bare array rather than a module is handled by :func:`randomize` itself.)"""
    modules = dict(tree_flatten(model.leaf_modules(), is_leaf=lambda m: isinstance(m, nn.Module)))
    for suffix in _OUTPUT_NAMES:
        for name, module in modules.items():
            if name.split(".")[-1] == suffix and hasattr(module, "weight"):
                return module
    raise ValueError(f"model has no output layer named one of {_OUTPUT_NAMES}")


_OUTPUT_NAMES = ("lm_head", "output", "embed_out", "embed_tokens", "embeddings", "wte",
                 "tok_embeddings", "token_embeddings", "word_embeddings", "embedding", "emb")
