"""The suffix drafter's settings and draft length: a value with no meaning is refused when it is given,
with one line naming it, not at the first draft with Python's error from inside the rule."""
from __future__ import annotations

import pytest

from reference.suffix.drafter import SuffixDrafter, SuffixHistory


@pytest.mark.parametrize("settings, message", [
    (dict(factor=float("nan")), "factor must be a finite number > 0, got nan"),
    (dict(factor=float("inf")), "factor must be a finite number > 0, got inf"),
    (dict(factor="4"), "factor must be a finite number > 0, got '4'"),
    (dict(ladder=(1.5, 2)), "every ladder length must be whole numbers >= 1"),
    (dict(max_match=2.5), "max_match and every ladder length must be whole numbers >= 1, got max_match=2.5"),
    (dict(ladder=()), "every ladder length must be whole numbers >= 1"),
])
def test_settings_with_no_meaning_are_refused_at_construction(settings, message):
    """nan and inf used to pass and fail at the first draft (int(nan * L)), a fractional ladder length deep
    in the search (slice indices), and max_match=2.5 let a match of 3 tokens through."""
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        SuffixDrafter(**settings)


@pytest.mark.parametrize("k", [2.5, 2.0, None])
def test_a_draft_length_that_is_not_a_whole_number_is_refused(k):
    d = SuffixDrafter()
    d.reset([1, 2, 3, 1, 2])
    with pytest.raises(ValueError, match=f"k must be a whole number >= 0, got {k!r}"):
        d.draft(k)
    assert d.draft(2) == [3, 1]


@pytest.mark.parametrize("max_tokens", [5.0, None, -1])
def test_the_history_bound_must_be_a_whole_number(max_tokens):
    """5.0 used to be accepted and fail at the first add (slice indices), None with a comparison TypeError."""
    with pytest.raises(ValueError, match="the history's max_tokens must be a whole number >= 0"):
        SuffixHistory(max_tokens=max_tokens)
