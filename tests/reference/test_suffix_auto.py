"""The auto drafter's rule at its boundary: the suffix drafter's draft when its match length L >= min_match,
else the lookup's. The inputs are built so that the two drafters disagree, so the test sees which one drafted
(the module's doctest and the other auto tests use inputs where both drafters give the same draft)."""
from __future__ import annotations

import pytest

from reference.ngram.drafter import NgramDrafter
from reference.suffix.auto import AUTO_MIN_MATCH, AutoDrafter
from reference.suffix.drafter import SuffixDrafter

# "1 2 3" was followed by 4 twice and by 9 once, most recently (after "7 1 2 3": L = 3 at that occurrence).
# lookup: the 3-gram's counts {4: 2, 9: 1} draft 4; suffix: the latest occurrence, L = 3, copies 9.
TOKENS = [1, 2, 3, 4, 1, 2, 3, 4, 7, 1, 2, 3, 9, 1, 2, 3]


def alone(drafter, tokens, k=2):
    drafter.reset(tokens)
    return drafter.draft(k)


def test_the_two_drafters_disagree_on_the_input():
    suffix = SuffixDrafter()
    assert alone(suffix, TOKENS) == [9, 1] and suffix.match_length == 3
    assert alone(NgramDrafter(), TOKENS)[0] == 4


@pytest.mark.parametrize("min_match, source", [(1, "suffix"), (2, "suffix"), (3, "suffix"), (4, "lookup"),
                                               (5, "lookup")])
def test_the_suffix_draft_is_taken_from_a_match_of_min_match_tokens_on(min_match, source):
    d = AutoDrafter(SuffixDrafter(), NgramDrafter(), min_match=min_match)
    d.reset(TOKENS)
    expected = alone(SuffixDrafter(), TOKENS) if source == "suffix" else alone(NgramDrafter(), TOKENS)
    assert d.draft(2) == expected and d.match_length == 3


def test_the_default_takes_a_one_token_match():
    """AUTO_MIN_MATCH = 1: "5" occurred once (L = 1) and the suffix drafter copies what followed it, where the
    lookup drafts nothing (one 1-gram occurrence is below a_1 = 2)."""
    assert AUTO_MIN_MATCH == 1
    d = AutoDrafter(SuffixDrafter(), NgramDrafter())
    d.reset([5, 6, 5])
    assert alone(NgramDrafter(), [5, 6, 5]) == []
    assert d.draft(3) == [6, 5, 6] and d.match_length == 1
