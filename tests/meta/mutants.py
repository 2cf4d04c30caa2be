"""Deliberately broken backends: the reference (or, for sampling, the MLX backend) with one rule
broken by wrapping or patching its functions for the duration of a ``with`` block. No file of the
backends is edited, and leaving the block restores everything.

Each mutant is a context manager; :data:`MUTANTS` maps a name to ``(mutant, backend, checks that
must catch it)``. docs/conformance.md lists the same table.
"""
from __future__ import annotations

import contextlib
import os
import sys
import tempfile

import reference.cache_file
import reference.draft
import reference.drafter
import reference.models.cache as model_cache


@contextlib.contextmanager
def replaced(original, replacement, prefixes=("reference", "conformance.adapters")):
    """Replace ``original`` by ``replacement`` in every loaded module of ``prefixes`` that holds it
    under some name (``from x import f`` makes copies of the binding), then put it back."""
    sites = [(m, name) for mod_name, m in list(sys.modules.items()) if m is not None and mod_name.startswith(prefixes)
             for name, value in list(vars(m).items()) if value is original]
    assert sites, f"{original!r} is bound nowhere: the mutant would test nothing"
    for m, name in sites:
        setattr(m, name, replacement)
    try:
        yield
    finally:
        for m, name in sites:
            setattr(m, name, original)


@contextlib.contextmanager
def attribute(owner, name, value):
    old = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)


# -- n-gram drafting ----------------------------------------------------------------------------

def a3_off_by_one():
    """The lax (context) minimum sample size a_3 is 2 instead of 1."""
    lax = reference.draft.LAX
    return attribute(reference.draft, "LAX", lax._replace(a_n=(lax.a_n[0], lax.a_n[1], lax.a_n[2] + 1, lax.a_n[3])))


def ties_to_largest():
    """Among equal best scores the largest token id wins: the original functions run on token ids
    mirrored by t -> M - t (order reversed, counts and weights unchanged) and the result is mirrored back."""
    M = 2**30
    try_primary, try_static = reference.draft.try_primary, reference.draft.try_static

    def mirror(part):
        return {M - y: c for y, c in part.items()}

    class Mirrored:  # a cache whose follower maps are mirrored when read
        def __init__(self, cache):
            self.counts = self
            self.cache = cache

        def get(self, eta, default=None):
            part = self.cache.counts.get(eta)
            return default if part is None else mirror(part)

    def primary(cache, ngrams, part_st, thr, score="exact"):
        y = try_primary(Mirrored(cache), ngrams, mirror(part_st), thr, score)
        return None if y is None else M - y

    def static(part_st):
        y = try_static(mirror(part_st))
        return None if y is None else M - y

    stack = contextlib.ExitStack()
    stack.enter_context(replaced(try_primary, primary))
    stack.enter_context(replaced(try_static, static))
    return stack


def static_weight_dropped():
    """The weight w(y) = 100 c_st(y) is dropped: every follower weighs 1."""
    return replaced(reference.draft.weight, lambda y, part_st: 1)


def dynamic_before_context():
    """The dynamic cache (strict thresholds) is asked before the context cache (lax thresholds)."""
    draft, lax, strict = reference.draft.draft, reference.draft.LAX, reference.draft.STRICT

    def dynamic_first(inp, n_draft, c_ctx, c_dyn=None, c_st=None, *, score="exact"):
        if c_dyn is None:
            return draft(inp, n_draft, c_ctx, None, c_st, score=score)
        with attribute(reference.draft, "LAX", strict), attribute(reference.draft, "STRICT", lax):
            return draft(inp, n_draft, c_dyn, c_ctx, c_st, score=score)

    return replaced(draft, dynamic_first)


def negative_start_read():
    """n-grams that would start before the first token are read anyway, wrapping around like a
    Python negative index (for [10, 20] the 3-gram is (20, 10, 20))."""
    draft = reference.draft.draft

    def wrapping(inp, n_draft, c_ctx, c_dyn=None, c_st=None, *, score="exact"):
        inp = list(inp)
        if 2 <= len(inp) < 4:
            inp = inp[-(4 - len(inp)):] + inp
        return draft(inp, n_draft, c_ctx, c_dyn, c_st, score=score)

    return replaced(draft, wrapping)


def drafts_counted_in_context():
    """The drafter adds its drafted tokens to the context cache."""
    draft = reference.drafter.NgramDrafter.draft

    def counting(self, n_draft):
        drafts = draft(self, n_draft)
        seq = list(self.tokens)
        for d in drafts:
            seq.append(d)
            self.c_ctx.update(seq, 1)
        return drafts

    return attribute(reference.drafter.NgramDrafter, "draft", counting)


# -- cache files ---------------------------------------------------------------------------------

def _byteswapped(path):
    import numpy as np

    data = np.fromfile(path, dtype="<i4").byteswap().tobytes()
    fd, tmp = tempfile.mkstemp(suffix=".bin")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return tmp


def wrong_byte_order():
    """Cache files are written and read big-endian (a round trip through the backend still works)."""
    load, save = reference.cache_file.load_cache, reference.cache_file.save_cache

    def load_big_endian(path):
        tmp = _byteswapped(path)
        try:
            return load(tmp)
        finally:
            os.unlink(tmp)

    def save_big_endian(cache, path):
        save(cache, path)
        tmp = _byteswapped(path)
        os.replace(tmp, path)

    stack = contextlib.ExitStack()
    stack.enter_context(replaced(load, load_big_endian))
    stack.enter_context(replaced(save, save_big_endian))
    return stack


# -- model state ---------------------------------------------------------------------------------

def keep_one_too_many():
    """keep(m) keeps m + 1 tokens of the verify forward (when there are that many)."""
    keep = model_cache.ModelCache.keep
    return attribute(model_cache.ModelCache, "keep", lambda self, m: keep(self, min(m + 1, self.pending)))


def keep_one_too_few():
    """keep(m) keeps m - 1 tokens of the verify forward."""
    keep = model_cache.ModelCache.keep
    return attribute(model_cache.ModelCache, "keep", lambda self, m: keep(self, max(m - 1, 0)))


def gdn_state_not_restored_after_no_draft_step():
    """After a step with no draft (S = 1), the next verify forward's rejected tokens stay in the
    GatedDeltaNet recurrent state (it is not restored to the state after the kept tokens)."""
    keep = model_cache.RecurrentState.keep

    def stale(self, m):
        _, states = self.trace
        after_no_draft = getattr(self, "_mutant_last_S", None) == 1
        self._mutant_last_S = len(states) - 1
        keep(self, m)
        if after_no_draft:
            self.recurrent = states[-1]

    return attribute(model_cache.RecurrentState, "keep", stale)


def conv_window_not_rolled_back():
    """keep(m) restores the recurrent matrix but leaves the conv window of the whole verify forward."""
    keep = model_cache.RecurrentState.keep

    def conv_kept(self, m):
        conv = self.conv
        keep(self, m)
        self.conv = conv

    return attribute(model_cache.RecurrentState, "keep", conv_kept)


# -- sampling (the reference does not sample: this mutant is of the MLX backend) ------------------

def greedy_acceptance_when_sampling():
    """At temperature > 0 a draft is accepted whenever it is the most likely token (not with probability p(d))."""
    import mlx.core as mx

    import mlx_backend.sampling as sampling

    accept_or_resample = sampling.accept_or_resample

    def greedy_accept(p, d):
        if int(mx.argmax(p[0]).item()) == d:
            return d, True
        return accept_or_resample(p, d)

    return attribute(sampling, "accept_or_resample", greedy_accept)


# name -> (mutant, the backend it breaks, the checks that must all fail: a rule check and a second one)
MUTANTS = {
    "a_3 off by one": (a3_off_by_one, "reference",
                       ["thresholds.tiny_vocabulary_context_only", "thresholds.golden_dense_ties"]),
    "ties to the largest token": (ties_to_largest, "reference",
                                  ["thresholds.ties_go_to_the_smallest_token", "thresholds.golden_dense_ties"]),
    "static weight dropped": (static_weight_dropped, "reference",
                              ["thresholds.static_weights_choose_the_follower", "drafting.golden_draft_dumps"]),
    "dynamic tried before context": (dynamic_before_context, "reference",
                                     ["drafting.drafts_follow_the_rules_with_all_caches",
                                      "replay.replay_follows_the_rules"]),
    "n-grams starting before the input read anyway": (negative_start_read, "reference",
                                                      ["drafting.golden_draft_dumps",
                                                       "replay.golden_replay_statistics"]),
    "context cache updated with drafted tokens": (drafts_counted_in_context, "reference",
                                                  ["counts.drafted_tokens_are_not_counted",
                                                   "drafting.golden_draft_dumps"]),
    "rollback keeps one token too many": (keep_one_too_many, "reference",
                                          ["rollback.keep_m_equals_feeding_m_tokens",
                                           "greedy.speculative_equals_plain_greedy"]),
    "rollback keeps one token too few": (keep_one_too_few, "reference",
                                         ["rollback.keep_m_equals_feeding_m_tokens",
                                          "greedy.speculative_equals_plain_greedy"]),
    "GDN state not restored after a step with no draft": (gdn_state_not_restored_after_no_draft_step, "reference",
                                                          ["rollback.zero_draft_steps_between_drafted_steps",
                                                           "rollback.keep_m_equals_feeding_m_tokens"]),
    "conv window not rolled back": (conv_window_not_rolled_back, "reference",
                                    ["rollback.keep_m_equals_feeding_m_tokens",
                                     "greedy.forced_right_wrong_and_empty_drafts"]),
    "sampling accepts drafts greedily at temperature > 0": (greedy_acceptance_when_sampling, "mlx",
                                                            ["sampling.drafts_do_not_change_the_distribution"]),
    "cache file with the wrong byte order": (wrong_byte_order, "reference",
                                             ["cache_files.golden_files_load",
                                              "cache_files.saved_files_are_llama_format"]),
}
