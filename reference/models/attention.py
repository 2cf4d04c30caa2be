"""Causal softmax attention with a KV cache, rotary positions and grouped KV heads.

Two variants, as in mlx-lm: ``llama.Attention`` (q/k/v/o projections, rope on the whole head) and
``qwen3_next.Qwen3NextAttention`` (``gated=True``: ``q_proj`` yields a query and an output gate per
head, RMSNorm on q and k per head (``q_norm``/``k_norm``), partial rope, output ``o_proj(attn * sigmoid(gate))``).

The query at absolute position p attends to keys ``0..p``, or with a sliding window of W tokens to
the last W of them (:func:`visible_keys`); it is computed from exactly those rows, one query at a
time, so a token's result does not depend on how many tokens share the forward. The state
(:class:`~reference.models.cache.KVState`) is one key and value row per token seen (a sliding
window layer keeps them all too: the rule is in which rows a query reads, not in what is stored).
"""
from __future__ import annotations

import numpy as np

from reference.models.cache import KVState
from reference.models.ops import linear, rms_norm, sigmoid, softmax
from reference.models.rope import Rope
from reference.models.weights import Weights


def visible_keys(p: int, window: int | None) -> slice:
    """The key positions the query at absolute position ``p`` attends: ``0..p`` (causal), or with a
    sliding window of ``window`` tokens only the last ``window`` of them, ``p - window + 1 .. p``.

    This is what mlx-lm's sliding-window layers compute for every token, whether it is decoded
    alone (a ``RotatingKVCache(max_size=window, keep=0)`` holding the last ``window`` tokens) or
    in a multi-token forward (``create_causal_mask(N, offset, window_size=window)``).
    """
    return slice(0 if window is None else max(0, p - window + 1), p + 1)


class Attention:
    """Weights (mlx-lm names, prefix ``self_attn.``): ``{q,k,v,o}_proj.weight`` (+ ``.bias``), and with
    ``gated=True`` also ``q_norm.weight``, ``k_norm.weight``. ``window``: sliding-window size (None: full)."""

    def __init__(self, w: Weights, n_heads: int, n_kv_heads: int, head_dim: int, rope: Rope,
                 gated: bool = False, eps: float = 1e-6, window: int | None = None):
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.rope, self.gated, self.eps, self.window = rope, gated, eps, window
        self.scale = head_dim**-0.5
        self.proj = {name: (w[f"{name}.weight"], w.get(f"{name}.bias"))
                     for name in ("q_proj", "k_proj", "v_proj", "o_proj")}
        if gated:
            self.q_norm, self.k_norm = w["q_norm.weight"], w["k_norm.weight"]

    def new_state(self, dtype) -> KVState:
        """An empty KV state: no rows (``KVCache`` before the first token)."""
        empty = np.zeros((self.n_kv_heads, 0, self.head_dim), dtype)
        return KVState(empty, empty.copy())

    def _proj(self, x: np.ndarray, name: str) -> np.ndarray:
        return linear(x, *self.proj[name])

    def __call__(self, x: np.ndarray, state: KVState) -> np.ndarray:
        S = x.shape[0]
        q = self._proj(x, "q_proj").reshape(S, self.n_heads, -1)
        if self.gated:  # per head: [query | gate]
            q, gate = q[..., :self.head_dim], q[..., self.head_dim:].reshape(S, -1)
        k = self._proj(x, "k_proj").reshape(S, self.n_kv_heads, self.head_dim)
        v = self._proj(x, "v_proj").reshape(S, self.n_kv_heads, self.head_dim)
        if self.gated:
            q = rms_norm(q, self.q_norm, self.eps)
            k = rms_norm(k, self.k_norm, self.eps)
        q, k, v = (t.transpose(1, 0, 2) for t in (q, k, v))  # [heads, S, head_dim]

        offset = state.offset
        q, k = self.rope(q, offset), self.rope(k, offset)
        state.append(k, v)

        group = self.n_heads // self.n_kv_heads  # query head h reads kv head h // group
        out = np.empty((S, self.n_heads, self.head_dim), dtype=x.dtype)
        for i in range(S):
            visible = visible_keys(offset + i, self.window)
            for h in range(self.n_heads):
                keys = state.keys[h // group, visible]
                values = state.values[h // group, visible]
                p = softmax(keys @ q[h, i] * x.dtype.type(self.scale))
                out[i, h] = p @ values
        out = out.reshape(S, -1)
        if self.gated:
            out = out * sigmoid(gate)
        return self._proj(out, "o_proj")
