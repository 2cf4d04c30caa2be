"""The decoder stack shared by every architecture: embed, N pre-norm residual layers, norm, LM head.

Each layer is ``h = x + mixer(input_layernorm(x)); out = h + mlp(post_attention_layernorm(h))``,
where the mixer is a GatedDeltaNet or an attention layer (``DecoderLayer`` in mlx-lm's model files).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from reference.models.cache import ModelCache
from reference.models.ops import linear, rms_norm


@dataclass
class DecoderLayer:
    """One pre-norm residual layer (mlx-lm's ``DecoderLayer``): ``h = x + mixer(rms_norm(x, input_norm))``,
    ``out = h + mlp(rms_norm(h, post_norm))`` (:meth:`Model.forward`)."""

    mixer: Callable  # GatedDeltaNet or Attention: (x, state) -> x
    mlp: Callable  # MLP or SparseMoe: x -> x
    input_norm: np.ndarray
    post_norm: np.ndarray


class Model:
    """A loaded model: ``forward(tokens, cache) -> logits [S, vocab]``, ``make_cache()``.

    ``config`` is the model directory's config.json (text part), ``dtype`` float32 or float64.
    """

    def __init__(self, config: dict, dtype, embed: np.ndarray, layers: list[DecoderLayer], norm: np.ndarray,
                 lm_head: np.ndarray | None, eps: float):
        self.config, self.dtype = config, np.dtype(dtype)
        self.embed, self.layers, self.norm, self.eps = embed, layers, norm, eps
        self.lm_head = embed if lm_head is None else lm_head  # tied embeddings: embed.as_linear
        self.vocab_size = embed.shape[0]
        self.cache_layout = self.make_cache().layout()

    @property
    def model_type(self) -> str:
        """config.json's ``model_type`` (``llama``, ``qwen3_5``, ``qwen3_next``, ...)."""
        return self.config["model_type"]

    def make_cache(self) -> ModelCache:
        """An empty state: zeros for recurrent layers, no rows for attention layers."""
        return ModelCache([layer.mixer.new_state(self.dtype) for layer in self.layers])

    def forward(self, tokens, cache: ModelCache) -> np.ndarray:
        """Run ``tokens`` (S >= 1 ids) after the state in ``cache``; returns logits ``[S, vocab]``.

        The cache advances by S tokens and records what :meth:`ModelCache.keep` needs to cut it back.
        ``cache`` must come from this model's :meth:`make_cache` (or one with the same layers, sizes and
        dtype): another is refused before anything changes.
        """
        tokens = np.asarray(tokens)
        if tokens.ndim != 1 or tokens.size == 0 or tokens.dtype.kind not in "iu":
            raise ValueError(f"forward needs a non-empty 1-D sequence of token ids, got {tokens!r}")
        bad = (tokens < 0) | (tokens >= self.vocab_size)
        if bad.any():
            raise ValueError(f"token id {int(tokens[bad][0])} is outside the vocabulary 0..{self.vocab_size - 1}")
        if cache.layout() != self.cache_layout:
            raise ValueError("this cache was made by another model (its layers differ in kind, size or dtype): "
                             "make one with this model's make_cache()")
        cache.begin(len(tokens))
        x = self.embed[tokens]
        for layer, state in zip(self.layers, cache.layers, strict=True):
            h = x + layer.mixer(rms_norm(x, layer.input_norm, self.eps), state)
            x = h + layer.mlp(rms_norm(h, layer.post_norm, self.eps))
        return linear(rms_norm(x, self.norm, self.eps), self.lm_head)
