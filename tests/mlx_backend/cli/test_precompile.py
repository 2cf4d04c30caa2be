"""``ngram-spec precompile`` caches every kernel the commands use: after it, commands on other inputs,
formats and flag combinations (another model architecture, both static-cache formats, with and without
a dynamic cache) compile nothing, i.e. write nothing new to numba's cache."""
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from child_processes import running

ROOT = Path(__file__).resolve().parents[3]

COMMANDS = textwrap.dedent("""
    import io, contextlib, sys
    from mlx_backend.cli import main
    d = sys.argv[1]
    runs = [
        f"create {d}/t.npy -o {d}/a.bin", f"create {d}/t.i32 -o {d}/a.ngc --format ours",
        f"stats {d}/t.i32 --json", f"stats {d}/t.npy --static {d}/a.bin --json --n-draft 8",
        f"stats {d}/t.i32 --static {d}/a.ngc --json --n-ctx 1024",
        f"tiny-model --arch qwen3_5 --out {d}/m",
        f"generate --model {d}/m --prompt-tokens {d}/p.i32 --max-tokens 40 --static {d}/a.ngc --json",
        f"generate --model {d}/m --prompt-tokens {d}/p.i32 --max-tokens 40 --dynamic {d}/dyn.bin --json",
        f"generate --model {d}/m --prompt-tokens {d}/p.i32 --max-tokens 40 --dynamic {d}/dyn.bin --static {d}/a.bin --json",
        f"stats {d}/t.i32 --dynamic {d}/dyn.bin --static {d}/a.bin --json",
        f"merge {d}/a.bin {d}/dyn.bin -o {d}/m.bin", f"convert {d}/m.bin -o {d}/m.ngc --to ours",
        f"inspect {d}/m.ngc", f"merge {d}/m.ngc {d}/a.ngc -o {d}/m2.ngc --format ours",
    ]
    for argv in runs:
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            code = main(argv.split())
        assert code == 0, (argv, out.getvalue()[-3000:])
""")


def _cache_files(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")
            if p.is_file()}


@pytest.mark.slow
def test_after_precompile_commands_compile_nothing(tmp_path):
    pytest.importorskip("numba")
    pytest.importorskip("mlx_lm")
    numba_cache, work = tmp_path / "numba", tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "NUMBA_CACHE_DIR": str(numba_cache), "NGRAM_SPEC_CACHE_DIR": str(tmp_path / "user")}
    done = subprocess.run([sys.executable, "-m", "mlx_backend.cli", "precompile"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "kernels cached" in done.stdout
    assert not list((tmp_path / "user").rglob("*"))  # nothing of the user's cache directory read or written
    before = _cache_files(numba_cache)
    assert len([f for f in before if f.endswith(".nbc")]) >= 20  # the kernels went to this cache
    rng = np.random.default_rng(1)
    text = rng.integers(0, 3000, 30_000).astype(np.int32)
    text.tofile(work / "t.i32")
    np.save(work / "t.npy", text)
    np.tile(np.arange(40, 70, dtype=np.int32), 4).tofile(work / "p.i32")
    ran = subprocess.run([sys.executable, "-c", COMMANDS, str(work)], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=900)
    assert ran.returncode == 0, ran.stderr[-3000:]
    after = _cache_files(numba_cache)
    assert {f: after[f] for f in after if before.get(f) != after[f]} == {}, "kernels compiled after precompile"


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_stopped_precompile_leaves_no_temporary_directory(tmp_path, sig, code):
    pytest.importorskip("numba")
    pytest.importorskip("mlx_lm")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp), "NGRAM_SPEC_CACHE_DIR": str(tmp_path / "user")}
    # a shell without job control starts background commands with SIGINT ignored, and a Python started so
    # keeps ignoring it: give the child the default disposition, as a terminal would
    with running([sys.executable, "-m", "mlx_backend.cli", "precompile"], env=env, cwd=ROOT,
                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                 preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)) as proc:
        deadline = time.monotonic() + 120
        while not list(tmp.glob("ngram-spec-precompile-*/tokens.i32")) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert list(tmp.glob("ngram-spec-precompile-*")), "precompile never made its temporary directory"
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=300)
    # Ctrl-C landing inside an extension module's import (the first command imports numba, which imports
    # scipy): main() catches the KeyboardInterrupt and returns 130, yet CPython then ends the process by
    # SIGINT, as after an uncaught one (seen in about half the runs here); a shell shows both as 130
    assert proc.returncode in ((code, -sig) if sig == signal.SIGINT else (code,)), err[-2000:]
    assert "Traceback" not in err
    assert list(tmp.glob("ngram-spec-precompile-*")) == []  # mlx's own JIT cache (tmp/mlx) may remain


def test_an_interrupt_swallowed_inside_a_command_still_stops_precompile(tmp_path, monkeypatch):
    """A library that swallows the ``KeyboardInterrupt`` raised in it must not keep precompile going (seen
    in CI and once under strace here: SIGINT delivered early, Python's handler ran, precompile ran to the
    end and exited 0): the interrupt is raised again after that command, and the temporary directory goes."""
    import argparse

    import mlx_backend.cli.precompile as pc
    import mlx_backend.cli

    ran = []

    def swallowing(args):
        ran.append(args.command)
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # the handler runs here, at the next bytecode
        except KeyboardInterrupt:
            pass
        return 0

    def build_parser():
        parser = argparse.ArgumentParser()
        sub = parser.add_subparsers(dest="command")
        for name in ("first", "second"):
            sub.add_parser(name).set_defaults(func=swallowing)
        return parser

    monkeypatch.setattr(mlx_backend.cli, "build_parser", build_parser)
    monkeypatch.setattr(pc, "commands", lambda d, with_model: [["first"], ["second"]])
    monkeypatch.setattr(pc.tempfile, "tempdir", str(tmp_path))
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        pc.precompile(progress=False)
    assert ran == ["first"]
    assert list(tmp_path.iterdir()) == []
    assert signal.getsignal(signal.SIGINT) is before


def test_a_signal_delivered_again_does_not_cut_the_cleanup_short(tmp_path, monkeypatch):
    """A Ctrl-C landing where raising is unsafe (here a ``__del__``; in real runs inside numba) is put off
    and delivered again 20 ms later, while precompile already stops for it and removes its temporary
    directory: that second delivery must not interrupt the removal (seen once in a fresh-venv run of the
    test command: the directory was left behind)."""
    import argparse
    import shutil

    import mlx_backend.cli
    import mlx_backend.cli.precompile as pc

    class KillsInDel:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)   # the handler runs here, in __del__: put off

    def command(args):
        KillsInDel()
        return 0

    def build_parser():
        parser = argparse.ArgumentParser()
        sub = parser.add_subparsers(dest="command")
        sub.add_parser("only").set_defaults(func=command)
        return parser

    rmtree = shutil.rmtree

    def slow_rmtree(*args, **kwargs):   # the cleanup spans the second delivery
        time.sleep(0.3)
        return rmtree(*args, **kwargs)

    monkeypatch.setattr(mlx_backend.cli, "build_parser", build_parser)
    monkeypatch.setattr(pc, "commands", lambda d, with_model: [["only"]])
    monkeypatch.setattr(pc.tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(shutil, "rmtree", slow_rmtree)
    with pytest.raises(KeyboardInterrupt):
        pc.precompile(progress=False)
    time.sleep(0.1)   # no delivery is left over to land after precompile returned
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("backend", ["reference", "bogus"])
def test_precompile_compiles_the_mlx_kernels_whatever_the_backend_variable_says(monkeypatch, backend):
    """``$NGRAM_SPEC_BACKEND`` set for the user's other commands does not reach precompile's own runs
    (before: ``reference`` failed on ``create --format ours needs --backend mlx``, an unknown name on
    ``unknown backend``, though precompile's --backend is mlx only)."""
    pytest.importorskip("numba")
    from mlx_backend.cli.precompile import precompile

    monkeypatch.setenv("NGRAM_SPEC_BACKEND", backend)
    assert precompile(progress=False, with_model=False) == 8
