"""An n-gram cache: the counts ``c(eta, y)`` of how often token ``y`` followed n-gram ``eta``.

llama.cpp (``common/ngram-cache.h:15-61``) keeps one ``unordered_map`` from a 4-slot n-gram (padded
with -1) to an inner map ``token -> count``; n-grams of different sizes are different keys of the
same map. Here the key is the plain tuple of the n-gram's tokens, so its length *is* its size:

>>> c = NgramCache()
>>> c.update([5, 6, 5, 6, 5], n_new=5, n_min=1, n_max=2)
>>> c.counts[(5,)], c.counts[(5, 6)]
({6: 2}, {5: 2})
>>> c.total()  # 4 positions of size 1 and 3 of size 2
7

Caches compare as multisets of ``(n-gram, token, count)``, whatever order they were built in.
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Sequence

LLAMA_NGRAM_MIN = 1  # ngram-cache.h:9
LLAMA_NGRAM_MAX = 4  # ngram-cache.h:10
LLAMA_NGRAM_STATIC = 2  # ngram-cache.h:11: lookup-create stores 2-grams only
TOKEN_NULL = -1  # LLAMA_TOKEN_NULL, the padding of unused n-gram slots in cache files

Ngram = tuple[int, ...]


class NgramCache:
    """Counts ``c(eta, y)``: ``counts[eta][y]`` for n-grams ``eta`` (tuples of 1..4 tokens); llama.cpp's
    ``common_ngram_cache``, a map from n-gram to a ``common_ngram_cache_part`` of follower counts (h:58-61).

    Every stored count is positive; an n-gram is present only if some token followed it.
    """

    def __init__(self, counts: dict[Ngram, dict[int, int]] | None = None):
        self.counts: dict[Ngram, dict[int, int]] = {} if counts is None else counts

    def update(self, inp: Sequence[int], n_new: int, n_min: int = LLAMA_NGRAM_MIN,
               n_max: int = LLAMA_NGRAM_MAX) -> None:
        """Count the followers of the last ``n_new`` tokens of ``inp`` (``common_ngram_cache_update``,
        ngram-cache.cpp:11-51).

        For ``n = n_min..n_max`` and every position ``i`` with ``max(N - n_new, n) <= i < N``:
        ``c(inp[i-n:i], inp[i]) += 1``. If ``inp`` only grows and ``n_new`` is the number of tokens
        appended since the last call, every (n-gram, next token) occurrence is counted exactly once.

        >>> c = NgramCache()
        >>> c.update([1, 2, 3], n_new=3, n_min=2, n_max=2)   # the static-cache build: 2-grams only
        >>> c.counts
        {(1, 2): {3: 1}}
        >>> c.update([1, 2, 3, 1], n_new=1, n_min=2, n_max=2)   # one token appended
        >>> sorted(c.counts)
        [(1, 2), (2, 3)]
        """
        if n_new < 0:
            raise ValueError(f"n_new must be >= 0, got {n_new}")
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= n_min <= n_max, got n_min={n_min}, n_max={n_max}")
        N = len(inp)
        # Only the tail that the new positions' n-grams reach is needed; plain ints hash fastest.
        lo = max(0, N - n_new - n_max)
        tail = [int(t) for t in inp[lo:N]]
        for n in range(n_min, n_max + 1):
            for i in range(max(N - n_new, n), N):
                eta = tuple(tail[i - n - lo:i - lo])
                y = tail[i - lo]
                part = self.counts.get(eta)
                if part is None:
                    self.counts[eta] = {y: 1}
                else:
                    part[y] = part.get(y, 0) + 1

    def merge(self, other: NgramCache) -> NgramCache:
        """Add every count of ``other`` to this cache (``common_ngram_cache_merge``,
        ngram-cache.cpp:260-285): counts of equal (n-gram, token) keys are summed, nothing is removed.
        Returns ``self``.

        >>> a = NgramCache({(1,): {2: 1}}); b = NgramCache({(1,): {2: 2, 3: 1}, (4, 5): {6: 1}})
        >>> a.merge(b).counts
        {(1,): {2: 3, 3: 1}, (4, 5): {6: 1}}
        """
        for eta, other_part in other.counts.items():
            part = self.counts.get(eta)
            if part is None:
                self.counts[eta] = dict(other_part)
            else:
                for y, c in other_part.items():
                    part[y] = part.get(y, 0) + c
        return self

    def copy(self) -> NgramCache:
        """An independent copy (inner maps copied too)."""
        return NgramCache({eta: dict(part) for eta, part in self.counts.items()})

    def clear(self) -> None:
        """Remove every n-gram."""
        self.counts.clear()

    def __len__(self) -> int:
        """The number of distinct n-grams."""
        return len(self.counts)

    def __eq__(self, other: object) -> bool:
        """Multiset equality of ``(n-gram, token, count)``; insertion order does not matter."""
        if not isinstance(other, NgramCache):
            return NotImplemented
        return self.counts == other.counts

    __hash__ = None  # mutable

    def __repr__(self) -> str:
        return f"NgramCache({len(self.counts)} n-grams, {self.n_entries()} entries, total {self.total()})"

    def n_entries(self) -> int:
        """The number of (n-gram, follower) pairs."""
        return sum(len(part) for part in self.counts.values())

    def total(self) -> int:
        """The sum of all counts (= the number of positions inserted)."""
        return sum(sum(part.values()) for part in self.counts.values())

    def sizes(self) -> set[int]:
        """The n-gram sizes present."""
        return {len(eta) for eta in self.counts}

    def entries(self) -> list[tuple[int, int, int, int, int, int, int]]:
        """Canonical rows ``(n, t0, t1, t2, t3, token, count)``, n-gram padded with -1 to 4 slots,
        sorted ascending (the canonical form of the conformance vectors' README, section 3.4).

        >>> NgramCache({(7, 8): {3: 1, 1: 2}, (9,): {7: 5}}).entries()
        [(1, 9, -1, -1, -1, 7, 5), (2, 7, 8, -1, -1, 1, 2), (2, 7, 8, -1, -1, 3, 1)]
        """
        return sorted(iter_rows(self.counts.items()))

    def canonical_bytes(self) -> bytes:
        """The canonical text: one ``n t0 t1 t2 t3 token count`` line per entry, LF-terminated."""
        return "".join(" ".join(map(str, row)) + "\n" for row in self.entries()).encode()

    def canonical_sha256(self) -> str:
        """SHA-256 of :meth:`canonical_bytes`, the ``canonical_sha256`` of the conformance vectors."""
        return hashlib.sha256(self.canonical_bytes()).hexdigest()


def pad(eta: Ngram) -> tuple[int, int, int, int]:
    """The 4 slots llama.cpp stores for an n-gram: its tokens, then -1 (``common_ngram``, h:15-38)."""
    return tuple(eta) + (TOKEN_NULL,) * (LLAMA_NGRAM_MAX - len(eta))


def iter_rows(items: Iterable[tuple[Ngram, dict[int, int]]]) -> Iterator[tuple[int, ...]]:
    """Unsorted ``(n, t0, t1, t2, t3, token, count)`` rows of (n-gram, followers) pairs."""
    for eta, part in items:
        head = (len(eta),) + pad(eta)
        for y, c in part.items():
            yield head + (y, c)
