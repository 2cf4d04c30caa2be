"""The state a model carries between forward passes, and how to save, restore and cut it.

Per layer (names as in mlx-lm's ``ArraysCache`` / ``KVCache``):

* :class:`RecurrentState` (a GatedDeltaNet layer): ``conv`` ``[K-1, conv_dim]``, the last ``K-1``
  rows that entered the causal conv1d, and ``recurrent`` ``[Hv, Dv, Dk]``, the delta-rule matrix
  ``S`` of every value head. Both summarise *all* tokens seen; neither can be shortened after the fact.
* :class:`KVState` (an attention layer): ``keys`` / ``values`` ``[n_kv_heads, T, head_dim]``, one
  row per token seen. Dropping the last rows forgets those tokens exactly ("trimming").

The speculative loop needs the state after the first ``m`` of the ``S`` tokens of a verify forward.
Every forward therefore leaves a *trace* in each layer: for attention the length before it; for a
recurrent layer the whole conv input ``[conv ; S new rows]`` and the recurrent matrix after each of
the S tokens. :meth:`ModelCache.keep` cuts every layer to ``m`` tokens from the trace, with no
second forward pass. :meth:`ModelCache.checkpoint` / :meth:`ModelCache.rollback` copy and restore
the whole state bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


class RecurrentState:
    """A GatedDeltaNet layer's state: ``conv`` (last K-1 conv input rows) and ``recurrent`` ``[Hv, Dv, Dk]``."""

    def __init__(self, conv: np.ndarray, recurrent: np.ndarray):
        self.conv = conv
        self.recurrent = recurrent
        self.trace: tuple[np.ndarray, np.ndarray] | None = None  # (conv_input, states [S+1, Hv, Dv, Dk])

    def record(self, conv_input: np.ndarray, states: np.ndarray) -> None:
        """Commit a forward: ``conv_input = [conv ; S rows]``, ``states[t]`` = recurrent after t tokens."""
        n_keep = self.conv.shape[0]
        self.trace = (conv_input, states)
        self.conv = conv_input[conv_input.shape[0] - n_keep:].copy()
        self.recurrent = states[-1]

    def keep(self, m: int) -> None:
        """Keep the state after the first ``m`` tokens of the traced forward: conv window ending at m, ``S_m``."""
        conv_input, states = self.trace
        self.conv = conv_input[m:m + self.conv.shape[0]].copy()
        self.recurrent = states[m].copy()
        self.trace = None

    def snapshot(self) -> tuple[np.ndarray, np.ndarray]:
        """Copies of the conv window and ``S`` (for :meth:`ModelCache.checkpoint`)."""
        return self.conv.copy(), self.recurrent.copy()

    def restore(self, saved: tuple[np.ndarray, np.ndarray]) -> None:
        """Go back to a :meth:`snapshot` (copied again, so it can be restored twice); the trace is dropped."""
        self.conv, self.recurrent = (a.copy() for a in saved)
        self.trace = None


class KVState:
    """An attention layer's state: ``keys`` / ``values`` ``[n_kv_heads, T, head_dim]``; ``offset`` = T."""

    def __init__(self, keys: np.ndarray, values: np.ndarray):
        self.keys = keys
        self.values = values
        self.trace: int | None = None  # offset before the last forward

    @property
    def offset(self) -> int:
        """T, the tokens the layer has seen."""
        return self.keys.shape[1]

    def append(self, keys: np.ndarray, values: np.ndarray) -> None:
        """Add the rows of a forward (``KVCache.update_and_fetch``) and remember where they start."""
        self.trace = self.offset
        self.keys = np.concatenate([self.keys, keys], axis=1)
        self.values = np.concatenate([self.values, values], axis=1)

    def keep(self, m: int) -> None:
        """Keep the first ``m`` rows of the traced forward: trimming is exact for attention."""
        end = self.trace + m
        self.keys, self.values = self.keys[:, :end], self.values[:, :end]
        self.trace = None

    def snapshot(self) -> tuple[np.ndarray, np.ndarray]:
        """Copies of ``keys`` and ``values`` (for :meth:`ModelCache.checkpoint`)."""
        return self.keys.copy(), self.values.copy()

    def restore(self, saved: tuple[np.ndarray, np.ndarray]) -> None:
        """Go back to a :meth:`snapshot` (copied again, so it can be restored twice); the trace is dropped."""
        self.keys, self.values = (a.copy() for a in saved)
        self.trace = None


LayerState = RecurrentState | KVState


@dataclass(frozen=True)
class Checkpoint:
    """A copy of every layer's state and the token count, taken by :meth:`ModelCache.checkpoint`."""

    offset: int
    layers: tuple


class ModelCache:
    """All layers' state (``layers[i]`` is a :class:`RecurrentState` or :class:`KVState`).

    ``offset`` counts the tokens the state summarises; ``pending`` is the length S of the last forward
    that :meth:`keep` may still cut (0 when there is none).
    """

    def __init__(self, layers: list[LayerState]):
        self.layers = layers
        self.offset = 0
        self.pending = 0

    def begin(self, n_tokens: int) -> None:
        """Called by ``Model.forward`` before it runs over ``n_tokens`` tokens."""
        self.offset += n_tokens
        self.pending = n_tokens

    def keep(self, m: int) -> None:
        """Keep the state after the first ``m`` tokens of the last forward (``0 <= m <= S``), forget the rest.

        No model computation: recurrent layers take the traced state after token m and the conv
        window ``conv_input[m : m+K-1]``; attention layers drop their last ``S - m`` rows.
        """
        if self.pending == 0:
            raise ValueError("keep(m) needs a forward pass to cut: call it once, right after model.forward")
        if not 0 <= m <= self.pending:
            raise ValueError(f"keep(m): m={m} is outside 0..{self.pending} (the last forward's length)")
        for layer in self.layers:
            layer.keep(m)
        self.offset -= self.pending - m
        self.pending = 0

    def checkpoint(self) -> Checkpoint:
        """A copy of the whole state (not of the last forward's trace)."""
        return Checkpoint(self.offset, tuple(layer.snapshot() for layer in self.layers))

    def rollback(self, cp: Checkpoint) -> None:
        """Restore the state of ``cp`` bit for bit; a later :meth:`keep` needs a new forward."""
        for layer, saved in zip(self.layers, cp.layers, strict=True):
            layer.restore(saved)
        self.offset = cp.offset
        self.pending = 0

    def layout(self) -> list[tuple]:
        """Each layer's kind, array sizes (all but the token axis) and dtype: what every cache that one
        model makes shares, whatever it has seen."""
        return [(type(s).__name__, s.keys.shape[0], s.keys.shape[2], s.keys.dtype) if isinstance(s, KVState)
                else (type(s).__name__, s.conv.shape, s.recurrent.shape, s.recurrent.dtype) for s in self.layers]

    def state(self) -> list[dict[str, np.ndarray]]:
        """Every layer's named state arrays, e.g. to compare two caches."""
        return [
            {"conv": s.conv, "recurrent": s.recurrent} if isinstance(s, RecurrentState)
            else {"keys": s.keys, "values": s.values}
            for s in self.layers
        ]
