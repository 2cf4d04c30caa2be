"""The width of a batched verify forward: one S for every row, chosen for the batch's token rate.

A batched verify forward runs B rows of S tokens (a row's last token, then up to S - 1 drafts, right-padded
to S): it costs what a forward over ``B * S`` token rows costs, padding included, whatever each row drafts.
So S is the one choice: given S, every row drafts ``min(n_b, S - 1)`` of its proposal (a draft in the
padding's place costs nothing more). With ``E_b(n)`` the tokens row b emits on average from n drafts (its
own acceptance, learned per match-length bucket exactly as the single-sequence policy learns it:
:meth:`mlx_backend.decode.draft_policy.DraftPolicy.expected_tokens`) and ``c(T)`` the cost of a forward
over T token rows, the policy takes

    S* = argmax_S  sum_b E_b(min(n_b, S - 1)) / c(B S),      S = S_min .. 1 + max_b n_b,

(S = 1: every row one plain token; ties to the narrower) within the per-step token budget
``B S <= max_batch_tokens``. ``S_min`` is 1, or ``1 + k`` for rows that asked for a fixed draft length k
(``draft_max=k``: they verify every proposal up to k, as alone). A wide batch makes long drafts dearer by
itself, through ``c(B S)``: on free text (E_b(n) ~ 1) it decodes plainly, on edits it drafts as far as
the rows' copies are worth it.

``c(T)`` relative to ``c(1)`` is the verify-cost curve that single-sequence generation learns on this model
and machine (:func:`mlx_backend.decode.draft_policy.learned_costs`, S = 1..65): B rows of S tokens read
the weights once for B S token rows, as one sequence of B S tokens does (attention over each row's own
keys is the difference, small at short contexts). Beyond the curve's end it grows with the slope of its
upper half (at least :data:`~mlx_backend.decode.draft_policy.PRIOR_SLOPE` a token); before any step was
timed it is the prior ``1 + PRIOR_SLOPE (T - 1)``.

>>> width([[1.0, 1.9, 2.7], [1.0, 1.1, 1.15]], [2, 2], [1.0, 1.1, 1.2, 1.3, 1.4, 1.5])   # one row copies well
3
>>> width([[1.0, 1.1, 1.15], [1.0, 1.1, 1.15]], [2, 2], [1.0, 1.1, 1.2, 1.3, 1.4, 1.5])  # neither does
1

Bursts. Summed tokens per cost is right while requests wait for a row: a row that ends early makes room
for the next one. When nobody waits (a burst: the rows are all there is), the time that matters is the
time until the LAST row ends, and a token of a row that will end early anyway saves almost nothing: only
the marginal cost of one row in the plain steps that the others still need. With ``R_b`` the tokens row b
has left (``max_tokens`` minus those emitted) and ``p(k)`` the cost of a plain step of k rows, finishing
plainly takes (rows sorted by R, longest first, ``R_(B+1) = 0``; :func:`plain_time`)

    P(R) = sum_i (R_(i) - R_(i+1)) p(i),

and a step that leaves the rows ``R - E(S)`` saves the burst ``P(R) - P(R - E(S))`` of that time. The
burst width is the S that saves the most time per cost (ties to the narrower, as above):

    S*_burst = argmax_S  (P(R) - P(R - E(S))) / c(B S),      E(S)_b = E_b(min(n_b, S - 1)).

Taking a token off the row with the most left saves a whole step ``p(1)``; off any other row (or off
one of several rows tied for the most, as a burst's rows start) only ``p(k) - p(k - 1)``, the slope of
the cost curve. A plain step saves exactly its cost, ``p(B)``: so a burst drafts only where the rows that
set its end copy, whatever the others do. On free text, where drafts pay for some rows now and then, it
decodes plainly; on edits the copies still pay, as every row that copies soon has the most left (its
``max_tokens`` is far away). The summed rule is the case where every token saves the same: with one row,
or rows that expect the same ``E`` and have as many left, the two rules choose the same S.

>>> costs = [1.0, 1.1, 1.2, 1.3, 1.4, 1.5]
>>> width([[1.0, 1.9, 2.7], [1.0, 1.1, 1.15]], [2, 2], costs, remaining=[50, 50])   # the other row sets the end
1
>>> width([[1.0, 1.1, 1.15], [1.0, 1.9, 2.7]], [2, 2], costs, remaining=[30, 50])   # the last row copies
3
"""
from __future__ import annotations

from typing import Optional, Sequence

from mlx_backend.decode.draft_policy import PRIOR_SLOPE, StepCosts


def expected_tokens(acceptance: Sequence[float], n: int) -> list[float]:
    """``[E(0), ..., E(n)]`` with ``E(j) = 1 + sum_{i<=j} prod_{l<=i} a_l`` (a row's acceptance ``a_1, a_2, ...``;
    n at most ``len(acceptance)``), the single-sequence policy's E (:mod:`mlx_backend.decode.draft_policy`).

    >>> expected_tokens([0.5, 0.5], 2)
    [1.0, 1.5, 1.75]
    """
    out, run = [1.0], 1.0
    for a in acceptance[:n]:
        run *= a
        out.append(out[-1] + run)
    return out


def plain_time(remaining: Sequence[float], rel_plain: Sequence[float]) -> float:
    """P(R) of the module docstring: the cost of decoding rows with ``remaining`` tokens left plainly to
    the last one, ``rel_plain[k - 1]`` = p(k) the cost of a plain step of k rows (negative R: 0).

    >>> plain_time([3, 1], [1.0, 1.5])   # one step of both rows, then two of the longer alone
    3.5
    """
    r = sorted((max(float(x), 0.0) for x in remaining), reverse=True) + [0.0]
    return sum((r[i] - r[i + 1]) * rel_plain[i] for i in range(len(r) - 1))


def _s_range(B: int, n_available: Sequence[int], max_batch_tokens: Optional[int]) -> int:
    s_max = 1 + max(n_available, default=0)
    if max_batch_tokens is not None:
        s_max = min(s_max, max(1, max_batch_tokens // max(B, 1)))
    return s_max


def _burst_left(expected, n_available, remaining, S: int) -> list[float]:
    """R - E(S): each row's tokens left after a step of width S (expected)."""
    return [R - e[min(n, S - 1)] for e, n, R in zip(expected, n_available, remaining)]


def width(expected: Sequence[Sequence[float]], n_available: Sequence[int], rel_cost: Sequence[float], *,
          s_min: int = 1, max_batch_tokens: Optional[int] = None,
          remaining: Optional[Sequence[float]] = None) -> int:
    """S* of the module docstring: ``expected[b][n]`` = E_b(n) for n = 0..n_available[b], ``rel_cost[T - 1]``
    = c(T) / c(1) for T = 1..B * (1 + max n) at least. With ``remaining`` (R_b, a burst: nobody waits for
    a row) S*_burst instead, plain steps costing ``p(k) = c(k)``."""
    B = len(expected)
    s_max = _s_range(B, n_available, max_batch_tokens)
    s_min = min(max(s_min, 1), s_max)
    before = plain_time(remaining, rel_cost) if remaining is not None else 0.0
    best, best_rate = s_min, -1.0
    for S in range(s_min, s_max + 1):
        if remaining is not None:   # the time this step saves the burst
            gain = before - plain_time(_burst_left(expected, n_available, remaining, S), rel_cost)
        else:
            gain = sum(e[min(n, S - 1)] for e, n in zip(expected, n_available))
        rate = gain / rel_cost[B * S - 1]
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = S, rate
    return best


def leave_plain(expected: Sequence[Sequence[float]], n_available: Sequence[int], rel_cost: Sequence[float], *,
                rel_plain: float, rel_restart: float = 0.0, max_batch_tokens: Optional[int] = None,
                remaining: Optional[Sequence[float]] = None) -> bool:
    """Whether to stop pipelined plain steps for a verify step: while every row's next token is in flight,
    each row's proposal guesses it with its first token, so ``expected[b][n]`` is what a verify of the n
    drafts after the guess yields, ``E_b(n + 1) - a_1`` (the single-sequence rule of
    :meth:`mlx_backend.decode.draft_policy.DraftPolicy.leave_plain`). Leave when some ``S >= 2`` beats the
    plain rate: ``sum_b expected[b][min(n_b, S - 1)] / (c(B S) + restart) > B / c_p(B)``, with ``rel_plain``
    = c_p(B) / c(1), a pipelined plain batch step, and ``rel_restart`` the pipeline's lost overlap
    (``c(1) - c_p``, relative to c(1)).

    >>> leave_plain([[1.0, 1.9], [1.0, 1.0]], [1, 0], [1.0, 1.1, 1.2, 1.3], rel_plain=1.1)    # one copies
    True
    >>> leave_plain([[1.0, 1.1], [1.0, 1.0]], [1, 0], [1.0, 1.1, 1.2, 1.3], rel_plain=1.1)
    False

    With ``remaining`` (R_b after the token in flight; a burst), the burst rule: leave when some
    ``S >= 2`` saves more time per cost, ``(P(R) - P(R - E(S))) / (c(B S) + restart) > (P(R) - P(R - 1)) /
    c_p(B)``, plain steps of k rows costing ``p(k) = c(k) c_p(B) / c(B)`` (the pipelined discount of B
    rows, for every k).

    >>> leave_plain([[1.0, 1.9], [1.0, 1.0]], [1, 0], [1.0, 1.1, 1.2, 1.3], rel_plain=1.1, remaining=[40, 40])
    False
    >>> leave_plain([[1.0, 1.9], [1.0, 1.0]], [1, 0], [1.0, 1.1, 1.2, 1.3], rel_plain=1.1, remaining=[40, 20])
    True
    """
    B = len(expected)
    s_max = _s_range(B, n_available, max_batch_tokens)
    if remaining is not None:
        p = [c * rel_plain / rel_cost[B - 1] for c in rel_cost[:B]]
        before = plain_time(remaining, p)
        plain = (before - plain_time([R - 1 for R in remaining], p)) / rel_plain
        return any((before - plain_time(_burst_left(expected, n_available, remaining, S), p))
                   / (rel_cost[B * S - 1] + rel_restart) > plain for S in range(2, s_max + 1))
    plain_rate = B / rel_plain
    for S in range(2, s_max + 1):
        tokens = sum(e[min(n, S - 1)] for e, n in zip(expected, n_available))
        if tokens / (rel_cost[B * S - 1] + rel_restart) > plain_rate:
            return True
    return False


def relative_costs(step_costs: Optional[StepCosts], t_max: int) -> list[float]:
    """``c(T) / c(1)`` for T = 1..t_max from the single-sequence curve ``step_costs`` (None, or nothing timed
    yet: the prior), extended beyond its end with the slope of its upper half, at least PRIOR_SLOPE.

    >>> relative_costs(None, 3)
    [1.0, 1.25, 1.5]
    """
    estimate = step_costs.estimate() if step_costs is not None else None
    if estimate is None:
        return [1.0 + PRIOR_SLOPE * (T - 1) for T in range(1, t_max + 1)]
    costs = estimate[0]
    rel = [c / costs[0] for c in costs]
    half = len(rel) // 2
    slope = max((rel[-1] - rel[half]) / max(len(rel) - 1 - half, 1), PRIOR_SLOPE)
    rel += [rel[-1] + slope * (T - len(costs)) for T in range(len(costs) + 1, t_max + 1)]
    return rel[:t_max]
