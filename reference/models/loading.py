"""Read a model directory in mlx-lm's format: ``config.json`` + ``model*.safetensors``, no mlx needed.

The tensors are read with the ``safetensors`` library's NumPy API and cast to the requested dtype
(float32 or float64); bfloat16 files are widened bit-exactly. Names follow mlx-lm's parameters
(``model.layers.{i}.linear_attn.in_proj_qkv.weight`` ...); a Hugging Face checkpoint of qwen3_5 /
qwen3_next is converted the way mlx-lm's ``sanitize`` does. Quantized checkpoints are refused.
"""
from __future__ import annotations

import glob
import json
import os
from pathlib import Path

import numpy as np

from reference.models import llama, qwen3_5, qwen3_next
from reference.models.decoder import Model
from reference.models.weights import Weights

ARCHITECTURES = {"llama": llama, "qwen3_5": qwen3_5, "qwen3_next": qwen3_next}


def read_safetensors(path: str) -> dict[str, np.ndarray]:
    """All tensors of one safetensors file as NumPy arrays (bfloat16 -> float32 by bit shift)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="numpy") as f:
            return {k: f.get_tensor(k) for k in f.keys()}
    except TypeError:  # numpy has no bfloat16: widen the raw 16-bit patterns
        return read_bfloat16_safetensors(path)
    except SafetensorError as exc:
        raise ValueError(f"{path}: not a readable safetensors file ({exc}); truncated or corrupt?") from None


def read_bfloat16_safetensors(path: str) -> dict[str, np.ndarray]:
    """safetensors layout: u64 header length, JSON header ``{name: {dtype, shape, data_offsets}}``, data."""
    raw = Path(path).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    dtypes = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I32": np.int32, "I64": np.int64,
              "U32": np.uint32, "U8": np.uint8, "BF16": np.uint16}
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in dtypes:
            raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        arr = np.frombuffer(raw, dtypes[info["dtype"]], offset=8 + n + start,
                            count=(end - start) // np.dtype(dtypes[info["dtype"]]).itemsize)
        if info["dtype"] == "BF16":
            arr = (arr.astype(np.uint32) << 16).view(np.float32)
        out[name] = arr.reshape(info["shape"])
    return out


def load_model(model_dir: str | os.PathLike, dtype=np.float32) -> Model:
    """The model in ``model_dir`` (mlx-lm format) as a NumPy :class:`~reference.models.decoder.Model`."""
    model_dir = Path(model_dir)
    dtype = np.dtype(dtype)
    if dtype not in (np.float32, np.float64):
        raise ValueError(f"dtype must be float32 or float64, got {dtype}")
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{model_dir} is not a model directory: no config.json "
                         "(make a tiny one with: ngram-spec tiny-model --arch qwen3_5 --out DIR)")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{config_path}: not valid JSON ({exc}); a model directory needs mlx-lm's "
                         "config.json") from None
    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ValueError(f"{config_path}: model_type {model_type!r} is not supported by the NumPy reference "
                         f"(supported: {', '.join(ARCHITECTURES)}); use --backend mlx")
    if "quantization" in config or "quantization_config" in config:
        raise ValueError(f"{config_path}: quantized models are not supported by the NumPy reference; "
                         "use an unquantized (float) checkpoint or --backend mlx")
    files = sorted(glob.glob(str(model_dir / "model*.safetensors")))
    if not files:
        raise ValueError(f"{model_dir}: no model*.safetensors weight files")
    arrays = {}
    for path in files:
        arrays.update(read_safetensors(path))
    arch = ARCHITECTURES[model_type]
    if hasattr(arch, "sanitize"):
        arrays = arch.sanitize(arrays, config)
    check_shapes(arrays, config.get("text_config", config), config_path, query_gate=model_type != "llama")
    arrays = {k: np.ascontiguousarray(v, dtype=dtype) for k, v in arrays.items()}
    return arch.build(config, Weights(arrays, str(model_dir)), dtype)


# (name suffix, axis, size): that axis of every tensor so named has the size config.json gives (a key of
# :func:`config_sizes`: a config key, or a product of them named by its keys).
HK_DK, HV_DV = "linear_num_key_heads x linear_key_head_dim", "linear_num_value_heads x linear_value_head_dim"
QUERY_AND_GATE = "2 x num_attention_heads x head_dim (a query and an output gate per head)"
_SHAPE_RULES = (
    ("embed_tokens.weight", 0, "vocab_size"), ("lm_head.weight", 0, "vocab_size"),
    ("embed_tokens.weight", 1, "hidden_size"), ("lm_head.weight", 1, "hidden_size"),
    ("layernorm.weight", 0, "hidden_size"), ("model.norm.weight", 0, "hidden_size"),
    ("_proj.weight", -1, "hidden_size"), ("in_proj_qkv.weight", -1, "hidden_size"),
    ("in_proj_qkvz.weight", -1, "hidden_size"), ("in_proj_ba.weight", -1, "hidden_size"),
    ("in_proj_z.weight", -1, "hidden_size"), ("in_proj_a.weight", -1, "hidden_size"),
    ("in_proj_b.weight", -1, "hidden_size"), ("mlp.gate.weight", -1, "hidden_size"),
    ("q_proj.weight", 0, "num_attention_heads x head_dim"), ("q_proj.weight", 0, QUERY_AND_GATE),
    ("k_proj.weight", 0, "num_key_value_heads x head_dim"), ("v_proj.weight", 0, "num_key_value_heads x head_dim"),
    ("linear_attn.A_log", 0, "linear_num_value_heads"), ("linear_attn.dt_bias", 0, "linear_num_value_heads"),
    ("in_proj_a.weight", 0, "linear_num_value_heads"), ("in_proj_b.weight", 0, "linear_num_value_heads"),
    ("in_proj_ba.weight", 0, "2 x linear_num_value_heads"), ("in_proj_z.weight", 0, HV_DV),
    ("in_proj_qkv.weight", 0, f"2 x {HK_DK} + {HV_DV}"), ("conv1d.weight", 0, f"2 x {HK_DK} + {HV_DV}"),
    ("in_proj_qkvz.weight", 0, f"2 x {HK_DK} + 2 x {HV_DV}"),
    ("linear_attn.norm.weight", 0, "linear_value_head_dim"), ("out_proj.weight", -1, HV_DV),
)
_OUTPUT_PROJECTIONS = ("o_proj.weight", "down_proj.weight", "out_proj.weight")  # hidden_size is their axis -2


def config_sizes(config: dict, query_gate: bool) -> dict[str, int]:
    """The sizes of :data:`_SHAPE_RULES` that config.json sets, as the architectures compute them (``head_dim``
    defaults to ``hidden_size // num_attention_heads``; ``query_gate``: ``q_proj`` also yields an output gate
    per head, as in qwen3_5 / qwen3_next)."""
    c = {k: v for k, v in config.items() if isinstance(v, int) and not isinstance(v, bool)}
    sizes = dict(c)
    heads = c.get("num_attention_heads")
    head_dim = c.get("head_dim") or (c["hidden_size"] // heads if heads and c.get("hidden_size") else None)
    if heads and head_dim:
        sizes[QUERY_AND_GATE if query_gate else "num_attention_heads x head_dim"] = heads * head_dim * (1 + query_gate)
        sizes["num_key_value_heads x head_dim"] = (c.get("num_key_value_heads") or heads) * head_dim
    linear = [c.get(k) for k in ("linear_num_key_heads", "linear_key_head_dim", "linear_num_value_heads",
                                 "linear_value_head_dim")]
    if all(linear):
        hk_dk, hv_dv = linear[0] * linear[1], linear[2] * linear[3]
        sizes.update({HK_DK: hk_dk, HV_DV: hv_dv, "2 x linear_num_value_heads": 2 * linear[2],
                      f"2 x {HK_DK} + {HV_DV}": 2 * hk_dk + hv_dv, f"2 x {HK_DK} + 2 x {HV_DV}": 2 * hk_dk + 2 * hv_dv})
    return sizes


def check_shapes(arrays: dict[str, np.ndarray], config: dict, config_path: Path, query_gate: bool = False) -> None:
    """Refuse weights that do not match config.json (mlx-lm refuses them when it loads): the vocabulary,
    hidden and dense MLP sizes, the attention heads (query, key/value), the GatedDeltaNet heads and head
    sizes and the number of layers, naming the first tensor that differs (``query_gate``: see
    :func:`config_sizes`). The architectures read the other sizes (the conv kernel, the experts) from the
    tensors themselves."""
    def refuse(name: str, shape, what: str):
        raise ValueError(f"{config_path}: config.json does not match the weights: tensor {name} has shape "
                         f"{tuple(shape)}, but {what}; use the config.json that came with these weights")

    sizes = config_sizes(config, query_gate)
    for name in sorted(arrays):
        shape = arrays[name].shape
        rules = [(axis, key) for suffix, axis, key in _SHAPE_RULES if name.endswith(suffix)]
        if name.endswith(_OUTPUT_PROJECTIONS):
            rules = [(axis, key) for axis, key in rules if key != "hidden_size"]
            rules.append((-2 if len(shape) > 1 else 0, "hidden_size"))
        if ".mlp.gate_proj." in name or ".mlp.up_proj." in name:
            rules.append((0, "intermediate_size"))
        if ".mlp.down_proj." in name:
            rules.append((1, "intermediate_size"))
        for axis, key in rules:
            want = sizes.get(key)
            if want is not None and -len(shape) <= axis < len(shape) and shape[axis] != want:
                refuse(name, shape, f"config.json's {key} is {want}")
    n_layers = config.get("num_hidden_layers")
    found = {int(k.split(".")[2]) for k in arrays if k.startswith("model.layers.")}
    if n_layers is not None and found != set(range(n_layers)):
        extra = sorted(found - set(range(n_layers)))
        if extra:
            raise ValueError(f"{config_path}: config.json does not match the weights: tensors of layer {extra[0]} "
                             f"exist, but config.json's num_hidden_layers is {n_layers}; use the config.json "
                             "that came with these weights")
