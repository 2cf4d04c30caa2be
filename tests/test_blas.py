"""Locating an optimized BLAS (mlx_backend/blas.py) without loading one: which library is chosen,
the environment of the re-executed command, the libgfortran links, and what a process reports.
No test here loads OpenBLAS or changes OPENBLAS_* settings of this process."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mlx_backend import blas

linux_x86 = pytest.mark.skipif(not sys.platform.startswith("linux") or os.uname().machine != "x86_64",
                               reason="the optimized BLAS is interposed on Linux x86-64 only")


@pytest.fixture
def libs(tmp_path, monkeypatch):
    """A fake system OpenBLAS and a fake wheel OpenBLAS (empty files), neither installed at first."""
    system, wheel = tmp_path / "system" / "libopenblas.so.0", tmp_path / "wheel" / "libopenblas.so.0"
    monkeypatch.setattr(blas, "SYSTEM_OPENBLAS", system)
    monkeypatch.setattr(blas, "wheel_openblas", lambda: wheel if wheel.exists() else None)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    monkeypatch.setenv("NGRAM_SPEC_CACHE_DIR", str(tmp_path / "cache"))

    def install(path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"")
        return path
    return system, wheel, install


@linux_x86
def test_auto_prefers_the_system_library_then_the_wheel(libs):
    system, wheel, install = libs
    assert blas.fast_blas_env("auto") is None                       # nothing installed: stay bundled
    install(wheel)
    env = blas.fast_blas_env("auto")
    assert env["LD_PRELOAD"] == str(wheel) and env["OPENBLAS_NUM_THREADS"] == "1"
    folder = Path(env["LD_LIBRARY_PATH"].split(os.pathsep)[0])
    gfortran = folder / blas.GFORTRAN                               # the name the wheel's library needs
    assert gfortran.is_symlink() and Path(os.path.realpath(gfortran)).name.startswith("libgfortran")
    assert Path(os.path.realpath(gfortran)).parent.name == "mlx_cpu.libs"
    # what that copy links by its hashed names sits beside it (the loader looks there: $ORIGIN)
    assert all((folder / p.name).exists() for p in Path(os.path.realpath(gfortran)).parent.iterdir())
    assert blas.fast_blas_env("wheel") == env                       # links made once, then reused
    install(system)
    assert blas.fast_blas_env("auto") == {"LD_PRELOAD": str(system), "OPENBLAS_NUM_THREADS": "1"}
    assert blas.fast_blas_env("wheel")["LD_PRELOAD"] == str(wheel)
    assert blas.fast_blas_env("bundled") is None


@linux_x86
def test_required_library_missing_names_the_fix(libs):
    with pytest.raises(FileNotFoundError, match="apt-get install libopenblas0-pthread"):
        blas.fast_blas_env("system")
    with pytest.raises(FileNotFoundError, match="pip install cmeel-openblas"):
        blas.fast_blas_env("wheel")
    with pytest.raises(ValueError, match="auto, system, wheel, bundled"):
        blas.fast_blas_env("mkl")


@linux_x86
def test_a_preloaded_blas_or_another_platform_is_left_alone(libs, monkeypatch):
    system, wheel, install = libs
    install(wheel)
    monkeypatch.setenv("LD_PRELOAD", "/opt/my/libmkl_rt.so.2")
    assert blas.fast_blas_env("auto") is None
    monkeypatch.delenv("LD_PRELOAD")
    monkeypatch.setattr(blas.platform, "machine", lambda: "aarch64")
    assert blas.fast_blas_env("auto") is None


@linux_x86
def test_ensure_fast_blas_re_executes_once_with_the_environment(libs, monkeypatch):
    system, wheel, install = libs
    calls, lines = [], []
    monkeypatch.setattr(blas.os, "execve", lambda exe, argv, env: calls.append((exe, argv, env)))
    monkeypatch.delenv(blas.REEXEC_MARK, raising=False)
    blas.ensure_fast_blas(["demo", "--json"], "auto", log=lines.append)
    assert not calls and "pip install cmeel-openblas" in lines[-1]   # nothing to use: a note, no re-run
    install(wheel)
    blas.ensure_fast_blas(["demo", "--json"], "auto", log=lines.append)
    (exe, argv, env), = calls
    assert argv == [sys.executable, "-m", "reference", "demo", "--json"] and exe == sys.executable
    assert env["LD_PRELOAD"] == str(wheel) and env[blas.REEXEC_MARK] == "auto"
    assert "cmeel-openblas wheel" in lines[-1] and str(wheel) in lines[-1]
    monkeypatch.setenv(blas.REEXEC_MARK, "auto")                     # the re-run process: never again
    monkeypatch.setenv("LD_PRELOAD", str(wheel))
    blas.ensure_fast_blas(["demo"], "auto", log=lines.append)
    assert len(calls) == 1 and "could not be loaded" in lines[-1]     # an empty file is never mapped


def test_blas_in_use_reports_only_a_library_that_is_loaded(monkeypatch, tmp_path):
    if sys.platform == "darwin":
        assert blas.blas_in_use() == "Accelerate"
        return
    monkeypatch.setenv("LD_PRELOAD", str(tmp_path / "libopenblas.so.0"))
    assert blas.blas_in_use().startswith("reference BLAS")          # named, but not in this process
    libc = next(line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()
                if "/libc.so" in line or "/libc-" in line)
    link = tmp_path / "libfakeblas.so"
    link.symlink_to(libc)                                           # a mapped file, named like a BLAS
    monkeypatch.setenv("LD_PRELOAD", str(link))
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "3")
    assert blas.blas_in_use() == f"{link} via LD_PRELOAD (OPENBLAS_NUM_THREADS=3)"


@linux_x86
def test_an_unwritable_cache_directory_keeps_the_bundled_blas(libs, monkeypatch, tmp_path):
    system, wheel, install = libs
    install(wheel)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("NGRAM_SPEC_CACHE_DIR", str(blocker / "cache"))   # cannot be created
    assert blas.fast_blas_env("auto") is None
    with pytest.raises(FileNotFoundError, match="NGRAM_SPEC_CACHE_DIR"):
        blas.fast_blas_env("wheel")


RE_RUN_PROBE = """
import json, os, sys
from mlx_backend import blas
def execve(exe, argv, env):  # the moment of the re-run: which mlx-lm modules were loaded before it
    print(json.dumps(sorted(m for m in sys.modules if m == "mlx_lm" or m.startswith("mlx_lm."))))
    sys.stdout.flush()
    os._exit(0)
blas.os.execve = execve
blas.fast_blas_env = lambda choice: {"LD_PRELOAD": "libopenblas.so.0", "OPENBLAS_NUM_THREADS": "1"}
sys.argv = ["ngram-spec", *sys.argv[1:]]
from reference.cli import main
sys.exit(main(sys.argv[1:]) or 3)  # 3: returned without re-running
"""


def run_probe(*argv: str) -> subprocess.CompletedProcess:
    """``ngram-spec *argv`` through RE_RUN_PROBE, with no fast-BLAS choice or re-run mark inherited."""
    pytest.importorskip("mlx_lm")
    env = {k: v for k, v in os.environ.items() if k not in (blas.REEXEC_MARK, blas.ENV_CHOICE, "LD_PRELOAD")}
    return subprocess.run([sys.executable, "-c", RE_RUN_PROBE, *argv], capture_output=True, text=True, env=env,
                          cwd=Path(__file__).parents[1], timeout=300)


@pytest.mark.parametrize("argv", [["generate", "--prompt", "hi", "--max-tokens", "2"], ["serve"]],
                         ids=["generate", "serve"])
def test_generate_and_serve_re_run_before_importing_mlx_lm(argv):
    """Everything a command imports before the re-run is imported again after it: ``generate`` and
    ``serve`` re-run themselves with the fast BLAS before importing mlx-lm (about 1 s here)."""
    out = run_probe(*argv)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.splitlines()[-1]) == []


@pytest.mark.parametrize("flag", [["--port", "70000"], ["--max-tokens", "0"], ["--draft-max", "-1"]],
                         ids=["port", "max-tokens", "draft-max"])
def test_serve_refuses_bad_arguments_before_re_running(flag):
    """A bad ``serve`` argument is one error line, exit 2, without the fast-BLAS re-run (and its note)
    first: the checks come before it."""
    out = run_probe("serve", *flag)
    assert out.returncode == 2 and out.stdout == "", (out.stdout, out.stderr[-2000:])
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "error:" in lines[0] and flag[0] in lines[0], lines
