"""Rotary position embedding as ``mx.fast.rope`` computes it (``mlx.nn.RoPE``, mlx-lm's ``initialize_rope``).

The first ``dims`` features of each head are rotated; the rest pass through (Qwen3-Next's partial
rotary embedding). Position ``p`` rotates feature pair ``i`` (``0 <= i < dims/2``) by the angle
``scale * p * inv_freq[i]``, by default ``inv_freq[i] = base ** (-2i / dims)``. ``traditional=False``
pairs feature ``i`` with ``i + dims/2`` (rotate-half); ``traditional=True`` pairs ``2i`` with ``2i + 1``.

>>> rope = Rope(dims=2, base=10000.0)
>>> x = np.array([[[1.0, 0.0]]])             # one head, one position, dims 2
>>> np.round(rope(x, offset=1), 6)            # rotated by 1 radian
array([[[0.540302, 0.841471]]])
"""
from __future__ import annotations

import math

import numpy as np


class Rope:
    """``Rope(dims, base, traditional=False, scale=1.0, inv_freq=None)``; ``rope(x [H, S, D], offset)``
    rotates the S rows as positions ``offset, offset+1, ...``."""

    def __init__(self, dims: int, base: float, traditional: bool = False, scale: float = 1.0,
                 inv_freq: np.ndarray | None = None):
        self.dims, self.traditional, self.scale = dims, traditional, scale
        self.inv_freq = base ** (-np.arange(0, dims, 2, dtype=np.float64) / dims) if inv_freq is None else inv_freq

    def __call__(self, x: np.ndarray, offset: int) -> np.ndarray:
        half = self.dims // 2
        positions = self.scale * np.arange(offset, offset + x.shape[-2], dtype=np.float64)
        theta = (positions[:, None] * self.inv_freq[None, :]).astype(x.dtype)  # [S, dims/2]
        cos, sin = np.cos(theta), np.sin(theta)
        out = x.copy()
        if self.traditional:
            x1, x2 = x[..., 0:self.dims:2], x[..., 1:self.dims:2]
            out[..., 0:self.dims:2] = x1 * cos - x2 * sin
            out[..., 1:self.dims:2] = x1 * sin + x2 * cos
        else:
            x1, x2 = x[..., :half], x[..., half:self.dims]
            out[..., :half] = x1 * cos - x2 * sin
            out[..., half:self.dims] = x1 * sin + x2 * cos
        return out


def llama3_inv_freq(dims: int, base: float, scaling: dict) -> np.ndarray:
    """Llama 3's frequency rescaling (mlx-lm's ``Llama3RoPE``): wavelengths longer than
    ``original_max_position_embeddings / low_freq_factor`` are stretched by ``factor``, those shorter than
    ``.. / high_freq_factor`` kept, the ones between interpolated smoothly."""
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_context = scaling.get("original_max_position_embeddings", 8192)
    periods = base ** (np.arange(0, dims, 2, dtype=np.float64) / dims)
    wavelens = 2 * math.pi * periods
    periods = np.where(wavelens > old_context / low, periods * factor, periods)
    medium = (wavelens > old_context / high) & (wavelens < old_context / low)
    smooth = (old_context / wavelens - low) / (high - low)
    periods = np.where(medium, periods / ((1 - smooth) / factor + smooth), periods)
    return 1 / periods


def make_rope(dims: int, base: float, traditional: bool, scaling: dict | None) -> Rope:
    """The rope of mlx-lm's ``initialize_rope`` for the scaling types the reference supports.

    ``default`` / ``mrope`` (text-only: plain rope), ``linear`` (positions scaled by ``1/factor``) and
    ``llama3``; other types raise a ValueError naming the type.
    """
    rope_type = "default"
    if scaling is not None:
        rope_type = scaling.get("type") or scaling.get("rope_type", "default")
    if rope_type in ("default", "mrope"):
        return Rope(dims, base, traditional)
    if rope_type == "linear":
        return Rope(dims, base, traditional, scale=1.0 / scaling["factor"])
    if rope_type == "llama3":
        return Rope(dims, base, traditional, inv_freq=llama3_inv_freq(dims, base, scaling))
    raise ValueError(
        f"rope scaling type {rope_type!r} is not supported by the NumPy reference "
        "(supported: default, linear, llama3, mrope); use --backend mlx for this model")
