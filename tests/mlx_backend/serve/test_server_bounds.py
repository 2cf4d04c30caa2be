"""What ``ngram-spec serve`` keeps per user is bounded (``--max-users``): a long run with many users."""
from __future__ import annotations

import numpy as np
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


def _random_requests(n_requests: int, seed: int = 0, length: int = 24, vocab: int = 50):
    """Requests of random tokens (``_learn``: 2 prompt tokens, then the response): mostly new n-grams, some repeated."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, length).tolist() for _ in range(n_requests)]


def test_the_dynamic_cache_is_llama_cpps_until_the_bound_then_keeps_the_most_counted():
    """Before: ``--dynamic-max-entries`` did not exist and the dynamic cache grew without bound (measured: 148 to
    591 bytes per learned token, 2.95 GB and a 25 s save after 5 M tokens of random text; docs/server.md). Below
    the bound the cache is exactly the unbounded one (llama.cpp's); the request that takes it over keeps the
    ``N - N // 4`` entries of the largest counts, the latest learned first among equal counts, counts unchanged,
    and the cache then learns as one built from them."""
    from mlx_backend.ngram.hash_table import HashTable
    from mlx_backend.serve.server import NgramSpeculator

    n = 400
    bounded = NgramSpeculator(dynamic_max_entries=n)
    unbounded = NgramSpeculator(dynamic_max_entries=0)
    expected, learned_after_the_cut = None, 0
    for tokens in _random_requests(200, length=12):
        _learn(unbounded, None, tokens)
        table = bounded.dynamic_for(None)
        arrays, dropped_before = table.T[3], bounded.stats()["dynamic_entries_dropped"]
        _learn(bounded, None, tokens)
        dropped = bounded.stats()["dynamic_entries_dropped"]
        assert table.n_entries() <= n and bounded.dynamic_for(None) is table    # the same table, cut in place
        if not dropped:                              # below the bound: exactly the unbounded cache
            assert table.entries() == unbounded.dynamic_for(None).entries()
        elif expected is None:                       # the first cut: the rule, applied to the unbounded cache
            full = unbounded.dynamic_for(None)
            w0, w1, tok, cnt = full.arrays()         # insertion order: the latest learned last
            keep = sorted(range(len(tok)), key=lambda e: (-cnt[e], -e))[:n - n // 4]
            expected = HashTable()
            expected.add_rows(w0[keep], w1[keep], tok[keep], cnt[keep])
            assert dropped == full.n_entries() - (n - n // 4) and table.entries() == expected.entries()
        elif dropped == dropped_before:              # then it learns as a cache of the kept entries, in its arrays
            expected.update(np.asarray(tokens, np.int32), 2)
            assert table.entries() == expected.entries() and table.T[3] is arrays
            learned_after_the_cut += 1
        else:
            break                                    # the second cut
    else:
        pytest.fail("the cache never went over the bound twice: too few requests")
    assert learned_after_the_cut >= 2
    stats = bounded.stats()
    assert stats["dynamic_max_entries"] == n
    assert stats["dynamic_caches"]["server"]["bytes"] == sum(a.nbytes for a in table.T)


def test_the_dynamic_caches_memory_stays_bounded(tmp_path):
    """Entries and bytes stay bounded however much is learned (here over 180 times the bound in tokens); the scope's
    file is cut to the bound when loaded, server-wide or per user."""
    from mlx_backend.serve.server import NgramSpeculator, _scope_file

    n = 300
    speculator = NgramSpeculator(dynamic=str(tmp_path / "dyn.ngram"), dynamic_max_entries=n, save_every=10**9)
    sizes = []
    for tokens in _random_requests(2500, seed=1, vocab=5000):
        _learn(speculator, None, tokens)
        stats = speculator.stats()["dynamic_caches"]["server"]
        sizes.append((stats["entries"], stats["bytes"]))
    assert max(e for e, _ in sizes) <= n and speculator.stats()["dynamic_entries_dropped"] > 100 * n
    assert max(b for _, b in sizes) <= 200 * n + 4096          # arrays sized for 1.25 N entries, N n-grams
    speculator.save()
    unbounded = NgramSpeculator(dynamic=str(tmp_path / "dyn.ngram"), dynamic_max_entries=0)
    assert unbounded.dynamic_for(None).n_entries() == sizes[-1][0]
    small = NgramSpeculator(dynamic=str(tmp_path / "dyn.ngram"), dynamic_max_entries=100)
    assert small.dynamic_for(None).n_entries() == 75 and small.stats()["dynamic_entries_dropped"] > 0
    folder = tmp_path / "users"
    users = NgramSpeculator(dynamic=str(folder), scope="user", dynamic_max_entries=0)
    _learn(users, "alice", list(range(200)))
    users.save()
    assert NgramSpeculator(dynamic=str(folder), scope="user", dynamic_max_entries=40).dynamic_for(
        "alice").n_entries() == 30 and _scope_file(folder, "alice").is_file()


@pytest.mark.parametrize("value", ["-1", "1.5", "many"])
def test_a_bad_dynamic_max_entries_is_one_line(capsys, value):
    from mlx_backend.serve.server import NgramSpeculator

    try:       # argparse refuses a value that is not an integer (SystemExit), the checks a negative one
        status = main(["serve", "--blas", "bundled", "--model", "nowhere", "--dynamic-max-entries", value])
    except SystemExit as exc:
        status = exc.code
    err = capsys.readouterr().err
    assert status == 2 and "Traceback" not in err, err
    if value == "-1":
        assert err.count("\n") == 1 and "--dynamic-max-entries must be an integer >= 0 (0: no limit" in err, err
    else:
        assert f"argument --dynamic-max-entries: invalid int value: '{value}'" in err, err
    with pytest.raises(ValueError, match="--dynamic-max-entries must be an integer >= 0"):
        NgramSpeculator(dynamic_max_entries=-1)


def test_the_speculative_path_runs_on_the_stream_mlx_lm_s_server_gives(monkeypatch):
    """mlx-lm's server generates on its own stream (the default device's, so that generation and a sharded
    model's synchronisation share one) and passes it as ``stream``; the plain path took it, the speculative
    one dropped it and ran on mlx-lm's module-level generation stream."""
    import types

    import mlx.core as mx

    from mlx_backend.serve import server

    class Called(Exception):
        pass

    def spec_stream_generate(*args, **kwargs):
        raise Called(kwargs)

    monkeypatch.setattr(server, "spec_stream_generate", spec_stream_generate)
    spec = server.RequestSpec(True, 4, None)
    me = types.SimpleNamespace(_current=(types.SimpleNamespace(spec=spec), [1, 2, 3, 1, 2]))
    stream = mx.new_stream(mx.cpu)
    steps = server.SpecResponseGenerator._stream_generate(me, None, types.SimpleNamespace(eos_token_ids=[0]), [2], 5,
                                                          draft_model=server.NgramSpeculator(), stream=stream)
    with pytest.raises(Called) as called:
        next(steps)
    assert called.value.args[0]["stream"] is stream
