"""Depthwise causal conv1d of a GatedDeltaNet layer over ``[conv_state ; S new rows]``.

mlx-lm runs the GDN short convolution (``nn.Conv1d(C, C, K, groups=C)``) through the generic
grouped convolution for every S. For the few rows of a decode or verify step the same result is
K shifted multiply-adds over the ``K - 1 + S`` input rows:

    y[:, t, c] = sum_{j < K} w[c, j] * x[:, t + j, c]        for t < S

which is what :func:`conv1d_shifted` computes (in float32, cast back to the input dtype).

>>> x = mx.arange(12, dtype=mx.float32).reshape(1, 6, 2)   # K - 1 + S = 6 rows, C = 2
>>> w = mx.array([[[1.0], [0.0], [0.0], [1.0]], [[0.0], [0.0], [0.0], [2.0]]])  # [C, K, 1]
>>> conv1d_shifted(x, w).tolist()   # K = 4, so S = 3 outputs
[[[6.0, 14.0], [10.0, 18.0], [14.0, 22.0]]]
"""
from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

# Largest S for which the shifted form replaces the grouped convolution (a verify step
# drafts at most a few dozen tokens; prefill chunks keep mlx-lm's convolution).
SHIFTED_MAX_ROWS = 64


def conv1d_shifted(conv_input: mx.array, weight: mx.array) -> mx.array:
    """Depthwise valid convolution of ``conv_input [B, K-1+S, C]`` with ``weight [C, K, 1]``."""
    K = weight.shape[1]
    S = conv_input.shape[1] - K + 1
    x = conv_input.astype(mx.float32)
    w = weight[:, :, 0].astype(mx.float32)
    y = x[:, 0:S] * w[:, 0]
    for j in range(1, K):
        y = y + x[:, j:j + S] * w[:, j]
    return y.astype(conv_input.dtype)


def depthwise_conv1d(conv_input: mx.array, conv: nn.Conv1d) -> mx.array:
    """``conv(conv_input)`` for the layer's depthwise ``conv``: shifted form for small S."""
    K = conv.weight.shape[1]
    if conv_input.shape[1] - K + 1 <= SHIFTED_MAX_ROWS and "bias" not in conv:
        return conv1d_shifted(conv_input, conv.weight)
    return conv(conv_input)
