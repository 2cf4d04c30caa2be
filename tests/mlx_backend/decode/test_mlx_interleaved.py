"""Two speculative runs on the same model, each with its own cache, advanced alternately (two streams a
program interleaves, as it may with mlx-lm's ``generate_step``): each gives plain greedy output.

The GatedDeltaNet layers are the model's, shared by both runs: a verify forward's record (the conv input and
per-token states ``keep`` needs) belongs to the run that made it, not to the layer, or the other run's
forward in between overwrites it and its ``keep`` cuts its cache to the other run's states (wrong tokens), or
finds no record at all (``AttributeError``)."""
from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlx_backend.decode.generate import ngram_speculative_generate_step
from mlx_backend.decode.rollback import GDN_PATHS, VerifyCache

from test_mlx_generate import ScriptedDrafter, model_of, plain_greedy
from test_mlx_rollback import assert_caches_close

HYBRID = ["qwen3_5", "qwen3_next"]


@pytest.mark.parametrize("arch", HYBRID)
@pytest.mark.parametrize("gdn_path", GDN_PATHS)
def test_verify_caches_of_two_runs_on_one_model_keep_their_own_records(arch, gdn_path):
    model = model_of(arch)
    prompts, verifies, keeps = ([1, 2, 3], [4, 5, 6, 7]), ([8, 9, 10, 11, 12], [13, 14, 15]), (2, 1)
    caches = [make_prompt_cache(model) for _ in prompts]
    for prompt, cache in zip(prompts, caches):
        model(mx.array([prompt]), cache=cache)
    vcs = [VerifyCache(model, cache, gdn_path) for cache in caches]
    for vc, verify in zip(vcs, verifies):   # both forwards first, then both keeps
        vc.forward(verify)
    for vc, m in zip(vcs, keeps):
        vc.keep(m)
    for vc in vcs:
        vc.close()
    for prompt, verify, m, cache in zip(prompts, verifies, keeps, caches):
        ref = make_prompt_cache(model)
        model(mx.array([prompt + verify[:m]]), cache=ref)
        assert_caches_close(cache, ref)


@pytest.mark.parametrize("arch", HYBRID)
@pytest.mark.parametrize("gdn_path", GDN_PATHS)
def test_two_interleaved_runs_on_one_model_equal_plain_greedy(arch, gdn_path):
    model = model_of(arch)
    prompts = [[5, 6, 7, 8] * 5, [9, 10, 11, 12, 13] * 4]
    want = [plain_greedy(model, p, 24)[0] for p in prompts]
    # scripted drafts from the plain continuation, some forced wrong: both runs accept and reject drafts
    script = [(4, None), (3, 1), (4, 3), (2, 0)]
    runs = [ngram_speculative_generate_step(
        mx.array(p), model, max_tokens=24, draft_max=4, gdn_path=gdn_path,
        drafter=ScriptedDrafter(w, script)) for p, w in zip(prompts, want)]
    got = [[], []]
    for a, b in zip(*runs):   # one token of each in turn: a verify step of one between the other's steps
        got[0].append(a[0])
        got[1].append(b[0])
    assert got == want
