"""Files users own are never overwritten by an input's own output, nor left half-written (reference/atomic.py).

The signal tests are deterministic, not timing-based: the test hook ``NGRAM_SPEC_TEST_HOLD_BEFORE_RENAME``
makes the writer pause once its temporary file holds the new content, the test waits until that
temporary file exists, then sends the signal; the old file must be byte-identical and no temporary left.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from child_processes import running

from conformance import vectors
from reference.atomic import HOLD_ENV, atomic_write, check_outputs
from mlx_backend.cli import main

ROOT = Path(__file__).resolve().parents[2]
OLD = b"the user's old file, not a cache\n"


def V(name: str) -> Path:
    return vectors.local_path(name)


def run(capsys, *argv):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


# --- outputs that are inputs ---------------------------------------------------------------------


def output_is_input_cases(tmp_path: Path):
    toks = tmp_path / "t.i32"
    toks.write_bytes(V("edge-rep5.i32").read_bytes())
    static = tmp_path / "s.bin"
    static.write_bytes(V("syn-static.bin").read_bytes())
    other = tmp_path / "o.bin"
    other.write_bytes(V("syn-static.bin").read_bytes())
    link = tmp_path / "link.bin"
    link.symlink_to(static)
    hard = tmp_path / "hard.i32"
    os.link(toks, hard)
    return [
        ["create", toks, "-o", toks],
        ["create", toks, "-o", hard],  # a hard link is the same file
        ["create", toks, "-o", tmp_path / "new.bin", "--tokens-out", toks],
        ["stats", toks, "--save-dynamic", toks],
        ["stats", toks, "--drafts-out", toks],
        ["stats", toks, "--static", static, "--save-dynamic", static],
        ["stats", toks, "--static", static, "--save-dynamic", link],  # a symbolic link to an input
        ["stats", toks, "--dynamic", other, "--drafts-out", other],
        ["merge", static, other, "-o", static],
        ["merge", static, other, "-o", link],
        ["convert", static, "-o", link, "--force"],
    ]


@pytest.mark.parametrize("backend", ["reference", "mlx"])
def test_an_output_that_is_an_input_is_refused(tmp_path, capsys, backend):
    """Every command refuses, with one line, an output path that is one of its inputs (it silently
    destroyed the input before), and leaves every file as it was."""
    for argv in output_is_input_cases(tmp_path):
        before = {p: p.read_bytes() for p in tmp_path.iterdir()}
        rc, _, err = run(capsys, *argv, "--backend", backend)
        assert rc == 2, (argv, err)
        assert err.count("\n") == 1 and "is the same file as the input" in err, (argv, err)
        assert {p: p.read_bytes() for p in tmp_path.iterdir()} == before, argv


def test_two_outputs_on_one_path_are_refused(tmp_path, capsys):
    toks = tmp_path / "t.i32"
    toks.write_bytes(V("edge-rep5.i32").read_bytes())
    rc, _, err = run(capsys, "stats", toks, "--n-ctx", 8, "--save-dynamic", tmp_path / "x", "--drafts-out",
                     tmp_path / "x")
    assert rc == 2 and "--save-dynamic and --drafts-out name the same file" in err
    assert not (tmp_path / "x").exists()


def test_check_outputs_allows_distinct_paths(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(b"a")
    check_outputs({"-o": b, "--other": None}, inputs=[a, None])  # b does not exist yet: fine
    b.write_bytes(b"b")
    check_outputs({"-o": b}, inputs=[a])
    with pytest.raises(ValueError, match="same file as the input"):
        check_outputs({"-o": b}, inputs=[a, b])


def _sys_is_read_only() -> bool:
    try:
        Path("/sys/ngram-spec-probe").touch()
    except OSError:
        return True
    os.unlink("/sys/ngram-spec-probe")
    return False


@pytest.mark.skipif(not os.path.isdir("/sys") or not _sys_is_read_only(),
                    reason="needs a folder nobody may write into: Linux's /sys (read-only even for root)")
def test_a_folder_that_cannot_be_written_is_refused_before_the_work(tmp_path, capsys):
    """Before, check_outputs saw only that the folder existed, so `create` built the whole cache, `generate`
    generated the whole text, and then the write failed ('Operation not permitted', naming no fix)."""
    with pytest.raises(ValueError, match=r"-o /sys/out\.bin: cannot create a file in the folder /sys \(.+\); make "
                                         "the folder writable or choose another output path"):
        check_outputs({"-o": "/sys/out.bin"}, inputs=[])
    toks = tmp_path / "t.i32"
    np.arange(5, dtype="<i4").tofile(toks)
    assert main(["create", str(toks), "-o", "/sys/out.bin"]) == 2
    assert "cannot create a file in the folder /sys" in capsys.readouterr().err


def test_the_folder_check_leaves_nothing_behind(tmp_path):
    check_outputs({"-o": tmp_path / "out.bin", "--other": tmp_path / "other.bin"}, inputs=[])
    assert list(tmp_path.iterdir()) == []


# --- atomic writes ---------------------------------------------------------------------------------


def test_atomic_write_keeps_the_mode_and_writes_through_links(tmp_path):
    target = tmp_path / "t.bin"
    target.write_bytes(OLD)
    target.chmod(0o640)
    link = tmp_path / "l.bin"
    link.symlink_to(target)
    with atomic_write(link) as f:
        f.write(b"new")
    assert link.is_symlink() and target.read_bytes() == b"new"
    assert target.stat().st_mode & 0o777 == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["l.bin", "t.bin"]


def test_a_directory_as_output_says_so(tmp_path, capsys):
    rc, _, err = run(capsys, "create", V("edge-rep5.i32"), "-o", tmp_path)
    assert rc == 2 and err.strip().endswith(f"-o {tmp_path} is a directory; give a file path"), err


@pytest.mark.parametrize("backend", ["reference", "mlx"])
def test_an_output_that_cannot_be_written_is_refused_before_any_work(tmp_path, capsys, backend):
    """A missing folder, an empty path or a directory as an output is refused at the start, before the
    work and before any other output is written (before: the error came after the work, e.g. 38 s of
    stats, and create's --tokens-out was already written)."""
    toks = tmp_path / "t.i32"
    toks.write_bytes(V("edge-rep5.i32").read_bytes())
    tokens_out = tmp_path / "tokens.i32"
    cases = [
        (["create", toks, "-o", tmp_path / "nodir" / "s.bin", "--tokens-out", tokens_out],
         f"-o {tmp_path / 'nodir' / 's.bin'}: the folder {tmp_path / 'nodir'} does not exist; create it first"),
        (["create", toks, "-o", "", "--tokens-out", tokens_out], "-o is empty; give a file path"),
        (["stats", toks, "--n-ctx", 8, "--save-dynamic", tmp_path / "nodir" / "d.bin"],
         "--save-dynamic " + str(tmp_path / "nodir" / "d.bin") + ": the folder"),
        (["merge", V("syn-static.bin"), "-o", tmp_path], f"-o {tmp_path} is a directory"),
    ]
    for argv, message in cases:
        before = sorted(p.name for p in tmp_path.iterdir())
        rc, _, err = run(capsys, *argv, "--backend", backend)
        assert rc == 2 and err.count("\n") == 1 and message in err, (argv, err)
        assert sorted(p.name for p in tmp_path.iterdir()) == before, argv


def test_create_refuses_to_write_over_the_tokenizer_it_reads(tmp_path, capsys):
    """``--tokenizer DIR`` reads DIR/tokenizer.json: that file is an input (before, ``-o
    DIR/tokenizer.json`` replaced it with the cache and exited 0)."""
    from reference.models.tiny import write_tiny_model

    model = write_tiny_model(tmp_path / "tiny", "llama")
    tokenizer = (model / "tokenizer.json").read_bytes()
    text = tmp_path / "t.txt"
    text.write_text("the cat sat on the mat. the cat sat on the mat.\n")
    rc, _, err = run(capsys, "create", text, "--tokenizer", model, "-o", model / "tokenizer.json")
    assert rc == 2 and "is the same file as the input" in err, err
    assert (model / "tokenizer.json").read_bytes() == tokenizer


def test_tokens_out_refuses_a_name_that_reads_back_as_something_else(tmp_path, capsys):
    """--tokens-out writes .npy, else raw int32; a name the readers take for another format (before:
    t.i32.xz got raw, uncompressed int32 that the reader then failed to decompress; t.txt, binary that
    create then tokenized as text) is refused before any work."""
    for name in ("t.i32.xz", "t.npy.xz", "t.txt", "t.md"):
        rc, _, err = run(capsys, "create", V("edge-rep5.i32"), "-o", tmp_path / "s.bin", "--tokens-out",
                         tmp_path / name)
        assert rc == 2 and "a name that reads back as something else" in err, (name, err)
    assert list(tmp_path.iterdir()) == []


def writers(tmp_path: Path):
    """(name, argv writing tmp_path/'out', backend) for every kind of file the project writes."""
    big = tmp_path / "corpus.i32"
    np.random.default_rng(0).integers(0, 5000, 20_000).astype("<i4").tofile(big)
    toks = tmp_path / "t.i32"
    toks.write_bytes(V("edge-rep5.i32").read_bytes())
    out = tmp_path / "out"
    return {
        "create-mlx-llama": ["create", big, "-o", out, "--backend", "mlx"],
        "create-mlx-ours": ["create", big, "-o", out, "--backend", "mlx", "--format", "ours"],
        "create-reference-llama": ["create", toks, "-o", out, "--backend", "reference"],
        # the cache first (to /dev/null: a stream, written directly, no pause), then the tokens
        "tokens-out": ["create", toks, "-o", os.devnull, "--tokens-out", out, "--backend", "mlx"],
        "stats-drafts-out": ["stats", toks, "--n-ctx", 8, "--drafts-out", out, "--backend", "mlx"],
        "stats-save-dynamic-ours": ["stats", toks, "--n-ctx", 8, "--save-dynamic", out, "--format", "ours",
                                    "--backend", "mlx"],
        "merge-reference": ["merge", V("syn-static.bin"), "-o", out, "--backend", "reference"],
    }


SIGNAL_CASES = [
    (signal.SIGTERM, "create-mlx-llama"),  # left a 4 MB truncated file in place of the old one before
    (signal.SIGTERM, "create-mlx-ours"),  # left a stale .tmpPID before
    (signal.SIGTERM, "create-reference-llama"),
    (signal.SIGTERM, "stats-drafts-out"),
    (signal.SIGINT, "tokens-out"),
    (signal.SIGINT, "stats-save-dynamic-ours"),
    (signal.SIGINT, "merge-reference"),
]


@pytest.mark.parametrize("signum,writer", SIGNAL_CASES, ids=[f"{s.name}-{w}" for s, w in SIGNAL_CASES])
def test_a_signal_mid_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path, signum, writer):
    argv = writers(tmp_path)[writer]
    out = tmp_path / "out"
    out.write_bytes(OLD)
    before = sorted(p.name for p in tmp_path.iterdir())
    env = {**os.environ, HOLD_ENV: "60", "PYTHONPATH": str(ROOT)}
    # a shell without job control starts background commands with SIGINT ignored, and a Python started so
    # keeps ignoring it (no KeyboardInterrupt): give the writer the default disposition a terminal gives
    proc = subprocess.Popen([sys.executable, "-m", "mlx_backend.cli", *map(str, argv)], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob(".out.*.tmp")):  # the writer's temporary file: it is writing now
            assert proc.poll() is None, f"{writer} ended before writing: {proc.stderr.read().decode()}"
            assert time.monotonic() < deadline, f"{writer}: no temporary file appeared"
            time.sleep(0.05)
        proc.send_signal(signum)
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == (130 if signum == signal.SIGINT else 128 + signal.SIGTERM), proc.stderr.read().decode()
    assert out.read_bytes() == OLD
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no temporary file left


def test_generate_help_says_an_interrupted_run_learns_nothing(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    assert "interrupted before the end (Ctrl-C) learns nothing and leaves the file as it was" in " ".join(
        capsys.readouterr().out.split())


def test_a_signal_while_tiny_model_writes_keeps_the_old_model_whole(tmp_path):
    """``tiny-model`` writes its four files into a temporary folder and renames them in together
    (:func:`reference.atomic.atomic_files`): SIGTERM before the renames leaves the old model as it was and
    no temporary folder (before: each file was written in place, so a signal left new weights beside an old
    config.json, and safetensors' own temporary file behind)."""
    from reference.models.tiny import write_tiny_model

    model = write_tiny_model(tmp_path / "m", "llama")
    before = {p.name: p.read_bytes() for p in model.iterdir()}
    env = {**os.environ, HOLD_ENV: "60", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "mlx_backend.cli", "tiny-model", "--arch", "qwen3_5", "-o",
                             str(model)], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not list(model.glob(".ngram-spec.*.tmp/tokenizer_config.json")):  # the last file: now it holds
            assert proc.poll() is None, f"tiny-model ended before holding: {proc.stderr.read().decode()}"
            assert time.monotonic() < deadline, "no temporary folder with the new model appeared"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 128 + signal.SIGTERM, proc.stderr.read().decode()
    assert {p.name: p.read_bytes() for p in model.iterdir()} == before   # no temporary folder either


# --- read-only outputs, full disks, dangling links, concurrent writers of one folder ---------------


def test_a_read_only_output_is_refused_and_left_as_it_was(tmp_path, capsys, monkeypatch):
    """An existing output this user may not write is refused with one line, as ``open(path, "w")`` refuses
    it (before: the rename over it needs only the folder's permission, so a file the user had made
    read-only to protect it was silently replaced, and by ``tiny-model`` too). ``os.access`` is made to say
    "read-only" for those files, as the tests may run as root (who may write any file)."""
    from reference.atomic import atomic_files

    out = tmp_path / "out.bin"
    out.write_bytes(OLD)
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_bytes(OLD)
    protected = {str(out), str(model / "config.json")}
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: (str(p) not in protected or not mode & os.W_OK)
                        and real_access(p, mode, **kw))
    rc, _, err = run(capsys, "create", V("edge-rep5.i32"), "-o", out)
    assert rc == 2 and err.count("\n") == 1 and "the file is read-only" in err, err
    with pytest.raises(PermissionError, match="read-only"):
        with atomic_write(out) as f:
            f.write(b"new")
    with pytest.raises(PermissionError, match="read-only"):
        with atomic_files(model) as tmp:
            (tmp / "config.json").write_bytes(b"new")
            (tmp / "model.safetensors").write_bytes(b"new")
    assert out.read_bytes() == OLD and sorted(p.name for p in tmp_path.iterdir()) == ["m", "out.bin"]
    assert [p.name for p in model.iterdir()] == ["config.json"] and (model / "config.json").read_bytes() == OLD


def test_a_failed_write_names_the_file_and_keeps_the_old_one(tmp_path, monkeypatch):
    """A full disk while writing: the error names the output (before: "[Errno 28] No space left on device"
    or numpy's "Not enough free space to write 55984764 bytes after offset 0", no file named: with -o and
    --tokens-out the user could not tell which), the old file stays and no temporary is left."""
    import errno
    import shutil

    out = tmp_path / "out.bin"
    out.write_bytes(OLD)
    with pytest.raises(OSError) as info:
        with atomic_write(out) as f:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))   # what a flush raises on a full disk
    assert info.value.filename == str(out) and "cannot write it: No space left on device" in info.value.strerror
    # numpy's tofile loses the errno: a folder with (almost) no room left is then said to be full
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10 << 20, 10 << 20, 4096))
    with pytest.raises(OSError) as info:
        with atomic_write(out) as f:
            raise OSError("Not enough free space to write 480 bytes after offset 0")
    assert info.value.filename == str(out) and info.value.errno == errno.ENOSPC
    assert "No space left on device (Not enough free space" in info.value.strerror
    assert out.read_bytes() == OLD and [p.name for p in tmp_path.iterdir()] == ["out.bin"]
    with pytest.raises(OSError) as info:   # an error naming its own file is the caller's: passed on as is
        with atomic_write(out) as f:
            open(tmp_path / "missing")
    assert info.value.filename == str(tmp_path / "missing")


def test_an_output_through_a_dangling_link_is_refused_before_any_work(tmp_path, capsys):
    """A symbolic link to a missing folder is written where it points: refused at the start like a missing
    folder (before: after the whole replay, as "dangling: No such file or directory")."""
    link = tmp_path / "link.bin"
    link.symlink_to(tmp_path / "nowhere" / "x.bin")
    toks = tmp_path / "t.i32"
    toks.write_bytes(V("edge-rep5.i32").read_bytes())
    with pytest.raises(ValueError, match=r"the folder .*nowhere \(where the link .*link.bin points\) does not exist"):
        check_outputs({"--save-dynamic": link}, inputs=[toks])
    rc, _, err = run(capsys, "stats", toks, "--n-ctx", 8, "--save-dynamic", link, "--backend", "reference")
    assert rc == 2 and err.count("\n") == 1 and "where the link" in err, err


HOLD_IN_RENAMES = """
import os, sys, time
from reference import atomic
real, done = os.replace, []
def replace(src, dst):   # pause after the first rename, in the middle of the set
    real(src, dst)
    done.append(dst)
    if len(done) == 1:
        open(sys.argv[2], "w").close()
        time.sleep(2)
os.replace = replace
with atomic.atomic_files(sys.argv[1]) as tmp:
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (tmp / name).write_text("A")
"""


def test_two_writers_of_one_folder_leave_one_set_never_a_mix(tmp_path):
    """Two processes writing a model folder at once (``atomic_files``): the folder ends with one writer's
    set (before: writer B's renames ran while A was between two of its own, leaving B's config.json beside
    A's weights). Writer A pauses after its first rename; B, started then, must wait for A's last."""
    from reference.atomic import atomic_files

    folder, marker = tmp_path / "model", tmp_path / "a-is-renaming"
    proc = subprocess.Popen([sys.executable, "-c", HOLD_IN_RENAMES, str(folder), str(marker)], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, "writer A never renamed"
            time.sleep(0.02)
        with atomic_files(folder) as tmp:
            for name in ("config.json", "model.safetensors", "tokenizer.json"):
                (tmp / name).write_text("B")
        assert proc.wait(timeout=60) == 0, proc.stderr.read().decode()
    finally:
        if proc.poll() is None:
            proc.kill()
    contents = {p.name: p.read_text() for p in folder.iterdir()}
    assert len(contents) == 3 and len(set(contents.values())) == 1, contents


def test_tiny_model_on_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, capsys, monkeypatch):
    """safetensors and tokenizers report a full disk with their own exception types, not OSError (before:
    a traceback; the folder the command had made was left behind, empty)."""
    import safetensors.numpy
    from safetensors import SafetensorError

    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.numpy, "save_file", full)
    rc, _, err = run(capsys, "tiny-model", "--arch", "llama", "-o", tmp_path / "new" / "m")
    assert rc == 2 and err.count("\n") == 1 and "No space left on device" in err, err
    assert list(tmp_path.iterdir()) == [tmp_path / "new"] and not (tmp_path / "new" / "m").exists()


# --- the mutation campaign's session folder ----------------------------------------------------------


def test_an_interrupted_mutation_init_leaves_no_session_database(tmp_path, monkeypatch):
    """Ctrl-C while ``cosmic-ray init`` fills the session's database: no database is left (before: the
    half-made one, with no mutants, was taken for the session on the next run, which then reported 0
    mutants for the module as if it were done)."""
    from conformance import mutation

    def popen(cmd, *args, **kwargs):   # cosmic-ray has made the database, then Ctrl-C
        Path(cmd[-1]).write_bytes(b"SQLite format 3\0")
        raise KeyboardInterrupt

    monkeypatch.setattr(subprocess, "Popen", popen)
    monkeypatch.setattr(mutation, "ROOT", ROOT)
    monkeypatch.setattr(mutation, "PACKAGES", ())   # no copy of the checkout needed
    session = tmp_path / "s"
    session.mkdir()
    with pytest.raises(KeyboardInterrupt):
        mutation.run_module(session, "reference/ngram/replay.py", 1, 60.0, None)
    assert [p.name for p in session.iterdir() if p.name != "trees"] == ["reference_ngram_replay.toml"]


def test_ctrl_c_stops_the_mutation_campaign_with_one_line(tmp_path, capsys, monkeypatch):
    """Ctrl-C during a module: exit 130, one line naming the session to resume, and no later module starts
    (before: a KeyboardInterrupt traceback, after the pool had run every remaining module, hours)."""
    import _thread
    import shutil as shutil_module

    from conformance import mutation

    started = []

    def run_module(session, module, *args):
        started.append(module)
        if len(started) == 1:
            _thread.interrupt_main()   # Ctrl-C reaches the main thread while this module's cosmic-ray runs
            time.sleep(0.5)

    monkeypatch.setattr(mutation, "run_module", run_module)
    monkeypatch.setattr(shutil_module, "which", lambda name: "/bin/true")
    argv = ["--module", "reference/ngram/replay.py", "--module", "reference/ngram/draft.py", "--session",
            str(tmp_path / "s")]
    try:
        rc = mutation.main(argv)
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C came out of main as a KeyboardInterrupt (a traceback)")
    err = capsys.readouterr().err
    assert rc == 130 and err.count("\n") == 1 and f"--session {tmp_path / 's'}" in err, err
    assert started == ["reference/ngram/replay.py"]


@pytest.mark.parametrize("make", ["mkstemp", "mkdtemp"])
def test_ctrl_c_right_as_the_temporary_is_made_leaves_none(tmp_path, monkeypatch, make):
    """A SIGINT that lands the moment ``mkstemp``/``mkdtemp`` returns (before the caller has recorded the
    name) is raised only once the cleanup knows the temporary (before: it was left behind). The signal
    is really sent (os.kill), as a terminal sends it, right after the temporary is made."""
    import tempfile

    from reference.atomic import atomic_files

    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    real = getattr(tempfile, make)

    def make_then_ctrl_c(*args, **kwargs):
        name = real(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGINT)
        return name

    monkeypatch.setattr(tempfile, make, make_then_ctrl_c)
    out = tmp_path / "out.bin"
    out.write_bytes(OLD)
    with pytest.raises(KeyboardInterrupt):
        if make == "mkstemp":
            with atomic_write(out) as f:
                f.write(b"new")
        else:
            with atomic_files(tmp_path) as tmp:
                (tmp / "out.bin").write_bytes(b"new")
    assert out.read_bytes() == OLD and [p.name for p in tmp_path.iterdir()] == ["out.bin"]


def test_ctrl_c_during_the_renames_of_a_set_leaves_one_whole_set(tmp_path, monkeypatch):
    """Ctrl-C between two renames of ``atomic_files``' set, in a process with another thread (numba's,
    mlx's, tokenizers' pools): the set is renamed whole, then the interrupt is raised (before: the
    signals were held by ``pthread_sigmask`` in the main thread only; the kernel handed Ctrl-C to the
    other thread, whose handler had the main thread raise mid-set: new config.json, old weights)."""
    import threading

    from reference.atomic import atomic_files

    folder = tmp_path / "m"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        (folder / name).write_text("old")
    real, done = os.replace, []

    def replace_then_ctrl_c(src, dst):
        real(src, dst)
        done.append(dst)
        if len(done) == 1:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)   # the signal is handled by now

    stop = threading.Event()
    other = threading.Thread(target=stop.wait, daemon=True)
    other.start()
    monkeypatch.setattr(os, "replace", replace_then_ctrl_c)
    try:
        with pytest.raises(KeyboardInterrupt):
            with atomic_files(folder) as tmp:
                for name in ("config.json", "model.safetensors"):
                    (tmp / name).write_text("new")
    finally:
        stop.set()
    assert {p.name: p.read_text() for p in folder.iterdir()} == {"config.json": "new", "model.safetensors": "new"}


# --- the user's cache directory --------------------------------------------------------------------


def test_a_converted_copy_removed_by_another_process_is_read_again(tmp_path, monkeypatch):
    """The copy of a llama.cpp-format file in the user's cache, deleted by another process between the
    check that it exists and its opening (a newer version's load removes the older copies): the file is
    read again and its copy written anew (before: FileNotFoundError, the command failed)."""
    pytest.importorskip("numba")
    from mlx_backend.ngram import converted_copy
    from mlx_backend.ngram.caches import load_cache, save_cache
    from mlx_backend.ngram.sorted_cache import build_static

    monkeypatch.setenv("NGRAM_SPEC_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "static.bin"
    save_cache(build_static(np.array([1, 2, 3, 1, 2, 4], np.int32)), path, format="llama")
    first = load_cache(path)
    copy, how = first.converted_copy
    assert how == "written"
    real = converted_copy.open_ours

    def removed_meanwhile(p, **kwargs):
        Path(p).unlink()   # the other process's cleanup wins the race
        return real(p, **kwargs)

    monkeypatch.setattr(converted_copy, "open_ours", removed_meanwhile)
    again = load_cache(path)
    assert again == first and again.converted_copy == (copy, "written") and copy.is_file()


CONCURRENT_LOAD = """
import sys
from mlx_backend.ngram.caches import load_cache
cache = load_cache(sys.argv[1])
print(cache.n_entries(), cache.total())
"""


def test_two_processes_converting_one_file_leave_one_whole_copy(tmp_path, monkeypatch):
    """Two first loads of one llama.cpp-format file at once both write its copy in the user's cache: both
    loads give the file's content, and one complete copy is left, no temporary."""
    pytest.importorskip("numba")
    from mlx_backend.ngram.caches import load_cache, save_cache
    from mlx_backend.ngram.sorted_cache import build_static

    path = tmp_path / "static.bin"
    save_cache(build_static(np.random.default_rng(0).integers(0, 3000, 300_000).astype(np.int32)), path,
               format="llama")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NGRAM_SPEC_CACHE_DIR": str(tmp_path / "cache")}
    with contextlib.ExitStack() as stack:
        procs = [stack.enter_context(running([sys.executable, "-c", CONCURRENT_LOAD, str(path)], cwd=ROOT, env=env,
                                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)) for _ in range(2)]
        outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e.decode() for _, e in outs]
    assert outs[0][0] == outs[1][0]
    copies = list((tmp_path / "cache" / "converted").iterdir())
    assert len(copies) == 1 and copies[0].suffix == ".ngc"
    from mlx_backend.ngram.cache_file import open_ours
    monkeypatch.setenv("NGRAM_SPEC_NO_CONVERTED_COPY", "1")   # read the file itself, keep no copy
    assert open_ours(copies[0], verify=True) == load_cache(path, verify=True)


def test_create_whose_tokens_out_cannot_be_written_leaves_the_cache_as_it_was(tmp_path, capsys, monkeypatch):
    """``create -o CACHE --tokens-out TOKENS`` on a disk with no room for TOKENS: one line, and CACHE is
    the old file (before: the new cache was renamed in first, then the tokens failed, so a run reported
    as failed had replaced one of its outputs)."""
    import errno

    import reference.ngram.tokens
    from mlx_backend.cli import ngram

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(reference.ngram.tokens, "write_tokens", full)   # where the tokens were written before
    monkeypatch.setattr(ngram, "write_tokens_into", full, raising=False)
    out = tmp_path / "s.bin"
    out.write_bytes(OLD)
    rc, _, err = run(capsys, "create", V("edge-rep5.i32"), "-o", out, "--tokens-out", tmp_path / "t.i32")
    assert rc == 2 and err.count("\n") == 1 and "No space left on device" in err, err
    assert out.read_bytes() == OLD and sorted(p.name for p in tmp_path.iterdir()) == ["s.bin"]


def test_an_interrupted_refresh_of_a_mutation_tree_keeps_the_old_tree(tmp_path, monkeypatch):
    """``--rerun-survivors`` copies the checkout over the session's tree: Ctrl-C in the middle of the copy
    leaves the old tree whole (before: the packages copied so far were new, the rest old, and the next run
    tested mutants against that mix)."""
    import shutil

    from conformance import mutation

    checkout = tmp_path / "checkout"
    for package in ("a", "b"):
        (checkout / package).mkdir(parents=True)
        (checkout / package / "m.py").write_text("new")
    session = tmp_path / "s"
    tree = session / "trees" / "mod"
    for package in ("a", "b"):
        (tree / package).mkdir(parents=True)
        (tree / package / "m.py").write_text("old")
    (session / "mod.sqlite").write_bytes(b"")   # an existing session: the tree is refreshed on --rerun-survivors
    real = shutil.copytree

    def copy_then_ctrl_c(src, dst, *args, **kwargs):
        if Path(src).name == "b":
            raise KeyboardInterrupt
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(mutation, "ROOT", checkout)
    monkeypatch.setattr(mutation, "PACKAGES", ("a", "b"))
    monkeypatch.setattr(mutation, "session_paths", lambda session, module: (session / "mod.toml",
                                                                             session / "mod.sqlite"))
    monkeypatch.setattr(mutation, "MODULES", {"mod": ("reference", ("counts",))})
    monkeypatch.setattr(shutil, "copytree", copy_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        mutation.run_module(session, "mod", 1, 60.0, None, rerun_survivors=True)
    assert {p.parent.name: p.read_text() for p in tree.glob("*/m.py")} == {"a": "old", "b": "old"}
    assert sorted(p.name for p in (session / "trees").iterdir()) == ["mod"]


@pytest.mark.parametrize("mode, data", [("wb", b"new bytes"), ("w", "new text")])
def test_the_new_content_is_on_disk_before_the_rename(tmp_path, monkeypatch, mode, data):
    """atomic_write's promise: the temporary file is flushed and fsync'ed, then renamed over the target. A rename
    without the fsync can leave, after a crash, a zero-length file where the old one was (the rename reaches
    the disk before the data): the fsync must be of the temporary file, with all its bytes, before the rename.
    Before, no test looked: a write without fsync passed every test."""
    import reference.atomic as atomic

    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.fstat(fd).st_ino, os.fstat(fd).st_size))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", os.stat(src).st_ino, os.stat(src).st_size))
        real_replace(src, dst)

    monkeypatch.setattr(atomic.os, "fsync", fsync)
    monkeypatch.setattr(atomic.os, "replace", replace)
    path = tmp_path / "out"
    path.write_bytes(OLD)
    with atomic_write(path, mode) as f:
        f.write(data)
    size = len(data if isinstance(data, bytes) else data.encode())
    (_, ino, synced), (what, renamed, _) = events
    assert what == "replace" and ino == renamed and synced == size, events
    assert path.read_bytes() == (data if isinstance(data, bytes) else data.encode())


def test_two_outputs_one_a_symbolic_link_to_the_other_are_refused(tmp_path):
    """Outputs are compared where they point: ``-o x`` and ``--other link-to-x`` name one file."""
    target, link = tmp_path / "x.bin", tmp_path / "link.bin"
    link.symlink_to(target)                       # dangling until x.bin is written: still the same file
    with pytest.raises(ValueError, match="name the same file"):
        check_outputs({"-o": target, "--other": link}, inputs=[])
    target.write_bytes(OLD)
    with pytest.raises(ValueError, match="name the same file"):
        check_outputs({"-o": link, "--other": target}, inputs=[])


def test_a_failed_set_leaves_an_existing_empty_folder_in_place(tmp_path):
    """``atomic_files`` removes on failure only a folder it created itself, never the user's (empty) one."""
    from reference.atomic import atomic_files

    folder = tmp_path / "out"
    folder.mkdir()
    with pytest.raises(RuntimeError):
        with atomic_files(folder) as tmp:
            (tmp / "a.bin").write_bytes(b"new")
            raise RuntimeError("failed mid-set")
    assert folder.is_dir() and list(folder.iterdir()) == []
    made = tmp_path / "made"
    with pytest.raises(RuntimeError):
        with atomic_files(made):
            raise RuntimeError("failed mid-set")
    assert not made.exists()


def test_a_signal_put_off_in_a_del_is_pending_until_taken_once(monkeypatch):
    """``defer_if_unsafe``: inside a ``__del__`` the handler must not raise (the exception would be dropped):
    the signal is put off (pending); ``take_pending`` hands it over once, after which it is neither pending
    nor delivered again. On ordinary Python code the handler raises at once (False)."""
    import sys

    from reference import atomic

    got = []
    monkeypatch.setattr(atomic, "RETRY_S", 0.05)
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: got.append(signum))
    try:
        def __del__():
            return sys._getframe()

        assert atomic.defer_if_unsafe(signal.SIGUSR1, __del__()) is True
        assert atomic.take_pending() == {signal.SIGUSR1}
        assert atomic.take_pending() == set()
        time.sleep(0.3)                           # the retry timer fired: nothing pending, nothing sent
        assert got == []
        assert atomic.defer_if_unsafe(signal.SIGUSR1, sys._getframe()) is False
        assert atomic.take_pending() == set()
    finally:
        atomic._pending.discard(signal.SIGUSR1)   # whatever failed above, no retry may land on the default action
        time.sleep(0.1)
        signal.signal(signal.SIGUSR1, previous)


def test_a_ctrl_c_landing_in_a_garbage_collectors_callback_is_delivered_again():
    """A Ctrl-C whose handler runs inside a ``gc.callbacks`` callback (hypothesis registers one to time its
    collections) is put off and raised once the callback has returned. Before: raised inside the callback,
    printed as "Exception ignored" and dropped, and the command ran on to its end (``conformance`` interrupted
    at 3 s printed PASSED and exited 0)."""
    import gc

    from reference.atomic import interrupts_at_safe_points

    calls = []

    def callback(phase, info):
        if phase == "start" and not calls:
            calls.append(phase)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)   # the handler runs here, inside the collector's callback

    gc.callbacks.append(callback)
    try:
        with pytest.raises(KeyboardInterrupt):
            with interrupts_at_safe_points():
                gc.collect()
                time.sleep(2)   # the signal, put off, lands here
    finally:
        gc.callbacks.remove(callback)
    assert calls == ["start"]


def test_a_temporary_left_by_a_killed_writer_is_removed_by_a_later_write(tmp_path, monkeypatch):
    """SIGKILL (the OOM killer) cannot be caught: its writer's temporary stays. The next complete write of the
    same file removes it once ``STALE_S`` old, and leaves a live writer's, a fresh one and others' files.
    Before: every such temporary stayed for good (a server killed while saving a large cache, each time)."""
    import reference.atomic as atomic

    out = tmp_path / "out"
    code = ("import sys; from reference.atomic import atomic_write\n"
            "with atomic_write(sys.argv[1]) as f: f.write(b'x' * 1000)")
    env = {**os.environ, HOLD_ENV: "60", "PYTHONPATH": str(ROOT)}
    killed = subprocess.Popen([sys.executable, "-c", code, str(out)], env=env)
    try:
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob(".out.*.tmp")):
            assert killed.poll() is None and time.monotonic() < deadline, "the writer made no temporary"
            time.sleep(0.05)
        killed.kill()
        killed.wait(timeout=60)
    finally:
        if killed.poll() is None:
            killed.kill()
    [left] = tmp_path.glob(".out.*.tmp")
    assert left.name.startswith(f".out.{killed.pid}.")
    live = tmp_path / f".out.{os.getpid()}.abc123.tmp"        # this process is alive
    other = tmp_path / ".other.1.abc123.tmp"                   # another file's
    for p in (live, other):
        p.write_bytes(b"")
    old = time.time() - atomic.STALE_S - 1
    for p in (left, live, other):
        os.utime(p, (old, old))
    monkeypatch.setattr(atomic, "STALE_S", 10 ** 9)           # younger than STALE_S: kept
    with atomic_write(out) as f:
        f.write(b"a")
    assert left.exists()
    monkeypatch.undo()
    with atomic_write(out) as f:
        f.write(b"b")
    assert not left.exists() and live.exists() and other.exists() and out.read_bytes() == b"b"
