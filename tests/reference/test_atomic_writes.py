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
