"""The compatibility matrix's worker processes (mlx_backend/models/compat.py: check_all): forked on Linux only;
spawned elsewhere (macOS, simulated here), where a child forked after mlx has loaded Metal is not safe."""
from __future__ import annotations

import pytest

from mlx_backend.models import compat


@pytest.mark.parametrize("platform, method", [("linux", "fork"), ("darwin", "spawn"), ("win32", "spawn")])
def test_the_worker_is_forked_on_linux_only(monkeypatch, platform, method):
    monkeypatch.setattr(compat.sys, "platform", platform)
    assert compat.start_method() == method


def test_a_spawned_worker_gives_the_forked_workers_verdict(monkeypatch):
    """What macOS gets: the row of a spawned worker (a fresh interpreter importing compat) is a forked one's."""
    forked, = compat.check_all(["llama"], timeout=300)
    monkeypatch.setattr(compat.sys, "platform", "darwin")
    spawned, = compat.check_all(["llama"], timeout=300)
    assert spawned == forked and spawned["verdict"] == "identical"
