"""Replay statistics (llama-lookup-stats): ``floor((N-1)/n_ctx)`` chunks; in each, draft, accept the
prefix the text agrees with, append the true next token; the context cache joins the dynamic cache
after each chunk. ``n_drafted`` counts drafted tokens, ``n_accept`` accepted ones, one draft call
per step."""
from __future__ import annotations

import inspect
import time

from hypothesis import strategies as st

from conformance import golden, oracle, vectors
from conformance.checks.drafting import describe_caches
from conformance.registry import check
from conformance.runner import Skip, current_options
from conformance.strategies import streams_with_caches

# Multi-chunk golden cases of a default run (the dynamic cache carries over between chunks).
DEFAULT_REPLAYS = golden.DEFAULT_CASES + ("e5-len8193-c4096-d16", "s2b-syn-v8-rep-nostatic-c2048-d8")


def _replay(impl, tokens, n_ctx, n_draft, c_st, c_dyn, **extra):
    calls: list[str] = []
    stats = impl.replay(tokens, n_ctx=n_ctx, n_draft=n_draft, c_st=c_st, c_dyn=c_dyn,
                        on_draft=lambda pos, d: calls.append(golden.dump_line(int(pos), [int(t) for t in d])),
                        **extra)
    return stats, calls


def _compare_totals(stats, want: dict, what: str) -> None:
    for key, value in want.items():
        assert hasattr(stats, key), (f"{what}: replay() returned a {type(stats).__name__} without the attribute "
                                     f"{key} (expected {value}); the protocol's stats are an object with the "
                                     f"attributes n_chunks, n_draft_calls, n_drafted, n_accept")
        got = getattr(stats, key)
        assert got == value, f"{what}: {key} = {got}, expected {value}"
    accept = getattr(stats, "accept", None)  # optional: the acceptance in percent, as lookup-stats prints it
    if accept is not None and "n_drafted" in want:
        expected = 100.0 * want["n_accept"] / want["n_drafted"] if want["n_drafted"] else 0.0
        assert abs(accept - expected) <= 1e-9 * max(1.0, expected), (
            f"{what}: accept = {accept}, expected 100 * n_accept / n_drafted = {expected}")


def replay_follows_rules(impl, stream, n_ctx, n_draft, what: str, c_st=None, c_dyn=None, **extra) -> dict:
    """Replay ``stream`` on the backend (caches handed as llama.cpp files) and check its draft calls and
    totals against lookup-stats' rules; returns the totals."""
    want = oracle.replay(stream, n_ctx, n_draft, c_st, c_dyn, wrap_int32=extra.get("score") == "int32")
    stats, calls = _replay(impl, stream, n_ctx, n_draft, golden.to_backend(impl, c_st), golden.to_backend(impl, c_dyn),
                           **extra)
    problem = golden.first_difference(calls, [golden.dump_line(p, d) for p, d in want.calls], what)
    assert problem is None, problem
    totals = {"n_chunks": want.n_chunks, "n_draft_calls": len(want.calls), "n_drafted": want.n_drafted,
              "n_accept": want.n_accept}
    _compare_totals(stats, totals, what)
    return totals


def golden_replays(impl, names, **extra) -> None:
    for case in map(vectors.load_case, names):
        stats, calls = _replay(impl, golden.tokens(case.tokens), case.n_ctx, case.n_draft,
                               golden.backend_cache(impl, case.static), golden.backend_cache(impl, case.dynamic),
                               **extra)
        problem = golden.first_difference(calls, vectors.dump_body(case), f"case {case.name}")
        assert problem is None, problem
        _compare_totals(stats, {"n_chunks": case.n_chunks, "n_draft_calls": case.n_draft_calls,
                                "n_drafted": case.n_drafted, "n_accept": case.n_accept}, f"case {case.name}")


@check("replay", needs=("replay",))
def golden_replay_statistics(impl):
    """Replays give llama.cpp's draft calls, chunk count, drafted and accepted counts, call for call."""
    names = list(DEFAULT_REPLAYS)
    if current_options().thorough:
        names += [c.name for c in vectors.drafting_cases()
                  if c.name not in names and not c.int32_overflow_products]
    if any(vectors.load_case(n).static or vectors.load_case(n).dynamic for n in names) and \
            getattr(impl, "load_cache", None) is None:
        names = [n for n in names if not (vectors.load_case(n).static or vectors.load_case(n).dynamic)]
    golden_replays(impl, names)


@check("replay", needs=("replay", "load_cache"))
def golden_int32_wrapped_scores(impl):
    """With score="int32", scores wrap like llama.cpp's int32 product (case o1, 83,959 products overflow; and a
    fixed case where context products wrap to negative scores)."""
    if "score" not in inspect.signature(impl.replay).parameters:
        raise Skip("replay() has no score= option for llama.cpp's wrapping int32 product (optional)")
    golden_replays(impl, ["o1-ovf-static-c4096-d8"], score="int32")
    # fixed: the context products c * 100 * 2^25 overflow int32 (c = 1, 2 wrap to negative scores, which
    # never win, so the static fallback drafts there): the drafts differ from the exact rules'
    stream, c_st = [1, 2, 3] * 10 + [1], {(1, 2): {3: 2**25, 4: 2**25 + 1}}
    replay_follows_rules(impl, stream, 30, 4, f'replay of {stream} with n_ctx=30, n_draft=4, score="int32", static '
                         f'cache {c_st}', c_st, score="int32")


@check("replay", needs=("replay", "cache_entries"))
def golden_dynamic_cache_after_replay(impl):
    """The dynamic cache after a replay holds every replayed chunk's n-grams (cases edge-neg-dyn-build, dyn-a-build)."""
    for name in ("edge-neg-dyn-build", "dyn-a-build"):
        case = vectors.load_case(name)
        stats = impl.replay(golden.tokens(case.tokens), n_ctx=case.n_ctx, n_draft=case.n_draft)
        if getattr(stats, "c_dyn", None) is None:
            raise Skip("the replay statistics carry no c_dyn (the dynamic cache after the replay; optional)")
        rows = sorted(tuple(int(x) for x in r) for r in impl.cache_entries(stats.c_dyn))
        text = "".join(" ".join(map(str, r)) + "\n" for r in rows).encode()
        import hashlib

        want = case.saved_dynamic["canonical_sha256"]
        assert hashlib.sha256(text).hexdigest() == want, (
            f"case {name}: the dynamic cache after the replay has {len(rows)} entries and a canonical "
            f"SHA-256 other than llama.cpp's {want}")


@check("replay", needs=("replay", "load_cache"),
       given=dict(streams=streams_with_caches(), n_ctx=st.integers(2, 40), n_draft=st.integers(1, 8)),
       examples=100)
def replay_follows_the_rules(impl, streams, n_ctx, n_draft):
    """On random streams, chunking, draft calls and the totals follow lookup-stats' rules."""
    stream, st_src, dyn_src = streams
    c_st = oracle.counts(st_src, sizes=(2,)) if st_src else None
    c_dyn = oracle.counts(dyn_src) if dyn_src else None
    replay_follows_rules(impl, stream, n_ctx, n_draft, f"replay of {stream} with n_ctx={n_ctx}, n_draft={n_draft}"
                         f"{describe_caches(st_src, dyn_src)}", c_st, c_dyn)


@check("replay", needs=("replay", "load_cache"))
def replay_tries_context_before_dynamic(impl):
    """A fixed replay where the context cache and the dynamic cache disagree (the text repeats
    [1, 2, 3], the dynamic cache learned [1, 2, 9]): the context cache is asked first, call for call."""
    stream, dyn_src = [1, 2, 3] * 30, [1, 2, 9] * 40   # 90 tokens: two chunks of 36 replayed
    n_ctx, n_draft = 36, 4
    replay_follows_rules(impl, stream, n_ctx, n_draft, f"replay of [1, 2, 3] * 30 with n_ctx={n_ctx}, n_draft={n_draft} "
                         "and a dynamic cache of [1, 2, 9] * 40", c_dyn=oracle.counts(dyn_src))


def _repeating_stream(n: int, seed: int, substitutions: int) -> list[int]:
    """``n`` tokens that repeat a random period of 23 ids with ``substitutions`` tokens replaced at random
    places: long accepted drafts and rejected ones."""
    import numpy as np

    rng = np.random.default_rng(seed)
    period = rng.integers(0, 2**31 - 1, 23).tolist()
    stream = [period[i % len(period)] for i in range(n)]
    for i in rng.integers(0, n, substitutions).tolist():
        stream[i] = period[i % 7]
    return stream


@check("replay", needs=("replay",))
def replay_past_2_16_tokens(impl):
    """A replay of 70,001 tokens in 20 chunks (positions past 2^16, the dynamic cache growing over them)
    follows lookup-stats' rules, call for call."""
    stream = _repeating_stream(70_001, 11, 400)   # substitutions: rejected drafts everywhere
    n_ctx, n_draft = 3_500, 16
    replay_follows_rules(impl, stream, n_ctx, n_draft, "replay of the fixed 70,001-token stream of "
                         f"replay_past_2_16_tokens, n_ctx={n_ctx}, n_draft={n_draft}")


@check("replay", needs=("replay",))
def replay_drafts_longer_than_the_chunk(impl):
    """Fixed replays with ``n_draft`` beyond the chunk (n_ctx + 40) and no ``on_draft``, where a backend may
    measure a draft without storing it: the totals follow lookup-stats' rules (drafts that cycle count
    ``n_draft`` tokens each; substitutions reject them mid-draft), and the same with ``on_draft``."""
    stream = ([1, 2, 3, 4, 5] * 30)[:140]
    for i in (17, 40, 41, 77, 103):  # rejected drafts, some after a long accepted run
        stream[i] = 9
    n_ctx, n_draft = 64, 104
    what = f"replay of the fixed stream of replay_drafts_longer_than_the_chunk, n_ctx={n_ctx}, n_draft={n_draft}"
    totals = replay_follows_rules(impl, stream, n_ctx, n_draft, what)
    _compare_totals(impl.replay(stream, n_ctx=n_ctx, n_draft=n_draft), totals, what + ", no on_draft")


@check("replay", needs=("replay",))
def replay_with_n_draft_0_and_below(impl):
    """``n_draft = 0`` replays with nothing drafted (lookup-stats ``--draft-max 0``: one draft call per
    token, each empty) and ``n_draft = -1`` is refused with ValueError."""
    stream = [1, 2, 3, 4] * 20
    totals = replay_follows_rules(impl, stream, 32, 0, "replay of [1, 2, 3, 4] * 20 with n_ctx=32, n_draft=0")
    assert totals["n_drafted"] == totals["n_accept"] == 0, totals
    try:
        impl.replay(stream, n_ctx=32, n_draft=-1)
    except ValueError:
        return
    raise AssertionError("replay(..., n_draft=-1) returned instead of raising ValueError")



@check("replay", needs=("replay",))
def replay_defaults_and_times(impl):
    """``replay``'s defaults, where it has them, are lookup-stats' (``n_ctx`` 4096, ``n_draft`` 16); the times
    it may report are non-negative and within the call's wall time: ``t_draft_us`` (microseconds drafting),
    ``load_ms`` (loading the caches), ``us_per_drafted_token`` = t_draft_us / n_drafted (0 when nothing was
    drafted)."""
    params = inspect.signature(impl.replay).parameters
    for name, want in (("n_ctx", 4096), ("n_draft", 16)):
        default = params[name].default if name in params else inspect.Parameter.empty
        assert default in (inspect.Parameter.empty, want), (
            f"replay's {name} defaults to {default}; lookup-stats' default is {want}")
    stream = _repeating_stream(300, 5, 3)
    c_st, c_dyn = oracle.counts(stream[100:], sizes=(2,)), oracle.counts(stream[:200])
    if getattr(impl, "load_cache", None) is None:
        c_st = c_dyn = None   # caches are handed as llama.cpp files: without load_cache, none
    c_st, c_dyn = golden.to_backend(impl, c_st), golden.to_backend(impl, c_dyn)
    t0 = time.perf_counter()
    stats = impl.replay(stream, n_ctx=64, n_draft=8, c_st=c_st, c_dyn=c_dyn)
    wall = time.perf_counter() - t0
    what = f"replay of 300 tokens with n_ctx=64, n_draft=8 and both caches, which took {wall * 1e3:.2f} ms"
    t_draft_us, load_ms = getattr(stats, "t_draft_us", None), getattr(stats, "load_ms", None)
    if t_draft_us is not None:
        assert 0 <= t_draft_us <= wall * 1e6, f"{what}: t_draft_us = {t_draft_us}"
        per = getattr(stats, "us_per_drafted_token", None)
        if per is not None:
            want = t_draft_us / stats.n_drafted if stats.n_drafted else 0.0
            assert abs(per - want) <= 1e-9 * max(1.0, want), f"{what}: us_per_drafted_token = {per}, expected {want}"
    if load_ms is not None:
        assert 0 <= load_ms <= wall * 1e3, f"{what}: load_ms = {load_ms}"
