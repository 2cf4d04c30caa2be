"""Speculative sampling keeps the output distribution of plain sampling (chi-square, fixed seeds).

Each test also runs a deliberately wrong scheme through the same statistic to show the test can
fail (it has power at these sample sizes).
"""
from __future__ import annotations

import itertools
import math

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from mlx_lm.sample_utils import make_sampler

from mlx_backend.decode.generate import ngram_speculative_generate_step
from mlx_backend.decode.sampling import Sampler, accept_or_resample, verify_drafts, verify_rows
from mlx_backend.models.tiny import tiny_model

ALPHA = 1e-3   # reject "same distribution" below this p-value


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Goodness-of-fit p-value; cells expected < 5 times are pooled. Wilson-Hilferty approximation
    of the chi-square tail (accurate to ~1e-3 here, which is all a threshold test needs)."""
    n = counts.sum()
    expected = probs * n
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    if np.any(obs[exp == 0]):
        return 0.0
    stat = float(((obs - exp) ** 2 / exp).sum())
    k = len(obs) - 1
    z = ((stat / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_accept_or_resample_is_distributed_as_p():
    mx.random.seed(0)
    p = mx.array([[0.05, 0.4, 0.1, 0.25, 0.2]])
    d, n = 1, 4000
    out = [accept_or_resample(p, d) for _ in range(n)]
    counts = np.bincount([t for t, _ in out], minlength=5)
    assert chi2_pvalue(counts, np.array(p[0])) > ALPHA
    accepted = sum(a for _, a in out) / n
    assert abs(accepted - 0.4) < 4 * math.sqrt(0.4 * 0.6 / n)
    # control: accepting whenever u < 2 p(d) (a biased rule) is detected by the same statistic
    biased = [d if np.random.default_rng(i).random() < 0.8 else t for i, (t, _) in enumerate(out)]
    assert chi2_pvalue(np.bincount(biased, minlength=5), np.array(p[0])) < ALPHA


def test_sampler_probs_top_k_top_p():
    lp = mx.log(mx.array([[0.1, 0.5, 0.15, 0.25]]))
    assert np.allclose(np.array(Sampler(temp=1.0, top_k=2).probs(lp)[0]), [0, 0.5 / 0.75, 0, 0.25 / 0.75])
    assert np.allclose(np.array(Sampler(temp=1.0, top_p=0.7).probs(lp)[0]), [0, 0.5 / 0.75, 0, 0.25 / 0.75])
    assert np.array(Sampler(temp=0.0).probs(lp)[0]).tolist() == [0, 1, 0, 0]
    # mlx-lm cuts top-p on the model's distribution, before the temperature: at temp 2 the flattened
    # distribution would need 3 tokens to reach 0.7, the model's own needs 2 (0.5 + 0.25)
    hot = np.array(Sampler(temp=2.0, top_p=0.7).probs(lp)[0])
    assert np.allclose(hot, np.array([0, 0.5 ** 0.5, 0, 0.25 ** 0.5]) / (0.5 ** 0.5 + 0.25 ** 0.5))


LOGPROBS = mx.log(mx.array([0.3, 0.02, 0.18, 0.12, 0.2, 0.05, 0.08, 0.05]))


def temperature_then_top_p(temp, top_p):
    """The law the old Sampler had (temperature first, then top-p): a wrong law, for the controls."""
    p = np.exp(np.array(LOGPROBS) / temp)
    p /= p.sum()
    order = np.argsort(-p)
    keep = (np.cumsum(p[order]) - p[order]) < top_p
    q = np.zeros_like(p)
    q[order[keep]] = p[order[keep]]
    return q / q.sum()


@pytest.mark.parametrize("kwargs", [dict(temp=0.7), dict(temp=2.0, top_p=0.7), dict(temp=1.5, min_p=0.3),
                                    dict(temp=1.0, top_k=3), dict(temp=3.0, top_p=0.9, min_p=0.2, top_k=4)])
def test_sampler_draws_like_make_sampler_with_the_same_arguments(kwargs):
    """Outside truth: mlx-lm's make_sampler. Its draws, and the Sampler's, fit Sampler.probs."""
    n = 20000
    law = np.array(Sampler(**kwargs).probs(LOGPROBS[None])[0], dtype=np.float64)
    mx.random.seed(3)
    theirs = np.array(make_sampler(**kwargs)(mx.broadcast_to(LOGPROBS, (n, 8))))
    ours = np.array(Sampler(**kwargs)(mx.broadcast_to(LOGPROBS, (n, 8))))
    for draws in (theirs, ours):
        assert chi2_pvalue(np.bincount(draws, minlength=8), law) > ALPHA
    if "top_p" in kwargs and len(kwargs) == 2:   # control: the old order is told apart by the same test
        assert chi2_pvalue(np.bincount(theirs, minlength=8), temperature_then_top_p(**kwargs)) < ALPHA


@pytest.mark.parametrize("kwargs, message", [(dict(temp=-1.0), "temp must be"), (dict(temp=float("nan")), "temp"),
                                             (dict(temp=1.0, top_p=0.0), "top_p must be in"),
                                             (dict(temp=1.0, top_p=2.0), "top_p"), (dict(min_p=1.5), "min_p"),
                                             (dict(top_k=-1), "top_k"), (dict(min_tokens_to_keep=0), "min_tokens"),
                                             # before: taken, then argpartition's kth failed at the first draw
                                             (dict(temp=1.0, top_k=2.5), "top_k must be a whole number"),
                                             (dict(temp=1.0, min_tokens_to_keep=1.5), "min_tokens_to_keep must be a whole")])
def test_sampler_refuses_meaningless_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Sampler(**kwargs)


def exact_pair_law(model, prompt, sampler):
    """P(t1, t2) of plain sampling with ``sampler``'s law, computed from the model's logits (V x V)."""
    V = model(mx.array([prompt]))[0].shape[-1]
    logits = model(mx.array([prompt]))[0, -1:]
    p1 = sampler.probs(logits - mx.logsumexp(logits, axis=-1, keepdims=True))[0]
    batch = mx.array([prompt + [t] for t in range(V)])
    logits = model(batch)[:, -1]
    p2 = sampler.probs(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    return np.array(p1[:, None] * p2, dtype=np.float64).reshape(-1)


class FixedDrafter:
    def __init__(self, drafts):
        self.drafts = drafts

    def reset(self, prompt):
        self.n = 0

    def extend(self, tokens):
        self.n += len(tokens)

    def draft(self, n):
        return self.drafts[self.n:self.n + n]


@pytest.mark.slow
@pytest.mark.parametrize("sampler_kind", ["explicit", "mlx_lm"])
def test_speculative_sampling_matches_plain_law(sampler_kind):
    """First two sampled tokens of a tiny qwen3_5 with 2 drafts verified in one forward."""
    model = tiny_model("qwen3_5", vocab_size=16, seed=4, logit_scale=1.5)
    prompt, n = [3, 1, 4, 1, 5], 700
    args = dict(temp=1.0, top_p=0.95, min_p=0.02)   # make_sampler's law, cuts included
    law = exact_pair_law(model, prompt, Sampler(**args))
    p1 = law.reshape(16, 16).sum(1)
    d1 = int(np.argsort(p1)[-2])                       # the 2nd most likely first token
    d2 = int(np.argmax(law.reshape(16, 16)[d1]))
    sampler = Sampler(**args) if sampler_kind == "explicit" else make_sampler(**args)
    mx.random.seed(7)
    pairs = []
    for _ in range(n):
        out = ngram_speculative_generate_step(mx.array(prompt), model, max_tokens=3, sampler=sampler,
                                              draft_max=2, drafter=FixedDrafter([d1, d2]))
        pairs.append([t for t, _, _ in itertools.islice(out, 2)])
        out.close()
    counts = np.bincount([a * 16 + b for a, b in pairs], minlength=256)
    assert chi2_pvalue(counts, law) > ALPHA
    # control: emitting the drafts whenever the first was sampled-accepted-or-not ("always accept
    # d1") is detected by the same statistic
    wrong = np.bincount([d1 * 16 + b for _, b in pairs], minlength=256)
    assert chi2_pvalue(wrong, law) < ALPHA


def test_verify_drafts_greedy_and_processors_agree():
    """The vectorised greedy path and the per-position path (with an identity processor) agree."""
    mx.random.seed(1)
    logits = mx.random.normal((4, 10))
    drafts = [int(t) for t in mx.argmax(logits, axis=-1).tolist()[:2]] + [0]
    fast = verify_drafts(logits, drafts)
    slow = verify_drafts(logits, drafts, logits_processors=[lambda toks, x: x], history=[1])
    assert fast[0] == slow[0] and fast[2] == slow[2] == 2 + (drafts[2] == fast[0][2])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5), st.sampled_from(["greedy", "opaque", "processor"])),
                min_size=1, max_size=4),
       st.integers(0, 2**31 - 1))
def test_verify_rows_is_verify_drafts_per_row(rows, seed):
    """Each row of a batched verify gives what verify_drafts gives on that row alone: the same emitted
    tokens, accepted count and log-probabilities (rows: draft length, how many drafts copy the argmax,
    how the row draws; padding after a row's real positions is random and must not matter)."""
    mx.random.seed(seed)
    S = 1 + max(k for k, _, _ in rows)
    logits = mx.random.normal((len(rows), S, 12)) * 3
    argmax = mx.argmax(logits, axis=-1).tolist()
    drafts = [[argmax[b][i] if i < right else (argmax[b][i] + 1) % 12 for i in range(k)]
              for b, (k, right, _) in enumerate(rows)]
    opaque = make_sampler(0.0)   # the kind of sampler mlx-lm's server hands over: a deterministic opaque draw
    samplers = [opaque if how == "opaque" else None for _, _, how in rows]
    processors = [[lambda toks, x: x * 1.0] if how == "processor" else None for _, _, how in rows]
    histories = [[b] for b in range(len(rows))]
    batched = verify_rows(logits, drafts, samplers, processors, histories)
    for b, (k, right, _) in enumerate(rows):
        alone = verify_drafts(logits[b, :k + 1], drafts[b], samplers[b], processors[b], histories[b])
        assert batched[b][0] == alone[0] and batched[b][2] == alone[2] == min(right, k)
        assert all(mx.array_equal(x, y).item() for x, y in zip(batched[b][1], alone[1]))
