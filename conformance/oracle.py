"""The expected values of the property checks: llama.cpp's lookup rules, transcribed on their own.

The suite must not trust the code it tests, and the reference is one of the backends it tests, so
the randomised checks compare a backend with this short, independent transcription of the rules in
the conformance vectors' README (section 4; ``docs/spec-map.md`` gives the llama.cpp line numbers).
It shares no code with ``reference/`` and is itself held to llama.cpp's golden vectors
(``tests/conformance/test_conformance_oracle.py``), so a wrong oracle cannot pass silently.

A cache here is a ``dict`` from an n-gram (a tuple of 1..4 tokens) to ``{follower: count}``.

>>> ctx = counts([1, 2, 3, 1, 2, 3, 1, 2])
>>> draft([1, 2, 3, 1, 2, 3, 1, 2], 4, ctx)
[3, 1, 2, 3]
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

Cache = dict[tuple[int, ...], dict[int, int]]

# (a_n, p_n) for n = 1..4: minimum sample size and minimum percentage (ngram-cache.cpp:59-62).
LAX = ((2, 2, 1, 1), (66, 50, 50, 50))  # the context cache
STRICT = ((4, 3, 2, 2), (75, 66, 66, 66))  # the dynamic cache


def counts(tokens: Sequence[int], sizes: Sequence[int] = (1, 2, 3, 4)) -> Cache:
    """``c(eta, y)`` = how often ``y`` followed ``eta`` in ``tokens``, for the n-gram sizes given.

    >>> counts([5, 6, 5, 6], sizes=(2,))
    {(5, 6): {5: 1}, (6, 5): {6: 1}}
    """
    tokens = [int(t) for t in tokens]
    pairs = Counter((tuple(tokens[i - n:i]), tokens[i]) for n in sizes for i in range(n, len(tokens)))
    return table(pairs)


def table(pairs: Counter) -> Cache:
    """A cache from a ``Counter`` of ``(n-gram, follower)`` pairs."""
    cache: Cache = {}
    for (eta, y), c in pairs.items():
        cache.setdefault(eta, {})[y] = c
    return cache


def rows(cache: Cache) -> list[tuple[int, ...]]:
    """Canonical ``(n, t0, t1, t2, t3, token, count)`` rows, sorted (README section 3.4)."""
    return sorted((len(eta),) + tuple(eta) + (-1,) * (4 - len(eta)) + (y, c)
                  for eta, part in cache.items() for y, c in part.items())


def add(target: Cache, other: Cache) -> Cache:
    """``target`` plus every count of ``other`` (llama-lookup-merge), in place."""
    for eta, part in other.items():
        mine = target.setdefault(eta, {})
        for y, c in part.items():
            mine[y] = mine.get(y, 0) + c
    return target


def _int32(x: int) -> int:
    return (x + 2**31) % 2**32 - 2**31


def _level(part: dict[int, int], part_st: dict[int, int], a: int, p: int, wrap: bool) -> int | None:
    """One level: the follower with the largest ``c * w`` (ties: smallest id; scores <= 0 never win),
    drafted iff the sum of counts is at least ``a`` and its own count is at least ``p`` percent.
    ``wrap``: every product and sum is llama.cpp's 32-bit ``int``."""
    num = _int32 if wrap else int
    best, best_score = None, 0
    for y in sorted(part):
        w = 100 * part_st[y] if part_st.get(y, 0) > 0 else 1
        score = num(part[y] * w)
        if score > best_score:
            best, best_score = y, score
    total = num(sum(part.values()))
    if best is not None and total >= a and num(100 * part[best]) >= num(p * total):
        return best
    return None


def draft(seq: Sequence[int], n_draft: int, ctx: Cache, dyn: Cache | None = None,
          st: Cache | None = None, wrap_int32: bool = False) -> list[int]:
    """Up to ``n_draft`` tokens to follow ``seq``: context (lax), then dynamic (strict), n = 4..1,
    then the static 2-gram alone; n-grams that would start before ``seq[0]`` are skipped."""
    S = [int(t) for t in seq[-4:]]  # n-grams of at most 4 tokens: the last 4 decide
    if len(S) < 2:
        return []
    out: list[int] = []
    while len(out) < n_draft:
        part_st = (st or {}).get(tuple(S[-2:]), {})
        y = None
        for cache, (a_n, p_n) in ((ctx, LAX), (dyn or {}, STRICT)):
            for n in (4, 3, 2, 1):
                if n <= len(S) and tuple(S[-n:]) in cache:
                    y = _level(cache[tuple(S[-n:])], part_st, a_n[n - 1], p_n[n - 1], wrap_int32)
                    if y is not None:
                        break
            if y is not None:
                break
        if y is None and part_st:  # static only: plain counts, a = 2, p = 50 %
            y = _level(part_st, {}, 2, 50, wrap_int32)
        if y is None:
            break
        out.append(y)
        S.append(y)
    return out


@dataclass
class Replay:
    """What a lookup-stats replay produces: one ``(pos, drafts)`` per draft call, and the totals."""

    calls: list[tuple[int, list[int]]] = field(default_factory=list)
    n_chunks: int = 0
    n_drafted: int = 0
    n_accept: int = 0
    dyn: Cache = field(default_factory=dict)


def replay(tokens: Sequence[int], n_ctx: int, n_draft: int, st: Cache | None = None,
           dyn: Cache | None = None, wrap_int32: bool = False) -> Replay:
    """llama-lookup-stats: ``floor((N-1)/n_ctx)`` chunks; in each, draft, accept the matching prefix,
    append the true next token; every appended token updates the context cache, which is added to
    the dynamic cache after the chunk."""
    tokens = [int(t) for t in tokens]
    out = Replay(dyn={eta: dict(part) for eta, part in (dyn or {}).items()})
    i_start = 0
    while i_start + n_ctx < len(tokens):
        X = tokens[i_start:i_start + n_ctx]
        P, ctx = [X[0]], {}
        while len(P) < n_ctx:
            d = draft(P, n_draft, ctx, out.dyn, st, wrap_int32)
            out.calls.append((i_start + len(P), d))
            out.n_drafted += len(d)
            for y in d:
                if len(P) == n_ctx or y != X[len(P)]:
                    break
                out.n_accept += 1
                _append(P, ctx, y)
            if len(P) < n_ctx:
                _append(P, ctx, X[len(P)])
        add(out.dyn, ctx)
        out.n_chunks += 1
        i_start += n_ctx
    return out


def _append(P: list[int], ctx: Cache, y: int) -> None:
    """Append ``y`` and count the n-grams (sizes 1..4) that it follows."""
    P.append(y)
    for n in range(1, min(4, len(P) - 1) + 1):
        part = ctx.setdefault(tuple(P[-1 - n:-1]), {})
        part[y] = part.get(y, 0) + 1
