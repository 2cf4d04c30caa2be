"""Drafting and fallback: context cache first (lax thresholds), then dynamic (strict), n = 4..1, then
the static 2-gram alone; drafted tokens extend the n-gram window; stop at the first position where
nothing passes. Checked against llama.cpp's own draft dumps and, on random streams, the rules."""
from __future__ import annotations

from hypothesis import strategies as st

from conformance import golden, oracle, vectors
from conformance.registry import check
from conformance.runner import current_options
from conformance.strategies import streams, streams_with_caches


def describe_caches(st_src, dyn_src) -> str:
    """``", static cache counted from [...]"`` etc., for the caches that exist."""
    return "".join(f", {kind} cache counted from {src}" for kind, src in (("static", st_src), ("dynamic", dyn_src))
                   if src)


def generate_and_compare(impl, stream, prompt_len, n_draft, st_src=None, dyn_src=None):
    """Drive the backend's drafter through a generation whose output is ``stream``: after each draft,
    the tokens the "model" agrees with plus the next true token are appended. Every draft must be
    the one the rules give for the same sequence and caches. The drafter first drafts for another
    sequence (the reversed stream) and is then ``reset()``: a reused drafter must start afresh."""
    c_st = oracle.counts(st_src, sizes=(2,)) if st_src else None
    c_dyn = oracle.counts(dyn_src) if dyn_src else None
    compare_generation(impl, stream, prompt_len, n_draft, golden.to_backend(impl, c_st), golden.to_backend(impl, c_dyn),
                       c_st, c_dyn, describe_caches(st_src, dyn_src))


def compare_generation(impl, stream, prompt_len, n_draft, backend_st, backend_dyn, c_st, c_dyn, caches: str):
    """:func:`generate_and_compare` with the caches given: the backend's (``backend_st``, ``backend_dyn``) and
    the same counts for the rules (``c_st``, ``c_dyn``)."""
    drafter = impl.NgramDrafter(c_st=backend_st, c_dyn=backend_dyn)
    seq = list(stream[:prompt_len])
    drafter.reset(stream[::-1])  # the drafter is reused: what reset() starts must not see this sequence
    drafter.extend(stream[:2])
    drafter.draft(n_draft)
    drafter.reset(seq)
    while True:
        got = [int(t) for t in drafter.draft(n_draft)]
        want = oracle.draft(seq, n_draft, oracle.counts(seq), c_dyn, c_st)
        assert got == want, (f"draft({n_draft}) after the tokens {seq}{caches} (on a drafter reset() after a first "
                             f"sequence {stream[::-1]}): the rules draft {want}, the backend drafted {got}")
        if len(seq) >= len(stream):
            return
        rest = stream[len(seq):]
        n_ok = next((i for i, (d, t) in enumerate(zip(got, rest)) if d != t), min(len(got), len(rest)))
        new = rest[:n_ok + 1]
        drafter.extend(new)
        seq += new


@check("drafting", needs=("NgramDrafter",),
       given=dict(stream=streams(), prompt_len=st.integers(0, 40), n_draft=st.integers(1, 8)), examples=150)
def drafts_follow_the_rules_context_only(impl, stream, prompt_len, n_draft):
    """With only the context cache, every draft during a generation is the one the rules give."""
    generate_and_compare(impl, stream, prompt_len, n_draft)


@check("drafting", needs=("NgramDrafter", "load_cache"),
       given=dict(streams=streams_with_caches(), prompt_len=st.integers(0, 40), n_draft=st.integers(1, 8)),
       examples=150)
def drafts_follow_the_rules_with_all_caches(impl, streams, prompt_len, n_draft):
    """With static and dynamic caches too, drafts follow the fallback order context > dynamic > static."""
    stream, st_src, dyn_src = streams
    generate_and_compare(impl, stream, prompt_len, n_draft, st_src, dyn_src)


@check("drafting", needs=("NgramDrafter", "build_static", "merge_caches", "load_cache"),
       given=dict(streams=streams_with_caches(), prompt_len=st.integers(0, 40), n_draft=st.integers(1, 8),
                  cut=st.floats(0, 1)), examples=100)
def drafts_with_built_and_merged_caches(impl, streams, prompt_len, n_draft, cut):
    """Caches made by the backend itself, as a user's pipeline makes them (``create`` then ``merge``), draft
    as the rules say: the static cache is the ``merge_caches`` of the ``build_static`` of the two parts of
    its stream, the dynamic cache the ``merge_caches`` of two loaded caches counted from the two parts of
    its stream."""
    stream, st_src, dyn_src = streams
    st_parts, dyn_parts = _split(st_src or [], cut), _split(dyn_src or [], cut)
    c_st = _sum([oracle.counts(part, sizes=(2,)) for part in st_parts])
    c_dyn = _sum([oracle.counts(part) for part in dyn_parts])
    built = [impl.build_static(part) for part in st_parts if len(part) >= 3]
    loaded = [golden.to_backend(impl, oracle.counts(part)) for part in dyn_parts if len(part) >= 2]
    compare_generation(impl, stream, prompt_len, n_draft, impl.merge_caches(built) if built else None,
                       impl.merge_caches(loaded) if loaded else None, c_st, c_dyn,
                       f", static cache merge_caches of the build_static of {st_parts[0]} and {st_parts[1]}, dynamic "
                       f"cache merge_caches of the counts of {dyn_parts[0]} and {dyn_parts[1]}")


def _split(tokens: list, cut: float) -> tuple[list, list]:
    i = int(cut * len(tokens))
    return list(tokens[:i]), list(tokens[i:])


def _sum(caches: list) -> dict | None:
    total: dict = {}
    for cache in caches:
        oracle.add(total, cache)
    return total or None


def chunk_dump(impl, case, chunk: int) -> tuple[list[str], list[str]]:
    """Draft calls of one lookup-stats chunk, made with the backend's drafter; and llama.cpp's."""
    start, n_ctx = chunk * case.n_ctx, case.n_ctx
    X = golden.tokens(case.tokens)[start:start + n_ctx]
    want = [line for line in vectors.dump_body(case) if start <= int(line.split()[0]) < start + n_ctx]
    drafter = impl.NgramDrafter(c_st=golden.backend_cache(impl, case.static),
                                c_dyn=golden.backend_cache(impl, case.dynamic))
    drafter.reset(X[:1])
    got, n = [], 1
    while n < n_ctx:
        d = [int(t) for t in drafter.draft(case.n_draft)]
        got.append(golden.dump_line(start + n, d))
        n_ok = next((i for i, (a, b) in enumerate(zip(d, X[n:])) if a != b), min(len(d), n_ctx - n))
        new = X[n:n + n_ok + 1]
        drafter.extend(new)
        n += len(new)
    return got, want


def golden_first_chunks(impl, names) -> None:
    for case in map(vectors.load_case, names):
        if case.n_chunks == 0 or case.int32_overflow_products:
            continue
        if (case.static or case.dynamic) and getattr(impl, "load_cache", None) is None:
            continue
        got, want = chunk_dump(impl, case, 0)
        problem = golden.first_difference(got, want, f"case {case.name}, first chunk")
        assert problem is None, problem + f" (token file {case.tokens}, n_draft {case.n_draft})"


@check("drafting", needs=("NgramDrafter",))
def golden_draft_dumps(impl):
    """Drafts during a generation equal llama.cpp's draft dumps (first chunk of each golden case)."""
    golden_first_chunks(impl, golden.DEFAULT_CASES)


@check("drafting", needs=("NgramDrafter",), fast=False)
def golden_draft_dumps_text(impl):
    """Drafts on English text (cl100k tokens) equal llama.cpp's, with the 2M-token static cache under --thorough."""
    names = ["a1-text-a-nostatic-c4096-d16"]
    if current_options().thorough:
        names += ["a3-text-a-static-c1024-d8", "a4-text-a-static-dyn-c4096-d16", "dyn-a-build",
                  "s2-syn-v8-rep-nostatic-c4096-d16"]
    golden_first_chunks(impl, names)


@check("drafting", needs=("NgramDrafter",))
def long_drafts_and_negative_lengths(impl):
    """Fixed cases at the ends of ``n_draft``: a draft that cycles goes on to exactly ``n_draft`` tokens
    (257 and 1000: past a byte, past CPython's small-int cache), ``draft(0)`` is empty, and ``draft(-1)``
    raises ValueError (a length below 0 is a caller's error, not an empty draft)."""
    seq = [1, 2, 3, 4, 5] * 3
    drafter = impl.NgramDrafter()
    drafter.reset(seq)
    for n_draft in (0, 257, 1000):
        got = [int(t) for t in drafter.draft(n_draft)]
        want = oracle.draft(seq, n_draft, oracle.counts(seq))
        assert got == want, (f"draft({n_draft}) after {seq}: the rules draft {len(want)} tokens "
                             f"{want[:8]}..., the backend drafted {len(got)} {got[:8]}...")
    try:
        drafter.draft(-1)
    except ValueError:
        pass
    else:
        raise AssertionError("draft(-1) returned instead of raising ValueError")

