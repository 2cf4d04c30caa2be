"""BatchVerifyCache: a batched verify forward scores every row as the solo VerifyCache does, and keep(m)
leaves each row's cache as its own m tokens would, checked against the solo path and against a fresh
forward over each row's whole kept history; unsupported caches fail naming the cache class."""
from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache

from mlx_backend.batch import verify
from mlx_backend.batch.verify import BatchVerifyCache
from mlx_backend.decode.rollback import RollbackUnsupported, VerifyCache
from mlx_backend.models.compat import build
from mlx_backend.models.tiny import CONFIGS, tiny_model

# batch vs solo VerifyCache: the same ops on the same numbers (measured: bitwise equal for llama, qwen3_5,
# qwen3_next; sliding-window layers attend a differently laid out key set: measured up to 1.1e-5)
ATOL = {"gemma3_text": 1e-4, "gemma3n": 1e-4}
ATOL_DEFAULT = 1e-5
ATOL_FRESH = 1e-4   # vs a fresh forward over the whole history: a prefill computes in another order
V = 64


@functools.cache
def models(arch: str, seed: int = 3):
    """Two identical models: one for the batch, one for the solo reference (the GDN recorder state lives
    on the layer instances, so the two paths must not share them). Architectures without a
    :mod:`~mlx_backend.models.tiny` config are the compatibility matrix's tiny models."""
    make = tiny_model if arch in CONFIGS else build
    return make(arch, seed=seed), make(arch, seed=seed)


def prefilled(model, prompt):
    cache = make_prompt_cache(model)
    if len(prompt) > 1:
        model(mx.array(prompt[:-1], mx.uint32)[None], cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def batch_of(model, prompts):
    solo = [prefilled(model, p) for p in prompts]
    return [solo[0][i].merge([s[i] for s in solo]) for i in range(len(solo[0]))]


def fresh_last_logits(model, tokens):
    """The logits after ``tokens`` from an empty cache (prefill, then the last token alone)."""
    cache = prefilled(model, tokens)
    return model(mx.array(tokens[-1:], mx.uint32)[None], cache=cache)[0, -1]


def run_steps(arch, seed, n_steps, gdn_path="states"):
    """Random prompts (some of length 1), random per-row lengths and m for n_steps verify steps; checks
    logits per row against the solo path each step, then a one-token step against a fresh forward."""
    rng = np.random.default_rng(seed)
    atol = ATOL.get(arch, ATOL_DEFAULT)
    B = int(rng.integers(1, 5))
    prompts = [rng.integers(0, V, int(rng.integers(1, 12))).tolist() for _ in range(B)]
    bmodel, smodel = models(arch)
    bvc = BatchVerifyCache(bmodel, batch_of(bmodel, prompts), gdn_path)
    solo = [VerifyCache(smodel, prefilled(smodel, p), gdn_path) for p in prompts]
    kept = [list(p) for p in prompts]   # row b's tokens, the last one not yet in the cache
    try:
        for _ in range(n_steps):
            lengths = rng.integers(1, 7, B).tolist()
            S = max(lengths)
            rows = [[kept[b][-1]] + rng.integers(0, V, lengths[b] - 1).tolist() for b in range(B)]
            logits = bvc.forward([r + [0] * (S - len(r)) for r in rows], lengths)
            assert logits.shape == (B, S, V)
            m = [int(rng.integers(1, n + 1)) for n in lengths]
            mx.eval(logits)
            bvc.keep(m)
            for b in range(B):
                ref = solo[b].forward(rows[b], record=True)
                solo[b].keep(m[b])
                assert mx.allclose(logits[b, :lengths[b]], ref, atol=atol, rtol=0).item(), (b, lengths, m)
                # the next input: a fresh token after the kept ones (kept: rows[b][:m[b]])
                kept[b] = kept[b][:-1] + rows[b][:m[b]] + [int(rng.integers(0, V))]
        one = bvc.forward([[k[-1]] for k in kept], [1] * B)
        bvc.keep([1] * B)
        for b in range(B):
            ref = solo[b].forward(kept[b][-1:])
            assert mx.allclose(one[b, 0], ref[0], atol=atol, rtol=0).item()
            assert mx.allclose(one[b, 0], fresh_last_logits(smodel, kept[b]), atol=ATOL_FRESH, rtol=0).item()
    finally:
        bvc.close()
        for s in solo:
            s.close()
    return bvc


@pytest.mark.parametrize("arch", ["llama", "qwen3_5", "gemma3_text"])
@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2 ** 31 - 1))
def test_batch_matches_solo(arch, seed):
    run_steps(arch, seed, n_steps=3)


@pytest.mark.parametrize("arch,gdn_path", [("qwen3_next", "states"), ("qwen3_5", "replay")])
def test_other_gdn_layout_and_replay_path(arch, gdn_path):
    for seed in (1, 2):
        run_steps(arch, seed, n_steps=3, gdn_path=gdn_path)


@pytest.mark.parametrize("arch", ["lfm2", "lfm2_moe"])
def test_short_conv_rows_match_solo(arch):
    """lfm2's ShortConv caches (before: refused, "not a known GatedDeltaNet") verify and cut back per row."""
    for seed in (1, 2):
        run_steps(arch, seed, n_steps=3)


def test_short_conv_windows_are_cut_per_row_in_one_forward():
    """Each row's ShortConv window after keep(m) is the one mlx-lm's own forward over that row's m tokens
    leaves (array-equal), with a single model forward (the window is cut from the conv's recorded input)."""
    model, _ = models("lfm2")
    prompts = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10]]
    rows, lengths, m = [[5, 11, 12, 13], [7, 14, 0, 0], [10, 15, 16, 0]], [4, 2, 3], [2, 2, 1]
    calls = []

    class Counting:
        layers = model.layers

        def __call__(self, *args, **kwargs):
            calls.append(1)
            return model(*args, **kwargs)
    cache = batch_of(model, prompts)
    bvc = BatchVerifyCache(Counting(), cache)
    assert len(bvc.conv) == 2 and not bvc.gdn
    bvc.forward(rows, lengths)
    bvc.keep(m)
    bvc.close()
    assert len(calls) == 1
    for b, prompt in enumerate(prompts):
        solo = prefilled(model, prompt)
        model(mx.array([rows[b][:m[b]]], mx.uint32), cache=solo)
        for c, ref in zip(cache, solo):
            if isinstance(c, ArraysCache):
                assert mx.array_equal(c[0][b:b + 1], ref[0]).item(), b


REPLAYED = ["mamba", "mamba2", "rwkv7", "jamba", "nemotron_h", "granitemoehybrid"]
ATOL_STEPS = 1e-4   # vs plain one-token steps: a verify forward computes the recurrence over S tokens at once


def one_token_steps(model, tokens):
    """The caches after ``tokens`` fed one at a time (mlx-lm's plain decode steps) from an empty cache."""
    cache = make_prompt_cache(model)
    for t in tokens:
        mx.eval(model(mx.array([[t]], mx.uint32), cache=cache))
    return cache


@pytest.mark.parametrize("arch", REPLAYED)
def test_replayed_recurrent_rows_are_cut_back_per_row_as_one_token_steps_leave_them(arch):
    """Mamba / Mamba2 / RWKV7 layers and hybrids' mamba layers (before: refused, "neither a known GatedDeltaNet
    nor a short conv"): three right-padded rows of lengths 5, 3, 4, keep(5, 1, 4) (all kept; a cut; every real
    token kept after padding that advanced the state), then lengths 3, 5, 2, keep(2, 5, 2): each row's
    recurrent caches and its next token's logits equal its kept tokens fed one at a time."""
    model, _ = models(arch)
    prompts = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10]]
    cache = batch_of(model, prompts)
    bvc = BatchVerifyCache(model, cache)
    assert bvc.replayed
    kept = [p[:-1] for p in prompts]
    last = [p[-1] for p in prompts]
    for lengths, m in (([5, 3, 4], [5, 1, 4]), ([3, 5, 2], [2, 5, 2])):
        S = max(lengths)
        rows = [[last[b]] + [(11 + 7 * b + 3 * j) % V for j in range(n - 1)] for b, n in enumerate(lengths)]
        mx.eval(bvc.forward([r + [0] * (S - len(r)) for r in rows], lengths))
        bvc.keep(m)
        for b in range(3):
            kept[b] += rows[b][:m[b]]
            last[b] = (40 + b) % V
    one = bvc.forward([[t] for t in last], [1, 1, 1])
    bvc.keep([1, 1, 1])
    bvc.close()
    for b in range(3):
        ref = one_token_steps(model, kept[b] + [last[b]])
        for c, r in zip(cache, ref):
            if type(c) is ArraysCache:
                for x, y in zip(c.cache, r.cache):
                    assert mx.allclose(x[b:b + 1], y, atol=ATOL_STEPS, rtol=0).item(), (b, kept[b])
        logits = model(mx.array([[last[b]]], mx.uint32), cache=one_token_steps(model, kept[b]))[0, -1]
        assert mx.allclose(one[b, 0], logits, atol=ATOL_STEPS, rtol=0).item(), b


@pytest.mark.parametrize("arch", REPLAYED + ["bailing_hybrid", "plamo2", "recurrent_gemma"])
def test_replayed_recurrent_rows_match_solo(arch):
    """Random rows, lengths and cuts against the single-sequence VerifyCache (its layer replay)."""
    run_steps(arch, 1, n_steps=3)


def test_a_recurrent_layer_sharing_its_cache_or_failing_the_check_is_refused(monkeypatch):
    """falcon_h1's mamba cache shares a CacheList with a KV cache: no layer to re-run alone; a layer class
    that fails :func:`batch_layer_replay_refusal` is refused too, the refusal saying why."""
    falcon, _ = models("falcon_h1")
    with pytest.raises(RollbackUnsupported, match="FalconH1Mixer.*CacheList.*one request at a time"):
        BatchVerifyCache(falcon, batch_of(falcon, [[1, 2]]))
    mamba, _ = models("mamba")
    monkeypatch.setitem(verify._BATCH_LAYER_REPLAY, verify._layer_classes(mamba), "a planted reason")
    with pytest.raises(RollbackUnsupported,
                       match="MambaBlock.*batched layer-replay check.*a planted reason.*one request at a time"):
        BatchVerifyCache(mamba, batch_of(mamba, [[1, 2]]))
    # longcat_flash_ngram's caches: mlx-lm cannot merge the check's rows (prompts of different lengths); the
    # refusal says what the check raised, not that caches differed
    longcat, _ = models("longcat_flash_ngram")
    with pytest.raises(RollbackUnsupported, match=r"layer-replay check \(batch_layer_replay_refusal: it raised "
                                                  r"ValueError: .*broadcast.*\): decode one request at a time"):
        BatchVerifyCache(longcat, batch_of(longcat, [[1, 2]]))


def test_a_recurrent_call_keep_cannot_cut_is_refused_before_any_state_moves(monkeypatch):
    """A recorded argument the per-row cut does not know (planted: every argument unknown) refuses keep, naming
    the layer class, before any row's state is put back: the recurrent caches hold the forward's state."""
    mamba, _ = models("mamba")
    cache = batch_of(mamba, [[1, 2, 3], [4, 5]])
    bvc = BatchVerifyCache(mamba, cache)
    mx.eval(bvc.forward([[3, 6, 7], [5, 8, 0]], [3, 2]))
    after_forward = [list(c.cache) for c in cache]
    monkeypatch.setattr(verify, "_first_rows", lambda *args: verify._UNKNOWN)
    with pytest.raises(RollbackUnsupported, match="ResidualBlock.*one request at a time"):
        bvc.keep([1, 2])
    bvc.close(align=False)
    assert all(x is y for now, then in zip(cache, after_forward) for x, y in zip(now.cache, then))


def test_sliding_window_rows_after_the_ring_wraps():
    """gemma3_text's window is 8: 6 steps of up to 6 tokens on prompts of up to 11 wrap every row's ring."""
    for seed in (11, 12, 13):
        run_steps("gemma3_text", seed, n_steps=6)


def test_kv_shared_layers_reading_a_sliding_window_cache():
    """gemma3n's KV-shared layers read another layer's BatchRotatingKVCache with ``keys_and_values()`` after
    that layer's update: in a verify forward they get the ring's rows and the new ones, as
    ``update_and_fetch`` returned them (before: the ring's rows only, a shape error at every verify
    forward), through and past the ring's wrap."""
    for seed in (11, 12):
        run_steps("gemma3n", seed, n_steps=6)


def test_keep_moves_no_key_and_ends_rows_apart():
    """keep(m) with different m per row: each row ends at its own column, offset = the row's real length,
    and the keys already cached stay where they were (nothing rolled)."""
    model, _ = models("llama")
    cache = batch_of(model, [[1, 2, 3], [4]])          # cached: 2 and 0 tokens
    bvc = BatchVerifyCache(model, cache)
    c = cache[0]
    before = np.array(c.keys[..., :c._idx, :])
    bvc.forward([[3, 9, 9, 9], [4, 5, 0, 0]], [4, 2])
    bvc.keep([2, 1])                                   # rows keep 2 and 1 tokens
    assert c.offset.tolist() == [4, 1]
    lp = c.left_padding.tolist()
    assert [e - p for e, p in zip(c._ngram_ends, lp)] == [4, 1]
    assert np.array_equal(np.array(c.keys[..., :before.shape[2], :]), before)
    bvc.close()                                        # mlx-lm's own layout again: right-aligned rows
    assert [c._idx - p for p in c.left_padding.tolist()] == [4, 1] and not hasattr(c, "_ngram_ends")


def test_trim_of_rows_ended_apart_trims_every_row():
    """mlx-lm's trim(n) on rows that end apart takes n keys off every row, as trim_rows([n] * B) does."""
    model, _ = models("llama")
    cache = batch_of(model, [[1, 2, 3], [4]])
    bvc = BatchVerifyCache(model, cache)
    bvc.forward([[3, 9, 9, 9], [4, 5, 0, 0]], [4, 2])
    bvc.keep([4, 1])                                   # ends apart: real lengths 6 and 1
    c = cache[0]
    assert c.trim(1) == 1
    assert c.offset.tolist() == [5, 0]
    assert [e - p for e, p in zip(c._ngram_ends, c.left_padding.tolist())] == [5, 0]
    bvc.close()


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_extract_and_join_after_rows_ended_apart(arch):
    """After a keep that ends the rows apart, extract(b) holds row b's real keys exactly (as its solo cache),
    and a new row joined with extend (the rows right-aligned again) decodes as alone."""
    model, smodel = models(arch)
    prompts = [[1, 2, 3, 4, 5], [6, 7]]
    cache = batch_of(model, prompts)
    bvc = BatchVerifyCache(model, cache)
    solo = [VerifyCache(smodel, prefilled(smodel, p), "states") for p in prompts]
    rows = [[5, 11, 12, 13], [7, 14, 0, 0]]
    bvc.forward(rows, [4, 2])
    bvc.keep([3, 1])
    for b, (r, m) in enumerate(zip(rows, [3, 1])):
        solo[b].forward(r[:[4, 2][b]], record=True)
        solo[b].keep(m)
        mine = [layer.extract(b) for layer in cache]
        for got, want in zip(mine, solo[b].cache):
            if type(want) is KVCache:   # gemma3_text's sliding-window layers are RotatingKVCache
                assert got.offset == want.offset
                assert np.array_equal(np.array(got.keys), np.array(want.keys[..., :want.offset, :]))
    new = [3, 8, 9]
    joined = batch_of(model, [new])
    for layer, more in zip(cache, joined):
        layer.extend(more)
    kept = [[1, 2, 3, 4, 5, 11, 12], [6, 7]]
    one = bvc.forward([[20], [21], [9]], [1, 1, 1])
    bvc.keep([1, 1, 1])
    for b, toks in enumerate(kept + [new[:-1]]):
        last = [20, 21, 9][b]
        want = fresh_last_logits(smodel, toks + [last])
        assert mx.allclose(one[b, 0], want, atol=ATOL_FRESH, rtol=0).item(), b
    bvc.close()
    for s in solo:
        s.close()


def test_bad_arguments():
    model, _ = models("llama")
    bvc = BatchVerifyCache(model, batch_of(model, [[1, 2], [3]]))
    with pytest.raises(ValueError, match="lengths"):
        bvc.forward([[1, 2], [3, 0]], [2, 3])
    with pytest.raises(ValueError, match="rows"):
        bvc.forward([[1, 2]], [2])
    with pytest.raises(ValueError, match="forward"):
        bvc.keep([1, 1])
    bvc.forward([[2, 5], [3, 0]], [2, 1])
    with pytest.raises(ValueError, match="m"):
        bvc.keep([1, 2])


def test_keep_rebuilds_a_sliding_window_cache_as_merge_does():
    """Per row: the last min(tokens, window) keys right-aligned, offset = the row's length, not rotated."""
    model, _ = models("gemma3_text")                     # window 8
    cache = batch_of(model, [list(range(1, 12)), [4]])  # cached: 10 and 0 tokens
    bvc = BatchVerifyCache(model, cache)
    bvc.forward([[11, 9, 9, 9], [4, 5, 0, 0]], [4, 2])
    bvc.keep([3, 2])
    c = cache[0]
    assert type(c).__name__.endswith("BatchRotatingKVCache") and not c.rotated
    assert c.offset.tolist() == [13, 2] and c._idx == c._offset == 8 and c.keys.shape[2] == 8
    assert c.left_padding.tolist() == [0, 6]
    bvc.close()
    assert type(c).__name__ == "BatchRotatingKVCache"


def test_unsupported_caches_raise_naming_the_class():
    llama4 = tiny_model("llama4")
    with pytest.raises(RollbackUnsupported, match="ChunkedKVCache"):
        BatchVerifyCache(llama4, make_prompt_cache(llama4))
    gemma = tiny_model("gemma3_text")
    with pytest.raises(RollbackUnsupported, match="RotatingKVCache.*merge"):
        BatchVerifyCache(gemma, make_prompt_cache(gemma))
    llama, _ = models("llama")
    with pytest.raises(RollbackUnsupported, match="KVCache.*merge"):
        BatchVerifyCache(llama, make_prompt_cache(llama))
    qwen, _ = models("qwen3_5")
    cache = batch_of(qwen, [[1, 2, 3], [4, 5]])
    gdn = next(c for c in cache if isinstance(c, ArraysCache))
    gdn.left_padding = mx.array([0, 2])
    bvc = BatchVerifyCache(qwen, cache)
    with pytest.raises(RollbackUnsupported, match="left_padding"):
        bvc.forward([[3], [5]], [1, 1])
    gdn.left_padding, gdn.lengths = None, mx.array([1, 1])
    with pytest.raises(RollbackUnsupported, match="lengths"):
        bvc.forward([[3], [5]], [1, 1])
    gdn.lengths = None
    cache[1].prepare(right_padding=[0, 1])
    with pytest.raises(RollbackUnsupported, match="BatchKVCache.*finalize"):
        bvc.forward([[3], [5]], [1, 1])
    bvc.close()


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next", "mamba2", "jamba"])
def test_a_batch_and_a_solo_verify_on_one_model_keep_their_own_records(arch):
    """A batch verify and a single-sequence verify on the same model (its GatedDeltaNet layers shared),
    forward, forward, keep, keep: each cuts its cache to its own states (before, the record lived on the
    layer: the second forward replaced the first's, which the batch then cut its rows to). Mamba layers:
    the decoder layers' recorded calls, likewise, are the batch's own."""
    model = models(arch)[0]
    prompts, solo_prompt = [[1, 2, 3], [4, 5, 6, 7, 8]], [9, 10, 11, 12]
    bvc = BatchVerifyCache(model, batch_of(model, prompts), "states")
    svc = VerifyCache(model, prefilled(model, solo_prompt), "states")
    rows, solo_row = [[3, 20, 21, 22], [8, 23, 24, 25]], [12, 26, 27, 28, 29]
    try:
        bvc.forward(rows, [4, 4])
        svc.forward(solo_row, record=True)
        bvc.keep([2, 3])
        svc.keep(4)
        one = bvc.forward([[30], [31]], [1, 1])
        bvc.keep([1, 1])
        solo_one = svc.forward([32])
    finally:
        bvc.close()
        svc.close()
    kept = [prompts[0][:-1] + rows[0][:2] + [30], prompts[1][:-1] + rows[1][:3] + [31]]
    for b in range(2):
        assert mx.allclose(one[b, 0], fresh_last_logits(model, kept[b]), atol=ATOL_FRESH, rtol=0).item(), b
    fresh = fresh_last_logits(model, solo_prompt[:-1] + solo_row[:4] + [32])
    assert mx.allclose(solo_one[0], fresh, atol=ATOL_FRESH, rtol=0).item()


def test_a_solo_run_closed_between_a_batch_forward_and_its_keep():
    """A single-sequence verify on the same mamba2 model, closed (its decoder layers given their own class
    back) between the batch's forward and keep: the batch re-runs its rows with mlx-lm's class it recorded."""
    model = models("mamba2")[0]
    prompts, rows = [[1, 2, 3], [4, 5, 6, 7, 8]], [[3, 20, 21, 22], [8, 23, 24, 25]]
    bvc = BatchVerifyCache(model, batch_of(model, prompts))
    try:
        bvc.forward(rows, [4, 4])
        svc = VerifyCache(model, prefilled(model, [9, 10, 11]))
        svc.forward([11, 12, 13])
        svc.keep(2)
        svc.close()
        bvc.keep([2, 3])
        one = bvc.forward([[30], [31]], [1, 1])
        bvc.keep([1, 1])
    finally:
        bvc.close()
    kept = [prompts[0][:-1] + rows[0][:2] + [30], prompts[1][:-1] + rows[1][:3] + [31]]
    for b in range(2):
        assert mx.allclose(one[b, 0], fresh_last_logits(model, kept[b]), atol=ATOL_FRESH, rtol=0).item(), b


def test_a_verify_forward_reads_a_ring_that_plain_steps_wrapped():
    """mlx-lm's own one-token steps of the batch (the decoder's pipelined plain steps) wrap a sliding-window
    ring (gemma3_text's window is 8; the ring is then ``rotated``, its write index mid-buffer); a verify
    forward must read the ring in temporal order: every real position's logits, and the next token's after
    keep(m), equal a fresh forward over the row's whole history."""
    from mlx_lm.models.cache import BatchRotatingKVCache

    model, _ = models("gemma3_text")
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8]]
    cache = batch_of(model, prompts)
    bvc = BatchVerifyCache(model, cache)
    history = [list(p) for p in prompts]                    # row b's tokens; the last one not yet fed
    try:
        for step in range(11):                              # plain steps: 11 tokens per row, the ring wraps
            bvc.check_state()
            model(mx.array([[h[-1]] for h in history], mx.uint32), cache=cache)
            for b, h in enumerate(history):
                h.append((7 * step + 13 * b + 5) % V)
        rings = [c for c in cache if isinstance(c, BatchRotatingKVCache)]
        assert rings and all(c.rotated and 0 < c._idx < c.max_size for c in rings)
        rows = [[history[0][-1], 40, 41, 42], [history[1][-1], 43, 0, 0]]
        lengths, m = [4, 2], [3, 1]
        logits = bvc.forward(rows, lengths)
        bvc.keep(m)
        for b in range(2):
            for i in range(lengths[b]):
                want = fresh_last_logits(model, history[b][:-1] + rows[b][:i + 1])
                assert mx.allclose(logits[b, i], want, atol=ATOL_FRESH, rtol=0).item(), (b, i)
        nxt = [50, 51]
        one = bvc.forward([[t] for t in nxt], [1, 1])
        bvc.keep([1, 1])
        for b in range(2):
            want = fresh_last_logits(model, history[b][:-1] + rows[b][:m[b]] + [nxt[b]])
            assert mx.allclose(one[b, 0], want, atol=ATOL_FRESH, rtol=0).item(), b
    finally:
        bvc.close()


def test_filter_of_rows_ended_apart_that_share_left_padding():
    """The row without left padding leaves (``filter``) while the rows ended apart by a keep stay: mlx-lm's
    filter shifts every remaining row left by the padding they share, so their end columns must move with
    them; each row's next token then still sees exactly its own history (a fresh forward over it)."""
    model, _ = models("llama")
    prompts = [list(range(1, 11)), [11, 12, 13], [14, 15, 16, 17]]   # cached 9, 2, 3: rows 1, 2 padded by 7, 6
    cache = batch_of(model, prompts)
    bvc = BatchVerifyCache(model, cache)
    try:
        rows = [[10, 20, 21, 22], [13, 23, 24, 25], [17, 26, 27, 0]]
        bvc.forward(rows, [4, 4, 3])
        bvc.keep([4, 1, 3])
        kept = [p[:-1] + r[:k] for p, r, k in zip(prompts, rows, [4, 1, 3])]
        for c in cache:
            c.filter(mx.array([1, 2]))
        assert min(cache[0].left_padding.tolist()) == 0   # the shared padding was shifted out
        nxt = [30, 31]
        one = bvc.forward([[t] for t in nxt], [1, 1])
        bvc.keep([1, 1])
        for j, b in enumerate([1, 2]):
            want = fresh_last_logits(model, kept[b] + [nxt[j]])
            assert mx.allclose(one[j, 0], want, atol=ATOL_FRESH, rtol=0).item(), b
    finally:
        bvc.close()
