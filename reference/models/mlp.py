"""Feed-forward blocks: the SwiGLU MLP, and Qwen3-Next's sparse mixture of experts.

Sources: ``llama.MLP`` / ``qwen3_next.Qwen3NextMLP`` (``down(silu(gate(x)) * up(x))``) and
``qwen3_next.Qwen3NextSparseMoeBlock`` with ``switch_layers.SwitchGLU``, mlx-lm 0.32.
"""
from __future__ import annotations

import numpy as np

from reference.models.ops import linear, sigmoid, silu, softmax
from reference.models.weights import Weights


class MLP:
    """``down_proj(silu(gate_proj(x)) * up_proj(x))``; weights ``{gate,up,down}_proj.weight`` (+ ``.bias``)."""

    def __init__(self, w: Weights):
        self.gate_proj = (w["gate_proj.weight"], w.get("gate_proj.bias"))
        self.up_proj = (w["up_proj.weight"], w.get("up_proj.bias"))
        self.down_proj = (w["down_proj.weight"], w.get("down_proj.bias"))

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return linear(silu(linear(x, *self.gate_proj)) * linear(x, *self.up_proj), *self.down_proj)


class SparseMoe:
    """Top-k routed SwiGLU experts plus a sigmoid-gated shared expert.

    For each token: ``p = softmax(gate(x))``; the ``top_k`` largest ``p_e`` (renormalised to sum 1 when
    ``norm_topk_prob``) weight the outputs of their experts ``down_e(silu(gate_e x) * up_e x)``; then
    ``+ sigmoid(shared_expert_gate(x)) * shared_expert(x)``. Weights: ``gate.weight [E, hidden]``,
    ``switch_mlp.{gate,up,down}_proj.weight [E, out, in]``, ``shared_expert.*``, ``shared_expert_gate.weight``.
    """

    def __init__(self, w: Weights, top_k: int, norm_topk_prob: bool):
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.gate = w["gate.weight"]
        self.experts_gate = w["switch_mlp.gate_proj.weight"]
        self.experts_up = w["switch_mlp.up_proj.weight"]
        self.experts_down = w["switch_mlp.down_proj.weight"]
        self.shared_expert = MLP(w.group("shared_expert."))
        self.shared_expert_gate = w["shared_expert_gate.weight"]

    def __call__(self, x: np.ndarray) -> np.ndarray:
        probs = softmax(linear(x, self.gate))
        out = np.empty_like(x)
        for i, (row, p) in enumerate(zip(x, probs)):
            experts = np.argsort(-p, kind="stable")[:self.top_k]
            scores = p[experts]
            if self.norm_topk_prob:
                scores = scores / scores.sum()
            y = np.zeros_like(row)
            for e, s in zip(experts, scores):
                h = silu(self.experts_gate[e] @ row) * (self.experts_up[e] @ row)
                y += (self.experts_down[e] @ h) * s
            out[i] = y
        shared_gate = sigmoid(linear(x, self.shared_expert_gate))
        return out + shared_gate * self.shared_expert(x)
