"""Pipelined plain mode: the generator steps like mlx-lm's ``generate_step`` while drafting does not
pay, and switching in and out of it keeps the output plain greedy's and the cache exact.

Truth: ``mlx_lm.generate.generate_step`` on the same model. The drafters here propose by *output
position* (how many tokens have been generated), so a schedule says exactly where the generator
enters plain mode (no proposal), where it leaves it (a proposal reaching past the token in flight)
and where a verify step rejects (a draft forced wrong).
"""
from __future__ import annotations

import mlx.core as mx
import mlx_lm
import pytest
from hypothesis import given, settings, strategies as st
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, make_prompt_cache
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from mlx_backend.decode.draft_policy import DraftPolicy
from mlx_backend.decode.generate import SpecStats, ngram_speculative_generate_step, stream_generate
from mlx_backend.decode.rollback import GDN_PATHS
from mlx_backend.models.tiny import ARCHITECTURES
from reference.models.tiny import write_tiny_model

from test_mlx_generate import VOCAB, argmax_sampler, assert_greedy_equal, model_of, plain_greedy, prompts


class PositionalDrafter:
    """Proposes ``truth[pos : pos + n]`` at output position ``pos`` with ``(n, wrong_at) = schedule[pos]``
    (``(0, None)`` past its end); the token at ``wrong_at`` is changed, so that draft is wrong."""

    def __init__(self, truth, schedule):
        self.truth, self.schedule = list(truth), dict(schedule)

    def reset(self, prompt):
        self.n_prompt, self.n = len(prompt), len(prompt)

    def extend(self, tokens):
        self.n += len(tokens)

    def draft(self, n_max):
        pos = self.n - self.n_prompt
        n, wrong_at = self.schedule.get(pos, (0, None))
        d = (self.truth[pos:pos + min(n, n_max)] + [0] * n_max)[:min(n, n_max)]
        if wrong_at is not None and wrong_at < len(d):
            d[wrong_at] = (d[wrong_at] + 1) % VOCAB
        return d


def forced_policy(k_max: int) -> DraftPolicy:
    """A cost-aware policy with flat verify costs and acceptance frozen at 0.9: it drafts whatever is
    proposed (up to ``k_max``), enters plain mode when nothing is, and leaves it as soon as a proposal
    reaches past the token in flight, so the drafter's schedule decides every switch."""
    return DraftPolicy([1.0] * (k_max + 1), alpha=0.0, prior=0.9)


def kv_offset(cache) -> int:
    """Tokens held by the attention layers of a prompt cache."""
    return next(c.offset for c in cache if isinstance(c, KVCache))


def spec_run(model, prompt, max_tokens, drafter, stats, **kw):
    return [t for t, _, _ in ngram_speculative_generate_step(mx.array(prompt), model, max_tokens=max_tokens,
                                                             drafter=drafter, stats=stats, **kw)]


@pytest.mark.parametrize("gdn_path", GDN_PATHS)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_forced_schedule_enters_and_leaves_plain_mode(arch, gdn_path):
    """Positions 0-4 plain; the proposal made at 5 guesses token 6 and reaches past it: leave after
    token 6, verify 3 drafts (all right: 4 tokens); plain again; leave after 13, verify 3 drafts
    with the 2nd wrong (2 tokens); plain to the end (max_tokens inside plain mode)."""
    model = model_of(arch)
    prompt = [3, 1, 4, 1, 5]
    plain, plain_lp = plain_greedy(model, prompt, 24)
    schedule = {5: (3, None), 6: (3, None), 12: (3, None), 13: (3, 1)}
    stats = SpecStats()
    cache = make_prompt_cache(model)
    spec = spec_run(model, prompt, 24, PositionalDrafter(plain, schedule), stats, draft_max=None,
                    draft_policy=forced_policy(3), gdn_path=gdn_path, prompt_cache=cache)
    assert assert_greedy_equal(plain, plain_lp, spec) is None
    assert (stats.enter_plain, stats.leave_plain) == (3, 2)
    assert (stats.n_drafted, stats.n_accept) == (6, 4)
    assert stats.steps == 2 + stats.plain_steps and stats.plain_steps == 24 - 4 - 2
    assert kv_offset(cache) == len(prompt) + 24   # every token, the last fed at the end (generate_step's)


@settings(max_examples=40, deadline=None)
@given(arch=st.sampled_from(ARCHITECTURES), prompt=prompts(), gdn_path=st.sampled_from(GDN_PATHS),
       max_tokens=st.integers(1, 20), draft_max=st.integers(1, 6),
       schedule=st.dictionaries(st.integers(0, 19), st.tuples(st.integers(0, 6),
                                                              st.one_of(st.none(), st.integers(0, 5))),
                                max_size=12))
def test_any_schedule_equals_plain_greedy(arch, prompt, gdn_path, max_tokens, draft_max, schedule):
    """Random switches between plain and verify steps, rejections anywhere, max_tokens in either mode."""
    model = model_of(arch)
    plain, plain_lp = plain_greedy(model, prompt, max_tokens)
    stats = SpecStats()
    cache = make_prompt_cache(model)
    out = list(ngram_speculative_generate_step(mx.array(prompt), model, max_tokens=max_tokens,
                                               draft_max=None, draft_policy=forced_policy(draft_max),
                                               drafter=PositionalDrafter(plain, schedule),
                                               stats=stats, gdn_path=gdn_path, prompt_cache=cache))
    tie = assert_greedy_equal(plain, plain_lp, [t for t, _, _ in out])
    assert stats.n_tokens == max_tokens and stats.leave_plain <= stats.enter_plain
    assert sum(f for _, _, f in out) == stats.n_accept <= stats.n_drafted
    if tie is None:
        assert kv_offset(cache) == len(prompt) + max_tokens
        for (_, lp, _), ref in zip(out, plain_lp):
            assert mx.allclose(lp, ref, atol=1e-4).item()


def first_turn(steps, stop_after):
    """The tokens a consumer takes from ``steps`` ((token, ...) tuples) until it has ``stop_after`` of them
    (None: to the end), then closes it, as ``stream_generate`` does at an EOS."""
    out = []
    for step in steps:
        out.append(int(step[0]))
        if len(out) == stop_after:
            break
    steps.close()
    return out


# (stop after how many tokens (None: exhausted at 12), schedule): where the run is when its consumer stops
# (a proposal at output position p guesses token p; in plain mode one reaching past the token in flight
# leaves after it, and the proposal at p + 1 is verified: {2: .., 3: (5, 3)} verifies tokens 3-7 at once,
# the 4th draft (token 6) wrong, so tokens 3, 4, 5 are accepted drafts and 6 the step's own token)
TURN_ENDS = {"plain mode": (4, {}), "an accepted draft mid-step": (4, {2: (5, None), 3: (5, 3)}),
             "the last accepted draft": (6, {2: (5, None), 3: (5, 3)}),
             "a step's own token": (7, {2: (5, None), 3: (5, 3)}),
             "exhausted in a verify step": (None, {6: (5, None), 7: (5, None)}),
             "exhausted in plain mode": (None, {2: (3, None)})}


@pytest.mark.parametrize("gdn_path", GDN_PATHS)
@pytest.mark.parametrize("end", TURN_ENDS)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_a_reused_prompt_cache_holds_what_generate_step_leaves(arch, end, gdn_path):
    """A chat loop reuses the prompt cache and feeds only the next turn's tokens (mlx_lm.chat): after a
    turn that ran out or whose consumer stopped (at an EOS), in either mode, the cache holds the prompt
    and every token yielded, as after mlx-lm's ``generate_step``, so the next turn is the same. (Before:
    a verify step's drafts after the consumer's last token stayed in it, and its last token was missing.)"""
    model = model_of(arch)
    prompt, turn2, stop_after, schedule = [3, 1, 4, 1, 5], [9, 2, 6], *TURN_ENDS[end]
    plain, _ = plain_greedy(model, prompt, 12)
    ref_cache, cache = make_prompt_cache(model), make_prompt_cache(model)
    ref1 = first_turn(generate_step(mx.array(prompt), model, max_tokens=12, sampler=argmax_sampler,
                                    prompt_cache=ref_cache), stop_after)
    ours1 = first_turn(ngram_speculative_generate_step(
        mx.array(prompt), model, max_tokens=12, draft_max=None, draft_policy=forced_policy(5),
        drafter=PositionalDrafter(plain, schedule), gdn_path=gdn_path, prompt_cache=cache), stop_after)
    assert ours1 == ref1 and kv_offset(cache) == kv_offset(ref_cache) == len(prompt) + len(ref1)
    ref2 = list(generate_step(mx.array(turn2), model, max_tokens=8, sampler=argmax_sampler, prompt_cache=ref_cache))
    ours2 = spec_run(model, turn2, 8, PositionalDrafter([t for t, _ in ref2], {1: (4, None)}), SpecStats(),
                     draft_max=None, draft_policy=forced_policy(5), gdn_path=gdn_path, prompt_cache=cache)
    assert assert_greedy_equal([int(t) for t, _ in ref2], [lp for _, lp in ref2], ours2) is None


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_draft_max_zero_is_generate_step(arch):
    """draft_max=0 is mlx-lm's pipelined plain decoding: same tokens and logprobs, and with a sampler
    the same random draws in the same order (same seed, same tokens), logits processors included."""
    model = model_of(arch)
    prompt = [2, 7, 1, 8, 2, 8]
    procs = make_logits_processors(repetition_penalty=1.3, repetition_context_size=5)
    for sampler in (argmax_sampler, make_sampler(temp=1.0)):
        mx.random.seed(5)
        ref = list(generate_step(mx.array(prompt), model, max_tokens=16, sampler=sampler,
                                 logits_processors=procs, prefill_step_size=4))
        mx.random.seed(5)
        stats = SpecStats()
        out = list(ngram_speculative_generate_step(mx.array(prompt), model, max_tokens=16, sampler=sampler,
                                                   logits_processors=procs, prefill_step_size=4,
                                                   draft_max=0, stats=stats))
        assert [t for t, _, _ in out] == [int(t) for t, _ in ref]
        assert all(mx.array_equal(lp, r).item() for (_, lp, _), (_, r) in zip(out, ref))
        assert stats.plain_steps == stats.steps == 16 and stats.enter_plain == 1 and stats.n_proposed == 0


def test_fixed_draft_length_verifies_every_proposal_where_it_is_made():
    """draft_max=k > 0 is not pipelined: a proposal guessing only the next token is verified too."""
    model = model_of("qwen3_5")
    prompt = [1, 2, 3]
    plain, plain_lp = plain_greedy(model, prompt, 10)
    stats = SpecStats()
    out = list(ngram_speculative_generate_step(mx.array(prompt), model, max_tokens=10, draft_max=4, stats=stats,
                                               drafter=PositionalDrafter(plain, {1: (1, None), 5: (2, 0)})))
    assert assert_greedy_equal(plain, plain_lp, [t for t, _, _ in out]) is None
    assert [f for _, _, f in out] == [False, True] + [False] * 8
    assert (stats.plain_steps, stats.enter_plain, stats.n_drafted, stats.n_accept) == (0, 0, 3, 1)


def test_policy_stays_plain_when_drafting_does_not_pay():
    """Costs where nothing pays: the whole run is one pipelined plain run, the proposals only teach."""
    model = model_of("qwen3_5")
    prompt = [4, 5, 6, 4, 5, 6, 4, 5]
    plain, plain_lp = plain_greedy(model, prompt, 20)
    policy = DraftPolicy([1.0, 2.0, 3.0, 4.0], plain_cost=0.9)
    stats = SpecStats()
    spec = spec_run(model, prompt, 20, PositionalDrafter(plain, {p: (3, None) for p in range(20)}), stats,
                    draft_max=None, draft_policy=policy)
    assert assert_greedy_equal(plain, plain_lp, spec) is None
    assert (stats.enter_plain, stats.leave_plain, stats.n_drafted) == (1, 0, 0)
    assert stats.policy["decisions"] == {0: 20} and min(stats.policy["accept"]) > 0.8


def test_policy_leaves_plain_mode_when_acceptance_rises():
    """Nearly free verification: the first proposal past the token in flight ends plain mode."""
    model = model_of("llama")
    prompt = [9, 9, 1, 2]
    plain, plain_lp = plain_greedy(model, prompt, 20)
    policy = DraftPolicy([1.0, 1.01, 1.02, 1.03], plain_cost=0.95, prior=0.9)
    stats = SpecStats()
    spec = spec_run(model, prompt, 20, PositionalDrafter(plain, {4: (3, None), 5: (3, None)}), stats,
                    draft_max=None, draft_policy=policy)
    assert assert_greedy_equal(plain, plain_lp, spec) is None
    assert (stats.enter_plain, stats.leave_plain, stats.n_drafted, stats.n_accept) == (2, 1, 3, 3)
    assert sum(stats.policy["decisions"].values()) == stats.steps


@pytest.fixture(scope="module")
def tiny_loaded(tmp_path_factory):
    return mlx_lm.load(str(write_tiny_model(str(tmp_path_factory.mktemp("tiny") / "llama"), "llama", seed=3)))


@pytest.mark.parametrize("eos_at,schedule", [(3, {}),                      # EOS in plain mode
                                             (6, {2: (6, None), 3: (6, None)}),   # EOS inside a verify run
                                             (2, {2: (4, None)})])        # EOS in flight when leaving
def test_stream_generate_stops_at_eos_in_either_mode(tiny_loaded, eos_at, schedule):
    model, tokenizer = tiny_loaded
    prompt = "abcab"
    plain = [r.token for r in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=12,
                                                     sampler=argmax_sampler)]
    eos = plain[eos_at]
    tokenizer.eos_token_ids = {eos}
    try:
        ref = [(r.text, r.token, r.finish_reason) for r in mlx_lm.stream_generate(
            model, tokenizer, prompt, max_tokens=12, sampler=argmax_sampler)]
        ours = [(r.text, r.token, r.finish_reason) for r in stream_generate(
            model, tokenizer, prompt, max_tokens=12, draft_max=None, draft_policy=forced_policy(6),
            drafter=PositionalDrafter(plain, schedule))]
    finally:
        tokenizer.eos_token_ids = {tokenizer.eos_token_id}
    assert ours == ref and ours[-1][2] == "stop"


def test_stream_generate_takes_mlx_lm_s_keywords(tiny_loaded):
    """Code written for ``mlx_lm.stream_generate`` runs unchanged: ``prompt_progress_callback`` is called
    with the same (done, total) pairs, ``num_draft_tokens`` is the draft length (0: plain, no drafter call),
    and what cannot apply (a draft model, a quantized KV cache) is a ValueError naming the keyword."""
    model, tokenizer = tiny_loaded
    prompt, calls = "abcab" * 40, {"mlx-lm": [], "ours": []}
    ref = [r.token for r in mlx_lm.stream_generate(
        model, tokenizer, prompt, max_tokens=6, sampler=argmax_sampler, prefill_step_size=64,
        prompt_progress_callback=lambda done, total: calls["mlx-lm"].append((done, total)))]
    stats = SpecStats()
    ours = [r.token for r in stream_generate(
        model, tokenizer, prompt, max_tokens=6, sampler=argmax_sampler, prefill_step_size=64, stats=stats,
        num_draft_tokens=0, prompt_progress_callback=lambda done, total: calls["ours"].append((done, total)))]
    assert ours == ref and calls["ours"] == calls["mlx-lm"] and len(calls["ours"]) >= 4
    assert stats.n_proposed == 0 and stats.plain_steps == stats.steps
    for bad, word in [(dict(draft_model=model), "draft_model"), (dict(kv_bits=4), "kv_bits"),
                      (dict(num_draft_tokens=2, draft_max=3), "num_draft_tokens")]:
        with pytest.raises(ValueError, match=word):
            next(stream_generate(model, tokenizer, prompt, max_tokens=4, **bad))


def test_counts_are_the_drafts_verified_when_the_policy_verifies_fewer_than_proposed(monkeypatch):
    """Verify costs that jump after S = 3 make the cost-aware policy verify only part of each 5-token
    proposal: ``n_drafted`` and ``draft_lengths`` count the drafts the verify forwards held (read off the
    forwards by a spy), not the proposals, and the policy learns each forward's cost under its real size."""
    from mlx_backend.decode.rollback import VerifyCache

    sizes, timed = [], []
    original = VerifyCache.forward

    def forward(self, tokens, record=None):
        sizes.append(len(tokens))
        return original(self, tokens, record)

    monkeypatch.setattr(VerifyCache, "forward", forward)
    model = model_of("llama")
    prompt = [3, 1, 4, 1, 5]
    plain, plain_lp = plain_greedy(model, prompt, 24)
    schedule = {p + d: (5, None) for p in (2, 9, 16) for d in (0, 1)}   # leave plain mode at 3, 10, 17
    policy = DraftPolicy([1.0, 1.0, 1.0, 9.0, 9.0, 9.0], alpha=0.0, prior=0.9)
    observe_cost = policy.observe_cost
    policy.observe_cost = lambda S, seconds: (timed.append(S), observe_cost(S, seconds))
    stats = SpecStats()
    spec = spec_run(model, prompt, 24, PositionalDrafter(plain, schedule), stats, draft_max=None,
                    draft_policy=policy)
    assert assert_greedy_equal(plain, plain_lp, spec) is None
    verified = [S - 1 for S in sizes]
    assert verified and max(verified) < 5 and stats.n_proposed > stats.n_drafted   # proposals were cut
    assert stats.n_drafted == sum(verified)
    assert {k: n for k, n in stats.draft_lengths.items() if k} == {k: verified.count(k) for k in set(verified)}
    assert sorted(S for S in timed if S) == sorted(sizes)
