"""Exact rollback of an mlx-lm prompt cache after a verify forward, without a second forward.

A verify forward runs the model over ``S`` tokens ``[last, d1..dk]``; afterwards only the first
``m`` of them (``last`` and the accepted drafts) may stay in the cache. :class:`VerifyCache`
runs such forwards and then :meth:`VerifyCache.keep` cuts every layer back to ``m`` tokens:

* attention caches (``KVCache``, ``QuantizedKVCache``, a ``RotatingKVCache`` that does not wrap,
  ...) are trimmed by ``S - m`` (their rows are offset-addressed);
* GatedDeltaNet layers (``qwen3_5``, ``qwen3_next``; cache ``ArraysCache(size=2)``) get
  ``cache[0]`` = the conv window ending at token m, ``conv_input[:, m : m + K - 1]``, and
  ``cache[1]`` = the recurrent state after token m.

For the recurrent state there are two paths (:data:`GDN_PATHS`):

* ``"states"``: the verify forward runs mlx-lm's ``gated_delta_update`` one token at a time and
  keeps every per-token state; keeping m is a lookup. Best where the recurrence runs as ops
  (CPU, CUDA), where these states are computed anyway.
* ``"replay"``: the verify forward runs ``gated_delta_update`` over all S tokens (Metal kernels on
  Apple silicon, which return only the final state) and saves its inputs ``q, k, v, a, b``;
  keeping ``0 < m < S`` re-runs only the recurrence over the first m tokens from the saved state
  (no projection weights are read again).

:func:`default_gdn_path` picks by device. The GDN layers are observed without touching mlx-lm's
modules: each layer *instance* gets a subclass of its own class (:func:`attach`) whose
``__call__`` is mlx-lm's unless a verify forward is running. The verify-time forward reuses the
layer's own projections, ``normalize_qk``, ``gated_delta_update``, norm and ``out_proj``; only the
depthwise conv is computed as shifted multiply-adds (:mod:`mlx_backend.conv`).
"""
from __future__ import annotations

from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen3_5, qwen3_next
from mlx_lm.models.cache import ArraysCache, RotatingKVCache
try:
    from mlx_lm.models.gated_delta import gated_delta_update, normalize_qk
except ImportError as exc:   # normalize_qk arrived in mlx-lm 0.32
    import mlx_lm
    raise ImportError(f"mlx_backend needs mlx-lm >= 0.32 (found {mlx_lm.__version__}): "
                      f"pip install 'mlx-lm>=0.32,<0.33'") from exc

from mlx_backend.conv import depthwise_conv1d

GDN_PATHS = ("states", "replay")


class RollbackUnsupported(ValueError):
    """The prompt cache holds state that cannot be cut back to a prefix of a verify forward."""


def default_gdn_path() -> str:
    """``"replay"`` where mlx-lm runs the recurrence as Metal kernels, ``"states"`` elsewhere."""
    on_metal = mx.default_device() == mx.gpu and mx.metal.is_available()
    return "replay" if on_metal else "states"


# -- the GatedDeltaNet layers we know: how each computes (qkv, z, b, a) from its input ---------

def _qwen3_5_projections(layer, x):
    B, S, _ = x.shape
    z = layer.in_proj_z(x).reshape(B, S, layer.num_v_heads, layer.head_v_dim)
    return layer.in_proj_qkv(x), z, layer.in_proj_b(x), layer.in_proj_a(x)


def _qwen3_next_projections(layer, x):
    B, S, _ = x.shape
    q, k, v, z, b, a = layer.fix_query_key_value_ordering(layer.in_proj_qkvz(x), layer.in_proj_ba(x))
    qkv = mx.concatenate([q.reshape(B, S, -1), k.reshape(B, S, -1), v.reshape(B, S, -1)], axis=-1)
    return qkv, z, b, a


PROJECTIONS: dict[type, Callable] = {
    qwen3_5.GatedDeltaNet: _qwen3_5_projections,
    qwen3_next.Qwen3NextGatedDeltaNet: _qwen3_next_projections,
}


class _Recording:
    """Per-token record of one GDN layer's verify forward (what :meth:`keep` needs)."""

    def __init__(self, conv_input, state0, final, states=None, inputs=None):
        self.conv_input = conv_input   # [B, K-1+S, conv_dim]: conv window + the S new rows
        self.state0 = state0           # recurrent state before the forward
        self.final = final             # recurrent state after all S tokens
        self.states = states           # "states" path: state after token t, t = 1..S
        self.inputs = inputs           # "replay" path: (q, k, v, a, b) of the S tokens

    def state_after(self, m: int, layer) -> mx.array:
        S = self.conv_input.shape[1] - layer.conv_kernel_size + 1
        if m == 0:
            return self.state0
        if m == S:
            return self.final
        if self.states is not None:
            return self.states[m - 1]
        q, k, v, a, b = (t[:, :m] for t in self.inputs)
        _, state = gated_delta_update(q, k, v, a, b, layer.A_log, layer.dt_bias, self.state0,
                                      use_kernel=not layer.training)
        return state


class _RecordingGDN:
    """Mixin put in front of a GDN layer's class, per instance (see :func:`attach`).

    With ``_ngram_path`` None (the default) the call is mlx-lm's own ``__call__``. During a verify
    forward it computes the same function and leaves a :class:`_Recording` in ``_ngram_record``.
    """

    _ngram_path = None
    _ngram_record = None

    def __call__(self, inputs, mask=None, cache=None):
        if self._ngram_path is None:
            return super().__call__(inputs, mask, cache)
        if mask is not None or cache is None:
            raise RollbackUnsupported("verify forward of a GatedDeltaNet layer needs batch size 1, "
                                      "no padding mask and a cache")
        B, S, _ = inputs.shape
        qkv, z, b, a = PROJECTIONS[self._ngram_base](self, inputs)
        K = self.conv_kernel_size
        conv_state = cache[0] if cache[0] is not None else mx.zeros((B, K - 1, self.conv_dim), inputs.dtype)
        conv_input = mx.concatenate([conv_state, qkv], axis=1)
        conv_out = nn.silu(depthwise_conv1d(conv_input, self.conv1d))
        q, k, v = (t.reshape(B, S, h, d) for t, h, d in zip(
            mx.split(conv_out, [self.key_dim, 2 * self.key_dim], -1),
            [self.num_k_heads, self.num_k_heads, self.num_v_heads],
            [self.head_k_dim, self.head_k_dim, self.head_v_dim]))
        q, k = normalize_qk(q, k, inv_scale=self.head_k_dim ** -0.5, eps=1e-6)
        state0 = cache[1] if cache[1] is not None else mx.zeros(
            (B, self.num_v_heads, self.head_v_dim, self.head_k_dim), mx.float32)
        use_kernel = not self.training
        if self._ngram_path == "states":
            ys, states, state = [], [], state0
            for t in range(S):
                y, state = gated_delta_update(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1],
                                              a[:, t:t + 1], b[:, t:t + 1], self.A_log,
                                              self.dt_bias, state, use_kernel=use_kernel)
                ys.append(y)
                states.append(state)
            out = mx.concatenate(ys, axis=1)
            record = _Recording(conv_input, state0, state, states=states)
        else:
            out, state = gated_delta_update(q, k, v, a, b, self.A_log, self.dt_bias, state0,
                                            use_kernel=use_kernel)
            record = _Recording(conv_input, state0, state, inputs=(q, k, v, a, b))
        cache[0] = mx.contiguous(conv_input[:, -(K - 1):])
        cache[1] = state
        self._ngram_record = record
        out = self.out_proj(self.norm(out, z).reshape(B, S, -1))
        group = getattr(self, "sharding_group", None)   # tensor parallel (mlx-lm's shard()): this rank's heads
        return out if group is None else mx.distributed.all_sum(out, group=group)


_SUBCLASSES: dict[type, type] = {}


def _recording_class(base: type) -> type:
    if base not in _SUBCLASSES:
        _SUBCLASSES[base] = type(f"Recording{base.__name__}", (_RecordingGDN, base),
                                 {"_ngram_base": base})
    return _SUBCLASSES[base]


def attach(layer: nn.Module) -> nn.Module:
    """Give this GDN layer instance its recording subclass (idempotent; parameters unchanged)."""
    if not isinstance(layer, _RecordingGDN):
        layer.__class__ = _recording_class(type(layer))
    return layer


def detach(layer: nn.Module) -> None:
    """Undo :func:`attach` on this instance."""
    if isinstance(layer, _RecordingGDN):
        layer._ngram_path = layer._ngram_record = None
        layer.__class__ = layer._ngram_base


def _gdn_layer(layer: nn.Module):
    """The GatedDeltaNet module of a decoder layer, or None if it has none."""
    module = getattr(layer, "linear_attn", None)
    return module if isinstance(module, nn.Module) else None


class VerifyCache:
    """A model and its prompt cache, for verify forwards that can be cut back to any prefix.

    >>> from mlx_backend.tiny_mlx import tiny_model
    >>> from mlx_lm.models.cache import make_prompt_cache
    >>> model = tiny_model("qwen3_5")
    >>> cache = make_prompt_cache(model)
    >>> vc = VerifyCache(model, cache)
    >>> logits = vc.forward([5, 6, 7, 8])   # S = 4 tokens
    >>> vc.keep(2)                           # the cache now holds tokens 5, 6 only
    >>> cache[1].offset
    2
    >>> vc.close()
    """

    def __init__(self, model: nn.Module, cache: list[Any], gdn_path: str | None = None):
        gdn_path = gdn_path or default_gdn_path()
        if gdn_path not in GDN_PATHS:
            raise ValueError(f"gdn_path must be one of {GDN_PATHS}, got {gdn_path!r}")
        self.model, self.cache, self.gdn_path = model, cache, gdn_path
        self.gdn: list[tuple[nn.Module, ArraysCache]] = []
        self.trimmed: list[Any] = []
        layers = list(getattr(model, "layers", []))
        for i, c in enumerate(cache):
            if isinstance(c, ArraysCache):
                layer = _gdn_layer(layers[i]) if len(layers) == len(cache) else None
                if layer is None or not isinstance(layer, tuple(PROJECTIONS)):
                    kind = type(layer).__name__ if layer is not None else "unknown layer"
                    raise RollbackUnsupported(
                        f"cache {i} is an ArraysCache of {kind} ({type(model).__module__}): its "
                        f"recurrent state cannot be cut back to a prefix of a verify forward "
                        f"(supported: qwen3_5 / qwen3_next GatedDeltaNet). "
                        f"Use draft_max=0 (--no-spec) for this model.")
                if c.lengths is not None or c.left_padding is not None:
                    raise RollbackUnsupported(f"cache {i} is a batched ArraysCache (lengths / left "
                                              f"padding); speculative decoding runs batch size 1")
                self.gdn.append((attach(layer), c))
            elif hasattr(c, "trim") and c.is_trimmable():
                self.trimmed.append(c)
            else:
                raise RollbackUnsupported(
                    f"cache {i} ({type(c).__name__}) cannot be trimmed"
                    + (" (a RotatingKVCache that already wrapped)" if isinstance(c, RotatingKVCache) else "")
                    + ", so rejected drafts cannot be removed. Use a full KVCache "
                    "(max_kv_size=None, no --max-kv-size) or draft_max=0 (--no-spec).")
        self.S = 0

    def check_room(self, S: int) -> None:
        """Raise if a verify forward of ``S`` tokens would evict rows of a rotating cache."""
        for c in self.trimmed:
            if isinstance(c, RotatingKVCache) and c.offset + S > c.max_size:
                raise RollbackUnsupported(
                    f"RotatingKVCache(max_size={c.max_size}) holds {c.offset} tokens; verifying "
                    f"{S} more would overwrite its window, which cannot be undone. Use a full "
                    f"KVCache (max_kv_size=None, no --max-kv-size) or draft_max=0 (--no-spec).")

    def forward(self, tokens, record: bool | None = None) -> mx.array:
        """Logits ``[S, vocab]`` of the model over ``tokens``, recording what :meth:`keep` needs.

        ``record`` defaults to ``S > 1``: a 1-token forward (nothing to verify) runs mlx-lm's own
        layer code and can then only be kept whole (``keep(1)``).
        """
        tokens = mx.array(tokens, dtype=mx.uint32) if not isinstance(tokens, mx.array) else tokens
        S = tokens.size
        self.check_room(S)
        record = S > 1 if record is None else record
        for layer, _ in self.gdn:
            attach(layer)
            layer._ngram_path = self.gdn_path if record else None
            layer._ngram_record = None
        try:
            logits = self.model(tokens.reshape(1, S), cache=self.cache)
        finally:
            for layer, _ in self.gdn:
                layer._ngram_path = None
        self.S = S
        return logits[0]

    def keep(self, m: int) -> None:
        """Cut every layer back to the first ``m`` tokens of the last :meth:`forward`."""
        if not 0 <= m <= self.S:
            raise ValueError(f"keep(m) needs 0 <= m <= S = {self.S}, got {m}")
        if m < self.S:
            for c in self.trimmed:
                c.trim(self.S - m)
            for layer, c in self.gdn:
                rec = layer._ngram_record
                if rec is None:
                    raise ValueError("keep(m < S) needs a forward with record=True")
                K = layer.conv_kernel_size
                c[0] = mx.contiguous(rec.conv_input[:, m:m + K - 1])
                c[1] = rec.state_after(m, layer)
        for layer, _ in self.gdn:
            layer._ngram_record = None
        self.S = 0

    def close(self) -> None:
        """Give the GDN layers back their own class."""
        _detach_all([layer for layer, _ in self.gdn])


def _detach_all(layers) -> None:
    for layer in layers:
        detach(layer)
