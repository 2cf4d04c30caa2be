"""The lookup-stats replay (``examples/lookup/lookup-stats.cpp``): treat a token stream as a
model's output and count how many drafted tokens it would have accepted.

The stream is cut into chunks of ``n_ctx`` tokens, ``for (i_start = 0; i_start + n_ctx < N;
i_start += n_ctx)`` (lookup-stats.cpp:77): exactly ``floor((N - 1) / n_ctx)`` chunks, the trailing
partial chunk (and, when ``n_ctx`` divides N, the last full one) is never replayed. In a chunk
``X``, with the context cache empty and ``P = [X[0]]``::

    while |P| < n_ctx:
        D = draft(P)                              # one draft call, one dump line
        accept the longest prefix of D equal to X[|P|:] (inside the chunk), updating c_ctx per token
        if |P| < n_ctx: append the "sampled" token X[|P|] and update c_ctx

After each chunk the context cache is merged into the dynamic cache and cleared (l.135-137).
``t_draft`` times the draft calls and the context updates, as lookup-stats does.

>>> stats = replay([1, 2, 3] * 4, n_ctx=11, n_draft=4)   # 12 tokens: one chunk of 11
>>> stats.n_chunks, stats.n_draft_calls, stats.n_drafted, stats.n_accept
(1, 6, 4, 4)

Five draft calls find nothing (no n-gram has enough samples yet); the sixth, at ``P = [1, 2, 3, 1, 2, 3]``,
drafts ``[1, 2, 3, 1]`` from the 3-gram ``(1, 2, 3)`` and all four are accepted.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence


from reference.ngram.draft import SCORES, draft
from reference.ngram.drafter import CacheLike, as_cache, check_static
from reference.ngram.cache import NgramCache
from reference.ngram.tokens import check_token_list


@dataclasses.dataclass
class ReplayStats:
    """What lookup-stats reports, plus the replay's shape.

    ``accept`` is a percentage (``100 * n_accept / n_drafted``) and ``us_per_drafted_token`` is
    ``t_draft_us / n_drafted``; both are 0.0 when nothing was drafted (llama.cpp prints ``-nan``).
    ``load_ms`` is the time spent loading the cache files passed by path. ``c_dyn`` is the dynamic
    cache after the replay (the loaded one plus every replayed chunk), for ``--save-dynamic``.
    """

    n_input: int
    n_ctx: int
    n_chunks: int
    n_draft: int
    n_drafted: int
    n_accept: int
    accept: float
    n_draft_calls: int
    t_draft_us: float
    us_per_drafted_token: float
    load_ms: float
    c_dyn: NgramCache = dataclasses.field(repr=False, compare=False)


def check_replay_args(n_ctx: int, n_draft: int) -> None:
    """Refuse what lookup-stats cannot replay: ``n_ctx < 2`` (no chunk could draft) or ``n_draft < 0``."""
    if n_ctx < 2:
        raise ValueError(f"n_ctx must be >= 2 (a chunk needs 2 tokens before anything can be drafted), got {n_ctx}")
    if n_draft < 0:  # 0: nothing is drafted, every token is "sampled" (lookup-stats --draft-max 0)
        raise ValueError(f"n_draft must be >= 0, got {n_draft}")


def replay(tokens: Sequence[int], n_ctx: int = 4096, n_draft: int = 16, c_st: CacheLike = None,
           c_dyn: CacheLike = None, on_draft: Callable[[int, list[int]], None] | None = None,
           score: str = "exact", progress: Callable[[int, int], None] | None = None) -> ReplayStats:
    """Replay ``tokens`` like llama-lookup-stats; see the module docstring.

    ``c_st``/``c_dyn`` are caches or file paths (loading them is timed as ``load_ms``); a given
    ``c_dyn`` is copied, never modified. ``on_draft(pos, drafts)`` is called after every draft call
    with ``pos`` = the index in ``tokens`` of the token ``drafts[0]`` predicts. ``progress(done, total)``
    (optional) is called after every chunk with the tokens replayed so far.
    """
    check_replay_args(n_ctx, n_draft)
    if score not in SCORES:
        raise ValueError(f"score must be one of {SCORES}, got {score!r}")
    if c_dyn is None:
        c_dyn = NgramCache()
    elif isinstance(c_dyn, NgramCache):
        c_dyn = c_dyn.copy()  # the dynamic cache grows during the replay; leave the caller's alone
    t0 = time.perf_counter()
    c_st = as_cache(c_st)
    c_dyn = as_cache(c_dyn)  # a path: a freshly loaded cache
    load_ms = 1e3 * (time.perf_counter() - t0)
    check_static(c_st)

    inp = check_token_list(tokens)
    N = len(inp)
    chunk_starts = range(0, N - n_ctx, n_ctx)  # i_start + n_ctx < N
    n_drafted = n_accept = n_calls = 0
    t_draft_ns = 0
    for i_start in chunk_starts:
        X = inp[i_start:i_start + n_ctx]
        c_ctx = NgramCache()
        P = [X[0]]
        while len(P) < n_ctx:
            t = time.perf_counter_ns()
            D = draft(P, n_draft, c_ctx, c_dyn, c_st, score=score)
            t_draft_ns += time.perf_counter_ns() - t
            if on_draft is not None:
                on_draft(i_start + len(P), D)
            n_calls += 1
            n_drafted += len(D)
            t = time.perf_counter_ns()
            for d in D:
                if len(P) == n_ctx or d != X[len(P)]:
                    break
                n_accept += 1
                P.append(d)
                c_ctx.update(P, 1)
            if len(P) < n_ctx:  # the "sampled" token
                P.append(X[len(P)])
                c_ctx.update(P, 1)
            t_draft_ns += time.perf_counter_ns() - t
        c_dyn.merge(c_ctx)  # not timed (lookup-stats.cpp:135-137)
        if progress is not None:
            progress(i_start + n_ctx, len(chunk_starts) * n_ctx)
    t_draft_us = t_draft_ns / 1e3
    return ReplayStats(
        n_input=N, n_ctx=n_ctx, n_chunks=len(chunk_starts), n_draft=n_draft,
        n_drafted=n_drafted, n_accept=n_accept,
        accept=100.0 * n_accept / n_drafted if n_drafted else 0.0,
        n_draft_calls=n_calls, t_draft_us=t_draft_us,
        us_per_drafted_token=t_draft_us / n_drafted if n_drafted else 0.0,
        load_ms=load_ms, c_dyn=c_dyn)
