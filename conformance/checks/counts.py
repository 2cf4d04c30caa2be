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
    """The context cache holds every n-gram of sizes 1..4 of the prompt and of each token appended later
    (and nothing of the sequence the drafter saw before reset())."""
    prompt_len = min(len(tokens), cuts[0] if cuts else len(tokens))
    drafter = impl.NgramDrafter()
    drafter.reset(tokens[::-1])  # a first sequence on the same drafter: reset() must forget it
    drafter.extend(tokens[:3])
    drafter.reset(tokens[:prompt_len])
    i = prompt_len
    for step in cuts[1:] + [len(tokens)]:
        drafter.extend(tokens[i:i + step])
        i += step
    got, want = _rows(impl, impl.context_counts(drafter)), oracle.rows(oracle.counts(tokens))
    assert got == want, (f"reset({tokens[::-1]}), extend({tokens[:3]}), reset({tokens[:prompt_len]}) then extend() with the rest of {tokens}: "
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


def wide_stream() -> list[int]:
    """A fixed stream of 2^16 + 2^15 + 40 tokens: 2^15 random ones over ids up to 2^31 - 2, then one
    token repeated 2^16 + 40 times (so a 2-gram counts more than 2^16 and positions pass 2^16)."""
    import numpy as np

    ids = np.array([0, 1, 255, 256, 2**15 - 1, 2**15, 2**16 - 1, 2**16, 2**16 + 1, 100_000, 2**31 - 2])
    rng = np.random.default_rng(20261130)
    head = ids[rng.integers(0, len(ids), 2**15)].tolist()
    return head + [2**16 + 1] * (2**16 + 40)


@check("counts", needs=("build_static", "cache_entries"))
def static_cache_of_a_long_stream(impl):
    """A stream longer than 2^16 tokens, with ids up to 2^31 - 2 and a 2-gram seen more than 2^16 times,
    gives exact counts (no 16-bit counts or positions, no 2-gram lost between blocks)."""
    tokens = wide_stream()
    got, want = _rows(impl, impl.build_static(tokens)), oracle.rows(oracle.counts(tokens, sizes=(2,)))
    assert got == want, f"build_static of the fixed {len(tokens)}-token stream (wide_stream()): " + _diff(got, want)


# Counts at the widths a port may store them in: sums reaching 2^15, 2^16 and 2^31 - 1 exactly.
WIDE_A = {(1, 2): {3: 2**15 - 1, 4: 2**16 - 1, 5: 2**31 - 2}, (2**31 - 2,): {2**16: 2**30 + 3, 9: 2**30}}
WIDE_B = {(1, 2): {3: 1, 4: 1, 5: 1}, (2**31 - 2,): {2**16: 2**30 + 2, 9: 2**30}, (7, 8, 9): {1: 2**15}}


@check("counts", needs=("load_cache", "merge_caches", "cache_entries"))
def merged_counts_past_16_and_31_bits(impl):
    """Merging sums counts exactly up to 2^31 - 1 (sums reaching 2^15, 2^16, 2^31 - 1); a sum past
    2^31 - 1 (2^31 exactly, 2^31 + 5) is either exact or refused with an error, never wrapped."""
    from conformance import golden

    small_a = golden.to_backend(impl, {eta: part for eta, part in WIDE_A.items() if len(eta) == 2})
    small_b = golden.to_backend(impl, {eta: part for eta, part in WIDE_B.items() if len(eta) != 1})
    want = oracle.rows(oracle.add({eta: dict(p) for eta, p in WIDE_A.items() if len(eta) == 2},
                                  {eta: p for eta, p in WIDE_B.items() if len(eta) != 1}))
    got = _rows(impl, impl.merge_caches([small_a, small_b]))
    assert got == want, "merge of caches whose counts sum to 2^15, 2^16 and 2^31 - 1: " + _diff(got, want)
    pairs = [(WIDE_A, WIDE_B, "2^31 and 2^31 + 5"),
             ({(9, 9): {9: 2**30}}, {(9, 9): {9: 2**30}}, "exactly 2^31, alone")]
    for left, right, sums in pairs:
        want = oracle.rows(oracle.add({eta: dict(p) for eta, p in left.items()}, right))
        try:
            got = _rows(impl, impl.merge_caches([golden.to_backend(impl, left), golden.to_backend(impl, right)]))
        except (ValueError, OverflowError):
            continue  # refusing a count that llama.cpp's int32 files cannot hold is allowed
        assert got == want, f"merge of caches whose counts sum to {sums} (exact or an error): " + _diff(got, want)


@check("counts", needs=("NgramDrafter", "context_counts", "cache_entries"))
def context_cache_grows_token_by_token(impl):
    """A fixed case: a 6,000-token stream of mostly new n-grams extended one token at a time (a table that
    must grow thousands of times) holds every n-gram of sizes 1..4 with its count."""
    import numpy as np

    rng = np.random.default_rng(5)
    tokens = rng.integers(0, 2**31 - 1, 6_000).tolist()
    tokens[3000:3400] = tokens[:400]  # some repeats: counts of 2
    drafter = impl.NgramDrafter()
    drafter.reset(tokens[:1])
    for t in tokens[1:]:
        drafter.extend([t])
    got, want = _rows(impl, impl.context_counts(drafter)), oracle.rows(oracle.counts(tokens))
    assert got == want, "the fixed 6,000-token stream of context_cache_grows_token_by_token: " + _diff(got, want)


@check("counts", needs=("build_static", "cache_entries"), fast=False)   # ~3-8 s: not in the meta-tests' runs
def static_cache_of_5_million_tokens(impl):
    """A fixed stream of 2^22 + 2^20 tokens over 60 ids (a backend that counts in chunks or blocks must
    merge them, and counts reach ~100): every 2-gram is counted exactly (expected counts by NumPy's
    unique over the (t[i-2], t[i-1], t[i]) triples)."""
    import numpy as np

    t = np.random.default_rng(7).integers(0, 60, 2**22 + 2**20).astype(np.int64)
    keys, counts = np.unique((t[:-2] << 42) | (t[1:-1] << 21) | t[2:], return_counts=True)
    want = np.column_stack([np.full(len(keys), 2), keys >> 42, (keys >> 21) & (2**21 - 1), np.full((len(keys), 2), -1),
                            keys & (2**21 - 1), counts]).tolist()
    got = [list(r) for r in _rows(impl, impl.build_static(t.tolist()))]
    assert got == want, (f"build_static of the fixed {len(t):,}-token stream of static_cache_of_5_million_tokens: "
                         + _diff([tuple(r) for r in got], [tuple(r) for r in want]))

