"""SpeculativeBatchGenerator: mlx-lm's BatchGenerator interface (as mlx-lm's server loop uses it) over the
batched speculative decoder. One generation response per token (several per step for a row that accepts
drafts), the finish reason on the last only; greedy tokens are plain greedy decoding's (mlx-lm's
generate_step, a near-tie excepted); a stop sequence ends a row inside a step; a prompt cache given with
its tokens is continued; segment ends are reported and their caches extracted; the finishing row's cache
holds exactly ``all_tokens``; a removed row reports itself not completed."""
from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import StopSequences
from mlx_lm.models.cache import make_prompt_cache

from mlx_backend.batch.server_batch import RowPlan, SpeculativeBatchGenerator, batch_unsupported
from mlx_backend.decode.generate import vocab_size
from test_batch_decoder import PROMPTS, OracleDrafter, assert_greedy_equal, model_of, plain_greedy


def drive(gen, reports, limit=500):
    """``next()`` until every inserted sequence has reported; (generation responses per uid, prompt responses,
    the most responses one uid got from one ``next()``)."""
    tokens, prompts, most = {}, [], 0
    for _ in range(limit):
        if not gen._live:
            return tokens, prompts, most
        prompt_responses, responses = gen.next()
        prompts += prompt_responses
        per_uid = {}
        for r in responses:
            tokens.setdefault(r.uid, []).append(r)
            per_uid[r.uid] = per_uid.get(r.uid, 0) + 1
        most = max([most, *per_uid.values()])
    raise AssertionError("the generator did not finish")


def planned(reports, drafter=None, draft_max=0):
    return lambda cached, prompt: RowPlan(drafter, draft_max, reports.append)


@pytest.mark.parametrize("arch", ["llama", "qwen3_5"])
def test_one_response_per_token_greedy_and_the_finishing_cache(arch):
    model = model_of(arch)
    n = [24, 16]
    oracle = OracleDrafter(plain_greedy(arch, tuple(PROMPTS[0]), n[0])[0])
    reports, plans = [], iter([RowPlan(oracle, 6, None), RowPlan(None, 0, None)])

    def plan(cached, prompt):
        p = next(plans)
        return RowPlan(p.drafter, p.draft_max, reports.append)

    gen = SpeculativeBatchGenerator(model, plan=plan, prefill_step_size=4)
    uids = gen.insert_segments([[PROMPTS[0]], [PROMPTS[2][:5], PROMPTS[2][5:]]], max_tokens=n)
    out, prompts, most = drive(gen, reports)
    assert most > 1                                        # a step emitted several tokens of one row
    for uid, prompt, k in zip(uids, (PROMPTS[0], PROMPTS[2]), n):
        responses = out[uid]
        assert [r.finish_reason for r in responses] == [None] * (k - 1) + ["length"]
        assert_greedy_equal(arch, prompt, k, [r.token for r in responses])
        last = responses[-1]
        held = next(c.offset for c in last.prompt_cache if hasattr(c, "offset"))
        assert held == len(last.all_tokens) and last.all_tokens[:len(prompt) + k - 1] == prompt + [
            r.token for r in responses[:-1]]
        assert all(r.logprobs.shape == (vocab_size(model),) for r in responses)
    # the second prompt's two segments (the last token split off, as mlx-lm does): ends after 5 and 10 of 11
    ends = [(p.progress, p.end_of_segment, p.end_of_prompt) for p in prompts if p.uid == uids[1] and p.end_of_segment]
    assert ends == [((5, 11), True, False), ((10, 11), True, False), ((11, 11), True, True)]
    assert [r.completed for r in reports] == [True, True] and sorted(r.uid for r in reports) == uids
    assert reports[[r.uid for r in reports].index(uids[0])].n_accept > 0


def test_a_stop_sequence_ends_the_row_inside_a_step():
    arch, k = "qwen3_5", 20   # its answer does not repeat itself: a stop pair first completes late
    truth = plain_greedy(arch, tuple(PROMPTS[0]), k)[0]
    def first(pair):   # where the two-token stop sequence ``pair`` first completes
        return next(i for i in range(1, k) if truth[i - 1:i + 1] == pair)

    at = next(i for i in range(6, k) if first(truth[i - 1:i + 1]) == i)   # late enough to fall inside a step
    stop = truth[at - 1:at + 1]
    reports = []
    gen = SpeculativeBatchGenerator(model_of(arch), plan=planned(reports, OracleDrafter(truth, every=100), 8))
    (uid,) = gen.insert([PROMPTS[0]], max_tokens=[k], stop_sequences=[StopSequences([stop])])
    out, _, most = drive(gen, reports)
    tokens = [r.token for r in out[uid]]
    assert tokens == truth[:at + 1] and out[uid][-1].finish_reason == "stop" and most > 1
    assert reports[0].output == tokens and reports[0].completed


def test_a_given_prompt_cache_is_continued_and_a_removed_row_is_not_completed():
    arch, k = "qwen3_5", 12
    model = model_of(arch)
    prompt = PROMPTS[2]
    cache = make_prompt_cache(model)
    model(mx.array(prompt[:6])[None], cache=cache)          # the LRU's cache of the first 6 tokens
    reports = []
    gen = SpeculativeBatchGenerator(model, plan=planned(reports))
    kept, dropped = gen.insert([prompt[6:], PROMPTS[3]], max_tokens=[k, 40], caches=[cache, None],
                               all_tokens=[prompt[:6], []])
    early = []
    for _ in range(6):
        early += [r for r in gen.next()[1] if r.uid == kept]
    caches = gen.extract_cache([kept, dropped, 12345])
    assert sorted(caches) == sorted([kept, dropped])
    for cache, tokens in caches.values():                    # copies holding exactly the tokens named
        assert next(c.offset for c in cache if hasattr(c, "offset")) == len(tokens)
    assert caches[kept][1][:len(prompt) - 1] == prompt[:-1]
    gen.remove([dropped, 12345])                              # an unknown uid is ignored, as mlx-lm's
    out, _, _ = drive(gen, reports)
    assert_greedy_equal(arch, prompt, k, [r.token for r in early + out[kept]])
    assert {r.uid: r.completed for r in reports} == {dropped: False, kept: True}


def test_the_tiny_models_caches_are_batchable():
    for arch in ("llama", "qwen3_5", "gemma3_text", "mamba", "mamba2", "rwkv7", "nemotron_h"):
        assert batch_unsupported(model_of(arch)) is None, arch
    assert "CacheList" in batch_unsupported(model_of("falcon_h1"))   # its mamba layer holds a KV cache too


def test_the_burst_rule_holds_while_nobody_waits():
    """The decoder's width is the burst rule's exactly while no sequence waits for or is in prefill."""
    gen = SpeculativeBatchGenerator(model_of("llama"), prefill_step_size=4)
    assert gen.decoder.burst()
    gen.insert_segments([[PROMPTS[0]], [PROMPTS[2]]], max_tokens=[4, 4])
    assert not gen.decoder.burst()
    gen.next()
    assert not gen.decoder.burst()   # the second sequence still waits
    drive(gen, [])
    assert gen.decoder.burst()
    gen.close()


@pytest.mark.parametrize("arch", ["llama", "qwen3_5"])
def test_a_prompt_cache_holding_the_whole_prompt(arch):
    """mlx-lm's LRU can hand over a cache that already holds the whole prompt (no segment left to feed): a
    trimmable cache gives its last token back, an untrimmable one (GatedDeltaNet) is prefilled afresh. Either
    way the row decodes plain greedy, and its finishing cache holds exactly the ``all_tokens`` it names: the
    prompt and every token emitted but the last."""
    model, k = model_of(arch), 10
    prompt = PROMPTS[2]
    cache = make_prompt_cache(model)
    model(mx.array(prompt)[None], cache=cache)
    mx.eval([c.state for c in cache])
    reports = []
    gen = SpeculativeBatchGenerator(model, plan=planned(reports, OracleDrafter(plain_greedy(arch, tuple(prompt), k)[0]), 4))
    (uid,) = gen.insert_segments([[]], max_tokens=[k], caches=[cache], all_tokens=[prompt])
    out, _, _ = drive(gen, reports)
    tokens = [r.token for r in out[uid]]
    assert_greedy_equal(arch, prompt, k, tokens)
    last = out[uid][-1]
    held = next(c.offset for c in last.prompt_cache if hasattr(c, "offset"))
    assert last.all_tokens == prompt + tokens[:-1] and held == len(last.all_tokens)


def test_a_rows_report_counts_its_own_drafts_as_the_solo_path_does():
    """A fixed draft length verifies every proposal where it is made, in a batch as alone: the report of a
    row (drafts verified, drafts accepted) equals the solo speculative run's counts with the same drafter
    (planted errors, so some drafts are rejected) and draft length, while another row shares the forwards."""
    from mlx_backend.decode.generate import SpecStats, ngram_speculative_generate_step

    arch, k = "qwen3_5", 20
    model = model_of(arch)
    truth = plain_greedy(arch, tuple(PROMPTS[0]), k)[0]
    solo = SpecStats()
    for _ in ngram_speculative_generate_step(mx.array(PROMPTS[0]), model, max_tokens=k, draft_max=5,
                                             drafter=OracleDrafter(truth, every=2), stats=solo):
        pass
    assert 0 < solo.n_accept < solo.n_drafted
    reports = []
    plans = iter([RowPlan(OracleDrafter(truth, every=2), 5, reports.append), RowPlan(None, 0, reports.append)])
    gen = SpeculativeBatchGenerator(model, plan=lambda cached, prompt: next(plans))
    uids = gen.insert([PROMPTS[0], PROMPTS[3]], max_tokens=[k, k])
    drive(gen, reports)
    report = next(r for r in reports if r.uid == uids[0])
    assert (report.n_drafted, report.n_accept) == (solo.n_drafted, solo.n_accept)
    plain = next(r for r in reports if r.uid == uids[1])
    assert (plain.n_drafted, plain.n_accept) == (0, 0)
