"""The compatibility matrix's worker processes (mlx_backend/models/compat.py: check_all): forked on Linux only;
spawned elsewhere (macOS, simulated here), where a child forked after mlx has loaded Metal is not safe."""
from __future__ import annotations

import pytest

from mlx_backend.models import compat


@pytest.mark.parametrize("platform, method", [("linux", "fork"), ("darwin", "spawn"), ("win32", "spawn")])
def test_the_worker_is_forked_on_linux_only(monkeypatch, platform, method):
    monkeypatch.setattr(compat.sys, "platform", platform)
    assert compat.start_method() == method
