"""lookup-stats replay on array tables: ``reference.ngram.replay.replay`` with each chunk replayed by one
numba kernel call (:func:`mlx_backend.ngram.hash_table.replay_chunk`), giving the same drafts and statistics.

The kernel records each draft call's position and drafts; ``on_draft`` is called for every call of
a chunk after the chunk, in call order. ``t_draft_us`` times what lookup-stats times: the draft calls and the
context-cache updates (the kernel calls), not the merges of each chunk into ``c_dyn`` (l.135-137).
The returned stats also carry ``cpu_t_draft_us``, the same span in CPU time of this process (on a
shared machine the wall clock includes waiting for a core).

>>> stats = replay([1, 2, 3] * 4, n_ctx=11, n_draft=4)
>>> stats.n_chunks, stats.n_draft_calls, stats.n_drafted, stats.n_accept
(1, 6, 4, 4)
"""
from __future__ import annotations

import os
import time

import numpy as np

from mlx_backend.ngram.hash_table import NGRAM_MAX, HashTable, replay_chunk
from reference.ngram.draft import SCORES
from reference.ngram.drafter import check_static
from reference.ngram.replay import ReplayStats, check_replay_args

INT64_MAX = 2**63 - 1


def replay(tokens, n_ctx: int = 4096, n_draft: int = 16, c_st=None, c_dyn=None, on_draft=None,
           score: str = "exact", progress=None) -> ReplayStats:
    """Replay ``tokens`` like llama-lookup-stats (see ``reference.ngram.replay.replay``). ``c_st``/``c_dyn``:
    caches of either backend or file paths of either format (loading is timed as ``load_ms``); a
    given ``c_dyn`` is copied, never modified. ``progress(done, total)`` (optional) is called after every
    chunk with the tokens replayed so far."""
    from mlx_backend.ngram.caches import as_sorted, as_table

    check_replay_args(n_ctx, n_draft)
    if score not in SCORES:
        raise ValueError(f"score must be one of {SCORES}, got {score!r}")
    t0 = time.perf_counter()
    st = as_sorted(c_st)
    check_static(st)
    dyn = as_table(c_dyn, copy=not isinstance(c_dyn, (str, os.PathLike))) if c_dyn is not None else HashTable()
    load_ms = 1e3 * (time.perf_counter() - t0)

    inp = np.asarray(tokens)
    if inp.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {inp.shape}")
    if inp.size and (int(inp.min()) < 0 or int(inp.max()) > 2**31 - 1):
        i = int(np.argmax((inp < 0) | (inp > 2**31 - 1)))
        raise ValueError(f"invalid token id {int(inp[i])} at index {i}; token ids must be in [0, 2**31-1]")
    inp = np.ascontiguousarray(inp, np.int32)
    N = inp.size
    n_chunks = max(0, -(-(N - n_ctx) // n_ctx)) if N > n_ctx else 0  # i_start + n_ctx < N
    chunk = min(n_ctx, N)  # a chunk's length when there is one (N > n_ctx): tables for a huge n_ctx cost nothing
    most = INT64_MAX // max(chunk - 1, 1)  # a chunk's drafted tokens, up to n_draft per call, are an int64 count
    if n_draft > most:
        raise ValueError(f"n_draft must be at most {most} here (the fast backend counts the up to n_draft x "
                         f"(n_ctx - 1) tokens a chunk drafts in int64), got {n_draft}; --backend reference has no limit")
    ctx = HashTable(NGRAM_MAX * chunk, NGRAM_MAX * chunk)  # c_dyn grows by doubling as chunks merge in
    record = on_draft is not None
    rec_pos = np.zeros(chunk, np.int64)  # one chunk's draft calls (at most n_ctx - 1)
    rec_k = np.zeros(chunk, np.int32)
    rec_d = np.zeros(chunk if record else 1, np.int32)  # the drafts of one chunk, grown by the kernel
    st_arrays = st.static_arrays()
    n_calls = n_drafted = n_accept = 0
    t_draft_ns = cpu_ns = 0
    # A one-token chunk drafts nothing: it only compiles (first run) or loads the kernel for these argument
    # types, outside the timed span (lookup-stats times drafting, not numba's compiler).
    replay_chunk(inp[:1], n_draft, ctx.T, dyn.T, st_arrays, score == "int32", 0, rec_pos, rec_k, rec_d, 0, record)
    for i_start in range(0, N - n_ctx, n_ctx):
        ctx.clear()
        t, c = time.perf_counter_ns(), time.process_time_ns()
        calls, d, a, rec_d = replay_chunk(inp[i_start : i_start + n_ctx], n_draft, ctx.T, dyn.T, st_arrays,
                                          score == "int32", i_start, rec_pos, rec_k, rec_d, 0, record)
        t_draft_ns += time.perf_counter_ns() - t
        cpu_ns += time.process_time_ns() - c
        n_calls += calls
        n_drafted += d
        n_accept += a
        dyn.merge(ctx)  # not timed (lookup-stats.cpp:135-137)
        if record:
            pos, ks = rec_pos[:calls].tolist(), rec_k[:calls].tolist()
            start = 0
            for j in range(calls):
                on_draft(pos[j], rec_d[start : start + ks[j]].tolist())
                start += ks[j]
        if progress is not None:
            progress(i_start + n_ctx, n_chunks * n_ctx)
    t_draft_us = t_draft_ns / 1e3
    stats = ReplayStats(
        n_input=N, n_ctx=n_ctx, n_chunks=n_chunks, n_draft=n_draft, n_drafted=n_drafted, n_accept=n_accept,
        accept=100.0 * n_accept / n_drafted if n_drafted else 0.0, n_draft_calls=n_calls,
        t_draft_us=t_draft_us, us_per_drafted_token=t_draft_us / n_drafted if n_drafted else 0.0,
        load_ms=load_ms, c_dyn=dyn)
    stats.cpu_t_draft_us = cpu_ns / 1e3
    return stats
