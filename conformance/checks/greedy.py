"""Speculative greedy equivalence: with greedy decoding, speculative generation emits exactly the
tokens of plain greedy generation, whatever the drafts are (right, wrong, empty, cut by EOS or
``max_tokens``). A difference is tolerated only where it is proven to be a near-tie: the two best
logits at that step differ by less than :data:`NEAR_TIE` (then the report says so)."""
from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from conformance import models
from conformance.registry import check
from conformance.runner import Skip, note
from conformance.strategies import schedules

NEAR_TIE = 1e-3  # largest top-2 logit gap (float32 logits) at which a divergence is a float near-tie
GENERATE = ("load_model", "generate_step")


def generate(impl, model, prompt, max_tokens, drafter=None, draft_max=4, eos=()):
    """``(tokens, from_draft flags or None)`` of one generation."""
    out = list(impl.generate_step(model, list(prompt), max_tokens, drafter=drafter, draft_max=draft_max,
                                  eos=tuple(eos)))
    flags = [f for _, f in out]
    return [int(t) for t, _ in out], (None if any(f is None for f in flags) else [bool(f) for f in flags])


def assert_same_tokens(impl, model, prompt, plain, spec, what) -> None:
    """``spec == plain``, or the first difference is a proven near-tie of ``impl``'s logits after
    ``prompt + plain[:i]`` (noted in the report)."""
    if spec == plain:
        return
    i = next((i for i, (a, b) in enumerate(zip(plain, spec)) if a != b), min(len(plain), len(spec)))
    if i < min(len(plain), len(spec)) and all(getattr(impl, n, None) for n in ("forward", "make_cache")):
        logits = np.asarray(impl.forward(model, prompt + plain[:i], impl.make_cache(model)))[-1]
        top2 = np.sort(logits.astype(np.float64))[-2:]
        gap = float(top2[1] - top2[0])
        if gap < NEAR_TIE:
            note(f"{what}: outputs part at token {i} where the top-2 logit gap is {gap:.2e} < {NEAR_TIE} (near-tie)")
            return
        raise AssertionError(f"{what}: token {i} differs: expected {plain[i]}, got {spec[i]} "
                             f"(top-2 logit gap {gap:.3g}, not a near-tie). Expected {plain}, got {spec}")
    raise AssertionError(f"{what}: expected {plain}, got {spec}")


@check("greedy", needs=GENERATE + ("NgramDrafter",),
       given=dict(model=models.models, prompt=models.prompts(), max_tokens=st.integers(1, 20),
                  draft_max=st.integers(1, 8)), examples=50)
def speculative_equals_plain_greedy(impl, model, prompt, max_tokens, draft_max):
    """With the n-gram drafter, speculative greedy output equals plain greedy output token for token."""
    m = models.load(impl, *model)
    plain, _ = generate(impl, m, prompt, max_tokens)
    spec, _ = generate(impl, m, prompt, max_tokens, drafter=impl.NgramDrafter(), draft_max=draft_max)
    assert_same_tokens(impl, m, prompt, plain, spec, f"tiny {model[0]} (seed {model[1]}), prompt {prompt}, "
                       f"max_tokens {max_tokens}, draft_max {draft_max}")


def expected_flags(truth, offered, eos):
    """The from_draft flags implied by the drafts offered at each position (none offered: no draft):
    a step accepts the drafts that match the greedy tokens, then emits one token of its own."""
    offers = dict(offered)
    flags: list[bool] = []
    while len(flags) < len(truth):
        pos = len(flags)
        d = offers.get(pos, [])
        n = next((i for i, (a, b) in enumerate(zip(d, truth[pos:])) if a != b), min(len(d), len(truth) - pos))
        flags += [True] * n + [False]
    flags = flags[:len(truth)]
    for i, t in enumerate(truth):
        if t in eos:
            return flags[:i + 1]
    return flags


@check("greedy", needs=GENERATE,
       given=dict(model=models.models, prompt=models.prompts(), max_tokens=st.integers(1, 20),
                  schedule=schedules(), eos_at=st.one_of(st.none(), st.integers(0, 19))), examples=50)
def forced_right_wrong_and_empty_drafts(impl, model, prompt, max_tokens, schedule, eos_at):
    """Drafts forced right, wrong or empty (and EOS inside an accepted run) never change greedy output."""
    m = models.load(impl, *model)
    truth, _ = generate(impl, m, prompt, max_tokens)
    eos = (truth[eos_at],) if eos_at is not None and eos_at < len(truth) else ()
    plain = truth[:truth.index(eos[0]) + 1] if eos else truth
    drafter = models.ScriptedDrafter(truth, schedule)
    spec, flags = generate(impl, m, prompt, max_tokens, drafter=drafter, draft_max=8, eos=eos)
    what = (f"tiny {model[0]} (seed {model[1]}), prompt {prompt}, max_tokens {max_tokens}, eos {list(eos)}, "
            f"drafts offered (position, drafts) {drafter.offered}")
    assert_same_tokens(impl, m, prompt, plain, spec, what)
    if flags is not None and spec == plain:
        want = expected_flags(truth, drafter.offered, eos)
        assert flags == want, f"{what}: from_draft flags {flags}, expected {want} (right drafts must be accepted)"


@check("greedy", needs=GENERATE,
       given=dict(seed=st.sampled_from(models.SEEDS), prompt=models.prompts(max_size=12),
                  schedule=schedules()), examples=10, fast=False)
def sliding_window_across_the_wrap(impl, seed, prompt, schedule):
    """On a model with sliding-window layers (window 4 < prompt + output), drafts forced right, wrong
    or empty before, across and after the window wraps never change greedy output."""
    m = models.load(impl, "llama_sliding", seed)
    prompt = models.WINDOW_PREFIX + prompt
    truth, _ = generate(impl, m, prompt, 16)
    drafter = models.ScriptedDrafter(truth, schedule)
    spec, _ = generate(impl, m, prompt, 16, drafter=drafter, draft_max=8)
    assert_same_tokens(impl, m, prompt, truth, spec, f"tiny llama_sliding (seed {seed}), prompt {prompt}, "
                       f"drafts offered (position, drafts) {drafter.offered}")


@check("greedy", needs=GENERATE,
       given=dict(model=models.models, prompt=models.prompts(), max_tokens=st.integers(1, 12)), examples=15)
def greedy_equals_the_reference(impl, model, prompt, max_tokens):
    """Greedy output equals the NumPy reference's for the same weights (float32), up to proven near-ties."""
    import conformance.adapters.reference as reference
    from reference.speculative import greedy_generate

    if impl is reference:
        raise Skip("the backend is the reference itself")
    ref_model = models.load(reference, *model)
    want = greedy_generate(ref_model, prompt, max_tokens)
    m = models.load(impl, *model)
    drafter = impl.NgramDrafter() if getattr(impl, "NgramDrafter", None) is not None else None
    got, _ = generate(impl, m, prompt, max_tokens, drafter=drafter)
    assert_same_tokens(reference, ref_model, prompt, want, got,
                       f"tiny {model[0]} (seed {model[1]}), prompt {prompt}, max_tokens {max_tokens}: "
                       f"reference vs {'speculative' if drafter else 'plain'} greedy of the backend")
