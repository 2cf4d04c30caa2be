"""mlx-lm's ``qwen3_next`` architecture (``mlx_lm/models/qwen3_next.py``): the hybrid stack.

Layer i is a GatedDeltaNet when ``(i + 1) % full_attention_interval != 0``, else gated attention
(``Qwen3NextAttention``). The GatedDeltaNet's input projections are fused and grouped by key head:
``in_proj_qkvz`` gives, per key head, ``[q (Dk) | k (Dk) | v (r*Dv) | z (r*Dv)]`` with ``r = Hv/Hk``, and
``in_proj_ba`` gives ``[b (r) | a (r)]`` (``fix_query_key_value_ordering``). The feed-forward block is a
sparse MoE for layers with ``num_experts > 0``, ``(i+1) % decoder_sparse_step == 0`` and i not in
``mlp_only_layers``, else a SwiGLU MLP.
"""
from __future__ import annotations

import numpy as np

from reference.models.attention import Attention
from reference.models.decoder import DecoderLayer, Model
from reference.models.gated_delta import GatedDeltaNet
from reference.models.mlp import MLP, SparseMoe
from reference.models.ops import linear
from reference.models.rope import make_rope
from reference.models.weights import Weights

NORM_SUFFIXES = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
                 ".q_norm.weight", ".k_norm.weight")


class FusedGatedDeltaNet(GatedDeltaNet):
    """Qwen3-Next's projections: ``in_proj_qkvz``, ``in_proj_ba``, grouped by key head."""

    def __init__(self, w: Weights, **dims):
        super().__init__(w, **dims)
        self.in_proj_qkvz, self.in_proj_ba = w["in_proj_qkvz.weight"], w["in_proj_ba.weight"]

    def project(self, x):
        S, nk, dk, dv = x.shape[0], self.n_k_heads, self.d_k, self.d_v
        r = self.n_v_heads // nk
        qkvz = linear(x, self.in_proj_qkvz).reshape(S, nk, -1)
        ba = linear(x, self.in_proj_ba).reshape(S, nk, -1)
        q, k = qkvz[..., :dk], qkvz[..., dk:2 * dk]
        v, z = qkvz[..., 2 * dk:2 * dk + r * dv], qkvz[..., 2 * dk + r * dv:]
        qkv = np.concatenate([q.reshape(S, -1), k.reshape(S, -1), v.reshape(S, -1)], axis=-1)
        b, a = ba[..., :r].reshape(S, -1), ba[..., r:].reshape(S, -1)
        return qkv, z.reshape(S, self.n_v_heads, dv), b, a


def is_linear_layer(i: int, config: dict) -> bool:
    """mlx-lm's ``is_linear``: GatedDeltaNet unless ``(i + 1) % full_attention_interval == 0``."""
    return (i + 1) % config.get("full_attention_interval", 4) != 0


def is_sparse_layer(i: int, config: dict) -> bool:
    """Whether layer i's feed-forward block is the sparse MoE (``Qwen3NextDecoderLayer``)."""
    return (config.get("num_experts", 0) > 0 and i not in (config.get("mlp_only_layers") or ())
            and (i + 1) % config.get("decoder_sparse_step", 1) == 0)


def build_attention(w: Weights, c: dict, partial_rotary_factor: float, rope_theta: float, rope_scaling) -> Attention:
    """Gated attention (``Qwen3NextAttention``): q/k RMSNorm, an output gate, rope on the first
    ``head_dim * partial_rotary_factor`` dimensions of each head."""
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    rope = make_rope(int(head_dim * partial_rotary_factor), rope_theta, False, rope_scaling)
    return Attention(w, c["num_attention_heads"], c["num_key_value_heads"], head_dim, rope, gated=True,
                     eps=c.get("rms_norm_eps", 1e-6))


def gdn_args(c: dict) -> dict:
    """The GatedDeltaNet's head counts and sizes from the config's ``linear_*`` keys (``Qwen3NextGatedDeltaNet``)."""
    return dict(n_k_heads=c["linear_num_key_heads"], n_v_heads=c["linear_num_value_heads"],
                d_k=c["linear_key_head_dim"], d_v=c["linear_value_head_dim"], eps=c.get("rms_norm_eps", 1e-6))


def sanitize(arrays: dict[str, np.ndarray], config: dict) -> dict[str, np.ndarray]:
    """mlx-lm's ``Model.sanitize`` for Hugging Face checkpoints (per-expert tensors present): stack the experts,
    move the conv kernel axis (``[C, 1, K]`` -> ``[C, K, 1]``), and add 1 to the RMSNorm weights (stored as
    offsets from 1). A directory already in mlx-lm's format passes through unchanged."""
    moe_layers = sorted(int(k.split(".")[2]) for k in arrays
                        if k.startswith("model.layers.") and k.endswith(".mlp.experts.0.up_proj.weight"))
    if not moe_layers:
        return arrays
    arrays = {k: v for k, v in arrays.items() if "mtp." not in k}
    for layer in moe_layers:
        prefix = f"model.layers.{layer}.mlp"
        for n in ("up_proj", "down_proj", "gate_proj"):
            arrays[f"{prefix}.switch_mlp.{n}.weight"] = np.stack(
                [arrays.pop(f"{prefix}.experts.{e}.{n}.weight") for e in range(config["num_experts"])])
    for k, v in arrays.items():
        if "conv1d.weight" in k and v.shape[-1] != 1:
            arrays[k] = np.moveaxis(v, 2, 1)
        if k.endswith(NORM_SUFFIXES) and v.ndim == 1:
            arrays[k] = v + 1
    return arrays


def build(config: dict, weights: Weights, dtype) -> Model:
    """mlx-lm's qwen3_next ``Model``: :func:`is_linear_layer` picks a :class:`FusedGatedDeltaNet` or
    :func:`build_attention`, :func:`is_sparse_layer` the MoE or a SwiGLU MLP; the LM head is separate
    unless ``tie_word_embeddings`` (default false)."""
    c = config
    layers = []
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        if is_linear_layer(i, c):
            mixer = FusedGatedDeltaNet(weights.group(p + "linear_attn."), **gdn_args(c))
        else:
            mixer = build_attention(weights.group(p + "self_attn."), c, c["partial_rotary_factor"],
                                    c["rope_theta"], c.get("rope_scaling"))
        mlp_w = weights.group(p + "mlp.")
        mlp = (SparseMoe(mlp_w, c["num_experts_per_tok"], c.get("norm_topk_prob", False))
               if is_sparse_layer(i, c) else MLP(mlp_w))
        layers.append(DecoderLayer(mixer, mlp, weights[p + "input_layernorm.weight"],
                                   weights[p + "post_attention_layernorm.weight"]))
    tie = c.get("tie_word_embeddings", False)
    return Model(c, dtype, weights["model.embed_tokens.weight"], layers, weights["model.norm.weight"],
                 None if tie else weights["lm_head.weight"], c["rms_norm_eps"])
