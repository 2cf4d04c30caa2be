"""``ngram-spec serve`` sets mlx's wired limit as ``mlx_lm.server``'s main does (which it bypasses): on Metal the
model's weights stay wired for the server's life, the batched path included. Metal is simulated: the device
reports a recommended working set, and the HTTP server returns at once."""
from __future__ import annotations

import socket

import mlx.core as mx
from mlx_lm import server as mlx_server

from mlx_backend.cli import main


def test_serve_wires_the_recommended_working_set_before_serving(tmp_path, monkeypatch):
    assert main(["tiny-model", "--arch", "llama", "--seed", "2", "--out", str(tmp_path / "llama")]) == 0
    events = []
    monkeypatch.setattr(mx, "device_info", lambda: {"max_recommended_working_set_size": 1 << 40})
    monkeypatch.setattr(mx, "set_wired_limit", lambda n: events.append(("wired", n)) or 0)
    monkeypatch.setattr(mlx_server, "_run_http_server", lambda *a, **k: events.append(("serving",)))
    with socket.socket() as sock:   # a free port (the arguments are checked by binding it; nothing listens)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert main(["serve", "--model", str(tmp_path / "llama"), "--host", "127.0.0.1", "--port", str(port),
                 "--blas", "bundled"]) == 0
    assert events[:2] == [("wired", 1 << 40), ("serving",)]
