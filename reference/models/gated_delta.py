"""The GatedDeltaNet (linear attention) layer of Qwen3-Next / Qwen3.5, as mlx-lm's ops path computes it.

Source: ``mlx_lm/models/qwen3_next.py`` / ``qwen3_5.py`` (``GatedDeltaNet.__call__``) and
``mlx_lm/models/gated_delta.py`` (``compute_g``, ``normalize_qk``, ``_gated_delta_step_ops``), mlx-lm 0.32.

For each token t, per value head (``S`` is ``[Dv, Dk]``, value head h reads key head ``h // (Hv/Hk)``)::

    g_t    = exp(-exp(A_log) * softplus(a_t + dt_bias))     decay in (0, 1)
    beta_t = sigmoid(b_t)                                     write strength
    S_t    = g_t S_{t-1} + beta_t (v_t - g_t S_{t-1} k_t) k_t^T
    y_t    = S_t q_t

where q, k, v come out of a causal depthwise conv1d (kernel K = 4) over ``[conv_state ; new rows]``
followed by SiLU, and q, k are L2-normalised with the ``Dk**-0.5`` read-out scale folded into q. The
output is ``out_proj(rms_norm(y) * weight * silu(z))`` (the gated RMSNorm).

The layer's state (:class:`~reference.models.cache.RecurrentState`) is the conv window and ``S``.
"""
from __future__ import annotations

import numpy as np

from reference.models.cache import RecurrentState
from reference.models.ops import linear, rms_norm, sigmoid, silu, softplus
from reference.models.weights import Weights


def compute_g(A_log: np.ndarray, a: np.ndarray, dt_bias: np.ndarray) -> np.ndarray:
    """Per-head decay ``exp(-exp(A_log) * softplus(a + dt_bias))`` (``gated_delta.compute_g``)."""
    return np.exp(-np.exp(A_log) * softplus(a + dt_bias))


def normalize_qk(q: np.ndarray, k: np.ndarray, eps: float = 1e-6) -> tuple[np.ndarray, np.ndarray]:
    """L2-normalise q and k over ``Dk``; q also gets the read-out scale ``Dk**-0.5`` (``normalize_qk``).

    mlx-lm writes it with ``rms_norm`` (eps scaled by ``1/Dk``): ``q = rms_norm(q)/Dk``,
    ``k = rms_norm(k)/sqrt(Dk)``, i.e. ``q / (sqrt(Dk) * sqrt(|q|^2 + eps))`` and ``k / sqrt(|k|^2 + eps)``.
    """
    inv_scale = q.shape[-1] ** -0.5
    rms_eps = eps * inv_scale**2
    q = q.dtype.type(inv_scale**2) * rms_norm(q, None, rms_eps)
    k = k.dtype.type(inv_scale) * rms_norm(k, None, rms_eps)
    return q, k


def causal_conv1d(conv_input: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """Depthwise causal conv: ``out[t, c] = sum_j weight[c, j] * conv_input[t + j, c]``.

    ``conv_input`` is ``[K-1+S, C]`` (the saved window then the S new rows), ``weight`` ``[C, K]``;
    the result has S rows (``nn.Conv1d(C, C, K, groups=C, padding=0, bias=False)``).
    """
    kernel = weight.shape[1]
    n_out = conv_input.shape[0] - kernel + 1
    out = np.zeros((n_out, conv_input.shape[1]), dtype=conv_input.dtype)
    for j in range(kernel):
        out += weight[:, j] * conv_input[j:j + n_out]
    return out


def gated_delta_step(state, q, k, v, g, beta):
    """One token of the gated delta rule for all heads (``_gated_delta_step_ops``).

    ``state [H, Dv, Dk]``, ``q, k [H, Dk]``, ``v [H, Dv]``, ``g, beta [H]`` -> ``(y [H, Dv], new state)``.
    """
    state = state * g[:, None, None]                       # decay
    kv_mem = np.sum(state * k[:, None, :], axis=-1)        # what S already returns for k: [H, Dv]
    delta = (v - kv_mem) * beta[:, None]                   # the correction to write
    state = state + k[:, None, :] * delta[:, :, None]      # rank-1 update delta k^T
    y = np.sum(state * q[:, None, :], axis=-1)             # read out with q: [H, Dv]
    return y, state


def gated_rms_norm(y: np.ndarray, z: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """``rms_norm(y) * weight * silu(z)`` over the last axis (``Qwen3NextRMSNormGated``)."""
    return silu(z) * rms_norm(y, weight, eps)


class GatedDeltaNet:
    """The layer. Subclasses read their input projections and define :meth:`project` (their layout).

    Weights (mlx-lm names, prefix ``linear_attn.``): ``conv1d.weight [C, K, 1]``, ``A_log [Hv]``,
    ``dt_bias [Hv]``, ``norm.weight [Dv]``, ``out_proj.weight [hidden, Hv*Dv]`` + the projections.
    """

    def __init__(self, w: Weights, n_k_heads: int, n_v_heads: int, d_k: int, d_v: int, eps: float):
        if n_v_heads % n_k_heads:
            raise ValueError(f"linear_num_value_heads ({n_v_heads}) must be a multiple of "
                             f"linear_num_key_heads ({n_k_heads})")
        self.A_log, self.dt_bias = w["A_log"], w["dt_bias"]
        self.norm_weight, self.out_proj = w["norm.weight"], w["out_proj.weight"]
        self.n_k_heads, self.n_v_heads, self.d_k, self.d_v, self.eps = n_k_heads, n_v_heads, d_k, d_v, eps
        self.key_dim, self.value_dim = n_k_heads * d_k, n_v_heads * d_v
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_weight = w["conv1d.weight"][:, :, 0]  # [C, K]
        self.kernel = self.conv_weight.shape[1]

    def project(self, x: np.ndarray):
        """``x [S, hidden]`` -> ``(qkv [S, conv_dim] laid out q|k|v, z [S, Hv, Dv], b [S, Hv], a [S, Hv])``."""
        raise NotImplementedError

    def new_state(self, dtype) -> RecurrentState:
        """Zeros, as mlx-lm starts a fresh ``ArraysCache``: conv ``[K-1, C]``, recurrent ``[Hv, Dv, Dk]``."""
        return RecurrentState(np.zeros((self.kernel - 1, self.conv_dim), dtype),
                              np.zeros((self.n_v_heads, self.d_v, self.d_k), dtype))

    def __call__(self, x: np.ndarray, state: RecurrentState) -> np.ndarray:
        S = x.shape[0]
        qkv, z, b, a = self.project(x)
        conv_input = np.concatenate([state.conv, qkv], axis=0)
        conv_out = silu(causal_conv1d(conv_input, self.conv_weight))
        q = conv_out[:, :self.key_dim].reshape(S, self.n_k_heads, self.d_k)
        k = conv_out[:, self.key_dim:2 * self.key_dim].reshape(S, self.n_k_heads, self.d_k)
        v = conv_out[:, 2 * self.key_dim:].reshape(S, self.n_v_heads, self.d_v)
        q, k = normalize_qk(q, k)
        repeat = self.n_v_heads // self.n_k_heads
        q, k = np.repeat(q, repeat, axis=1), np.repeat(k, repeat, axis=1)
        g = compute_g(self.A_log, a, self.dt_bias)
        beta = sigmoid(b)

        states = np.empty((S + 1, *state.recurrent.shape), dtype=state.recurrent.dtype)
        states[0] = state.recurrent
        y = np.empty((S, self.n_v_heads, self.d_v), dtype=x.dtype)
        for t in range(S):
            y[t], states[t + 1] = gated_delta_step(states[t], q[t], k[t], v[t], g[t], beta[t])
        state.record(conv_input, states)

        out = gated_rms_norm(y, z, self.norm_weight, self.eps)
        return linear(out.reshape(S, self.value_dim), self.out_proj)
