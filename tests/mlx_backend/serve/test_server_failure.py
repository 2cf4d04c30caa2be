"""``ngram-spec serve`` never dies silently (issue 29): faults injected into the real server's generation path.

Each test starts the real server (``mlx_backend.cli.main(["serve", ...])``) on a tiny model from a small launcher
script that first replaces ``mlx_backend.decode.generate.ngram_speculative_generate_step`` (the speculative step
the server generates with) by a faulty one, then talks to it with the real ``openai`` client:

* a Python exception in the generation itself is the worker's failure: logged with its traceback, every
  request in flight or waiting answered with HTTP 500 (a streamed one with an error event), exit status 1;
* a ``ValueError`` in the generation is that request's error (400) and the server keeps serving;
* a native crash (SIGILL, as from a BLAS built for another CPU) leaves faulthandler's report in the log and
  the process dies by the signal;
* the same worker failure in the batched path (``--decode-concurrency 8``, the step of
  ``mlx_backend.batch.generate.BatchSpeculativeDecoder`` replaced; the other tests run with 1, the
  single-sequence path).
"""
from __future__ import annotations

import http.client
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import child_processes
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("mlx_lm")

from mlx_backend.cli import main  # noqa: E402

ROOT = Path(__file__).parents[3]
MESSAGES = [{"role": "user", "content": "abc abc abc abc abc"}]

LAUNCHER = '''
import os, signal, sys, threading, time

import mlx_backend.decode.generate as generate

FAULT = os.environ["NGRAM_SPEC_TEST_FAULT"]
original = generate.ngram_speculative_generate_step
calls = []


def faulty_step(*args, **kwargs):
    calls.append(1)
    if FAULT == "raise":
        time.sleep(1.5)  # the other requests are waiting in the queue by then
        raise RuntimeError("injected failure in the speculative step")
    if FAULT == "sigill":
        signal.pthread_kill(threading.get_ident(), signal.SIGILL)  # what a CPU does on an unknown instruction
    if FAULT == "bad-request" and len(calls) == 1:
        raise ValueError("injected bad input of one request")
    yield from original(*args, **kwargs)


generate.ngram_speculative_generate_step = faulty_step

import mlx_backend.batch.generate as batch_generate

original_batch_step = batch_generate.BatchSpeculativeDecoder.step


def faulty_batch_step(self):
    if FAULT == "raise-batched":
        time.sleep(1.5)  # the other requests have joined the batch by then
        raise RuntimeError("injected failure in the batched step")
    return original_batch_step(self)


batch_generate.BatchSpeculativeDecoder.step = faulty_batch_step
from mlx_backend.cli import main

sys.exit(main(sys.argv[1:]))
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    out = tmp_path_factory.mktemp("failure-model") / "llama"
    assert main(["tiny-model", "--arch", "llama", "--seed", "2", "--out", str(out)]) == 0
    return out


class FaultyServer:
    """The launcher serving ``model`` on a free port with ``fault`` injected; its stderr goes to ``log``."""

    def __init__(self, tmp_path: Path, model: Path, fault: str, timeout: float = 60.0, concurrency: int = 1):
        self.port = free_port()
        launcher = tmp_path / "launch_faulty_server.py"
        launcher.write_text(LAUNCHER)
        self.log = tmp_path / "server.log"
        env = dict(os.environ, NGRAM_SPEC_TEST_FAULT=fault,
                   PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        with open(self.log, "wb") as err:
            self.proc = child_processes.start(
                [sys.executable, str(launcher), "serve", "--model", str(model), "--port", str(self.port),
                 "--blas", "bundled", "--draft-max", "3", "--log-level", "WARNING",
                 "--decode-concurrency", str(concurrency)],
                stdout=subprocess.DEVNULL, stderr=err, env=env, cwd=tmp_path)
        try:
            self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="unused",
                                        max_retries=0, timeout=30)
            deadline = time.monotonic() + timeout
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited at start ({self.proc.returncode}): {self.text()}")
                try:
                    if self.health() == 200:
                        break
                except OSError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"server did not start: {self.text()}")
                time.sleep(0.2)
        except BaseException:   # the fixture closes only the servers it was given
            child_processes.end(self.proc)
            raise

    def health(self) -> int:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        conn.request("GET", "/health")
        return conn.getresponse().status

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait(self, timeout: float = 30.0) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            child_processes.end(self.proc)
            pytest.fail(f"the server was still running {timeout:.0f} s later; its log:\n{self.text()}")

    def close(self) -> None:
        child_processes.end(self.proc)


@pytest.fixture
def start(tmp_path, tiny_llama):
    servers = []

    def start(fault: str, concurrency: int = 1) -> FaultyServer:
        servers.append(FaultyServer(tmp_path, tiny_llama, fault, concurrency=concurrency))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def outcome(call):
    """What ``call()`` raised (or returned)."""
    try:
        return call()
    except Exception as exc:  # noqa: BLE001 (the exception is the result)
        return exc


def test_a_worker_failure_answers_every_request_logs_its_traceback_and_exits_1(start):
    server = start("raise")
    client = server.client
    streamed = lambda: list(client.chat.completions.create(  # noqa: E731
        model="default_model", messages=MESSAGES, max_tokens=8, stream=True))
    waiting = [
        lambda: client.chat.completions.create(model="default_model", messages=MESSAGES, max_tokens=8),
        streamed,
        lambda: client.completions.create(model="default_model", prompt="one two one two", max_tokens=8),
    ]
    t0 = time.monotonic()
    with ThreadPoolExecutor(1 + len(waiting)) as pool:
        in_flight = pool.submit(outcome, streamed)  # its response has begun when the step raises (1.5 s later)
        time.sleep(0.5)
        queued = [pool.submit(outcome, call) for call in waiting]  # these wait in the queue meanwhile
        results = [in_flight.result()] + [f.result() for f in queued]
    rc = server.wait()
    log = server.text()
    for r in results:
        assert isinstance(r, openai.APIError) and not isinstance(r, openai.APIConnectionError), (r, log)
        assert "RuntimeError: injected failure in the speculative step" in r.message, (r, log)
    # the streamed answer had begun (HTTP 200): its last event is the error; the waiting ones get HTTP 500
    assert not isinstance(results[0], openai.APIStatusError), results[0]
    assert [r.status_code for r in results[1:]] == [500] * len(waiting), results
    assert rc == 1, log
    assert time.monotonic() - t0 < 30
    assert "Traceback (most recent call last)" in log and "in faulty_step" in log, log
    assert "RuntimeError: injected failure in the speculative step" in log, log
    assert "generation worker failed" in log, log


def test_a_worker_failure_in_a_batch_answers_every_request_and_exits_1(start):
    """The batched path (--decode-concurrency 8): the step fails while three requests decode together."""
    server = start("raise-batched", concurrency=8)
    client = server.client
    calls = [lambda: client.chat.completions.create(model="default_model", messages=MESSAGES, max_tokens=8),
             lambda: list(client.chat.completions.create(model="default_model", messages=MESSAGES, max_tokens=8,
                                                         stream=True)),
             lambda: client.completions.create(model="default_model", prompt="one two one two", max_tokens=8)]
    with ThreadPoolExecutor(len(calls)) as pool:
        results = [f.result() for f in [pool.submit(outcome, call) for call in calls]]
    rc = server.wait()
    log = server.text()
    for r in results:
        assert isinstance(r, openai.APIError) and not isinstance(r, openai.APIConnectionError), (r, log)
        assert "RuntimeError: injected failure in the batched step" in r.message, (r, log)
    assert rc == 1, log
    assert "in faulty_batch_step" in log and "generation worker failed" in log, log


def test_a_value_error_in_one_request_is_that_requests_error_and_the_server_keeps_serving(start):
    server = start("bad-request")
    with pytest.raises(openai.BadRequestError, match="injected bad input of one request"):
        server.client.chat.completions.create(model="default_model", messages=MESSAGES, max_tokens=8)
    r = server.client.chat.completions.create(model="default_model", messages=MESSAGES, max_tokens=8)
    assert r.choices[0].finish_reason in ("stop", "length")
    chunks = list(server.client.chat.completions.create(model="default_model", messages=MESSAGES, max_tokens=8,
                                                        stream=True))
    assert chunks and server.health() == 200 and server.proc.poll() is None
    server.proc.terminate()
    assert server.wait() == 0, server.text()
    assert "injected bad input of one request" in server.text()  # logged, with its traceback


def test_a_native_crash_in_the_worker_leaves_faulthandlers_report_and_dies_by_the_signal(start):
    server = start("sigill")
    with pytest.raises(openai.APIConnectionError):
        server.client.chat.completions.create(model="default_model", messages=MESSAGES, max_tokens=8)
    rc = server.wait()
    log = server.text()
    assert rc == -signal.SIGILL, (rc, log)
    assert "Fatal Python error: Illegal instruction" in log, log
    assert "in faulty_step" in log, log  # the Python stack of the crashing thread
