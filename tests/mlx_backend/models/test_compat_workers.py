"""The compatibility matrix's worker processes (mlx_backend/models/compat.py: check_all): spawned on every platform,
as a child forked after this process has run mlx (Linux) or loaded Metal (macOS) is not safe."""
from __future__ import annotations

import multiprocessing
import os
import time

import pytest

from mlx_backend.models import compat


def test_a_worker_started_after_this_process_ran_mlx_checks_its_architecture():
    """Before: the worker was forked on Linux, and a forked child of a process that has evaluated anything with
    mlx hangs at its first evaluation, so every architecture "timed out ... building the model" (why the
    spawned-worker test removed in 2bc9f1b timed out in CI: its first half forked, from a test process that had
    run mlx by then; alone, it had not, and passed)."""
    import mlx.core as mx

    mx.eval(mx.ones(2) + 1)
    row, = compat.check_all(["llama"], timeout=60)
    assert row["verdict"] == "identical", row


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="forks its worker")
def test_a_worker_that_dies_at_once_is_reported_at_once_with_its_exit_code(monkeypatch):
    """A worker that dies before its first message (a spawned one that cannot import, one killed by the system)
    is its architecture's verdict as soon as it is dead, with its exit code, and a new worker takes the rest:
    the parent closes its copy of the pipe's sending end, so the death reads as end of file, not as a silence
    until the timeout. A forked worker that exits at once stands for any start method."""
    monkeypatch.setattr(compat, "start_method", lambda: "fork")
    monkeypatch.setattr(compat, "_work", lambda archs, send: os._exit(3))
    t0 = time.monotonic()
    rows = list(compat.check_all(["llama", "gemma3_text"], timeout=120))
    assert time.monotonic() - t0 < 20
    crashed = "the process crashed (exit code 3) in speculative decoding"   # no stage reported: the last one's words
    assert [(r["arch"], r["verdict"], r["detail"]) for r in rows] == [("llama", "error", crashed),
                                                                        ("gemma3_text", "error", crashed)]
