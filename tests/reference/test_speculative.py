"""The speculative greedy loop: same tokens as plain greedy whatever the drafts, exact counts."""
from __future__ import annotations

import math
import tempfile
from functools import lru_cache

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from reference.models import load_model
from reference.speculative import SpecStats, greedy_generate, speculative_generate
from reference.models.tiny import ARCHS, VOCAB_SIZE, write_tiny_model

SETTINGS = settings(max_examples=100, deadline=None)


@lru_cache(maxsize=None)
def tiny(arch: str, seed: int):
    return load_model(write_tiny_model(tempfile.mkdtemp(), arch, seed=seed))


class ForcedDrafter:
    """Drafts by schedule from the known greedy continuation: step i drafts ``right`` correct tokens then
    ``wrong`` wrong ones (``(right, wrong)`` = ``schedule[i % len]``; (0, 0) is an empty draft).

    It also checks that the loop keeps it informed: its tokens must always be prompt + the true output."""

    def __init__(self, continuation: list[int], schedule: list[tuple[int, int]]):
        self.continuation, self.schedule = continuation, schedule

    def reset(self, prompt):
        self.prompt, self.tokens, self.step = list(prompt), list(prompt), 0

    def extend(self, tokens):
        self.tokens += list(tokens)
        n = len(self.tokens) - len(self.prompt)
        assert self.tokens == self.prompt + self.continuation[:n], "the loop fed the drafter other tokens"

    def draft(self, n_draft):
        right, wrong = self.schedule[self.step % len(self.schedule)]
        self.step += 1
        pos = len(self.tokens) - len(self.prompt)
        truth = self.continuation[pos:]
        drafts = truth[:right]
        for j in range(len(drafts), len(drafts) + wrong):
            true_token = truth[j] if j < len(truth) else 0
            drafts.append((true_token + 1) % VOCAB_SIZE)
        return drafts[:n_draft]


def recomputed_greedy(model, prompt, n):
    """Greedy from scratch: each token is the argmax after a fresh forward over everything before it."""
    out = []
    for _ in range(n):
        out.append(int(np.argmax(model.forward(prompt + out, model.make_cache())[-1])))
    return out


def check_stats(prompt, tokens, stats: SpecStats, eos=()):
    assert stats.n_forward == stats.steps + (len(prompt) > 1)  # one prefill forward, then the steps
    assert 0 <= stats.n_accept <= stats.n_drafted
    # every step yields its accepted drafts and one token of the model's own, all counted; only an EOS
    # inside the last step's accepted run leaves tokens unemitted (max_tokens never cuts a step)
    if tokens[-1] in set(eos):
        assert len(tokens) <= stats.n_accept + stats.steps
    else:
        assert len(tokens) == stats.n_accept + stats.steps
    assert stats.tokens_per_forward == pytest.approx(len(tokens) / stats.steps)


prompts = st.one_of(
    st.lists(st.integers(0, 255), min_size=1, max_size=16),  # no particular structure
    st.builds(lambda pattern, r: pattern * r, st.lists(st.integers(0, 255), min_size=1, max_size=5),
              st.integers(2, 5)),  # repetitive
)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_generate_is_argmax_of_full_recomputation(arch):
    model = tiny(arch, 1)
    prompt = list(b"abc abd abc")
    assert greedy_generate(model, prompt, 12) == recomputed_greedy(model, prompt, 12)


@SETTINGS
@example(arch="qwen3_next", seed=0, prompt=[5, 6, 5, 6], draft_max=8, max_tokens=24,
         schedule=[(0, 0), (5, 0), (0, 0), (2, 2), (0, 3)])  # empty drafts between accepted and rejected ones
@given(arch=st.sampled_from(ARCHS), seed=st.integers(0, 1), prompt=prompts, draft_max=st.integers(1, 8),
       max_tokens=st.integers(1, 24),
       schedule=st.lists(st.tuples(st.integers(0, 9), st.integers(0, 3)), min_size=1, max_size=5))
def test_speculative_equals_greedy_under_forced_drafts(arch, seed, prompt, draft_max, max_tokens, schedule):
    model = tiny(arch, seed)
    greedy = greedy_generate(model, prompt, max_tokens)
    tokens, stats = speculative_generate(model, prompt, max_tokens, ForcedDrafter(greedy, schedule), draft_max)
    assert tokens == greedy
    check_stats(prompt, tokens, stats)


@SETTINGS
@given(arch=st.sampled_from(ARCHS), prompt=prompts, draft_max=st.integers(1, 8), max_tokens=st.integers(1, 24))
def test_speculative_equals_greedy_with_the_ngram_drafter(arch, prompt, draft_max, max_tokens):
    from reference.ngram.drafter import NgramDrafter

    model = tiny(arch, 1)
    tokens, stats = speculative_generate(model, prompt, max_tokens, NgramDrafter(), draft_max)
    assert tokens == greedy_generate(model, prompt, max_tokens)
    check_stats(prompt, tokens, stats)



def test_draft_max_0_is_plain_decoding_with_the_ngram_drafter():
    """draft_max = 0 (allowed, ``k may be 0``) never asks the drafter for drafts: one token per forward."""
    from reference.ngram.drafter import NgramDrafter

    model = tiny("llama", 1)
    prompt = [5, 6, 5, 6, 5, 6]
    tokens, stats = speculative_generate(model, prompt, 8, NgramDrafter(), 0)
    assert tokens == greedy_generate(model, prompt, 8)
    assert stats.n_drafted == 0 and stats.steps == len(tokens) == stats.n_forward - 1

def test_ngram_drafts_get_accepted_on_a_model_that_repeats():
    from reference.ngram.drafter import NgramDrafter

    model = tiny("llama", 1)  # greedy falls into loops: prompt lookup pays off
    prompt = list(b"the cat sat on the mat. the cat sat on the mat. the cat")
    tokens, stats = speculative_generate(model, prompt, 40, NgramDrafter(), 8)
    assert tokens == greedy_generate(model, prompt, 40)
    assert stats.n_accept > 10 and stats.n_forward < 40


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("k", [1, 3, 8])
def test_all_drafts_right_emits_k_plus_one_tokens_per_step(arch, k):
    """The bonus token is not off by one: k right drafts give k + 1 tokens for one forward."""
    model = tiny(arch, 0)
    prompt, n = list(b"hello"), 20
    greedy = greedy_generate(model, prompt, n)
    tokens, stats = speculative_generate(model, prompt, n, ForcedDrafter(greedy, [(99, 0)]), k)
    assert tokens == greedy
    # the first step (the prompt's last token) drafts nothing; the last drafts only what fits in n
    assert stats.steps == 1 + math.ceil((n - 1) / (k + 1))
    assert stats.n_accept == stats.n_drafted == n - stats.steps


def test_on_tokens_reports_every_token_once_in_order():
    model = tiny("llama", 1)
    prompt = list(b"the cat sat on the mat. the cat")
    seen_spec, seen_greedy = [], []
    tokens, _ = speculative_generate(model, prompt, 30, ForcedDrafter(greedy_generate(model, prompt, 30), [(3, 1)]),
                                     4, on_tokens=seen_spec.append)
    assert greedy_generate(model, prompt, 30, on_tokens=seen_greedy.append) == tokens
    assert sum(seen_spec, []) == tokens == sum(seen_greedy, [])
    assert max(map(len, seen_spec)) == 4  # three accepted drafts and the bonus token arrive together


@pytest.mark.parametrize("arch", ARCHS)
def test_all_drafts_wrong_costs_one_forward_per_token(arch):
    model = tiny(arch, 0)
    prompt, n = list(b"hello"), 12
    greedy = greedy_generate(model, prompt, n)
    tokens, stats = speculative_generate(model, prompt, n, ForcedDrafter(greedy, [(0, 4)]), 4)
    assert tokens == greedy
    assert stats.steps == n and stats.n_accept == 0 and stats.n_drafted > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_eos_inside_an_accepted_run_stops_there(arch):
    model = tiny(arch, 0)
    prompt = list(b"hello")
    greedy = greedy_generate(model, prompt, 30)
    j = next(i for i in range(3, 30) if greedy[i] not in greedy[:i])  # first occurrence, inside a long draft
    eos = {greedy[j]}
    assert greedy_generate(model, prompt, 30, eos=eos) == greedy[:j + 1]
    drafter = ForcedDrafter(greedy, [(99, 0)])
    tokens, stats = speculative_generate(model, prompt, 30, drafter, 8, eos=eos)
    assert tokens == greedy[:j + 1]
    check_stats(prompt, tokens, stats, eos)
    # the drafter learned the whole last step (1 token, then 9 per step), past the EOS as llama.cpp does
    learned = len(drafter.tokens) - len(prompt)
    assert learned >= len(tokens) and (learned - 1) % 9 == 0


def test_drafts_outside_the_vocabulary_are_cut_not_run():
    """A drafter with ids of another vocabulary (a foreign static cache): the step verifies only the drafts
    before the first bad id, whose followers could never be accepted; the reference model refuses bad ids."""
    model = tiny("llama", 0)
    greedy = greedy_generate(model, [1, 2], 9)

    class Foreign(ForcedDrafter):
        def draft(self, n_draft):
            return (super().draft(n_draft)[:2] + [VOCAB_SIZE + 5, 3])[:n_draft]

    tokens, stats = speculative_generate(model, [1, 2], 9, Foreign(greedy, [(99, 0)]), 4)
    assert tokens == greedy and stats.n_drafted == stats.n_accept > 0


def test_max_tokens_inside_an_accepted_run_stops_there():
    model = tiny("qwen3_5", 0)
    greedy = greedy_generate(model, [1, 2, 3], 5)
    drafter = ForcedDrafter(greedy_generate(model, [1, 2, 3], 30), [(99, 0)])
    tokens, stats = speculative_generate(model, [1, 2, 3], 5, drafter, 8)
    assert tokens == greedy and len(tokens) == 5
    # the first step drafts nothing, the second 3: with the model's own token they fill the 4 still wanted
    assert stats.steps == 2 and stats.n_drafted == stats.n_accept == 3


def test_eos_as_the_first_token_and_bad_arguments():
    model = tiny("llama", 0)
    first = greedy_generate(model, [7, 8], 1)
    tokens, stats = speculative_generate(model, [7, 8], 10, ForcedDrafter(first, [(1, 1)]), 4, eos=first)
    assert tokens == first and stats.steps == 1 and stats.n_forward == 2 and stats.n_drafted == 0
    with pytest.raises(ValueError, match="prompt is empty"):
        greedy_generate(model, [], 5)
    with pytest.raises(ValueError, match="max_tokens must be at least 1"):
        speculative_generate(model, [1], 0, ForcedDrafter([], [(0, 0)]), 4)
    for draft_max in (-1, None, 2.5):   # None: before, a comparison TypeError from inside
        with pytest.raises(ValueError, match="draft_max must be a whole number >= 0"):
            speculative_generate(model, [1], 3, ForcedDrafter([], [(0, 0)]), draft_max)


@pytest.mark.parametrize("generate", ["greedy", "speculative"])
def test_arguments_that_are_not_token_ids_or_counts_are_refused_not_truncated(generate):
    """A float prompt id used to be truncated (1.7 ran as 1), a fractional max_tokens to round up in greedy
    (3.5 gave 4 tokens) and to fail deep inside the speculative loop, and ``eos=<one id>`` to fail with
    "'int' object is not iterable"."""
    from reference.ngram.drafter import NgramDrafter

    model = tiny("llama", 0)

    def run(prompt=(7, 8), max_tokens=3, eos=()):
        if generate == "greedy":
            return greedy_generate(model, prompt, max_tokens, eos=eos)
        return speculative_generate(model, prompt, max_tokens, NgramDrafter(), 4, eos=eos)[0]

    with pytest.raises(ValueError, match=r"the prompt must be token ids \(integers\): item 0 is 1.7"):
        run(prompt=[1.7, 2])
    with pytest.raises(ValueError, match="the prompt must be token ids .*item 0 is 'a'"):
        run(prompt="ab")
    for max_tokens in (3.5, True, None):
        with pytest.raises(ValueError, match=r"max_tokens must be at least 1 \(a whole number\)"):
            run(max_tokens=max_tokens)
    with pytest.raises(ValueError, match=r"eos must be a collection of token ids, e.g. eos=\[256\]"):
        run(eos=256)
    assert run(prompt=np.array([7, 8]), max_tokens=np.int64(3), eos=np.array([], int)) == run()   # NumPy ints are fine


@pytest.mark.parametrize("bad", [VOCAB_SIZE, -1])
def test_the_first_id_outside_the_vocabulary_is_cut_at_the_boundary(bad):
    """The ids a model of V tokens takes are 0..V-1: a draft of exactly V (or -1) is cut with everything
    after it, never run; the drafts before it are verified and accepted."""
    model = tiny("llama", 0)
    greedy = greedy_generate(model, [1, 2], 9)

    class Foreign(ForcedDrafter):
        def draft(self, n_draft):
            return (super().draft(n_draft)[:2] + [bad, 3])[:n_draft]

    tokens, stats = speculative_generate(model, [1, 2], 9, Foreign(greedy, [(99, 0)]), 4)
    assert tokens == greedy and stats.n_drafted == stats.n_accept > 0
    assert stats.n_drafted <= 2 * (stats.steps - 1)   # at most the 2 good drafts of each step after the first
