"""Rotary position embedding as ``mx.fast.rope`` computes it (``mlx.nn.RoPE``, mlx-lm's ``initialize_rope``).

The first ``dims`` features of each head are rotated; the rest pass through (Qwen3-Next's partial
rotary embedding). Frequency ``i`` (``0 <= i < dims/2``) is ``base ** (-2i / dims)`` and position ``p``
rotates by angle ``scale * p * freq_i``. ``traditional=False`` pairs feature ``i`` with ``i + dims/2``
(rotate-half); ``traditional=True`` pairs ``2i`` with ``2i + 1``.

>>> rope = Rope(dims=2, base=10000.0)
>>> x = np.array([[[1.0, 0.0]]])             # one head, one position, dims 2
>>> np.round(rope(x, offset=1), 6)            # rotated by 1 radian
array([[[0.540302, 0.841471]]])
"""
from __future__ import annotations

import numpy as np


class Rope:
    """``Rope(dims, base, traditional=False, scale=1.0)``; ``rope(x [H, S, D], offset)`` rotates positions offset.."""

    def __init__(self, dims: int, base: float, traditional: bool = False, scale: float = 1.0):
        self.dims, self.base, self.traditional, self.scale = dims, base, traditional, scale

    def __call__(self, x: np.ndarray, offset: int) -> np.ndarray:
        half = self.dims // 2
        freqs = self.base ** (-np.arange(0, self.dims, 2, dtype=np.float64) / self.dims)
        positions = self.scale * np.arange(offset, offset + x.shape[-2], dtype=np.float64)
        theta = (positions[:, None] * freqs[None, :]).astype(x.dtype)  # [S, dims/2]
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


def make_rope(dims: int, base: float, traditional: bool, scaling: dict | None) -> Rope:
    """The rope of mlx-lm's ``initialize_rope`` for the scaling types the reference supports.

    ``default`` / ``mrope`` (text-only: plain rope) and ``linear`` (positions scaled by ``1/factor``);
    other types raise a ValueError naming the type.
    """
    rope_type = "default"
    if scaling is not None:
        rope_type = scaling.get("type") or scaling.get("rope_type", "default")
    if rope_type in ("default", "mrope"):
        return Rope(dims, base, traditional)
    if rope_type == "linear":
        return Rope(dims, base, traditional, scale=1.0 / scaling["factor"])
    raise ValueError(
        f"rope scaling type {rope_type!r} is not supported by the NumPy reference "
        "(supported: default, linear, mrope); use --backend mlx for this model")
