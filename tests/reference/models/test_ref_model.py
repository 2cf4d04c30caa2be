"""The NumPy reference model against mlx-lm's own model classes (same directory, same weights).

Measured on Linux x86_64, numpy 2.4 + OpenBLAS, mlx 0.32.4 (CPU, reference BLAS), float32, tiny random
models (logits of magnitude up to ~5): max |logit difference| 1.1e-5 (qwen3_5), 6.1e-6 (qwen3_next),
1.7e-6 (llama) on the prompt below, over prefill, a 4-token and a 1-token forward. The tests allow
LOGIT_ATOL = 1e-4, STATE_ATOL = 1e-4 for the named state (conv window, recurrent matrix, KV rows).
Over 80 random small configs (``configs()`` below): |mlx - reference float32| median 6e-6, 95th
percentile 9e-5, max 4.5e-4; the float32 reference's own error against float64 reached 1.8e-4 at the
same ill-conditioned rows, so the random-config test measures mlx against float64 (see there).
"""
from __future__ import annotations

import json
import tempfile
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reference.models import KVState, RecurrentState, load_model
from reference.models.tiny import ARCHS, tiny_weights, write_tiny_model

LOGIT_ATOL = 1e-4
STATE_ATOL = 1e-4
PROMPT = list(b"hello world, hello world! 12345")
CHUNKS = (20, 4, 1, 6)  # prefill, a verify-sized forward, a single token, another multi-token forward


@lru_cache(maxsize=None)
def tiny_dir(arch: str, seed: int) -> Path:
    return write_tiny_model(tempfile.mkdtemp(prefix=f"tiny-{arch}-"), arch, seed=seed)


def reference_logits(model_dir, dtype=np.float32):
    model = load_model(model_dir, dtype)
    cache = model.make_cache()
    out, start = [], 0
    for n in CHUNKS:
        out.append(model.forward(PROMPT[start:start + n], cache))
        start += n
    return np.concatenate(out), cache


def mlx_logits(model_dir):
    mx = pytest.importorskip("mlx.core")
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model as mlx_load_model

    model, _ = mlx_load_model(Path(model_dir))
    cache = make_prompt_cache(model)
    out, start = [], 0
    for n in CHUNKS:
        out.append(np.array(model(mx.array([PROMPT[start:start + n]]), cache=cache)[0]))
        start += n
    return np.concatenate(out), cache


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("seed", [0, 7])
def test_logits_and_state_match_mlx_lm(arch, seed):
    pytest.importorskip("mlx_lm")
    ours, our_cache = reference_logits(tiny_dir(arch, seed))
    theirs, their_cache = mlx_logits(tiny_dir(arch, seed))
    assert ours.shape == theirs.shape == (sum(CHUNKS), 260)
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=LOGIT_ATOL)
    assert (np.abs(ours) > 0.5).mean() > 0.3  # the comparison is not between near-zero logits
    for ours_l, theirs_l in zip(our_cache.layers, their_cache, strict=True):
        if isinstance(ours_l, RecurrentState):
            np.testing.assert_allclose(ours_l.conv, np.array(theirs_l[0])[0], rtol=0, atol=STATE_ATOL)
            np.testing.assert_allclose(ours_l.recurrent, np.array(theirs_l[1])[0], rtol=0, atol=STATE_ATOL)
        elif hasattr(theirs_l, "_temporal_order"):   # a sliding-window layer's ring: its last rows
            assert isinstance(ours_l, KVState) and ours_l.offset == theirs_l.offset == sum(CHUNKS)
            keys, values = (np.array(theirs_l._temporal_order(a))[0] for a in theirs_l.state[:2])
            assert theirs_l.max_size <= keys.shape[1] < sum(CHUNKS)
            np.testing.assert_allclose(ours_l.keys[:, -keys.shape[1]:], keys, rtol=0, atol=STATE_ATOL)
            np.testing.assert_allclose(ours_l.values[:, -keys.shape[1]:], values, rtol=0, atol=STATE_ATOL)
        else:
            assert isinstance(ours_l, KVState) and ours_l.offset == theirs_l.offset == sum(CHUNKS)
            keys, values = (np.array(a)[0] for a in theirs_l.state[:2])
            np.testing.assert_allclose(ours_l.keys, keys[:, :theirs_l.offset], rtol=0, atol=STATE_ATOL)
            np.testing.assert_allclose(ours_l.values, values[:, :theirs_l.offset], rtol=0, atol=STATE_ATOL)


VARIANTS = {
    # every branch of mlx-lm's classes the tiny defaults do not take
    "llama-bias-untied-traditional-linear-rope": ("llama", dict(
        attention_bias=True, mlp_bias=True, tie_word_embeddings=False, num_key_value_heads=4,
        rope_traditional=True, rope_scaling={"type": "linear", "factor": 2.0})),
    "llama-llama3-rope": ("llama", dict(rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16})),  # short context: every frequency band is exercised
    "qwen3_5-moe-untied-interval-2": ("qwen3_5", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        tie_word_embeddings=False, full_attention_interval=2, linear_num_value_heads=2)),
    "qwen3_5-no-rope-parameters": ("qwen3_5", dict(rope_parameters=None, rope_theta=5000.0, partial_rotary_factor=0.5)),
    "qwen3_next-dense-tied-bias": ("qwen3_next", dict(
        num_experts=0, tie_word_embeddings=True, attention_bias=True, partial_rotary_factor=0.5,
        linear_num_key_heads=1, linear_num_value_heads=4)),
    "qwen3_next-moe-every-2nd-unnormalised": ("qwen3_next", dict(
        decoder_sparse_step=2, mlp_only_layers=[], norm_topk_prob=False, num_hidden_layers=4)),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_config_variants_match_mlx_lm(variant, tmp_path):
    pytest.importorskip("mlx_lm")
    arch, overrides = VARIANTS[variant]
    write_tiny_model(tmp_path, arch, seed=5, **overrides)
    ours, _ = reference_logits(tmp_path)
    theirs, _ = mlx_logits(tmp_path)
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=LOGIT_ATOL)


@st.composite
def configs(draw):
    """A random small config in the space mlx-lm's classes accept."""
    arch = draw(st.sampled_from(ARCHS))
    n_heads = draw(st.sampled_from([2, 4]))
    # hybrid stacks need both layer kinds: mlx-lm indexes the cache of its first attention layer
    # (full_attention_interval - 1) and of layer 0 as a GatedDeltaNet one
    n_layers = draw(st.integers(1 if arch.startswith("llama") else 2, 4))
    c = dict(hidden_size=draw(st.sampled_from([32, 48])), num_hidden_layers=n_layers, num_attention_heads=n_heads,
             num_key_value_heads=draw(st.sampled_from([k for k in (1, 2, 4) if n_heads % k == 0])),
             head_dim=draw(st.sampled_from([8, 16])), intermediate_size=draw(st.sampled_from([40, 64])))
    if arch == "llama_sliding":   # mlx-lm needs one full-attention layer; windows shorter than the prompt
        c.update(layer_types=["sliding_attention"] * (n_layers - 1) + ["full_attention"],
                 sliding_window=draw(st.integers(1, 12)))
    elif arch != "llama":
        n_k = draw(st.integers(1, 2))
        c.update(linear_num_key_heads=n_k, linear_num_value_heads=n_k * draw(st.integers(1, 3)),
                 linear_key_head_dim=draw(st.sampled_from([8, 16])),
                 linear_value_head_dim=draw(st.sampled_from([8, 24])),
                 linear_conv_kernel_dim=draw(st.integers(2, 5)), full_attention_interval=draw(st.integers(2, n_layers)))
        factor = draw(st.sampled_from([0.25, 0.5, 1.0]))
        if arch == "qwen3_next":
            c.update(partial_rotary_factor=factor, mlp_only_layers=[])
        else:
            c["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": factor}
    return arch, c, draw(st.integers(0, 2**16))


# derandomized: the same 25 configs every run (150 checked once while writing this), so that a rare
# float32 near-tie elsewhere cannot make CI flaky; exact properties elsewhere stay randomized
@settings(max_examples=25, deadline=None, derandomize=True)
@given(config=configs())
def test_random_configs_match_mlx_lm(config):
    """Against the float64 reference as the truth: mlx-lm's float32 error may exceed LOGIT_ATOL only where
    float32 itself is ill-conditioned, i.e. where the float32 reference is off by as much (a near-zero
    vector normalised, seen once in ~100 random configs at 1.5e-4)."""
    pytest.importorskip("mlx_lm")
    arch, overrides, seed = config
    with tempfile.TemporaryDirectory() as d:
        write_tiny_model(d, arch, seed=seed, **overrides)
        exact, _ = reference_logits(d, np.float64)
        ours, _ = reference_logits(d, np.float32)
        theirs, _ = mlx_logits(d)
    float32_error = np.abs(ours - exact)
    assert np.all(np.abs(theirs - exact) <= LOGIT_ATOL + 4 * float32_error)


def test_quantized_checkpoints_are_refused(tmp_path):
    src = tiny_dir("llama", 0)
    config = json.loads((src / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization": {"group_size": 64, "bits": 4}}))
    with pytest.raises(ValueError, match="quantized models are not supported"):
        load_model(tmp_path)


def test_nested_text_config_matches_mlx_lm(tmp_path):
    """Qwen3.5 checkpoints nest the text model's settings under ``text_config``."""
    pytest.importorskip("mlx_lm")
    write_tiny_model(tmp_path, "qwen3_5", seed=2)
    flat = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "text_config": flat}))
    ours, _ = reference_logits(tmp_path)
    theirs, _ = mlx_logits(tmp_path)
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=LOGIT_ATOL)
    flat_logits, _ = reference_logits(tiny_dir("qwen3_5", 2))
    np.testing.assert_array_equal(ours, flat_logits)


@pytest.mark.parametrize("arch", ARCHS)
def test_float64_agrees_with_float32(arch):
    f32, _ = reference_logits(tiny_dir(arch, 0), np.float32)
    f64, cache = reference_logits(tiny_dir(arch, 0), np.float64)
    assert f64.dtype == np.float64 and all(a.dtype == np.float64 for s in cache.state() for a in s.values())
    np.testing.assert_allclose(f32, f64, rtol=0, atol=1e-4)


def hf_layout(arrays: dict, arch: str) -> dict:
    """The tiny weights as a Hugging Face checkpoint stores them (what mlx-lm's sanitize converts)."""
    norm_suffixes = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
                     ".q_norm.weight", ".k_norm.weight")
    out = {}
    for k, v in arrays.items():
        if k.startswith("language_model."):
            k = "model.language_model." + k[len("language_model.model."):] if k.startswith(
                "language_model.model.") else k[len("language_model."):]
        if "conv1d.weight" in k:
            v = np.moveaxis(v, 1, 2)  # [C, K, 1] -> [C, 1, K]
        elif k.endswith(norm_suffixes):
            v = v - 1  # stored as an offset from 1
        if ".switch_mlp." in k:
            prefix, name = k.split(".switch_mlp.")
            for e in range(v.shape[0]):
                out[f"{prefix}.experts.{e}.{name}"] = v[e]
            continue
        out[k] = v
    if arch == "qwen3_next":
        out["mtp.fc.weight"] = np.zeros((2, 2), np.float32)  # dropped by sanitize
    return out


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next"])
def test_hugging_face_layout_loads_like_mlx_layout(arch, tmp_path):
    from safetensors.numpy import save_file

    src = tiny_dir(arch, 0)
    config = json.loads((src / "config.json").read_text())
    save_file(hf_layout(tiny_weights(config, 0), arch), str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf, _ = reference_logits(tmp_path)
    mlx_fmt, _ = reference_logits(src)
    np.testing.assert_array_equal(hf, mlx_fmt)


def test_bfloat16_weights_are_widened_exactly(tmp_path):
    mx = pytest.importorskip("mlx.core")
    from reference.models.loading import read_safetensors

    values = np.array([1.5, -2.25, 3.0e-3, 65504.0], np.float32)
    mx.save_safetensors(str(tmp_path / "w.safetensors"), {"a": mx.array(values).astype(mx.bfloat16)})
    expected = np.array(mx.array(values).astype(mx.bfloat16).astype(mx.float32))
    np.testing.assert_array_equal(read_safetensors(str(tmp_path / "w.safetensors"))["a"], expected)


def test_bad_model_directories_get_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="no config.json.*tiny-model"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    with pytest.raises(ValueError, match="model_type 'mamba' is not supported"):
        load_model(tmp_path)
    src = tiny_dir("llama", 0)
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    with pytest.raises(ValueError, match="no model.*safetensors"):
        load_model(tmp_path)
    from safetensors.numpy import load_file, save_file

    weights = load_file(str(src / "model.safetensors"))
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="'model.layers.1.mlp.up_proj.weight' is missing"):
        load_model(tmp_path)
    with pytest.raises(ValueError, match="float32 or float64"):
        load_model(src, np.float16)
    config = json.loads((src / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "rope_scaling": {"type": "yarn", "factor": 4.0}}))
    with pytest.raises(ValueError, match="rope scaling type 'yarn' is not supported"):
        load_model(tmp_path)


def test_forward_rejects_bad_tokens():
    model = load_model(tiny_dir("llama", 0))
    with pytest.raises(ValueError, match="token id 260 is outside the vocabulary 0..259"):
        model.forward([1, 260], model.make_cache())
    with pytest.raises(ValueError, match="non-empty"):
        model.forward([], model.make_cache())


def with_config(out: Path, arch: str, key: str, value) -> None:
    """In ``out``: the tiny ``arch`` model's weights (linked) under its config.json with ``key`` set to ``value``."""
    src = tiny_dir(arch, 0)
    config = json.loads((src / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, key: value}))
    (out / "model.safetensors").symlink_to(src / "model.safetensors")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("key, value", [("hidden_size", 32), ("vocab_size", 300), ("intermediate_size", 80),
                                        ("num_key_value_heads", 4), ("num_hidden_layers", 1)])
def test_a_config_that_does_not_match_the_weights_is_refused(arch, key, value, tmp_path):
    """mlx-lm refuses these; the reference used to run them silently (sizes read from the tensors, layers
    beyond num_hidden_layers ignored). The error names a tensor and the config key."""
    with_config(tmp_path, arch, key, value)
    with pytest.raises(ValueError, match=f"config.json does not match the weights: tensors? (of layer )?"
                                         f"[a-z_.0-9]+ .*config.json's {key}"):
        load_model(tmp_path)


@pytest.mark.parametrize("arch, key, value", [
    (arch, key, value) for arch in ("llama", "qwen3_5", "qwen3_next")
    for key, value in (("num_attention_heads", 8), ("num_attention_heads", 3), ("linear_num_key_heads", 1),
                       ("linear_num_value_heads", 8), ("linear_key_head_dim", 8), ("linear_value_head_dim", 8))
    if arch != "llama" or not key.startswith("linear_")])   # llama has no GatedDeltaNet layers
def test_head_counts_and_sizes_that_do_not_match_the_weights_are_refused_at_load(arch, key, value, tmp_path):
    """These used to load and fail on the first forward with a broadcast or reshape error from inside the
    attention or the GatedDeltaNet (check_shapes said the architectures read these sizes from the tensors)."""
    with_config(tmp_path, arch, key, value)
    with pytest.raises(ValueError, match=f"config.json does not match the weights: tensor [A-Za-z_.0-9]+ .*"
                                         f"config.json's .*{key}"):
        load_model(tmp_path)


def test_a_cache_from_another_model_is_refused_before_it_changes():
    """It used to fail deep inside a layer (AttributeError, concatenate) after advancing the cache's offset,
    or, for a float32 cache in a float64 model, to run the recurrence in float32 silently."""
    llama, qwen = load_model(tiny_dir("llama", 0)), load_model(tiny_dir("qwen3_5", 0))
    qwen64 = load_model(tiny_dir("qwen3_5", 0), np.float64)
    for model, cache in ((llama, qwen.make_cache()), (qwen, llama.make_cache()), (qwen64, qwen.make_cache())):
        with pytest.raises(ValueError, match="this cache was made by another model .*make_cache"):
            model.forward([1, 2], cache)
        assert cache.offset == 0 and cache.pending == 0
    twin = load_model(tiny_dir("qwen3_5", 0))      # the same model loaded again: its caches are alike
    cache = qwen.make_cache()
    qwen.forward([1, 2], cache)
    assert twin.forward([3], cache).shape == (1, 260) and cache.offset == 3
