"""Load a model for generation: a GGUF file (the default: SmolLM2-135M-Instruct) or an mlx-lm model
directory, optionally cast to another dtype."""
from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn


def load_model(model: str | None, dtype: str | None = None):
    """``(model, tokenizer, description)`` for ``--model``: None (SmolLM2), a .gguf file or an mlx-lm directory."""
    from mlx_backend.models import gguf

    if model is None or str(model).endswith(".gguf"):
        dtype = dtype or gguf.default_dtype()
        path = gguf.default_model_path() if model is None else Path(model)
        m, tokenizer = gguf.load(path, dtype)
        return m, tokenizer, f"{path.name} ({dtype})"
    if not Path(model).is_dir():
        raise FileNotFoundError(f"--model {model}: not a .gguf file or an mlx-lm model directory")
    from mlx_lm.utils import load

    try:
        m, tokenizer = load(model)
    except (ValueError, RuntimeError) as exc:  # mlx-lm's and mlx's errors for a config or weights they cannot read
        raise ValueError(f"--model {model}: mlx-lm cannot load this model directory: {exc}") from exc
    quantized = any(isinstance(mod, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, mod in m.named_modules())
    if dtype is None:
        return m, tokenizer, str(model)
    if dtype == "quantized" or quantized:
        raise ValueError(f"--dtype {dtype}: {model} is {'' if quantized else 'not '}quantized and mlx-lm loads it "
                         "as stored; drop --dtype, or convert it first (mlx_lm.convert -q / --dequantize)")
    m.set_dtype(getattr(mx, dtype))  # every floating parameter (mlx.nn.Module.set_dtype)
    return m, tokenizer, f"{model} ({dtype})"
