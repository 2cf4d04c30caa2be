"""Speculative greedy equivalence: with greedy decoding, speculative generation emits exactly the
tokens of plain greedy generation, whatever the drafts are (right, wrong, empty, cut by EOS or
``max_tokens``). A difference is tolerated only where it is proven to be a near-tie: the two best
logits at that step differ by less than :data:`NEAR_TIE` (then the report says so)."""
from __future__ import annotations

import inspect
import time

import numpy as np
from hypothesis import strategies as st

from conformance import models
from conformance.registry import check
from conformance.runner import Skip, note
from conformance.strategies import schedules

NEAR_TIE = 1e-3  # largest top-2 logit gap (float32 logits) at which a divergence is a float near-tie
GENERATE = ("load_model", "generate_step")


def generate(impl, model, prompt, max_tokens, drafter=None, draft_max=4, eos=(), verified=None):
    """``(tokens, from_draft flags)`` of one generation; a speculative one must report every flag. With a
    drafter and a backend that reports counts (``stats``), the counts are checked against the flags
    (:func:`check_counts`); ``verified()`` gives the drafts each draft call sent to verification, when the
    caller knows them (a fixed ``draft_max``)."""
    counts = {} if drafter is not None and reports_counts(impl) else None
    t0 = time.perf_counter()
    out = list(impl.generate_step(model, list(prompt), max_tokens, drafter=drafter, draft_max=draft_max,
                                  eos=tuple(eos), **({} if counts is None else {"stats": counts})))
    seconds = time.perf_counter() - t0
    flags = [f for _, f in out]
    if drafter is not None and any(f is None for f in flags):
        raise AssertionError(f"generate_step with a drafter yielded from_draft = None for {flags.count(None)} of "
                             f"{len(flags)} tokens: it must say for each token whether it was an accepted draft")
    flags = [bool(f) for f in flags]
    if counts is not None:
        what = f"prompt {list(prompt)}, max_tokens {max_tokens}, draft_max {draft_max}, eos {list(eos)}"
        check_counts(counts, flags, verified() if verified else None, seconds, what)
    return [int(t) for t, _ in out], flags


def reports_counts(impl) -> bool:
    """Whether the backend's ``generate_step`` takes ``stats`` (the optional counts of a generation)."""
    try:
        return "stats" in inspect.signature(impl.generate_step).parameters
    except (TypeError, ValueError):
        return False


def check_counts(counts: dict, flags: list[bool], verified, seconds: float, what: str) -> None:
    """The counts a speculative generation reports (``generate_step(..., stats=dict)``) agree with what
    it emitted. A step emits its accepted drafts, then the model's own token, unless EOS among the
    accepted drafts ends the output; a step is counted whole (as llama.cpp's lookup), so

    - ``steps`` = the tokens not from a draft, plus one if the output ends with an accepted draft;
    - ``n_accept`` = the accepted drafts emitted (at least that many when the output ends inside an
      accepted run: those past EOS count too);
    - ``n_drafted`` >= ``n_accept``; with a fixed ``draft_max``, exactly the drafts the draft calls
      returned (each cut to the length asked and before the first id outside the vocabulary):
      ``verified``, when the check knows them;
    - optional: ``accept`` = 100 n_accept / n_drafted (0 when nothing was drafted); ``draft_lengths``
      {k: steps that verified k drafts}, summing to ``steps`` and, weighted by k, to ``n_drafted``;
      ``t_draft`` <= ``t_total`` <= the generation's wall time, in seconds."""
    missing = [k for k in ("steps", "n_drafted", "n_accept") if k not in counts]
    assert not missing, f"{what}: generate_step(stats=...) reported {sorted(counts)}, without {missing}"
    ends_inside = bool(flags) and flags[-1]
    steps, n_drafted, n_accept = counts["steps"], counts["n_drafted"], counts["n_accept"]
    want_steps = flags.count(False) + ends_inside
    assert steps == want_steps, (f"{what}: reported steps = {steps}, but the output (from_draft flags {flags}) "
                                 f"took {want_steps} steps")
    emitted = flags.count(True)
    assert n_accept == emitted or (ends_inside and n_accept > emitted), (
        f"{what}: reported n_accept = {n_accept}, but {emitted} emitted tokens are accepted drafts "
        f"(flags {flags})")
    assert n_drafted >= n_accept, f"{what}: reported n_drafted = {n_drafted} < n_accept = {n_accept}"
    if verified is not None:
        want = sum(map(len, verified))
        assert n_drafted == want, (f"{what}: reported n_drafted = {n_drafted}, but the draft calls sent {want} drafts "
                                   f"to verification: {verified}")
    if "accept" in counts:
        want = 100.0 * n_accept / n_drafted if n_drafted else 0.0
        assert abs(counts["accept"] - want) <= 1e-9 * max(1.0, want), (
            f"{what}: reported accept = {counts['accept']} %, but {n_accept} of {n_drafted} drafts is {want} %")
    if "draft_lengths" in counts:
        lengths = {int(k): int(c) for k, c in counts["draft_lengths"].items()}
        assert sum(lengths.values()) == steps and sum(k * c for k, c in lengths.items()) == n_drafted, (
            f"{what}: reported draft_lengths {lengths} do not add up to steps = {steps} and n_drafted = {n_drafted}")
    if "t_total" in counts:
        t_draft, t_total = counts.get("t_draft", 0.0), counts["t_total"]
        assert 0 <= t_draft <= t_total <= seconds, (
            f"{what}: reported t_draft = {t_draft} s, t_total = {t_total} s; the generation took {seconds:.4f} s")


def in_vocab(drafts: list[int], vocab: int | None) -> list[int]:
    """``drafts`` before the first id outside ``0..vocab - 1`` (what a step sends to verification)."""
    cut = next((i for i, t in enumerate(drafts) if t < 0 or (vocab is not None and t >= vocab)), len(drafts))
    return drafts[:cut]


class ObservedDrafter:
    """The backend's drafter, with the calls the generation makes to it recorded: ``prompts`` (one per
    ``reset``), and per ``draft`` call ``(tokens handed so far, n_draft, drafts)``."""

    def __init__(self, inner):
        self.inner, self.prompts, self.tokens, self.calls = inner, [], [], []

    def reset(self, prompt):
        self.prompts.append([int(t) for t in prompt])
        self.tokens = list(self.prompts[-1])
        self.inner.reset(prompt)

    def extend(self, tokens):
        tokens = [int(t) for t in tokens]
        self.tokens += tokens
        self.inner.extend(tokens)

    def draft(self, n_draft):
        drafts = [int(t) for t in self.inner.draft(n_draft)]
        self.calls.append((list(self.tokens), n_draft, drafts))
        return drafts


def check_drafter_calls(drafter: ObservedDrafter, prompt, output, draft_max, what) -> list:
    """The generation reset() the drafter with the prompt once, handed it (reset then extend) exactly
    the prompt and the tokens emitted so far before each draft call, and asked for at most
    ``draft_max``; returns ``(position, drafts)`` per call, for :func:`expected_flags`."""
    assert drafter.prompts == [list(prompt)], (f"{what}: the drafter was reset() with {drafter.prompts}, expected "
                                               f"once with the prompt {list(prompt)}")
    offered = []
    for i, (tokens, n_draft, drafts) in enumerate(drafter.calls):
        pos = len(tokens) - len(prompt)
        assert tokens == list(prompt) + output[:pos], (
            f"{what}: before draft call {i + 1} the drafter was handed {tokens[len(prompt):]} after the prompt "
            f"(reset() then extend()), but the output so far is {output[:pos]}")
        assert n_draft <= draft_max, f"{what}: draft call {i + 1} asked for {n_draft} > draft_max = {draft_max} tokens"
        offered.append((pos, drafts[:n_draft]))
    return offered


def assert_same_tokens(model, prompt, plain, spec, what) -> None:
    """``spec == plain``, or the first difference is a proven near-tie: after ``prompt + plain[:i]`` the
    NumPy reference's two best logits on the same weights differ by less than :data:`NEAR_TIE` (noted in
    the report). The reference's, not the backend's: a backend's own logits can not vouch for its output."""
    if spec == plain:
        return
    i = next((i for i, (a, b) in enumerate(zip(plain, spec)) if a != b), min(len(plain), len(spec)))
    if i < min(len(plain), len(spec)):
        top2 = np.sort(models.reference_logits(model, prompt + plain[:i])[-1])[-2:]
        gap = float(top2[1] - top2[0])
        if gap < NEAR_TIE:
            note(f"{what}: outputs part at token {i} where the reference's top-2 logit gap is {gap:.2e} < "
                 f"{NEAR_TIE} (near-tie)")
            return
        raise AssertionError(f"{what}: token {i} differs: expected {plain[i]}, got {spec[i]} (the reference's "
                             f"top-2 logit gap there is {gap:.3g}, not a near-tie). Expected {plain}, got {spec}")
    raise AssertionError(f"{what}: expected {plain}, got {spec}")


def plain_then_observed(impl, model, prompt, max_tokens, draft_max):
    """Plain greedy, then speculative with the backend's drafter observed (``draft_max`` None: the backend's
    own policy); the outputs must agree. Returns ``(tokens, flags, offered, what)``, ``offered`` being the
    checked drafter calls (:func:`check_drafter_calls`), or None after a proven near-tie."""
    m = models.load(impl, *model)
    plain, _ = generate(impl, m, prompt, max_tokens)
    drafter = ObservedDrafter(impl.NgramDrafter())
    sent = None if draft_max is None else (lambda: [d[:n] for _, n, d in drafter.calls])
    spec, flags = generate(impl, m, prompt, max_tokens, drafter=drafter, draft_max=draft_max, verified=sent)
    what = f"tiny {model[0]} (seed {model[1]}), prompt {prompt}, max_tokens {max_tokens}, draft_max {draft_max}"
    assert_same_tokens(m, prompt, plain, spec, what)
    if spec != plain:
        return spec, flags, None, what
    limit = max_tokens if draft_max is None else draft_max
    return spec, flags, check_drafter_calls(drafter, prompt, spec, limit, what), what


@check("greedy", needs=GENERATE + ("NgramDrafter",),
       given=dict(model=models.models, prompt=models.prompts(), max_tokens=st.integers(1, 20),
                  draft_max=st.integers(1, 8)), examples=50)
def speculative_equals_plain_greedy(impl, model, prompt, max_tokens, draft_max):
    """With the n-gram drafter, speculative greedy output equals plain greedy output token for token; the
    drafter is handed exactly the prompt and the emitted tokens, and from_draft marks the accepted drafts."""
    spec, flags, offered, what = plain_then_observed(impl, model, prompt, max_tokens, draft_max)
    if offered is not None:
        want = expected_flags(spec, offered, ())
        assert flags == want, (f"{what}: from_draft flags {flags}, expected {want} from the drafts (position, "
                               f"drafts) {offered}")


@check("greedy", needs=GENERATE + ("NgramDrafter",))
def draft_max_0_is_plain_decoding(impl):
    """``draft_max=0`` with a drafter decodes plainly: plain greedy output, no draft asked for, no token
    flagged from_draft (the drafter may still be handed the tokens), in every architecture."""
    prompt = [3, 4, 5, 3, 4, 5, 3, 4]   # repeats: a drafter asked for drafts would find some
    for arch in models.supported(impl):
        spec, flags, offered, what = plain_then_observed(impl, (arch, 0), prompt, 6, 0)
        assert not any(flags), f"{what}: from_draft flags {flags} with draft_max=0"


@check("greedy", needs=GENERATE + ("NgramDrafter",),
       given=dict(model=models.models, prompt=models.prompts(), max_tokens=st.integers(1, 24)), examples=25)
def default_draft_length_equals_plain_greedy(impl, model, prompt, max_tokens):
    """With ``draft_max=None`` (the backend's own draft-length policy: one that may draft nothing, or
    decode plainly while it keeps asking the drafter), output still equals plain greedy; the drafter is
    handed exactly the prompt and the emitted tokens, and a token flagged from_draft was drafted there."""
    spec, flags, offered, what = plain_then_observed(impl, model, prompt, max_tokens, None)
    if offered is not None:
        for i in (i for i, f in enumerate(flags) if f):
            assert any(pos <= i < pos + len(d) and d[:i - pos + 1] == spec[pos:i + 1] for pos, d in offered), (
                f"{what}: token {i} ({spec[i]}) is flagged from_draft, but no draft call offered the output up to "
                f"it; drafts offered (position, drafts): {offered}")


@check("greedy", needs=GENERATE + ("NgramDrafter",))
def prompt_ids_outside_the_vocabulary_are_refused(impl):
    """A speculative generation refuses a prompt holding an id outside the model's vocabulary (-1, the
    vocabulary size itself, 2^31 - 1) with ValueError, before any token: an embedding read past its
    table is garbage or a crash, never an answer. The ids 0 and vocabulary size - 1 are accepted."""
    m = models.load(impl, models.supported(impl)[0], models.SEEDS[0])
    bad = [-1, 2**31 - 1]
    if all(getattr(impl, n, None) for n in ("forward", "make_cache")):
        vocab = int(np.asarray(impl.forward(m, [0], impl.make_cache(m))).shape[-1])
        bad.append(vocab)
        edges = [0, vocab - 1, 0]   # the first and the last id of the vocabulary are valid
        out = list(impl.generate_step(m, edges, 2, drafter=impl.NgramDrafter(), draft_max=2))
        assert len(out) == 2, f"generate_step with the prompt {edges} (ids 0 and vocab - 1) yielded {out}"
    for t in bad:
        prompt = [0, 1, t]
        try:
            out = list(impl.generate_step(m, prompt, 3, drafter=impl.NgramDrafter(), draft_max=2))
        except ValueError:
            continue
        raise AssertionError(f"generate_step with the prompt {prompt} (id {t} is outside the vocabulary) "
                             f"yielded {out} instead of raising ValueError")


class _Proposing:
    """A drafter that proposes ``ids`` at every call, and records what it returned."""

    def __init__(self, ids):
        self.ids, self.returned = list(ids), []

    def reset(self, prompt):
        pass

    def extend(self, tokens):
        pass

    def draft(self, n_draft):
        self.returned.append(self.ids[:n_draft])
        return self.returned[-1]


@check("greedy", needs=GENERATE + ("forward", "make_cache"))
def drafts_outside_the_vocabulary_are_never_accepted(impl):
    """A drafter may propose ids the model does not have (a static cache of another tokenizer, a negative
    id): the drafts from the first such id on are never verified nor accepted, and the output is plain
    greedy's; a draft of id 0 or vocabulary size - 1 is an ordinary draft (flagged when accepted)."""
    arch = models.supported(impl)[0]
    m = models.load(impl, arch, models.SEEDS[0])
    prompt = [5, 6, 7]
    vocab = int(np.asarray(impl.forward(m, [0], impl.make_cache(m))).shape[-1])
    plain, _ = generate(impl, m, prompt, 6)
    where = f"tiny {arch} (seed {models.SEEDS[0]}), prompt {prompt}"
    for ids in ([vocab, vocab + 7, 2**31 - 1], [vocab + 7, 3], [2**31 - 1], [-1, 5], [-3], [plain[1], -2, 4]):
        drafter = _Proposing(ids)
        spec, flags = generate(impl, m, prompt, 6, drafter=drafter, draft_max=3,
                               verified=lambda: [in_vocab(d, vocab) for d in drafter.returned])
        what = f"{where}, drafts {ids} at every call"
        assert_same_tokens(m, prompt, plain, spec, what)
        assert in_vocab(ids, vocab) or not any(flags), (
            f"{what}: tokens flagged from_draft {flags}, but no draft is a token of the model")
    # the first and the last id of the vocabulary are drafts like any other: verified (the counts say so)
    for edge in (0, vocab - 1):
        drafter = _Proposing([edge])
        generate(impl, m, prompt, 4, drafter=drafter, draft_max=1,
                 verified=lambda: [in_vocab(d, vocab) for d in drafter.returned])


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


def run_scripted(impl, m, prompt, truth, plain, schedule, max_tokens, eos, where):
    """Generate with drafts scripted from greedy's ``truth``; the output must be ``plain`` and the run must
    follow the protocol (:func:`check_scripted_run`)."""
    drafter = models.ScriptedDrafter(truth, schedule)
    spec, flags = generate(impl, m, prompt, max_tokens, drafter=drafter, draft_max=8, eos=eos,
                           verified=lambda: [d for _, d in drafter.offered])
    what = f"{where}, max_tokens {max_tokens}, eos {list(eos)}, drafts offered (position, drafts) {drafter.offered}"
    assert_same_tokens(m, prompt, plain, spec, what)
    check_scripted_run(drafter, prompt, truth, eos, flags, spec == plain, what)


@check("greedy", needs=GENERATE,
       given=dict(model=models.models, prompt=models.prompts(), max_tokens=st.integers(1, 20),
                  schedule=schedules(), eos_at=st.one_of(st.none(), st.integers(0, 19))), examples=50)
def forced_right_wrong_and_empty_drafts(impl, model, prompt, max_tokens, schedule, eos_at):
    """Drafts forced right, wrong or empty (and EOS inside an accepted run) never change greedy output."""
    m = models.load(impl, *model)
    truth, _ = generate(impl, m, prompt, max_tokens)
    eos = (truth[eos_at],) if eos_at is not None and eos_at < len(truth) else ()
    plain = truth[:truth.index(eos[0]) + 1] if eos else truth
    run_scripted(impl, m, prompt, truth, plain, schedule, max_tokens, eos,
                 f"tiny {model[0]} (seed {model[1]}), prompt {prompt}")


def check_scripted_run(drafter, prompt, truth, eos, flags, same, what) -> None:
    """The scripted drafter was reset() with the prompt once and handed the emitted tokens; where the
    output is right, the from_draft flags are the ones its drafts imply."""
    assert drafter.prompts == [list(prompt)], f"{what}: the drafter was reset() with {drafter.prompts}"
    assert drafter.wrong_input is None, f"{what}: {drafter.wrong_input}"
    if same:
        want = expected_flags(truth, drafter.offered, eos)
        assert flags == want, f"{what}: from_draft flags {flags}, expected {want} (right drafts must be accepted)"


@check("greedy", needs=GENERATE)
def eos_first_last_and_inside_an_accepted_run(impl):
    """EOS as the very first token, as the bonus token ending a step, and inside a run of accepted drafts:
    output stops right after it, and from_draft marks exactly the accepted drafts."""
    # the first model and prompt whose 12 greedy tokens hold two new tokens after the first: tiny qwen3_5 (seed
    # 0) and the first prompt, for a backend that supports every architecture
    tried = []
    for arch, seed, prompt in ((a, seed, p) for a in models.supported(impl) for seed in models.SEEDS
                               for p in ([72, 101, 108, 108, 111, 32] * 3, [3, 1, 4, 1, 5, 9, 2, 6] * 2)):
        m = models.load(impl, arch, seed)
        truth, _ = generate(impl, m, prompt, 12)
        firsts = [i for i in range(1, len(truth)) if truth[i] not in truth[:i]]
        if len(firsts) >= 2:
            break
        tried.append(f"tiny {arch} (seed {seed}), prompt {prompt}: {truth}")
    else:
        raise AssertionError(f"no model and prompt emits enough distinct tokens for this check: {'; '.join(tried)}")
    inside, last = firsts[0], firsts[1]
    cases = [  # (what, EOS position in truth, schedule, max_tokens)
        ("EOS first", 0, [("true", 8)], 12),
        ("EOS inside an accepted run", inside, [("true", 8)], 12),
        # the first draft call is at position 0 or 1 (before or after the prompt's token): one of these
        # two makes EOS the bonus token right after the accepted drafts
        ("EOS as the bonus token after accepted drafts", last, [("true", last)], 12),
        ("EOS as the bonus token after accepted drafts", last, [("true", last - 1)], 12),
        ("EOS as the last token max_tokens allows", last, [("true", 2), ("true", 8)], last + 1),
    ]
    for label, at, schedule, max_tokens in cases:
        run_scripted(impl, m, prompt, truth, truth[:at + 1], schedule, max_tokens, (truth[at],),
                     f"{label}: tiny {arch} (seed {seed}), prompt {prompt}")


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
    spec, _ = generate(impl, m, prompt, 16, drafter=drafter, draft_max=8,
                       verified=lambda: [d for _, d in drafter.offered])
    assert_same_tokens(m, prompt, truth, spec, f"tiny llama_sliding (seed {seed}), prompt {prompt}, "
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
    assert_same_tokens(ref_model, prompt, want, got,
                       f"tiny {model[0]} (seed {model[1]}), prompt {prompt}, max_tokens {max_tokens}: "
                       f"reference vs {'speculative' if drafter else 'plain'} greedy of the backend")


def _memory_gb() -> float | None:
    """The machine's physical memory in GB (None where the OS does not say)."""
    import os

    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    except (ValueError, OSError, AttributeError):
        return None


def check_stream(impl, m, prompt, max_tokens, drafter, eos, truth, what) -> None:
    """One ``stream_generate`` run against mlx-lm's rules (see :func:`stream_generate_follows_mlx_lm`)."""
    limit = 256 if max_tokens is None else max_tokens
    t0 = time.perf_counter()
    responses, seen = [], []
    for r in impl.stream_generate(m, list(prompt), max_tokens=max_tokens, drafter=drafter, draft_max=4,
                                  eos=tuple(eos)):
        responses.append(r)
        seen.append(time.perf_counter() - t0)
    tokens = [int(r.token) for r in responses]
    end = next((i + 1 for i, t in enumerate(truth) if t in eos), len(truth))
    assert_same_tokens(m, prompt, truth[:min(end, limit)], tokens, what)
    if tokens != truth[:min(end, limit)]:
        return
    memory = _memory_gb()
    for i, (r, t) in enumerate(zip(responses, seen)):
        last = i == len(responses) - 1
        want_reason = None if not last else "stop" if tokens[-1] in eos else "length"
        assert (r.generation_tokens, r.finish_reason, r.prompt_tokens) == (i + 1, want_reason, len(prompt)), (
            f"{what}: response {i + 1} of {len(responses)} reports generation_tokens {r.generation_tokens}, "
            f"finish_reason {r.finish_reason!r}, prompt_tokens {r.prompt_tokens}; expected {i + 1}, "
            f"{want_reason!r}, {len(prompt)}")
        # rates are counts over times within the call: at least the count over the time since the call
        assert r.generation_tps >= (i + 1) / t and r.prompt_tps >= len(prompt) / seen[0], (
            f"{what}: response {i + 1} reports generation_tps {r.generation_tps}, prompt_tps {r.prompt_tps}, "
            f"but {i + 1} tokens came {t:.4f} s after the call (the first {seen[0]:.4f} s)")
        assert 0 <= r.peak_memory and (memory is None or r.peak_memory <= memory), (
            f"{what}: response {i + 1} reports peak_memory {r.peak_memory} GB; the machine has {memory} GB")
    assert tokens[-1] in eos or len(tokens) == limit, f"{what}: {len(tokens)} tokens, none EOS, max_tokens {limit}"


@check("greedy", needs=GENERATE + ("stream_generate", "NgramDrafter"))
def stream_generate_follows_mlx_lm(impl):
    """A backend with mlx-lm's ``stream_generate`` API yields, plain and speculative, one response per
    generated token: plain greedy's tokens up to EOS (its response included) or ``max_tokens`` (256, mlx-lm's
    default, when omitted), ``generation_tokens`` counting them, ``finish_reason`` None until the last
    ("stop" at EOS, "length" at max_tokens), ``prompt_tokens`` the prompt's length, token rates no lower than
    the count over the time since the call, and a peak memory within the machine's (GB)."""
    arch = models.supported(impl)[0]   # qwen3_5 for a backend that supports every architecture
    m = models.load(impl, arch, 0)
    prompt = [9, 8, 7, 9, 8, 7, 9, 8]
    truth, _ = generate(impl, m, prompt, 256)
    where = f"stream_generate on tiny {arch} (seed 0), prompt {prompt}"
    for max_tokens, eos in ((10, ()), (12, (truth[4],)), (None, ())):
        for drafter in (None, impl.NgramDrafter()):
            what = f"{where}, max_tokens {max_tokens}, eos {list(eos)}, {'a' if drafter else 'no'} drafter"
            check_stream(impl, m, prompt, max_tokens, drafter, eos, truth, what)
