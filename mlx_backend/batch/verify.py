"""Verify forwards over a *batch* of sequences, each then cut back to its own accepted prefix, exactly.

A batched verify forward runs the model over ``tokens [B, S]``: row b holds ``lengths[b]`` real
tokens (its last emitted token, then its drafts), right-padded to S. Afterwards row b may keep only
its first ``m[b]`` tokens (``1 <= m[b] <= lengths[b]``). :class:`BatchVerifyCache` does both over
the batched prompt cache of mlx-lm's ``BatchGenerator`` (per-layer caches built with the caches'
own ``merge`` of per-request caches, grown with ``extend``, shrunk with ``filter``):

* ``BatchKVCache`` (attention): the forward is mlx-lm's own. Row b's queries sit at RoPE positions
  ``offset[b] .. offset[b] + S - 1`` (``offset`` is a per-row array) and the cache's causal mask lets a
  real query see only the keys up to itself, so the right padding after a row's real tokens never
  reaches them. ``keep(m)`` moves row b's end back by its surplus ``S - m[b]`` and its ``offset``
  with it (:class:`mlx_backend.batch.ragged._RaggedKV`, given to the verifier's attention caches: rows
  may end at different columns, the mask follows each row's end, and no key is moved). Row b's next
  token then sits at position ``offset[b]`` = its real length and sees exactly its real keys: what
  m[b] one-token steps would have left (no second forward).
* ``ArraysCache(size=2)`` of a GatedDeltaNet layer (qwen3_5, qwen3_5_moe, qwen3_next; recognised by
  :func:`mlx_backend.decode.rollback.gdn_projections`): the verify forward runs the recording layer of
  :mod:`mlx_backend.decode.rollback` (one token at a time, every per-token recurrent state kept, or
  the "replay" path), which is batch-agnostic; the right padding of a row comes after its real
  tokens, so (the recurrence being causal) its states up to ``lengths[b]`` are unaffected.
  ``keep(m)`` sets row b's conv window to ``conv_input[b, m[b] : m[b] + K - 1]`` and its recurrent
  state to the recorded state after token m[b]. The cache must carry no ``lengths`` and no nonzero
  ``left_padding`` (mlx-lm's masks for padded prefill); an all-zero ``left_padding`` (what ``merge``
  of empty caches leaves) is the same as none and is dropped.
* ``ArraysCache(size=1)`` of a short convolution whose cache is its conv window (lfm2, lfm2_moe,
  lfm2-vl; :func:`mlx_backend.decode.rollback.conv_window_layer`): the forward is mlx-lm's, its
  ``nn.Conv1d`` keeps its input ``[window ; S new rows]`` (padding rows come after a row's real ones);
  ``keep(m)`` sets row b's window to rows ``m[b] .. m[b] + K - 2`` of it, as for a GDN layer's window.
  The same conditions on ``lengths`` and ``left_padding`` hold.
* ``BatchRotatingKVCache`` (sliding-window layers): not written during the forward, each query masked
  to what its one-token step sees, then rebuilt as ``merge`` would leave it
  (:mod:`mlx_backend.batch.rotating`).
* Everything else raises :class:`~mlx_backend.decode.rollback.RollbackUnsupported` naming the cache
  class: unbatched caches (``KVCache``, ``RotatingKVCache``: merge per-request caches first),
  quantized and chunked caches, ``ArraysCache`` of other recurrent layers, custom caches.
"""
from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, BatchKVCache, BatchRotatingKVCache, CacheList

from mlx_backend.decode.rollback import (GDN_PATHS, RollbackUnsupported, _RecordingConvInput, _RecordingGDN,
                                         _state_layer_name, attach, checkpoint_interval, default_gdn_path,
                                         detach, recorded_layer, take_record)
from mlx_backend.batch.ragged import _RaggedKV
from mlx_backend.batch.rotating import _VerifyingRotating, keep_rows


def _unsupported(i: int, c: Any) -> RollbackUnsupported:
    name = type(c).__name__
    if name in ("KVCache", "RotatingKVCache"):
        how = ("a per-request cache: build the batch cache with the cache's own merge([...]) "
               "(BatchKVCache / BatchRotatingKVCache)")
    else:
        how = "no exact batched rollback is known for it; decode this model one request at a time"
    return RollbackUnsupported(f"cache {i} ({name}): {how}")


class BatchVerifyCache:
    """A model and its batched prompt cache, for verify forwards cut back per row (module docstring).

    ``cache`` is the list of per-layer batch caches (``BatchKVCache``, ``BatchRotatingKVCache``, GDN and
    short-conv ``ArraysCache``), updated in place; caches grown with ``extend`` or shrunk with ``filter``
    between forwards stay valid.
    """

    def __init__(self, model: nn.Module, cache: list[Any], gdn_path: str | None = None):
        gdn_path = gdn_path or default_gdn_path()
        if gdn_path not in GDN_PATHS:
            raise ValueError(f"gdn_path must be one of {GDN_PATHS}, got {gdn_path!r}")
        self.model, self.cache, self.gdn_path = model, cache, gdn_path
        self.kv: list[BatchKVCache] = []
        self.rotating: list[BatchRotatingKVCache] = []
        self.gdn: list[tuple[nn.Module, ArraysCache]] = []
        self.conv: list[tuple[nn.Module, ArraysCache]] = []   # short convs: their nn.Conv1d, their cache
        layers = list(getattr(model, "layers", []))
        for i, top in enumerate(cache):
            layer = layers[i] if len(layers) == len(cache) else None
            for c in (top.caches if isinstance(top, CacheList) else [top]):
                if isinstance(c, BatchKVCache):
                    self.kv.append(attach(c, _RaggedKV))
                elif isinstance(c, BatchRotatingKVCache):
                    self.rotating.append(attach(c, _VerifyingRotating))
                elif type(c) is ArraysCache:
                    recorded = recorded_layer(layer)
                    if recorded is None:
                        raise RollbackUnsupported(
                            f"cache {i} (ArraysCache) belongs to a recurrent layer "
                            f"({_state_layer_name(layer)}) that is neither "
                            f"a known GatedDeltaNet nor a short conv; batched rollback needs recorded per-token "
                            f"states: decode one request at a time")
                    module, mixin = recorded
                    (self.gdn if mixin is _RecordingGDN else self.conv).append((module, c))
                else:
                    raise _unsupported(i, c)
        self.S = 0
        self.records: list | None = None   # the last forward's GDN and short-conv records (take_record)
        self.lengths: list[int] | None = None
        self.state_bytes = sum(4 * g.num_v_heads * g.head_v_dim * g.head_k_dim for g, _ in self.gdn)

    @property
    def batch_size(self) -> int:
        for c in self.kv + self.rotating:
            return int(c.offset.shape[0])
        for _, c in self.gdn + self.conv:
            return c.batch_size
        return 0

    def check_state(self) -> None:
        """Refuse a cache in the middle of a padded prefill (RollbackUnsupported); drop a GatedDeltaNet
        cache's all-zero ``left_padding`` (what ``merge`` of an empty cache leaves), which mlx-lm's layers
        would otherwise count down below zero with every token. Run before every forward of the batch."""
        for c in self.kv + self.rotating:
            if getattr(c, "_right_padding", None) is not None or getattr(c, "_lengths", None) is not None:
                raise RollbackUnsupported(f"a {type(c).__name__} has a right-padded prefill pending: "
                                          f"finalize() it before a verify forward")
        for _, c in self.gdn + self.conv:
            if c.lengths is not None:
                raise RollbackUnsupported("a recurrent ArraysCache has `lengths` set (a right-padded "
                                          "prefill in progress): finalize() it before a verify forward")
            if c.left_padding is not None:
                if max(c.left_padding.tolist(), default=0) != 0:
                    raise RollbackUnsupported("a recurrent ArraysCache has nonzero left_padding (a "
                                              "left-padded prefill): prefill rows alone, then merge")
                c.left_padding = None   # all zero: the same as no mask

    def forward(self, tokens, lengths: Sequence[int]) -> mx.array:
        """Logits ``[B, S, vocab]`` of the model over ``tokens [B, S]`` (row b: ``lengths[b]`` real tokens,
        right-padded), recording what :meth:`keep` needs. Logits past a row's length are meaningless."""
        tokens = tokens if isinstance(tokens, mx.array) else mx.array(tokens, dtype=mx.uint32)
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be [B, S], got shape {tokens.shape}")
        B, S = tokens.shape
        lengths = [int(n) for n in lengths]
        if len(lengths) != B or any(not 1 <= n <= S for n in lengths):
            raise ValueError(f"lengths must hold B = {B} values in 1..S = {S}, got {lengths}")
        if self.batch_size and self.batch_size != B:
            raise ValueError(f"tokens hold {B} rows but the cache holds {self.batch_size}")
        self.check_state()
        every = checkpoint_interval(S, self.state_bytes * B)
        for layer, _ in self.gdn:
            attach(layer)
            layer._ngram_path, layer._ngram_every, layer._ngram_record = self.gdn_path, every, None
        for conv, _ in self.conv:
            attach(conv, _RecordingConvInput)
            conv._ngram_verify, conv._ngram_record = True, None
        for c in self.rotating:
            attach(c, _VerifyingRotating)
            c._ngram_verify, c._ngram_new = True, None
        try:
            logits = self.model(tokens, cache=self.cache)
        finally:
            for layer, _ in self.gdn:
                layer._ngram_path = None
            for conv, _ in self.conv:
                conv._ngram_verify = False
            for c in self.rotating:
                c._ngram_verify = False
        # this forward's, kept here (take_record)
        self.records = [take_record(module) for module, _ in self.gdn + self.conv]
        self.S, self.lengths = S, lengths
        return logits

    def keep(self, m: Sequence[int]) -> None:
        """Cut row b back to the first ``m[b]`` tokens of the last :meth:`forward` (``1 <= m[b] <= lengths[b]``)."""
        if self.lengths is None:
            raise ValueError("keep() needs a forward() first")
        m = [int(x) for x in m]
        if len(m) != len(self.lengths) or any(not 1 <= a <= n for a, n in zip(m, self.lengths)):
            raise ValueError(f"keep(m) needs 1 <= m[b] <= lengths[b] = {self.lengths}, got {m}")
        surplus = [self.S - a for a in m]
        for c in self.kv:
            c.trim_rows(surplus)
        for c in self.rotating:
            keep_rows(c, m)
        for (module, c), rec in zip(self.gdn + self.conv, self.records):
            c[0] = rec.window(m)
            if rec.state0 is not None:   # a GDN layer: its recurrent state too
                c[1] = self._states_after(module, rec, m)
        self.records = None
        self.S, self.lengths = 0, None

    @staticmethod
    def _states_after(layer, rec, m: list[int]) -> mx.array:
        """Row b's recurrent state after its first m[b] tokens, for every row."""
        states = {a: rec.state_after(a, layer) for a in sorted(set(m))}   # one per distinct m
        picked = [states[a][b:b + 1] for b, a in enumerate(m)]
        return mx.concatenate(picked, axis=0) if len(picked) > 1 else picked[0]

    def close(self, align: bool = True) -> None:
        """Give the GDN layers, the short convs and the caches their own class back (with ``align``, the attention rows
        right-aligned first, as mlx-lm keeps them; without, for caches about to be dropped)."""
        for c in self.kv:
            if align:
                c.align()
        for obj in [module for module, _ in self.gdn + self.conv] + self.rotating + self.kv:
            detach(obj)
