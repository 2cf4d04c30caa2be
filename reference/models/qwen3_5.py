"""mlx-lm's ``qwen3_5`` architecture (``mlx_lm/models/qwen3_5.py``): Qwen3.5's text model.

The same hybrid stack as :mod:`reference.models.qwen3_next` (layer pattern, gated attention, gated
RMSNorm, MoE when ``num_experts > 0``, then on every layer) with separate GatedDeltaNet projections:
``in_proj_qkv`` (``[q | k | v]``), ``in_proj_z``, ``in_proj_b``, ``in_proj_a``. The config may nest the
text model under ``text_config``; rope settings come from ``rope_parameters`` when present.
"""
from __future__ import annotations

import numpy as np

from reference.models.decoder import DecoderLayer, Model
from reference.models.gated_delta import GatedDeltaNet
from reference.models.mlp import MLP, SparseMoe
from reference.models.ops import linear
from reference.models.qwen3_next import NORM_SUFFIXES, build_attention, gdn_args, is_linear_layer
from reference.models.weights import Weights

DEFAULT_ROPE_PARAMETERS = {"type": "default", "rope_theta": 100000, "partial_rotary_factor": 0.25}


class SplitGatedDeltaNet(GatedDeltaNet):
    """Qwen3.5's projections: ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``."""

    def __init__(self, w: Weights, **dims):
        super().__init__(w, **dims)
        self.in_proj_qkv, self.in_proj_z = w["in_proj_qkv.weight"], w["in_proj_z.weight"]
        self.in_proj_b, self.in_proj_a = w["in_proj_b.weight"], w["in_proj_a.weight"]

    def project(self, x):
        z = linear(x, self.in_proj_z).reshape(x.shape[0], self.n_v_heads, self.d_v)
        return linear(x, self.in_proj_qkv), z, linear(x, self.in_proj_b), linear(x, self.in_proj_a)


def text_config(config: dict) -> dict:
    """The text model's settings (``config["text_config"]`` if present, as ``qwen3_5.ModelArgs.from_dict``)."""
    return {"model_type": config["model_type"], **config.get("text_config", config)}


def rope_settings(c: dict) -> tuple[float, float, dict | None]:
    """``(partial_rotary_factor, rope_theta, rope_scaling)`` as ``TextModelArgs.__post_init__`` derives them."""
    rp = c.get("rope_parameters", DEFAULT_ROPE_PARAMETERS)
    if rp:
        return rp.get("partial_rotary_factor", 0.25), rp.get("rope_theta", 100000.0), rp
    return c.get("partial_rotary_factor", 0.25), c.get("rope_theta", 100000.0), c.get("rope_scaling")


def is_sparse_layer(i: int, config: dict) -> bool:
    """Qwen3.5's MoE variant has the sparse block on every layer (``qwen3_5.DecoderLayer``)."""
    return config.get("num_experts", 0) > 0


def sanitize(arrays: dict[str, np.ndarray], config: dict) -> dict[str, np.ndarray]:
    """mlx-lm's ``Model.sanitize``: text tensors only, named ``model.*`` / ``lm_head.*`` here (mlx-lm's
    ``language_model.`` prefix and Hugging Face's ``model.language_model.`` removed), ``mtp.`` dropped; for a
    Hugging Face checkpoint (conv kernel stored ``[C, 1, K]``) move the conv kernel axis and add 1 to the
    RMSNorm weights (stored as offsets from 1)."""
    renamed = {}
    for k, v in arrays.items():
        if k.startswith(("vision_tower", "model.visual")) or "mtp." in k:
            continue
        if k.startswith("model.language_model."):
            k = "model." + k[len("model.language_model."):]
        elif k.startswith("language_model."):
            k = k[len("language_model."):]
        renamed[k] = v
    arrays = renamed
    unsanitized = any("conv1d.weight" in k and v.shape[-1] != 1 for k, v in arrays.items())
    if unsanitized:
        for k, v in arrays.items():
            if "conv1d.weight" in k and v.shape[-1] != 1:
                arrays[k] = np.moveaxis(v, 2, 1)
            elif k.endswith(NORM_SUFFIXES) and v.ndim == 1:
                arrays[k] = v + 1
    return arrays


def build(config: dict, weights: Weights, dtype) -> Model:
    """mlx-lm's qwen3_5 ``Model`` (text part): :func:`is_linear_layer` picks a :class:`SplitGatedDeltaNet`
    or gated attention, :func:`is_sparse_layer` the MoE or a SwiGLU MLP; the LM head is separate unless
    ``tie_word_embeddings`` (default false)."""
    c = text_config(config)
    partial_rotary_factor, rope_theta, rope_scaling = rope_settings(c)
    layers = []
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        if is_linear_layer(i, c):
            mixer = SplitGatedDeltaNet(weights.group(p + "linear_attn."), **gdn_args(c))
        else:
            mixer = build_attention(weights.group(p + "self_attn."), c, partial_rotary_factor, rope_theta,
                                    rope_scaling)
        mlp_w = weights.group(p + "mlp.")
        mlp = (SparseMoe(mlp_w, c["num_experts_per_tok"], c.get("norm_topk_prob", True))
               if is_sparse_layer(i, c) else MLP(mlp_w))
        layers.append(DecoderLayer(mixer, mlp, weights[p + "input_layernorm.weight"],
                                   weights[p + "post_attention_layernorm.weight"]))
    tie = c.get("tie_word_embeddings", False)
    return Model(c, dtype, weights["model.embed_tokens.weight"], layers, weights["model.norm.weight"],
                 None if tie else weights["lm_head.weight"], c.get("rms_norm_eps", 1e-6))
