"""Suffix drafting (``reference/suffix/drafter.py``): the latest earlier occurrence of the longest suffix
whose length is in the ladder, ``L`` measured there up to ``max_match``, ``min(k, floor(factor * L))``
tokens copied from what followed it (LZ77-style from the sequence itself, or from a history sequence
up to its end); ties to the sequence itself, then the newer history sequence, then the later position;
the history bounded by tokens, oldest sequences dropped first.

Expected values come from hand-worked cases (below, the reasoning next to each) and from the rule
restated on its own in the second part of :mod:`conformance.oracle`.
"""
from __future__ import annotations

import math

from conformance import oracle as rule
from conformance.registry import check
from conformance.strategies import suffix_sessions

NEEDS = ("suffix_drafter",)
# the settings of the hand-worked cases (worked out with factor 2; the rule's defaults are checked apart,
# in defaults_are_the_rules)
DEFAULTS = dict(history=(), max_tokens=rule.SUFFIX_HISTORY_MAX_TOKENS, factor=2.0, max_match=rule.SUFFIX_MAX_MATCH)
M = 2**31 - 1  # the largest token id

# Hand-worked cases: (name, settings that differ from DEFAULTS, steps). A step is ("reset", tokens),
# ("extend", tokens), ("add_history", tokens) or ("draft", k, the draft, L). Positions are 0-based: "ends at
# e" means the occurrence is T[e-m:e] and the token that followed it is T[e]. Unless said otherwise the
# ladder is 1 2 3 4 6 8 12 16 ..., factor 2, max_match 64, and the history is empty.
CASES = [
    # n = 8. "9 1 2" (m = 3) never occurred before; "1 2" (m = 2) ends at e = 3 only (at 8 = n there is no
    # follower). L = 2: before it T[0] = 5 != T[5] = 9. n_d = min(8, 2 * 2) = 4: T[3:7] = 3 4 9 1.
    # After "3 4" is appended: "4 9 1 2 3 4" (m = 6) never occurred; "1 2 3 4" (m = 4) ends at e = 5, L = 4
    # (T[0] = 5 != T[5] = 9): draft(0) drafts nothing but measures L = 4 (not the stale 2); draft(8) copies
    # 8 = 2 * 4 tokens with period n - e = 10 - 5 = 5: 9 1 2 3 4, 9 1 2. A draft is not appended: asking
    # again gives the same. reset() starts afresh: in "3 4" the 4 never occurred before (the old sequence
    # is gone): no match, L = 0.
    ("the docstring's example, k = 0, reset", {}, [
        ("reset", [5, 1, 2, 3, 4, 9, 1, 2]), ("draft", 8, [3, 4, 9, 1], 2),
        ("extend", [3, 4]), ("draft", 0, [], 4), ("draft", 8, [9, 1, 2, 3, 4, 9, 1, 2], 4),
        ("draft", 8, [9, 1, 2, 3, 4, 9, 1, 2], 4),
        ("reset", [3, 4]), ("draft", 4, [], 0)]),
    # n = 5. m = 4: "2 1 2 1" would end at e = 4, where T[0:4] = 1 2 1 2: no. m = 3: "1 2 1" ends at e = 3
    # (T[0:3]); at e = 4, T[1:4] = 2 1 2: no. L = 3 (l <= e = 3). n_d = min(6, 6) = 6, copied from T[3] on
    # and, past the end, from the copy itself: period 5 - 3 = 2: 2 1 2 1 2 1. A run: "7 7" ends at e = 2,
    # L = 2, n_d = 4, period 1.
    ("an occurrence that overlaps the end copies its own period", {}, [
        ("reset", [1, 2, 1, 2, 1]), ("draft", 6, [2, 1, 2, 1, 2, 1], 3),
        ("reset", [7, 7, 7]), ("draft", 5, [7, 7, 7, 7], 2)]),
    # n = 13, the end "1 2 3 4 5" occurred at T[1:6] (e = 6): a 5-token match, and 5 is not in the ladder.
    # m = 6: "9 1 2 3 4 5" never occurred (T[0:6] starts with 0); m = 4: "2 3 4 5" ends at e = 6 only. L is
    # measured there: 5 (T[0] = 0 != T[7] = 9), not 4. n_d = min(10, 2 * 5) = 10, period 13 - 6 = 7:
    # 6 9 1 2 3 4 5, then 6 9 1.
    ("a 5-token match is found through m = 4 and measured as 5", {}, [
        ("reset", [0, 1, 2, 3, 4, 5, 6, 9, 1, 2, 3, 4, 5]), ("draft", 10, [6, 9, 1, 2, 3, 4, 5, 6, 9, 1], 5)]),
    # n = 18, T = 9 1 2 3 4 5 7 8 2 3 4 5 6 1 2 3 4 5. m = 6: "6 1 2 3 4 5" never occurred. m = 4: "2 3 4 5"
    # ends at e = 6 (common length 5: "1 2 3 4 5", T[0] = 9 != T[12] = 6) and at e = 12 (common length 4:
    # T[7] = 8 != T[13] = 1). Both are m = 4 matches: the later one wins although the earlier is longer.
    # L = 4, n_d = 8, period 18 - 12 = 6: 6 1 2 3 4 5, 6 1.
    ("a later 4-token match beats an earlier 5-token one (the ladder's spacing)", {}, [
        ("reset", [9, 1, 2, 3, 4, 5, 7, 8, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5]), ("draft", 8, [6, 1, 2, 3, 4, 5, 6, 1], 4)]),
    # n = 8. "9 1 2" never occurred; "1 2" ends at e = 2 (followed by 8) and e = 5 (followed by 9), both with
    # L = 2. The latest, e = 5: period 3: 9 1 2 9.
    ("the latest occurrence in the sequence", {}, [
        ("reset", [1, 2, 8, 1, 2, 9, 1, 2]), ("draft", 4, [9, 1, 2, 9], 2)]),
    # n = 11. "8 1 2 3" never occurred; "1 2 3" (m = 3) ends at e = 3 only; "2 3" also ends at e = 7, later,
    # but m = 3 is tried first. L = 3, n_d = min(4, 6) = 4: T[3:7] = 7 5 2 3.
    ("a longer match beats a later shorter one", {}, [
        ("reset", [1, 2, 3, 7, 5, 2, 3, 8, 1, 2, 3]), ("draft", 4, [7, 5, 2, 3], 3)]),
    # n = 6. "9 1 2" (m = 3) is nowhere before; "1 2" ends at e = 3 in the sequence (L = 2: T[0] = 5 !=
    # T[3] = 9) and at e = 3 in the history sequence (followed by 6 6). Same m: the sequence wins. Period 3:
    # 9 1 2 9.
    ("a tie between the sequence and the history goes to the sequence", dict(history=[[4, 1, 2, 6, 6]]), [
        ("reset", [5, 1, 2, 9, 1, 2]), ("draft", 4, [9, 1, 2, 9], 2)]),
    # n = 11. "9 1 2 3 4 5" (m = 6) is nowhere before. "2 3 4 5" (m = 4) ends at e = 5 in the sequence (common
    # length 4: T[0] = 8 != T[6] = 1) and at e = 5 in the history (common length 5: 1 2 3 4 5). Both are m = 4
    # matches, a tie: the sequence wins although the history's match is longer. L = 4, n_d = 8, period 6:
    # 9 1 2 3 4 5, 9 1. (The history would have drafted 7.)
    ("ties are by ladder length, not by L", dict(history=[[1, 2, 3, 4, 5, 7]]), [
        ("reset", [8, 2, 3, 4, 5, 9, 1, 2, 3, 4, 5]), ("draft", 8, [9, 1, 2, 3, 4, 5, 9, 1], 4)]),
    # As two cases above, but the history sequence starts 9 1 2: "9 1 2" (m = 3) ends at e = 3 there and
    # nowhere in the sequence: the history wins. L = 3 (l <= e = 3). n_d = min(8, 6) = 6, but the history
    # sequence ends after 6 6.
    ("a longer match in the history beats the sequence", dict(history=[[9, 1, 2, 6, 6]]), [
        ("reset", [5, 1, 2, 9, 1, 2]), ("draft", 8, [6, 6], 3)]),
    # n = 3: 3 never occurred in the sequence. "1 2 3" ends at e = 4 in the history sequence 4 1 2 3 6.
    # L = 3 (l <= n = 3). n_d = min(10, 6) = 6: the copy stops at the history sequence's end after one token.
    ("a copy from the history stops at the end of its sequence", dict(history=[[4, 1, 2, 3, 6]]), [
        ("reset", [1, 2, 3]), ("draft", 10, [6], 3)]),
    # The only 2 of the history is its last token: nothing followed it there, so it is no occurrence.
    ("the last token of a history sequence is no occurrence", dict(history=[[7, 1, 2]]), [
        ("reset", [1, 2]), ("draft", 4, [], 0)]),
    # n = 3. "9 1 2" is nowhere; "1 2" ends at e = 2 in the older history sequence (followed by 3) and at
    # e = 3 in the newer one (followed by 5 6 8 8), L = 2 in both (7 != 9 before the newer one). The newer
    # wins: n_d = min(3, 4) = 3: 5 6 8.
    ("the newer history sequence wins a tie", dict(history=[[1, 2, 3, 4, 4, 4], [7, 1, 2, 5, 6, 8, 8]]), [
        ("reset", [9, 1, 2]), ("draft", 3, [5, 6, 8], 2)]),
    # "1 2" ends at e = 2 (followed by 3) and e = 5 (followed by 4 4) of the history sequence: the later one.
    ("the later position in a history sequence", dict(history=[[1, 2, 3, 1, 2, 4, 4]]), [
        ("reset", [1, 2]), ("draft", 2, [4, 4], 2)]),
    # max_tokens 7: 4 + 3 = 7 tokens, both kept. "1 2" ends at e = 2 of the first: L = 2, n_d = 4, the
    # sequence ends after 3 9.
    ("the history within its bound drafts", dict(history=[[1, 2, 3, 9], [5, 5, 5]], max_tokens=7), [
        ("reset", [8, 1, 2]), ("draft", 4, [3, 9], 2)]),
    # max_tokens 6: adding 5 5 5 makes 7 tokens, so the oldest sequence (1 2 3 9) is dropped: no match.
    ("evicted history no longer drafts", dict(history=[[1, 2, 3, 9], [5, 5, 5]], max_tokens=6), [
        ("reset", [8, 1, 2]), ("draft", 4, [], 0)]),
    # max_tokens 4: the 6-token sequence keeps its last 4 tokens, 3 4 5 6. The 1 that was followed by 2 3 is
    # gone: no match. The 4 ends at e = 2 of what is kept: L = 1 (3 != 0 before it), n_d = min(4, 2) = 2.
    ("a sequence longer than the bound keeps its end", dict(history=[[1, 2, 3, 4, 5, 6]], max_tokens=4), [
        ("reset", [0, 1]), ("draft", 4, [], 0), ("reset", [0, 4]), ("draft", 4, [5, 6], 1)]),
    # max_tokens 0: the history keeps nothing (the 1 followed by 2 would otherwise draft).
    ("a history bounded by 0 tokens is empty", dict(history=[[5, 1, 2]], max_tokens=0), [
        ("reset", [1]), ("draft", 4, [], 0)]),
    # No history at first: "1 2" is nowhere. add_history(4 1 2 5): "1 2" ends at e = 3 there, L = 2, the
    # copy stops after 5. max_tokens 6: adding 3 3 3 makes 7 tokens, 4 1 2 5 is dropped: no match again.
    ("history added after the drafter was made is read, and evicted", dict(max_tokens=6), [
        ("reset", [1, 2]), ("draft", 4, [], 0), ("add_history", [4, 1, 2, 5]), ("draft", 4, [5], 2),
        ("add_history", [3, 3, 3]), ("draft", 4, [], 0)]),
    # factor 0.5. n = 7. "4 1 2 3" is nowhere before; "1 2 3" ends at e = 3, L = 3: n_d = min(8, floor(1.5))
    # = 1: 4. With factor 1.5, floor(4.5) = 4, period 4: 4 1 2 3.
    ("the factor limits the draft", dict(factor=0.5), [
        ("reset", [1, 2, 3, 4, 1, 2, 3]), ("draft", 8, [4], 3)]),
    ("the factor limits the draft (1.5)", dict(factor=1.5), [
        ("reset", [1, 2, 3, 4, 1, 2, 3]), ("draft", 8, [4, 1, 2, 3], 3)]),
    # factor 0.5, n = 3: "2 1" is nowhere before, 1 ends at e = 1: L = 1, n_d = floor(0.5) = 0. A match
    # (L = 1 reported) and no draft.
    ("a factor below 1 can draft nothing after a match", dict(factor=0.5), [
        ("reset", [1, 2, 1]), ("draft", 4, [], 1)]),
    # max_match 3: only ladder lengths <= 3 are tried. "2 3 4" ends at e = 4 (common length 4: 1 2 3 4), so
    # L = min(4, 3) = 3 and n_d = min(8, 6) = 6, period 9 - 4 = 5: 5 1 2 3 4, 5.
    ("max_match caps L", dict(max_match=3), [
        ("reset", [1, 2, 3, 4, 5, 1, 2, 3, 4]), ("draft", 8, [5, 1, 2, 3, 4, 5], 3)]),
    # Nothing before the end to match: an empty sequence, one token, three distinct tokens.
    ("no match, no draft", {}, [
        ("reset", []), ("draft", 4, [], 0), ("reset", [7]), ("draft", 4, [], 0),
        ("reset", [1, 2, 3]), ("draft", 4, [], 0)]),
    # The largest id: M ends at e = 1 ("0 M" is nowhere before), L = 1, n_d = 2, period 2: 0 M.
    ("the largest token id", {}, [
        ("reset", [M, 0, M]), ("draft", 4, [0, M], 1)]),
]


def _settings(overrides: dict) -> dict:
    return {**DEFAULTS, **overrides}


def _describe(settings: dict) -> str:
    parts = [f"{k} {v}" for k, v in settings.items() if k != "history" and v != DEFAULTS[k]]
    if settings["history"]:
        parts.insert(0, f"history {list(settings['history'])}")
    return ", ".join(parts) or "default settings"


@check("suffix", needs=NEEDS)
def hand_worked_cases(impl):
    """Drafts and match lengths equal hand-worked cases (the reasoning is in conformance/checks/suffix.py).

    The cases: overlapping copies, the ladder's gaps, ties between the sequence and the history, the newest
    history, eviction, the end of a history sequence, the factor, k = 0, max_match, no match."""
    for name, overrides, steps in CASES:
        s = _settings(overrides)
        drafter = impl.suffix_drafter(list(map(list, s["history"])), s["max_tokens"], s["factor"], s["max_match"])
        done = []
        for step in steps:
            if step[0] == "draft":
                _, k, want, want_L = step
                got = [int(t) for t in drafter.draft(k)]
                L = int(drafter.match_length)
                assert (got, L) == (want, want_L), (
                    f"case {name!r} ({_describe(s)}), after {done}: draft({k}) drafted {got} with match_length "
                    f"{L}; the rule drafts {want} with L = {want_L}")
            else:
                getattr(drafter, step[0])(list(step[1]))
            done.append(f"{step[0]}({', '.join(map(str, step[1:2]))})")


def drive(impl, session, on_draft) -> None:
    """Drive the backend's suffix drafter through ``session`` (:func:`conformance.strategies.suffix_sessions`):
    for each request, ``reset(prompt)``, then draft, append the accepted prefix of the draft and the next
    true token with ``extend``, until the stream is complete; then, if asked, ``add_history(stream)``. The
    drafter first drafts for another sequence (the reversed first stream): reset() must start afresh.
    ``on_draft(T, k, history, drafted, L)`` sees every draft, with the history the rule keeps."""
    settings, history, requests = session
    drafter = impl.suffix_drafter([list(h) for h in history], settings["max_tokens"], settings["factor"],
                                  settings["max_match"])
    added = [list(h) for h in history]
    drafter.reset(requests[0][0][::-1])
    drafter.draft(4)
    for stream, prompt_len, ks, add in requests:
        seq = list(stream[:prompt_len])
        drafter.reset(list(seq))
        i = 0
        while True:
            k = ks[i % len(ks)]
            i += 1
            got = [int(t) for t in drafter.draft(k)]
            on_draft(seq, k, rule.kept_history(added, settings["max_tokens"]), got, int(drafter.match_length))
            if len(seq) >= len(stream):
                break
            rest = stream[len(seq):]
            n_ok = next((j for j, (d, t) in enumerate(zip(got, rest)) if d != t), min(len(got), len(rest)))
            new = list(rest[:n_ok + 1])
            drafter.extend(new)
            seq += new
        if add:
            drafter.add_history(list(stream))
            added.append(list(stream))


def _where(settings, T, history) -> str:
    return (f"the sequence {T}, the history as the bound keeps it {history} (factor {settings['factor']}, max_match "
            f"{settings['max_match']}, max_tokens {settings['max_tokens']})")


@check("suffix", needs=NEEDS, given=dict(session=suffix_sessions()), examples=100)
def drafts_follow_the_rule(impl, session):
    """During generations with a history that requests join, every draft and its match_length are the rule's."""
    settings = session[0]

    def compare(T, k, history, got, L):
        want = rule.suffix_draft(T, k, history, factor=settings["factor"], max_match=settings["max_match"])
        assert (got, L) == (want.draft, want.match_length), (
            f"draft({k}) after {_where(settings, T, history)}: the rule drafts {want.draft} with L = "
            f"{want.match_length} (copied from {want.source} at position {want.end}), the backend drafted {got} "
            f"with match_length {L}")

    drive(impl, session, compare)


@check("suffix", needs=NEEDS, given=dict(session=suffix_sessions()), examples=50)
def drafts_are_copies_of_a_longest_match(impl, session):
    """Every draft copies what followed an occurrence of the last L tokens, L of the longest ladder length.

    Without the oracle's choice among occurrences: 0 <= L <= min(max_match, n); L >= 1 exactly when the last
    token occurred before with a follower (in the sequence or a kept history sequence); the draft has at most
    min(k, floor(factor * L)) tokens and is the continuation, copied with its period in the sequence or up to
    a history sequence's end, after some occurrence matching exactly L tokens (or max_match: L is then
    max_match); no occurrence anywhere matches a longer ladder length than L's. So with L = 0 the draft is
    empty, and with L >= 1, k >= 1 and factor * L >= 1 it is not."""
    settings = session[0]
    factor, max_match = settings["factor"], settings["max_match"]

    def invariants(T, k, history, got, L):
        where = f"draft({k}) after {_where(settings, T, history)} drafted {got} with match_length {L}"
        n = len(T)
        assert 0 <= L <= min(max_match, n), f"{where}: L must be in 0..min(max_match, len(sequence))"
        seen = n >= 1 and (T[-1] in T[:-1] or any(T[-1] in h[:-1] for h in history))
        assert (L >= 1) == seen, (f"{where}: the last token {'did' if seen else 'did not'} occur before (with a "
                                  f"follower), so L must be {'>= 1' if seen else '0'}")
        n_d = min(max(k, 0), math.floor(factor * L))
        assert len(got) <= n_d, f"{where}: at most min(k, floor(factor * L)) = {n_d} tokens"
        if L == 0:
            return
        found = rule.occurrences(T, history, max_match)
        best = max(rule.rung(o.common, max_match) for o in found)
        assert rule.rung(L, max_match) == best, (
            f"{where}: some occurrence matches the last {best} tokens (a ladder length), so L must be at least "
            f"{best} and below the next ladder length")
        witnesses = [o for o in found if o.common == L and got == (
            [T[o.end + j % (n - o.end)] for j in range(n_d)] if o.source == -1
            else history[o.source][o.end:o.end + n_d])]
        assert witnesses, (f"{where}: no earlier occurrence of the last {L} tokens (matching exactly {L}, or "
                           f"max_match) was followed by this draft of min(k, floor(factor * L)) = {n_d} tokens "
                           "(fewer only where a history sequence ends)")

    drive(impl, session, invariants)


@check("suffix", needs=NEEDS)
def long_matches_and_drafts(impl):
    """Long matches and drafts: L stops at max_match = 64, drafts reach 1000 tokens, long streams draft by the rule.

    A 100-token match measured as 64 drafting 2 * 64 tokens, a 1000-token draft of a run, and drafts along a
    1,500-token stream (a 300-token stretch repeated) with a 2,100-token history bounded to 1,500 tokens."""
    import random

    A = list(range(100, 200))
    cases = [
        # "the latest occurrence of the last 64 tokens": T[36:100] ends at e = 100; L = min(100, 64) = 64;
        # n_d = min(200, 128) = 128, period 100: A, then A[:28].
        ("a 100-token match", DEFAULTS, A + A, 200, A + A[:28], 64),
        # "5 5" ends at e = 2 (L = 2); factor 1024: n_d = min(1000, 2048) = 1000, period 1.
        ("a 1000-token draft", {**DEFAULTS, "factor": 1024.0}, [5, 5, 5], 1000, [5] * 1000, 2),
    ]
    for name, s, T, k, want, want_L in cases:
        drafter = impl.suffix_drafter([], s["max_tokens"], s["factor"], s["max_match"])
        drafter.reset(T)
        got = [int(t) for t in drafter.draft(k)]
        L = int(drafter.match_length)
        assert (got, L) == (want, want_L), (f"{name}: draft({k}) after {len(T)} tokens (factor {s['factor']}) "
                                            f"drafted {len(got)} tokens {got[:12]}... with match_length {L}; the "
                                            f"rule drafts {len(want)} tokens {want[:12]}... with L = {want_L}")
    r = random.Random(20261203)
    base = [r.randrange(12) for _ in range(1500)]
    base[900:1200] = base[100:400]  # a 300-token repeat: long matches, copies past max_match
    history = [[r.randrange(12) for _ in range(500)] for _ in range(3)] + [base[300:900]]
    kept = rule.kept_history(history, 1500)  # the two newest sequences: 1,100 tokens
    drafter = impl.suffix_drafter(history, 1500, 2.0, 64)
    drafter.reset(base[:50])
    n = 50
    for k in (16, 64, 128, 3, 200, 8, 0, 32):
        for _ in range(3):
            T = base[:n]
            got = [int(t) for t in drafter.draft(k)]
            want = rule.suffix_draft(T, k, kept, factor=2.0)
            assert (got, int(drafter.match_length)) == (want.draft, want.match_length), (
                f"draft({k}) after the first {n} tokens of a 1,500-token stream, with a history bounded to 1,500 "
                f"tokens: the rule drafts {want.draft} with L = {want.match_length} (from {want.source} at "
                f"{want.end}), the backend drafted {got} with match_length {drafter.match_length}")
            drafter.extend(base[n:n + 60])
            n += 60


@check("suffix", needs=NEEDS)
def ladder_lengths_are_the_rules(impl):
    """Exactly the ladder's lengths rank matches: for each c = 2..64, a c-token match beats a later (c-1)-token
    match iff c is in the ladder 1 2 3 4 6 8 12 16 24 32 48 64."""
    for c in range(2, rule.SUFFIX_MAX_MATCH + 1):
        W = [1000 + i for i in range(c)]  # the sequence ends with W, after the token 3
        # A = 1 W 4: W ended there, 1 != 3 before it: c tokens in common. B = 2 W[1:] 5: c - 1 tokens (2 != W[0]).
        T = [1] + W + [4] + [2] + W[1:] + [5] + [3] + W
        want, want_L = ([4], c) if c in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64) else ([5], c - 1)
        drafter = impl.suffix_drafter([], rule.SUFFIX_HISTORY_MAX_TOKENS, 2.0, 64)
        drafter.reset(T)
        got = [int(t) for t in drafter.draft(1)]
        L = int(drafter.match_length)
        assert (got, L) == (want, want_L), (
            f"a {c}-token match ending at {c + 1} (followed by 4) and a later {c - 1}-token one (followed by 5): "
            f"{'the longer wins: ' + str(c) + ' is' if want == [4] else 'the later wins: ' + str(c) + ' is not'} "
            f"a ladder length, so draft(1) is {want} with L = {want_L}; the backend drafted {got} with "
            f"match_length {L} (the sequence {T})")


@check("suffix", needs=NEEDS)
def defaults_are_the_rules(impl):
    """Settings left out are the rule's: factor 4, max_match 64, a history bounded by 2^18 tokens."""
    A = list(range(100, 200))
    drafter = impl.suffix_drafter()
    drafter.reset(A + A)  # a 100-token match: L = max_match = 64, n_d = min(300, 4 * 64) = 256
    got = [int(t) for t in drafter.draft(300)]
    L = int(drafter.match_length)
    assert (got, L) == (A + A + A[:56], 64), (
        f"suffix_drafter() with no settings, after the 100 tokens 100..199 twice: draft(300) must copy 4 * 64 = "
        f"256 tokens (factor 4, max_match 64) with L = 64; the backend drafted {len(got)} tokens with match_length {L}")
    big = [6] + [5] * (rule.SUFFIX_HISTORY_MAX_TOKENS - 3) + [7, 8]  # exactly 2^18 tokens
    drafter = impl.suffix_drafter([big])
    for added, T, want, why in (
            (None, [6], [5, 5, 5, 5], "the history holds exactly its bound of 2^18 tokens: all of them are kept, the "
                                      "first 6 (followed by 5 5 ...) too"),
            ([9], [7], [], "adding one more token makes 2^18 + 1: the 2^18-token sequence is dropped, its 7 8 too")):
        if added:
            drafter.add_history(added)
        drafter.reset(T)
        got = [int(t) for t in drafter.draft(4)]
        assert got == want, (f"suffix_drafter([a 2^18-token sequence]): {why}; draft(4) after {T} must be {want}, "
                             f"got {got}")


@check("suffix", needs=NEEDS)
def invalid_settings_are_refused(impl):
    """A factor <= 0, a max_match below 1 and a history bound below 0 raise ValueError."""
    for what, args in (("factor 0", ([], 100, 0.0, 64)), ("factor -1", ([], 100, -1.0, 64)),
                       ("max_match 0", ([], 100, 2.0, 0)), ("max_tokens -1", ([], -1, 2.0, 64))):
        try:
            impl.suffix_drafter(*args)
        except ValueError:
            continue
        raise AssertionError(f"suffix_drafter with {what} returned instead of raising ValueError")
