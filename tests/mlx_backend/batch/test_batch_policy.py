"""The batched verify width (mlx_backend.batch.policy): properties of the rule S* = argmax tokens / c(B S)."""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from mlx_backend.batch.policy import expected_tokens, relative_costs, width
from mlx_backend.decode.draft_policy import DraftPolicy, StepCosts


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
    costs.add(0, 0.1)
    costs.add(4, 0.14)
    rel = relative_costs(costs, 10)
    assert len(rel) == 10 and rel[0] == 1.0
    assert all(b >= a for a, b in zip(rel, rel[1:]))           # never cheaper for more tokens
    assert rel[3] < rel[9] and rel[9] - rel[8] >= 0.25 - 1e-12  # beyond the curve: at least the prior slope
