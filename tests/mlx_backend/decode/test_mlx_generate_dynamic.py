"""Dynamic cache persistence: load (empty if absent), learn this run's context cache, save atomically."""
from __future__ import annotations

import os

import mlx.core as mx
import pytest

import reference.ngram.api as api
from mlx_backend.ngram.dynamic_cache import load_dynamic, save_dynamic
from mlx_backend.decode.generate import ngram_speculative_generate_step
from mlx_backend.ngram.default import lookup_drafter
from mlx_backend.models.tiny import tiny_model


def test_learn_across_runs(tmp_path):
    path = tmp_path / "dyn.bin"
    model = tiny_model("qwen3_5", seed=3)
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    c_dyn = load_dynamic(path, api)
    assert api.cache_entries(c_dyn) == []
    drafter = api.NgramDrafter(c_dyn=c_dyn)
    out = [t for t, _, _ in ngram_speculative_generate_step(mx.array(prompt), model, max_tokens=12,
                                                            draft_max=3, drafter=drafter)]
    learned = save_dynamic(path, c_dyn, drafter.c_ctx, api)
    ctx = api.NgramCache()
    ctx.update(prompt + out, len(prompt + out))     # c_ctx of the run: all n-grams of prompt + output
    assert api.cache_entries(learned) == api.cache_entries(ctx)
    assert api.cache_entries(load_dynamic(path, api)) == api.cache_entries(ctx)
    # a second run adds its counts to the stored ones
    drafter2 = api.NgramDrafter(c_dyn=load_dynamic(path, api))
    drafter2.reset(prompt)
    again = save_dynamic(path, drafter2.c_dyn, drafter2.c_ctx, api)
    assert api.cache_entries(again) == api.cache_entries(api.merge_caches([ctx, drafter2.c_ctx]))


def test_interrupted_save_leaves_old_file(tmp_path, monkeypatch):
    """Ctrl-C after the new cache is written but before it replaces the old one (the real writer, with
    os.fsync interrupted): the old file is intact and no temporary file is left."""
    path = tmp_path / "dyn.bin"
    first = api.build_static([5, 6, 7, 5, 6, 8])
    save_dynamic(path, None, first, api)
    before = path.read_bytes()
    ctx = api.build_static([9, 9, 9, 9])

    def interrupted(fd):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_dynamic(path, load_dynamic(path, api), ctx, api)
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["dyn.bin"]          # no temporary file left behind


def test_lookup_drafter_reads_cache_files(tmp_path):
    path = tmp_path / "st.bin"
    api.save_cache(api.build_static([10, 11, 12, 10, 11, 12]), path)
    drafter = lookup_drafter(c_st=str(path))
    drafter.reset([10, 11])
    assert drafter.draft(1) == [12]


def test_default_backend_learns_the_same_rows(tmp_path):
    """With the default n-gram backend (array-based if present), the saved cache has the same rows."""
    path = tmp_path / "dyn.bin"
    model = tiny_model("llama", seed=3)
    prompt = [1, 2, 3, 1, 2, 3]
    c_dyn = load_dynamic(path)
    drafter = lookup_drafter(c_dyn=c_dyn)
    out = [t for t, _, _ in ngram_speculative_generate_step(mx.array(prompt), model, max_tokens=6,
                                                            draft_max=2, drafter=drafter)]
    save_dynamic(path, c_dyn, drafter.c_ctx)
    ctx = api.NgramCache()
    ctx.update(prompt + out, len(prompt + out))
    assert api.cache_entries(api.load_cache(path)) == api.cache_entries(ctx)
