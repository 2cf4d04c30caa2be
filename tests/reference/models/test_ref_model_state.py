"""Properties of the reference model's state: keep(m), checkpoint / rollback, steps of any size.

All comparisons are bit for bit (``np.array_equal``): the reference forward is batch-invariant
(see ``reference/models/ops.py``), so a token's state does not depend on how tokens were grouped.
"""
from __future__ import annotations

import tempfile
from functools import lru_cache

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from reference.models import load_model
from reference.models.tiny import ARCHS, VOCAB_SIZE, write_tiny_model

SETTINGS = settings(max_examples=100, deadline=None)
ARCH_CONFIGS = [(arch, {}) for arch in ARCHS] + [
    # other shapes mlx-lm's classes support: Hv == Hk, every other layer attention, no GQA
    ("qwen3_5", dict(linear_num_value_heads=2, full_attention_interval=2, num_key_value_heads=4)),
    ("qwen3_next", dict(linear_num_key_heads=1, num_hidden_layers=4, full_attention_interval=2, mlp_only_layers=[])),
]


@lru_cache(maxsize=None)
def tiny(config_index: int, seed: int, dtype: str):
    arch, overrides = ARCH_CONFIGS[config_index]
    return load_model(write_tiny_model(tempfile.mkdtemp(), arch, seed=seed, **overrides), np.dtype(dtype))


models = st.builds(tiny, st.integers(0, len(ARCH_CONFIGS) - 1), st.integers(0, 2),
                   st.sampled_from(["float32", "float64"]))
token_lists = st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=12)


def assert_same_state(a, b):
    assert a.offset == b.offset
    for layer_a, layer_b in zip(a.state(), b.state(), strict=True):
        assert layer_a.keys() == layer_b.keys()
        for name in layer_a:
            assert layer_a[name].dtype == layer_b[name].dtype
            assert np.array_equal(layer_a[name], layer_b[name]), name


def one_at_a_time(model, tokens):
    cache = model.make_cache()
    logits = [model.forward([t], cache)[0] for t in tokens]
    return cache, np.array(logits)


@SETTINGS
@given(model=models, prefix=token_lists, block=token_lists, data=st.data())
def test_forward_s_keep_m_equals_feeding_m_tokens_one_at_a_time(model, prefix, block, data):
    m = data.draw(st.integers(0, len(block)), label="m")
    cache = model.make_cache()
    model.forward(prefix, cache)
    logits = model.forward(block, cache)
    cache.keep(m)
    expected, expected_logits = one_at_a_time(model, prefix + block[:m])
    assert_same_state(cache, expected)
    assert np.array_equal(logits[:m], expected_logits[len(prefix):])  # the verify logits are greedy's too
    # and the kept state continues exactly like the sequential one
    nxt = data.draw(token_lists, label="next")
    assert np.array_equal(model.forward(nxt, cache), model.forward(nxt, expected))


@SETTINGS
@given(model=models, prefix=token_lists, steps=st.lists(token_lists, min_size=1, max_size=4), data=st.data())
def test_rollback_restores_the_state_bit_for_bit(model, prefix, steps, data):
    cache = model.make_cache()
    model.forward(prefix, cache)
    before = [{k: v.copy() for k, v in layer.items()} for layer in cache.state()]
    cp = cache.checkpoint()
    for block in steps:  # anything at all happens after the checkpoint
        model.forward(block, cache)
        if data.draw(st.booleans(), label="keep"):
            cache.keep(data.draw(st.integers(0, len(block)), label="m"))
    cache.rollback(cp)
    assert cache.offset == len(prefix)
    for layer, saved in zip(cache.state(), before, strict=True):
        for name in saved:
            assert np.array_equal(layer[name], saved[name])
    fresh = model.make_cache()
    model.forward(prefix, fresh)
    nxt = data.draw(token_lists, label="next")
    assert np.array_equal(model.forward(nxt, cache), model.forward(nxt, fresh))
    # a checkpoint is a copy: rolling back twice works, later forwards do not change it
    cache.rollback(cp)
    assert_same_state(cache, fresh_after(model, prefix))


def fresh_after(model, tokens):
    cache = model.make_cache()
    model.forward(tokens, cache)
    return cache


@SETTINGS
@example(model=tiny(0, 0, "float32"), prompt=[1, 2, 3],  # no draft, drafts, no draft, all rejected, one kept
         steps=[([], 0), ([4, 5, 6], 2), ([], 0), ([7, 8], 0), ([9], 1)])
@given(model=models, prompt=token_lists,
       steps=st.lists(st.tuples(st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=0, max_size=8), st.integers(0, 8)),
                      min_size=1, max_size=6))
def test_steps_with_and_without_drafts_leave_no_stale_state(model, prompt, steps):
    """Speculative-loop shaped steps: forward [last, drafts...] (S = 1 when there is no draft), keep 1 + n.

    A known failure elsewhere: after a step with no draft the recurrent state is left stale or
    double-advanced. Here every mix of S = 1 and S > 1 steps ends in the sequential state."""
    cache = model.make_cache()
    model.forward(prompt, cache)
    kept = list(prompt)
    last = (prompt[-1] + 1) % VOCAB_SIZE  # the token emitted after the prompt, not yet fed
    for drafts, n in steps:
        n = min(n, len(drafts))
        model.forward([last, *drafts], cache)
        cache.keep(1 + n)
        kept += [last, *drafts[:n]]
        last = (kept[-1] * 7 + 3) % VOCAB_SIZE  # the bonus token: fed by the next step
    expected, _ = one_at_a_time(model, kept)
    assert cache.offset == len(kept)
    assert_same_state(cache, expected)


def test_bonus_token_keep_is_not_off_by_one():
    """Verify [last, d1, d2, d3] with d1, d2 right: the bonus comes from logits[2]; keep(3) holds last, d1, d2."""
    model = tiny(0, 0, "float64")
    prompt = list(b"abcabc")
    cache = model.make_cache()
    greedy = []
    last = int(np.argmax(model.forward(prompt, cache)[-1]))
    reference = model.make_cache()
    model.forward(prompt, reference)
    t = last
    for _ in range(3):
        greedy.append(t)
        t = int(np.argmax(model.forward([t], reference)[-1]))
    bonus_expected = t  # greedy's token after last, d1, d2
    d1, d2 = greedy[1], greedy[2]
    wrong = (t + 1) % VOCAB_SIZE
    logits = model.forward([last, d1, d2, wrong], cache)
    predicted = np.argmax(logits, axis=-1)
    assert predicted[0] == d1 and predicted[1] == d2 and predicted[2] != wrong
    assert predicted[2] == bonus_expected
    cache.keep(3)
    assert_same_state(cache, reference)


def test_keep_needs_a_forward_and_a_valid_m():
    model = tiny(0, 0, "float32")
    cache = model.make_cache()
    with pytest.raises(ValueError, match="needs a forward pass"):
        cache.keep(0)
    model.forward([1, 2, 3], cache)
    with pytest.raises(ValueError, match="m=4 is outside 0..3"):
        cache.keep(4)
    cache.keep(2)
    with pytest.raises(ValueError, match="needs a forward pass"):
        cache.keep(1)  # the trace is consumed: cutting twice would cut the wrong tokens


def test_trimming_only_the_kv_rows_corrupts_a_hybrid_model():
    """mlx-lm's trim_prompt_cache shortens KV caches; doing only that leaves the recurrent layers ahead."""
    from reference.models import KVState

    model = tiny(0, 0, "float64")  # qwen3_5: 3 GatedDeltaNet layers, 1 attention layer
    cache = model.make_cache()
    model.forward([5, 6, 7], cache)
    model.forward([8, 9, 10], cache)
    for layer in cache.layers:  # "trim 2": drop the KV rows of tokens 9 and 10, nothing else
        if isinstance(layer, KVState):
            layer.keys, layer.values = layer.keys[:, :-2], layer.values[:, :-2]
    expected, _ = one_at_a_time(model, [5, 6, 7, 8])
    stale = model.forward([11], cache)
    assert not np.allclose(stale, model.forward([11], expected), atol=1e-3)
