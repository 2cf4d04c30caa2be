"""Sampling distribution: with temperature > 0, drafts must not change what is sampled. A drafted
token d is accepted with probability p(d), otherwise a token is drawn from p without d,
renormalised; so each emitted token is distributed exactly as plain sampling's p. Checked with
chi-square tests against p computed from the backend's own logits, over fixed seeds."""
from __future__ import annotations

import math
from collections import Counter

import numpy as np

from conformance import models
from conformance.registry import check

SAMPLING = ("load_model", "sample_step", "make_cache", "forward")
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


def probs(impl, model, tokens, temperature) -> np.ndarray:
    logits = np.asarray(impl.forward(model, list(tokens), impl.make_cache(model)), dtype=np.float64)[-1]
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


def pick_temperature(impl, model, prompt) -> float:
    """A temperature at which the most likely token has probability 0.2..0.8 (so both outcomes occur)."""
    for t in (2.0, 1.0, 0.5, 0.25, 0.1, 0.05):
        if 0.2 <= probs(impl, model, prompt, t).max() <= 0.8:
            return t
    return 1.0


@check("sampling", needs=SAMPLING)
def drafts_do_not_change_the_distribution(impl):
    """At temperature > 0, every emitted token follows p: the first (plain, never drafted for), the one
    with drafts offered, the one after an accepted draft, and the bonus token after all drafts were accepted.

    After the first token, drafts [d2, d3] are offered: when the first token is greedy's d1, the second
    must follow p2 = p(. | prompt, d1), after an accepted d2 the third p3, and after an accepted d3 too the
    fourth (the bonus token) p4; with the single draft [d2], the third token is the bonus token, of law p3
    (reached often enough to test). The temperature puts p2's top token at 0.2..0.8, so acceptance and
    rejection both occur."""
    arch, prompt = "qwen3_5", [72, 101, 108, 108, 111]
    model = models.load(impl, arch, 0)
    d1 = int(np.argmax(probs(impl, model, prompt, 1.0)))   # the argmax does not depend on the temperature
    T = pick_temperature(impl, model, prompt + [d1])
    p1, p2 = probs(impl, model, prompt, T), probs(impl, model, prompt + [d1], T)
    d2 = int(np.argmax(p2))
    p3 = probs(impl, model, prompt + [d1, d2], T)
    d3, second2 = int(np.argmax(p3)), int(np.argsort(p2)[-2])
    p4 = probs(impl, model, prompt + [d1, d2, d3], T)   # the bonus token's law once d2 and d3 are accepted
    d4 = int(np.argmax(p4))
    variants = (("plain sampling", lambda: None, 2), ("drafts [d2, d3]", lambda: FixedDrafter([d2, d3]), 2),
                ("draft [d2], then the bonus token", lambda: FixedDrafter([d2]), 1))  # 3rd token: bonus, law p3
    for label, drafter_of, draft_max in variants:
        firsts, seconds, thirds, fourths = Counter(), Counter(), Counter(), Counter()
        for seed in range(N_SAMPLES):
            out = [int(t) for t in impl.sample_step(model, prompt, 4, temperature=T, seed=seed,
                                                    drafter=drafter_of(), draft_max=draft_max)]
            firsts[out[0]] += 1
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
