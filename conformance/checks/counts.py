"""n-gram counts: ``c(eta, y)`` is how often ``y`` followed ``eta``; sizes 1..4 are distinct keys.

The static cache holds 2-grams only (llama-lookup-create); the context cache holds sizes 1..4 of the
prompt and of every emitted token, and never of a drafted one; merging adds counts key by key.
"""
from __future__ import annotations

from hypothesis import strategies as st

from conformance import oracle
from conformance.registry import check
from conformance.strategies import streams


def _rows(impl, cache) -> list[tuple[int, ...]]:
    return sorted(tuple(int(x) for x in row) for row in impl.cache_entries(cache))


def _diff(got: list, want: list) -> str:
    extra = sorted(set(got) - set(want))[:5]
    missing = sorted(set(want) - set(got))[:5]
    return f"rows (n, t0, t1, t2, t3, token, count) not expected: {extra}; expected but absent: {missing}"


@check("counts", needs=("build_static", "cache_entries"), given=dict(tokens=streams()), examples=100)
def static_cache_counts_2grams(impl, tokens):
    """The static cache of a stream counts every 2-gram and its follower: c_st((t[i-2], t[i-1]), t[i])."""
    got, want = _rows(impl, impl.build_static(tokens)), oracle.rows(oracle.counts(tokens, sizes=(2,)))
    assert got == want, f"build_static({tokens}): " + _diff(got, want)


@check("counts", needs=("NgramDrafter", "context_counts", "cache_entries"),
       given=dict(tokens=streams(), cuts=st.lists(st.integers(1, 20), max_size=8)), examples=100)
def context_cache_counts_sizes_1_to_4(impl, tokens, cuts):
    """The context cache holds every n-gram of sizes 1..4 of the prompt and of each token appended later."""
    prompt_len = min(len(tokens), cuts[0] if cuts else len(tokens))
    drafter = impl.NgramDrafter()
    drafter.reset(tokens[:prompt_len])
    i = prompt_len
    for step in cuts[1:] + [len(tokens)]:
        drafter.extend(tokens[i:i + step])
        i += step
    got, want = _rows(impl, impl.context_counts(drafter)), oracle.rows(oracle.counts(tokens))
    assert got == want, (f"reset({tokens[:prompt_len]}) then extend() with the rest of {tokens}: "
                         + _diff(got, want))


@check("counts", needs=("NgramDrafter", "context_counts", "cache_entries"),
       given=dict(tokens=streams(), n_draft=st.integers(1, 8)), examples=100)
def drafted_tokens_are_not_counted(impl, tokens, n_draft):
    """Drafting reads the caches only: drafted tokens never enter the context cache."""
    drafter = impl.NgramDrafter()
    drafter.reset(tokens)
    drafts = [list(drafter.draft(n_draft)) for _ in range(2)]
    got, want = _rows(impl, impl.context_counts(drafter)), oracle.rows(oracle.counts(tokens))
    assert got == want, f"after reset({tokens}) and draft({n_draft}) -> {drafts[0]}: " + _diff(got, want)
    assert drafts[0] == drafts[1], f"drafting twice from {tokens} gave {drafts[0]}, then {drafts[1]}"


@check("counts", needs=("build_static", "merge_caches", "cache_entries"),
       given=dict(a=streams(), b=streams()), examples=80)
def merge_adds_counts(impl, a, b):
    """Merging caches sums the counts of equal (n-gram, token) keys and leaves its inputs unchanged."""
    ca, cb = impl.build_static(a), impl.build_static(b)
    merged = impl.merge_caches([ca, cb])
    want = oracle.rows(oracle.add(oracle.counts(a, (2,)), oracle.counts(b, (2,))))
    got = _rows(impl, merged)
    assert got == want, f"merge of the static caches of {a} and {b}: " + _diff(got, want)
    assert _rows(impl, ca) == oracle.rows(oracle.counts(a, (2,))), "merge_caches modified its first input"
    assert _rows(impl, cb) == oracle.rows(oracle.counts(b, (2,))), "merge_caches modified its second input"
