"""The batched verify width (mlx_backend.batch.policy): properties of the rule S* = argmax tokens / c(B S), and
of the burst rule S*_burst = argmax (P(R) - P(R - E(S))) / c(B S) (nobody waits: the time until the last row
ends)."""
from __future__ import annotations

from hypothesis import assume, given, settings, strategies as st

from mlx_backend.batch.policy import expected_tokens, leave_plain, plain_time, relative_costs, width
from mlx_backend.decode.draft_policy import MIN_PLAIN, DraftPolicy, StepCosts


def curve(T_max, slope):
    return [1.0 + slope * (T - 1) for T in range(1, T_max + 1)]


acceptances = st.lists(st.floats(0.0, 1.0), min_size=1, max_size=12)
rows = st.lists(st.tuples(acceptances, st.integers(0, 12)), min_size=1, max_size=6)


def table(rows_):
    expected = [expected_tokens(a, n) for a, n in rows_]
    return expected, [min(n, len(a)) for a, n in rows_]


@settings(max_examples=200, deadline=None)
@given(rows, st.floats(0.0, 2.0), st.floats(0.0, 2.0))
def test_steeper_costs_never_widen(rows_, slope, extra):
    expected, n = table(rows_)
    T = len(n) * (1 + max(n))
    assert width(expected, n, curve(T, slope + extra)) <= width(expected, n, curve(T, slope))


@settings(max_examples=200, deadline=None)
@given(rows, st.floats(0.0, 2.0))
def test_the_width_beats_every_other(rows_, slope):
    """No other S gives more tokens per cost (the rule's definition, checked from outside: every S tried)."""
    expected, n = table(rows_)
    B, T = len(n), len(n) * (1 + max(n))
    costs = curve(T, slope)
    S = width(expected, n, costs)
    rate = lambda S_: sum(e[min(k, S_ - 1)] for e, k in zip(expected, n)) / costs[B * S_ - 1]  # noqa: E731
    assert all(rate(S) >= rate(other) * (1 - 2e-9) for other in range(1, max(n) + 2))   # ties: the narrower


def test_free_text_decodes_plainly_and_free_verification_drafts_all():
    nothing = [expected_tokens([0.0] * 8, 8)] * 4
    assert width(nothing, [8] * 4, curve(36, 0.05)) == 1          # no draft is ever accepted
    perfect = [expected_tokens([1.0] * 8, 8)] * 4
    assert width(perfect, [8, 3, 8, 0], [1.0] * 36) == 9          # verifying is free: the longest proposal


@settings(max_examples=100, deadline=None)
@given(rows, st.integers(1, 40), st.integers(1, 13))
def test_budget_and_fixed_minimum(rows_, budget, s_min):
    expected, n = table(rows_)
    B, T = len(n), len(n) * (1 + max(n))
    S = width(expected, n, [1.0] * T, s_min=s_min, max_batch_tokens=budget)
    assert 1 <= S <= 1 + max(n)
    assert B * S <= max(budget, B)                        # a budget below B rows still runs one token a row
    if B * min(s_min, 1 + max(n)) <= budget:
        assert S >= min(s_min, 1 + max(n))                # rows with a fixed k get at least their width


def test_expected_tokens_are_the_policy_s():
    policy = DraftPolicy([1.0] * 9, prior=0.7)
    a = policy.acceptance(0)
    assert expected_tokens(a, 8) == [policy.expected_tokens(n) for n in range(9)]


def test_relative_costs_extend_the_learned_curve():
    costs = StepCosts(4)
    for _ in range(MIN_PLAIN):
        costs.add(0, 0.1)
    costs.add(4, 0.14)
    rel = relative_costs(costs, 10)
    assert len(rel) == 10 and rel[0] == 1.0
    assert all(b >= a for a, b in zip(rel, rel[1:]))           # never cheaper for more tokens
    assert rel[3] < rel[9] and rel[9] - rel[8] >= 0.25 - 1e-12  # beyond the curve: at least the prior slope


# ---- bursts: nobody waits, the time until the last row ends --------------------------------------------

COPIES, WRITES = [0.95] * 8, [0.05] * 8    # a row copying its prompt; one writing its own text
SMOLLM2_LIKE = curve(40, 0.12)              # about the learned curve: c(4) ~ 1.35, c(16) ~ 2.8


def test_burst_decodes_plainly_when_the_critical_row_drafts_poorly():
    """Four rows of a free-chat burst: three copy well, the one with the most left does not. Summed tokens
    per cost drafts (the copies pay for themselves); the burst rule decodes plainly, since the burst ends
    when that row does, and wider steps only slow it."""
    expected = [expected_tokens(a, 8) for a in (COPIES, COPIES, COPIES, WRITES)]
    n = [8] * 4
    assert width(expected, n, SMOLLM2_LIKE) > 1
    assert width(expected, n, SMOLLM2_LIKE, remaining=[40, 40, 40, 60]) == 1
    assert width(expected, n, SMOLLM2_LIKE, remaining=[60, 60, 60, 60]) == 1   # tied: the writer ends last


def test_burst_drafts_when_the_critical_row_copies():
    """The same rows, but now the copying row has the most left (an edit's answer): its drafts shorten the
    burst, and the burst rule drafts as wide as the summed rule would for it."""
    expected = [expected_tokens(a, 8) for a in (WRITES, WRITES, WRITES, COPIES)]
    n = [8] * 4
    assert width(expected, n, SMOLLM2_LIKE, remaining=[40, 40, 40, 60]) > 1
    assert width([expected[3]], [8], SMOLLM2_LIKE, remaining=[60]) == width([expected[3]], [8], SMOLLM2_LIKE)
    all_copy = [expected_tokens(COPIES, 8)] * 4
    assert width(all_copy, n, SMOLLM2_LIKE, remaining=[60, 60, 60, 60]) > 1


def test_burst_leaves_plain_steps_only_for_the_critical_row():
    rel, rel_plain = SMOLLM2_LIKE, 0.9 * SMOLLM2_LIKE[3]
    guesses = [[e - COPIES[0] for e in expected_tokens(COPIES, 8)[1:]],
               [e - WRITES[0] for e in expected_tokens(WRITES, 8)[1:]]] * 2
    n = [7] * 4
    assert leave_plain(guesses, n, rel, rel_plain=rel_plain)                           # summed: the copies pay
    assert not leave_plain(guesses, n, rel, rel_plain=rel_plain, remaining=[40, 60, 40, 60])
    assert leave_plain(guesses, n, rel, rel_plain=rel_plain, remaining=[60, 40, 60, 40])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 30), min_size=1, max_size=6), st.floats(0.0, 1.0))
def test_plain_time_is_plain_decoding_to_the_last_row(remaining, slope):
    """P(R) = the sum over plain steps of p(rows still decoding), each step one token of every row."""
    p = curve(len(remaining), slope)
    left, total = list(remaining), 0.0
    while any(left):
        total += p[sum(1 for r in left if r) - 1]
        left = [max(r - 1, 0) for r in left]
    assert abs(plain_time(remaining, p) - total) < 1e-9


@settings(max_examples=200, deadline=None)
@given(rows, st.floats(0.0, 2.0), st.lists(st.floats(0.0, 200.0), min_size=6, max_size=6))
def test_the_burst_width_saves_the_most_time_per_cost(rows_, slope, remaining):
    expected, n = table(rows_)
    B, T = len(n), len(n) * (1 + max(n))
    costs, R = curve(T, slope), remaining[:B]
    saved = lambda S_: (plain_time(R, costs) - plain_time(  # noqa: E731
        [r - e[min(k, S_ - 1)] for r, e, k in zip(R, expected, n)], costs)) / costs[B * S_ - 1]
    S = width(expected, n, costs, remaining=R)
    assert all(saved(S) >= saved(other) - 1e-6 for other in range(1, max(n) + 2))


@settings(max_examples=200, deadline=None)
@given(acceptances, st.integers(1, 12), st.integers(1, 6), st.floats(0.01, 2.0))
def test_alike_rows_burst_as_they_sum(a, k, B, slope):
    """One row, or rows that expect the same tokens and have as many left: every token saves the same
    time, and the burst rule chooses the summed rule's S."""
    e = expected_tokens(a, k)
    n = min(k, len(a))
    costs = curve(B * (1 + n), slope)
    rates = sorted(e[S - 1] / costs[B * S - 1] for S in range(1, n + 2))
    assume(all(y - x > 1e-6 * y for x, y in zip(rates, rates[1:])))   # no ties: both take the narrower, up to rounding
    assert width([e] * B, [n] * B, costs, remaining=[500.0] * B) == width([e] * B, [n] * B, costs)


def test_leaving_plain_steps_pays_for_the_lost_overlap():
    """rel_restart (c(1) - c_p over c(1), what the generator passes) on cases it decides, summed and burst:
    the module doctests' leaving cases stay in plain mode once the pipeline's lost overlap is added to the
    verify's cost. Before, no test passed rel_restart: a rule that dropped it passed."""
    expected, n, rel = [[1.0, 1.9], [1.0, 1.0]], [1, 0], [1.0, 1.1, 1.2, 1.3]
    # summed: 2.9 tokens / c(4) = 2.9 / 1.3 = 2.23 > B / c_p(B) = 2 / 1.1 = 1.82; 2.9 / (1.3 + 0.35) = 1.76 < 1.82
    assert leave_plain(expected, n, rel, rel_plain=1.1)
    assert leave_plain(expected, n, rel, rel_plain=1.1, rel_restart=0.25)          # 2.9 / 1.55 = 1.87
    assert not leave_plain(expected, n, rel, rel_plain=1.1, rel_restart=0.35)
    # burst, R = [40, 20]: p(k) = c(k) c_p(B) / c(B) = [1.0, 1.1], P(R) = 20 * 1.0 + 20 * 1.1 = 42; a plain step
    # saves P(R) - P(R - 1) = 1.1 in c_p(B) = 1.1 (1.0 per cost); S = 2 leaves R - E = [38.1, 19], P = 40: it saves
    # 2.0 in 1.3 + restart, so it leaves while restart < 0.7
    burst = dict(rel_plain=1.1, remaining=[40, 20])
    assert leave_plain(expected, n, rel, **burst)
    assert leave_plain(expected, n, rel, rel_restart=0.6, **burst)
    assert not leave_plain(expected, n, rel, rel_restart=0.8, **burst)
