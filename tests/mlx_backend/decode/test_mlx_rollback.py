"""Exact rollback: after a verify forward over S tokens, ``keep(m)`` leaves the prompt cache as if only
the first m tokens had been processed (both GDN paths, forced on CPU), and unsupported caches fail
with an error naming the cache and the option that avoids it."""
from __future__ import annotations

import functools

import mlx.core as mx
import pytest
from hypothesis import given, settings, strategies as st
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import (ArraysCache, KVCache, QuantizedKVCache, RotatingKVCache,
                                 make_prompt_cache)

from mlx_backend.decode.generate import ngram_speculative_generate_step
from mlx_backend.models.compat import build
from mlx_backend.decode.rollback import (GDN_PATHS, RollbackUnsupported, VerifyCache, default_gdn_path,
                                  gdn_projections)
from mlx_backend.models.tiny import ARCHITECTURES, tiny_model

from test_mlx_generate import ScriptedDrafter, argmax_sampler, assert_greedy_equal, model_of, plain_greedy

ATOL = 1e-5


def cache_arrays(cache):
    """The live content of each layer cache: (conv, recurrent) or the first ``offset`` KV rows."""
    out = []
    for c in cache:
        if isinstance(c, ArraysCache):
            out.append((c[0], c[1]))
        else:
            out.append((c.keys[..., :c.offset, :], c.values[..., :c.offset, :]))
    return out


def assert_caches_close(a, b):
    for (x0, x1), (y0, y1) in zip(cache_arrays(a), cache_arrays(b)):
        assert x0.shape == y0.shape and x1.shape == y1.shape
        assert mx.allclose(x0, y0, atol=ATOL).item() and mx.allclose(x1, y1, atol=ATOL).item()


@settings(max_examples=40, deadline=None)
@given(arch=st.sampled_from(ARCHITECTURES), gdn_path=st.sampled_from(GDN_PATHS),
       prompt=st.lists(st.integers(0, 63), min_size=1, max_size=12),
       verify=st.lists(st.integers(0, 63), min_size=2, max_size=9), data=st.data())
def test_keep_m_equals_processing_only_m_tokens(arch, gdn_path, prompt, verify, data):
    m = data.draw(st.integers(0, len(verify)), label="m")
    model = model_of(arch)
    cache = make_prompt_cache(model)
    model(mx.array([prompt]), cache=cache)
    vc = VerifyCache(model, cache, gdn_path)
    logits = vc.forward(verify)
    vc.keep(m)

    ref = make_prompt_cache(model)
    model(mx.array([prompt]), cache=ref)
    ref_logits = model(mx.array([verify]), cache=ref)[0]      # mlx-lm's own forward, no recording
    assert mx.allclose(logits, ref_logits, atol=ATOL).item()
    ref = make_prompt_cache(model)
    model(mx.array([prompt + verify[:m]]), cache=ref)
    assert_caches_close(cache, ref)
    nxt = model(mx.array([[5, 6]]), cache=cache)
    assert mx.allclose(nxt, model(mx.array([[5, 6]]), cache=ref), atol=ATOL).item()
    vc.close()


def test_recording_subclass_is_per_instance_and_removable():
    model = model_of("qwen3_5")
    gdn = model.layers[0].linear_attn
    base = type(gdn)
    names = sorted(k for k, _ in tree_flatten(model.parameters()))
    vc = VerifyCache(model, make_prompt_cache(model))
    assert type(gdn) is not base and isinstance(gdn, base)
    assert type(model_of("qwen3_next").layers[0].linear_attn).__name__ == "Qwen3NextGatedDeltaNet"
    assert sorted(k for k, _ in tree_flatten(model.parameters())) == names   # no new parameters
    vc.close()
    assert type(gdn) is base


def test_default_path_on_cpu_is_states():
    assert default_gdn_path() == ("states" if not mx.metal.is_available() else default_gdn_path())
    with pytest.raises(ValueError, match="gdn_path"):
        VerifyCache(model_of("llama"), make_prompt_cache(model_of("llama")), gdn_path="kernel")


def test_keep_out_of_range():
    model = model_of("qwen3_5")
    vc = VerifyCache(model, make_prompt_cache(model))
    vc.forward([1, 2, 3])
    with pytest.raises(ValueError, match="0 <= m <= S"):
        vc.keep(4)


def test_rotating_cache_wrapping_during_verify_and_already_wrapped_equal_plain_greedy():
    """A RotatingKVCache that wraps inside a verify forward, or had wrapped before it, is rolled
    back exactly (more in test_mlx_windowed.py)."""
    model = model_of("llama")
    for prompt in ([1, 2, 3, 4, 5, 6], list(range(10))):
        fresh = lambda: [RotatingKVCache(max_size=8, keep=0) for _ in model.layers]
        ref = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=10,
                                                sampler=argmax_sampler, prompt_cache=fresh())]
        spec = [t for t, _, _ in ngram_speculative_generate_step(
            mx.array(prompt), model, prompt_cache=fresh(), max_tokens=10, draft_max=4,
            drafter=ScriptedDrafter(ref, [(4, None), (4, 1)]))]
        assert spec == ref


def test_rotating_cache_with_room_and_draft_max_zero_work():
    model = model_of("llama")
    prompt = [9, 8, 7, 9, 8, 7]
    plain, lp = plain_greedy(model, prompt, 12)
    cache = [RotatingKVCache(max_size=64, keep=0) for _ in model.layers]
    spec = [t for t, _, _ in ngram_speculative_generate_step(mx.array(prompt), model, prompt_cache=cache,
                                                             max_tokens=12, draft_max=3)]
    assert_greedy_equal(plain, lp, spec)
    small = [RotatingKVCache(max_size=8, keep=0) for _ in model.layers]   # wraps: fine without drafts
    out = [t for t, _, _ in ngram_speculative_generate_step(mx.array(prompt), model, prompt_cache=small,
                                                            max_tokens=12, draft_max=0)]
    ref = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=12, sampler=argmax_sampler,
                                            prompt_cache=[RotatingKVCache(max_size=8, keep=0)
                                                          for _ in model.layers])]
    assert out == ref


def test_quantized_kv_cache_is_trimmed_exactly():
    model = tiny_model("llama", head_dim=32, seed=2)     # quantization groups need head_dim >= 32
    prompt = [4, 5, 6, 4, 5, 6, 4]
    quant = lambda: [QuantizedKVCache(group_size=32, bits=8) for _ in model.layers]
    ref = list(generate_step(mx.array(prompt), model, max_tokens=10, sampler=argmax_sampler,
                             prompt_cache=quant()))
    spec = [t for t, _, _ in ngram_speculative_generate_step(
        mx.array(prompt), model, prompt_cache=quant(), max_tokens=10, draft_max=4,
        drafter=ScriptedDrafter([int(t) for t, _ in ref], [(4, 2), (3, None)]))]
    assert_greedy_equal([int(t) for t, _ in ref], [l for _, l in ref], spec)


class OpaqueCache(KVCache):
    """A cache type the rollback does not know: not trimmable, its state in attributes."""

    def is_trimmable(self):
        return False


def test_untrimmable_cache_is_snapshotted_and_replayed():
    model = model_of("llama")
    prompt = [3, 4, 5, 3, 4, 5, 3]
    ref = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=12, sampler=argmax_sampler)]
    cache = [OpaqueCache() for _ in model.layers]
    vc = VerifyCache(model, cache)
    assert vc.replayed == cache and vc.replayed_layers == {"OpaqueCache"}
    vc.close()
    spec = [t for t, _, _ in ngram_speculative_generate_step(
        mx.array(prompt), model, max_tokens=12, draft_max=4, prompt_cache=cache,
        drafter=ScriptedDrafter(ref, [(4, 0), (4, 2), (4, None)]))]
    assert spec == ref


@functools.cache
def recurrent_model(arch):
    return build(arch, seed=1)


@pytest.mark.parametrize("arch", ["mamba", "olmo_hybrid"])
@settings(max_examples=5, deadline=None)
@given(prompt=st.lists(st.integers(0, 63), min_size=1, max_size=12),
       verify=st.lists(st.integers(0, 63), min_size=2, max_size=7), data=st.data())
def test_unknown_recurrent_layers_are_restored_and_replayed(arch, prompt, verify, data):
    """Recurrent layers the GDN recorder does not know (Mamba, olmo_hybrid's GatedDeltaNet) are
    checkpointed before the verify forward; keep(m < S) restores them and re-runs m tokens (their
    layers alone where the model qualifies, else the whole model)."""
    m = data.draw(st.integers(0, len(verify)), label="m")
    model = recurrent_model(arch)
    cache = make_prompt_cache(model)
    model(mx.array([prompt]), cache=cache)
    vc = VerifyCache(model, cache)
    assert vc.replayed and not vc.gdn
    vc.forward(verify)
    vc.keep(m)
    assert vc.n_replays == (0 < m < len(verify))
    vc.close()
    ref = make_prompt_cache(model)
    model(mx.array([prompt + verify[:m]]), cache=ref)
    nxt = model(mx.array([[5, 6]]), cache=cache)
    assert mx.allclose(nxt, model(mx.array([[5, 6]]), cache=ref), atol=ATOL).item()


SHORT_CONV = ["lfm2", "lfm2_moe", "lfm2-vl"]   # ShortConv layers 0 and 2, attention 1 and 3


class CountingModel:
    """A model whose forward calls are counted (a VerifyCache reads ``layers`` and calls the model)."""

    def __init__(self, model):
        self.model, self.calls = model, 0

    @property
    def layers(self):
        return self.model.layers

    def __getattr__(self, name):   # make_cache, args, ...: the model's
        return getattr(self.model, name)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.model(*args, **kwargs)


def assert_caches_equal(a, b):
    """Array-equal live content: every array of an ArraysCache, the first ``offset`` rows of a KVCache."""
    for x, y in zip(a, b):
        if isinstance(x, ArraysCache):
            assert all(mx.array_equal(u, v).item() for u, v in zip(x.cache, y.cache))
        else:
            assert x.offset == y.offset
            assert mx.array_equal(x.keys[..., :x.offset, :], y.keys[..., :y.offset, :]).item()
            assert mx.array_equal(x.values[..., :x.offset, :], y.values[..., :y.offset, :]).item()


@pytest.mark.parametrize("arch", SHORT_CONV)
@settings(max_examples=3, deadline=None)
@given(prompt=st.lists(st.integers(0, 63), min_size=1, max_size=12),
       verify=st.lists(st.integers(0, 63), min_size=2, max_size=7))
def test_short_conv_window_is_cut_from_the_record_without_a_second_forward(arch, prompt, verify):
    """lfm2's ShortConv caches only its conv window (the last K - 1 gated inputs): keep(m) cuts it from the
    input the conv saw in the verify forward, one model forward in all for every m (before: restored and
    re-run, a second forward for 0 < m < S), and every cache is then array-equal to mlx-lm's own forward
    over exactly the m kept tokens from the same state."""
    model = recurrent_model(arch)
    for m in range(len(verify) + 1):
        cache = make_prompt_cache(model)
        model(mx.array([prompt]), cache=cache)
        counted = CountingModel(model)
        vc = VerifyCache(counted, cache)
        assert len(vc.conv) == 2 and not vc.replayed
        vc.forward(verify)
        vc.keep(m)
        assert counted.calls == 1 and vc.n_replays == 0
        vc.close()
        ref = make_prompt_cache(model)
        model(mx.array([prompt]), cache=ref)
        if m:
            model(mx.array([verify[:m]]), cache=ref)
        assert_caches_equal(cache, ref)


@pytest.mark.parametrize("arch", SHORT_CONV)
def test_short_conv_speculative_greedy_equals_plain_without_a_second_forward(arch, monkeypatch):
    """Drafts all accepted, partly accepted and rejected on lfm2-family models: plain greedy's tokens, and
    no keep() re-runs the model (before: every partial acceptance replayed the kept tokens)."""
    model = recurrent_model(arch)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 3, 1, 4]
    plain, _ = plain_greedy(model, prompt, 20)
    keeps = []   # (m, S, second forwards) of every keep
    keep = VerifyCache.keep

    def counted_keep(self, m):
        S, before = self.S, self.n_replays
        keep(self, m)
        keeps.append((m, S, self.n_replays - before))
    monkeypatch.setattr(VerifyCache, "keep", counted_keep)
    spec = [t for t, _, _ in ngram_speculative_generate_step(
        mx.array(prompt), model, max_tokens=20, draft_max=4,
        drafter=ScriptedDrafter(plain, [(4, None), (4, 2), (4, 0)]))]
    assert spec == plain
    assert {"all", "part", "none"} <= {"all" if m == S else "none" if m == 1 else "part" for m, S, _ in keeps if S > 1}
    assert all(n == 0 for _, _, n in keeps)


def test_short_conv_is_recorded_only_if_its_cache_is_its_conv_window():
    """Recognition is by what the cache holds: a ShortConv whose cache is not the conv's last K - 1 input
    rows (here: kept halved, doubled back before use) is replayed, and still exact; the unchanged ShortConv
    layer is recorded."""
    from mlx_lm.models import lfm2

    class Halved(lfm2.ShortConv):
        def __call__(self, x, mask=None, cache=None):
            if cache is not None and cache[0] is not None:
                cache[0] = 2 * cache[0]
            out = super().__call__(x, mask, cache)
            if cache is not None:
                cache[0] = 0.5 * cache[0]
            return out

    model = build("lfm2", seed=4)
    model.layers[0].conv.__class__ = Halved
    assert_replayed_and_exact(model, "conv", "Halved")


def assert_replayed_and_exact(model, recorded: str, replayed: str) -> None:
    """One layer of ``model`` (class ``replayed``) is replayed, one is recorded (``VerifyCache.<recorded>``),
    and speculative greedy with drafts partly and wholly rejected equals plain greedy."""
    prompt = [1, 2, 3, 1, 2, 3, 1]
    ref = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=12, sampler=argmax_sampler)]
    vc = VerifyCache(model, make_prompt_cache(model))
    assert len(getattr(vc, recorded)) == 1 and vc.replayed_layers == {replayed}   # layer 2 is recorded
    vc.close()
    spec = [t for t, _, _ in ngram_speculative_generate_step(
        mx.array(prompt), model, max_tokens=12, draft_max=4,
        drafter=ScriptedDrafter(ref, [(4, 1), (4, None)]))]
    assert spec == ref


def test_gdn_layer_is_recorded_only_if_it_computes_what_the_recorder_computes():
    """Recognition is by computation: a layer with qwen3_5's modules whose forward differs
    (here: output doubled) is not recorded but replayed, and still exact."""
    from mlx_lm.models import qwen3_5

    class Doubled(qwen3_5.GatedDeltaNet):
        def __call__(self, inputs, mask=None, cache=None):
            return 2 * super().__call__(inputs, mask, cache)

    model = tiny_model("qwen3_5", seed=4)
    own = model.layers[0].linear_attn
    assert gdn_projections(own) is not None
    own.__class__ = Doubled
    try:
        assert gdn_projections(own) is None
        assert_replayed_and_exact(model, "gdn", "Doubled")
    finally:
        own.__class__ = qwen3_5.GatedDeltaNet


def test_batched_arrays_cache_is_refused():
    model = model_of("qwen3_5")
    cache = make_prompt_cache(model)
    cache[0].left_padding = mx.array([1, 0])
    with pytest.raises(RollbackUnsupported, match="batched ArraysCache"):
        VerifyCache(model, cache)


def test_any_model_runs_with_draft_max_zero():
    """draft_max=0 needs no rollback, so even an unsupported cache generates (plain decoding)."""
    model = model_of("llama")

    class Plain(KVCache):
        def is_trimmable(self):
            return False
    prompt = [1, 2, 3]
    out = [t for t, _, _ in ngram_speculative_generate_step(mx.array(prompt), model, max_tokens=6,
                                                            draft_max=0,
                                                            prompt_cache=[Plain() for _ in model.layers])]
    assert out == plain_greedy(model, prompt, 6)[0]


# -- long verifies: S = 65 (k = 64), GDN states checkpointed every c tokens -------------------------

@settings(max_examples=25, deadline=None)
@given(gdn_path=st.sampled_from(GDN_PATHS), every=st.sampled_from([None, 1, 2, 7, 16, 64, 65]),
       prompt=st.lists(st.integers(0, 63), min_size=1, max_size=8), data=st.data())
def test_keep_m_after_a_verify_of_65_equals_processing_only_m_tokens(gdn_path, every, prompt, data):
    """S = 65 on the tiny qwen3_5 model, any checkpoint interval c (None: the memory budget's):
    keep(m) leaves the cache of a forward over the first m tokens, for m on and between checkpoints."""
    verify = data.draw(st.lists(st.integers(0, 63), min_size=65, max_size=65), label="verify")
    m = data.draw(st.sampled_from([0, 1, 6, 7, 8, 15, 16, 17, 33, 63, 64, 65]), label="m")
    model = model_of("qwen3_5")
    cache = make_prompt_cache(model)
    model(mx.array([prompt]), cache=cache)
    vc = VerifyCache(model, cache, gdn_path, gdn_checkpoint_every=every)
    logits = vc.forward(verify)
    if gdn_path == "states":
        rec = vc.records[0]
        c = every or 1
        assert rec.every == c and sorted(rec.states) == list(range(c, 65, c))   # checkpoints only
    vc.keep(m)
    ref = make_prompt_cache(model)
    model(mx.array([prompt]), cache=ref)
    assert mx.allclose(logits, model(mx.array([verify]), cache=ref)[0], atol=ATOL).item()
    ref = make_prompt_cache(model)
    model(mx.array([prompt + verify[:m]]), cache=ref)
    assert_caches_close(cache, ref)
    vc.close()


def test_checkpointed_state_is_bit_identical_to_the_kept_one():
    """The recompute from a checkpoint runs the forward's own one-token updates: the same numbers."""
    model = model_of("qwen3_5")
    verify = [(7 * i + 3) % 64 for i in range(65)]
    states = {}
    for every in (1, 16):
        cache = make_prompt_cache(model)
        model(mx.array([[1, 2, 3]]), cache=cache)
        vc = VerifyCache(model, cache, "states", gdn_checkpoint_every=every)
        vc.forward(verify)
        vc.keep(40)
        states[every] = [(c[0], c[1]) for c in cache if isinstance(c, ArraysCache)]
        vc.close()
    for (a0, a1), (b0, b1) in zip(states[1], states[16]):
        assert mx.array_equal(a0, b0).item() and mx.array_equal(a1, b1).item()


def test_default_checkpoint_interval_bounds_the_kept_states(monkeypatch):
    """The budget decides c: a budget of 3 states' bytes keeps at most 3 per-token states of S = 65."""
    from mlx_backend.decode import rollback

    model = model_of("qwen3_5")
    cache = make_prompt_cache(model)
    vc = VerifyCache(model, cache, "states")
    monkeypatch.setattr(rollback, "GDN_STATE_BUDGET", 3 * vc.state_bytes)
    monkeypatch.setattr(rollback.checkpoint_interval, "__defaults__", (3 * vc.state_bytes,))
    vc.forward(list(range(65)))
    for rec in vc.records:
        assert len(rec.states) <= 3 and rec.every == 22
    vc.keep(30)
    vc.close()
    assert rollback.checkpoint_interval(65, 144 * 2 ** 20, 512 * 2 ** 20) == 18


@settings(max_examples=12, deadline=None)
@given(gdn_path=st.sampled_from(GDN_PATHS), every=st.sampled_from([None, 5, 16]),
       script=st.lists(st.tuples(st.integers(0, 64), st.one_of(st.none(), st.integers(0, 63))),
                       min_size=1, max_size=4),
       prompt=st.lists(st.integers(0, 63), min_size=1, max_size=12))
def test_drafts_of_64_equal_plain_greedy(gdn_path, every, script, prompt):
    """Speculative greedy with k = 64 (scripted drafts: right up to a chosen position, or all right)
    on the tiny qwen3_5 model gives plain greedy's tokens."""
    import mlx_backend.decode.generate as generate

    model = model_of("qwen3_5")
    max_tokens = 150
    plain, plain_lp = plain_greedy(model, prompt, max_tokens)
    drafter = ScriptedDrafter(plain, script)
    original = generate.VerifyCache
    generate.VerifyCache = lambda m, c, p: original(m, c, p, gdn_checkpoint_every=every)
    try:
        spec = [t for t, _, _ in ngram_speculative_generate_step(mx.array(prompt), model, max_tokens=max_tokens,
                                                                 draft_max=64, drafter=drafter, gdn_path=gdn_path)]
    finally:
        generate.VerifyCache = original
    assert_greedy_equal(plain, plain_lp, spec)


LAYER_REPLAYED = ["mamba2", "jamba", "granitemoehybrid", "rwkv7", "falcon_h1"]


def live_arrays(cache):
    """Every array a cache holds for the tokens it has seen: each ArraysCache entry, the first ``offset``
    rows of a KV cache (also inside a CacheList)."""
    out = []
    for top in cache:
        for c in (top.caches if hasattr(top, "caches") else [top]):
            if isinstance(c, ArraysCache):
                out += [a for a in c.cache if a is not None]
            else:
                out += [c.keys[..., :c.offset, :], c.values[..., :c.offset, :]]
    return out


@pytest.mark.parametrize("arch", LAYER_REPLAYED)
def test_replayed_layers_rerun_alone_every_m(arch):
    """Mamba / Mamba2 / RWKV7 / Falcon-H1 layers (caches neither recorder knows): keep(m) re-runs only the
    decoder layers holding them, on the first m positions of what they got in the verify forward, and
    the model is called once in all (before: a second model forward for every 0 < m < S). Every cache is
    then array-equal to mlx-lm's own forward over exactly the m kept tokens from the same state."""
    model = recurrent_model(arch)
    prompt, verify = [3, 1, 4, 1, 5, 9, 2], [6, 5, 3, 5, 8, 9, 7, 9]
    for m in range(len(verify) + 1):
        cache = make_prompt_cache(model)
        model(mx.array([prompt]), cache=cache)
        counted = CountingModel(model)
        vc = VerifyCache(counted, cache)   # may drive the model (the once-per-class check)
        assert vc.replayed
        counted.calls = 0
        vc.forward(verify)
        vc.keep(m)
        assert counted.calls == 1
        assert vc.n_replays == getattr(vc, "n_layer_replays", 0) == (0 < m < len(verify))
        vc.close()
        ref = make_prompt_cache(model)
        model(mx.array([prompt]), cache=ref)
        if m:
            model(mx.array([verify[:m]]), cache=ref)
        mine, theirs = live_arrays(cache), live_arrays(ref)
        assert len(mine) == len(theirs)
        assert all(a.shape == b.shape and mx.array_equal(a, b).item() for a, b in zip(mine, theirs))
        nxt = model(mx.array([[5, 6]]), cache=cache)
        assert mx.array_equal(nxt, model(mx.array([[5, 6]]), cache=ref)).item()


def _count_keeps(monkeypatch):
    keeps = []   # (m, S, full replays, layer replays) of every keep
    keep = VerifyCache.keep

    def counted_keep(self, m):
        S, full, local = self.S, self.n_replays, getattr(self, "n_layer_replays", 0)
        keep(self, m)
        layer = getattr(self, "n_layer_replays", 0) - local
        keeps.append((m, S, self.n_replays - full - layer, layer))
    monkeypatch.setattr(VerifyCache, "keep", counted_keep)
    return keeps


@pytest.mark.parametrize("arch", LAYER_REPLAYED)
def test_layer_replay_speculative_greedy_equals_plain(arch, monkeypatch):
    """Drafts all accepted, partly accepted and rejected: plain greedy's tokens, every partial acceptance
    re-running only the replayed layers (no keep re-runs the model; before: each one did)."""
    model = recurrent_model(arch)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 3, 1, 4]
    plain, _ = plain_greedy(model, prompt, 20)
    VerifyCache(model, make_prompt_cache(model)).close()   # the once-per-class check runs here (its own keeps)
    keeps = _count_keeps(monkeypatch)
    spec = [t for t, _, _ in ngram_speculative_generate_step(
        mx.array(prompt), model, max_tokens=20, draft_max=4,
        drafter=ScriptedDrafter(plain, [(4, None), (4, 2), (4, 0)]))]
    assert spec == plain
    kinds = {"all" if m == S else "none" if m == 1 else "part" for m, S, _, _ in keeps if S > 1}
    assert {"all", "part", "none"} <= kinds
    assert all(full == 0 for _, _, full, _ in keeps)
    assert all(local == (0 < m < S) for m, S, _, local in keeps if S > 1)


def test_layer_replay_is_refused_to_a_layer_with_unknown_arguments(monkeypatch):
    """Unknown structure keeps the full replay: Mamba2 layers given an argument the cutter does not know how
    to cut to m tokens (here a 1-D position array) are not re-run alone (the once-per-class check finds
    the layer-local keep falling back), every keep(m < S) re-runs the model, and speculation stays exact."""
    from mlx_lm.models import mamba2

    class WithPositions(mamba2.ResidualBlock):
        def __call__(self, x, mask=None, cache=None, positions=None):
            return super().__call__(x, mask, cache)

    class Positioned(mamba2.Mamba2):
        def __call__(self, x, cache=None):
            hidden = self.embeddings(x)
            positions = mx.arange(x.shape[1])
            for layer, c in zip(self.layers, cache or [None] * len(self.layers)):
                hidden = layer(hidden, None, c, positions=positions)
            return self.norm_f(hidden)

    model = build("mamba2", seed=5)
    model.backbone.__class__ = Positioned
    for layer in model.layers:
        layer.__class__ = WithPositions
    vc = VerifyCache(model, make_prompt_cache(model))
    assert vc.replayed and getattr(vc, "layer_replay", None) is False
    vc.close()
    prompt = [1, 2, 3, 1, 2, 3, 1]
    plain, _ = plain_greedy(model, prompt, 12)
    keeps = _count_keeps(monkeypatch)
    spec = [t for t, _, _ in ngram_speculative_generate_step(
        mx.array(prompt), model, max_tokens=12, draft_max=4, drafter=ScriptedDrafter(plain, [(4, 1), (4, None)]))]
    assert spec == plain
    assert any(full for _, _, full, _ in keeps) and not any(local for _, _, _, local in keeps)
