"""What ``ngram-spec serve`` keeps per user is bounded (``--max-users``): a long run with many users."""
from __future__ import annotations

import pytest

pytest.importorskip("mlx_lm")

from mlx_backend.cli import main  # noqa: E402


def _learn(speculator, user, tokens):
    from mlx_backend.serve.server import RequestSpec

    speculator.finish(RequestSpec(True, 4, user), tokens, 2, completed=True)


def test_users_in_memory_are_bounded_and_the_dropped_ones_come_back_from_their_files(tmp_path):
    """Before: every ``user`` seen since start kept its dynamic cache and history in memory and in /v1/stats
    (measured: +47 KB of RSS and +81 bytes of /v1/stats per distinct user, 12,000 users: 759 MB, a 978 KB
    /v1/stats answered in 0.5 s). With ``max_users`` the least recently used user is saved and dropped."""
    from mlx_backend.serve.server import NgramSpeculator

    folder = tmp_path / "users"
    speculator = NgramSpeculator(dynamic=str(folder), history=str(folder), scope="user", max_users=2,
                                 history_max_tokens=100)
    _learn(speculator, "alice", [5, 6, 7, 5, 6, 7])
    alice = (speculator.dynamic_for("alice").entries(), speculator.history_for("alice").sequences)
    for user in ("bob", "carol", "dave"):
        _learn(speculator, user, [1, 2, 3, 1, 2])
        assert len(speculator.c_dyn) <= 2 and len(speculator.histories) <= 2
    stats = speculator.stats()
    assert len(stats["dynamic_caches"]) == len(stats["suffix_histories"]) == 2 and stats["users_dropped"] == 2
    assert "alice" not in speculator.c_dyn and "alice" not in speculator.histories
    assert (speculator.dynamic_for("alice").entries(), speculator.history_for("alice").sequences) == alice
    assert len(speculator.c_dyn) <= 2


def test_without_files_a_dropped_user_starts_afresh(tmp_path):
    from mlx_backend.serve.server import NgramSpeculator

    speculator = NgramSpeculator(scope="user", max_users=1)
    _learn(speculator, "alice", [5, 6, 7, 5, 6, 7])
    _learn(speculator, "bob", [5, 6, 7, 5, 6, 7])
    assert list(speculator.c_dyn) == ["bob"] and list(speculator.histories) == ["bob"]
    assert len(speculator.dynamic_for("alice")) == 0 and speculator.history_for("alice").n_tokens == 0


def test_a_user_whose_file_cannot_be_written_is_kept(tmp_path):
    from mlx_backend.serve.server import NgramSpeculator, _scope_file

    folder = tmp_path / "users"
    speculator = NgramSpeculator(dynamic=str(folder), scope="user", max_users=1)
    _learn(speculator, "alice", [5, 6, 7, 5, 6, 7])
    _scope_file(folder, "alice").mkdir()          # alice's file cannot be written
    _learn(speculator, "bob", [5, 6, 7, 5, 6, 7])
    assert "alice" in speculator.c_dyn            # not dropped: what it learned would be lost
    _scope_file(folder, "alice").rmdir()
    _learn(speculator, "carol", [5, 6, 7, 5, 6, 7])
    assert "alice" not in speculator.c_dyn and _scope_file(folder, "alice").is_file()


def test_a_negative_max_users_is_one_line(capsys):
    assert main(["serve", "--blas", "bundled", "--model", "nowhere", "--max-users", "-1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--max-users must be >= 0" in err, err
