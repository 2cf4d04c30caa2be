"""Sliding-window (``RotatingKVCache``), chunked (``ChunkedKVCache``) and ``max_kv_size`` caches:
speculative greedy output equals mlx-lm's plain greedy ``generate_step`` output token for token,
with drafts accepted and rejected across the window's wrap, and a verify forward over a wrapped
ring sees exactly the keys that one-token steps see (tiny models built with mlx-lm's classes)."""
from __future__ import annotations

import functools

import mlx.core as mx
import pytest
from hypothesis import given, settings, strategies as st
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache, make_prompt_cache

from mlx_backend.decode.generate import SpecStats, ngram_speculative_generate_step
from mlx_backend.decode.rollback import VerifyCache
from mlx_backend.models.compat import build
from mlx_backend.models.tiny import WINDOWED, tiny_model

from test_mlx_generate import ScriptedDrafter, argmax_sampler, assert_greedy_equal

WINDOW = 8   # every windowed tiny model: sliding window / chunk of 8 tokens, prompts of 12-30


@functools.cache
def setup(kind: str):
    """(model, make_cache) for each cache layout under test."""
    if kind in WINDOWED:
        model = tiny_model(kind, seed=1)
        return model, lambda: make_prompt_cache(model)
    if kind == "qwen2-max-kv":   # --max-kv-size: RotatingKVCache(keep=4) in every layer, for a model without
        model = build("qwen2", seed=1)   # make_cache (llama has one since mlx-lm 0.32: max_kv_size was ignored)
        assert all(isinstance(c, RotatingKVCache) and c.keep == 4 for c in make_prompt_cache(model, WINDOW + 2))
        return model, lambda: make_prompt_cache(model, max_kv_size=WINDOW + 2)
    model = tiny_model("llama", seed=1)
    if kind == "llama-layer-types":   # llama with sliding_attention layers
        model = tiny_model("llama", seed=1, layer_types=["sliding_attention", "full_attention"],
                           sliding_window=WINDOW)
        return model, lambda: make_prompt_cache(model)
    if kind == "llama-window-in-bigger-ring":   # one-token steps masked inside the ring (mlx-lm's roll)
        model = tiny_model("llama", seed=1, layer_types=["sliding_attention", "full_attention"],
                           sliding_window=WINDOW // 2)
        return model, lambda: [RotatingKVCache(max_size=WINDOW), KVCache()]
    raise ValueError(kind)


KINDS = WINDOWED + ("qwen2-max-kv", "llama-layer-types", "llama-window-in-bigger-ring")


def plain(model, make_cache, prompt, n, prefill=2048):
    out = list(generate_step(mx.array(prompt), model, max_tokens=n, sampler=argmax_sampler,
                             prompt_cache=make_cache(), prefill_step_size=prefill))
    return [int(t) for t, _ in out], [lp for _, lp in out]


prompt_st = st.builds(lambda p, r, tail: p * r + tail, st.lists(st.integers(0, 63), min_size=2, max_size=5),
                      st.integers(3, 6), st.lists(st.integers(0, 63), max_size=3))
script_st = st.lists(st.tuples(st.integers(0, 8), st.one_of(st.none(), st.integers(0, 7))),
                     min_size=1, max_size=5)


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=6, deadline=None)
@given(prompt=prompt_st, script=script_st, prefill=st.sampled_from([5, 2048]))
def test_scripted_drafts_across_the_wrap_equal_plain_greedy(kind, prompt, script, prefill):
    """Drafts of 0..8 tokens, right or forced wrong at a position, over 24 tokens past a window of 8."""
    model, make_cache = setup(kind)
    ref, ref_lp = plain(model, make_cache, prompt, 24, prefill)
    stats = SpecStats()
    spec = [t for t, _, _ in ngram_speculative_generate_step(
        mx.array(prompt), model, max_tokens=24, draft_max=8, prompt_cache=make_cache(), stats=stats,
        drafter=ScriptedDrafter(ref, script), prefill_step_size=prefill)]
    assert_greedy_equal(ref, ref_lp, spec)


@pytest.mark.parametrize("kind", KINDS)
def test_ngram_drafter_accepts_and_rejects_across_the_wrap(kind):
    model, make_cache = setup(kind)
    prompt = [5, 6, 7, 8, 9] * 4
    ref, ref_lp = plain(model, make_cache, prompt, 40)
    stats = SpecStats()
    spec = [t for t, _, _ in ngram_speculative_generate_step(
        mx.array(prompt), model, max_tokens=40, draft_max=4, prompt_cache=make_cache(), stats=stats)]
    assert_greedy_equal(ref, ref_lp, spec)
    assert 0 < stats.n_accept < stats.n_drafted       # accepted and rejected drafts, past the window


def single_steps(model, cache, tokens):
    """Logits of ``tokens`` fed one at a time (what plain decoding computes)."""
    rows = [model(mx.array([[t]]), cache=cache)[0] for t in tokens]
    return mx.concatenate(rows) if rows else None


@pytest.mark.parametrize("keep", [0, 4])
@settings(max_examples=8, deadline=None)
@given(n_prompt=st.integers(1, 30), verify=st.lists(st.integers(0, 63), min_size=2, max_size=9),
       data=st.data())
def test_verify_forward_on_a_ring_equals_one_token_steps(keep, n_prompt, verify, data):
    """Over a RotatingKVCache (wrapped or not, keep 0 or 4), each row of a verify forward's logits
    equals the one-token step's, and after ``keep(m)`` the next steps equal those after m steps."""
    model = tiny_model("llama", seed=2)
    m = data.draw(st.integers(0, len(verify)), label="m")
    prompt = [(7 * i) % 64 for i in range(n_prompt)]
    fresh = lambda: [RotatingKVCache(max_size=WINDOW, keep=keep) for _ in model.layers]
    cache, ref = fresh(), fresh()
    model(mx.array([prompt]), cache=cache)
    model(mx.array([prompt]), cache=ref)
    vc = VerifyCache(model, cache)
    logits = vc.forward(verify)
    assert mx.allclose(logits, single_steps(model, ref, verify), atol=1e-4).item()
    vc.keep(m)
    vc.close()
    ref = fresh()
    model(mx.array([prompt]), cache=ref)
    single_steps(model, ref, verify[:m])
    assert [(c.offset, c._idx, c.keys.shape) for c in cache] == [(c.offset, c._idx, c.keys.shape) for c in ref]
    assert mx.allclose(single_steps(model, cache, [3, 4]), single_steps(model, ref, [3, 4]), atol=1e-4).item()


def test_mlx_multi_token_forward_over_a_wrapped_ring_with_keep_differs_from_one_token_steps():
    """Why the verify forward builds its own mask: mlx-lm's own S-token forward over a wrapped
    ``RotatingKVCache(keep=4)`` attends other keys than S one-token steps do."""
    model = tiny_model("llama", seed=2)
    fresh = lambda: [RotatingKVCache(max_size=WINDOW, keep=4) for _ in model.layers]
    a, b = fresh(), fresh()
    model(mx.array([list(range(20))]), cache=a)
    model(mx.array([list(range(20))]), cache=b)
    verify = [1, 2, 3, 4, 5]
    assert not mx.allclose(model(mx.array([verify]), cache=a)[0], single_steps(model, b, verify),
                           atol=1e-3).item()


def test_chunked_cache_is_trimmed_exactly():
    """llama4's ChunkedKVCache: prompts past a chunk boundary, scripted right and wrong drafts."""
    model, make_cache = setup("llama4")
    prompt = [3, 1, 4, 1, 5, 9, 2, 6] * 3
    ref, ref_lp = plain(model, make_cache, prompt, 30)
    for script in ([(8, None)], [(5, 2), (3, None), (0, None)], [(8, 0)]):
        spec = [t for t, _, _ in ngram_speculative_generate_step(
            mx.array(prompt), model, max_tokens=30, draft_max=8, prompt_cache=make_cache(),
            drafter=ScriptedDrafter(ref, script))]
        assert_greedy_equal(ref, ref_lp, spec)


def test_kv_shared_layers_reading_a_sliding_window_cache_equal_plain_greedy():
    """gemma3n's KV-shared layers read another layer's RotatingKVCache with ``keys_and_values()`` after
    that layer's update; in a verify forward (the ring not written) they get its rows and the S new
    ones, as ``update_and_fetch`` returned them. Before: the old rows only, and every verify forward
    on gemma3n failed (ValueError: the [S, n + S] mask against n keys)."""
    model = build("gemma3n", seed=1)
    make_cache = lambda: make_prompt_cache(model)
    assert any(isinstance(c, RotatingKVCache) for c in make_cache())
    prompt = [3, 1, 4, 1, 5, 9, 2, 6] * 3                 # 24 tokens: past the window of 8
    ref, ref_lp = plain(model, make_cache, prompt, 20)
    for script in ([(6, None)], [(5, 2), (3, None), (0, None)]):
        spec = [t for t, _, _ in ngram_speculative_generate_step(
            mx.array(prompt), model, max_tokens=20, draft_max=6, prompt_cache=make_cache(),
            drafter=ScriptedDrafter(ref, script))]
        assert_greedy_equal(ref, ref_lp, spec)


def test_quantized_kv_cache_across_many_verify_steps():
    """QuantizedKVCache (mlx-lm's --kv-bits cache): trimmed rows are overwritten exactly."""
    model = tiny_model("llama", head_dim=32, seed=3)
    make_cache = lambda: [QuantizedKVCache(group_size=32, bits=4) for _ in model.layers]
    prompt = [4, 5, 6, 7] * 5
    ref, ref_lp = plain(model, make_cache, prompt, 40)
    spec = [t for t, _, _ in ngram_speculative_generate_step(
        mx.array(prompt), model, max_tokens=40, draft_max=6, prompt_cache=make_cache(),
        drafter=ScriptedDrafter(ref, [(6, 3), (6, None), (2, 0)]))]
    assert_greedy_equal(ref, ref_lp, spec)
