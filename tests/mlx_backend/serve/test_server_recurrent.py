"""``ngram-spec serve`` on models without an attention layer (Mamba, Mamba2, RWKV7: recurrent states only).

Before, such a model was refused at start ("the model has no attention layer; ngram-spec serve needs one to
track its cache"): a request served alone stored its prompt cache under the tokens read from the attention
layers' offset. Now, without an attention layer, the cache is stored under the tokens fed (the prompt and every
token the client got, :func:`mlx_backend.serve.server.held_tokens`); the batched path counts them per row. A
recurrent state cannot be trimmed, so a stored cache is reused only when it holds exactly a prefix of the new
prompt (mlx-lm's ``LRUPromptCache`` rule). Every greedy answer here is mlx-lm's plain greedy decoding, as the
same request with ``"speculative": false``, and a turn continuing a conversation from a stored cache answers
what a fresh server answers.
"""
from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("mlx_lm")

from test_server import Server  # noqa: E402  (tests/mlx_backend/serve/test_server.py)
from test_server_batched import EDIT, EOS, MESSAGES, N, plain_greedy, run, together, write_recurrent_model  # noqa: E402

REQUESTS = [("chat", MESSAGES[0], {}), ("chat", MESSAGES[1], {"drafter": "suffix"}),
            ("chat", MESSAGES[2], {"draft_max": 3}), ("chat", EDIT, {})]


@pytest.fixture(scope="module")
def recurrent(tmp_path_factory):
    """Tiny random mamba, mamba2 and rwkv7 models, and hybrids with mamba layers (nemotron_h, jamba), with the
    tiny models' tokenizer, written once."""
    root = tmp_path_factory.mktemp("recurrent-models")
    return {arch: write_recurrent_model(arch, root / arch)
            for arch in ("mamba", "mamba2", "rwkv7", "nemotron_h", "jamba")}


@pytest.mark.parametrize("arch", ["mamba", "mamba2", "rwkv7", "nemotron_h", "jamba"])
@pytest.mark.parametrize("concurrency", ["4", "1"])
def test_a_model_with_recurrent_layers_is_served_with_plain_answers(recurrent, arch, concurrency):
    """Concurrent speculative requests, batched (``--decode-concurrency 4``: they share verify forwards) or served
    one at a time (``1``), each get the tokens the same request gets alone with ``"speculative": false``, which
    are mlx-lm's plain greedy decoding: models without an attention layer (before: refused at start) and hybrids'
    mamba layers (before: served one request at a time, "batched rollback needs recorded per-token states")."""
    path = recurrent[arch]
    server = Server("--model", path, "--decode-concurrency", concurrency)
    try:
        plain = [run(server, kind, what, {"speculative": False}) for kind, what, _ in REQUESTS]
        got = together(server, REQUESTS)
        stats = server.stats()
    finally:
        server.stop()
    for (kind, what, _), (text, ids, finish, timings), alone in zip(REQUESTS, got, plain):
        assert (text, ids, finish) == alone[:3]
        assert ids == plain_greedy(path, kind, what)
        assert timings["speculative"] and not alone[3]["speculative"]
    assert stats["completed"] == 2 * len(REQUESTS)
    assert (stats["rows_per_forward"]["max"] > 1) == (concurrency != "1"), stats
    assert stats["draft_n"] > 0, stats


LETTERS = {str(b): 40.0 for b in b"abcdef"}   # logit_bias: answers of these letters only (byte-level vocab)


def ask(server, what, **kw):
    """A greedy request answered in :data:`LETTERS` (sent back, the text is its own tokens again, with no space for
    mlx-lm's chat answer to strip): a chat (``what``: messages) or a completion (``what``: text); (text, finish
    reason, cached prompt tokens)."""
    client, kw = server.client, dict(model="default_model", max_tokens=N, temperature=0.0, logit_bias=LETTERS, **kw)
    if isinstance(what, str):
        r = client.completions.create(prompt=what, **kw)
        text = r.choices[0].text
    else:
        r = client.chat.completions.create(messages=what, **kw)
        text = r.choices[0].message.content
    details = r.usage.prompt_tokens_details
    return text, r.choices[0].finish_reason, details.cached_tokens if details else 0


def plain_text(path, what) -> str:
    """mlx-lm's own greedy decoding of :func:`ask`'s request (the same ``logit_bias``), as text."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_logits_processors

    model, tokenizer = load(str(path))
    prompt = tokenizer.encode(what) if isinstance(what, str) else tokenizer.apply_chat_template(
        what, add_generation_prompt=True)
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    for t, _ in generate_step(mx.array(prompt), model, max_tokens=N, sampler=lambda x: mx.argmax(x, axis=-1),
                              logits_processors=make_logits_processors({int(k): v for k, v in LETTERS.items()})):
        if t == EOS:
            break
        detokenizer.add_token(t)
    detokenizer.finalize()
    return detokenizer.text


@pytest.mark.parametrize("arch", ["mamba", "rwkv7"])
@pytest.mark.parametrize("concurrency", ["4", "1"])
def test_a_continued_conversation_reuses_the_recurrent_cache_exactly(recurrent, arch, concurrency):
    """A request continuing an earlier one starts from its stored cache (the earlier prompt and answer: a prefix of
    the new prompt, reused untrimmed, ``cached_tokens`` > 0) and answers what a fresh server answers, which is
    plain greedy decoding of the whole prompt: a chat's second turn, and a completion continuing one cut by a stop
    word (the cache then holds the stop word's tokens too; a speculative step may have been cut inside its
    accepted drafts)."""
    path = recurrent[arch]
    turn1 = [{"role": "user", "content": "abc abc abc def def def abc abc abc"}]
    prompt = "def def abc abc def def abc"
    server = Server("--model", path, "--decode-concurrency", concurrency)
    try:
        turn2 = turn1 + [{"role": "assistant", "content": ask(server, turn1)[0]},
                         {"role": "user", "content": "again: abc abc def def"}]
        whole = ask(server, prompt)[0]
        stop = whole[4:6]
        assert ask(server, prompt, stop=[stop])[1] == "stop"
        continued = prompt + whole[:whole.index(stop) + len(stop)] + "abc"   # the tokens fed, stop word included
        got = [ask(server, turn2), ask(server, continued)]
    finally:
        server.stop()
    for what, (text, _, cached) in zip([turn2, continued], got):
        assert cached > 0, (what, cached)   # a prompt-cache hit
        with Server("--model", path, "--decode-concurrency", concurrency) as fresh:
            fresh_text, _, fresh_cached = ask(fresh, what)
        assert fresh_cached == 0 and text == fresh_text == plain_text(path, what), what


@pytest.mark.parametrize("arch", ["mamba", "llama"])
@pytest.mark.parametrize("concurrency", ["1", "4"])
@pytest.mark.parametrize("speculative", [True, False])
def test_a_prompt_the_cache_holds_whole_is_answered(recurrent, tmp_path, arch, concurrency, speculative):
    """A completion whose prompt is an earlier prompt and its whole answer finds a cache holding exactly that
    (mlx-lm's exact hit: nothing left to feed). It is answered as a fresh server answers it (plain greedy of the
    whole prompt), and the cached tokens reported are those reused: an attention cache gives its last token back
    (trimmed: all but one reused), a recurrent one cannot be trimmed and the prompt is prefilled afresh (none).
    Before, served one at a time it was refused (HTTP 400, "the prompt must hold at least one token"),
    speculative or not, and then (fixed inside the generator) reported the whole prompt as cached. Batched, the
    answer's last token was never fed, so the stored cache is a shorter prefix, reused as it is."""
    path = recurrent[arch] if arch in recurrent else write_recurrent_model(arch, tmp_path / arch)
    prompt = "def def abc abc def def abc"
    extra = {} if speculative else {"extra_body": {"speculative": False}}
    with Server("--model", path, "--decode-concurrency", concurrency) as server:
        whole, finish, _ = ask(server, prompt, **extra)
        assert finish == "length"   # the cache is stored under the prompt and every answered token
        r = server.client.completions.create(model="default_model", prompt=prompt + whole, max_tokens=N,
                                             temperature=0.0, logit_bias=LETTERS, **extra)
    text, details = r.choices[0].text, r.usage.prompt_tokens_details
    assert text == plain_text(path, prompt + whole)
    # one at a time the first cache is stored under the prompt and every answered token (an exact hit: llama's
    # is trimmed by one, mamba's not reused); batched, under the tokens fed, the last answered one never was (a
    # shorter stored prefix, reused whole by both)
    whole_hit_of_a_state = arch == "mamba" and concurrency == "1"
    assert (details.cached_tokens if details else 0) == (0 if whole_hit_of_a_state else r.usage.prompt_tokens - 1)
