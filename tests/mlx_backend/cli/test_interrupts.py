"""Ctrl-C (and SIGTERM) end every long command the same way, in every phase (issue 29, item 6).

Ctrl-C: exit status 130 and one line on stderr, ``ngram-spec CMD: interrupted``; SIGTERM: 143 (the
temporary file of an open atomic write is removed). Never a traceback; the old output file unchanged
and no temporary file left beside it. What stderr may hold: progress bars show only on a terminal
(stderr is a pipe here) and the loaders' notes on llama.cpp-format inputs are turned off
(``NGRAM_SPEC_NO_CONVERTED_COPY=1``), so after Ctrl-C stderr must be exactly that one line, and empty
after SIGTERM.

Before the fix, a signal that arrived while a numba kernel ran was handled when the kernel called back
into Python to box the arrays it returns (``numba.core.serialize._numba_unpickle``), and the exception
raised there came out as ``SystemError: CPUDispatcher(<function _unpack_2grams ...>) returned a result
with an exception set``: a 35-line traceback and exit 1; elsewhere Ctrl-C was a silent 130.

Landing inside a kernel on purpose: the child wraps one kernel of the command's phase so that its
first call (a marker file appears) first runs ``_spin``, a compiled loop of about two seconds that
returns a tuple of arrays, as most of the project's kernels do (boxing the arrays of a returned tuple
is where numba loses the exception; a kernel returning one array passes it on); the signal is sent
while it runs. The other moments
of ``create`` are real runs: during the imports (numba's extension is mapped), one second into the
build, and during the write (its temporary file exists; the write is held there, so the run cannot
end before the signal).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from child_processes import running

from reference.atomic import HOLD_ENV

pytest.importorskip("numba")

ROOT = Path(__file__).resolve().parents[3]
OLD = b"the user's old file, not a cache\n"

# The child for the kernel cases: python CHILD MODULE FUNCTION MARKER ngram-spec-args...
CHILD = textwrap.dedent('''
    import importlib, os, sys, time
    import numpy as np
    from numba import njit

    @njit
    def _spin(n):
        x = np.zeros(2, np.int64)
        for i in range(n):
            x[0] = (x[0] * 31 + i) % 1000003
        return x[:1], x[1:]  # a tuple of arrays, as most of the project's kernels return

    module, name, marker = sys.argv[1:4]
    _spin(10)
    t = time.perf_counter()
    _spin(2_000_000)
    n = int(2.0 * 2_000_000 / max(time.perf_counter() - t, 1e-6))  # about two seconds
    mod = importlib.import_module(module)
    real = getattr(mod, name)

    def slowed(*args, **kwargs):
        if np.size(args[0]) > 2 and not os.path.exists(marker):  # the first call on real data
            open(marker, "w").close()
            _spin(n)
        return real(*args, **kwargs)

    setattr(mod, name, slowed)
    from mlx_backend.cli import main
    sys.exit(main(sys.argv[4:]))
''')


def start(argv, tmp_path: Path, env=None, child=None):
    """``with start(...) as proc:`` the command (or ``child``) running, killed at the block's end if it still runs."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NGRAM_SPEC_NO_CONVERTED_COPY": "1", HOLD_ENV: "30", **(env or {})}
    cmd = [sys.executable, *(child or ["-m", "mlx_backend.cli"]), *map(str, argv)]
    # a shell without job control starts background commands with SIGINT ignored, and a Python started so
    # keeps ignoring it (no KeyboardInterrupt): give the child the default disposition a terminal gives
    return running(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                   preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def wait_for(proc: subprocess.Popen, ready, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, f"ended before {what}: rc {proc.returncode}: {proc.stderr.read()[-3000:]}"
        assert time.monotonic() < deadline, f"never {what}"
        time.sleep(0.01)


def numba_mapped(proc: subprocess.Popen) -> bool:
    """The child has loaded numba's compiled extension: mlx_backend.cli.main runs, importing."""
    try:
        return "numba" in Path(f"/proc/{proc.pid}/maps").read_text()
    except OSError:
        return False


def stop(proc: subprocess.Popen, signum: int) -> tuple[int, str]:
    proc.send_signal(signum)
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, err


def check_ending(signum: int, rc: int, err: str, command: str, out_dir: Path, before: list[str]) -> None:
    if signum == signal.SIGINT:
        # CPython may end a process by SIGINT after main() returned 130, when a KeyboardInterrupt went through
        # a library's PyRun_* call on its way (as after an uncaught one); a shell shows both as 130
        assert rc in (130, -signal.SIGINT), (rc, err[-3000:])
        assert err == f"ngram-spec {command}: interrupted\n", err[-3000:]
    else:
        assert rc == 128 + signum, (rc, err[-3000:])
        assert err == "", err[-3000:]
    assert (out_dir / "out").read_bytes() == OLD
    assert sorted(p.name for p in out_dir.iterdir()) == before  # no temporary file left


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    """A 4M-token file (ids below 2**21: the packed build) and a llama.cpp-format static cache."""
    from mlx_backend.ngram.caches import save_cache
    from mlx_backend.ngram.sorted_cache import build_static

    d = tmp_path_factory.mktemp("inputs")
    tokens = np.random.default_rng(0).integers(0, 1 << 21, 4_000_000).astype("<i4")
    tokens.tofile(d / "tokens.i32")
    tokens[:200_000].tofile(d / "short.i32")
    save_cache(build_static(tokens[:1_000_000]), d / "static.bin", format="llama")
    return {"tokens": d / "tokens.i32", "short": d / "short.i32", "static": d / "static.bin"}


def out_folder(tmp_path: Path) -> tuple[Path, list[str]]:
    out_dir = tmp_path / "out-dir"
    out_dir.mkdir()
    (out_dir / "out").write_bytes(OLD)
    return out_dir, sorted(p.name for p in out_dir.iterdir())


CREATE_MOMENTS = {
    "importing": lambda proc, out_dir: wait_for(proc, lambda: numba_mapped(proc), "imported numba"),
    "building": lambda proc, out_dir: (wait_for(proc, lambda: numba_mapped(proc), "imported numba"), time.sleep(1.0)),
    "writing": lambda proc, out_dir: wait_for(proc, lambda: list(out_dir.glob(".out.*.tmp")), "wrote"),
}


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="finds the import phase in /proc/PID/maps")
@pytest.mark.parametrize("moment", CREATE_MOMENTS)
def test_ctrl_c_during_create_exits_130_with_one_line(tmp_path, inputs, moment):
    out_dir, before = out_folder(tmp_path)
    with start(["create", inputs["tokens"], "-o", out_dir / "out", "--backend", "mlx"], tmp_path) as proc:
        CREATE_MOMENTS[moment](proc, out_dir)
        rc, err = stop(proc, signal.SIGINT)
    check_ending(signal.SIGINT, rc, err, "create", out_dir, before)


KERNEL_CASES = {  # name: (signal, kernel wrapped (module, function), ngram-spec arguments; OUT: the output file)
    "create": (signal.SIGINT, ("mlx_backend.ngram.sorted_cache", "_unpack_2grams"),
               ["create", "TOKENS", "-o", "OUT"]),
    "merge": (signal.SIGINT, ("mlx_backend.ngram.sorted_cache", "_merge_rows"),
              ["merge", "STATIC", "STATIC_COPY", "-o", "OUT"]),  # a copy: one file twice is warned about
    "convert": (signal.SIGINT, ("mlx_backend.ngram.cache_file", "_scan_llama"),
                ["convert", "STATIC", "-o", "OUT", "--to", "ours", "--force"]),
    "inspect": (signal.SIGINT, ("mlx_backend.ngram.cache_file", "_scan_llama"), ["inspect", "STATIC"]),
    "stats": (signal.SIGINT, ("mlx_backend.ngram.replay", "replay_chunk"),
              ["stats", "SHORT", "--n-ctx", "256", "--save-dynamic", "OUT"]),
    "stats-drafts-out-sigterm": (signal.SIGTERM, ("mlx_backend.ngram.replay", "replay_chunk"),  # inside the atomic write
                                 ["stats", "SHORT", "--n-ctx", "256", "--drafts-out", "OUT"]),
}


@pytest.mark.parametrize("case", KERNEL_CASES)
def test_a_signal_inside_a_compiled_kernel_ends_the_command_cleanly(tmp_path, inputs, case):
    """The signal arrives while a numba kernel of the command's phase runs (see the module docstring)."""
    signum, (module, function), argv = KERNEL_CASES[case]
    out_dir, before = out_folder(tmp_path)
    aux = tmp_path / "aux"
    aux.mkdir()
    (aux / "child.py").write_text(CHILD)
    marker = aux / "in-kernel"
    shutil.copy(inputs["static"], aux / "static-copy.bin")
    names = {"TOKENS": inputs["tokens"], "SHORT": inputs["short"], "STATIC": inputs["static"],
             "STATIC_COPY": aux / "static-copy.bin", "OUT": out_dir / "out"}
    argv = [names.get(a, a) for a in argv] + ["--backend", "mlx"]
    with start(argv, tmp_path, child=[aux / "child.py", module, function, marker]) as proc:
        wait_for(proc, marker.exists, f"called {function}")
        time.sleep(0.3)  # inside the two-second compiled loop
        rc, err = stop(proc, signum)
    check_ending(signum, rc, err, argv[0], out_dir, before)


def test_an_interrupt_garbled_by_a_kernel_is_still_an_interrupt(capsys, monkeypatch):
    """main() reads a SystemError caused by a KeyboardInterrupt (what a kernel's caller got) as Ctrl-C."""
    import mlx_backend.cli.ngram as ngram
    from mlx_backend.cli import main

    def interrupted_kernel(args):
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as exc:
            raise SystemError("CPUDispatcher(<function _unpack_2grams>) returned a result with an exception set") from exc

    monkeypatch.setattr(ngram, "cmd_create", interrupted_kernel)
    assert main(["create", "x.i32", "-o", "y.bin"]) == 130
    assert capsys.readouterr().err == "ngram-spec create: interrupted\n"


class _Terminal:
    """A stream that says it is a terminal and records what is written to it (the terminal both streams show)."""

    def __init__(self, screen: list[str]):
        self.screen = screen

    def write(self, text: str) -> int:
        self.screen.append(text)
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return True


def test_on_a_terminal_the_interrupted_line_starts_a_line_of_its_own(monkeypatch):
    """generate streams its text to stdout without a newline; before, Ctrl-C's line was glued to it on the
    terminal ('...the presentngram-spec generate: interrupted'). Piped (the tests above), the line is as it was."""
    from mlx_backend.cli import _interrupted

    screen: list[str] = []
    monkeypatch.setattr(sys, "stdout", _Terminal(screen))
    monkeypatch.setattr(sys, "stderr", _Terminal(screen))
    sys.stdout.write("intertwined with the present")
    assert _interrupted("generate") == 130
    assert "".join(screen).splitlines() == ["intertwined with the present", "ngram-spec generate: interrupted"]
