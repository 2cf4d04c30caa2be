"""State rollback: after a verify forward over S tokens, ``keep(m)`` leaves the model state exactly
as if only the first m tokens had been fed, for every layer kind (attention KV rows, GatedDeltaNet
conv window and recurrent matrix), also after 1-token steps (no draft) between drafted ones. The
state is observed through the logits of the next forward, so any backend's state layout works."""
from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from conformance import models
from conformance.registry import check

ROLLBACK = ("load_model", "make_cache", "forward", "keep")
TOLERANCE = 1e-4  # float32 logits of tiny models are O(1); a state off by one token moves them by > 1e-2
# float32 sums in another order: the mlx backend's logits are within 9e-5 of the reference's (measured on every
# tiny model, prompts of 1-29 tokens, 2026-12-08); a state that lost its earlier tokens is off by 1-6
REFERENCE_TOLERANCE = 1e-3


@st.composite
def verify_steps(draw):
    """``(tokens, m)`` pairs: a verify forward over S = len(tokens) tokens keeping the first m, 0 <= m <= S
    (S = 1: a step with no draft, which keeps its token; m = 0: the whole forward is dropped)."""
    steps = []
    for _ in range(draw(st.integers(1, 6))):
        S = draw(st.sampled_from([1, 1, 2, 3, 4, 6]))
        tokens = draw(st.lists(st.integers(0, models.VOCAB - 1), min_size=S, max_size=S))
        steps.append((tokens, draw(st.integers(0 if S > 1 else 1, S))))
    return steps


def run_steps(impl, model, prompt, steps):
    """Feed ``prompt`` then each verify step, keeping m of S; return the cache and the kept tokens."""
    cache = impl.make_cache(model)
    impl.forward(model, prompt, cache)
    impl.keep(cache, len(prompt))
    kept = list(prompt)
    _check_reported_counts(cache, kept, [])
    for i, (tokens, m) in enumerate(steps):
        impl.forward(model, tokens, cache)
        impl.keep(cache, m)
        kept += tokens[:m]
        _check_reported_counts(cache, kept, steps[:i + 1])
    return cache, kept


def _check_reported_counts(cache, kept, steps) -> None:
    """A cache that reports ``offset`` (optional: the number of tokens its state summarises) counts the
    kept tokens; one that reports ``n_replays`` (optional: how many times ``keep`` re-ran tokens through
    the model) re-ran none: every layer of the protocol's models (attention rows, sliding windows, a
    GatedDeltaNet's conv window and recurrent matrix) can be cut back to any m from what the verify
    forward computed, so a rollback that recomputes has failed to recognise a layer."""
    offset = getattr(cache, "offset", None)
    assert offset is None or offset == len(kept), (
        f"after the prompt and the verify steps (tokens, m) {steps} the cache reports offset = {offset}, but "
        f"it holds the state of {len(kept)} tokens")
    replays = getattr(cache, "n_replays", None)
    assert not replays, (
        f"after the prompt and the verify steps (tokens, m) {steps} the cache reports n_replays = {replays}: "
        f"keep(m) re-ran tokens through the model instead of cutting the state the verify forward recorded")


def state_error(impl, model, prompt, steps) -> tuple[float, list[int]]:
    """Largest next-token logit difference between the rolled-back state and the kept tokens fed one
    at a time (no rollback involved), and the kept tokens."""
    cache, kept = run_steps(impl, model, prompt, steps)
    fed = impl.make_cache(model)
    for t in kept:
        impl.forward(model, [t], fed)
        impl.keep(fed, 1)
    probe = [kept[-1] ^ 1]
    got = np.asarray(impl.forward(model, probe, cache), dtype=np.float64)[-1]
    want = np.asarray(impl.forward(model, probe, fed), dtype=np.float64)[-1]
    return float(np.max(np.abs(got - want))), kept


def assert_state_equals_fed(impl, model, prompt, steps, what):
    err, _ = state_error(impl, model, prompt, steps)
    if err <= TOLERANCE:
        return
    k = next(k for k in range(1, len(steps) + 1) if state_error(impl, model, prompt, steps[:k])[0] > TOLERANCE)
    err, kept = state_error(impl, model, prompt, steps[:k])
    raise AssertionError(
        f"{what}: after the verify steps (tokens, m) {steps[:k]} (the first {k} of {len(steps)}) the state "
        f"differs from feeding the kept tokens {kept} one at a time: next-token logits differ by up to "
        f"{err:.3g} (tolerance {TOLERANCE})")


@check("rollback", needs=ROLLBACK,
       given=dict(model=models.models, prompt=models.prompts(max_size=8), steps=verify_steps()), examples=50)
def keep_m_equals_feeding_m_tokens(impl, model, prompt, steps):
    """keep(m) after a forward over S tokens gives the state of feeding those m tokens one at a time."""
    m = models.load(impl, *model)
    assert_state_equals_fed(impl, m, prompt, steps, f"tiny {model[0]} (seed {model[1]}), prompt {prompt}")


@check("rollback", needs=ROLLBACK,
       given=dict(model=models.models, prompt=models.prompts(max_size=8), steps=verify_steps(),
                  probe=st.lists(st.integers(0, models.VOCAB - 1), min_size=1, max_size=3)), examples=25)
def forward_equals_the_reference(impl, model, prompt, steps, probe):
    """After the prompt and verify steps (each keeping m of S), a forward over ``probe`` gives, row for row,
    the NumPy reference's logits for the kept tokens and the probe fed whole from an empty state. The other
    rollback checks compare the backend with itself; this one anchors its state and logits to the reference."""
    m = models.load(impl, *model)
    cache, kept = run_steps(impl, m, prompt, steps)
    got = np.asarray(impl.forward(m, probe, cache), dtype=np.float64)
    want = models.reference_logits(m, kept + probe)[len(kept):]
    assert got.shape == want.shape, (f"tiny {model[0]} (seed {model[1]}): forward over {len(probe)} tokens returned "
                                     f"logits of shape {got.shape}, expected {want.shape}")
    err = float(np.max(np.abs(got - want)))
    assert err <= REFERENCE_TOLERANCE, (
        f"tiny {model[0]} (seed {model[1]}), prompt {prompt}, verify steps (tokens, m) {steps}, then a forward "
        f"over {probe}: its logits differ from the reference's for the kept tokens {kept} + {probe} fed whole by "
        f"up to {err:.3g} (tolerance {REFERENCE_TOLERANCE})")


@check("rollback", needs=ROLLBACK)
def zero_draft_steps_between_drafted_steps(impl):
    """Steps with no draft (S = 1) between drafted steps, and keep(0) and keep(S), leave no stale state, in every architecture."""
    # (S, m), with the ends of the range: m = S (everything kept) and m = 0 (everything dropped)
    shape = [(1, 1), (4, 2), (1, 1), (1, 1), (3, 1), (1, 1), (5, 5), (2, 1), (1, 1), (3, 0), (1, 1), (2, 0), (2, 2)]
    steps = [([10 + 7 * i + j for j in range(S)], m) for i, (S, m) in enumerate(shape)]
    for arch in models.supported(impl):
        m = models.load(impl, arch, 0)
        assert_state_equals_fed(impl, m, [5, 6, 7], steps, f"tiny {arch} (seed 0), prompt [5, 6, 7]")


@check("rollback", needs=ROLLBACK,
       given=dict(seed=st.sampled_from(models.SEEDS), prompt=models.prompts(max_size=8), steps=verify_steps()),
       examples=10, fast=False)
def sliding_window_across_the_wrap(impl, seed, prompt, steps):
    """On a model with sliding-window layers (window 4, shorter than the prompt and than some verify
    forwards), keep(m) gives the state of feeding the m tokens one at a time: each kept token sees
    exactly the last 4 tokens in those layers, before, across and after the window wraps."""
    m = models.load(impl, "llama_sliding", seed)
    prompt = models.WINDOW_PREFIX + prompt
    assert_state_equals_fed(impl, m, prompt, steps, f"tiny llama_sliding (seed {seed}), prompt {prompt}")
