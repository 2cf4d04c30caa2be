"""The expected values of the property checks: llama.cpp's lookup rules, transcribed on their own,
and the suffix-drafting rule of ``reference/suffix/drafter.py``, restated (the second part of this file).

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

import math
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


# -- suffix drafting ------------------------------------------------------------------------------------
#
# The expected values of the suffix-drafting checks (conformance/checks/suffix.py): the rule stated in
# reference/suffix/drafter.py's docstring, restated on its own and computed the other way round. The
# reference searches the ladder's suffix lengths from the longest down and scans each source backwards
# for the first hit; this oracle lists *every* earlier occurrence of the sequence's end (a position e of
# the sequence itself or of a history sequence that has a follower, with the length of what the tokens
# before e have in common with the end of the sequence) and then picks the greatest by one key:
#
#     (rung, source, e)   rung    the longest ladder length the occurrence matches: the largest m in
#                                 the ladder with m <= min(common length, max_match)
#                         source  the sequence itself above every history sequence, a newer history
#                                 sequence above an older one
#                         e       the later position above the earlier
#
# L is the chosen occurrence's common length, counted up to max_match; the draft is
# min(k, floor(factor * L)) tokens of what followed it: in the sequence itself the tokens from e on,
# repeating with period n - e past the end (what an LZ77 copy that overlaps its own output gives); in a
# history sequence the tokens from e to at most its end.
#
# The history (kept_history) is likewise restated: of every sequence added, oldest first, each cut to
# its last max_tokens tokens, the newest ones whose total fits in max_tokens.
#
# It is held to the reference, on random sequences, and to the hand-worked cases of
# conformance/checks/suffix.py by tests/conformance/test_conformance_suffix_oracle.py.

SUFFIX_LADDER = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # the suffix lengths of the rule
SUFFIX_MAX_MATCH = 64
SUFFIX_FACTOR = 4.0
SUFFIX_HISTORY_MAX_TOKENS = 1 << 18


@dataclass(frozen=True)
class Occurrence:
    """An earlier occurrence of the sequence's end: it ends just before ``end`` in ``source`` (``-1`` the
    sequence itself, ``i`` the history sequence ``i``, oldest first), with ``common`` tokens in common
    with the end of the sequence (counted up to the cap asked for)."""

    source: int
    end: int
    common: int


@dataclass
class Suggestion:
    """What the rule drafts: the draft, ``L``, and where it was copied from (for messages)."""

    draft: list[int]
    match_length: int
    source: str | None  # "sequence", "history[i]" (i: oldest first, after eviction), or None: no match
    end: int | None


def kept_history(added: Sequence[Sequence[int]],
                 max_tokens: int = SUFFIX_HISTORY_MAX_TOKENS) -> list[list[int]]:
    """The history after adding ``added`` (oldest first) to an empty one bounded by ``max_tokens``.

    >>> kept_history([[1, 2, 3], [4, 5], [6]], max_tokens=5)
    [[4, 5], [6]]
    >>> kept_history([[1, 2, 3, 4, 5, 6]], max_tokens=4), kept_history([[1, 2]], max_tokens=0)
    ([[3, 4, 5, 6]], [])
    """
    tails = [list(s)[max(0, len(s) - max_tokens):] for s in added]
    tails = [t for t in tails if t and max_tokens > 0]
    kept: list[list[int]] = []
    total = 0
    for t in reversed(tails):  # newest first, while they fit
        if total + len(t) > max_tokens:
            break
        kept.insert(0, t)
        total += len(t)
    return kept


def common_length(source: Sequence[int], end: int, T: Sequence[int], cap: int) -> int:
    """How many tokens before ``end`` in ``source`` equal the last tokens of ``T`` (at most ``cap``)."""
    c = 0
    while c < cap and c < end and c < len(T) and source[end - 1 - c] == T[len(T) - 1 - c]:
        c += 1
    return c


def occurrences(T: Sequence[int], history: Sequence[Sequence[int]], cap: int) -> list[Occurrence]:
    """Every earlier occurrence of at least the last token of ``T`` that has a follower: in ``T`` the ends
    ``1 <= e < len(T)``, in each history sequence ``h`` the ends ``1 <= e < len(h)``."""
    out = []
    for index, source in [(-1, T)] + list(enumerate(history)):
        for e in range(1, len(source)):
            c = common_length(source, e, T, cap)
            if c:
                out.append(Occurrence(index, e, c))
    return out


def rung(common: int, max_match: int = SUFFIX_MAX_MATCH, ladder: Sequence[int] = SUFFIX_LADDER) -> int:
    """The longest ladder length an occurrence with ``common`` tokens in common matches (0: none)."""
    return max((m for m in ladder if m <= min(common, max_match)), default=0)


def suffix_draft(T: Sequence[int], k: int, history: Sequence[Sequence[int]] = (), *,
                 factor: float = SUFFIX_FACTOR, max_match: int = SUFFIX_MAX_MATCH,
                 ladder: Sequence[int] = SUFFIX_LADDER) -> Suggestion:
    """The draft of up to ``k`` tokens for the sequence ``T`` with the (already bounded) ``history``.

    >>> suffix_draft([5, 1, 2, 3, 4, 9, 1, 2], 8).draft   # L = 2: up to 4 * 2 tokens, 3 4 9 1 2 then 3 4 9 again
    [3, 4, 9, 1, 2, 3, 4, 9]
    >>> suffix_draft([1, 2, 1, 2, 1], 6)   # "1 2 1" ended at 3: period 5 - 3 = 2, copied past the end
    Suggestion(draft=[2, 1, 2, 1, 2, 1], match_length=3, source='sequence', end=3)
    """
    T = [int(t) for t in T]
    history = [[int(t) for t in h] for h in history]
    rungs = [rung(c, max_match, ladder) for c in range(max_match + 1)]  # by common length
    found = [o for o in occurrences(T, history, max_match) if rungs[o.common]]
    if not found:
        return Suggestion([], 0, None, None)
    newest = len(history)  # the sequence itself ranks above every history sequence
    best = max(found, key=lambda o: (rungs[o.common], newest if o.source == -1 else o.source, o.end))
    L = best.common  # counted up to max_match
    n_d = min(max(k, 0), math.floor(factor * L))
    if best.source == -1:
        period = len(T) - best.end
        draft = [T[best.end + j % period] for j in range(n_d)]
        where = "sequence"
    else:
        draft = history[best.source][best.end:best.end + n_d]
        where = f"history[{best.source}]"
    return Suggestion(draft, L, where, best.end)
