"""Elementwise and normalisation primitives shared by the NumPy model layers.

Each function states the mlx / mlx-lm operation it mirrors. All take and return arrays of the
model's dtype (float32 or float64); nothing here keeps state.

Batch invariance: :func:`linear` multiplies one row at a time (a matrix-vector product per token)
instead of one matrix-matrix product for all rows. BLAS blocks a gemm differently for different
row counts, so ``x @ W.T`` on S rows does not round the same as S one-row products; row by row, a
token's output is bit-identical whether it is computed alone or inside a verify forward of S tokens.
That makes "speculative == greedy" an exact identity of the reference, not a near one.

>>> x = np.array([[3.0, 4.0]], dtype=np.float32)
>>> rms_norm(x, np.ones(2, np.float32), 0.0)
array([[0.84852815, 1.1313709 ]], dtype=float32)
"""
from __future__ import annotations

import numpy as np


def linear(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """``x @ weight.T (+ bias)`` for ``x [S, in]``, ``weight [out, in]`` (``mlx.nn.Linear``), row by row."""
    out = np.empty((x.shape[0], weight.shape[0]), dtype=x.dtype)
    for i, row in enumerate(x):
        out[i] = weight @ row
    if bias is not None:
        out += bias
    return out


def rms_norm(x: np.ndarray, weight: np.ndarray | None, eps: float) -> np.ndarray:
    """``x / sqrt(mean(x^2, last axis) + eps) * weight`` (``mx.fast.rms_norm``)."""
    y = x / np.sqrt(np.mean(np.square(x), axis=-1, keepdims=True) + x.dtype.type(eps))
    return y if weight is None else y * weight


def sigmoid(x: np.ndarray) -> np.ndarray:
    """``1 / (1 + exp(-x))`` (``mx.sigmoid``)."""
    return 1 / (1 + np.exp(-x))


def silu(x: np.ndarray) -> np.ndarray:
    """``x * sigmoid(x)`` (``mlx.nn.silu``)."""
    return x * sigmoid(x)


def softplus(x: np.ndarray) -> np.ndarray:
    """``log(1 + exp(x))`` computed as ``logaddexp(x, 0)`` (``mlx.nn.softplus``)."""
    return np.logaddexp(x, x.dtype.type(0))


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """``exp(x - max) / sum(exp(x - max))`` along ``axis`` (``mx.softmax(..., precise=True)``)."""
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return e / np.sum(e, axis=axis, keepdims=True)
