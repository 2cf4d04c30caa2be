"""BatchSpeculativeDecoder: rows added at different steps, one removed mid-way, each finished row's greedy
tokens are plain greedy decoding of its prompt alone (mlx-lm's generate_step); a divergence is allowed
only at a proven near-tie. Also the token budget, EOS, sampled rows and argument errors."""
from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler

from mlx_backend.batch.generate import BatchSpeculativeDecoder
from mlx_backend.decode.generate import ngram_speculative_generate_step
from mlx_backend.decode.rollback import RollbackUnsupported
from mlx_backend.decode.sampling import Sampler
from mlx_backend.models.compat import build
from mlx_backend.models.tiny import CONFIGS, tiny_model

NEAR_TIE = 1e-3   # top-2 log-probability gap under which two tokens count as tied in float32

PROMPTS = [
    [1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6, 1, 2, 3],   # repetitive: drafts get accepted
    [7],                                          # a one-token prompt (empty cache at merge)
    [9, 8, 7, 6, 9, 8, 7, 6, 9, 8, 7],
    [30, 31, 32, 33, 34, 35, 36, 37, 38],
]


@functools.cache
def model_of(arch: str):
    """A tiny model; architectures without a :mod:`~mlx_backend.models.tiny` config: the compatibility
    matrix's (lfm2: ShortConv layers, served batched since their windows are cut from a record; mamba,
    rwkv7, hybrids' mamba layers: since their decoder layers are re-run per row)."""
    return (tiny_model if arch in CONFIGS else build)(arch, seed=1)


@functools.cache
def plain_greedy(arch: str, prompt: tuple, max_tokens: int):
    """mlx-lm's plain greedy tokens and the log-probability rows they came from."""
    out = list(generate_step(mx.array(prompt), model_of(arch), max_tokens=max_tokens, sampler=make_sampler(0.0)))
    return [int(t) for t, _ in out], [lp for _, lp in out]


def assert_greedy_equal(arch, prompt, max_tokens, got, prefix=False):
    """``got`` == plain greedy (or a prefix of it), except for a divergence at a proven near-tie."""
    plain, logprobs = plain_greedy(arch, tuple(prompt), max_tokens)
    if prefix:
        plain = plain[:len(got)]
    assert len(got) == len(plain), (plain, got)
    for i, (a, b) in enumerate(zip(plain, got)):
        if a != b:
            top2 = mx.sort(logprobs[i])[-2:].tolist()
            gap = top2[1] - top2[0]
            assert gap < NEAR_TIE, f"token {i}: plain {a} != batch {b} with top-2 gap {gap:.3g}"
            assert logprobs[i][b].item() >= top2[0], f"token {i}: batch {b} is not among plain's top 2"
            return i
    return None


def run_schedule(dec, schedule, remove_at=None):
    """Drive ``dec``: ``schedule`` maps a step number to the rows to add then ((prompt, kwargs) pairs);
    ``remove_at`` = (step, index into the added rows). Returns (uids in add order, tokens per uid)."""
    uids, out, step = [], {}, 0
    while dec.rows or any(s >= step for s in schedule):
        for prompt, kwargs in schedule.get(step, []):
            uids.append(dec.add(prompt, **kwargs))
            out[uids[-1]] = []
        if remove_at is not None and step == remove_at[0]:
            dec.remove(uids[remove_at[1]])
        for uid, tokens in dec.step().items():
            out[uid] += tokens
        step += 1
    return uids, out


@pytest.mark.parametrize("arch", ["llama", "qwen3_5", "qwen3_next", "gemma3_text", "lfm2",
                                  # recurrent layers cut back by a per-row layer replay (before: refused;
                                  # mamba2's and nemotron_h's tiny outputs repeat too little to accept drafts here)
                                  "mamba", "rwkv7", "jamba", "granitemoehybrid"])
def test_rows_equal_plain_greedy(arch):
    model = model_of(arch)
    dec = BatchSpeculativeDecoder(model)
    n = [30, 20, 24, 16]
    schedule = {0: [(PROMPTS[0], dict(max_tokens=n[0], drafter="suffix")),
                    (PROMPTS[1], dict(max_tokens=n[1], drafter="lookup"))],
                2: [(PROMPTS[2], dict(max_tokens=n[2]))],                     # auto
                4: [(PROMPTS[3], dict(max_tokens=n[3], drafter="suffix", draft_max=3))]}
    uids, out = run_schedule(dec, schedule, remove_at=(5, 1))
    for i in (0, 2, 3):
        assert dec.finished[uids[i]] == "length"
        assert_greedy_equal(arch, PROMPTS[i], n[i], out[uids[i]])
    assert uids[1] not in dec.finished and 0 < len(out[uids[1]]) < n[1]
    assert_greedy_equal(arch, PROMPTS[1], n[1], out[uids[1]], prefix=True)
    assert dec.n_forward < sum(len(t) for t in out.values()) and dec.n_accept > 0   # shared forwards, accepted drafts
    assert dec.rows == [] and dec.cache is None
    dec.close()


class OracleDrafter:
    """Drafts plain greedy's own continuation ``truth``, made wrong at one position in every ``every``-th
    call (cycling through positions), so rows accept long and varied prefixes; past ``truth``: token 0."""

    def __init__(self, truth, every=3):
        self.truth, self.calls, self.every = list(truth), 0, every

    def reset(self, prompt):
        self.n_prompt, self.seen = len(prompt), list(prompt)

    def draft(self, k):
        at = len(self.seen) - self.n_prompt
        out = (self.truth[at:at + k] + [0] * k)[:k]
        self.calls += 1
        if out and self.calls % self.every == 0:
            i = (self.calls // self.every) % len(out)
            out[i] = (out[i] + 1) % 64
        return out

    def extend(self, tokens):
        self.seen.extend(tokens)


@pytest.mark.parametrize("arch", ["llama", "qwen3_5", "qwen3_next", "gemma3_text",
                                  "mamba", "mamba2", "rwkv7", "jamba", "nemotron_h", "granitemoehybrid"])
def test_rows_with_long_accepted_drafts_equal_plain_greedy(arch):
    """Drafters that know the answer (with planted errors): every row accepts long, different prefixes
    in the same forward, so every keep(m) cuts the rows at different places."""
    dec = BatchSpeculativeDecoder(model_of(arch))
    n = [30, 20, 24, 16]
    oracle = [OracleDrafter(plain_greedy(arch, tuple(p), k)[0]) for p, k in zip(PROMPTS, n)]
    schedule = {0: [(PROMPTS[0], dict(max_tokens=n[0], drafter=oracle[0], draft_max=7)),
                    (PROMPTS[1], dict(max_tokens=n[1], drafter=oracle[1], draft_max=5))],
                1: [(PROMPTS[2], dict(max_tokens=n[2], drafter=oracle[2], draft_max=3))],
                3: [(PROMPTS[3], dict(max_tokens=n[3], drafter=oracle[3], draft_max=6))]}
    uids, out = run_schedule(dec, schedule, remove_at=(4, 2))
    for i in (0, 1, 3):
        assert dec.finished[uids[i]] == "length"
        assert_greedy_equal(arch, PROMPTS[i], n[i], out[uids[i]])
    assert_greedy_equal(arch, PROMPTS[2], n[2], out[uids[2]], prefix=True)
    assert dec.n_accept > dec.n_drafted // 2 and dec.n_accept < dec.n_drafted


class LateDrafter(OracleDrafter):
    """Wrong (every token off by one) for its first ``wrong`` calls, then plain greedy's own continuation."""

    def __init__(self, truth, wrong):
        super().__init__(truth, every=10 ** 9)
        self.wrong = wrong

    def draft(self, k):
        out = super().draft(k)
        return [(t + 1) % 64 for t in out] if self.calls <= self.wrong else out


def held_tokens(cache) -> int:
    """How many tokens a per-request cache holds (its attention layers' offset)."""
    return next(int(c.offset) for c in cache if hasattr(c, "offset"))


@pytest.mark.parametrize("arch", ["llama", "qwen3_5", "gemma3_text"])
def test_plain_mode_pipelines_and_every_cache_holds_what_it_says(arch):
    """Cost-aware rows whose drafts are wrong at first: the batch decodes plainly with the next step in
    flight, rows join while it does, then drafts turn right and verify steps return. Every row equals plain
    greedy; at every step each row's cache holds exactly ``cached_tokens`` (one more while a plain step is in
    flight), and so does a finished row's kept cache."""
    dec = BatchSpeculativeDecoder(model_of(arch), keep_finished_caches=True)
    rows = [(PROMPTS[0], 30, 12), (PROMPTS[2], 24, 30), (PROMPTS[3], 20, 8), (PROMPTS[1], 6, 3)]
    schedule = {0: rows[:2], 5: rows[2:3], 9: rows[3:]}
    uids, out, step, kept = [], {}, 0, {}
    while dec.rows or any(s >= step for s in schedule):
        for prompt, n, wrong in schedule.get(step, []):
            truth = plain_greedy(arch, tuple(prompt), n)[0]
            uids.append(dec.add(prompt, max_tokens=n, drafter=LateDrafter(truth, wrong)))
            out[uids[-1]] = []
        for uid, tokens in dec.step().items():
            out[uid] += tokens
        for uid in dec.active:
            assert held_tokens(dec.extract(uid)) == len(dec.cached_tokens(uid)), (uid, step)
        kept.update(dec.finished_caches)
        step += 1
    assert dec.n_plain > 0 and dec.n_accept > 0
    for uid, (prompt, n, _) in zip(uids, [r for s in sorted(schedule) for r in schedule[s]]):
        assert_greedy_equal(arch, prompt, n, out[uid])
        cache, tokens = kept[uid]
        assert held_tokens(cache) == len(tokens) and tokens == list(prompt) + out[uid][:len(tokens) - len(prompt)]


def test_a_row_alone_after_the_batch_emptied():
    """Every row gone (the batch cache is dropped), then a new row starts a new batch."""
    model = model_of("llama")
    dec = BatchSpeculativeDecoder(model)
    _, out = run_schedule(dec, {0: [(PROMPTS[2], dict(max_tokens=5))]})
    uid = dec.add(PROMPTS[0], max_tokens=12, drafter="suffix")
    got = []
    while dec.rows:
        got += dec.step()[uid]
    assert_greedy_equal("llama", PROMPTS[0], 12, got)
    assert_greedy_equal("llama", PROMPTS[2], 5, next(iter(out.values())))


@pytest.mark.parametrize("arch", ["llama", "qwen3_5", "gemma3_text"])
def test_a_lone_row_decodes_on_its_own_caches(arch):
    """A row alone decodes on per-request caches (mlx-lm's KVCache, RotatingKVCache, ArraysCache, as the solo
    path does), merged into batch caches while a second row runs and extracted when it is alone again; its
    tokens across both changes equal plain greedy, and so do the other row's."""
    from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache, KVCache, RotatingKVCache
    batched, lone = (BatchKVCache, BatchRotatingKVCache), (KVCache, RotatingKVCache)
    dec = BatchSpeculativeDecoder(model_of(arch))

    def kinds():
        return {isinstance(c, batched) for c in dec.cache if isinstance(c, batched + lone)}

    first = dec.add(PROMPTS[0], max_tokens=30, drafter="suffix", draft_max=3)
    out = {first: []}
    seen = []
    for step in range(60):
        if step == 3:
            second = dec.add(PROMPTS[3], max_tokens=8, drafter="suffix", draft_max=2)
            out[second] = []
        if not dec.rows:
            break
        seen.append((len(dec.rows), kinds()))
        for uid, tokens in dec.step().items():
            out[uid] += tokens
    assert (1, {False}) in seen and (2, {True}) in seen                   # lone, then batched
    assert seen.index((2, {True})) < len(seen) - 1 - seen[::-1].index((1, {False}))   # ... then lone again
    assert all(n == 1 and k == {False} or n == 2 and k == {True} for n, k in seen), seen
    assert_greedy_equal(arch, PROMPTS[0], 30, out[first])
    assert_greedy_equal(arch, PROMPTS[3], 8, out[second])


def test_budget_caps_every_forward_and_keeps_greedy():
    model = model_of("qwen3_5")
    dec = BatchSpeculativeDecoder(model, max_batch_tokens=7)
    seen = []
    schedule = {0: [(PROMPTS[0], dict(max_tokens=24, drafter="suffix", draft_max=8)),
                    (PROMPTS[2], dict(max_tokens=24, drafter="suffix", draft_max=8)),
                    (PROMPTS[3], dict(max_tokens=12, drafter="suffix", draft_max=8))]}
    uids, out = [], {}
    for prompt, kwargs in schedule[0]:
        uids.append(dec.add(prompt, **kwargs))
        out[uids[-1]] = []
    verify = dec.verifier.forward

    def spy(tokens, lengths):
        seen.append(list(lengths))
        return verify(tokens, lengths)

    dec.verifier.forward = spy
    while dec.rows:
        for uid, tokens in dec.step().items():
            out[uid] += tokens
    # the forward's tokens, rows times width (padding included), within the budget; some drafts verified
    assert all(len(l) * max(l) <= max(7, len(l)) for l in seen) and max(max(l) for l in seen) > 1
    for uid, prompt, n in zip(uids, [PROMPTS[0], PROMPTS[2], PROMPTS[3]], [24, 24, 12]):
        assert_greedy_equal("qwen3_5", prompt, n, out[uid])


def test_eos_ends_a_row_with_the_eos_token():
    plain, _ = plain_greedy("llama", tuple(PROMPTS[0]), 30)
    eos = plain[9]
    first = plain.index(eos)
    dec = BatchSpeculativeDecoder(model_of("llama"), eos_token_ids=[eos])
    uids, out = run_schedule(dec, {0: [(PROMPTS[0], dict(max_tokens=30, drafter="suffix"))]})
    assert out[uids[0]] == plain[:first + 1] and dec.finished[uids[0]] == "stop"


def test_sampled_row_equals_the_solo_speculative_path():
    """A sampled row (exact speculative sampling, Sampler) among greedy rows draws the same random
    numbers as the solo path with the same drafter and draft length: the same tokens, seed for seed."""
    model = model_of("llama")
    sampler = Sampler(temp=1.0)
    for seed in (0, 1):
        mx.random.seed(seed)
        solo = [t for t, _, _ in ngram_speculative_generate_step(mx.array(PROMPTS[0]), model, max_tokens=20,
                                                                  sampler=sampler, draft_max=4, drafter="suffix")]
        mx.random.seed(seed)
        dec = BatchSpeculativeDecoder(model)
        schedule = {0: [(PROMPTS[2], dict(max_tokens=16, drafter="suffix")),
                        (PROMPTS[0], dict(max_tokens=20, drafter="suffix", draft_max=4, sampler=sampler))]}
        uids, out = run_schedule(dec, schedule)
        assert out[uids[1]] == solo
        assert_greedy_equal("llama", PROMPTS[2], 16, out[uids[0]])


def test_bad_arguments():
    dec = BatchSpeculativeDecoder(model_of("llama"))
    with pytest.raises(ValueError, match="vocabulary"):
        dec.add([1, 999], max_tokens=4)
    with pytest.raises(ValueError, match="max_tokens"):
        dec.add([1], max_tokens=0)
    with pytest.raises(ValueError, match="unknown drafter"):
        dec.add([1], max_tokens=3, drafter="nope")
    with pytest.raises(KeyError):
        dec.remove(12345)
    assert dec.step() == {}
    with pytest.raises(ValueError, match="max_batch_tokens"):
        BatchSpeculativeDecoder(model_of("llama"), max_batch_tokens=0)


def test_unsupported_model_is_refused_before_anything_changes():
    dec = BatchSpeculativeDecoder(tiny_model("llama4"))
    with pytest.raises(RollbackUnsupported, match="ChunkedKVCache"):
        dec.add([1, 2, 3], max_tokens=4)
    assert dec.rows == [] and dec.cache is None and dec.verifier is None


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2 ** 31 - 1))
def test_random_schedules_equal_plain_greedy(seed):
    """Random prompts, arrival steps, draft lengths (fixed, or the cost-aware width with its pipelined plain
    steps), planted draft errors, one random removal; the summed width, the burst width, or either at random
    from step to step (a server's queue filling and emptying)."""
    rng = np.random.default_rng(seed)
    arch = ["llama", "qwen3_5", "gemma3_text"][int(rng.integers(3))]
    burst = [None, lambda: True, lambda: bool(rng.random() < 0.5)][int(rng.integers(3))]
    dec = BatchSpeculativeDecoder(model_of(arch), max_batch_tokens=int(rng.integers(4, 20)), burst=burst)
    rows, schedule = [], {}
    for _ in range(int(rng.integers(2, 5))):
        prompt = tuple(rng.integers(0, 64, int(rng.integers(1, 10))).tolist())
        n = int(rng.integers(1, 14))
        truth = plain_greedy(arch, prompt, n)[0]
        kwargs = dict(max_tokens=n, drafter=OracleDrafter(truth, every=int(rng.integers(1, 4))),
                      draft_max=[None, *range(7)][int(rng.integers(8))])   # None: cost-aware, plain mode too
        rows.append((prompt, n))
        schedule.setdefault(int(rng.integers(0, 5)), []).append((list(prompt), kwargs))
    order = [r for step in sorted(schedule) for r in schedule[step]]   # add order
    removed = (int(rng.integers(0, 6)), int(rng.integers(len(order)))) if rng.random() < 0.5 else None
    if removed is not None and removed[0] < min(schedule):
        removed = None
    uids, out = run_schedule_checked(dec, schedule, removed)
    for uid, (prompt, kwargs) in zip(uids, order):
        n = kwargs["max_tokens"]
        assert_greedy_equal(arch, prompt, n, out[uid], prefix=uid not in dec.finished)


def run_schedule_checked(dec, schedule, removed):
    """run_schedule, skipping a removal of a row not yet added or already finished."""
    uids, out, step = [], {}, 0
    while dec.rows or any(s >= step for s in schedule):
        for prompt, kwargs in schedule.get(step, []):
            uids.append(dec.add(prompt, **kwargs))
            out[uids[-1]] = []
        if removed is not None and step == removed[0] and removed[1] < len(uids) and uids[removed[1]] in dec.active:
            dec.remove(uids[removed[1]])
        for uid, tokens in dec.step().items():
            out[uid] += tokens
        step += 1
    return uids, out


def test_an_eos_inside_an_accepted_run_ends_the_row_there():
    """A drafter that knows the answer: a row's second step accepts six drafts at once, and the EOS is the
    one of the first ones; the row ends at that EOS ("stop"), the accepted tokens after it dropped, exactly as plain
    greedy decoding stops there. A second row shares the forward and the EOS rule."""
    arch, n = "qwen3_5", 20
    truth = plain_greedy(arch, tuple(PROMPTS[0]), n)[0]
    j = next(j for j in range(2, 7) if truth[j] not in truth[:j])   # a new token among step 2's drafts
    eos = truth[j]
    dec = BatchSpeculativeDecoder(model_of(arch), eos_token_ids=[eos])
    other = plain_greedy(arch, tuple(PROMPTS[2]), n)[0]
    schedule = {0: [(PROMPTS[0], dict(max_tokens=n, drafter=OracleDrafter(truth, every=10 ** 9), draft_max=6)),
                    (PROMPTS[2], dict(max_tokens=n, drafter=OracleDrafter(other, every=10 ** 9), draft_max=6))]}
    uids, out = run_schedule(dec, schedule)
    assert out[uids[0]] == truth[:j + 1] and dec.finished[uids[0]] == "stop"
    want = other[:other.index(eos) + 1] if eos in other else other
    assert out[uids[1]] == want and dec.finished[uids[1]] == ("stop" if eos in other else "length")


def test_each_rows_counts_are_the_drafts_its_forwards_verified(monkeypatch):
    """A row's ``n_drafted`` is the drafts its verify forwards held (not the proposals: the token budget cuts
    them to the step's width) and its ``n_accept`` the tokens it emitted beyond one per forward; the
    decoder's totals are the rows' sums. Both are read here off the forwards themselves (a spy on the
    verifiers' ``forward``: the row order and the real lengths)."""
    from mlx_backend.batch import generate as batch_generate

    dec = BatchSpeculativeDecoder(model_of("qwen3_5"), max_batch_tokens=7)
    verified, forwards = {}, {}

    def spying(cls):
        original = cls.forward

        def forward(self, tokens, lengths):
            for r, n in zip(dec.rows, lengths):
                verified[r.uid] = verified.get(r.uid, 0) + int(n) - 1
                forwards[r.uid] = forwards.get(r.uid, 0) + 1
            return original(self, tokens, lengths)
        monkeypatch.setattr(cls, "forward", forward)

    spying(batch_generate.BatchVerifyCache)
    spying(batch_generate._LoneRow)
    specs = [(PROMPTS[0], 24), (PROMPTS[2], 24), (PROMPTS[3], 12)]
    rows = []
    for prompt, n in specs:
        dec.add(prompt, max_tokens=n, drafter="suffix", draft_max=8)
        rows.append(dec.rows[-1])
    out = {r.uid: [] for r in rows}
    while dec.rows:
        for uid, tokens in dec.step().items():
            out[uid] += tokens
    assert dec.n_plain == 0 and sum(verified.values()) > 0
    for r, (prompt, n) in zip(rows, specs):
        assert len(out[r.uid]) == n
        assert r.n_drafted == verified[r.uid], r.uid
        assert r.n_accept == n - forwards[r.uid], r.uid
    assert dec.n_drafted == sum(verified.values()) and dec.n_accept == sum(r.n_accept for r in rows)
