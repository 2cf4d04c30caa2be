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

import reference.ngram.api
import reference.ngram.cache_file
import reference.ngram.draft
import reference.ngram.drafter
import reference.models.cache as model_cache
import reference.ngram.replay
import reference.speculative
import reference.suffix.drafter as suffix_drafter


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
    lax = reference.ngram.draft.LAX
    return attribute(reference.ngram.draft, "LAX", lax._replace(a_n=(lax.a_n[0], lax.a_n[1], lax.a_n[2] + 1, lax.a_n[3])))


def ties_to_largest():
    """Among equal best scores the largest token id wins: the original functions run on token ids
    mirrored by t -> M - t (order reversed, counts and weights unchanged) and the result is mirrored back."""
    M = 2**30
    try_primary, try_static = reference.ngram.draft.try_primary, reference.ngram.draft.try_static

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
    return replaced(reference.ngram.draft.weight, lambda y, part_st: 1)


def dynamic_before_context():
    """The dynamic cache (strict thresholds) is asked before the context cache (lax thresholds)."""
    draft, lax, strict = reference.ngram.draft.draft, reference.ngram.draft.LAX, reference.ngram.draft.STRICT

    def dynamic_first(inp, n_draft, c_ctx, c_dyn=None, c_st=None, *, score="exact"):
        if c_dyn is None:
            return draft(inp, n_draft, c_ctx, None, c_st, score=score)
        with attribute(reference.ngram.draft, "LAX", strict), attribute(reference.ngram.draft, "STRICT", lax):
            return draft(inp, n_draft, c_dyn, c_ctx, c_st, score=score)

    return replaced(draft, dynamic_first)


def negative_start_read():
    """n-grams that would start before the first token are read anyway, wrapping around like a
    Python negative index (for [10, 20] the 3-gram is (20, 10, 20))."""
    draft = reference.ngram.draft.draft

    def wrapping(inp, n_draft, c_ctx, c_dyn=None, c_st=None, *, score="exact"):
        inp = list(inp)
        if 2 <= len(inp) < 4:
            inp = inp[-(4 - len(inp)):] + inp
        return draft(inp, n_draft, c_ctx, c_dyn, c_st, score=score)

    return replaced(draft, wrapping)


def drafts_counted_in_context():
    """The drafter adds its drafted tokens to the context cache."""
    draft = reference.ngram.drafter.NgramDrafter.draft

    def counting(self, n_draft):
        drafts = draft(self, n_draft)
        seq = list(self.tokens)
        for d in drafts:
            seq.append(d)
            self.c_ctx.update(seq, 1)
        return drafts

    return attribute(reference.ngram.drafter.NgramDrafter, "draft", counting)


def reset_keeps_context():
    """reset(prompt) starts the new sequence's tokens but keeps the context cache of the previous one."""
    def reset(self, prompt):
        self.tokens = [int(t) for t in prompt]
        self.c_ctx.update(self.tokens, len(self.tokens))

    return attribute(reference.ngram.drafter.NgramDrafter, "reset", reset)


def scores_in_int32():
    """The drafter scores c * w in int32 (llama.cpp's wrapping product) instead of exactly."""
    init = reference.ngram.drafter.NgramDrafter.__init__

    def int32_init(self, c_st=None, c_dyn=None, score="exact"):
        init(self, c_st, c_dyn, score="int32")

    return attribute(reference.ngram.drafter.NgramDrafter, "__init__", int32_init)


# -- integer widths ------------------------------------------------------------------------------

def _wrap(c, bits):
    return (c + 2**(bits - 1)) % 2**bits - 2**(bits - 1)


def static_counts_in_int16():
    """build_static counts in int16: a 2-gram seen more than 2^15 - 1 times wraps."""
    build = reference.ngram.api.build_static

    def int16_build(tokens, progress=None):
        cache = build(tokens, progress)
        return reference.ngram.api.NgramCache({eta: {y: _wrap(c, 16) for y, c in part.items()}
                                         for eta, part in cache.counts.items()})

    return replaced(build, int16_build)


def static_built_in_blocks():
    """build_static counts each block of 2^16 tokens on its own: the 2-grams across a block boundary are lost."""
    build = reference.ngram.api.build_static

    def blocks(tokens, progress=None):
        tokens = list(tokens)
        return reference.ngram.api.merge_caches(build(tokens[i:i + 2**16], progress) for i in range(0, len(tokens), 2**16))

    return replaced(build, blocks)


def merge_in_int32():
    """merge_caches sums counts in int32: a sum past 2^31 - 1 wraps to a negative count."""
    merge = reference.ngram.api.merge_caches

    def int32_merge(caches):
        out = merge(caches)
        return reference.ngram.api.NgramCache({eta: {y: _wrap(c, 32) for y, c in part.items()}
                                         for eta, part in out.counts.items()})

    return replaced(merge, int32_merge)


def replay_positions_in_uint16():
    """The replay reports draft positions as uint16 (wrapping past 65535)."""
    replay = reference.ngram.replay.replay

    def uint16_positions(tokens, n_ctx, n_draft, c_st=None, c_dyn=None, on_draft=None, **extra):
        report = None if on_draft is None else (lambda pos, d: on_draft(pos % 2**16, d))
        return replay(tokens, n_ctx, n_draft, c_st, c_dyn, on_draft=report, **extra)

    return replaced(replay, uint16_positions)


# -- cache files ---------------------------------------------------------------------------------

def duplicate_records_keep_the_last():
    """A cache file holding the same n-gram (or follower) twice loads, the last record winning, as an
    unchecked hash-map insert would do."""
    from conformance import llama_format

    load = reference.ngram.cache_file.load_cache

    def lenient(path):
        try:
            return load(path)
        except ValueError as exc:
            if "duplicate" not in str(exc):
                raise
        with open(path, "rb") as f:
            return reference.ngram.api.NgramCache(llama_format.from_bytes(f.read()))

    return replaced(load, lenient)

def _byteswapped(path):
    import numpy as np

    data = np.fromfile(path, dtype="<i4").byteswap().tobytes()
    fd, tmp = tempfile.mkstemp(suffix=".bin")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return tmp


def wrong_byte_order():
    """Cache files are written and read big-endian (a round trip through the backend still works)."""
    load, save = reference.ngram.cache_file.load_cache, reference.ngram.cache_file.save_cache

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


def keep_zero_keeps_all():
    """keep(0) keeps the whole verify forward (a falsy m read as "no cut")."""
    keep = model_cache.ModelCache.keep
    return attribute(model_cache.ModelCache, "keep", lambda self, m: keep(self, m or self.pending))


def gdn_rolled_back_by_recompute():
    """The MLX rollback does not recognise mlx-lm's GatedDeltaNet layers: it snapshots them and re-runs the
    kept tokens (the same tokens, a second forward for every partly rejected draft)."""
    import mlx_backend.decode.rollback as rollback

    return attribute(rollback, "gdn_projections", lambda layer: None)


def forward_ignores_its_state():
    """The MLX adapter's forward runs each call's tokens from an empty state (its cache keeps nothing and
    reports no ``offset``): compared only with itself, fed one token at a time, it looks consistent."""
    import types

    import conformance.adapters.mlx as adapter

    forward, make_cache = adapter.forward, adapter.make_cache
    stack = contextlib.ExitStack()
    stack.enter_context(attribute(adapter, "make_cache", lambda model: types.SimpleNamespace(model=model)))
    stack.enter_context(attribute(adapter, "forward", lambda model, tokens, cache: forward(model, tokens,
                                                                                           make_cache(model))))
    stack.enter_context(attribute(adapter, "keep", lambda cache, m: None))
    return stack


def near_tie_vouched_by_own_logits():
    """The MLX backend emits the draft that greedy rejected in place of the model's own token, and its adapter's
    forward returns all-zero logits: every top-2 gap of its own logits is 0, so a near-tie proof on them would
    excuse every difference."""
    import numpy as np

    import conformance.adapters.mlx as adapter
    import mlx_backend.decode.generate as generate

    verify, forward = generate.verify_drafts, adapter.forward

    def rejected_draft_emitted(logits, drafts, sampler=None, logits_processors=None, history=None):
        emitted, logprobs, n = verify(logits, drafts, sampler, logits_processors, history)
        if n < len(drafts):
            emitted = list(emitted[:n]) + [int(drafts[n])]
        return emitted, logprobs, n

    stack = contextlib.ExitStack()
    stack.enter_context(attribute(generate, "verify_drafts", rejected_draft_emitted))
    stack.enter_context(attribute(adapter, "forward", lambda model, tokens, cache: np.zeros_like(
        forward(model, tokens, cache))))
    return stack


# -- generation ----------------------------------------------------------------------------------

def eos_first_not_checked():
    """The first token (the prompt forward's) is not checked for EOS: generation goes on after it."""
    generate = reference.speculative.speculative_generate

    def late_eos(model, prompt, max_tokens, drafter, draft_max, eos=(), on_tokens=None):
        eos = set(eos)
        tokens, stats = generate(model, prompt, max_tokens, drafter, draft_max, eos=eos, on_tokens=on_tokens)
        if len(tokens) == 1 and tokens[0] in eos and max_tokens > 1:
            tokens, stats = generate(model, prompt, max_tokens, drafter, draft_max, eos=(), on_tokens=None)
            stop = next((i for i, t in enumerate(tokens) if i > 0 and t in eos), len(tokens) - 1)
            tokens = tokens[:stop + 1]
            if on_tokens:
                on_tokens(tokens[1:])
        return tokens, stats

    return replaced(generate, late_eos)


class _BonusNotHanded:
    def __init__(self, drafter):
        self.drafter = drafter

    def reset(self, prompt):
        self.drafter.reset(prompt)

    def extend(self, tokens):
        tokens = list(tokens)
        self.drafter.extend(tokens[:-1] if len(tokens) > 1 else tokens)

    def draft(self, n_draft):
        return self.drafter.draft(n_draft)


def bonus_token_not_handed_to_drafter():
    """After a step with accepted drafts, the drafter is not handed the step's last (bonus) token."""
    generate = reference.speculative.speculative_generate

    def forgetful(model, prompt, max_tokens, drafter, draft_max, eos=(), on_tokens=None):
        return generate(model, prompt, max_tokens, _BonusNotHanded(drafter), draft_max, eos=eos, on_tokens=on_tokens)

    return replaced(generate, forgetful)


def steps_counted_per_token():
    """The reported ``steps`` counts emitted tokens, not forwards (a porter's slip: equal in plain decoding)."""
    generate = reference.speculative.speculative_generate

    def per_token(model, prompt, max_tokens, drafter, draft_max, eos=(), on_tokens=None):
        tokens, stats = generate(model, prompt, max_tokens, drafter, draft_max, eos=eos, on_tokens=on_tokens)
        stats.steps = len(tokens)
        return tokens, stats

    return replaced(generate, per_token)


def draft_max_0_still_drafts():
    """With draft_max=0 the generation still asks the drafter for one token per step (and verifies it)."""
    generate = reference.speculative.speculative_generate

    def asks_anyway(model, prompt, max_tokens, drafter, draft_max, eos=(), on_tokens=None):
        return generate(model, prompt, max_tokens, drafter, max(draft_max, 1), eos=eos, on_tokens=on_tokens)

    return replaced(generate, asks_anyway)


def replay_default_n_draft_8():
    """replay() defaults to n_draft = 8 instead of lookup-stats' 16."""
    replay = reference.ngram.replay.replay

    def replay_8(tokens, n_ctx=4096, n_draft=8, **kwargs):
        return replay(tokens, n_ctx, n_draft, **kwargs)

    return replaced(replay, replay_8)


# -- sampling (the reference does not sample: this mutant is of the MLX backend) ------------------

def greedy_acceptance_when_sampling():
    """At temperature > 0 a draft is accepted whenever it is the most likely token (not with probability p(d))."""
    import mlx.core as mx

    import mlx_backend.decode.sampling as sampling

    accept_or_resample = sampling.accept_or_resample

    def greedy_accept(p, d):
        if int(mx.argmax(p[0]).item()) == d:
            return d, True
        return accept_or_resample(p, d)

    return attribute(sampling, "accept_or_resample", greedy_accept)


def greedy_bonus_token_when_sampling():
    """At temperature > 0, the bonus token after all drafts were accepted is the most likely one, not sampled."""
    import mlx.core as mx

    import mlx_backend.decode.generate as generate

    verify = generate.verify_drafts

    def argmax_bonus(logits, drafts, sampler=None, logits_processors=None, history=None):
        emitted, logprobs, n = verify(logits, drafts, sampler, logits_processors, history)
        if drafts and n == len(drafts):
            emitted[-1] = int(mx.argmax(logprobs[-1]).item())
        return emitted, logprobs, n

    return attribute(generate, "verify_drafts", argmax_bonus)


# -- suffix drafting -----------------------------------------------------------------------------

def suffix_earliest_occurrence():
    """Suffix drafting copies after the earliest occurrence of the matched suffix, not the latest."""
    def earliest_end(source, m, T, end_limit):
        suffix = list(T[len(T) - m:])
        return next((e for e in range(m, end_limit) if list(source[e - m:e]) == suffix), -1)

    return replaced(suffix_drafter.latest_end, earliest_end)


def suffix_factor_ignored():
    """Suffix drafting drafts k tokens whatever the match length (factor * L does not bound the draft)."""
    draft = suffix_drafter.SuffixDrafter.draft

    def unbounded(self, k):
        factor, self.factor = self.factor, float(max(k, 1))
        try:
            return draft(self, k)
        finally:
            self.factor = factor

    return attribute(suffix_drafter.SuffixDrafter, "draft", unbounded)


def suffix_history_first():
    """At each suffix length the history is searched before the sequence itself (ties go to the history)."""
    latest_end, match_length = suffix_drafter.latest_end, suffix_drafter.match_length

    def find_match(T, history, *, ladder=suffix_drafter.LADDER, max_match=suffix_drafter.MAX_MATCH):
        n = len(T)
        for m in sorted((m for m in ladder if m <= min(n, max_match)), reverse=True):
            for i, source in [(i, history[i]) for i in range(len(history) - 1, -1, -1)] + [(-1, T)]:
                e = latest_end(source, m, T, len(source) if i >= 0 else n)
                if e >= 0:
                    return i, e, match_length(source, e, T, n, max_match)
        return None

    return replaced(suffix_drafter.find_match, find_match)


def suffix_length_is_the_ladders():
    """match_length reports the ladder length found (m*), not the match measured at the occurrence: a 5-token
    match found with m = 4 reports 4 and drafts 8 tokens instead of 10."""
    match_length, ladder = suffix_drafter.match_length, suffix_drafter.LADDER

    def ladder_length(a, e, b, n, limit):
        l = match_length(a, e, b, n, limit)
        return max((m for m in ladder if m <= l), default=0)

    return replaced(match_length, ladder_length)


def suffix_history_not_evicted():
    """The suffix history keeps every sequence added (cut to max_tokens each) instead of dropping the oldest."""
    add = suffix_drafter.SuffixHistory.add

    def keep_all(self, tokens):
        bound, self.max_tokens = self.max_tokens, 1 << 62
        try:
            add(self, list(tokens)[-bound:] if bound else [])
        finally:
            self.max_tokens = bound

    return attribute(suffix_drafter.SuffixHistory, "add", keep_all)


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
                                      "replay.replay_tries_context_before_dynamic"]),
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
    # issue 11: one mutant per class of bug that passed the default run before
    "static counts in int16": (static_counts_in_int16, "reference", ["counts.static_cache_of_a_long_stream"]),
    "static cache built in blocks of 2^16 tokens": (static_built_in_blocks, "reference",
                                                    ["counts.static_cache_of_a_long_stream"]),
    "merge sums in int32": (merge_in_int32, "reference", ["counts.merged_counts_past_16_and_31_bits"]),
    "drafter scores in int32": (scores_in_int32, "reference", ["thresholds.scores_past_32_bits"]),
    "replay positions in uint16": (replay_positions_in_uint16, "reference", ["replay.replay_past_2_16_tokens"]),
    "reset() keeps the previous sequence's context cache": (reset_keeps_context, "reference",
                                                            ["counts.context_cache_counts_sizes_1_to_4",
                                                             "drafting.drafts_follow_the_rules_context_only"]),
    "keep(0) keeps everything": (keep_zero_keeps_all, "reference",
                                 ["rollback.zero_draft_steps_between_drafted_steps",
                                  "rollback.keep_m_equals_feeding_m_tokens"]),
    "bonus token not handed to the drafter": (bonus_token_not_handed_to_drafter, "reference",
                                              ["greedy.speculative_equals_plain_greedy",
                                               "greedy.forced_right_wrong_and_empty_drafts"]),
    "EOS not checked on the first token": (eos_first_not_checked, "reference",
                                           ["greedy.eos_first_last_and_inside_an_accepted_run"]),
    "duplicate cache-file records: the last one wins": (duplicate_records_keep_the_last, "reference",
                                                       ["cache_files.damaged_files_are_refused"]),
    "bonus token taken greedily at temperature > 0": (greedy_bonus_token_when_sampling, "mlx",
                                                      ["sampling.drafts_do_not_change_the_distribution"]),
    # issue 11, second stop: the counts a generation reports, draft_max = 0, replay's defaults
    "steps counted per emitted token": (steps_counted_per_token, "reference",
                                        ["greedy.speculative_equals_plain_greedy",
                                         "greedy.forced_right_wrong_and_empty_drafts"]),
    "draft_max = 0 still drafts": (draft_max_0_still_drafts, "reference", ["greedy.draft_max_0_is_plain_decoding"]),
    "replay defaults to n_draft = 8": (replay_default_n_draft_8, "reference", ["replay.replay_defaults_and_times"]),
    "GatedDeltaNet rolled back by re-running": (gdn_rolled_back_by_recompute, "mlx",
                                                ["rollback.zero_draft_steps_between_drafted_steps",
                                                 "rollback.keep_m_equals_feeding_m_tokens"]),
    # 2026-12-08: checks that compared a backend only with itself
    "forward ignores its state": (forward_ignores_its_state, "mlx", ["rollback.forward_equals_the_reference"]),
    "a near-tie vouched for by the backend's own logits": (near_tie_vouched_by_own_logits, "mlx",
                                                           ["greedy.speculative_equals_plain_greedy",
                                                            "rollback.forward_equals_the_reference"]),
    # suffix drafting (reference/suffix/drafter.py)
    "suffix: the earliest occurrence instead of the latest": (suffix_earliest_occurrence, "reference",
                                                              ["suffix.hand_worked_cases",
                                                               "suffix.drafts_follow_the_rule"]),
    "suffix: the factor ignored": (suffix_factor_ignored, "reference",
                                   ["suffix.hand_worked_cases", "suffix.drafts_follow_the_rule",
                                    "suffix.drafts_are_copies_of_a_longest_match"]),
    "suffix: the history searched before the sequence": (suffix_history_first, "reference",
                                                         ["suffix.hand_worked_cases",
                                                          "suffix.drafts_follow_the_rule"]),
    "suffix: L reported as the ladder length": (suffix_length_is_the_ladders, "reference",
                                                ["suffix.hand_worked_cases", "suffix.drafts_follow_the_rule",
                                                 "suffix.drafts_are_copies_of_a_longest_match"]),
    "suffix: the history never evicted": (suffix_history_not_evicted, "reference",
                                          ["suffix.hand_worked_cases", "suffix.drafts_follow_the_rule"]),
}
