"""``ngram_speculative_generate_step`` / ``stream_generate`` with ``drafter=`` a name (lookup, suffix, auto)
or a Drafter object, and ``history=`` (a SuffixHistory) for suffix and auto: plain greedy output always;
the history is drafted from; an unknown name is a ValueError naming the choices."""
from __future__ import annotations

import re

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.generate import generate_step

from mlx_backend.decode.generate import SpecStats, ngram_speculative_generate_step, run_drafter, stream_generate
from mlx_backend.models.tiny import tiny_model
from reference.models.tiny import write_tiny_model
from mlx_backend.ngram.default import suffix_api
from reference.suffix.auto import AutoDrafter
from reference.ngram.drafter import NgramDrafter

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13]
N = 32


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """A tiny qwen3_5 directory (random answers that do not repeat themselves), its tokenizer, and the
    plain greedy answer to PROMPT."""
    import mlx_lm

    path = write_tiny_model(tmp_path_factory.mktemp("drafters") / "qwen3_5", "qwen3_5", seed=2)
    model, tokenizer = mlx_lm.load(str(path))
    plain = [t for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=N,
                                         sampler=lambda x: mx.argmax(x, axis=-1))]
    return model, plain, tokenizer


def spec(model, **kw):
    stats = SpecStats()
    tokens = [t for t, _, _ in ngram_speculative_generate_step(mx.array(PROMPT), model, max_tokens=N, draft_max=4,
                                                                stats=stats, **kw)]
    return tokens, stats


@pytest.mark.parametrize("drafter", ["lookup", "suffix", "auto", None])
def test_every_named_drafter_gives_plain_greedy_output(qwen, drafter):
    model, plain, _ = qwen
    tokens, random_stats = spec(model, drafter=drafter)
    assert tokens == plain
    looping = tiny_model("llama")                     # answers 14 1 14 1 ...: every drafter drafts there
    tokens, stats = spec(looping, drafter=drafter)
    assert tokens == [t for t, _ in generate_step(mx.array(PROMPT), looping, max_tokens=N,
                                                  sampler=lambda x: mx.argmax(x, axis=-1))]
    rejected = random_stats.n_drafted - random_stats.n_accept + stats.n_drafted - stats.n_accept
    assert stats.n_accept > 0 and rejected > 0   # drafts accepted, and drafts rejected (rolled back)


def test_a_history_holding_the_answer_is_drafted_from(qwen):
    model, plain, _ = qwen
    history = suffix_api().SuffixHistory(1000)
    history.add(PROMPT + plain)                       # an earlier request: this prompt, then this answer
    for name in ("suffix", "auto"):
        without, s0 = spec(model, drafter=name)
        with_history, s1 = spec(model, drafter=name, history=history)
        assert without == with_history == plain
        assert s1.n_accept > s0.n_accept + 10, (name, s0, s1)
    with pytest.raises(ValueError, match="history: the suffix drafter's history, unused by drafter='lookup'"):
        spec(model, drafter="lookup", history=history)   # lookup has no use for it (before: taken, ignored)


def test_stream_generate_takes_a_drafter_name(qwen):
    model, plain, tokenizer = qwen
    stats = SpecStats()
    out = [r.token for r in stream_generate(model, tokenizer, mx.array(PROMPT), max_tokens=N,
                                            drafter="suffix", draft_max=4, stats=stats)]
    assert out == plain[:len(out)] and len(out) >= 1 and stats.n_drafted > 0


def test_a_drafter_object_is_used_as_given_and_an_unknown_name_is_refused(qwen):
    model, plain, _ = qwen
    suffix = suffix_api().SuffixDrafter()
    assert run_drafter(suffix, None) is suffix
    tokens, _ = spec(model, drafter=suffix)
    assert tokens == plain and list(suffix.tokens) == PROMPT + plain     # it saw the whole run
    assert isinstance(run_drafter(None, None), AutoDrafter)               # the default: auto
    assert run_drafter("suffix", 0) is None                               # draft_max=0: nothing drafts
    for bad in ("sufix", ""):
        with pytest.raises(ValueError, match="unknown drafter .*: choose one of lookup, suffix, auto"):
            spec(model, drafter=bad)
    with pytest.raises(ValueError, match="choose one of lookup, suffix, auto"):
        run_drafter("x", 0)


def test_a_cache_the_drafter_would_not_read_is_refused(qwen):
    """Each of c_st / c_dyn (the lookup drafter's) and history (the suffix drafter's) given to a drafter that does
    not read it is a ValueError naming it and the way out, as generate's --drafter suffix --static is; auto reads
    all three. Before: drafter="suffix" with c_st (even a missing file), "lookup" with a history, and a drafter
    object with any of them ran, ignoring them."""
    model, plain, tokenizer = qwen
    history = suffix_api().SuffixHistory(1000)
    lookup_caches = "the lookup drafter's caches, unused by drafter='suffix': drop {}, or use drafter='lookup' or 'auto'"
    cases = [({"drafter": "suffix", "c_st": "/nope.bin"}, "c_st: " + lookup_caches.format("it")),
             ({"drafter": "suffix", "c_dyn": "/nope.bin"}, "c_dyn: " + lookup_caches.format("it")),
             ({"drafter": "suffix", "c_st": "/nope.bin", "c_dyn": "/nope.bin"},
              "c_st and c_dyn: " + lookup_caches.format("them")),
             ({"drafter": "lookup", "history": history}, "history: the suffix drafter's history, unused by "
                                                         "drafter='lookup': drop it, or use drafter='suffix' or 'auto'"),
             ({"drafter": suffix_api().SuffixDrafter(), "history": history},
              "history: the caches of a drafter made by name, unused by the SuffixDrafter given: drop it, or give it "
              "to the drafter when you make it"),
             ({"drafter": NgramDrafter(), "c_st": "/nope.bin"}, "c_st: the caches of a drafter made by name")]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            spec(model, **kwargs)
        with pytest.raises(ValueError, match=re.escape(message)):
            next(stream_generate(model, tokenizer, mx.array(PROMPT), max_tokens=N, **kwargs))
    assert spec(model, drafter="auto", history=history)[0] == plain   # auto reads all three


def test_a_draft_max_past_the_limit_or_beside_a_policy_is_refused(qwen):
    """draft_max=10**5 with max_tokens=-1 ran the machine out of memory (verify forwards that wide), 10**9 asked
    the auto drafter for a 3.7 GiB buffer; a draft_policy given with a draft_max was ignored. Both are now a
    ValueError before any forward; the limit itself is accepted."""
    from mlx_backend.decode.draft_policy import DraftPolicy

    model, plain, _ = qwen
    for draft_max in (1025, 10**9):
        with pytest.raises(ValueError, match=r"draft_max must be in 0\.\.1024 \(the verify forward's memory"):
            next(ngram_speculative_generate_step(mx.array(PROMPT), model, max_tokens=-1, draft_max=draft_max))
    with pytest.raises(ValueError, match="draft_max fixes the draft length and draft_policy chooses it"):
        next(ngram_speculative_generate_step(mx.array(PROMPT), model, max_tokens=N, draft_max=4,
                                             draft_policy=DraftPolicy([1.0, 1.1, 1.2])))
    for draft_max in (0, 4):   # with draft_max=0 a misspelt gdn_path ran (unused), with 4 it was refused
        with pytest.raises(ValueError, match="gdn_path must be one of"):
            next(ngram_speculative_generate_step(mx.array(PROMPT), model, max_tokens=N, draft_max=draft_max,
                                                 gdn_path="state"))
    at_the_limit = [t for t, _, _ in ngram_speculative_generate_step(mx.array(PROMPT), model, max_tokens=N,
                                                                     draft_max=1024)]
    assert at_the_limit == plain


def test_arguments_of_the_wrong_type_are_named(qwen):
    """Before: float prompt ids were truncated and generated from silently; draft_max 2.5 or "8" and a
    drafter that is no Drafter failed deep inside (slice indices, comparison, ``'int' object has no
    attribute 'reset'``)."""
    model, _, _ = qwen
    cases = [({"prompt": mx.array([1.7, 2.9, 3.5])}, "the prompt must be a 1-D sequence of integer token ids"),
             ({"prompt": mx.array([PROMPT[:2], PROMPT[2:4]])}, "the prompt must be a 1-D sequence"),
             ({"draft_max": 2.5}, "draft_max must be a whole number or None"),
             ({"draft_max": "8"}, "draft_max must be a whole number or None"),
             ({"drafter": 42}, "drafter must be one of lookup, suffix, auto, None .auto. or a Drafter"),
             # before: '<' not supported, slice indices, AttributeError 'summary', reset() missing an argument,
             # 'int' object is not iterable, all from deep inside
             ({"max_tokens": "5"}, "max_tokens must be a whole number, got '5'"),
             ({"max_tokens": 2.5}, "max_tokens must be a whole number, got 2.5"),
             ({"prefill_step_size": 2.5}, "prefill_step_size must be a whole number"),
             ({"stats": {}}, "stats must be a SpecStats"),
             ({"draft_max": None, "draft_policy": "x"}, "draft_policy must be a DraftPolicy"),
             ({"drafter": NgramDrafter}, "drafter must be a drafter object, got the class NgramDrafter"),
             ({"prompt": mx.array(5)}, "the prompt must be a 1-D sequence of integer token ids, got an array of shape")]
    for kwargs, message in cases:
        kwargs = {"prompt": mx.array(PROMPT), "draft_max": 4, "max_tokens": N, **kwargs}
        with pytest.raises(TypeError, match=message):
            next(ngram_speculative_generate_step(kwargs.pop("prompt"), model, **kwargs))
    # before: 'NoneType' object has no attribute 'named_modules', 'Linear' object has no attribute 'layers'
    for not_a_model, name in ((None, "NoneType"), (nn.Linear(4, 4), "Linear")):
        with pytest.raises(TypeError, match=f"model must be an mlx-lm language model .*, got {name}"):
            next(ngram_speculative_generate_step(mx.array(PROMPT), not_a_model, max_tokens=N))

