"""Greedy n-gram speculative decoding equals mlx-lm's own plain greedy decoding, token for token.

Truth: ``mlx_lm.generate.generate_step`` with an argmax sampler on the same model. Where float
arithmetic of a multi-token verify forward could flip an argmax, the test accepts a difference only
at a step whose top-2 log-probability gap (of the plain run) is below ``NEAR_TIE``, and then stops
comparing (the sequences legitimately part there); it never skips silently.
"""
from __future__ import annotations

import functools

import mlx.core as mx
import pytest
from hypothesis import given, settings, strategies as st
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from mlx_backend.decode.generate import SpecStats, ngram_speculative_generate_step, vocab_size
from mlx_backend.decode.rollback import GDN_PATHS
from mlx_backend.models.tiny import ARCHITECTURES, tiny_model

NEAR_TIE = 1e-3   # log-probability gap under which two top tokens count as tied in float32
VOCAB = 64


@functools.cache
def model_of(arch: str):
    return tiny_model(arch, vocab_size=VOCAB, seed=1)


def argmax_sampler(logprobs):
    return mx.argmax(logprobs, axis=-1)


def plain_greedy(model, prompt, max_tokens, prefill_step_size=512):
    """mlx-lm's plain greedy tokens and their log-probability rows."""
    out = list(generate_step(mx.array(prompt), model, max_tokens=max_tokens, sampler=argmax_sampler,
                             prefill_step_size=prefill_step_size))
    return [int(t) for t, _ in out], [lp for _, lp in out]


def assert_greedy_equal(plain, plain_logprobs, spec):
    """``spec == plain``, except for a divergence at a proven near-tie (returns its index or None)."""
    assert len(spec) == len(plain), (plain, spec)
    for i, (a, b) in enumerate(zip(plain, spec)):
        if a != b:
            row = plain_logprobs[i]
            top2 = mx.sort(row)[-2:].tolist()
            gap = top2[1] - top2[0]
            assert gap < NEAR_TIE, f"token {i}: plain {a} != spec {b} with top-2 gap {gap:.3g}"
            assert row[b].item() >= top2[0], f"token {i}: spec {b} is not among plain's top 2"
            return i
    return None


class ScriptedDrafter:
    """Drafts from a known continuation ``truth`` following a script of ``(n, wrong_at)`` per call.

    ``n`` tokens are proposed (0: a zero-draft step); the token at ``wrong_at`` (if any) is changed, so
    the draft is forced wrong there. Positions past ``truth`` are padded with token 0.
    """

    def __init__(self, truth, script):
        self.truth, self.script, self.calls = list(truth), list(script), []

    def reset(self, prompt):
        self.n_prompt, self.tokens = len(prompt), list(prompt)

    def extend(self, tokens):
        self.tokens.extend(tokens)

    def draft(self, n_max):
        n, wrong_at = self.script[len(self.calls) % len(self.script)]
        n = min(n, n_max)
        pos = len(self.tokens) - self.n_prompt
        d = (self.truth[pos:pos + n] + [0] * n)[:n]
        if wrong_at is not None and wrong_at < n:
            d[wrong_at] = (d[wrong_at] + 1) % VOCAB
        self.calls.append(d)
        return d


def prompts():
    """Prompts with repetition (a pattern repeated) and without (random tokens)."""
    tok = st.integers(0, VOCAB - 1)
    repeated = st.builds(lambda p, r, tail: (p * r + tail)[:40], st.lists(tok, min_size=1, max_size=5),
                         st.integers(2, 6), st.lists(tok, max_size=3))
    return st.one_of(st.lists(tok, min_size=1, max_size=20), repeated)


steps_script = st.lists(st.tuples(st.integers(0, 8), st.one_of(st.none(), st.integers(0, 7))),
                        min_size=1, max_size=6)


@settings(max_examples=60, deadline=None)
@given(arch=st.sampled_from(ARCHITECTURES), prompt=prompts(), script=steps_script,
       max_tokens=st.integers(1, 24), gdn_path=st.sampled_from(GDN_PATHS),
       prefill=st.sampled_from([3, 512]))
def test_scripted_drafts_equal_plain_greedy(arch, prompt, script, max_tokens, gdn_path, prefill):
    model = model_of(arch)
    plain, plain_lp = plain_greedy(model, prompt, max_tokens, prefill)
    drafter = ScriptedDrafter(plain, script)
    stats = SpecStats()
    out = list(ngram_speculative_generate_step(mx.array(prompt), model, max_tokens=max_tokens,
                                               draft_max=8, drafter=drafter, stats=stats,
                                               gdn_path=gdn_path, prefill_step_size=prefill))
    spec = [t for t, _, _ in out]
    tie = assert_greedy_equal(plain, plain_lp, spec)
    # the counters agree with what was yielded, and from_draft marks exactly the accepted drafts
    assert stats.n_tokens == len(spec) and sum(f for _, _, f in out) == stats.n_accept
    # every proposal (verified or a shadow one in plain mode) is counted, each step once
    assert stats.n_accept <= stats.n_drafted <= stats.n_proposed == sum(len(d) for d in drafter.calls)
    assert sum(stats.draft_lengths.values()) == stats.steps >= stats.plain_steps
    if tie is None:   # logprobs rows are the plain ones (same prefix, same model)
        for (_, lp, _), ref in zip(out, plain_lp):
            assert mx.allclose(lp, ref, atol=1e-4).item()


@settings(max_examples=20, deadline=None)
@given(arch=st.sampled_from(ARCHITECTURES), prompt=prompts(), draft_max=st.integers(1, 8))
def test_ngram_drafter_equal_plain_greedy(arch, prompt, draft_max):
    """The default n-gram drafter (reference or array-based) on prompts with and without repetition."""
    model = model_of(arch)
    plain, plain_lp = plain_greedy(model, prompt, 24)
    stats = SpecStats()
    spec = [t for t, _, _ in ngram_speculative_generate_step(mx.array(prompt), model, max_tokens=24,
                                                             draft_max=draft_max, stats=stats)]
    assert_greedy_equal(plain, plain_lp, spec)
    assert stats.steps <= stats.n_tokens == 24 and stats.n_accept <= stats.n_drafted <= stats.n_proposed


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_accepted_runs_save_forwards(arch):
    """With a perfect drafter, k drafts per step give k+1 tokens per forward (not just equality)."""
    model = model_of(arch)
    prompt = [1, 2, 3, 4, 5]
    plain, plain_lp = plain_greedy(model, prompt, 30)
    stats = SpecStats()
    spec = [t for t, _, _ in ngram_speculative_generate_step(
        mx.array(prompt), model, max_tokens=30, draft_max=4,
        drafter=ScriptedDrafter(plain, [(4, None)]), stats=stats)]
    assert assert_greedy_equal(plain, plain_lp, spec) is None
    # the first token's step drafts nothing (llama.cpp's rule), then 5 steps of 4 + 1, then 3 + 1 to reach 30
    assert stats.steps == 7 and stats.n_accept == stats.n_drafted == 23
    assert stats.tokens_per_forward == 30 / 7 and stats.draft_lengths == {0: 1, 4: 5, 3: 1}


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_auto_draft_length_equal_plain_greedy(arch):
    """draft_max=None (cost-aware policy) changes only speed, never tokens; its decisions are in stats."""
    model = model_of(arch)
    prompt = [7, 8, 9, 10] * 5
    plain, plain_lp = plain_greedy(model, prompt, 30)
    stats = SpecStats()
    spec = [t for t, _, _ in ngram_speculative_generate_step(mx.array(prompt), model, max_tokens=30,
                                                             draft_max=None, stats=stats)]
    assert_greedy_equal(plain, plain_lp, spec)
    assert sum(stats.policy["decisions"].values()) == stats.steps
    assert len(stats.policy["cost_rel"]) == len(stats.policy["accept"]) + 1


def test_prompt_cache_is_updated_in_place_and_reusable():
    """Like mlx-lm's generate_step: after the run the cache holds the prompt and every yielded token,
    so the next turn's tokens continue from it."""
    model = model_of("qwen3_5")
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    plain, plain_lp = plain_greedy(model, prompt, 12)
    cache = make_prompt_cache(model)
    spec = [t for t, _, _ in ngram_speculative_generate_step(
        mx.array(prompt), model, max_tokens=12, prompt_cache=cache, draft_max=3,
        drafter=ScriptedDrafter(plain, [(3, 1), (2, None)]))]
    assert_greedy_equal(plain, plain_lp, spec)
    assert cache[1].offset == len(prompt) + len(spec)
    # continue from the cache with a next turn: equals a fresh plain run over the whole history
    turn = [7, 7, 2]
    more, _ = plain_greedy(model, prompt + spec + turn, 1)
    nxt = next(generate_step(mx.array(turn), model, prompt_cache=cache, sampler=argmax_sampler))[0]
    assert int(nxt) == more[0]


def test_max_tokens_and_bad_arguments():
    model = model_of("llama")
    assert len(list(ngram_speculative_generate_step(mx.array([1, 2]), model, max_tokens=5, draft_max=8,
                                                    drafter=ScriptedDrafter([1] * 9, [(8, None)])))) == 5
    with pytest.raises(ValueError, match="at least one token"):
        next(ngram_speculative_generate_step(mx.array([], mx.uint32), model))
    with pytest.raises(ValueError, match="draft_max"):
        next(ngram_speculative_generate_step(mx.array([1]), model, draft_max=-1))


@pytest.mark.parametrize("bad", [VOCAB, 10**8, -1])
def test_prompt_ids_outside_the_vocabulary_are_refused(bad):
    """An id >= the embedding's rows reads past it (garbage; a segfault for 1e8): a ValueError naming it."""
    model = model_of("qwen3_5")
    assert vocab_size(model) == VOCAB
    with pytest.raises(ValueError, match=f"token id {bad} .*vocabulary of {VOCAB} tokens"):
        next(ngram_speculative_generate_step(mx.array([1, bad, 2]), model, draft_max=2))


def test_drafts_outside_the_vocabulary_are_cut():
    """A drafter of another vocabulary: drafts are cut before the first bad id (never run)."""
    model = model_of("llama")
    plain, plain_lp = plain_greedy(model, [1, 2], 10)

    class Foreign(ScriptedDrafter):
        def draft(self, n):
            return (list(super().draft(n))[:2] + [10**8, 3])[:n]

    stats = SpecStats()
    spec = [t for t, _, _ in ngram_speculative_generate_step(mx.array([1, 2]), model, max_tokens=10, draft_max=4,
                                                             drafter=Foreign(plain, [(4, None)]), stats=stats)]
    assert assert_greedy_equal(plain, plain_lp, spec) is None
    assert stats.n_drafted == stats.n_accept > 0


@pytest.mark.parametrize("arch", ["qwen3_5", "llama"])
def test_logits_processors_see_the_same_history_as_mlx_lm(arch):
    """A repetition penalty (depends on all earlier tokens) gives mlx-lm's tokens with drafts too."""
    from mlx_lm.sample_utils import make_logits_processors
    model = model_of(arch)
    prompt = [2, 3, 4, 2, 3, 4, 2, 3]
    procs = make_logits_processors(repetition_penalty=1.5, repetition_context_size=6)
    out = list(generate_step(mx.array(prompt), model, max_tokens=20, sampler=argmax_sampler,
                             logits_processors=procs))
    plain, plain_lp = [int(t) for t, _ in out], [lp for _, lp in out]
    spec = [t for t, _, _ in ngram_speculative_generate_step(
        mx.array(prompt), model, max_tokens=20, logits_processors=procs, draft_max=4,
        drafter=ScriptedDrafter(plain, [(4, None), (3, 1), (0, None)]))]
    assert assert_greedy_equal(plain, plain_lp, spec) is None


class CountingDrafter:
    """Records the lengths it is asked for; drafts token 1 repeated."""

    def __init__(self):
        self.asked = []

    def reset(self, prompt):
        pass

    def extend(self, tokens):
        pass

    def draft(self, n):
        self.asked.append(n)
        return [1] * n


@pytest.mark.parametrize("draft_max, stop_after", [(0, None), (0, 3), (None, 3)])
def test_draft_lengths_count_the_emitted_steps(draft_max, stop_after):
    """draft_max=0 asks the drafter for nothing (plain decoding); ``draft_lengths`` counts the steps whose
    tokens were emitted, also when the caller stops while the next plain step is already in flight."""
    model = model_of("llama")
    plain, plain_lp = plain_greedy(model, [1, 2, 3], 8)
    stats, drafter = SpecStats(), CountingDrafter()
    spec = []
    for t, _, _ in ngram_speculative_generate_step(mx.array([1, 2, 3]), model, max_tokens=8, draft_max=draft_max,
                                                   drafter=drafter, stats=stats):
        spec.append(int(t))
        if len(spec) == stop_after:
            break
    assert assert_greedy_equal(plain[:len(spec)], plain_lp, spec) is None
    assert sum(stats.draft_lengths.values()) == stats.steps
    assert sum(k * c for k, c in stats.draft_lengths.items()) == stats.n_drafted
    if draft_max == 0:
        assert drafter.asked == [] and stats.steps == len(spec) and stats.draft_lengths == {0: len(spec)}


def test_spec_stats_rates_by_hand():
    """``accept`` is accepted / verified drafts in percent (llama.cpp's), not per proposed draft (the cost-aware
    policy verifies only part of a proposal); ``tokens_per_forward`` is tokens per decode step."""
    stats = SpecStats(steps=4, n_forward=5, n_tokens=10, n_drafted=8, n_accept=6, n_proposed=20)
    assert stats.accept == 75.0 and stats.tokens_per_forward == 2.5
    d = stats.as_dict()
    assert (d["accept"], d["tokens_per_forward"], d["n_proposed"]) == (75.0, 2.5, 20)
    assert SpecStats(n_proposed=3).accept == 0.0 and SpecStats().tokens_per_forward == 0.0
