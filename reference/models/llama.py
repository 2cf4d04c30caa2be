"""mlx-lm's ``llama`` architecture (``mlx_lm/models/llama.py``): attention-only, every layer a KV cache.

Config keys read: ``hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads,
head_dim, rms_norm_eps, vocab_size, rope_theta, rope_traditional, rope_scaling, tie_word_embeddings,
attention_bias, mlp_bias, layer_types, sliding_window``: a ``"sliding_attention"`` layer attends only
the last ``sliding_window`` tokens (:func:`~reference.models.attention.visible_keys`).
"""
from __future__ import annotations

from reference.models.attention import Attention
from reference.models.decoder import DecoderLayer, Model
from reference.models.mlp import MLP
from reference.models.rope import make_rope
from reference.models.weights import Weights


def is_linear_layer(i: int, config: dict) -> bool:
    """No recurrent layers in llama."""
    return False


def is_sparse_layer(i: int, config: dict) -> bool:
    """No mixture of experts in llama."""
    return False


def build(config: dict, weights: Weights, dtype) -> Model:
    """mlx-lm's llama ``Model``: every layer attention (windowed for ``"sliding_attention"``) and a SwiGLU
    MLP; the LM head is the embedding unless ``tie_word_embeddings`` is false (default true)."""
    layer_types = config.get("layer_types") or ["full_attention"] * config["num_hidden_layers"]
    if set(layer_types) - {"full_attention", "sliding_attention"}:
        raise ValueError(f"unknown llama layer types {sorted(set(layer_types))}; the reference knows "
                         f"full_attention and sliding_attention")
    n_heads = config["num_attention_heads"]
    n_kv_heads = config.get("num_key_value_heads") or n_heads
    head_dim = config.get("head_dim") or config["hidden_size"] // n_heads
    eps = config["rms_norm_eps"]
    rope = make_rope(head_dim, config.get("rope_theta", 10000), config.get("rope_traditional", False),
                     config.get("rope_scaling"))
    layers = []
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        layers.append(DecoderLayer(
            mixer=Attention(weights.group(p + "self_attn."), n_heads, n_kv_heads, head_dim, rope,
                            window=config["sliding_window"] if layer_types[i] == "sliding_attention" else None),
            mlp=MLP(weights.group(p + "mlp.")),
            input_norm=weights[p + "input_layernorm.weight"],
            post_norm=weights[p + "post_attention_layernorm.weight"],
        ))
    tie = config.get("tie_word_embeddings", True)
    return Model(config, dtype, weights["model.embed_tokens.weight"], layers, weights["model.norm.weight"],
                 None if tie else weights["lm_head.weight"], eps)
