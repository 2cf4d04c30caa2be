"""The MLX backend's speculative output equals the NumPy reference's for the same weights (float32).

The same tiny model directory (``reference.models.tiny.write_tiny_model``) is loaded by mlx-lm and by
``reference.models.load_model``. Tokens must be equal; a difference is allowed only where the
reference's own top-2 logit gap at that step is below ``NEAR_TIE`` (NumPy and MLX sum in different
orders), after which the sequences are not compared further.
"""
from __future__ import annotations

import functools

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from mlx_backend.decode.generate import SpecStats, ngram_speculative_generate_step
from reference.ngram.drafter import NgramDrafter
from reference.models import load_model
from reference.speculative import greedy_generate, speculative_generate
from reference.models.tiny import write_tiny_model

NEAR_TIE = 1e-3


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-ref")

    @functools.cache
    def pair(arch):
        path = write_tiny_model(root / arch, arch, seed=5)
        mlx_model, _ = mlx_lm.load(str(path))
        return mlx_model, load_model(path)
    return pair


def assert_equal_to_reference(ref_model, prompt, ref_tokens, spec_tokens):
    assert len(ref_tokens) == len(spec_tokens)
    for i, (a, b) in enumerate(zip(ref_tokens, spec_tokens)):
        if a != b:
            logits = ref_model.forward(list(prompt) + ref_tokens[:i], ref_model.make_cache())[-1]
            top2 = np.sort(logits)[-2:]
            assert top2[1] - top2[0] < NEAR_TIE, f"token {i}: reference {a} != mlx {b}, gap {top2[1] - top2[0]}"
            return


@settings(max_examples=12, deadline=None)
@given(arch=st.sampled_from(["qwen3_5", "qwen3_next", "llama"]),
       pattern=st.lists(st.integers(97, 122), min_size=1, max_size=6), reps=st.integers(1, 4),
       draft_max=st.integers(1, 8))
def test_mlx_speculative_equals_numpy_reference(models, arch, pattern, reps, draft_max):
    mlx_model, ref_model = models(arch)
    prompt = pattern * reps
    ref_tokens = greedy_generate(ref_model, prompt, 16)
    ref_spec, _ = speculative_generate(ref_model, prompt, 16, NgramDrafter(), draft_max)
    assert ref_spec == ref_tokens
    stats = SpecStats()
    spec = [t for t, _, _ in ngram_speculative_generate_step(mx.array(prompt), mlx_model, max_tokens=16,
                                                             draft_max=draft_max, drafter=NgramDrafter(),
                                                             stats=stats)]
    assert_equal_to_reference(ref_model, prompt, ref_tokens, spec)


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next", "llama"])
def test_verify_logits_and_kept_state_match_reference(models, arch):
    """One verify forward over S tokens then keep(m): logits and next-step logits match the reference."""
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_backend.decode.rollback import VerifyCache
    mlx_model, ref_model = models(arch)
    prompt, verify, m = [104, 101, 108, 108, 111], [32, 119, 111, 114, 108], 2
    cache = make_prompt_cache(mlx_model)
    mlx_model(mx.array([prompt]), cache=cache)
    vc = VerifyCache(mlx_model, cache)
    ours = np.array(vc.forward(verify))
    vc.keep(m)
    ours_next = np.array(mlx_model(mx.array([[33]]), cache=cache)[0])
    rc = ref_model.make_cache()
    ref_model.forward(prompt, rc)
    ref = ref_model.forward(verify, rc)
    rc.keep(m)
    ref_next = ref_model.forward([33], rc)
    np.testing.assert_allclose(ours, ref, atol=2e-4, rtol=1e-4)
    np.testing.assert_allclose(ours_next, ref_next, atol=2e-4, rtol=1e-4)
