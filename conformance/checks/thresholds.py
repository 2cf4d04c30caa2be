"""Thresholds and ties: a level drafts its best follower y* iff ``F >= a_n`` and ``100 c(y*) >= p_n F``
(lax a = 2 2 1 1, p = 66 50 50 50 for the context cache; strict a = 4 3 2 2, p = 75 66 66 66 for the
dynamic cache); y* maximises ``c(y) w(y)``, ``w(y) = 100 c_st(y)`` or 1; ties go to the smallest id.
Tiny vocabularies make ties and exact threshold boundaries frequent."""
from __future__ import annotations

from hypothesis import strategies as st

from conformance import golden, vectors
from conformance.oracle import counts
from conformance.checks.drafting import generate_and_compare, golden_first_chunks
from conformance.registry import check
from conformance.strategies import streams_with_caches, tiny_vocab_streams


@check("thresholds", needs=("NgramDrafter",))
def ties_go_to_the_smallest_token(impl):
    """Among followers with the same best score, the smallest token id is drafted."""
    cases = [  # (context, expected draft of 1 token, why)
        ([3, 1, 7, 3, 1, 9, 3, 1], [7], "2-gram (3, 1) is followed by 7 once and 9 once: 50 % passes p_2 = 50, tie -> 7"),
        ([3, 1, 9, 3, 1, 7, 3, 1], [7], "the same counts seen in the other order: still 7"),
        ([2, 8, 2, 6, 2], [], "1-gram (2,) is followed by 8 once and 6 once: 50 % < p_1 = 66, no draft"),
    ]
    for context, want, why in cases:
        drafter = impl.NgramDrafter()
        drafter.reset(context)
        got = [int(t) for t in drafter.draft(1)]
        assert got == want, f"draft(1) after {context}: expected {want} ({why}), got {got}"


@check("thresholds", needs=("NgramDrafter", "load_cache"))
def static_ties_go_to_the_smallest_token(impl):
    """The static-only fallback drafts the most frequent follower, ties to the smallest id, if it has >= 50 %."""
    cases = [  # (static cache source, context, expected)
        ([4, 5, 9, 4, 5, 7], [4, 5], [7], "static (4, 5) -> {9: 1, 7: 1}: 50 % of 2 passes, tie -> 7"),
        ([4, 5, 9], [4, 5], [], "static (4, 5) -> {9: 1}: a sample of 1 < 2, no draft"),
    ]
    for src, context, want, why in cases:
        c_st = golden.to_backend(impl, counts(src, sizes=(2,)))
        drafter = impl.NgramDrafter(c_st=c_st)
        drafter.reset(context)
        got = [int(t) for t in drafter.draft(1)]
        assert got == want, f"draft(1) after {context} with the static cache of {src}: expected {want} ({why}), got {got}"


@check("thresholds", needs=("NgramDrafter", "load_cache"))
def static_weights_choose_the_follower(impl):
    """Scores are c(y) * w(y) with w(y) = 100 c_st(X_2, y); the percentage test uses the winner's own count."""
    c_st = golden.to_backend(impl, counts([3, 4, 9], sizes=(2,)))  # static: (3, 4) -> {9: 1}
    cases = [
        ([1, 2, 3, 4, 7, 1, 2, 3, 4, 9, 1, 2, 3, 4], [9],
         "4-gram (1, 2, 3, 4) -> {7: 1, 9: 1}: s(7) = 1, s(9) = 1 * 100; 9 has 50 % >= p_4 = 50"),
        ([1, 2, 3, 4, 7, 1, 2, 3, 4, 7, 1, 2, 3, 4, 9, 1, 2, 3, 4], [],
         "every level has {7: 2, 9: 1}: the weighted winner 9 has 33 % < 50 %, so no level passes, "
         "and the static 2-gram alone has a sample of 1 < 2"),
    ]
    for context, want, why in cases:
        drafter = impl.NgramDrafter(c_st=c_st)
        drafter.reset(context)
        got = [int(t) for t in drafter.draft(1)]
        assert got == want, (f"draft(1) after {context} with the static cache (3, 4) -> {{9: 1}}: "
                             f"expected {want} ({why}), got {got}")


@check("thresholds", needs=("NgramDrafter",),
       given=dict(stream=tiny_vocab_streams(), prompt_len=st.integers(0, 30), n_draft=st.integers(1, 6)),
       examples=200)
def tiny_vocabulary_context_only(impl, stream, prompt_len, n_draft):
    """On 2-4 token vocabularies (ties and exact threshold boundaries everywhere) drafts follow the lax rules."""
    generate_and_compare(impl, stream, prompt_len, n_draft)


@check("thresholds", needs=("NgramDrafter", "load_cache"),
       given=dict(streams=streams_with_caches(tiny_vocab_streams), prompt_len=st.integers(0, 30),
                  n_draft=st.integers(1, 6)), examples=200)
def tiny_vocabulary_all_caches(impl, streams, prompt_len, n_draft):
    """On 2-4 token vocabularies with static and dynamic caches, drafts follow the strict rules and weights."""
    stream, st_src, dyn_src = streams
    generate_and_compare(impl, stream, prompt_len, n_draft, st_src, dyn_src)


@check("thresholds", needs=("NgramDrafter",))
def golden_dense_ties(impl):
    """On a uniform 3-token stream, drafts equal llama.cpp's (first chunk of case s1, where 8 % of the evaluated levels tie)."""
    vectors.load_case("s1-syn-v3-nostatic-c4096-d16")
    golden_first_chunks(impl, ["s1-syn-v3-nostatic-c4096-d16"])


def assert_drafts(impl, seq, n_draft, c_st, c_dyn, why: str) -> None:
    """``draft(n_draft)`` after ``seq`` with these caches (loaded from llama.cpp files) is the rules' draft."""
    from conformance import golden, oracle

    drafter = impl.NgramDrafter(c_st=golden.to_backend(impl, c_st), c_dyn=golden.to_backend(impl, c_dyn))
    drafter.reset(seq)
    got, want = [int(t) for t in drafter.draft(n_draft)], oracle.draft(seq, n_draft, oracle.counts(seq), c_dyn, c_st)
    assert got == want, (f"draft({n_draft}) after {seq} with the dynamic cache {c_dyn} and the static cache {c_st}: "
                         f"the rules draft {want} ({why}), the backend drafted {got}")


@check("thresholds", needs=("NgramDrafter", "load_cache"))
def scores_past_32_bits(impl):
    """Scores c * 100 * c_st(y) are exact past 2^31 (static counts 2^24 and 2^25): the follower with the
    larger static count wins, as in the exact rules (llama.cpp's int32 product is replay's score="int32")."""
    c_st = {(1, 2): {3: 2**24, 4: 2**25}, (2, 4): {1: 2**31 - 1}, (2, 3): {1: 2**31 - 1}}
    assert_drafts(impl, [1, 2, 4, 1, 2, 3, 1, 2], 3, c_st, None, "score of 4 = 1 * 100 * 2^25 > 2^31")


@check("thresholds", needs=("NgramDrafter", "load_cache"))
def scores_past_64_bits(impl):
    """Scores c * 100 * c_st(y) are exact past 2^64 (dynamic counts near 2^31 times static weights near
    100 * 2^31: products of about 2^68 that differ in their last bits): the larger product wins, ties to
    the smaller id; the winner then takes the share test (strict p_2 = 66 %), or the static fallback drafts."""
    cases = [  # ((1, 2)'s dynamic followers, its static followers, why the rules draft what they draft)
        ({3: 2**31 - 1, 4: 2**30 - 1}, {3: 2**30, 4: 2**31 - 1}, "3 scores 100 (2^31 - 1) more: it wins, 66.7 % passes"),
        ({3: 2**31 - 1, 4: 2**30}, {3: 2**30, 4: 2**31 - 1}, "equal products: the tie goes to 3, 66.7 % passes"),
        ({3: 2**31 - 1, 4: 2**30 + 1}, {3: 2**30, 4: 2**31 - 1},
         "4 scores 100 (2^31 - 1) more: it wins, its 33 % share fails; the static fallback drafts 4"),
    ]
    for dyn_follow, st_follow, why in cases:
        assert_drafts(impl, [1, 2], 1, {(1, 2): st_follow}, {(1, 2): dyn_follow}, why)


@check("thresholds", needs=("NgramDrafter", "load_cache"))
def weighted_ties_with_different_counts(impl):
    """Equal scores from different counts and weights (2 * 100 * 1 = 1 * 100 * 2) tie, and the tie goes to the
    smaller id, whose own count then passes the share test: the 2-gram (7, 8) is followed by 20, 20, 30, 40
    and the static cache weighs 20 by 1 and 30 by 2, so 20 (2 of 4 = 50 % >= p_2) is drafted, not 30."""
    assert_drafts(impl, [1, 7, 8, 20, 2, 7, 8, 20, 3, 7, 8, 30, 4, 7, 8, 40, 5, 7, 8], 1, {(7, 8): {20: 1, 30: 2}},
                  None, "a tie of 2 * 100 * 1 and 1 * 100 * 2: 20 wins, its 50 % passes")


# Dynamic-cache levels at their thresholds (strict a = 4 3 2 2, p = 75 66 66 66): follower counts
# exactly at a_n and p_n, and one step below each.
STRICT_BOUNDARIES = ({7: 3, 8: 1}, {7: 3}, {7: 74, 8: 26},  # n = 1: sum 4 with 75 %, sum 3, 74 %
                     {7: 2, 8: 1}, {7: 2},  # n = 2: sum 3 with 66.7 %, sum 2
                     {7: 1},  # n = 3, 4: sum 1 < 2
                     {7: 33, 8: 17}, {7: 13, 8: 7}, {8: 3, 7: 1})  # 66 % exactly, 65 %; the best is not the first


@check("thresholds", needs=("NgramDrafter", "load_cache"))
def dynamic_thresholds_at_the_boundary(impl):
    """Each dynamic-cache level n = 1..4 drafts exactly when the count sum reaches a_n and the best share
    reaches p_n (strict thresholds), on counts placed at each boundary and one step below it."""
    from conformance import golden, oracle

    seq = [100, 101, 102, 103]  # no suffix of it has a follower in the context cache
    for n in (1, 2, 3, 4):
        for part in STRICT_BOUNDARIES:
            c_dyn = {tuple(seq[-n:]): part}
            drafter = impl.NgramDrafter(c_dyn=golden.to_backend(impl, c_dyn))
            drafter.reset(seq)
            got, want = [int(t) for t in drafter.draft(1)], oracle.draft(seq, 1, oracle.counts(seq), c_dyn)
            assert got == want, (f"draft(1) after {seq} with the dynamic cache {c_dyn} (level n = {n}: strict "
                                 f"a_{n} = {oracle.STRICT[0][n - 1]}, p_{n} = {oracle.STRICT[1][n - 1]} %): the rules "
                                 f"draft {want}, the backend drafted {got}")


# Context-cache levels at their thresholds (lax a = 2 2 1 1, p = 66 50 50 50): follower counts exactly at
# a_n and p_n, and one step below each. A share one point below p_n needs a large count sum: 65 % is 13 of
# 20, 49 % is 49 of 100 (the two others share 51, each less than 49).
LAX_BOUNDARIES = ({7: 2}, {7: 1},  # n = 1, 2: sum 2 (100 %), sum 1 < 2; n = 3, 4: sum 1 >= 1
                  {7: 33, 8: 17}, {7: 13, 8: 7},  # 66 % exactly, 65 %
                  {7: 1, 8: 1}, {7: 49, 8: 48, 9: 3},  # 50 % exactly (a tie, to 7), 49 %
                  {8: 3, 7: 1})  # 75 %; the best is not the first


def context_with_followers(n: int, part: dict[int, int]) -> list[int]:
    """A context whose last n tokens X (ids 100..) were followed by each y of ``part`` exactly part[y] times
    earlier, and whose last n + 1 tokens (a fresh id 999 before X) never occurred: level n is the largest
    level with followers. The shorter suffixes of X also occurred 3 F times after other tokens (1000..),
    each time followed by a new token (2000..), so that no level below n passes its share test (at most
    25 %) and a wrong decision at level n cannot be hidden by a lower level drafting the same token."""
    x = list(range(100, 100 + n))
    seq = []
    for y, c in part.items():
        for _ in range(c):
            seq += x + [y]
    if n > 1:
        for j in range(3 * sum(part.values())):
            seq += [1000 + j] + x[1:] + [2000 + j]
    return seq + [999] + x


@check("thresholds", needs=("NgramDrafter",))
def context_thresholds_at_the_boundary(impl):
    """Each context-cache level n = 1..4 drafts exactly when the count sum reaches a_n and the best share
    reaches p_n (lax thresholds), on counts placed at each boundary and one step below it."""
    from conformance import oracle

    for n in (1, 2, 3, 4):
        for part in LAX_BOUNDARIES:
            seq = context_with_followers(n, part)
            drafter = impl.NgramDrafter()
            drafter.reset(seq)
            got, want = [int(t) for t in drafter.draft(1)], oracle.draft(seq, 1, oracle.counts(seq))
            assert got == want, (
                f"draft(1) after a context where the last {n} tokens {seq[-n:]} were followed by {part} (counts) "
                f"and the last {n + 1} never occurred, no shorter level passing (level n = {n}: lax a_{n} = {oracle.LAX[0][n - 1]}, "
                f"p_{n} = {oracle.LAX[1][n - 1]} %): the rules draft {want}, the backend drafted {got}")


@check("thresholds", needs=("NgramDrafter", "load_cache"))
def followers_outside_the_static_cache_weigh_1(impl):
    """A follower the static cache does not know weighs exactly 1: seen 60 times (score 60) it loses to one
    seen once with static count 1 (score 100), whose 1/61 share then fails p_n, so nothing is drafted."""
    from conformance import golden, oracle

    seq, c_st = [1, 2, 3] * 60 + [1, 2, 4, 1, 2], {(1, 2): {4: 1}}
    drafter = impl.NgramDrafter(c_st=golden.to_backend(impl, c_st))
    drafter.reset(seq)
    got, want = [int(t) for t in drafter.draft(3)], oracle.draft(seq, 3, oracle.counts(seq), None, c_st)
    assert got == want, (f"draft(3) after [1, 2, 3] * 60 + [1, 2, 4, 1, 2] with the static cache {c_st}: the rules "
                         f"draft {want} (w(3) = 1, w(4) = 100), the backend drafted {got}")
