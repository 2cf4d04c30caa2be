"""Load a model for generation: a GGUF file (the default: SmolLM2-135M-Instruct) or an mlx-lm model
directory, optionally cast to another dtype."""
from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn


def load(path: str | Path | None = None, dtype: str | None = None):
    """``(model, tokenizer)`` like ``mlx_lm.load``: from a GGUF file (default: SmolLM2-135M-Instruct;
    :func:`mlx_backend.models.gguf.load`) or from an mlx-lm model directory, as ``--model`` loads them
    (:func:`load_model`). ``dtype``: a GGUF file's as in :func:`mlx_backend.models.gguf.load_gguf_model`; a
    directory is loaded as stored (None) or cast to float32, float16 or bfloat16."""
    from mlx_backend.models import gguf

    if path is not None and not Path(path).exists():   # a GGUF file or a directory, meant: say both
        raise FileNotFoundError(f"path {path}: no such file or directory (a .gguf file or an mlx-lm model directory)")
    if path is None or not Path(path).is_dir():
        return gguf.load(path, dtype)
    model, tokenizer, _ = load_model(str(path), dtype, flags=("path", "dtype"))
    return model, tokenizer


def load_model(model: str | None, dtype: str | None = None, *, flags: tuple[str, str] = ("--model", "--dtype")):
    """``(model, tokenizer, description)`` for ``--model``: None (SmolLM2), a .gguf file or an mlx-lm directory;
    errors name the model and dtype as ``flags`` (:func:`load`'s arguments: ``path``, ``dtype``)."""
    from mlx_backend.models import gguf

    model_flag, dtype_flag = flags
    if model is None or str(model).endswith(".gguf"):
        dtype = dtype or gguf.default_dtype()
        path = gguf.default_model_path() if model is None else Path(model)
        m, tokenizer = gguf.load(path, dtype)
        return m, tokenizer, f"{path.name} ({dtype})"
    if not (Path(model) / "config.json").is_file():   # a folder of something else (`--model docs`): not mlx-lm's
        raise FileNotFoundError(f"{model_flag} {model}: not a .gguf file or an mlx-lm model directory")
    from mlx_lm.utils import load

    try:
        m, tokenizer = load(model)
    except (ValueError, RuntimeError) as exc:  # mlx-lm's and mlx's errors for a config or weights they cannot read
        raise ValueError(f"{model_flag} {model}: mlx-lm cannot load this model directory: {exc}") from exc
    quantized = any(isinstance(mod, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, mod in m.named_modules())
    if dtype is None:
        return m, tokenizer, str(model)
    if dtype == "quantized" or quantized:
        raise ValueError(f"{dtype_flag} {dtype}: {model} is {'' if quantized else 'not '}quantized and mlx-lm loads "
                         f"it as stored; drop {dtype_flag}, or convert it first (mlx_lm.convert -q / --dequantize)")
    m.set_dtype(getattr(mx, dtype))  # every floating parameter (mlx.nn.Module.set_dtype)
    return m, tokenizer, f"{model} ({dtype})"
