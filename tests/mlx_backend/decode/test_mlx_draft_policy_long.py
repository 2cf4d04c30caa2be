"""Long drafts (k up to 64): the policy drafts a whole proposal where verifying is free and acceptance
high, nothing where a verified row costs a row, keeps acceptance per match-length bucket (long suffix
matches and short ones learned apart), does not start long on a fresh policy, drafts long once long
matches keep being accepted, and its per-step work stays small at k = 64."""
from __future__ import annotations

import time

from hypothesis import given, settings, strategies as st

from mlx_backend.decode import draft_policy
from mlx_backend.decode.draft_policy import (DEFAULT_K_MAX, MATCH_BUCKETS, MIN_PLAIN, PRIORS, DraftPolicy, StepCosts,
                                             match_bucket)

K = DEFAULT_K_MAX


def test_the_cap_is_64_and_costs_reach_65():
    assert K == 64
    costs = StepCosts(K + 1)
    for _ in range(MIN_PLAIN):
        costs.add(0, 0.1)
    policy = DraftPolicy(step_costs=costs)
    assert policy.k_max == 64 and len(policy.costs) == 65 and len(policy.accept_by[-1]) == 64


@settings(max_examples=80, deadline=None)
@given(accept=st.floats(0.6, 1.0), n_available=st.integers(0, 80), match=st.integers(0, 100),
       c1=st.floats(0.01, 10))
def test_free_verify_and_any_acceptance_drafts_the_whole_proposal(accept, n_available, match, c1):
    """(a >= 0.6: a^64 still moves E(n) in floating point, so the longest is strictly best.)"""
    policy = DraftPolicy([c1] * (K + 1), prior=accept)
    assert policy.choose(n_available, match) == min(n_available, K)


@settings(max_examples=80, deadline=None)
@given(accept=st.lists(st.floats(0.0, 0.999), min_size=K, max_size=K), n_available=st.integers(0, 80),
       match=st.integers(0, 100), c1=st.floats(0.01, 10), extra=st.floats(0, 1))
def test_a_row_that_costs_a_row_never_pays(accept, n_available, match, c1, extra):
    """c(S) >= S c(1): E(n) <= n + 1 < (n + 1) c(n + 1) / c(1) unless every draft is sure."""
    policy = DraftPolicy([c1 * S * (1 + extra) for S in range(1, K + 2)])
    policy.accept_by[match_bucket(match)] = accept
    assert policy.choose(n_available, match) == 0
    assert not policy.leave_plain(n_available, match)


@settings(max_examples=50, deadline=None)
@given(long_match=st.integers(16, 64), short_match=st.integers(1, 3), n=st.integers(20, 40))
def test_the_bucketed_estimate_separates_long_and_short_matches(long_match, short_match, n):
    """Long-match proposals always right, short-match ones always wrong, interleaved: the policy drafts
    long after a long match and nothing after a short one (one shared estimate could not do both)."""
    policy = DraftPolicy([1.0 + 0.15 * s for s in range(K + 1)], plain_cost=1.0)
    pos = 0
    for step in range(n):
        if step % 2:
            policy.observe([pos + 1 + i for i in range(K)], [pos + 1, pos + 2], long_match)
            pos += 2
        else:
            policy.observe([-1, -2], [pos + 1], short_match)   # wrong at once
            pos += 1
    assert policy.acceptance(long_match)[0] > 0.9
    assert policy.acceptance(short_match)[0] < 0.2
    assert policy.choose(K, long_match) >= 8
    assert policy.choose(K, short_match) == 0


def test_buckets():
    assert MATCH_BUCKETS == (0, 1, 2, 4, 8, 16, 32) and len(PRIORS) == len(MATCH_BUCKETS)
    assert [match_bucket(L) for L in (0, 1, 3, 4, 8, 15, 16, 31, 32, 1000, -1)] == [0, 1, 2, 3, 4, 4, 5, 5, 6, 6, 0]


@settings(max_examples=40, deadline=None)
@given(slope=st.floats(0.01, 0.3), match=st.integers(0, 7), long_match=st.integers(0, 64),
       c_p=st.floats(0.001, 1))
def test_a_fresh_policy_does_not_start_long(slope, match, long_match, c_p):
    """Before any observation: after a match of L < 8 (free text), with a verify row costing 1 % of a
    step or more, at most 24 drafts (the priors cap E(n) at 1 / (1 - a) <= 6.7 tokens); after any match,
    with only plain steps timed (a first run), fewer than 16 (untimed sizes are costed at
    PRIOR_SLOPE a token)."""
    policy = DraftPolicy([1.0 + slope * s for s in range(K + 1)], plain_cost=1.0)
    assert policy.choose(K, match) <= 24
    costs = StepCosts(K + 1)
    for _ in range(MIN_PLAIN):
        costs.add(0, c_p)
    assert costs.estimate() is not None and DraftPolicy(step_costs=costs).choose(K, long_match) < 16


def copy_run(policy, steps, match=40, source_len=4000):
    """A model copying a text the drafter matched ``match`` tokens of: every draft right. Each step
    verifies the policy's choice and emits its drafts and the bonus token. Returns the choices."""
    pos, choices = 0, []
    for _ in range(steps):
        proposal = list(range(pos, pos + K))
        k = policy.choose(len(proposal), match)
        choices.append(k)
        policy.observe(proposal, list(range(pos, pos + k + 1)), match)
        pos += k + 1
    return choices


def test_long_matches_that_keep_being_accepted_make_it_draft_long():
    policy = DraftPolicy([1.0 + 0.02 * s for s in range(K + 1)], plain_cost=1.0)
    choices = copy_run(policy, 30)
    assert max(choices[-5:]) == K, choices
    assert choices.index(K) < 25, choices                                     # learned within 25 verifies
    assert policy.choose(K, 1) < K                                            # other buckets unaffected


def test_drafts_that_keep_failing_midway_cut_the_draft_length():
    """After a long copy, the text copied from changes every 5 tokens (drafts right for 4 tokens, then
    wrong): within 40 verifies the policy drafts at most 10. (Slower than learning: the long copy's
    hundreds of observations fade by 1 - alpha a proposal.)"""
    policy = DraftPolicy([1.0 + 0.05 * s for s in range(K + 1)], plain_cost=1.0)
    copy_run(policy, 30)
    assert policy.choose(K, 40) == K
    pos = 10_000
    for _ in range(40):
        policy.observe(list(range(pos, pos + 4)) + [-1] * (K - 4), list(range(pos, pos + 5)), 40)
        pos += 5
    assert policy.choose(K, 40) <= 10, policy.acceptance(40)[:8]


def test_observe_is_cheap_at_k_64():
    """Plain-mode worst case: a 64-token proposal every token, all right (64 proposals open)."""
    policy = DraftPolicy([1.0] * (K + 1), plain_cost=1.0)
    n = 2000
    t0 = time.perf_counter()
    for t in range(n):
        policy.observe(list(range(t + 1, t + 1 + K)), [t + 1], 40)
        policy.leave_plain(K, 40)
    per_token = (time.perf_counter() - t0) / n
    assert len(policy._pending) <= K
    assert per_token < 2e-3, per_token   # measured ~0.05 ms on a loaded 2-core EPYC; a 135M model's step: > 5 ms


def test_unverified_proposals_teach_their_own_bucket():
    policy = DraftPolicy([1.0, 1.9, 2.8], prior=0.2)
    for t in range(20):
        policy.observe([t + 1, t + 2], [t + 1], 20)
    assert policy.acceptance(20)[0] > 0.9 and policy.accept[0] == 0.2
    assert draft_policy.BUCKET_LABELS[match_bucket(20)] in policy.summary()["accept_by_match"]


def test_the_last_token_of_a_plain_run_is_not_timed():
    """c_p is timed token to token in plain mode, but neither for a plain run's first token (it pays for
    the steps before) nor for its last (launched a whole step before it is waited for with no next step
    built meanwhile: timed at 0.1-0.2 of a step on SmolLM2, which inflated every c(S) / c_p)."""
    import mlx.core as mx

    from mlx_backend.decode.generate import SpecStats, ngram_speculative_generate_step
    from mlx_backend.models.tiny import tiny_model

    class Silent:   # proposes nothing: one plain run over the whole output
        match_length = 0

        def reset(self, prompt):
            pass

        def extend(self, tokens):
            pass

        def draft(self, k):
            return []

    costs = StepCosts(K + 1)
    stats = SpecStats()
    out = list(ngram_speculative_generate_step(mx.array([1, 2, 3]), tiny_model("llama", seed=3), max_tokens=12,
                                               drafter=Silent(), stats=stats,
                                               draft_policy=DraftPolicy(step_costs=costs)))
    assert len(out) == 12 and stats.plain_steps == 12 and stats.enter_plain == 1
    assert len(costs.samples[0]) == 12 - 2
