"""``mlx_backend.decode.generate.stream_generate`` behaves as ``mlx_lm.stream_generate`` (one-import switch),
including stopping at an EOS token that lies inside an accepted draft run."""
from __future__ import annotations

import functools

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import GenerationResponse, generation_stream
from mlx_lm.models.cache import make_prompt_cache

from mlx_backend.decode.generate import SpecStats, ngram_speculative_generate_step, stream_generate
from mlx_backend.models.compat import build
from reference.models.tiny import write_tiny_model

from test_mlx_generate import ScriptedDrafter, argmax_sampler


@functools.cache
def loaded(arch: str, tmp_root: str):
    return mlx_lm.load(str(write_tiny_model(f"{tmp_root}/{arch}", arch, seed=3)))


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tiny"))


def responses(gen):
    return [(r.text, r.token, r.from_draft, r.finish_reason, r.generation_tokens) for r in gen]


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next", "llama"])
def test_stream_generate_matches_mlx_lm_with_eos_inside_accepted_run(arch, tmp_root):
    model, tokenizer = loaded(arch, tmp_root)
    prompt = "xyzzy xyzzy" if arch == "llama" else "abcabcabc"   # llama repeats one token after abcabcabc
    plain = [r.token for r in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=20,
                                                     sampler=argmax_sampler)]
    # make a plain token that first occurs after the first two an EOS token: the run must stop there,
    # inside an accepted draft run (the first token's step drafts nothing)
    stop_at = next(i for i in range(2, len(plain) - 1) if plain[i] not in plain[:i])
    eos = plain[stop_at]
    tokenizer.eos_token_ids = {eos}
    try:
        ref = responses(mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=20,
                                               sampler=argmax_sampler))
        drafter = ScriptedDrafter(plain, [(8, None)])
        stats = SpecStats()
        ours = responses(stream_generate(model, tokenizer, prompt, max_tokens=20, draft_max=8,
                                         drafter=drafter, stats=stats))
    finally:
        tokenizer.eos_token_ids = {tokenizer.eos_token_id}
    assert [r[:2] + r[3:] for r in ours] == [r[:2] + r[3:] for r in ref]   # text, token, finish, count
    assert ours[-1][3] == "stop" and ours[-1][1] == eos and len(ours) == stop_at + 1
    # EOS was drafted with more drafted tokens after it, and all of them up to EOS were accepted
    first = drafter.calls[0]
    assert eos in first[:-1] and stats.n_accept >= first.index(eos)


def test_stream_generate_types_and_length(tmp_root):
    model, tokenizer = loaded("qwen3_5", tmp_root)
    tokenizer.eos_token_ids = set()
    try:
        out = list(stream_generate(model, tokenizer, [104, 105, 104, 105, 104], max_tokens=7, draft_max=3))
    finally:
        tokenizer.eos_token_ids = {tokenizer.eos_token_id}
    assert all(isinstance(r, GenerationResponse) for r in out)
    assert out[-1].finish_reason == "length" and out[-1].generation_tokens == 7
    assert out[-1].logprobs.shape == (model.args.text_config["vocab_size"],)
    with pytest.raises(ValueError, match="non-zero"):
        next(stream_generate(model, tokenizer, "x", max_tokens=0))


@pytest.mark.parametrize("bad", [260, 10**8, -5])
def test_stream_generate_refuses_prompt_ids_outside_the_vocabulary(bad, tmp_root):
    model, tokenizer = loaded("llama", tmp_root)   # 260 tokens: 256 bytes and 4 specials
    with pytest.raises(ValueError, match=f"token id {bad} \\(position 1\\) is outside .* 260 tokens"):
        next(stream_generate(model, tokenizer, [104, bad, 105], max_tokens=3, draft_max=2))


def test_stream_generate_wires_the_model_as_mlx_lm_does_on_metal(tmp_root, monkeypatch):
    """On Metal (simulated: the device reports a recommended working set) mlx_lm.stream_generate sets mlx's wired
    limit to it while generating and restores it after; ours must do the same, or a Mac user's speculative run
    pages where the plain one (``--no-spec``, mlx-lm's own) does not."""
    model, tokenizer = loaded("llama", tmp_root)
    limits = []
    monkeypatch.setattr(mx, "device_info", lambda: {"max_recommended_working_set_size": 1 << 40})
    monkeypatch.setattr(mx, "set_wired_limit", lambda n: limits.append(n) or 7)

    def run(gen):
        seen = []
        for r in gen:
            seen.append(list(limits))   # the limits set while this response was being produced
        return seen
    plain = run(mlx_lm.stream_generate(model, tokenizer, "xyzzy xyzzy", max_tokens=6, sampler=argmax_sampler))
    assert limits == [1 << 40, 7] and plain[0] == [1 << 40]
    limits.clear()
    ours = run(stream_generate(model, tokenizer, "xyzzy xyzzy", max_tokens=6, draft_max=4))
    assert limits == [1 << 40, 7] and ours[0] == [1 << 40]                     # set while generating, then restored


def test_stream_generate_refuses_at_its_boundary_what_it_cannot_run(tmp_root):
    """max_kv_size 0 or -1 is refused by generate's --max-kv-size rule (before: taken silently, no window at all);
    no tokenizer or no prompt is a TypeError naming it (before: AttributeError 'NoneType' object has no attribute
    'decode' from inside mlx-lm, and mlx's raw 'incompatible function arguments')."""
    model, tokenizer = loaded("llama", tmp_root)
    for bad in (0, -1):
        with pytest.raises(ValueError, match=f"max_kv_size must be at least 1 or None \\(keep every position\\), "
                                             f"got {bad}"):
            next(stream_generate(model, tokenizer, "abcab", 4, max_kv_size=bad))
    with pytest.raises(TypeError, match="max_kv_size must be a whole number or None"):
        next(stream_generate(model, tokenizer, "abcab", 4, max_kv_size=8.5))
    with pytest.raises(TypeError, match="tokenizer must be mlx-lm's TokenizerWrapper or a Hugging Face tokenizer .* "
                                        "got NoneType"):
        next(stream_generate(model, None, "abcab", 4))
    for prompt in (None, 3.5):
        with pytest.raises(TypeError, match="the prompt must be text, an mx.array or a sequence of integer token ids, "
                                            f"got {type(prompt).__name__}"):
            next(stream_generate(model, tokenizer, prompt, 4))
    # mlx-lm ignores max_kv_size where the run does not make the cache or the model makes its own (tiny llama
    # has make_cache): refused (before: taken and ignored, the whole context kept)
    for cache, message in ((make_prompt_cache(model), "prompt_cache was given"),
                           (None, "this model makes its own caches")):
        with pytest.raises(ValueError, match=f"max_kv_size sizes the cache the run makes, and {message}"):
            next(stream_generate(model, tokenizer, "abcab", 4, max_kv_size=8, prompt_cache=cache))
    class NoDrafts:   # a drafter of the caller's whose draft returns None (before: "'NoneType' object is not
        def reset(self, prompt):   # subscriptable" from inside the run)
            pass

        def extend(self, tokens):
            pass

        def draft(self, n):
            return None

    with pytest.raises(TypeError, match=r"the drafter's draft\(n\) must return a sequence of token ids \(a list, \[\] "
                                        r"for none\), got NoneType"):
        list(stream_generate(model, tokenizer, "abc abc abc", 5, drafter=NoDrafts(), draft_max=4))
    qwen2 = build("qwen2", seed=1)   # no make_cache: at least 1 runs, with a rotating cache
    assert list(stream_generate(qwen2, tokenizer, [5, 6, 7, 5, 6], 4, max_kv_size=8))[-1].finish_reason


def test_stream_generate_takes_mlx_lm_s_arguments_in_mlx_lm_s_places(tmp_root, monkeypatch):
    """mlx-lm's places: (model, tokenizer, prompt, max_tokens, draft_model, stream). A draft model passed fifth is
    refused as by name (it was read as max_kv_size and dropped: a run the caller did not ask for), and a stream
    passed sixth runs every forward (prefill, verify steps, plain steps, the last token into the caller's cache),
    as mlx-lm's does (it was refused as a draft model; by name, as an unknown keyword)."""
    model, tokenizer = loaded("llama", tmp_root)
    with pytest.raises(ValueError, match="draft_model"):
        next(stream_generate(model, tokenizer, "abcab", 4, model))
    stream, streams = mx.new_stream(mx.default_device()), []
    forward = type(model).__call__

    def recorded(self, *args, **kwargs):
        streams.append(mx.default_stream(mx.default_device()))
        return forward(self, *args, **kwargs)
    monkeypatch.setattr(type(model), "__call__", recorded)
    prompt = "abcab" * 3
    list(mlx_lm.stream_generate(model, tokenizer, prompt, 8, None, stream, prefill_step_size=4))
    assert streams and all(s == stream for s in streams)   # the truth: mlx-lm runs them all on it
    for draft_max in (None, 0, 3):
        streams.clear()
        list(stream_generate(model, tokenizer, prompt, 8, None, stream, prefill_step_size=4, draft_max=draft_max,
                             prompt_cache=make_prompt_cache(model)))
        assert len(streams) > 4 and all(s == stream for s in streams), (draft_max, streams)


def test_mlx_lm_s_keywords_at_their_defaults_are_taken_and_the_rest_refused(tmp_root):
    """mlx-lm's server passes every keyword of stream_generate, most at its default (stream, input_embeddings=None,
    kv_bits=None, kv_group_size, quantized_kv_start, num_draft_tokens): that call runs (was a TypeError: stream,
    input_embeddings) and gives mlx-lm's tokens; ngram_speculative_generate_step takes the same keywords (was a
    TypeError for each); what cannot be honoured is one ValueError naming it."""
    model, tokenizer = loaded("llama", tmp_root)
    server = dict(stream=generation_stream, sampler=argmax_sampler, logits_processors=None, draft_model=None,
                  num_draft_tokens=0, input_embeddings=None, prompt_progress_callback=None, prefill_step_size=4,
                  kv_bits=None, kv_group_size=64, quantized_kv_start=5000)
    ref = [r.token for r in mlx_lm.stream_generate(model, tokenizer, "abcab", 8, prompt_cache=make_prompt_cache(model),
                                                   **server)]
    ours = [r.token for r in stream_generate(model, tokenizer, "abcab", 8, prompt_cache=make_prompt_cache(model),
                                             **server)]
    assert ours == ref   # num_draft_tokens=0: plain decoding, mlx-lm's own steps
    step = functools.partial(ngram_speculative_generate_step, mx.array([104, 105, 104, 105]), model, max_tokens=8)
    assert ([t for t, _, _ in step(stream=generation_stream, num_draft_tokens=2, input_embeddings=None, kv_bits=None,
                                   kv_group_size=32, quantized_kv_start=0)]
            == [t for t, _, _ in step(draft_max=2)])
    embeddings = mx.zeros((5, 32))
    for bad, word in [(dict(input_embeddings=embeddings), "input_embeddings: .* pass token ids"),
                      (dict(kv_bits=4), "kv_bits: .* QuantizedKVCache"),
                      (dict(num_draft_tokens=2, draft_max=3), "num_draft_tokens=2 and draft_max=3")]:
        with pytest.raises(ValueError, match=word):
            next(step(**bad))
        with pytest.raises(ValueError, match=word):
            next(stream_generate(model, tokenizer, "abcab", 4, **bad))


def test_generate_returns_mlx_lm_s_text_and_prints_its_lines_and_the_drafts(tmp_root, capsys):
    """``mlx_backend.generate`` stands in for ``mlx_lm.generate`` (a probe: there was none, so code calling
    ``generate(model, tokenizer, prompt, verbose=True)`` had to be rewritten): the same text, mlx-lm's printed
    lines, and one line of the drafts."""
    from mlx_backend import generate

    model, tokenizer = loaded("llama", tmp_root)
    want = mlx_lm.generate(model, tokenizer, "xyzzy xyzzy xyzzy", max_tokens=24, sampler=argmax_sampler)
    got = generate(model, tokenizer, "xyzzy xyzzy xyzzy", max_tokens=24, draft_max=4)
    assert got == want and len(got) > 0
    assert capsys.readouterr().out == ""
    stats = SpecStats()
    assert generate(model, tokenizer, "xyzzy xyzzy xyzzy", verbose=True, max_tokens=24, draft_max=4,
                    stats=stats) == want
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "=" * 10 and out[1] == want and out[2] == "=" * 10, out
    assert out[3].startswith("Prompt: ") and out[4].startswith("Generation: 24 tokens, "), out
    assert out[5] == (f"Drafts: {stats.n_accept} of {stats.n_drafted} accepted, {stats.tokens_per_forward:.2f} "
                      f"tokens per forward pass") and stats.n_drafted > 0, out
    assert out[6].startswith("Peak memory: ") and len(out) == 7, out


def test_a_bytes_prompt_is_refused(tmp_root):
    """b"hello" was read as the token ids 104, 101, ... (the docstring: neither text nor ids is a TypeError)."""
    model, tokenizer = loaded("llama", tmp_root)
    with pytest.raises(TypeError, match="the prompt must be text, an mx.array or a sequence of integer token ids, "
                                        "got bytes"):
        next(stream_generate(model, tokenizer, b"hello", max_tokens=4))


@pytest.mark.parametrize("arch", ["llama", "qwen3_5"])
def test_a_run_left_open_on_a_prompt_cache_is_closed_by_the_next_turn(arch, tmp_root):
    """A generator kept in a variable and left by a break stayed open, its cache holding verified drafts it never
    yielded; the next turn on that cache read them and gave other tokens than mlx-lm's (a probe: offset 49
    against 46). The next turn now closes it first: the same tokens and cache offset as mlx-lm's."""
    model, tokenizer = loaded(arch, tmp_root)
    turns = ("abcabcabcabcabcabc", "abcabc")

    def two_turns(generate, **kw):
        cache = make_prompt_cache(model)
        first = generate(model, tokenizer, turns[0], max_tokens=20, prompt_cache=cache, **kw)
        for i, _ in enumerate(first):
            if i == 1:
                break
        second = [r.token for r in generate(model, tokenizer, turns[1], max_tokens=8, prompt_cache=cache, **kw)]
        return second, next(c.offset for c in cache if hasattr(c, "offset")), first   # an attention layer's

    want, offset, _ = two_turns(mlx_lm.stream_generate, sampler=argmax_sampler)
    got, got_offset, first = two_turns(stream_generate, draft_max=4, drafter="suffix")
    assert (got, got_offset) == (want, offset)
    assert len(list(first)) <= 1   # ended by the second: at most the response stream_generate held back


def test_one_spec_stats_over_two_runs_adds_their_times_as_their_counts(tmp_root):
    """A probe reused one SpecStats for two runs: the counts added up but t_total was the last run's, so
    n_tokens / t_total came out about twice the real rate."""
    import time

    model, tokenizer = loaded("llama", tmp_root)
    stats = SpecStats()
    list(stream_generate(model, tokenizer, "xyzzy xyzzy", max_tokens=12, draft_max=4, stats=stats))
    n1, t1 = stats.n_tokens, stats.t_total
    t0 = time.perf_counter()
    list(stream_generate(model, tokenizer, "xyzzy xyzzy", max_tokens=12, draft_max=4, stats=stats))
    wall = time.perf_counter() - t0
    assert stats.n_tokens == 2 * n1
    assert t1 + 0.5 * wall <= stats.t_total <= t1 + wall, (t1, wall, stats.t_total)
