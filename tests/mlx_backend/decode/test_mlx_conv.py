"""The shifted multiply-add depthwise conv equals mlx-lm's grouped ``nn.Conv1d`` (the GDN conv)."""
from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from hypothesis import given, settings, strategies as st

from mlx_backend.decode.conv import SHIFTED_MAX_ROWS, conv1d_shifted, depthwise_conv1d
from mlx_backend.models.tiny import tiny_model

# float32: the K products are summed in float32 either way; bfloat16 inputs are computed in float32
# and rounded once, as mlx's convolution does.
TOL = {mx.float32: 1e-6, mx.bfloat16: 1e-2, mx.float16: 1e-3}


def grouped_conv(C, K, dtype, seed):
    mx.random.seed(seed)
    conv = nn.Conv1d(C, C, K, groups=C, padding=0, bias=False)
    conv.weight = mx.random.normal(conv.weight.shape)
    conv.set_dtype(dtype)
    return conv


@settings(max_examples=40, deadline=None)
@given(C=st.integers(1, 80), K=st.integers(1, 5), S=st.integers(1, 20), B=st.integers(1, 2),
       dtype=st.sampled_from(list(TOL)), seed=st.integers(0, 2**16))
def test_shifted_equals_grouped_conv(C, K, S, B, dtype, seed):
    conv = grouped_conv(C, K, dtype, seed)
    x = mx.random.normal((B, K - 1 + S, C)).astype(dtype)
    want = conv(x)
    got = conv1d_shifted(x, conv.weight)
    assert got.shape == want.shape == (B, S, C) and got.dtype == want.dtype
    assert mx.allclose(got.astype(mx.float32), want.astype(mx.float32), atol=TOL[dtype], rtol=TOL[dtype]).item()


def test_dispatch_uses_grouped_conv_for_long_inputs():
    conv = grouped_conv(8, 4, mx.float32, 0)
    x = mx.random.normal((1, 3 + SHIFTED_MAX_ROWS + 1, 8))
    assert mx.array_equal(depthwise_conv1d(x, conv), conv(x)).item()
    short = x[:, :3 + SHIFTED_MAX_ROWS]
    assert mx.allclose(depthwise_conv1d(short, conv), conv(short), atol=1e-6).item()


def test_on_real_gdn_layer_weights():
    """The conv of a (tiny) qwen3_5 GatedDeltaNet layer, over a decode-sized window."""
    layer = tiny_model("qwen3_5").layers[0].linear_attn
    x = mx.random.normal((1, layer.conv_kernel_size - 1 + 5, layer.conv_dim))
    assert mx.allclose(conv1d_shifted(x, layer.conv1d.weight), layer.conv1d(x), atol=1e-6).item()
