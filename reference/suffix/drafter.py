"""Suffix drafting: find where the end of the sequence occurred before, and copy what followed it.

The rule (ours; the idea is prompt lookup's and SuffixDecoding's, arXiv 2411.04975): with ``T`` the
sequence so far (prompt and output, ``n = len(T)`` tokens) and ``H = [h_1 .. h_r]`` the history
(earlier requests' prompts and outputs, oldest first), a draft of up to ``k`` tokens is::

    m*   = the largest m in LADDER, m <= min(n, max_match), such that the suffix s_m = T[n-m:n]
           occurred earlier: T[e-m:e] == s_m for some end e < n (in the sequence itself), or
           h[e-m:e] == s_m for some e < len(h) (in a history sequence h: followed by a token)
    e    = the LATEST such occurrence: the largest e in T if any; else in the newest h that has one,
           its largest e
    L    = the match length there: the largest l <= max_match (l <= n, l <= e) with the l tokens
           before e equal to T[n-l:n]                                      (L >= m*)
    n_d  = min(k, floor(factor * L))                                      draft length
    d_j  = U[e + j], j = 0 .. n_d - 1: the tokens that followed, where U is T followed by the draft
           itself (an occurrence in T that overlaps the end copies its own period, as LZ77 does) or
           the history sequence h (the draft stops at h's end)

No earlier occurrence of even the last token: no draft. Ties in length go to the sequence itself,
then to the newer history sequence, then to the later position: the latest occurrence, because what
an agent rewrites is the newest version of a text it was shown (the file in this prompt rather than
the same file in an earlier turn) and what a repeated answer continues is its most recent pattern.

Why a LADDER of lengths rather than every length up to ``max_match``: the fast backend keeps one
"latest end" index per length in the ladder (an O(len(LADDER)) append per token, independent of
``n``); existence is monotone in m (a suffix that occurred has all its shorter suffixes occur at the
same ends), so the largest ladder length found is the longest matched suffix to within the ladder's
spacing, and ``L`` then measures the real match at the chosen occurrence.

``factor`` bounds the draft by the evidence, like SuffixDecoding's ``max_spec_factor``: a one-token
match drafts ``factor`` tokens, a 32-token match drafts up to ``32 * factor``. The cost-aware policy
(``mlx_backend.decode.draft_policy``) then decides how many of them to verify.

>>> d = SuffixDrafter()
>>> d.reset([5, 1, 2, 3, 4, 9, 1, 2])
>>> d.draft(8), d.match_length     # "1 2" occurred at positions 1..2, followed by 3 4 9 1 2 (3 4 9 ...)
([3, 4, 9, 1, 2, 3, 4, 9], 2)
>>> d.draft(3)                     # at most k
[3, 4, 9]
>>> d.extend([3, 4])
>>> d.draft(8), d.match_length     # now "9 1 2 3 4"'s suffix "1 2 3 4" matched, L = 4
([9, 1, 2, 3, 4, 9, 1, 2], 4)
>>> d.reset([7, 7, 7])             # a run copies its own period
>>> d.draft(5)
[7, 7, 7, 7, 7]
>>> SuffixDrafter(factor=1.0).draft(5)   # nothing seen: nothing drafted
[]
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence

from reference.ngram.tokens import check_token_list, is_whole

LADDER = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # suffix lengths searched, longest first
MAX_MATCH = 64                                       # the longest match measured (L <= MAX_MATCH)
FACTOR = 4.0                                         # draft length <= FACTOR * L (measured: docs/suffix.md)
HISTORY_MAX_TOKENS = 1 << 18                         # the history's default bound, in tokens (~40 MB fast)


class SuffixHistory:
    """Earlier sequences (a request's prompt followed by its output), oldest first, bounded by tokens.

    ``add`` appends a sequence and then drops the oldest ones while the total exceeds ``max_tokens``
    (least recently added first); a single sequence longer than ``max_tokens`` keeps its last
    ``max_tokens`` tokens. Shared by the drafters of one scope (``ngram-spec serve``: all users, or one).

    >>> h = SuffixHistory(max_tokens=5)
    >>> h.add([1, 2, 3]); h.add([4, 5]); h.add([6])
    >>> h.sequences, h.n_tokens
    ([[4, 5], [6]], 3)
    """

    def __init__(self, max_tokens: int = HISTORY_MAX_TOKENS):
        if not isinstance(max_tokens, numbers.Integral) or max_tokens < 0:
            raise ValueError(f"the history's max_tokens must be a whole number >= 0, got {max_tokens!r}")
        self.max_tokens = max_tokens
        self.sequences: list[list[int]] = []
        self.n_tokens = 0

    def add(self, tokens: Iterable[int]) -> None:
        """Append a finished sequence, then drop the oldest while over ``max_tokens`` (see above)."""
        seq = check_token_list(tokens)[-self.max_tokens:] if self.max_tokens else []
        if seq:
            self.sequences.append(seq)
            self.n_tokens += len(seq)
        while self.n_tokens > self.max_tokens:
            self.n_tokens -= len(self.sequences.pop(0))


def match_length(a: Sequence[int], e: int, b: Sequence[int], n: int, limit: int) -> int:
    """The largest ``l <= limit`` (and ``<= e``, ``<= n``) with ``a[e-l:e] == b[n-l:n]``."""
    l = 0
    while l < min(limit, e, n) and a[e - 1 - l] == b[n - 1 - l]:
        l += 1
    return l


def latest_end(source: Sequence[int], m: int, T: Sequence[int], end_limit: int) -> int:
    """The largest ``e < end_limit`` (``e >= m``) with ``source[e-m:e] == T[-m:]``, or -1."""
    suffix = list(T[len(T) - m:])
    for e in range(end_limit - 1, m - 1, -1):
        if list(source[e - m:e]) == suffix:
            return e
    return -1


def find_match(T: Sequence[int], history: Sequence[Sequence[int]], *, ladder=LADDER,
               max_match: int = MAX_MATCH) -> tuple[int, int, int] | None:
    """``(source, e, L)`` of the rule above: ``source`` -1 for the sequence itself, else the index of
    the history sequence; None when not even the last token occurred before."""
    n = len(T)
    for m in sorted((m for m in ladder if m <= min(n, max_match)), reverse=True):
        e = latest_end(T, m, T, n)
        if e >= 0:
            return -1, e, match_length(T, e, T, n, max_match)
        for i in range(len(history) - 1, -1, -1):
            e = latest_end(history[i], m, T, len(history[i]))
            if e >= 0:
                return i, e, match_length(history[i], e, T, n, max_match)
    return None


def check_settings(factor: float, max_match: int, ladder: Sequence[int]) -> tuple[int, ...]:
    """The ladder, sorted and without repeats, once the settings are valid (ValueError naming the bad one).

    >>> check_settings(4.0, 64, (8, 1, 8))
    (1, 8)
    """
    if not isinstance(factor, numbers.Real) or not 0 < factor < math.inf:
        raise ValueError(f"factor must be a finite number > 0, got {factor!r}")
    lengths = [max_match, *ladder]
    if not ladder or not all(is_whole(m) and m >= 1 for m in lengths):
        raise ValueError(f"max_match and every ladder length must be whole numbers >= 1, got max_match={max_match!r}, "
                         f"ladder={tuple(ladder)!r}")
    return tuple(sorted(set(ladder)))


class SuffixDrafter:
    """Drafts by the rule of this module from the sequence it has seen and ``history`` (a
    :class:`SuffixHistory`, read only: the caller adds finished sequences to it).

    After each :meth:`draft`, :attr:`match_length` is ``L`` (0: no match): the draft-length policy
    keys its acceptance estimate by it.
    """

    def __init__(self, history: SuffixHistory | None = None, *, factor: float = FACTOR,
                 max_match: int = MAX_MATCH, ladder: Sequence[int] = LADDER):
        self.ladder = check_settings(factor, max_match, ladder)
        self.history, self.factor, self.max_match = history, factor, max_match
        self.tokens: list[int] = []
        self.match_length = 0

    def reset(self, prompt: Sequence[int]) -> None:
        """Start a sequence: ``T`` = the prompt (the history is kept)."""
        self.tokens = check_token_list(prompt)
        self.match_length = 0

    def extend(self, tokens: Iterable[int]) -> None:
        """Append emitted tokens to ``T``."""
        self.tokens.extend(check_token_list(tokens))

    def draft(self, k: int) -> list[int]:
        """``d_0 .. d_{n_d-1}`` of the module's rule for ``T`` and the history (``[]`` without a match or
        for ``k = 0``); sets :attr:`match_length` to ``L`` even when ``k = 0``."""
        if not isinstance(k, numbers.Integral) or k < 0:
            raise ValueError(f"k must be a whole number >= 0, got {k!r}")
        history = self.history.sequences if self.history is not None else []
        found = find_match(self.tokens, history, ladder=self.ladder, max_match=self.max_match)
        self.match_length = found[2] if found else 0
        if found is None or k == 0:
            return []
        source, e, L = found
        n_d = min(k, int(self.factor * L))
        if source == -1:
            U = list(self.tokens)
            for j in range(n_d):
                U.append(U[e + j])
            return U[len(self.tokens):]
        return list(history[source][e:e + n_d])
