"""reference.suffix.replay: recorded requests replayed as the generation loop runs them."""
from __future__ import annotations

import math
import re
import random

import numpy as np
import pytest

from reference.ngram.drafter import NgramDrafter
from reference.speculative import speculative_generate
from reference.suffix.drafter import SuffixDrafter, SuffixHistory
from reference.suffix.replay import replay_request, replay_requests


class Oracle:
    """Drafts the true continuation (it knows the whole sequence): every draft is accepted."""

    def __init__(self, full):
        self.full, self.n, self.calls = list(full), 0, []

    def reset(self, prompt):
        self.n = len(prompt)

    def extend(self, tokens):
        self.n += len(list(tokens))

    def draft(self, k):
        self.calls.append(k)
        return self.full[self.n:self.n + k]


class Silent:
    """Never drafts; records what it is told."""

    def __init__(self):
        self.seen, self.calls = [], []

    def reset(self, prompt):
        self.seen = []

    def extend(self, tokens):
        self.seen += list(tokens)

    def draft(self, k):
        self.calls.append(k)
        return []


@pytest.mark.parametrize("n_out", [1, 2, 3, 9, 10, 17, 64])
@pytest.mark.parametrize("k", [1, 2, 3, 8])
def test_an_always_right_drafter_needs_one_step_plus_one_per_k_plus_1_tokens(n_out, k):
    prompt, output = [5, 6], list(range(100, 100 + n_out))
    oracle = Oracle(prompt + output)
    r = replay_request(prompt, output, oracle, k)
    # the first step emits one token (k = 0), each later one k + 1 (fewer at the end: it never overshoots)
    assert r.verify_steps == 1 + math.ceil((n_out - 1) / (k + 1))
    assert r.accepted == r.drafted == n_out - r.verify_steps
    assert 0 not in oracle.calls  # k = 0 steps do not ask the drafter
    assert all(c <= k for c in oracle.calls)


@pytest.mark.parametrize("k", [0, 1, 16])
def test_without_drafts_every_token_is_a_step_and_the_drafter_learns_the_output_in_order(k):
    output = [3, 1, 4, 1, 5, 9, 2, 6]
    d = Silent()
    r = replay_request([2, 7], output, d, k)
    assert (r.verify_steps, r.drafted, r.accepted, r.output_tokens) == (len(output), 0, 0, len(output))
    assert d.seen == output
    # k = min(draft_max, tokens left - 1): 0 at the first step, then down to 0 at the last
    expected = [min(k, len(output) - i - 1) for i in range(1, len(output))]
    assert d.calls == [c for c in expected if c]


def test_a_hand_computed_suffix_replay():
    # T = 1 2 3 4 | 1 (k = 0) | "1" occurred at the start, L = 1, factor 2: draft "2 3" (k = 3), both
    # right, + 4 | 5 (k = 0: one token left): 3 steps, 2 drafted, 2 accepted
    r = replay_requests([([1, 2, 3, 4], [1, 2, 3, 4, 5])], lambda h: SuffixDrafter(h, factor=2.0), 8)
    assert (r.verify_steps, r.drafted, r.accepted, r.output_tokens) == (3, 2, 2, 5)
    assert r.tokens_per_step == 5 / 3
    # the default factor 4: draft "2 3 4" (k = 3 = min(8, 5 - 1 - 1), 4 * L = 4), all right, + 5: 2 steps
    r = replay_requests([([1, 2, 3, 4], [1, 2, 3, 4, 5])], SuffixDrafter, 8)
    assert (r.verify_steps, r.drafted, r.accepted, r.output_tokens) == (2, 3, 3, 5)


def test_the_history_holds_earlier_requests_prompt_and_output():
    reqs = [([7], [1, 2, 3]), ([1], [2, 3, 9])]
    # request 2 with the history: T = 1 2 after its first step; "1 2" ends at 3 in 7 1 2 3 (L = 2),
    # draft "3" (k = 1: two tokens left), accepted, + 9: 2 steps. Alone: "2" never seen, 3 steps.
    alone = replay_requests(reqs, SuffixDrafter, 8)
    shared = replay_requests(reqs, SuffixDrafter, 8, history=SuffixHistory())
    assert [r.verify_steps for r in alone.per_request] == [3, 3]
    assert [r.verify_steps for r in shared.per_request] == [3, 2]
    assert shared.per_request[1].accepted == 1


def test_the_history_is_filled_in_file_order_after_each_request():
    history, seen = SuffixHistory(), []

    def make(h):
        seen.append([list(s) for s in h.sequences])
        return Silent()

    reqs = [([1], [2]), ([3, 4], [5, 6]), ([7], [8])]
    replay_requests(reqs, make, 4, history=history)
    assert seen == [[], [[1, 2]], [[1, 2], [3, 4, 5, 6]]]
    assert history.sequences == [[1, 2], [3, 4, 5, 6], [7, 8]]


def test_totals_are_the_sums_of_the_requests():
    rng = random.Random(1)
    reqs = [([rng.randrange(4) for _ in range(rng.randrange(1, 30))],
             [rng.randrange(4) for _ in range(rng.randrange(1, 60))]) for _ in range(12)]
    r = replay_requests(reqs, lambda h: SuffixDrafter(h), 5, history=SuffixHistory())
    for key in ("output_tokens", "verify_steps", "drafted", "accepted", "draft_seconds"):
        assert getattr(r, key) == pytest.approx(sum(getattr(p, key) for p in r.per_request))
    assert r.requests == 12 and r.output_tokens == sum(len(o) for _, o in reqs)
    assert r.output_tokens == r.verify_steps + r.accepted  # every step emits its accepted drafts and one token


def test_drafts_are_cut_to_k_and_before_an_id_outside_the_vocabulary():
    class Greedy(Oracle):
        def draft(self, k):  # too many tokens, the 3rd one out of the vocabulary
            d = self.full[self.n:self.n + k + 5]
            return d[:2] + [10**6] + d[3:] if len(d) > 2 else d

    output = list(range(20))
    r = replay_request([0], output, Greedy([0] + output), 4, vocab_size=100)
    assert r.drafted <= 2 * r.verify_steps and r.accepted == r.drafted
    r = replay_request([0], output, Oracle([0] + output + [1] * 10), 4)  # a drafter past the end: cut to k
    assert r.verify_steps == 1 + math.ceil(19 / 5)


@pytest.mark.parametrize("bad", [([], [1]), ([1], [])])
def test_empty_prompts_and_outputs_are_refused_with_the_request_number(bad):
    with pytest.raises(ValueError, match="request 2: the (prompt|output) is empty"):
        replay_requests([([1], [2]), bad], lambda h: Silent(), 4)


def test_progress_counts_output_tokens():
    calls = []
    replay_requests([([1], [2, 3]), ([4], [5, 6, 7])], lambda h: Silent(), 4, progress=lambda d, t: calls.append((d, t)))
    assert calls[-1] == (5, 5) and [d for d, _ in calls] == sorted(d for d, _ in calls)


class TableModel:
    """A model whose greedy token after any prefix of ``seq`` is ``seq``'s next token (0 after a
    wrong token: rows past a rejected draft are never read)."""

    def __init__(self, seq, vocab_size):
        self.seq, self.vocab_size = list(seq), vocab_size

    def make_cache(self):
        class Cache:
            n = start = 0  # positions held; where the last forward began

            def keep(self, m):
                self.n = self.start + m

        return Cache()

    def forward(self, tokens, cache):
        cache.start = cache.n
        logits = np.zeros((len(tokens), self.vocab_size), np.float32)
        ok = True
        for i, t in enumerate(tokens):
            ok = ok and self.seq[cache.n + i] == t
            logits[i, self.seq[cache.n + i + 1] if ok else 0] = 1.0
        cache.n += len(tokens)
        return logits


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("which", ["suffix", "lookup"])
def test_the_replay_counts_what_speculative_generate_counts(seed, which):
    """The replay is the generation loop with the output standing in for the model."""
    rng = random.Random(seed)
    V = 6
    prompt = [rng.randrange(V) for _ in range(rng.randrange(1, 40))]
    output = [rng.randrange(V) for _ in range(rng.randrange(1, 80))]
    make = (lambda: SuffixDrafter()) if which == "suffix" else (lambda: NgramDrafter())
    for k in (1, 3, 16):
        model = TableModel(prompt + output + [0], V)
        tokens, stats = speculative_generate(model, prompt, len(output), make(), k)
        assert tokens == output
        r = replay_request(prompt, output, make(), k, vocab_size=V)
        assert (r.verify_steps, r.drafted, r.accepted) == (stats.steps, stats.n_drafted, stats.n_accept)


@pytest.mark.parametrize("prompt, output, message", [
    ([1, 2], [3, 4, -5], "the output: invalid token id -5 at index 2"),
    ([1, 2], [3, 4, 2.5], "the output: token id 2.5 at index 2 is not an integer"),
    ([1.5, 2], [3], "the prompt: token id 1.5 at index 0 is not an integer")])
def test_a_bad_id_is_named_by_its_sequence_and_index(prompt, output, message):
    """Before: the ids went to the drafter a step at a time, so a bad output id was reported at its index in
    the step ("index 0"), a float was truncated, and a drafter that checks nothing never caught either."""
    class Trusting:   # checks nothing: the replay must
        def reset(self, tokens): pass
        def extend(self, tokens): pass
        def draft(self, k): return []

    for drafter in (SuffixDrafter(), Trusting()):
        with pytest.raises(ValueError, match=re.escape(message)):
            replay_request(prompt, output, drafter, 4)
