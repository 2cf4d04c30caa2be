"""What ``ngram-spec serve`` keeps across requests and restarts, per scope (``--dynamic-scope``): the dynamic
caches' and suffix histories' files are checked at start, and an operator's mistakes there are one line, not a
failure later."""
from __future__ import annotations

import contextlib
import hashlib
import signal
import subprocess
import sys
import textwrap
import threading
import time

import child_processes
import pytest

pytest.importorskip("mlx_lm")

from mlx_backend.cli import main  # noqa: E402

pytest.importorskip("openai")


def user_file(folder, user: str, suffix: str = ".ngram"):
    return folder / f"user-{hashlib.sha256(user.encode()).hexdigest()[:32]}{suffix}"


@pytest.mark.parametrize("content", [b"", b"garbage bytes, not a cache", b"\x01\x00\x00\x00" * 3],
                         ids=["empty", "damaged", "foreign"])
def test_a_damaged_user_cache_is_one_line_at_start(capsys, tmp_path, content):
    """Before: ``--dynamic-scope user`` read a user's file only at that user's first request, inside the
    generation worker, so one damaged file stopped the whole server then (exit status 1, every request in
    flight answered 500). ``--model nowhere``: the check comes before the model is loaded."""
    folder = tmp_path / "users"
    folder.mkdir()
    user_file(folder, "alice").write_bytes(content)
    assert main(["serve", "--blas", "bundled", "--model", "nowhere", "--dynamic-scope", "user",
                 "--dynamic", str(folder)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--dynamic {folder}: a user's dynamic cache cannot be read" in err, err
    assert str(user_file(folder, "alice")) in err and "Traceback" not in err, err
    assert user_file(folder, "alice").read_bytes() == content     # left as it was


def test_readable_user_caches_pass_the_check_at_start(capsys, tmp_path):
    from mlx_backend.serve.server import NgramSpeculator, RequestSpec

    folder = tmp_path / "users"
    first = NgramSpeculator(dynamic=str(folder), scope="user")
    first.finish(RequestSpec(True, 4, "alice"), [5, 6, 7, 5, 6, 7], 2, completed=True)
    first.save()
    assert user_file(folder, "alice").is_file()
    again = NgramSpeculator(dynamic=str(folder), scope="user")
    assert len(again.dynamic_for("alice")) == len(first.dynamic_for("alice")) > 0
    assert len(again.dynamic_for("bob")) == 0


def test_one_unwritable_user_cache_does_not_stop_the_others_being_saved(tmp_path):
    """Before: ``save`` stopped at the first file it could not write, so every later user's cache went
    unsaved (and was marked saved)."""
    from mlx_backend.ngram.dynamic_cache import load_dynamic
    from mlx_backend.serve.server import NgramSpeculator, RequestSpec

    folder = tmp_path / "users"
    speculator = NgramSpeculator(dynamic=str(folder), scope="user")
    for user in ("alice", "bob"):
        speculator.finish(RequestSpec(True, 4, user), [5, 6, 7, 5, 6, 7], 2, completed=True)
    user_file(folder, "alice").mkdir()           # sorted first: alice's hash begins 2bd8, bob's 81b6
    with pytest.raises(IsADirectoryError):
        speculator.save()
    assert len(load_dynamic(user_file(folder, "bob"))) > 0
    assert sorted(p.name for p in folder.iterdir()) == sorted([user_file(folder, "alice").name,
                                                               user_file(folder, "bob").name])   # no temporary
    user_file(folder, "alice").rmdir()
    speculator.save()                             # still to be saved, and saved now
    assert len(load_dynamic(user_file(folder, "alice"))) > 0


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("scope-models") / "llama"
    assert main(["tiny-model", "--arch", "llama", "--out", str(path)]) == 0
    return path


@contextlib.contextmanager
def served(llama, dyn, monkeypatch, hold_s: str):
    """``with served(...) as server:`` a server with ``--dynamic dyn`` that answered one request (killed at the
    block's end if still running); every write of the cache waits ``hold_s`` seconds before its rename
    (reference.atomic's test hook)."""
    from test_server import Server  # tests/mlx_backend/serve/test_server.py

    monkeypatch.setenv("NGRAM_SPEC_TEST_HOLD_BEFORE_RENAME", hold_s)
    with Server("--model", str(llama), "--dynamic", str(dyn), "--save-every", "100", "--draft-max", "3") as server:
        server.client.completions.create(model="default_model", prompt="one two three one two three one",
                                         max_tokens=8, temperature=0.0)
        yield server


def test_a_second_sigterm_during_the_shutdown_save_does_not_abandon_it(llama, tmp_path, monkeypatch):
    """Before: the shutdown save ran in the main thread, where ``atomic_write`` puts its own SIGTERM handler,
    so a second SIGTERM while the file was written exited 143 without saving (what was learned lost)."""
    from mlx_backend.ngram.dynamic_cache import load_dynamic

    dyn = tmp_path / "dyn.ngram"
    with served(llama, dyn, monkeypatch, "3") as server:
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(1.5)                                # the requests are answered at once; the save now waits
        server.proc.send_signal(signal.SIGTERM)
        out = server.proc.communicate(timeout=60)[0].decode()
    assert server.proc.returncode == 0, out
    assert "SIGTERM again: already stopping" in out, out
    assert len(load_dynamic(dyn)) > 0 and [p.name for p in tmp_path.iterdir()] == ["dyn.ngram"]


def test_a_cache_that_cannot_be_saved_at_shutdown_is_logged_and_exits_1(llama, tmp_path, monkeypatch):
    """Before: ``ngram-spec serve: error: ...: Is a directory`` and exit status 2, a bad flag's."""
    dyn = tmp_path / "dyn.ngram"
    with served(llama, dyn, monkeypatch, "0") as server:
        dyn.mkdir()                                   # the file cannot be written now
        server.proc.send_signal(signal.SIGTERM)
        out = server.proc.communicate(timeout=60)[0].decode()
    assert server.proc.returncode == 1, out
    assert f"the dynamic n-gram cache {dyn} cannot be saved (IsADirectoryError" in out, out
    assert "was not saved (above): what was learned since its last save is lost" in out
    assert "Traceback" not in out, out


def test_a_completed_request_without_output_leaves_nothing_to_save(tmp_path):
    """Before: it marked its (still empty) cache changed, and the save then failed: llama.cpp's format has no
    empty cache file (ValueError), a worker failure when periodic."""
    from mlx_backend.serve.server import NgramSpeculator, RequestSpec

    speculator = NgramSpeculator(dynamic=str(tmp_path / "dyn.ngram"), save_every=1)
    speculator.finish(RequestSpec(True, 4, None), [1, 2, 3], 3, completed=True)
    speculator.save()
    assert not (tmp_path / "dyn.ngram").exists() and speculator.stats()["completed"] == 1


def test_the_suffix_history_is_kept_in_its_file_per_scope(tmp_path):
    """``--history``: saved every ``--save-every`` completed requests and read back at start, one file for the
    server or one per user (beside the dynamic caches when the folder is the same); before, the history
    started empty at every start."""
    from mlx_backend.serve.server import NgramSpeculator, RequestSpec

    path = tmp_path / "history"
    first = NgramSpeculator(history=str(path), save_every=2)
    first.finish(RequestSpec(True, 4, None), [5, 6, 7, 8], 2, completed=True)
    assert not path.exists()                              # saved every 2 completed requests
    first.finish(RequestSpec(True, 4, None), [9, 9, 9], 3, completed=True)    # no output: still history
    assert NgramSpeculator(history=str(path)).history_for(None).sequences == [[5, 6, 7, 8], [9, 9, 9]]

    folder = tmp_path / "users"
    users = NgramSpeculator(dynamic=str(folder), history=str(folder), scope="user")
    users.finish(RequestSpec(True, 4, "alice"), [5, 6, 7, 5, 6, 7], 2, completed=True)
    users.finish(RequestSpec(True, 4, None), [1, 2, 3, 4], 2, completed=True)   # no user: no scope
    users.save()
    assert sorted(p.name for p in folder.iterdir()) == sorted([user_file(folder, "alice").name,
                                                               user_file(folder, "alice", ".history").name])
    again = NgramSpeculator(dynamic=str(folder), history=str(folder), scope="user")
    assert again.history_for("alice").sequences == [[5, 6, 7, 5, 6, 7]]
    assert again.history_for("bob").sequences == [] and again.history_for(None) is None


@pytest.mark.parametrize("content", [b"", b"garbage bytes, not a history"], ids=["empty", "damaged"])
def test_a_damaged_history_file_is_one_line_at_start(capsys, tmp_path, content):
    folder = tmp_path / "users"
    folder.mkdir()
    user_file(folder, "alice", ".history").write_bytes(content)
    (tmp_path / "server.history").write_bytes(content)
    for args in (["--dynamic-scope", "user", "--history", str(folder)], ["--history", str(tmp_path / "server.history")]):
        assert main(["serve", "--blas", "bundled", "--model", "nowhere", *args]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "not a suffix history file" in err and "Traceback" not in err, err
    assert user_file(folder, "alice", ".history").read_bytes() == content    # left as it was


def test_a_restarted_server_drafts_from_the_history_it_saved(llama, tmp_path):
    """The same question after a restart with the same ``--history`` accepts as many drafts as when asked a
    second time on the live server (the history holds the first answer either way), more than on a fresh one."""
    from test_server import Server  # tests/mlx_backend/serve/test_server.py

    history = tmp_path / "history"
    flags = ("--model", str(llama), "--drafter", "suffix", "--draft-max", "4", "--history", str(history))
    prompt = "alpha beta gamma delta alpha beta"

    def ask(server):
        r = server.client.completions.create(model="default_model", prompt=prompt, max_tokens=24, temperature=0.0)
        return r.choices[0].text, r.model_extra["timings"]["draft_n_accepted"]

    with Server(*flags) as server:
        fresh, live = ask(server), ask(server)
        server.stop()
    assert history.is_file()
    with Server(*flags) as server:
        restarted = ask(server)
        server.stop()
    assert fresh[0] == live[0] == restarted[0]
    assert restarted[1] == live[1] > fresh[1], (fresh, live, restarted)


def test_the_users_histories_are_checked_at_start_without_being_indexed(tmp_path, monkeypatch):
    """Before: to check it, every user's history file was read into a history, indexed and dropped (0.6 s
    per full 2^18-token file on the 2-core VM: ten users' full files made the start 6 s longer), then read
    again at that user's first request. Now the check reads the arrays only."""
    from mlx_backend.serve.server import NgramSpeculator, RequestSpec
    from mlx_backend.suffix.drafter import SuffixHistory

    folder = tmp_path / "users"
    first = NgramSpeculator(history=str(folder), scope="user")
    first.finish(RequestSpec(True, 4, "alice"), [5, 6, 7, 5, 6, 7], 2, completed=True)
    first.save()
    added = []
    add = SuffixHistory.add
    monkeypatch.setattr(SuffixHistory, "add", lambda self, tokens: added.append(1) or add(self, tokens))
    again = NgramSpeculator(history=str(folder), scope="user")
    assert added == []
    assert again.history_for("alice").sequences == [[5, 6, 7, 5, 6, 7]] and added == [1]


A, B = bytes(range(32)), bytes(range(1, 33))     # two tokenizers' fingerprints


def test_a_history_file_of_another_tokenizer_is_refused_before_the_first_request(tmp_path):
    """Before: ``--history`` read a history written while serving another model (another tokenizer) silently, in
    either scope, and every draft from it meant other text. Now the server records its tokenizer in the files it
    saves and refuses another's once it knows its own (``use_tokenizer``, before the first request); a file of
    the same tokenizer keeps its sequences."""
    from mlx_backend.serve.server import NgramSpeculator, RequestSpec

    path, folder = tmp_path / "history", tmp_path / "users"
    for scope, where in (("server", path), ("user", folder)):
        first = NgramSpeculator(history=str(where), scope=scope)
        first.use_tokenizer(50, A, n_vocab=64)
        first.finish(RequestSpec(True, 4, "alice"), [5, 6, 7, 5, 6, 7], 2, completed=True)
        first.save()
        file = path if scope == "server" else user_file(folder, "alice", ".history")
        again = NgramSpeculator(history=str(where), scope=scope)     # the model not loaded yet: not known
        with pytest.raises(ValueError, match="give --history another path, or delete the file") as info:
            again.use_tokenizer(50, B, n_vocab=64)
        assert str(file) in str(info.value) and f"fingerprint {A.hex()[:16]}..., in use {B.hex()[:16]}..." in \
            str(info.value), info.value
        same = NgramSpeculator(history=str(where), scope=scope)
        same.use_tokenizer(50, A, n_vocab=64)
        assert same.history_for("alice").sequences == [[5, 6, 7, 5, 6, 7]]


def test_cache_files_of_another_tokenizer_are_refused_and_the_servers_own_record_its_tokenizer(tmp_path):
    """Before: ``serve`` drafted silently from a ``--static`` or ``--dynamic`` file of our format built with
    another tokenizer (``generate`` refused it), and the dynamic caches it saved in our format recorded no
    tokenizer. Now each is checked once the model is loaded (``use_tokenizer``), and the user-scope caches it
    saves record the served one, so a server with another model refuses them."""
    from mlx_backend.ngram import api
    from mlx_backend.serve.server import NgramSpeculator, RequestSpec
    from reference.ngram.ours_file import file_tokenizer

    static = tmp_path / "static.ngc"
    built = api.build_static([1, 2, 3, 1, 2, 4])
    built.vocab_size, built.fingerprint = 50, A
    api.save_cache(built, static, format="ours")
    NgramSpeculator(static=str(static)).use_tokenizer(50, A, n_vocab=64)
    with pytest.raises(ValueError, match=f"--static: cache file {static}: built with another tokenizer"):
        NgramSpeculator(static=str(static)).use_tokenizer(50, B, n_vocab=64)
    with pytest.raises(ValueError, match=f"--dynamic: cache file {static}: built for a vocabulary of 50"):
        NgramSpeculator(dynamic=str(static)).use_tokenizer(60, A, n_vocab=64)
    folder = tmp_path / "users"
    first = NgramSpeculator(dynamic=str(folder), scope="user")
    first.use_tokenizer(50, A, n_vocab=64)
    first.finish(RequestSpec(True, 4, "alice"), [5, 6, 7, 5, 6, 7], 2, completed=True)
    first.save()
    assert file_tokenizer(user_file(folder, "alice", ".ngram")) == (50, A)
    with pytest.raises(ValueError, match="--dynamic .*a user's dynamic cache cannot be read .*another tokenizer"):
        NgramSpeculator(dynamic=str(folder), scope="user").use_tokenizer(50, B, n_vocab=64)
    NgramSpeculator(dynamic=str(folder), scope="user").use_tokenizer(50, A, n_vocab=64)


def test_a_history_file_that_records_no_tokenizer_is_still_read(tmp_path):
    """Files saved before tokenizers were recorded (two arrays): read as a cache file with an all-zero
    fingerprint is, in either scope; saved again, they record the served tokenizer."""
    import numpy as np

    from mlx_backend.serve.server import NgramSpeculator, RequestSpec

    path, folder = tmp_path / "history", tmp_path / "users"
    folder.mkdir()
    for file in (path, user_file(folder, "alice", ".history")):
        with open(file, "wb") as f:
            np.savez(f, tokens=np.array([5, 6, 7, 8], np.int32), lengths=np.array([4]))
    for scope, where, file in (("server", path, path), ("user", folder, user_file(folder, "alice", ".history"))):
        speculator = NgramSpeculator(history=str(where), scope=scope)
        speculator.use_tokenizer(50, A, n_vocab=64)
        assert speculator.history_for("alice").sequences == [[5, 6, 7, 8]]
        speculator.finish(RequestSpec(True, 4, "alice"), [1, 2, 3], 2, completed=True)
        speculator.save()
        with np.load(file) as archive:
            assert int(archive["vocab_size"]) == 50 and archive["fingerprint"].tobytes() == A


def test_serve_refuses_a_history_of_another_tokenizer_in_one_line(llama, tmp_path, capsys, monkeypatch):
    """End to end: the model's tokenizer is checked once it is loaded, before the server listens: one line, exit
    status 2 (as a damaged history file), the file left as it was."""
    import numpy as np
    from mlx_lm import server as mlx_server

    monkeypatch.setattr(mlx_server, "_run_http_server", lambda *a, **k: pytest.fail("the server was started"))
    history = tmp_path / "history"
    with open(history, "wb") as f:    # the file format (mlx_backend/suffix/history_file.py), written by hand
        np.savez(f, tokens=np.array([5, 6, 7], np.int32), lengths=np.array([3]), vocab_size=np.int64(0),
                 fingerprint=np.frombuffer(A, np.uint8))
    content = history.read_bytes()
    assert main(["serve", "--blas", "bundled", "--model", str(llama), "--history", str(history)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{history}: built with another tokenizer (fingerprint {A.hex()[:16]}" in err, err
    assert "Traceback" not in err and history.read_bytes() == content


def test_the_start_line_names_the_history_file_and_its_bound(llama, tmp_path):
    """Before: ``suffix history 1000, PATH tokens``."""
    from test_server import free_port  # tests/mlx_backend/serve/test_server.py

    history = tmp_path / "history"
    proc = subprocess.Popen([sys.executable, "-m", "mlx_backend.cli", "serve", "--model", str(llama), "--port",
                             str(free_port()), "--history", str(history), "--history-max-tokens", "1000"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    hung = threading.Timer(240, proc.kill)               # a server that never logs its start: readline ends
    hung.start()
    lines = []
    try:
        while not lines or "serving" not in lines[-1]:
            lines.append(proc.stdout.readline())
            assert lines[-1], "".join(lines)             # the server exited (or was killed) before its start line
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    finally:
        hung.cancel()
        if proc.poll() is None:                          # a failure above must not leave a server running
            proc.kill()
            proc.communicate()
    assert f"suffix history 1000 tokens, kept in {history})" in lines[-1], lines[-1]



def test_a_sigterm_right_after_the_start_line_stops_the_server(llama, tmp_path):
    """SIGTERM delivered the moment the start line is logged, before mlx-lm's serve_forever runs: the server
    stops the generation thread, saves and exits 0. Before: the signal came before the server's handlers
    were in place, the process printed 'interrupted' and then hung at exit on the generation thread
    (seen once in CI, as test_the_start_line_names_the_history_file_and_its_bound's timeout)."""
    from test_server import free_port  # tests/mlx_backend/serve/test_server.py

    script = textwrap.dedent(f"""
        import logging, os, signal, sys
        from mlx_backend.cli import main
        from mlx_backend.serve import server

        class TermOnStart(logging.Handler):
            def emit(self, record):
                if record.getMessage().startswith("serving"):
                    print("SIGTERM after the start line", flush=True)
                    os.kill(os.getpid(), signal.SIGTERM)

        server.log.addHandler(TermOnStart())
        sys.exit(main(["serve", "--model", {str(llama)!r}, "--port", "{free_port()}", "--history",
                       {str(tmp_path / "history")!r}]))
    """)
    proc = child_processes.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "SIGTERM after the start line" in proc.stdout, proc.stdout + proc.stderr
    assert proc.returncode == 0 and "interrupted" not in proc.stderr, proc.stdout + proc.stderr


def response_ngrams(full, n_prompt):
    """Independent count of ``(n, t0, t1, t2, t3, token)`` keys: every n-gram (n = 1..4) whose follower is a
    response token ``full[i]``, ``i >= n_prompt`` (the prompt's own n-grams are not learned)."""
    import collections

    keys = collections.Counter()
    for i in range(n_prompt, len(full)):
        for n in range(1, min(4, i) + 1):
            keys[(n, *full[i - n:i], *[-1] * (4 - n), full[i])] += 1
    return keys


def rows(counter):
    return sorted(k + (c,) for k, c in counter.items())


def test_the_dynamic_cache_learns_exactly_the_response_ngrams_of_completed_requests():
    """The class docstring's rule, counted independently: a completed request teaches its cache the n-grams
    whose followers are response tokens (n-grams may reach back into the prompt), once per occurrence; the
    prompt's own n-grams, a cancelled request and another user's request teach it nothing. Before, only
    ``len(cache) > 0`` was checked: learning the prompt too, or dropping the first response token, passed."""
    from mlx_backend.serve.server import NgramSpeculator, RequestSpec

    a = [5, 6, 7, 5, 6, 7, 8, 5, 6]          # prompt of 4 tokens, then 5 response tokens
    b = [9, 5, 6, 7, 9]                      # prompt of 2 tokens
    server = NgramSpeculator()
    server.finish(RequestSpec(True, 4, None), a, 4, completed=True)
    assert server.dynamic_for(None).entries() == rows(response_ngrams(a, 4))
    server.finish(RequestSpec(True, 4, None), [1, 2, 3, 1, 2, 3], 2, completed=False)    # cancelled: nothing
    server.finish(RequestSpec(True, 4, None), b, 2, completed=True)
    assert server.dynamic_for(None).entries() == rows(response_ngrams(a, 4) + response_ngrams(b, 2))

    users = NgramSpeculator(scope="user")
    users.finish(RequestSpec(True, 4, "alice"), a, 4, completed=True)
    users.finish(RequestSpec(True, 4, "bob"), b, 2, completed=True)
    assert users.dynamic_for("alice").entries() == rows(response_ngrams(a, 4))
    assert users.dynamic_for("bob").entries() == rows(response_ngrams(b, 2))


def test_the_dynamic_cache_is_saved_every_save_every_completed_requests(monkeypatch):
    """``--save-every 2``: saved after the 2nd and the 4th completed request, not after every one once the
    first save is done (the count starts again at each save). Requests 1 s apart, so the share rule
    (next test) never holds a save back."""
    import tempfile

    import mlx_backend.serve.server as server
    from mlx_backend.serve.server import NgramSpeculator, RequestSpec

    now = [0.0]
    monkeypatch.setattr(server, "_clock", lambda: now[0])
    with tempfile.TemporaryDirectory() as folder:
        speculator = NgramSpeculator(dynamic=f"{folder}/dyn.ngram", save_every=2)
        saves = []
        for _ in range(5):
            now[0] += 1.0
            speculator.finish(RequestSpec(True, 4, None), [5, 6, 7, 5, 6, 7], 2, completed=True)
            saves.append(speculator.stats()["dynamic_saves"])
        assert saves == [0, 1, 1, 2, 2]


def test_periodic_saves_take_at_most_their_share_of_the_time(tmp_path, monkeypatch):
    """Before: every ``--save-every`` requests the generation thread wrote each changed cache whole however
    long it took (a server-wide cache of 2.4 M entries: ~2 s every 20 requests, p95 latency 1.1-3.3 s against
    a p50 of 69 ms). Now a periodic save waits until 19x the last one's duration has passed (SAVE_SHARE 5 %);
    shutdown still saves all. Saves of 2 s, requests of 0.1 s, save_every 1: the first request saves, the
    next ones do not until 38 s after that save ended."""
    import mlx_backend.serve.server as server
    from mlx_backend.serve.server import NgramSpeculator, RequestSpec

    assert server.SAVE_SHARE == 0.05
    now = [100.0]
    monkeypatch.setattr(server, "_clock", lambda: now[0])
    speculator = NgramSpeculator(dynamic=str(tmp_path / "dyn.ngram"), save_every=1)
    saves, real_save = [], speculator.save

    def slow_save(*args, **kwargs):
        saves.append(now[0])
        real_save(*args, **kwargs)
        now[0] += 2.0

    monkeypatch.setattr(speculator, "save", slow_save)

    def request():
        speculator.finish(RequestSpec(True, 4, None), [5, 6, 7, 5, 6, 7], 2, completed=True)
        now[0] += 0.1

    for _ in range(5):
        request()
    assert saves == [100.0]                   # not four more saves of 2 s each
    now[0] = 102.0 + 38.0 - 0.05              # just before 19 x 2 s after the save ended
    request()
    assert len(saves) == 1
    request()
    assert len(saves) == 2 and (tmp_path / "dyn.ngram").is_file()


def test_users_whose_names_differ_only_in_case_get_their_own_files(tmp_path):
    """``user`` is an opaque name: "alice" and "Alice" are two scopes, each with its own dynamic cache and
    suffix history file, read back apart."""
    from mlx_backend.serve.server import NgramSpeculator, RequestSpec

    folder = tmp_path / "users"
    first = NgramSpeculator(dynamic=str(folder), history=str(folder), scope="user")
    first.finish(RequestSpec(True, 4, "alice"), [5, 6, 7, 5, 6, 7], 2, completed=True)
    first.finish(RequestSpec(True, 4, "Alice"), [1, 2, 3, 1, 2, 3, 1], 2, completed=True)
    first.save()
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        user_file(folder, u, s).name for u in ("alice", "Alice") for s in (".ngram", ".history"))
    again = NgramSpeculator(dynamic=str(folder), history=str(folder), scope="user")
    assert again.history_for("alice").sequences == [[5, 6, 7, 5, 6, 7]]
    assert again.history_for("Alice").sequences == [[1, 2, 3, 1, 2, 3, 1]]
    assert again.dynamic_for("alice").entries() == first.dynamic_for("alice").entries()
    assert again.dynamic_for("Alice").entries() == first.dynamic_for("Alice").entries()


def test_stats_add_up_the_requests_as_counted_by_hand():
    """``/v1/stats`` totals over four requests with known counters: a request that drafts nothing (draft length
    0, or not speculative) counts toward no drafter; the queue wait is averaged over every request, cancelled
    ones included; verify forwards count only the requests decoded alone (the batched one's come from
    ``count_forward``)."""
    from mlx_backend.decode.generate import SpecStats
    from mlx_backend.serve.server import NgramSpeculator, RequestSpec

    server = NgramSpeculator(drafter="lookup")
    requests = [  # (spec, completed)
        (RequestSpec(True, None, None, drafter="suffix", t_queue=0.5,
                     stats=SpecStats(steps=4, n_tokens=10, n_drafted=8, n_accept=6)), True),
        (RequestSpec(True, 0, None, t_queue=1.5, stats=SpecStats(steps=5, n_tokens=5)), True),
        (RequestSpec(False, 4, None, t_queue=1.0, stats=SpecStats(steps=3, n_tokens=3)), False),
        (RequestSpec(True, 4, None, batched=True, stats=SpecStats(steps=2, n_tokens=6, n_drafted=4, n_accept=4)),
         True),
    ]
    for spec, completed in requests:
        server.finish(spec, [1, 2, 3, 4], 2, completed=completed)
    s = server.stats()
    assert (s["requests"], s["speculative_requests"], s["completed"], s["cancelled"]) == (4, 3, 3, 1)
    assert (s["completion_tokens"], s["decode_forwards"], s["draft_n"], s["draft_n_accepted"]) == (24, 14, 12, 10)
    assert s["drafters"] == {"lookup": 1, "suffix": 1, "auto": 0}
    assert s["accept"] == pytest.approx(100 * 10 / 12)
    assert s["tokens_per_forward"] == pytest.approx(24 / 14)
    assert s["accepted_per_row_step"] == pytest.approx(10 / 14)
    assert s["queue_wait"] == {"mean": pytest.approx(3.0 / 4), "max": 1.5}
    assert s["verify_forwards"] == 12 and s["rows_per_forward"] == {"mean": 1.0, "max": 1}


def test_a_request_drafts_from_the_scope_table_without_copying_it():
    """Before: every request's lookup drafter copied its scope's whole dynamic cache (``NgramDrafter`` copies
    ``c_dyn``), so a request's start, and each batched row's memory, grew with everything the server had learned
    (measured: 72 ms a request with an empty server cache, 2.65 s with one of 2.4 M entries, ~1 M tokens served).
    Now the drafter reads the table itself; it changes only between drafts (``finish``, generation thread), also
    when it grows and is re-allocated, and the drafts stay those of a drafter built afresh."""
    from mlx_backend.serve.server import NgramSpeculator, RequestSpec

    speculator = NgramSpeculator(scope="server")
    speculator.finish(RequestSpec(True, 4, None), [5, 6, 7, 5, 6, 7], 2, completed=True)
    table = speculator.dynamic_for(None)
    for name in ("lookup", "auto"):
        drafter = speculator.drafter(None, [], set(), name)
        lookup = drafter.inner if name == "lookup" else drafter.inner.lookup
        assert lookup.c_dyn is table
    drafter = speculator.drafter(None, [], set(), "lookup")
    drafter.reset([1, 9, 8])
    before = table.T
    for i in range(200):   # grow the table past several re-allocations while the drafter lives
        speculator.finish(RequestSpec(True, 4, None), [20 + i % 7, 1, 9, 8, 3, 4, 20 + i % 11, 30 + i % 13, 1, 9, 8],
                          1, completed=True)
    assert table.T is not before
    fresh = speculator.drafter(None, [], set(), "lookup")
    fresh.reset([1, 9, 8])
    assert drafter.draft(4) == fresh.draft(4) != []


def test_user_caches_are_written_in_our_format_and_leave_no_converted_copy(tmp_path, monkeypatch):
    """Before: each user's dynamic cache was written in llama.cpp's format, so every start read and sorted every
    user's file (``check_user_files``; 310 s for 9,000 small files on a 2-core VM, 13 s in our format) and left
    a converted copy of each in the user's cache directory (9,000 files, 92 MB, never removed)."""
    from mlx_backend.ngram.cache_file import detect_format
    from mlx_backend.serve.server import NgramSpeculator, RequestSpec

    monkeypatch.setenv("NGRAM_SPEC_CACHE_DIR", str(tmp_path / "user-cache"))
    folder = tmp_path / "users"
    first = NgramSpeculator(dynamic=str(folder), scope="user")
    for user in ("alice", "bob"):
        first.finish(RequestSpec(True, 4, user), [5, 6, 7, 5, 6, 7], 2, completed=True)
    first.save()
    assert all(detect_format(user_file(folder, u)) == "ours" for u in ("alice", "bob"))
    again = NgramSpeculator(dynamic=str(folder), scope="user")   # checks every user's file at start
    assert len(again.dynamic_for("alice")) == len(first.dynamic_for("alice")) > 0
    assert not (tmp_path / "user-cache" / "converted").exists()


def test_a_user_cache_of_llama_format_is_rewritten_in_ours(tmp_path, monkeypatch):
    """A file an earlier version wrote (llama.cpp's format) is still read, and written in ours at its next save."""
    from mlx_backend.ngram.cache_file import detect_format
    from mlx_backend.ngram.dynamic_cache import save_dynamic
    from mlx_backend.ngram.hash_table import HashTable
    from mlx_backend.serve.server import NgramSpeculator, RequestSpec
    import numpy as np

    monkeypatch.setenv("NGRAM_SPEC_CACHE_DIR", str(tmp_path / "user-cache"))
    folder = tmp_path / "users"
    folder.mkdir()
    old = HashTable()
    old.update(np.array([1, 2, 3, 1, 2, 3], np.int32), 2)
    save_dynamic(user_file(folder, "alice"), old, None)
    assert detect_format(user_file(folder, "alice")) == "llama"
    speculator = NgramSpeculator(dynamic=str(folder), scope="user")
    speculator.finish(RequestSpec(True, 4, "alice"), [5, 6, 7, 5, 6, 7], 2, completed=True)
    speculator.save()
    assert detect_format(user_file(folder, "alice")) == "ours"
    reloaded = NgramSpeculator(dynamic=str(folder), scope="user").dynamic_for("alice")
    assert reloaded.entries() == speculator.dynamic_for("alice").entries() != old.entries()
