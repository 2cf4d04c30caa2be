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
* a plain ``ArraysCache`` of any other recurrent layer (Mamba, Mamba2, RWKV7, the mamba / linear-attention
  layers of jamba, nemotron_h, granitemoehybrid, plamo2, ...) that is the only cache of its decoder layer:
  the "layer replay" of :class:`mlx_backend.decode.rollback.VerifyCache`, per row. The forward is mlx-lm's;
  the cache's arrays are kept as they were before it and each such decoder layer's call arguments are
  recorded (:class:`~mlx_backend.decode.rollback._RecordingCall`). ``keep(m)`` leaves the forward's state
  to the rows with ``m[b] = S`` (all their tokens real); every other row, including one that keeps all its
  ``lengths[b] < S`` real tokens (the padding after them advanced its state), is re-run, rows with the
  same ``m[b]`` together: each such decoder layer alone, from those rows of the kept arrays, on those rows
  and the first ``m[b]`` positions of its recorded arguments (:func:`_batch_cut`; the recurrence is causal,
  so the hidden states it got for a row's real positions are that row's own), its output dropped; the
  re-run rows' states are then put back in place. A model qualifies by a check once per set of decoder
  layer classes (:func:`batch_layer_replay_refusal`), else it is refused. The same conditions on
  ``lengths`` and ``left_padding`` hold (mamba2's masks for padded prefill then stay off). A layer whose
  cache shares a ``CacheList`` with a KV cache (falcon_h1) is refused: its re-run would have to cut
  that KV cache per row too.
* ``BatchRotatingKVCache`` (sliding-window layers): not written during the forward, each query masked
  to what its one-token step sees, then rebuilt as ``merge`` would leave it
  (:mod:`mlx_backend.batch.rotating`).
* Everything else raises :class:`~mlx_backend.decode.rollback.RollbackUnsupported` naming the cache
  class: unbatched caches (``KVCache``, ``RotatingKVCache``: merge per-request caches first),
  quantized and chunked caches, ``ArraysCache`` of other recurrent layers sharing a ``CacheList`` or in a
  model that fails the check, custom caches.
"""
from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, BatchKVCache, BatchRotatingKVCache, CacheList

from mlx_backend.decode.rollback import (GDN_PATHS, RollbackUnsupported,
                                         VerifyCache, _RecordingCall, _RecordingConvInput, _RecordingGDN, _UNKNOWN,
                                         _first_rows, _layer_classes, _parameter_names, _same_caches,
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

    ``cache`` is the list of per-layer batch caches (``BatchKVCache``, ``BatchRotatingKVCache``, GDN,
    short-conv and other recurrent layers' ``ArraysCache``), updated in place; caches grown with ``extend``
    or shrunk with ``filter`` between forwards stay valid. ``layer_replay``: whether the model's other
    recurrent layers may be re-run per row (None: :func:`batch_layer_replay_refusal` decides; the
    check itself passes True).
    """

    def __init__(self, model: nn.Module, cache: list[Any], gdn_path: str | None = None,
                 layer_replay: bool | None = None):
        gdn_path = gdn_path or default_gdn_path()
        if gdn_path not in GDN_PATHS:
            raise ValueError(f"gdn_path must be one of {GDN_PATHS}, got {gdn_path!r}")
        self.model, self.cache, self.gdn_path = model, cache, gdn_path
        self.kv: list[BatchKVCache] = []
        self.rotating: list[BatchRotatingKVCache] = []
        self.gdn: list[tuple[nn.Module, ArraysCache]] = []
        self.conv: list[tuple[nn.Module, ArraysCache]] = []   # short convs: their nn.Conv1d, their cache
        self.replayed: list[ArraysCache] = []   # other recurrent layers' caches: re-run per row (keep)
        replayed_names: set[str] = set()
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
                    if recorded is not None:
                        module, mixin = recorded
                        (self.gdn if mixin is _RecordingGDN else self.conv).append((module, c))
                    elif isinstance(top, CacheList):
                        raise RollbackUnsupported(
                            f"cache {i} (ArraysCache) belongs to a recurrent layer "
                            f"({_state_layer_name(layer)}) that is neither "
                            f"a known GatedDeltaNet nor a short conv and shares its layer with another cache "
                            f"(CacheList); batched rollback needs recorded per-token "
                            f"states or a layer re-run on its own: decode one request at a time")
                    else:
                        self.replayed.append(c)
                        replayed_names.add(_state_layer_name(layer))
                else:
                    raise _unsupported(i, c)
        if self.replayed:
            why = ("" if layer_replay else "layer_replay=False given" if layer_replay is False
                   else batch_layer_replay_refusal(model))
            if why:
                raise RollbackUnsupported(
                    f"recurrent layers ({', '.join(sorted(replayed_names))}) that are neither a known "
                    f"GatedDeltaNet nor a short conv, and whose decoder layers failed the batched layer-replay "
                    f"check (batch_layer_replay_refusal: {why}): decode one request at a time")
        self.layers = layers if self.replayed else []   # recorded during a forward (_RecordingCall)
        self.calls: list | None = None   # the last forward's calls holding replayed caches (_record_calls)
        self.checkpoint: list | None = None   # the replayed caches' arrays before the last forward
        self.S = 0
        self.records: list | None = None   # the last forward's GDN and short-conv records (take_record)
        self.lengths: list[int] | None = None
        self.state_bytes = sum(4 * g.num_v_heads * g.head_v_dim * g.head_k_dim for g, _ in self.gdn)

    @property
    def batch_size(self) -> int:
        for c in self.kv + self.rotating:
            return int(c.offset.shape[0])
        for c in [c for _, c in self.gdn + self.conv] + self.replayed:
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
        for c in [c for _, c in self.gdn + self.conv] + self.replayed:
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
        # the replayed caches' arrays as they are (mlx-lm's layers put new arrays in a cache, never write
        # into one: batch_layer_replay_refusal would see it) and the calls holding them; not for one token,
        # which every row keeps
        record = S > 1
        self.checkpoint = [list(c.cache) for c in self.replayed] if record else None
        for layer in self.layers:
            attach(layer, _RecordingCall)
            layer._ngram_verify, layer._ngram_calls = record, None
        self.calls = None
        try:
            logits = self.model(tokens, cache=self.cache)
        finally:
            recorded = [(layer, layer._ngram_calls or []) for layer in self.layers]
            for layer in self.layers:
                layer._ngram_verify, layer._ngram_calls = False, None
            for layer, _ in self.gdn:
                layer._ngram_path = None
            for conv, _ in self.conv:
                conv._ngram_verify = False
            for c in self.rotating:
                c._ngram_verify = False
        # this forward's, kept here (take_record)
        self.records = [take_record(module) for module, _ in self.gdn + self.conv]
        self.S, self.lengths = S, lengths
        if record and self.replayed:
            self.calls = self._record_calls(recorded)
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
        if self.replayed:
            self._replay_rows(m)
        self.records = self.calls = self.checkpoint = None
        self.S, self.lengths = 0, None

    def _record_calls(self, recorded: list) -> list:
        """Of the decoder-layer calls of the forward just run (``recorded``: each layer and its calls), those
        that got a replayed cache: ``(layer, its mlx-lm class, args, kwargs, cache)``, one per replayed cache,
        in :attr:`replayed`'s order (the class kept: a solo run on the same model may detach the layer before
        :meth:`keep`). Raises RollbackUnsupported (the batch cache then holds the whole forward)
        unless each replayed cache went to exactly one call of one decoder layer, as the cache itself (its
        other arguments are cut at :meth:`keep`, which refuses one :func:`_batch_cut` does not know)."""
        held: dict[int, tuple] = {}
        ok = True
        for layer, calls in recorded:
            for args, kwargs in calls:
                mine = [v for v in (*args, *kwargs.values()) if any(v is c for c in self.replayed)]
                if not mine:
                    continue
                if len(mine) != 1 or id(mine[0]) in held or len(calls) != 1:
                    ok = False
                held[id(mine[0])] = (layer, layer._ngram_base, args, kwargs, mine[0])
        calls = [held.get(id(c)) for c in self.replayed]
        if not ok or any(call is None for call in calls):
            raise RollbackUnsupported("a recurrent layer's verify call could not be recorded for a per-row "
                                      "re-run: decode this model one request at a time")
        return calls

    def _replay_rows(self, m: list[int]) -> None:
        """The replayed caches after :meth:`keep`: a row that keeps all S tokens keeps the forward's state;
        every other row (fewer tokens kept, or padding after its real ones that advanced its state) gets,
        rows keeping the same number a together, its decoder layer re-run alone from the snapshot rows on
        the first a positions of the layer's recorded arguments; the rows are then put back in place."""
        B, S = len(m), self.S
        groups: dict[int, list[int]] = {}
        for b, a in enumerate(m):
            if a < S:
                groups.setdefault(a, []).append(b)
        if not groups:
            return
        order = [b for rows in groups.values() for b in rows]
        where = list(range(B))
        for j, b in enumerate(order):
            where[b] = B + j   # row b's state: in the replayed rows, after the forward's B
        results = {id(c): [] for c in self.replayed}
        for a, rows in groups.items():
            index = mx.array(rows)
            for (layer, base, args, kwargs, cache), saved in zip(self.calls, self.checkpoint):
                part = ArraysCache(len(saved))
                part.cache = [None if x is None else x[index] for x in saved]
                cut = _batch_cut(base, args, kwargs, cache, rows, B, S, a, part)
                if cut is None:   # before any state is put back: the batch cache holds the whole forward
                    raise RollbackUnsupported(f"a recurrent layer's verify call ({base.__name__}) has an argument "
                                              "a per-row re-run cannot cut: decode this model one request at a time")
                cut_args, cut_kwargs = cut
                base.__call__(layer, *cut_args, **cut_kwargs)   # output unused: only the state
                results[id(cache)].append(part.cache)
        where = mx.array(where)
        for c in self.replayed:
            parts = results[id(c)]
            c.cache = [x if x is None else mx.concatenate([x, *(p[k] for p in parts)])[where]
                       for k, x in enumerate(c.cache)]

    @staticmethod
    def _states_after(layer, rec, m: list[int]) -> mx.array:
        """Row b's recurrent state after its first m[b] tokens, for every row."""
        states = {a: rec.state_after(a, layer) for a in sorted(set(m))}   # one per distinct m
        picked = [states[a][b:b + 1] for b, a in enumerate(m)]
        return mx.concatenate(picked, axis=0) if len(picked) > 1 else picked[0]

    def close(self, align: bool = True) -> None:
        """Give the GDN layers, the short convs, the decoder layers and the caches their own class back (with
        ``align``, the attention rows right-aligned first, as mlx-lm keeps them; without, for caches about
        to be dropped)."""
        for c in self.kv:
            if align:
                c.align()
        for obj in [module for module, _ in self.gdn + self.conv] + self.rotating + self.kv + self.layers:
            detach(obj)


def _batch_cut(base: type, args: tuple, kwargs: dict, cache, rows: list[int], B: int, S: int, m: int, part):
    """A recorded call of a decoder layer (of mlx-lm's class ``base``) in a batched verify forward cut to
    ``rows`` and their first m tokens, ``cache`` replaced by ``part``; None if an argument is of a kind
    this does not know. An array whose
    first axis is the batch (B) keeps those rows (one of a single row, broadcast, stays); one with no other
    axis (a value per row) is then kept as it is, any other has its tokens cut as
    :func:`mlx_backend.decode.rollback._first_rows` cuts a single sequence's."""
    names = _parameter_names(base)
    index = mx.array(rows)

    def cut(value, name, first):
        if value is cache:
            return part
        if isinstance(value, mx.array):
            if value.ndim == 0 or value.shape[0] not in (1, B):
                return _UNKNOWN
            if value.shape[0] == B and B > 1:
                value = value[index]
            if value.ndim == 1:   # one value per row (bailing_hybrid's offsets): the same for m tokens
                return value
        return _first_rows(value, name, S, m, first)

    cut_args = tuple(cut(v, names[i] if i < len(names) else "", i == 0) for i, v in enumerate(args))
    cut_kwargs = {k: cut(v, k, False) for k, v in kwargs.items()}
    if any(v is _UNKNOWN for v in cut_args + tuple(cut_kwargs.values())):
        return None
    return cut_args, cut_kwargs


#: Per set of decoder layer classes: why per-row layer replay in a batch does not qualify ("": it does).
_BATCH_LAYER_REPLAY: dict[frozenset, str] = {}


def batch_layer_replay_refusal(model: nn.Module) -> str:
    """Why :class:`BatchVerifyCache` may not cut back, per row, the recurrent layers that are neither a
    GatedDeltaNet nor a short conv by re-running their decoder layers alone (:meth:`BatchVerifyCache.keep`),
    in a few words: the caches differed, or what the check raised (e.g. mlx-lm's ``merge`` of its caches);
    "" where it may.

    Checked once per set of decoder layer classes, on random tokens: three rows (prompts of 3, 2 and 1
    tokens) merged into batch caches, a verify forward with lengths 4, 4, 3 (S = 4), then keep(4, 2, 3)
    (all kept; a cut; all real tokens kept after padding) must leave each row's caches allclose
    (:data:`~mlx_backend.decode.rollback.LAYER_REPLAY_RTOL`, ``LAYER_REPLAY_ATOL``) to the row alone:
    its prompt, then a solo :class:`~mlx_backend.decode.rollback.VerifyCache` forward over its real tokens
    cut back by the full replay (the model re-run on the kept tokens). A model that fails, or raises,
    is not batched.
    """
    key = _layer_classes(model)
    if key not in _BATCH_LAYER_REPLAY:
        _BATCH_LAYER_REPLAY[key] = _batch_replays_layer_locally(model)
    return _BATCH_LAYER_REPLAY[key]


def _batch_replays_layer_locally(model: nn.Module) -> str:
    from mlx_lm.models.cache import make_prompt_cache

    def prefilled(prompt):
        cache = make_prompt_cache(model)
        if prompt:
            mx.eval(model(mx.array([prompt]), cache=cache))
        return cache

    try:
        vocab = model(mx.array([[0]]), cache=make_prompt_cache(model)).shape[-1]
        tokens = mx.random.randint(0, vocab, (24,), key=mx.random.key(1)).tolist()
        prompts, lengths, m, S = [tokens[:3], tokens[3:5], tokens[5:6]], [4, 4, 3], [4, 2, 3], 4
        rows = [tokens[8 + 4 * b:8 + 4 * b + n] for b, n in enumerate(lengths)]
        solo = [prefilled(p) for p in prompts]
        batch = [solo[0][i].merge([s[i] for s in solo]) for i in range(len(solo[0]))]
        bvc = BatchVerifyCache(model, batch, layer_replay=True)
        try:
            mx.eval(bvc.forward([r + [0] * (S - len(r)) for r in rows], lengths))
            bvc.keep(m)
        finally:
            bvc.close(align=False)
        same = True
        for b in range(len(prompts)):
            alone = prefilled(prompts[b])
            vc = VerifyCache(model, alone, layer_replay=False)
            try:
                mx.eval(vc.forward(rows[b]))
                vc.keep(m[b])
            finally:
                vc.close()
            mine = [list(c.cache) for c in batch if type(c) is ArraysCache]
            theirs = [list(c.cache) for c in alone if type(c) is ArraysCache]
            mine = [[None if x is None else x[b:b + 1] for x in c] for c in mine]
            same = _same_caches(mine, theirs) and same
        return "" if same else "a row's caches differed from the row decoded alone"
    except Exception as exc:   # a layer the recorded arguments cannot re-run, caches mlx-lm cannot merge
        return f"it raised {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".rstrip(": ")
