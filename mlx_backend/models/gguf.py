"""Load a llama-architecture GGUF file into mlx-lm's ``llama`` model (the default: SmolLM2-135M-Instruct).

mlx reads GGUF itself (``mx.load(path, return_metadata=True)``): F32/F16/BF16 tensors come back as
arrays, Q4_0/Q4_1/Q8_0 tensors as mlx affine-quantized triples ``name.weight`` (packed uint32),
``name.scales``, ``name.biases`` with group size 32, and the other ggml quant types (K-quants, ...)
dequantized to float16. This module maps llama.cpp's tensor names onto mlx-lm's, builds
``mlx_lm.models.llama.ModelArgs`` from the ``llama.*`` metadata, and undoes the one layout change
llama.cpp's converter makes: the rows of ``attn_q`` / ``attn_k`` are permuted so that each head's
rotary pairs are interleaved (``convert_hf_to_gguf.py: LlamaModel.permute``), while mlx-lm's llama
uses the Hugging Face layout (first half / second half of each head).

>>> import numpy as np
>>> w = np.arange(8).reshape(8, 1)               # one head of dim 8, Hugging Face row order
>>> permuted = llama_cpp_permute(w, n_head=1)    # what llama.cpp's converter stores
>>> permuted[:, 0].tolist()
[0, 4, 1, 5, 2, 6, 3, 7]
>>> unpermute_rope_rows(permuted, n_head=1)[:, 0].tolist()
[0, 1, 2, 3, 4, 5, 6, 7]
"""
from __future__ import annotations

import re
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models import llama

from mlx_backend.models.gguf_file import (GGUFError, default_model_path,  # noqa: F401  (gguf.read_gguf, ...)
                                         metadata_value, read_gguf)
from mlx_backend.models.tokenizer import tokenizer_from_metadata


# "quantized" keeps the file's Q4_0/Q4_1/Q8_0 tensors as mlx QuantizedLinear / QuantizedEmbedding;
# the others dequantize every weight to that float type (what a bandwidth-bound BLAS path wants).
DTYPES = {"quantized": None, "float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}

SUPPORTED_ARCHITECTURES = ("llama",)

# llama.cpp tensor name -> mlx-lm llama parameter path (``{i}`` = block index).
_TENSOR_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "blk.{i}.attn_norm": "model.layers.{i}.input_layernorm",
    "blk.{i}.ffn_norm": "model.layers.{i}.post_attention_layernorm",
    "blk.{i}.attn_q": "model.layers.{i}.self_attn.q_proj",
    "blk.{i}.attn_k": "model.layers.{i}.self_attn.k_proj",
    "blk.{i}.attn_v": "model.layers.{i}.self_attn.v_proj",
    "blk.{i}.attn_output": "model.layers.{i}.self_attn.o_proj",
    "blk.{i}.ffn_gate": "model.layers.{i}.mlp.gate_proj",
    "blk.{i}.ffn_up": "model.layers.{i}.mlp.up_proj",
    "blk.{i}.ffn_down": "model.layers.{i}.mlp.down_proj",
}
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")


def model_args(metadata: dict, tensors: dict[str, mx.array]) -> llama.ModelArgs:
    """mlx-lm ``llama.ModelArgs`` from the GGUF ``llama.*`` keys (llama.cpp's names, gguf spec)."""
    arch = metadata.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(
            f"unsupported GGUF architecture {arch!r}: this loader maps only "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}; for other models pass an mlx-lm model directory "
            "to --model (convert with: mlx_lm.convert --hf-path ...)"
        )
    p = f"{arch}."
    n_head = metadata_value(metadata, p + "attention.head_count")
    hidden = metadata_value(metadata, p + "embedding_length")
    rope_scaling = None
    scaling_type = metadata.get(p + "rope.scaling.type", "none")
    if scaling_type == "linear":
        rope_scaling = {"type": "linear", "factor": metadata_value(metadata, p + "rope.scaling.factor")}
    elif scaling_type != "none":
        raise GGUFError(f"unsupported rope scaling {scaling_type!r} (only none and linear are mapped)")
    return llama.ModelArgs(
        model_type="llama",
        hidden_size=hidden,
        num_hidden_layers=metadata_value(metadata, p + "block_count"),
        intermediate_size=metadata_value(metadata, p + "feed_forward_length"),
        num_attention_heads=n_head,
        num_key_value_heads=metadata_value(metadata, p + "attention.head_count_kv", n_head),
        head_dim=metadata_value(metadata, p + "attention.key_length", hidden // n_head),
        rms_norm_eps=metadata_value(metadata, p + "attention.layer_norm_rms_epsilon"),
        vocab_size=int(tensors["token_embd.weight"].shape[0]),
        rope_theta=metadata_value(metadata, p + "rope.freq_base", 10000.0),
        max_position_embeddings=metadata_value(metadata, p + "context_length", None),
        rope_scaling=rope_scaling,
        tie_word_embeddings="output.weight" not in tensors,
    )


def llama_cpp_permute(w, n_head: int):
    """llama.cpp's converter layout: per head, row ``2*i + h`` holds Hugging Face row ``h*d/2 + i``."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rope_rows(w, n_head: int):
    """Inverse of :func:`llama_cpp_permute`: back to the Hugging Face row order mlx-lm's llama uses."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _mlx_name(gguf_tensor: str) -> str:
    """``blk.3.attn_q.scales`` -> ``model.layers.3.self_attn.q_proj.scales``."""
    base, _, leaf = gguf_tensor.rpartition(".")
    block = _BLOCK.match(base)
    key, index = (f"blk.{{i}}.{block.group(2)}", block.group(1)) if block else (base, None)
    if key not in _TENSOR_NAMES:
        raise GGUFError(f"unexpected tensor {gguf_tensor!r} for a llama GGUF (no mlx-lm parameter for it)")
    return _TENSOR_NAMES[key].format(i=index) + "." + leaf


def default_dtype() -> str:
    """GGUF weights: kept quantized on a GPU (4x less to read per step), float32 on the CPU.

    On the CPU mlx's quantized matmul is slower than float32 under either BLAS (SmolLM2, one token:
    102 ms quantized vs 82 ms float32 with the bundled BLAS, 74 ms with OpenBLAS; docs/benchmarks.md).
    """
    return "quantized" if mx.default_device() == mx.gpu else "float32"


def load_gguf_model(path: str | Path | None = None, dtype: str | None = None) -> nn.Module:
    """mlx-lm llama ``Model`` with the weights of a GGUF file (default: SmolLM2-135M-Instruct Q4_1).

    ``dtype="quantized"`` keeps Q4_0/Q4_1/Q8_0 weights quantized (mlx ``QuantizedLinear`` /
    ``QuantizedEmbedding``, group size 32, float32 scales); ``"float32"`` / ``"float16"`` /
    ``"bfloat16"`` dequantize every weight to that type; None: :func:`default_dtype`.
    """
    dtype = dtype or default_dtype()
    _check_dtype(dtype)
    tensors, metadata = read_gguf(path if path is not None else default_model_path())
    return model_from_gguf(tensors, metadata, dtype)


def _check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")


def model_from_gguf(tensors: dict[str, mx.array], metadata: dict, dtype: str | None = None) -> nn.Module:
    """Build the model from ``read_gguf``'s output (see :func:`load_gguf_model`)."""
    dtype = dtype or default_dtype()
    _check_dtype(dtype)
    args = model_args(metadata, tensors)
    model = llama.Model(args)
    shapes = {name: p.shape for name, p in tree_flatten(model.parameters())}

    from tqdm import tqdm

    weights = {}
    quantized = {}  # mlx-lm module path -> {"group_size", "bits"}
    names = [n for n in tensors if not n.endswith((".scales", ".biases"))]  # those go with their weight
    for name in tqdm(names, desc=f"loading the model ({dtype})", unit="tensor", leave=False, disable=None):
        value = tensors[name]
        target = _mlx_name(name)
        if name[: -len(".weight")] + ".scales" in tensors:  # a quantized triple
            base = name[: -len(".weight")]
            # float32 scales/biases: llama.cpp computes in float32; a float16 dequantize would round
            scales, biases = (tensors[base + leaf].astype(mx.float32) for leaf in (".scales", ".biases"))
            q = _quantization(value, scales, shapes[target][-1])
            if DTYPES[dtype] is None:
                quantized[target[: -len(".weight")]] = q
                weights[target[: -len(".weight")] + ".scales"] = _rows(base, scales, args)
                weights[target[: -len(".weight")] + ".biases"] = _rows(base, biases, args)
            else:
                value = mx.dequantize(value, scales, biases, **q)
        value = _rows(name.rpartition(".")[0], value, args)
        if mx.issubdtype(value.dtype, mx.floating):
            value = value.astype(DTYPES[dtype] or mx.float32)
        weights[target] = value
        mx.eval(value)   # the work happens here, so the progress bar shows it
    if quantized:
        nn.quantize(model, class_predicate=lambda path, module: quantized.get(path, False))
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    model.eval()
    return model


def _quantization(packed: mx.array, scales: mx.array, in_features: int) -> dict:
    """Group size and bits of a quantized triple, read off its shapes (32-bit words, groups per row)."""
    return {"group_size": in_features // scales.shape[-1], "bits": packed.shape[-1] * 32 // in_features}


def _rows(base: str, value: mx.array, args: llama.ModelArgs) -> mx.array:
    """Undo llama.cpp's RoPE row permutation on ``attn_q`` / ``attn_k`` (rows = output dims)."""
    block = _BLOCK.match(base)
    part = block.group(2) if block else ""
    if part == "attn_q":
        return unpermute_rope_rows(value, args.num_attention_heads)
    if part == "attn_k":
        return unpermute_rope_rows(value, args.num_key_value_heads)
    return value


def load(path: str | Path | None = None, dtype: str | None = None):
    """``(model, tokenizer)`` like ``mlx_lm.load``, from a GGUF file (default: SmolLM2-135M-Instruct).

    ``dtype`` as in :func:`load_gguf_model` (None: :func:`default_dtype`, the faster one here). The
    tokenizer is an mlx-lm ``TokenizerWrapper`` built from the GGUF's tokenizer metadata.
    """
    dtype = dtype or default_dtype()
    _check_dtype(dtype)
    tensors, metadata = read_gguf(path if path is not None else default_model_path())
    return model_from_gguf(tensors, metadata, dtype), tokenizer_from_metadata(metadata)
