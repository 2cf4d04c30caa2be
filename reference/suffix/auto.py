"""The ``auto`` drafter: suffix drafting where the sequence's end matched something long enough, else
llama.cpp's lookup.

Rule, per draft: ask the suffix drafter; if its match length ``L`` is at least ``min_match``, its
draft is the draft; otherwise the lookup drafter's (n-gram counts of sizes 1..4, the dynamic and static
caches) is. A short match says little about which continuation is right, where the lookup's counts
and thresholds (``a_n``, ``p_n``) choose among continuations; a long one pins the copy down, and the
copy runs as far as it agrees, which the lookup's fixed 4-gram window cannot see.

>>> from reference.ngram.drafter import NgramDrafter
>>> from reference.suffix.drafter import SuffixDrafter
>>> d = AutoDrafter(SuffixDrafter(), NgramDrafter(), min_match=3)
>>> d.reset([1, 2, 3, 4, 5, 6, 1, 2, 3])
>>> d.draft(4), d.match_length      # "1 2 3" matched (L = 3): the suffix drafter's copy
([4, 5, 6, 1], 3)
>>> d.reset([1, 2, 9, 1, 2])
>>> d.draft(4), d.match_length      # L = 2 < 3: the lookup's draft (one 2-gram seen once: below a_n)
([], 2)
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

AUTO_MIN_MATCH = 1   # measured on edit traces: any match beats the lookup (docs/suffix.md)


class AutoDrafter:
    """``suffix`` (a :class:`reference.suffix.drafter.SuffixDrafter` or the fast one) where its match is
    at least ``min_match`` tokens long, else ``lookup`` (an ``NgramDrafter`` of either backend).
    :attr:`match_length` is the suffix drafter's ``L`` of the last draft."""

    def __init__(self, suffix, lookup, *, min_match: int = AUTO_MIN_MATCH):
        if min_match < 0:
            raise ValueError(f"min_match must be >= 0, got {min_match}")
        self.suffix, self.lookup, self.min_match = suffix, lookup, min_match
        self.match_length = 0

    def reset(self, prompt: Sequence[int]) -> None:
        """Reset both drafters with the prompt."""
        self.suffix.reset(prompt)
        self.lookup.reset(prompt)
        self.match_length = 0

    def extend(self, tokens: Iterable[int]) -> None:
        """Hand the emitted tokens to both drafters (the one not asked must still see them)."""
        tokens = list(tokens)
        self.suffix.extend(tokens)
        self.lookup.extend(tokens)

    def draft(self, k: int) -> list[int]:
        """The suffix drafter's draft when its ``L >= min_match``, else the lookup's (the module's rule)."""
        drafts = self.suffix.draft(k)
        self.match_length = self.suffix.match_length
        if self.match_length >= self.min_match:
            return drafts
        return self.lookup.draft(k)


DRAFTERS = ("lookup", "suffix", "auto")
DEFAULT_DRAFTER = "auto"   # generation's default (ngram-spec generate / serve, stream_generate)


def make_drafter(name: str, *, c_st=None, c_dyn=None, history=None, score: str = "exact",
                 min_match: int = AUTO_MIN_MATCH):
    """The reference drafter called ``name`` (one of :data:`DRAFTERS`): ``lookup`` llama.cpp's
    (``c_st``, ``c_dyn``, ``score``), ``suffix`` this package's (``history``: a ``SuffixHistory`` or
    None), ``auto`` the two by the rule of this module.

    >>> make_drafter("sufix")
    Traceback (most recent call last):
    ...
    ValueError: unknown drafter 'sufix': choose one of lookup, suffix, auto
    """
    from reference.ngram.drafter import NgramDrafter
    from reference.suffix.drafter import SuffixDrafter

    if name not in DRAFTERS:
        raise ValueError(f"unknown drafter {name!r}: choose one of {', '.join(DRAFTERS)}")
    if name == "lookup":
        return NgramDrafter(c_st=c_st, c_dyn=c_dyn, score=score)
    if name == "suffix":
        return SuffixDrafter(history)
    return AutoDrafter(SuffixDrafter(history), NgramDrafter(c_st=c_st, c_dyn=c_dyn, score=score), min_match=min_match)
