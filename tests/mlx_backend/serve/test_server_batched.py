"""``ngram-spec serve`` decoding concurrent requests together (issue 28), with the real ``openai`` client.

Eight clients at once (chat, an edit and completions, streamed and not, speculative with several draft lengths
and drafters, and plain, greedy and one sampled) against servers on tiny models: each greedy one gets exactly
what the same request gets alone (the sampled one completes; its exactness is the decoder's, tested in
``tests/mlx_backend/batch``), every greedy answer is plain greedy decoding's (mlx-lm's own ``generate_step``, cut after the
EOS token), and the server really verified several rows in one forward (``/v1/stats``
``rows_per_forward`` max > 1). A client that hangs up mid-stream frees its row (counted ``cancelled``,
far fewer tokens than it asked for) while the others complete correctly. SIGTERM ends every request in flight
with an error its client sees and saves the dynamic cache.
"""
from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("mlx_lm")

from mlx_backend.cli import main  # noqa: E402
from test_server import Server  # noqa: E402  (tests/mlx_backend/serve/test_server.py)

N = 64   # long enough that requests sent together overlap in the batch
EOS = 256  # the tiny models' EOS token (reference.models.tiny.EOS_TOKEN_ID)
MESSAGES = [
    [{"role": "user", "content": "abc abc abc abc abc"}],
    [{"role": "user", "content": "the cat sat on the mat, the cat sat"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1 2 3 1 2 3 1 2"}],
]
PROMPT = "one two one two one two one two"
EDIT = [{"role": "user", "content": "Rename total to subtotal in this file and give the whole file back:\n\n"
                                    "def add(items):\n    total = 0\n    for item in items:\n        total += item\n"
                                    "    return total\n"}]
# (kind, messages or prompt, extra body): streamed and not, speculative (default, fixed, suffix) and plain,
# greedy and sampled ("sampled": temperature 0.8), chat and an agent's edit (a file to give back changed)
REQUESTS = [
    ("chat", MESSAGES[0], {}),
    ("stream", MESSAGES[1], {"draft_max": 3}),
    ("chat", MESSAGES[2], {"speculative": False}),
    ("text", PROMPT, {}),
    ("stream", MESSAGES[0], {"drafter": "suffix"}),
    ("chat", MESSAGES[1], {"draft_max": 0}),
    ("chat", EDIT, {}),
    ("sampled", EDIT, {}),
]


def run(server, kind, what, body):
    """One greedy request: (text, token ids or None when streamed, finish reason, timings or None)."""
    client = server.client
    if kind == "text":
        r = client.completions.create(model="default_model", prompt=what, max_tokens=N, temperature=0.0,
                                      extra_body=body or None)
        c = r.choices[0]
        return c.text, None, c.finish_reason, r.model_extra["timings"]
    if kind == "sampled":
        r = client.chat.completions.create(model="default_model", messages=what, max_tokens=N, temperature=0.8,
                                           extra_body=body or None)
        return r.choices[0].message.content or "", None, r.choices[0].finish_reason, r.model_extra["timings"]
    if kind == "stream":
        chunks = list(client.chat.completions.create(model="default_model", messages=what, max_tokens=N,
                                                     temperature=0.0, stream=True, extra_body=body or None))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        final = next(c for c in chunks if c.choices and c.choices[0].finish_reason)
        return text, None, final.choices[0].finish_reason, final.model_extra["timings"]
    r = client.chat.completions.create(model="default_model", messages=what, max_tokens=N, temperature=0.0,
                                       logprobs=True, extra_body=body or None)
    c = r.choices[0]
    return c.message.content or "", [t.model_extra["id"] for t in c.logprobs.content], c.finish_reason, \
        r.model_extra["timings"]


def together(server, requests):
    """``requests`` sent at once from one thread each (released together by a barrier)."""
    barrier = threading.Barrier(len(requests))

    def one(request):
        barrier.wait()
        return run(server, *request)

    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(one, requests))


def plain_greedy(path, kind, what):
    """mlx-lm's own greedy decoding of the request's prompt: N tokens, cut after the first EOS."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    model, tokenizer = load(str(path))
    prompt = tokenizer.encode(what) if kind == "text" else tokenizer.apply_chat_template(
        what, add_generation_prompt=True)
    out = []
    for t, _ in generate_step(mx.array(prompt), model, max_tokens=N, sampler=lambda x: mx.argmax(x, axis=-1)):
        out.append(int(t))
        if t == EOS:
            break
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("batched-models")
    out = {}
    for arch in ("llama", "qwen3_5", "llama_sliding"):
        out[arch] = root / arch
        assert main(["tiny-model", "--arch", arch, "--seed", "2", "--out", str(out[arch])]) == 0
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen3_5", "llama_sliding"])
def test_concurrent_clients_each_get_what_they_get_alone_in_one_batch(models, arch):
    server = Server("--model", str(models[arch]), "--decode-concurrency", "8")
    try:
        alone = [run(server, *request) for request in REQUESTS]
        before = server.stats()
        got = together(server, REQUESTS)
        stats = server.stats()
    finally:
        server.stop()
    greedy = [kind != "sampled" for kind, *_ in REQUESTS]
    assert [g[:3] for g, k in zip(got, greedy) if k] == [a[:3] for a, k in zip(alone, greedy) if k]
    for (kind, what, body), (text, ids, finish, timings) in zip(REQUESTS, got):
        assert finish in ("stop", "length") and timings["predicted_n"] >= 1
        if ids is not None:
            assert ids == plain_greedy(models[arch], kind, what), (arch, body)
            assert timings["predicted_n"] == len(ids)
        speculative = body.get("speculative", True) and body.get("draft_max", 1) != 0
        assert timings["speculative"] == speculative and (timings["draft_n"] == 0 or speculative)
        assert timings["draft_max"] == (0 if not speculative else body.get("draft_max", "auto"))
    texts = {json.dumps(what): text for (kind, what, _), (text, *_ignored) in zip(REQUESTS, got) if kind == "chat"}
    for (kind, what, _), (text, *_ignored) in zip(REQUESTS, got):
        if kind == "stream":   # the same conversation, not streamed, is answered with the same text
            assert text == texts.get(json.dumps(what), text) and text
    assert stats["completed"] == before["completed"] + len(REQUESTS)
    assert stats["rows_per_forward"]["max"] > 1, stats
    assert stats["verify_forwards"] - before["verify_forwards"] < sum(
        t["decode_forwards"] for *_rest, t in got), stats   # shared forwards: fewer than the requests' own
    # the totals of /v1/stats from the responses' own metrics (these 12 requests are all the server saw)
    timings = [t for *_rest, t in alone + got]
    assert stats["requests"] == len(timings)
    assert stats["accepted_per_row_step"] == pytest.approx(
        sum(t["draft_n_accepted"] for t in timings) / sum(t["decode_forwards"] for t in timings))
    assert stats["queue_wait"]["max"] == pytest.approx(max(t["queue_ms"] for t in timings) / 1e3)
    assert stats["queue_wait"]["mean"] == pytest.approx(sum(t["queue_ms"] for t in timings) / 1e3 / len(timings))


def write_recurrent_model(arch: str, out) -> str:
    """A tiny random model of the compatibility matrix's ``arch`` (:func:`mlx_backend.models.compat.tiny_config`)
    with the tiny models' tokenizer, written in mlx-lm's format."""
    import importlib

    import mlx.core as mx
    from mlx_backend.models.compat import randomize, tiny_config
    from reference.models.tiny import VOCAB_SIZE, write_tokenizer

    module = importlib.import_module(f"mlx_lm.models.{arch}")
    config = {**tiny_config(module), "vocab_size": VOCAB_SIZE, "eos_token_id": EOS}
    mx.random.seed(2)
    model = randomize(module.Model(module.ModelArgs.from_dict(config)))
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(config))
    model.save_weights(str(out / "model.safetensors"))
    write_tokenizer(out)
    return str(out)


def test_decode_concurrency_one_serves_one_row_per_forward(models):
    server = Server("--model", str(models["llama"]), "--decode-concurrency", "1")
    try:
        got = together(server, REQUESTS[:3])
        stats = server.stats()
    finally:
        server.stop()
    assert stats["rows_per_forward"]["max"] == 1 and stats["completed"] == 3
    assert got[0][1] == plain_greedy(models["llama"], "chat", MESSAGES[0])
    # served one after the other: the request served last waited (queue_ms) for at least one whole other answer
    waits = sorted((t["queue_ms"], t["prompt_ms"] + t["predicted_ms"]) for *_rest, t in got)
    assert waits[-1][0] >= min(answer for _, answer in waits[:-1]), waits
    assert stats["queue_wait"]["max"] == pytest.approx(waits[-1][0] / 1e3)


def test_a_request_beyond_decode_concurrency_waits_for_a_free_row(models):
    """Three requests, two rows: the third joins when a row frees, and its wait is reported (``queue_ms``)."""
    server = Server("--model", str(models["llama"]), "--decode-concurrency", "2")
    try:
        got = together(server, [REQUESTS[0], REQUESTS[3], REQUESTS[5]])
        stats = server.stats()
    finally:
        server.stop()
    assert stats["rows_per_forward"]["max"] == 2 and stats["completed"] == 3
    waits = sorted((t["queue_ms"], t["predicted_ms"]) for *_rest, t in got)
    # it waited until the quicker of the two ended (half of that: the three arrive a few ms apart)
    assert waits[-1][0] >= 0.5 * min(decode for _, decode in waits[:-1]), waits
    assert stats["queue_wait"]["max"] == pytest.approx(waits[-1][0] / 1e3)


def test_a_client_that_hangs_up_mid_stream_frees_its_row_and_the_others_complete(models):
    server = Server("--model", str(models["llama"]), "--decode-concurrency", "8")
    try:
        others = [REQUESTS[0], REQUESTS[1], REQUESTS[3]]
        alone = [run(server, *request) for request in others]
        before = server.stats()
        conn, r = server.open_stream(MESSAGES[2])
        with ThreadPoolExecutor(len(others)) as pool:
            futures = [pool.submit(run, server, *request) for request in others]
            time.sleep(0.2)
            r.close()                                     # hang up with the answer unread
            conn.close()
            got = [f.result() for f in futures]
        after = server.stats()
        assert run(server, *REQUESTS[2])[2] in ("stop", "length")   # still serving
    finally:
        server.stop()
    assert [g[:3] for g in got] == [a[:3] for a in alone]
    assert after["cancelled"] == before["cancelled"] + 1
    assert after["completed"] == before["completed"] + len(others)
    assert after["completion_tokens"] - before["completion_tokens"] < 3000
    assert after["rows_per_forward"]["max"] > 1


@pytest.mark.parametrize("extra", [{}, {"seed": 0}], ids=["batched", "served-alone"])
def test_a_client_that_hangs_up_before_a_non_streamed_answer_stops_its_request(models, extra):
    """A non-streamed request has nothing to write until it ends, so no failed write can tell the server its
    client went away (a timeout, Ctrl-C): before, it decoded to ``max_tokens`` for no one (mlx-lm's server still
    does). Now it is stopped within a token of the hang-up, batched or served alone (``seed``: mlx-lm serves
    seeded requests one at a time), counted ``cancelled``, and the server goes on serving."""
    server = Server("--model", str(models["llama"]), "--decode-concurrency", "8")
    try:
        before = server.stats()
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        conn.request("POST", "/v1/chat/completions", headers={"Content-Type": "application/json"}, body=json.dumps(
            {"messages": MESSAGES[2], "max_tokens": 3000, "temperature": 0.0, "logit_bias": {str(EOS): -100},
             **extra}))                                    # no EOS: only the hang-up can end it before 3000 tokens
        time.sleep(0.3)
        conn.close()                                       # hang up with the answer unread
        deadline = time.monotonic() + 120
        while (after := server.stats())["cancelled"] + after["completed"] == before["cancelled"] + before["completed"]:
            assert time.monotonic() < deadline, after
            time.sleep(0.05)
        time.sleep(0.5)
        assert server.stats()["completion_tokens"] == after["completion_tokens"]     # nothing decoded since
        assert run(server, *REQUESTS[0])[2] in ("stop", "length")                     # still serving
    finally:
        server.stop()
    assert after["cancelled"] == before["cancelled"] + 1 and after["completed"] == before["completed"]
    assert after["completion_tokens"] - before["completion_tokens"] < 3000


def test_clients_connecting_at_once_while_the_server_is_busy_are_all_answered(models):
    """Agents fan out: many clients connect in the same instant. The connections the server has not accepted yet
    wait in the listen backlog, which was socketserver's 5: a burst overflowed it and the clients beyond it got
    "connection reset" or hung (``openai``: ``APIConnectionError``; 17 of 512 clients released together here).
    Made certain by stopping the server's process (SIGSTOP) while 64 clients connect: each connection must
    complete, and once the server runs again each is answered."""
    server = Server("--model", str(models["llama"]), "--decode-concurrency", "8")
    clients = []
    try:
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            for _ in range(64):
                clients.append(socket.create_connection(("127.0.0.1", server.port), timeout=5))
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        for sock in clients:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        answers = [sock.makefile("rb").readline() for sock in clients]
    finally:
        for sock in clients:
            sock.close()
        server.stop()
    assert answers == [b"HTTP/1.0 200 OK\r\n"] * 64, set(answers)


def test_sigterm_ends_every_request_in_flight_with_an_error_and_saves_the_dynamic_cache(models, tmp_path):
    """SIGTERM while three requests decode in one batch (two streamed, one not, through the openai client), one
    request having completed before: the server exits 0; every client in flight gets an error it sees (the
    streams' last event is an error, which the client raises as an APIError; the other gets HTTP 503), none an
    answer cut short without one; the dynamic cache is saved with what the completed request taught it."""
    from mlx_backend.ngram.dynamic_cache import load_dynamic

    dyn = tmp_path / "dyn.ngram"
    server = Server("--model", str(models["llama"]), "--dynamic", str(dyn), "--save-every", "1000")
    stopped = False
    try:
        assert run(server, *REQUESTS[0])[2] in ("stop", "length")
        learned = server.stats()["dynamic_caches"]["server"]["ngrams"]
        assert learned > 0 and not dyn.exists()          # learned, not saved yet (--save-every 1000)

        def long_chat(messages, stream):
            return server.client.chat.completions.create(model="default_model", messages=messages, max_tokens=3000,
                                                         temperature=0.0, stream=stream)

        with ThreadPoolExecutor(1) as pool:
            whole = pool.submit(long_chat, MESSAGES[0], False)
            streams = [iter(long_chat(m, True)) for m in MESSAGES[1:]]
            firsts = [next(s) for s in streams]           # both have begun, and the request sent before them too
            out = server.stop()                           # SIGTERM; asserts exit status 0
            stopped = True
            for stream in streams:
                with pytest.raises(openai.APIError, match="stopping") as cut:
                    for chunk in stream:
                        assert not (chunk.choices and chunk.choices[0].finish_reason), "a stream completed"
                assert not isinstance(cut.value, openai.APIConnectionError)
            with pytest.raises(openai.APIStatusError, match="stopping") as refused:
                whole.result(timeout=60)
            assert refused.value.status_code == 503
        assert all(f.choices for f in firsts)
    finally:
        if not stopped:
            server.stop(check=False)
    assert dyn.exists() and len(load_dynamic(dyn)) > 0, out


def test_a_request_whose_sampler_refuses_its_arguments_gets_400_and_the_batch_serves_on(models):
    """mlx refuses a top_k beyond the vocabulary only when sampling; in a batch that would fail the shared step
    (the worker), so the request's sampler is tried first: the request gets 400, the others are answered."""
    server = Server("--model", str(models["llama"]), "--decode-concurrency", "8")
    try:
        with pytest.raises(openai.BadRequestError, match="top_k"):
            server.client.chat.completions.create(model="default_model", messages=MESSAGES[0], max_tokens=8,
                                                  temperature=1.0, extra_body={"top_k": 100000})
        got = together(server, REQUESTS[:2])
        assert server.get("/health")[0] == 200
    finally:
        server.stop()
    assert got[0][1] == plain_greedy(models["llama"], "chat", MESSAGES[0])


def post(server, path, body: dict):
    status, payload = server.post_raw(path, json.dumps(body).encode())
    return status, payload


HI = [{"role": "user", "content": "hi"}]
FIELDS_MLX_LM_DOES_NOT_CHECK = [   # before: the first three stopped the batched server (exit 1), the logit_bias
    # one crashed it on a later request (SIGSEGV), the others were HTTP 404 or taken silently
    ("/v1/completions", {"prompt": "", "max_tokens": 4}, "prompt is empty"),
    ("/v1/completions", {"prompt": "ab", "max_tokens": 4, "stop": 5}, "stop must be a string or a list of strings"),
    ("/v1/completions", {"prompt": "ab", "max_tokens": 4, "stop": [1]}, "stop must be a string or a list"),
    ("/v1/completions", {"prompt": "ab", "max_tokens": 4, "logit_bias": {"99999": 5}}, "logit_bias token id 99999"),
    ("/v1/completions", {"prompt": "ab", "max_tokens": 4, "logit_bias": {"-3": 5}}, "logit_bias token id -3"),
    ("/v1/chat/completions", {"messages": HI, "max_tokens": 4, "tools": 5}, "tools must be a list"),
    ("/v1/chat/completions", {"messages": HI, "max_tokens": 4, "chat_template_kwargs": 5},
     "chat_template_kwargs must be an object"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "foo"}]}], "max_tokens": 4},
     "messages[0].content must be text, or a list of text parts"),
    ("/v1/chat/completions", {"messages": HI, "max_tokens": 4, "stream_options": 5}, "stream_options must be"),
    ("/v1/chat/completions", {"messages": HI, "max_tokens": 4, "role_mapping": 5}, "role_mapping must be"),
]


def test_fields_mlx_lm_takes_unchecked_get_400_and_the_batched_server_serves_on(models):
    """Each request is answered 400 naming its field, twice (the logit_bias crash came on the second), and the
    server then answers a good request exactly: it is still the same process, serving."""
    server = Server("--model", str(models["llama"]), "--decode-concurrency", "8")
    try:
        for path, body, needle in FIELDS_MLX_LM_DOES_NOT_CHECK:
            for _ in range(2):
                status, payload = post(server, path, body)
                assert status == 400 and needle in payload["error"]["message"], (body, status, payload)
        assert server.proc.poll() is None
        got = run(server, *REQUESTS[0])
    finally:
        server.stop()
    assert got[1] == plain_greedy(models["llama"], *REQUESTS[0][:2])


def test_a_second_sigterm_while_stopping_is_ignored(models, tmp_path):
    """SIGTERM twice 50 ms apart: exit 0 and the dynamic cache saved (before: exit 134, 130 or 143, the
    second signal breaking mlx-lm's shutdown, sometimes before the save)."""
    dyn = tmp_path / "dyn.ngram"
    with Server("--model", str(models["llama"]), "--dynamic", str(dyn), "--save-every", "1000") as server:
        run(server, *REQUESTS[0])
        server.proc.terminate()
        time.sleep(0.05)
        server.proc.terminate()
        out = server.proc.communicate(timeout=600)[0].decode()
    assert server.proc.returncode == 0, out
    assert dyn.exists() and "already stopping" in out, out


def test_top_logprobs_name_the_generated_token_sorted_most_likely_first(models):
    """``logprobs`` with ``top_logprobs``, greedy, decoded in a batch with two other requests: each
    ``logprobs.content`` entry is the generated token (the ids a ``logprobs``-only request gets, plain greedy
    decoding's), with its own log-probability, and its ``top_logprobs`` come most likely first, the generated
    (greedy) token among them with the same log-probability. Before, mlx-lm 0.32 wrote each entry as the first of
    the top tokens in ``mx.argpartition`` order (unsorted): not the generated token at most positions, and
    changing with the last bits of the logits, so between speculative and plain decoding."""
    server = Server("--model", str(models["llama"]), "--decode-concurrency", "8")
    try:
        ids = run(server, *REQUESTS[0])[1]

        def with_top(_):
            return server.client.chat.completions.create(
                model="default_model", messages=REQUESTS[0][1], max_tokens=N, temperature=0.0, logprobs=True,
                top_logprobs=5)

        with ThreadPoolExecutor(3) as pool:
            others = [pool.submit(run, server, *REQUESTS[i]) for i in (1, 3)]
            r = with_top(None)
            assert all(f.result()[2] in ("stop", "length") for f in others)
    finally:
        server.stop()
    content = r.choices[0].logprobs.content
    assert [c.model_extra["id"] for c in content] == ids == plain_greedy(models["llama"], *REQUESTS[0][:2])
    for entry in content:
        tops = entry.top_logprobs
        assert len(tops) == 5 and [t.logprob for t in tops] == sorted((t.logprob for t in tops), reverse=True)
        assert tops[0].model_extra["id"] == entry.model_extra["id"]      # greedy: the most likely token
        assert entry.logprob == pytest.approx(tops[0].logprob, abs=1e-6) and entry.token == tops[0].token


BAD_SPEC_FIELDS = [({"draft_max": -1}, "draft_max"), ({"draft_max": "x"}, "draft_max"), ({"n_draft": 1.5}, "n_draft"),
                   ({"drafter": "foo"}, "drafter"), ({"drafter": 3}, "drafter"), ({"speculative": "yes"}, "speculative"),
                   ({"user": 5}, "user"), ({"stop": 3}, "stop"), ({"draft_max": 65}, "draft_max"),
                   ({"num_draft_tokens": 10 ** 9}, "num_draft_tokens")]


def test_bad_speculation_fields_get_400_naming_the_field_in_param_while_a_batch_decodes(models):
    """Bad per-request fields sent (through the openai client) while two requests decode together: each is HTTP
    400 whose OpenAI error body names the field in ``param`` (before: always null) and in the message; the two
    requests in flight are answered exactly as alone, and the server serves on. A fixed draft length above 64
    is refused: one request's width is that of every batched row (before: 10**9 accepted)."""
    server = Server("--model", str(models["llama"]), "--decode-concurrency", "8")
    try:
        others = [REQUESTS[0], REQUESTS[3]]
        alone = [run(server, *request) for request in others]
        with ThreadPoolExecutor(len(others)) as pool:
            futures = [pool.submit(run, server, *request) for request in others]
            for fields, name in BAD_SPEC_FIELDS:
                body = {"max_tokens": 8, **fields}
                with pytest.raises(openai.BadRequestError) as refused:
                    server.client.chat.completions.create(model="default_model", messages=MESSAGES[0],
                                                          temperature=body.pop("temperature", 0.0), extra_body=body)
                error = refused.value.body
                assert error["type"] == "invalid_request_error" and error["param"] == name, (fields, error)
                assert name in error["message"], (fields, error)
            got = [f.result() for f in futures]
        assert server.get("/health")[0] == 200
    finally:
        server.stop()
    assert [g[:3] for g in got] == [a[:3] for a in alone]
