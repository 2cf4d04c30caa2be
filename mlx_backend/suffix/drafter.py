"""The fast suffix drafter: :mod:`reference.suffix.drafter`'s rule, draft for draft, on "latest end"
hash indexes (:mod:`mlx_backend.suffix.index`).

The rule: with ``T`` the sequence so far (``n`` tokens) and the history's sequences, find the largest
ladder length ``m <= min(n, max_match)`` whose suffix ``T[n-m:n]`` occurred earlier followed by a
token -- in ``T`` itself first, else in the newest history sequence holding it -- at its latest end ``e``;
measure the match length ``L <= max_match`` backwards from there, and draft the
``n_d = min(k, floor(factor * L))`` tokens that followed ``e`` (copied LZ77-style in ``T``, up to the
history sequence's end).

How: the drafter indexes ``T`` as it grows (an append indexes the windows ending at the new position:
O(len(LADDER)) table writes, amortized over the table's doublings), and a draft makes one lookup per
ladder length in ``T``'s index and one in the history's, verifying tokens on a hit: its cost does not
depend on ``n``. The history concatenates its sequences, each followed by a separator, into one indexed
corpus; as the reference drops the oldest sequences, positions before the first live one are ignored
(with latest ends, a window whose latest end was dropped has no live occurrence), and the corpus is
compacted and re-indexed once the dropped positions outnumber the live ones (amortized O(len(LADDER))
per token added).

State memory per token of context: 4 bytes of token, 8 of prefix hash, and the table's 8-byte slots,
one per distinct (length, window) key at a load of 35..70 %. English text (``reference/data/persuasion.i32``,
default ladder: ``tests/mlx_backend/suffix/test_bench_suffix.py``) has 10.1..10.7 distinct keys per token
of the ladder's 12, so 130..245 bytes per token: 155 measured at 1M tokens (a 128 MiB table). A history
takes as much per position it holds: its live tokens, plus at most as many dropped ones not yet compacted.

>>> d = SuffixDrafter()
>>> d.reset([5, 1, 2, 3, 4, 9, 1, 2])
>>> d.draft(8), d.match_length
([3, 4, 9, 1, 2, 3, 4, 9], 2)
>>> h = SuffixHistory(max_tokens=100)
>>> h.add([7, 8, 9, 10])
>>> d = SuffixDrafter(h)
>>> d.reset([1, 8, 9])
>>> d.draft(4), d.match_length     # "8 9" followed by 10 in the history, which then ends
([10], 2)
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

import numpy as np

from mlx_backend.suffix.index import SEP, LatestEnds, draft
from reference.ngram.tokens import INT32_MAX, check_range, check_token_list
from reference.suffix.drafter import FACTOR, HISTORY_MAX_TOKENS, LADDER, MAX_MATCH, check_settings

MAX_POSITIONS = 1 << 32  # an index stores positions in 32 bits
MAX_HISTORY_TOKENS = MAX_POSITIONS // 8  # a history uses < 5 positions per token kept (separators, dropped ones)


def as_tokens(tokens: Iterable[int]) -> np.ndarray | list[int]:
    """``tokens``, each checked to be a valid id (0 <= t <= 2**31-1): an integer array as int32, anything
    else as a list of ints (written into the buffers as it is)."""
    if isinstance(tokens, np.ndarray) and tokens.dtype.kind in "iu":
        t = tokens.reshape(-1)
        check_range(t, "tokens")
        return t.astype(np.int32, copy=False)
    if type(tokens) is not list:
        tokens = list(tokens)
    for t in tokens:  # a step's few ints, checked in microseconds
        if type(t) is not int or not 0 <= t <= INT32_MAX:
            return check_token_list(tokens)
    return tokens


class SuffixHistory:
    """Earlier sequences, oldest first, bounded by tokens, as :class:`reference.suffix.drafter.SuffixHistory`:
    ``add`` appends a sequence (its last ``max_tokens`` tokens) and drops the oldest ones while the total
    exceeds ``max_tokens``. Indexed once for every drafter that shares it (they only read it).

    >>> h = SuffixHistory(max_tokens=5)
    >>> h.add([1, 2, 3]); h.add([4, 5]); h.add([6])
    >>> h.sequences, h.n_tokens
    ([[4, 5], [6]], 3)
    """

    def __init__(self, max_tokens: int = HISTORY_MAX_TOKENS):
        if not 0 <= max_tokens <= MAX_HISTORY_TOKENS:
            raise ValueError(f"the history's max_tokens must be in [0, {MAX_HISTORY_TOKENS}], got {max_tokens}")
        self.max_tokens = max_tokens
        self.n_tokens = 0
        self._spans: deque[tuple[int, int]] = deque()  # (start, length) of each live sequence in _buf
        self._buf = np.full(1024, SEP, np.int32)         # the sequences, each followed by SEP
        self._hash = np.zeros(1025, np.uint64)           # prefix hashes of _buf
        self._n = 0                                      # positions used
        self._live = 0                                   # positions before it belong to dropped sequences
        self._index = LatestEnds(LADDER)

    @property
    def sequences(self) -> list[list[int]]:
        return [self._buf[s:s + length].tolist() for s, length in self._spans]

    def add(self, tokens: Iterable[int]) -> None:
        seq = as_tokens(tokens)[-self.max_tokens:] if self.max_tokens else []
        size = len(seq)
        if size:
            if self._n + size + 1 > self._buf.size:
                self._compact(size + 1)
            start = self._n
            self._buf[start:start + size] = seq
            self._buf[start + size] = SEP
            self._n = start + size + 1
            self._spans.append((start, size))
            self.n_tokens += size
            self._index.add(self._buf, self._hash, start, self._n, 0, self._live)
        while self.n_tokens > self.max_tokens:
            self.n_tokens -= self._spans.popleft()[1]
            self._live = self._spans[0][0] if self._spans else self._n
        if self._live > self._n - self._live:
            self._compact(0)

    def cover(self, lengths: Iterable[int]) -> None:
        """Index the ladder ``lengths`` too (a drafter's that shares this history)."""
        have = set(self._index.lengths.tolist())
        if not set(lengths) <= have:
            self._index = LatestEnds(have | set(lengths))
            self._index.rebuild(self._buf, self._hash, self._live, self._n, self._window_room())

    def corpus(self) -> tuple:
        """The history's arguments of :func:`mlx_backend.suffix.index.draft`: the buffer, its prefix hashes,
        its table and hash mask, and the live positions' range."""
        return self._buf, self._hash, self._index.slots, self._index.hash_mask, self._live, self._n

    def _window_room(self) -> int:
        return len(self._index.lengths) * (self._n - self._live)

    def _compact(self, extra: int) -> None:
        """Move the live sequences to the start of a buffer with room for ``extra`` more positions (at most
        half full) and index them afresh."""
        live = self._n - self._live
        buf = np.full(1 << max(10, (2 * (live + extra) - 1).bit_length()), SEP, np.int32)
        buf[:live] = self._buf[self._live:self._n]
        self._spans = deque((s - self._live, length) for s, length in self._spans)
        self._buf, self._hash = buf, np.zeros(buf.size + 1, np.uint64)
        self._n, self._live = live, 0
        self._index.rebuild(self._buf, self._hash, 0, live, self._window_room())


class SuffixDrafter:
    """Drafts by the rule of this module from the sequence it has seen and ``history`` (a
    :class:`SuffixHistory` of this module, read only: the caller adds finished sequences to it).

    After each :meth:`draft`, :attr:`match_length` is ``L`` (0: no match). :attr:`tokens` is a read-only
    int32 view of the sequence.
    """

    def __init__(self, history: SuffixHistory | None = None, *, factor: float = FACTOR,
                 max_match: int = MAX_MATCH, ladder: Sequence[int] = LADDER):
        self.ladder = check_settings(factor, max_match, ladder)
        if history is not None and not isinstance(history, SuffixHistory):
            raise TypeError(f"history must be a {__name__}.SuffixHistory, got "
                            f"{type(history).__module__}.{type(history).__qualname__}")
        self.history, self.factor, self.max_match = history, factor, max_match
        self._factor = float(factor)
        lengths = [m for m in self.ladder if m <= max_match]  # the lengths the rule can choose
        self._index = LatestEnds(lengths)
        self._lengths_desc = self._index.lengths[::-1].copy()
        self._history = history if history is not None else SuffixHistory(0)
        self._history.cover(lengths)
        self._buf = np.zeros(1024, np.int32)
        self._hash = np.zeros(1025, np.uint64)
        self._n = 0
        self._out = np.zeros(int(factor * max_match) + 1, np.int32)  # n_d <= factor * L <= factor * max_match
        self.match_length = 0

    @property
    def tokens(self) -> np.ndarray:
        v = self._buf[:self._n]
        v.flags.writeable = False
        return v

    def reset(self, prompt: Sequence[int]) -> None:
        prompt = as_tokens(prompt)
        self._n = 0
        self._index.clear(len(self._index.lengths) * len(prompt))
        self.match_length = 0
        self._append(prompt)

    def extend(self, tokens: Iterable[int]) -> None:
        self._append(as_tokens(tokens))

    def _append(self, t: np.ndarray | list[int]) -> None:
        n, m = self._n, len(t)
        if n + m > MAX_POSITIONS:
            raise ValueError(f"a sequence holds at most {MAX_POSITIONS} tokens")
        if n + m > self._buf.size:
            size = max(2 * self._buf.size, n + m)
            buf, hashes = np.zeros(size, np.int32), np.zeros(size + 1, np.uint64)
            buf[:n], hashes[:n + 1] = self._buf[:n], self._hash[:n + 1]
            self._buf, self._hash = buf, hashes
        if m == 1:
            self._buf[n] = t[0]
        else:
            self._buf[n:n + m] = t
        self._n = n + m
        self._index.add(self._buf, self._hash, n, n + m, n, 0)

    def draft(self, k: int) -> list[int]:
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        n_d, L = draft(self._buf, self._hash, self._n, self._index.slots, self._index.hash_mask,
                       *self._history.corpus(), self._index.pow, self._lengths_desc, self.max_match, self._factor, k,
                       self._out)
        self.match_length = int(L)
        return self._out[:n_d].tolist()
