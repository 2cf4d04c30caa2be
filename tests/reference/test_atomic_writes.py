"""Files users own are never overwritten by an input's own output, nor left half-written (reference/atomic.py).

The signal tests are deterministic, not timing-based: the test hook ``NGRAM_SPEC_TEST_HOLD_BEFORE_RENAME``
makes the writer pause once its temporary file holds the new content, the test waits until that
temporary file exists, then sends the signal; the old file must be byte-identical and no temporary left.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

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
    assert rc == 2 and err.strip().endswith(f"{tmp_path}: Is a directory"), err


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
        "tokens-out": ["create", toks, "-o", tmp_path / "s.bin", "--tokens-out", out, "--backend", "mlx"],
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
