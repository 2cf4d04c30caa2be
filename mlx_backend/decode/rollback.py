"""Exact rollback of an mlx-lm prompt cache after a verify forward (a second forward only for
caches of unknown recurrent layers).

A verify forward runs the model over ``S`` tokens ``[last, d1..dk]``; afterwards only the first
``m`` of them (``last`` and the accepted drafts) may stay in the cache. :class:`VerifyCache`
runs such forwards and then :meth:`VerifyCache.keep` cuts every layer back to ``m`` tokens:

* attention caches (``KVCache``, ``QuantizedKVCache``, ``ChunkedKVCache``, ...) are trimmed by
  ``S - m`` (their rows are offset-addressed);
* a ``RotatingKVCache`` (sliding window, ``max_kv_size``), wrapped or not, is left untouched by the
  verify forward: each query attends exactly the keys a one-token step at its position would see
  (:func:`single_step_mask`), and ``keep(m)`` then writes the first m new rows one at a time with
  mlx-lm's own one-token update, so the ring ends as m plain steps would leave it;
* GatedDeltaNet layers recognised by what they compute (:func:`gdn_projections`: qwen3_5,
  qwen3_5_moe, qwen3_next; cache ``ArraysCache(size=2)``) get ``cache[0]`` = the conv window
  ending at token m, ``conv_input[:, m : m + K - 1]``, and ``cache[1]`` = the recurrent state
  after token m;
* short-convolution layers whose cache is the conv window alone, recognised by what they do
  (:func:`conv_window_layer`: lfm2, lfm2_moe, lfm2-vl's ``ShortConv``; ``ArraysCache(size=1)``),
  get ``cache[0]`` = the conv window ending at token m, the same slice of the conv's input
  ``[window ; S new rows]``, kept as the conv saw it during the verify forward (no recurrence: nothing else);
* every other cache (``ArraysCache`` of Mamba / SSM / other linear-attention layers, custom
  cache classes) is snapshotted before the verify forward; ``keep(m < S)`` puts it back to before
  the forward and re-runs the first m tokens. Where every such cache is an ``ArraysCache`` and the
  model qualifies (:func:`layer_replay_qualifies`, checked once per class), only the decoder layers
  holding them are re-run, each on the first m positions of the arguments it got in the verify
  forward (recorded by :class:`_RecordingCall`; a KV cache in the same layer is trimmed to before
  the forward first and gets its m rows again): no second model forward. Otherwise the whole model
  re-runs the m tokens (a second forward).

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
depthwise conv is computed as shifted multiply-adds (:mod:`mlx_backend.decode.conv`).
"""
from __future__ import annotations

import functools
import inspect
import math
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models.cache import ArraysCache, CacheList, RotatingKVCache, make_prompt_cache
try:
    from mlx_lm.models.gated_delta import gated_delta_update, normalize_qk
except ImportError as exc:   # normalize_qk arrived in mlx-lm 0.32
    import mlx_lm
    raise ImportError(f"mlx_backend needs mlx-lm >= 0.32 (found {mlx_lm.__version__}): "
                      f"pip install 'mlx-lm>=0.32,<0.33'") from exc

from mlx_backend.decode.conv import depthwise_conv1d

GDN_PATHS = ("states", "replay")
#: Bytes of per-token recurrent states a ``"states"`` verify forward may keep (all GDN layers together);
#: beyond it only every c-th token's state is kept (:func:`checkpoint_interval`).
GDN_STATE_BUDGET = 512 * 2 ** 20


def checkpoint_interval(S: int, state_bytes: int, budget: int = GDN_STATE_BUDGET) -> int:
    """``c``: a verify forward over S tokens keeps the recurrent states after tokens c, 2c, ... < S
    (``(S - 1) // c`` of them, ``state_bytes`` each: every GDN layer's state together), the fewest
    c that fits ``budget``. ``keep(m)`` then starts from the last checkpoint at or before m and
    re-runs the recurrence over at most ``c - 1`` tokens (no weights read).

    >>> checkpoint_interval(65, 48 * 3 * 2 ** 20)   # Qwen3.5-27B: 144 MiB a token, 64 * 144 MiB > 512 MiB
    18
    >>> checkpoint_interval(9, 4 * 2 ** 10)         # a small model: every state
    1
    """
    return max(1, math.ceil((S - 1) * state_bytes / budget)) if budget > 0 else max(S, 1)


class RollbackUnsupported(ValueError):
    """The prompt cache holds state that cannot be cut back to a prefix of a verify forward."""


def default_gdn_path() -> str:
    """``"replay"`` where mlx-lm runs the recurrence as Metal kernels, ``"states"`` elsewhere."""
    on_metal = mx.default_device() == mx.gpu and mx.metal.is_available()
    return "replay" if on_metal else "states"


# -- the GatedDeltaNet layouts the recorder knows, by the modules a layer has (not its class) ----

def _qwen3_5_projections(layer, x):
    B, S, _ = x.shape
    z = layer.in_proj_z(x).reshape(B, S, layer.num_v_heads, layer.head_v_dim)
    return layer.in_proj_qkv(x), z, layer.in_proj_b(x), layer.in_proj_a(x)


def _qwen3_next_projections(layer, x):
    B, S, _ = x.shape
    q, k, v, z, b, a = layer.fix_query_key_value_ordering(layer.in_proj_qkvz(x), layer.in_proj_ba(x))
    qkv = mx.concatenate([q.reshape(B, S, -1), k.reshape(B, S, -1), v.reshape(B, S, -1)], axis=-1)
    return qkv, z, b, a


_GDN_MODULES = ("conv1d", "A_log", "dt_bias", "norm", "out_proj", "conv_kernel_size", "conv_dim",
                "key_dim", "num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim")
#: How a GatedDeltaNet layout computes ``(qkv, z, b, a)``, keyed by the projection modules it has
#: (qwen3_5 / qwen3_5_moe: separate projections; qwen3_next: fused qkvz and ba).
PROJECTIONS: dict[tuple[str, ...], Callable] = {
    ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"): _qwen3_5_projections,
    ("in_proj_qkvz", "in_proj_ba", "fix_query_key_value_ordering"): _qwen3_next_projections,
}
_RECORDABLE: dict[type, Callable | None] = {}   # per layer class: its projections, or None


def _input_dims(linear) -> int:
    """Input width of an ``nn.Linear`` or ``nn.QuantizedLinear``."""
    w = linear.weight.shape[-1]
    return w * 32 // linear.bits if hasattr(linear, "bits") else w


def gdn_projections(layer) -> Callable | None:
    """The projections of a GatedDeltaNet layer the recorder can run, else None.

    A layer qualifies by what it computes, not by its class name: it has the modules of a layout
    in :data:`PROJECTIONS`, and (checked once per class, on a random 4-token input from an empty
    state) the recording forward gives mlx-lm's own output, conv window and recurrent state.
    """
    base = getattr(layer, "_ngram_base", type(layer))
    if base not in _RECORDABLE:
        _RECORDABLE[base] = None
        for names, projections in PROJECTIONS.items():
            if all(hasattr(layer, n) for n in names + _GDN_MODULES):
                recorder = _recording_class(base, _RecordingGDN)
                recorder._ngram_projections = staticmethod(projections)
                if _records_exactly(layer, base, recorder, _input_dims(getattr(layer, names[0]))):
                    _RECORDABLE[base] = projections
                break
    return _RECORDABLE[base]


def _records_exactly(layer, base: type, recorder: type, dims: int) -> bool:
    x = mx.random.normal((1, 4, dims), key=mx.random.key(0))
    own, rec = ArraysCache(size=2), ArraysCache(size=2)
    saved = layer.__class__
    try:
        y = base.__call__(layer, x, None, own)
        layer.__class__ = recorder
        layer._ngram_path = "states"
        y_rec = layer(x, None, rec)
        pairs = [(y, y_rec), (own[0], rec[0]), (own[1], rec[1])]
        return all(a.shape == b.shape and mx.allclose(a, b, rtol=1e-2, atol=1e-3).item() for a, b in pairs)
    except Exception:   # a layer with these modules that computes something else
        return False
    finally:
        layer.__class__ = saved
        _clear(layer)


class _Recording:
    """Per-token record of one GDN or short-conv layer's verify forward (what :meth:`keep` needs)."""

    def __init__(self, conv_input, kernel_size, state0=None, final=None, states=None, inputs=None, every=1):
        self.conv_input = conv_input   # [B, K-1+S, conv_dim]: conv window + the S new rows
        self.kernel_size = kernel_size  # K
        self.state0 = state0           # recurrent state before the forward (None: a short conv, no state)
        self.final = final             # recurrent state after all S tokens
        self.states = states           # "states" path: {t: state after token t}, t = every, 2 every, ... < S
        self.inputs = inputs           # (q, k, v, a, b) of the S tokens: "replay", or "states" with every > 1
        self.every = every             # "states" path: the checkpoint interval c

    def window(self, m: int | list[int]) -> mx.array:
        """The conv window after the first m of the S new rows, rows ``m .. m + K - 2`` of
        ``conv_input``; ``m`` one int, or one per batch row."""
        n = self.kernel_size - 1
        if isinstance(m, int):
            return mx.contiguous(self.conv_input[:, m:m + n])
        rows = mx.array(m)[:, None] + mx.arange(n)[None]            # [B, K-1]
        return mx.take_along_axis(self.conv_input, rows[..., None], axis=1)

    def state_after(self, m: int, layer) -> mx.array:
        S = self.conv_input.shape[1] - layer.conv_kernel_size + 1
        if m == 0:
            return self.state0
        if m == S:
            return self.final
        if self.states is not None:
            # the last checkpoint at or before m, then the recurrence over the rest, one token at a time
            # as the verify forward ran it (the same ops on the same inputs: the same numbers)
            j = m - m % self.every
            state = self.states[j] if j else self.state0
            for t in range(j, m):
                q, k, v, a, b = (x[:, t:t + 1] for x in self.inputs)
                _, state = gated_delta_update(q, k, v, a, b, layer.A_log, layer.dt_bias, state,
                                              use_kernel=not layer.training)
            return state
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
    _ngram_every = 1   # "states" path: keep the recurrent state after every c-th token (checkpoints)

    def __call__(self, inputs, mask=None, cache=None):
        if self._ngram_path is None:
            return super().__call__(inputs, mask, cache)
        if mask is not None or cache is None:
            raise RollbackUnsupported("verify forward of a GatedDeltaNet layer needs batch size 1, "
                                      "no padding mask and a cache")
        B, S, _ = inputs.shape
        qkv, z, b, a = self._ngram_projections(self, inputs)
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
            every = max(1, self._ngram_every or 1)
            ys, states, state = [], {}, state0
            for t in range(S):
                y, state = gated_delta_update(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1],
                                              a[:, t:t + 1], b[:, t:t + 1], self.A_log,
                                              self.dt_bias, state, use_kernel=use_kernel)
                ys.append(y)
                if (t + 1) % every == 0 and t + 1 < S:
                    states[t + 1] = state   # a checkpoint; the states between are freed once computed
            out = mx.concatenate(ys, axis=1)
            record = _Recording(conv_input, K, state0, state, states=states,
                                inputs=(q, k, v, a, b) if every > 1 else None, every=every)
        else:
            out, state = gated_delta_update(q, k, v, a, b, self.A_log, self.dt_bias, state0,
                                            use_kernel=use_kernel)
            record = _Recording(conv_input, K, state0, state, inputs=(q, k, v, a, b))
        cache[0] = mx.contiguous(conv_input[:, -(K - 1):])
        cache[1] = state
        self._ngram_record = record
        out = self.out_proj(self.norm(out, z).reshape(B, S, -1))
        group = getattr(self, "sharding_group", None)   # tensor parallel (mlx-lm's shard()): this rank's heads
        return out if group is None else mx.distributed.all_sum(out, group=group)


# -- short convolutions whose cache is their window (lfm2's ShortConv) -------------------------

class _RecordingConvInput:
    """Mixin put in front of a short-conv layer's ``nn.Conv1d``, per instance (see :func:`attach`).

    With ``_ngram_verify`` off the call is mlx-lm's. During a verify forward it is mlx-lm's too, and
    the conv's input ``[window ; S new rows]`` is left as a :class:`_Recording` in ``_ngram_record``.
    """

    _ngram_verify = False
    _ngram_record = None

    def __call__(self, x):
        if self._ngram_verify:
            self._ngram_record = _Recording(x, self.weight.shape[1])
        return super().__call__(x)


_WINDOW_ONLY: dict[type, bool] = {}   # per layer class: its cache is its conv's window (checked once)


def conv_window_layer(layer: nn.Module) -> nn.Conv1d | None:
    """The ``nn.Conv1d`` of a decoder layer's short convolution (``layer.conv``, with ``conv`` and
    ``in_proj``) whose cache holds that conv's window and nothing else, else None.

    The rule (lfm2's ``ShortConv``): the cache is the last K - 1 rows the conv was fed (for lfm2 the
    gated projections ``B * x``); a forward over S tokens feeds it ``[window ; S new rows]``, so after
    the first m tokens the cache is rows ``m .. m + K - 2`` of that input, with no recurrence to
    recompute. A layer qualifies by doing this, not by its class name: once per class, from a window
    of random rows, a forward over 4 random tokens is recorded, and for every m <= 4 mlx-lm's own
    forward over the first m tokens must leave that slice in an ``ArraysCache(size=1)``.
    """
    module = getattr(layer, "conv", None)
    conv = getattr(module, "conv", None)
    if not isinstance(conv, nn.Conv1d) or not isinstance(getattr(module, "in_proj", None), nn.Module):
        return None
    if type(module) not in _WINDOW_ONLY:
        _WINDOW_ONLY[type(module)] = _keeps_conv_window(module, conv)
    return conv if _WINDOW_ONLY[type(module)] else None


def _keeps_conv_window(module: nn.Module, conv: nn.Conv1d, S: int = 4) -> bool:
    x = mx.random.normal((1, 2 * S, _input_dims(module.in_proj)), key=mx.random.key(0))
    saved = conv.__class__

    def cache_from(window):
        cache = ArraysCache(size=1)
        cache[0] = window
        return cache
    try:
        start = ArraysCache(size=1)
        module(x[:, :S], None, start)   # a window of random rows
        attach(conv, _RecordingConvInput)
        conv._ngram_verify = True
        module(x[:, S:], None, cache_from(start[0]))
        record = take_record(conv)
        conv._ngram_verify = False
        for m in range(S + 1):
            own = cache_from(start[0])
            if m:
                module(x[:, S:S + m], None, own)
            window = record.window(m)
            if own[0].shape != window.shape or not mx.allclose(own[0], window, rtol=1e-2, atol=1e-3).item():
                return False
        return True
    except Exception:   # a layer with these modules whose cache is something else
        return False
    finally:
        conv.__class__ = saved
        _clear(conv)


def recorded_layer(layer: nn.Module | None) -> tuple[nn.Module, type] | None:
    """What a verify forward records of a decoder layer holding an ``ArraysCache``, with its mixin:
    its GatedDeltaNet (:func:`gdn_projections`), or its short conv's ``nn.Conv1d``
    (:func:`conv_window_layer`); None for a layer the rollback must replay."""
    if layer is None:
        return None
    gdn = gdn_layer(layer)
    if gdn is not None and gdn_projections(gdn) is not None:
        return gdn, _RecordingGDN
    conv = conv_window_layer(layer)
    return (conv, _RecordingConvInput) if conv is not None else None


_SUBCLASSES: dict[tuple[type, type], type] = {}


def _recording_class(base: type, mixin: type) -> type:
    if (base, mixin) not in _SUBCLASSES:
        _SUBCLASSES[base, mixin] = type(f"Recording{base.__name__}", (mixin, base), {"_ngram_base": base})
    return _SUBCLASSES[base, mixin]


def attach(obj, mixin: type = _RecordingGDN):
    """Give this instance (a GDN layer, a short conv, a rotating cache) its recording subclass (idempotent;
    parameters and state unchanged)."""
    if not isinstance(obj, mixin):
        obj.__class__ = _recording_class(type(obj), mixin)
    return obj


def detach(obj) -> None:
    """Undo :func:`attach` on this instance."""
    if hasattr(obj, "_ngram_base"):
        _clear(obj)
        obj.__class__ = obj._ngram_base


def _clear(obj) -> None:
    """Remove the recording attributes set on this instance."""
    for name in [k for k in vars(obj) if k.startswith("_ngram")]:
        delattr(obj, name)


# -- rotating (sliding-window) KV caches --------------------------------------------------------

@functools.lru_cache(maxsize=256)
def single_step_mask(L: int, offset: int, keep: int, max_size: int, idx: int,
                     window_size: int | None, S: int) -> np.ndarray:
    """``[S, n + S]`` bool: which keys query i of a verify forward may attend, for the ``n`` rows a
    ``RotatingKVCache`` in this state returns (its first ``min(offset, L)`` buffer rows, ``L`` the
    buffer length) followed by the S new rows, so that token ``offset + i`` sees exactly the tokens a
    one-token decoding step at its position sees.

    The rule is mlx-lm's own: a shadow ``RotatingKVCache`` in the same state (``offset``, ``keep``,
    write index ``_idx``), whose row j holds the tag j + 1, takes the S one-token updates
    (``_update_in_place``, the new row tagged n + i + 1) and gives the one-token masks
    (``make_mask``); the tags it returns are the columns query i attends. A multi-token forward
    through mlx-lm's ``_update_concat`` differs once the ring has wrapped with ``keep > 0`` (it drops
    the kept rows for later queries and sees up to ``max_size + S - 1`` keys), which is why the
    verify forward does not use it.
    """
    n = min(offset, L)
    shadow = RotatingKVCache(max_size, keep)
    if L:
        tags = np.zeros(L, np.float32)   # 0 marks a row never written
        tags[:n] = np.arange(1, n + 1)
        shadow.keys = shadow.values = mx.array(tags).reshape(1, 1, L, 1)
        shadow.offset, shadow._idx = offset, idx
    mask = np.zeros((S, n + S), bool)
    for i in range(S):
        one = shadow.make_mask(1, window_size=window_size)
        tag = mx.full((1, 1, 1, 1), n + i + 1, mx.float32)
        seen = np.array(shadow.update_and_fetch(tag, tag)[0]).reshape(-1)
        if one is not None:
            seen = seen[np.array(one).reshape(-1)]
        mask[i, seen[seen > 0].astype(np.int64) - 1] = True
    return mask


class _RecordingRotating:
    """Mixin put in front of a ``RotatingKVCache``'s class, per instance (see :func:`attach`).

    With ``_ngram_verify`` off every call is mlx-lm's. During a verify forward the cache is not
    written: ``update_and_fetch`` returns its rows followed by the S new ones (kept for
    :meth:`ngram_keep`), ``keys_and_values`` returns the same once they are given (a layer that
    shares another layer's cache reads it so after that layer's update: gemma3n's KV-shared
    layers), and ``make_mask`` gives :func:`single_step_mask`.
    """

    _ngram_verify = False
    _ngram_new = None

    def make_mask(self, N, window_size=None, return_array=False):
        if not self._ngram_verify:
            return super().make_mask(N, window_size=window_size, return_array=return_array)
        L = 0 if self.keys is None else self.keys.shape[2]
        return mx.array(single_step_mask(L, self.offset, self.keep, self.max_size, self._idx,
                                         window_size, N))

    def update_and_fetch(self, keys, values):
        if not self._ngram_verify:
            return super().update_and_fetch(keys, values)
        self._ngram_new = (keys, values)
        return self.keys_and_values()

    def keys_and_values(self):
        if not (self._ngram_verify and self._ngram_new is not None):
            return super().keys_and_values()
        keys, values = self._ngram_new
        if self.keys is None:
            return keys, values
        old_keys, old_values = super().keys_and_values()
        return mx.concatenate([old_keys, keys], axis=2), mx.concatenate([old_values, values], axis=2)

    def ngram_keep(self, m: int) -> None:
        """Write the first m rows of the last verify forward, one mlx-lm one-token update each."""
        keys, values = self._ngram_new
        self._ngram_new = None
        for t in range(m):
            super().update_and_fetch(keys[..., t:t + 1, :], values[..., t:t + 1, :])


# -- decoder layers re-run alone on their recorded arguments (layer-local replay) -----------------

class _RecordingCall:
    """Mixin put in front of a decoder layer's class, per instance (see :func:`attach`).

    With ``_ngram_verify`` off the call is mlx-lm's. During a verify forward it is mlx-lm's too, and
    the arguments of each call (hidden states, masks, cache, ...) are appended to ``_ngram_calls``.
    """

    _ngram_verify = False
    _ngram_calls = None

    def __call__(self, *args, **kwargs):
        if self._ngram_verify:
            if self._ngram_calls is None:   # an attribute, not a child module (nn.Module keeps lists as items)
                object.__setattr__(self, "_ngram_calls", [])
            self._ngram_calls.append((args, kwargs))
        return super().__call__(*args, **kwargs)


_SCALARS = (type(None), str, bool, int, float)


def _holds_array(value) -> bool:
    if isinstance(value, mx.array):
        return True
    if isinstance(value, (list, tuple)):
        return any(_holds_array(v) for v in value)
    if isinstance(value, dict):
        return any(_holds_array(v) for v in value.values())
    return False


def _first_rows(value, name: str, S: int, m: int, first: bool):
    """``value`` (an argument a decoder layer got in a verify forward over S tokens) as it is for the
    first m tokens, or ``_UNKNOWN``: a mask (a parameter named ``*mask*``) ``[..., S, N + S]`` becomes
    ``[..., m, N + m]`` (the queries of the first m tokens, the keys before them and theirs: what mlx-lm's
    ``create_causal_mask`` gives for m tokens, windowed or not); another array with the S axis second
    (``[B, S, ...]``: hidden states, rwkv7's ``v_first``) keeps its first m rows; None, strings, numbers
    and objects without arrays (caches, "causal") are the same for m tokens. Anything else is unknown."""
    if isinstance(value, mx.array):
        if "mask" in name.lower() and not first:
            if value.ndim >= 2 and value.shape[-2] == S and value.shape[-1] >= S:
                return value[..., :m, :value.shape[-1] - S + m]
            return _UNKNOWN
        if value.ndim >= 2 and value.shape[1] == S:
            return value[:, :m]
        return _UNKNOWN
    if isinstance(value, _SCALARS) or not _holds_array(value):
        return value
    return _UNKNOWN


_UNKNOWN = object()


@functools.lru_cache(maxsize=None)
def _parameter_names(cls: type) -> tuple[str, ...]:
    """The names of ``cls.__call__``'s parameters after ``self`` (empty if they cannot be read)."""
    try:
        return tuple(inspect.signature(cls.__call__).parameters)[1:]
    except (TypeError, ValueError):
        return ()


def _cut_call(layer, args: tuple, kwargs: dict, S: int, m: int) -> tuple[tuple, dict] | None:
    """The arguments of a recorded decoder-layer call cut to the first m tokens, or None if one of
    them is of a kind :func:`_first_rows` does not know."""
    names = _parameter_names(layer._ngram_base)
    cut_args = tuple(_first_rows(v, names[i] if i < len(names) else "", S, m, i == 0)
                     for i, v in enumerate(args))
    cut_kwargs = {k: _first_rows(v, k, S, m, False) for k, v in kwargs.items()}
    if any(v is _UNKNOWN for v in cut_args + tuple(cut_kwargs.values())):
        return None
    return cut_args, cut_kwargs


def _subcaches(value) -> list:
    return list(value.caches) if isinstance(value, CacheList) else [value]


#: Per set of decoder layer classes: whether layer-local replay gave the full replay's caches.
_LAYER_REPLAY: dict[frozenset, bool] = {}
#: Tolerance of that check (the re-run layers see the verify forward's hidden states, computed over S
#: tokens; the full replay recomputes them over m: the same numbers up to float rounding).
LAYER_REPLAY_RTOL, LAYER_REPLAY_ATOL = 1e-4, 1e-5


def layer_replay_qualifies(model: nn.Module) -> bool:
    """Whether :meth:`VerifyCache.keep` may re-run only the decoder layers holding replayed caches.

    Checked once per set of decoder layer classes (:func:`set_layer_replay` may decide instead), on
    random tokens: from a 3-token
    prompt, a verify forward over 5 tokens, then for m = 1 (a single-token cut: masks become one row)
    and m = 3 ``keep(m)`` layer-locally and by the full replay (restore, then the model over the m
    tokens) must leave every cache allclose
    (:data:`LAYER_REPLAY_RTOL`, :data:`LAYER_REPLAY_ATOL`; same shapes), and the layer-local keep must
    have re-run the layers (not fallen back). A model that fails, or raises, keeps the full replay.
    Whatever the comparisons find, the check runs the same forwards (ranks of a sharded model run it
    in lockstep: :meth:`mlx_backend.distributed.sharded.ShardedRun.spec_kwargs`).
    """
    key = _layer_classes(model)
    if key not in _LAYER_REPLAY:
        _LAYER_REPLAY[key] = False   # while checking (the check builds VerifyCaches on this model)
        _LAYER_REPLAY[key] = _replays_layer_locally(model)
    return _LAYER_REPLAY[key]


def set_layer_replay(model: nn.Module, verdict: bool) -> None:
    """Decide :func:`layer_replay_qualifies` for ``model``'s decoder layer classes without the check
    (the ranks of a sharded model agree on one verdict)."""
    _LAYER_REPLAY[_layer_classes(model)] = bool(verdict)


def _layer_classes(model: nn.Module) -> frozenset:
    return frozenset(getattr(l, "_ngram_base", type(l)) for l in getattr(model, "layers", []))


def _live_state(cache) -> Any:
    """What a cache holds for the tokens it has seen (a KV cache's first ``offset`` rows, not its buffer)."""
    if isinstance(cache, ArraysCache):
        return list(cache.cache)
    if isinstance(cache, RotatingKVCache):   # a ring: its buffer as it is
        return cache.state
    if getattr(cache, "keys", None) is not None and isinstance(getattr(cache, "offset", None), int):
        def rows(x):
            return x[..., :cache.offset, :]
        return [cache.offset, tree_map(rows, cache.keys), tree_map(rows, cache.values)]
    return cache.state


def _replays_layer_locally(model: nn.Module, P: int = 3, S: int = 5) -> bool:
    def prefilled(tokens):
        cache = make_prompt_cache(model)
        mx.eval(model(mx.array([tokens]), cache=cache))   # logits evaluated, as a generation loop does
        return cache
    try:
        vocab = model(mx.array([[0]]), cache=make_prompt_cache(model)).shape[-1]
        tokens = mx.random.randint(0, vocab, (P + S,), key=mx.random.key(0)).tolist()
        same = True
        for m in (1, S - 2):   # about ten forwards of at most 5 tokens, once per process and class
            caches = []
            for local in (True, False):
                cache = prefilled(tokens[:P])
                vc = VerifyCache(model, cache, layer_replay=local)
                try:
                    if not vc.replayed:
                        return False
                    mx.eval(vc.forward(tokens[P:]))
                    vc.keep(m)
                    if vc.n_replays != 1 or vc.n_layer_replays != local:
                        return False
                finally:
                    vc.close()
                caches.append([_live_state(c) for top in cache for c in _subcaches(top)])
            mx.eval(caches)   # every array, on every rank (a sharded layer's arrays wait on collectives)
            same = _same_caches(*caches) and same   # and go on: the same forwards whatever it finds
        return same
    except Exception:   # a layer the recorded arguments cannot re-run, a model the check cannot drive
        return False


def _same_caches(mine: list, theirs: list) -> bool:
    a, b = tree_flatten(mine), tree_flatten(theirs)
    if len(a) != len(b):
        return False
    for (_, x), (_, y) in zip(a, b):
        if not isinstance(x, mx.array) or not isinstance(y, mx.array):
            if (x is None) != (y is None):
                return False
        elif x.shape != y.shape or not mx.allclose(x, y, rtol=LAYER_REPLAY_RTOL, atol=LAYER_REPLAY_ATOL).item():
            return False
    return True


def gdn_layer(layer: nn.Module):
    """The GatedDeltaNet module of a decoder layer, or None if it has none."""
    module = getattr(layer, "linear_attn", None)
    return module if isinstance(module, nn.Module) else None


def _snapshot(value):
    """A copy of ``value`` that later in-place writes to its arrays do not reach (arrays get new
    handles; lists, tuples and dicts are copied; other values are kept)."""
    if isinstance(value, mx.array):
        return mx.array(value)
    if type(value) in (list, tuple):
        return type(value)(_snapshot(v) for v in value)
    if isinstance(value, dict):
        return {k: _snapshot(v) for k, v in value.items()}
    return value


def _state_layer_name(layer: nn.Module | None) -> str:
    """Class name of the sub-module of a decoder layer that holds recurrent state (for reports)."""
    if layer is None:
        return "unknown layer"
    for name in ("linear_attn", "mixer", "mamba", "temporal_block", "conv", "attn", "attention",
                 "self_attn", "time_mixer"):
        module = getattr(layer, name, None)
        if isinstance(module, nn.Module):
            return type(module).__name__
    return type(layer).__name__


class VerifyCache:
    """A model and its prompt cache, for verify forwards that can be cut back to any prefix.

    >>> from mlx_backend.models.tiny import tiny_model
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

    def __init__(self, model: nn.Module, cache: list[Any], gdn_path: str | None = None,
                 gdn_checkpoint_every: int | None = None, layer_replay: bool | None = None):
        gdn_path = gdn_path or default_gdn_path()
        if gdn_checkpoint_every is not None and gdn_checkpoint_every < 1:
            raise ValueError(f"gdn_checkpoint_every must be >= 1, got {gdn_checkpoint_every}")
        self.gdn_checkpoint_every = gdn_checkpoint_every   # None: checkpoint_interval(S, state_bytes)
        if gdn_path not in GDN_PATHS:
            raise ValueError(f"gdn_path must be one of {GDN_PATHS}, got {gdn_path!r}")
        self.model, self.cache, self.gdn_path = model, cache, gdn_path
        self.gdn: list[tuple[nn.Module, ArraysCache]] = []
        self.conv: list[tuple[nn.Module, ArraysCache]] = []   # short convs: their nn.Conv1d, their cache
        self.rotating: list[RotatingKVCache] = []
        self.trimmed: list[Any] = []
        self.replayed: list[Any] = []           # restored from a snapshot and re-run (see keep)
        self.replayed_layers: set[str] = set()   # what they hold, for reports
        layers = list(getattr(model, "layers", []))
        for i, top in enumerate(cache):
            layer = layers[i] if len(layers) == len(cache) else None
            for c in (top.caches if isinstance(top, CacheList) else [top]):
                if isinstance(c, ArraysCache):
                    if c.lengths is not None or c.left_padding is not None:
                        raise RollbackUnsupported(f"cache {i} is a batched ArraysCache (lengths / left "
                                                  f"padding); speculative decoding runs batch size 1")
                    recorded = recorded_layer(layer)
                    if recorded is not None:
                        module, mixin = recorded
                        (self.gdn if mixin is _RecordingGDN else self.conv).append((attach(module, mixin), c))
                    else:
                        self.replayed.append(c)
                        self.replayed_layers.add(_state_layer_name(layer))
                elif isinstance(c, RotatingKVCache):
                    self.rotating.append(attach(c, _RecordingRotating))
                elif hasattr(c, "trim") and c.is_trimmable():
                    self.trimmed.append(c)
                else:
                    self.replayed.append(c)
                    self.replayed_layers.add(type(c).__name__)
        self.S = 0
        self.recorded = False
        # the last forward's record of each GDN layer and short conv (as self.gdn + self.conv), taken off the
        # layer: the layers are the model's, shared by every VerifyCache on it, and another run's forward in
        # between must not replace it
        self.records: list | None = None
        self.tokens = self.checkpoint = None
        self.n_replays = 0         # keeps that re-ran kept tokens (conformance's n_replays), either way:
        self.n_layer_replays = 0   # of them, those that re-ran only the decoder layers holding replayed caches
        # layer-local replay (see keep): every replayed cache an ArraysCache, the model qualified
        self.layers: list[nn.Module] = []
        self.calls: list | None = None   # the last forward's recorded decoder-layer calls (_record_calls)
        if self.replayed and all(isinstance(c, ArraysCache) for c in self.replayed) and layers:
            if layer_replay is None:
                layer_replay = layer_replay_qualifies(model)
            if layer_replay:
                self.layers = layers
        self.layer_replay = bool(self.layers)
        # bytes of one recurrent state of every GDN layer together (float32 [Hv, Dv, Dk] each)
        self.state_bytes = sum(4 * g.num_v_heads * g.head_v_dim * g.head_k_dim for g, _ in self.gdn)

    def forward(self, tokens, record: bool | None = None) -> mx.array:
        """Logits ``[S, vocab]`` of the model over ``tokens``, recording what :meth:`keep` needs.

        ``record`` defaults to ``S > 1``: a 1-token forward (nothing to verify) runs mlx-lm's own
        layer and cache code and can then only be kept whole (``keep(1)``).
        """
        tokens = mx.array(tokens, dtype=mx.uint32) if not isinstance(tokens, mx.array) else tokens
        S = tokens.size
        record = S > 1 if record is None else record
        every = self.gdn_checkpoint_every or checkpoint_interval(S, self.state_bytes)
        for layer, _ in self.gdn:
            attach(layer)
            layer._ngram_path = self.gdn_path if record else None
            layer._ngram_every = every
            layer._ngram_record = None
        for conv, _ in self.conv:
            attach(conv, _RecordingConvInput)
            conv._ngram_verify, conv._ngram_record = record, None
        for c in self.rotating:
            attach(c, _RecordingRotating)
            c._ngram_verify, c._ngram_new = record, None
        if record and self.replayed:
            self.tokens, self.checkpoint = tokens, [_snapshot(vars(c)) for c in self.replayed]
        for layer in self.layers:
            attach(layer, _RecordingCall)
            layer._ngram_verify, layer._ngram_calls = record, None
        self.calls = None
        try:
            logits = self.model(tokens.reshape(1, S), cache=self.cache)
        finally:
            if self.layers:
                self.calls = self._record_calls() if record else None
            for layer, _ in self.gdn:
                layer._ngram_path = None
            for conv, _ in self.conv:
                conv._ngram_verify = False
            for c in self.rotating:
                c._ngram_verify = False
            self.records = [take_record(module) for module, _ in self.gdn + self.conv]
        self.S, self.recorded = S, record
        return logits[0]

    def _record_calls(self) -> list | None:
        """The decoder-layer calls of the forward just run that hold the replayed caches, one per layer:
        ``(layer, args, kwargs, trimmed caches of that layer)``; None (then :meth:`keep` replays the
        whole model) unless each replayed cache was passed to exactly one layer call, in a cache
        (or ``CacheList``) whose other parts are all trimmed (offset-addressed KV)."""
        replayed, trimmed = {id(c) for c in self.replayed}, {id(c) for c in self.trimmed}
        calls, covered, ok = [], set(), True
        for layer in self.layers:
            layer._ngram_verify = False
            recorded, layer._ngram_calls = layer._ngram_calls or [], None
            for args, kwargs in recorded:
                held = [v for v in (*args, *kwargs.values())
                        if any(id(c) in replayed for c in _subcaches(v))]
                if not held:
                    continue
                subs = [c for v in held for c in _subcaches(v)]
                ids = {id(c) for c in subs}
                if len(held) != 1 or len(recorded) != 1 or ids & covered or not ids <= replayed | trimmed:
                    ok = False
                covered |= ids
                calls.append((layer, args, kwargs, [c for c in subs if id(c) in trimmed]))
        return calls if ok and replayed <= covered else None

    def keep(self, m: int) -> None:
        """Cut every layer back to the first ``m`` tokens of the last :meth:`forward`.

        Caches neither trimmed, recorded nor rotating (:attr:`replayed`: recurrent layers neither
        recorder knows, other cache types) are exact too: for ``m < S`` they go back to the snapshot
        of their attributes taken before the forward, and the first m tokens are re-run. Where the
        model qualifies (:attr:`layer_replay`) only the decoder layers holding them are re-run, each
        on the first m positions of the arguments it got in the forward (their KV caches trimmed to
        before the forward first); else every layer goes back to before the forward and the model
        re-runs the first m tokens (a second forward).
        """
        if not 0 <= m <= self.S:
            raise ValueError(f"keep(m) needs 0 <= m <= S = {self.S}, got {m}")
        if m < self.S and not self.recorded:
            raise ValueError("keep(m < S) needs a forward with record=True")
        calls, self.calls = self.calls, None
        if m < self.S and self.replayed and calls is not None:
            cut = [_cut_call(layer, args, kwargs, self.S, m) for layer, args, kwargs, _ in calls]
            if all(c is not None for c in cut):
                self._replay_layers(m, calls, cut)
                return
        if m < self.S and self.replayed:
            tokens = self.tokens
            self._cut(0)
            for c, saved in zip(self.replayed, self.checkpoint):
                vars(c).update(saved)
            self.tokens = self.checkpoint = None
            if m:
                self.n_replays += 1
                self.forward(tokens[:m])
                self.keep(m)
            return
        self._cut(m)
        self.tokens = self.checkpoint = None

    def _replay_layers(self, m: int, calls: list, cut: list) -> None:
        """keep(m) by layer-local replay: the replayed caches back to their snapshot, the KV caches of
        the same layers trimmed to before the forward, then each of those layers alone on its cut
        arguments (its output discarded: unevaluated, mlx computes only what the caches need)."""
        rerun = {id(c) for _, _, _, kv in calls for c in kv}
        self._cut(m, before=rerun)
        for c, saved in zip(self.replayed, self.checkpoint):
            vars(c).update(saved)
        self.tokens = self.checkpoint = None
        if m:
            self.n_replays += 1
            self.n_layer_replays += 1
            for (layer, _, _, _), (args, kwargs) in zip(calls, cut):
                layer._ngram_base.__call__(layer, *args, **kwargs)

    def _cut(self, m: int, before: set[int] = frozenset()) -> None:
        if m < self.S:
            for c in self.trimmed:
                c.trim(self.S if id(c) in before else self.S - m)
            for (module, c), rec in zip(self.gdn + self.conv, self.records):
                c[0] = rec.window(m)
                if rec.state0 is not None:   # a GDN layer: its recurrent state too
                    c[1] = rec.state_after(m, module)
        if self.recorded:
            for c in self.rotating:
                c.ngram_keep(m)
        self.records = None
        self.S, self.recorded = 0, False

    def close(self) -> None:
        """Give the GDN layers, the short convs, the rotating caches and the decoder layers back their own class."""
        _detach_all([module for module, _ in self.gdn + self.conv] + self.rotating + self.layers)


def take_record(layer) -> "_Recording | None":
    """The record a GDN layer (or a short conv's nn.Conv1d) left in the forward just run (None if it recorded
    nothing), removed from the layer: the caller (a VerifyCache, a BatchVerifyCache) keeps it, since the layer is the model's, shared
    by every run on it, and another run's forward before this one's keep() would replace it."""
    record = getattr(layer, "_ngram_record", None)
    layer._ngram_record = None
    return record


def _detach_all(layers) -> None:
    for layer in layers:
        detach(layer)
