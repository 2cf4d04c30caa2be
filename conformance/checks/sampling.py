"""Sampling distribution: with temperature > 0, drafts must not change what is sampled. A drafted
token d is accepted with probability p(d), otherwise a token is drawn from p without d,
renormalised; so each emitted token is distributed exactly as plain sampling's p. Checked with
chi-square tests against p computed from the NumPy reference's logits on the same weights, over fixed seeds."""
from __future__ import annotations

import math
from collections import Counter

import numpy as np

from conformance import models
from conformance.registry import check

SAMPLING = ("load_model", "sample_step")
N_SAMPLES = 300
P_FAIL = 1e-4  # a correct backend fails a test with this probability (the seeds are fixed, so it is reproducible)


class FixedDrafter:
    """Offers the same drafts at its first call, nothing afterwards. The first call comes after the first
    token: no drafts are asked for the prompt's own step (llama.cpp's lookup, reference/speculative.py)."""

    def __init__(self, drafts):
        self.drafts, self.calls = list(drafts), 0

    def reset(self, prompt):
        self.calls = 0

    def extend(self, tokens):
        pass

    def draft(self, n_draft):
        self.calls += 1
        return self.drafts[:n_draft] if self.calls == 1 else []


def probs(model, tokens, temperature) -> np.ndarray:
    """The law sampling must follow after ``tokens``: softmax(logits / T) of the NumPy reference's logits on
    ``model``'s weights (the backend's own logits could carry its own mistake into the expected law)."""
    logits = models.reference_logits(model, tokens)[-1]
    z = np.exp((logits - logits.max()) / temperature)
    return z / z.sum()


def chi_square_p_value(observed: Counter, p: np.ndarray, bins: list[list[int]]) -> tuple[float, list]:
    """p-value of the observed counts in ``bins`` (lists of tokens; the rest is one more bin)."""
    n = sum(observed.values())
    in_bins = {t for b in bins for t in b}
    obs = [sum(observed[t] for t in b) for b in bins] + [sum(c for t, c in observed.items() if t not in in_bins)]
    exp = [n * sum(p[t] for t in b) for b in bins] + [n * (1 - sum(p[t] for t in in_bins))]
    x = sum((o - e) ** 2 / e for o, e in zip(obs, exp) if e > 0)
    df = len(obs) - 1  # 1 or 2 here: closed forms of the chi-square survival function
    p_value = math.erfc(math.sqrt(x / 2)) if df == 1 else math.exp(-x / 2)
    return p_value, list(zip(obs, [round(e, 1) for e in exp]))


def pooled_p_value(groups: dict, law) -> tuple[float, list]:
    """p-value of the tokens observed after each prefix (``groups``: prefix -> Counter), each group against
    its own law ``law(prefix)`` in the bins [its top token], [its second token], [the rest]: the sum of the
    groups' chi-square statistics with 2 degrees of freedom each (groups with fewer than 30 tokens left out)."""
    x, df, tables = 0.0, 0, []
    for prefix, observed in sorted(groups.items()):
        n = sum(observed.values())
        if n < 30:
            continue
        p = law(prefix)
        top = [int(t) for t in np.argsort(p)[-2:][::-1]]
        obs = [observed[top[0]], observed[top[1]], n - observed[top[0]] - observed[top[1]]]
        exp = [n * p[top[0]], n * p[top[1]], n * (1 - p[top[0]] - p[top[1]])]
        x += sum((o - e) ** 2 / e for o, e in zip(obs, exp) if e > 0)
        df += 2
        tables.append((list(prefix), list(zip(obs, [round(e, 1) for e in exp]))))
    half = x / 2  # chi-square survival function for an even df: exp(-x/2) sum_{i < df/2} (x/2)^i / i!
    return math.exp(-half) * sum(half ** i / math.factorial(i) for i in range(df // 2)) if df else 1.0, tables


TEMPERATURES = (2.0, 1.0, 0.5, 0.25, 0.1, 0.05)


def pick_prompt_and_temperature(model) -> tuple[list[int], float]:
    """A prompt and a temperature at which the first token is nearly always greedy's d1 (p >= 0.8), so that
    almost every sample reaches the drafted positions, and the second token's top has probability 0.3..0.7
    (so a draft of it is accepted and rejected about equally): the first of seeded random prompts that
    qualifies (the tiny models are the same for every backend)."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        prompt = rng.integers(0, 256, 5).tolist()
        for t in TEMPERATURES:
            p1 = probs(model, prompt, t)
            if p1.max() >= 0.8 and 0.3 <= probs(model, prompt + [int(np.argmax(p1))], t).max() <= 0.7:
                return prompt, t
    raise AssertionError("no prompt of the tiny model qualifies for the sampling test (p1 >= 0.8, p2 in 0.3..0.7)")


@check("sampling", needs=SAMPLING)
def drafts_do_not_change_the_distribution(impl):
    """At temperature > 0, every emitted token follows p: the first (plain, never drafted for), the one
    with drafts offered, the one after an accepted draft, and the bonus token after all drafts were accepted.

    After the first token, drafts [d2, d3] are offered: the second token must follow p(. | prompt, first)
    (tested for every first token, pooled); when the first token is greedy's d1 (the prompt is chosen so
    that it nearly always is) the second must follow p2 = p(. | prompt, d1), after an accepted d2 the third p3, and after an accepted d3 too the
    fourth (the bonus token) p4; with the single draft [d2], the third token is the bonus token, of law p3
    (reached often enough to test). The temperature puts p2's top token at 0.2..0.8, so acceptance and
    rejection both occur."""
    arch = models.supported(impl)[0]   # qwen3_5 for a backend that supports every architecture
    model = models.load(impl, arch, 0)
    prompt, T = pick_prompt_and_temperature(model)
    d1 = int(np.argmax(probs(model, prompt, T)))
    p1, p2 = probs(model, prompt, T), probs(model, prompt + [d1], T)
    d2 = int(np.argmax(p2))
    p3 = probs(model, prompt + [d1, d2], T)
    d3, second2 = int(np.argmax(p3)), int(np.argsort(p2)[-2])
    p4 = probs(model, prompt + [d1, d2, d3], T)   # the bonus token's law once d2 and d3 are accepted
    d4 = int(np.argmax(p4))
    variants = (("plain sampling", lambda: None, 2), ("drafts [d2, d3]", lambda: FixedDrafter([d2, d3]), 2),
                ("draft [d2], then the bonus token", lambda: FixedDrafter([d2]), 1))  # 3rd token: bonus, law p3
    for label, drafter_of, draft_max in variants:
        firsts, seconds, thirds, fourths = Counter(), Counter(), Counter(), Counter()
        after_first: dict = {}   # the second token after each first token (its law: p(. | prompt, first))
        for seed in range(N_SAMPLES):
            out = [int(t) for t in impl.sample_step(model, prompt, 4, temperature=T, seed=seed,
                                                    drafter=drafter_of(), draft_max=draft_max)]
            firsts[out[0]] += 1
            if len(out) > 1:
                after_first.setdefault((out[0],), Counter())[out[1]] += 1
            if out[0] == d1 and len(out) > 1:
                seconds[out[1]] += 1
                if out[1] == d2 and len(out) > 2:
                    thirds[out[2]] += 1
                    if out[2] == d3 and len(out) > 3:
                        fourths[out[3]] += 1
        pv, table = chi_square_p_value(firsts, p1, [[d1]])
        assert pv >= P_FAIL, (
            f"{label} on tiny {arch}, prompt {prompt}, temperature {T}: the first token's counts "
            f"(observed, expected) for [d1={d1}, others] are {table} over {N_SAMPLES} seeds 0..{N_SAMPLES - 1}; "
            f"chi-square p = {pv:.2g} < {P_FAIL}")
        assert sum(seconds.values()) >= 30, f"too few first tokens d1={d1} ({sum(seconds.values())}) to test"
        pv, table = chi_square_p_value(seconds, p2, [[d2], [second2]])
        assert pv >= P_FAIL, (
            f"{label} on tiny {arch}, prompt {prompt}, temperature {T}: after d1={d1}, the second token's "
            f"counts (observed, expected) for [d2={d2}, second={second2}, others] are {table}; "
            f"chi-square p = {pv:.2g} < {P_FAIL}")
        pv, tables = pooled_p_value(after_first, lambda prefix: probs(model, prompt + list(prefix), T))
        assert pv >= P_FAIL, (
            f"{label} on tiny {arch}, prompt {prompt}, temperature {T}: the second token after each first token "
            f"(first token, (observed, expected) for [its law's top, second, others]) is {tables}; pooled "
            f"chi-square p = {pv:.2g} < {P_FAIL}")
        if sum(thirds.values()) >= 30:
            pv, table = chi_square_p_value(thirds, p3, [[d3]])
            assert pv >= P_FAIL, (
                f"{label} on tiny {arch}, prompt {prompt}, temperature {T}: after d1={d1}, d2={d2}, the third "
                f"token's counts (observed, expected) for [d3={d3}, others] are {table}; chi-square p = {pv:.2g}")
        if sum(fourths.values()) >= 30:
            pv, table = chi_square_p_value(fourths, p4, [[d4]])
            assert pv >= P_FAIL, (
                f"{label} on tiny {arch}, prompt {prompt}, temperature {T}: after d1={d1}, d2={d2}, d3={d3} (both "
                f"drafts accepted), the bonus token's counts (observed, expected) for [d4={d4}, others] are "
                f"{table}; chi-square p = {pv:.2g}")
