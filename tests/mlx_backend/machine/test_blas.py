"""Locating and checking an optimized BLAS (mlx_backend/machine/blas.py): which library is chosen, the check
that runs a candidate in a child process before any re-run (fake BLAS libraries compiled here: one
whose ``cblas_sgemm`` executes an illegal instruction, one that returns wrong numbers), the verdicts
kept per CPU, the environment of the re-executed command, and what a process reports. No test here
loads a BLAS into this process or changes OPENBLAS_* settings of it."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mlx_backend.machine import blas

linux_x86 = pytest.mark.skipif(not sys.platform.startswith("linux") or os.uname().machine != "x86_64",
                               reason="the optimized BLAS is interposed on Linux x86-64 only")

# cblas_sgemm as mlx calls it (row-major C = alpha * op(A) @ op(B) + beta * C); the bodies below replace it
FAKE_BLAS = {
    # ud2: the CPU raises SIGILL, as an AVX-512 kernel does on a CPU without AVX-512
    "trap": "__builtin_trap();",
    # a plausible-looking but wrong product: every entry 1
    "wrong": "for (int i = 0; i < M; i++) for (int j = 0; j < N; j++) C[i * ldc + j] = 1.0f;",
    # Ctrl-C arriving while the check runs (the terminal sends it to the whole process group)
    "interrupted": "raise(SIGINT);",
}
FAKE_SOURCE = """
#include <signal.h>
void cblas_sgemm(int order, int ta, int tb, int M, int N, int K, float alpha, const float *A, int lda,
                 const float *B, int ldb, float beta, float *C, int ldc) {{ {body} }}
"""

CPU_AVX2 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B12 64-Core Processor
flags\t\t: fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma bmi2

processor\t: 1
model name\t: AMD EPYC 7B12 64-Core Processor
flags\t\t: fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma bmi2
"""
CPU_AVX512 = CPU_AVX2.replace("AMD EPYC 7B12 64-Core Processor", "Intel(R) Xeon(R) Platinum 8481C") \
    .replace("avx2 fma bmi2", "avx2 fma bmi2 avx512f avx512bw avx512vl")


@pytest.fixture(scope="module")
def fake_blas(tmp_path_factory) -> dict[str, Path]:
    """The fake libraries of FAKE_BLAS, compiled with the machine's C compiler."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler (cc/gcc) to build the fake BLAS libraries")
    root = tmp_path_factory.mktemp("fake-blas")
    libs = {}
    for name, body in FAKE_BLAS.items():
        (root / f"{name}.c").write_text(FAKE_SOURCE.format(body=body))
        libs[name] = root / f"lib{name}blas.so"
        subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", libs[name], root / f"{name}.c"], check=True)
    return libs


@pytest.fixture
def libs(tmp_path, monkeypatch):
    """A fake system OpenBLAS and a fake wheel OpenBLAS (empty files), neither installed at first;
    every candidate passes its check unless a test says otherwise."""
    system, wheel = tmp_path / "system" / "libopenblas.so.0", tmp_path / "wheel" / "libopenblas.so.0"
    monkeypatch.setattr(blas, "SYSTEM_OPENBLAS", system)
    monkeypatch.setattr(blas, "wheel_openblas", lambda: wheel if wheel.exists() else None)
    monkeypatch.setattr(blas, "probe", lambda env: (True, ""))
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    monkeypatch.setenv("NGRAM_SPEC_CACHE_DIR", str(tmp_path / "cache"))

    def install(path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"")
        return path
    return system, wheel, install


@linux_x86
def test_auto_prefers_the_system_library_then_the_wheel(libs, monkeypatch):
    system, wheel, install = libs
    assert blas.candidates("auto") == []                            # nothing installed: stay bundled
    install(wheel)
    (source, env), = blas.candidates("auto")
    assert env["LD_PRELOAD"] == str(wheel) and env["OPENBLAS_NUM_THREADS"] == "1" and "wheel" in source
    folder = Path(env["LD_LIBRARY_PATH"].split(os.pathsep)[0])
    gfortran = folder / blas.GFORTRAN                               # the name the wheel's library needs
    assert gfortran.is_symlink() and Path(os.path.realpath(gfortran)).name.startswith("libgfortran")
    assert Path(os.path.realpath(gfortran)).parent.name == "mlx_cpu.libs"
    # what that copy links by its hashed names sits beside it (the loader looks there: $ORIGIN)
    assert all((folder / p.name).exists() for p in Path(os.path.realpath(gfortran)).parent.iterdir())
    assert blas.candidates("wheel") == [(source, env)]              # links made once, then reused
    install(system)
    assert [env for _, env in blas.candidates("auto")] == [
        {"LD_PRELOAD": str(system), "OPENBLAS_NUM_THREADS": "1"}, env]
    assert [env for _, env in blas.candidates("wheel")] == [env]
    assert blas.candidates("bundled") == []
    (source, by_path), = blas.candidates(str(wheel))                 # a path: that file, libgfortran offered
    assert source == "library given by --blas / $NGRAM_SPEC_BLAS" and by_path == env
    monkeypatch.chdir(wheel.parent)                                  # a relative path is made absolute: the
    assert blas.candidates(wheel.name) == [(source, by_path)]        # loader would search for a bare name


@linux_x86
def test_required_library_missing_names_the_fix(libs):
    with pytest.raises(FileNotFoundError, match="apt-get install libopenblas0-pthread"):
        blas.candidates("system")
    with pytest.raises(FileNotFoundError, match="pip install ngsolve-openblas"):
        blas.candidates("wheel")
    with pytest.raises(ValueError, match="auto, system, wheel, bundled or a library file"):
        blas.candidates("mkl")


def test_the_blas_option_takes_a_name_or_an_existing_file(tmp_path):
    import argparse

    lib = tmp_path / "libmkl_rt.so.2"
    lib.write_bytes(b"")
    assert blas.parse_choice("wheel") == "wheel" and blas.parse_choice(str(lib)) == str(lib)
    with pytest.raises(argparse.ArgumentTypeError, match="neither one of auto, system, wheel, bundled"):
        blas.parse_choice(str(tmp_path / "missing.so"))


@linux_x86
def test_a_preloaded_blas_or_another_platform_is_left_alone(libs, monkeypatch):
    system, wheel, install = libs
    install(wheel)
    monkeypatch.setenv("LD_PRELOAD", "/opt/my/libmkl_rt.so.2")
    assert blas.candidates("auto") == []
    monkeypatch.delenv("LD_PRELOAD")
    monkeypatch.setattr(blas.platform, "machine", lambda: "aarch64")
    assert blas.candidates("auto") == []


@linux_x86
def test_ensure_fast_blas_re_executes_once_with_the_environment(libs, monkeypatch):
    system, wheel, install = libs
    calls, lines = [], []
    monkeypatch.setattr(blas.os, "execve", lambda exe, argv, env: calls.append((exe, argv, env)))
    monkeypatch.delenv(blas.REEXEC_MARK, raising=False)
    blas.ensure_fast_blas(["demo", "--json"], "auto", log=lines.append)
    assert not calls and "pip install ngsolve-openblas" in lines[-1]  # nothing to use: a note, no re-run
    install(wheel)
    blas.ensure_fast_blas(["demo", "--json"], "auto", log=lines.append)
    (exe, argv, env), = calls
    assert argv == [sys.executable, "-m", "mlx_backend.cli", "demo", "--json"] and exe == sys.executable
    assert env["LD_PRELOAD"] == str(wheel) and env[blas.REEXEC_MARK] == "auto"
    assert "ngsolve-openblas wheel" in lines[-1] and str(wheel) in lines[-1]
    monkeypatch.setenv(blas.REEXEC_MARK, "auto")                     # the re-run process: never again
    monkeypatch.setenv("LD_PRELOAD", str(wheel))
    blas.ensure_fast_blas(["demo"], "auto", log=lines.append)
    assert len(calls) == 1 and "could not be loaded" in lines[-1]     # an empty file is never mapped


@linux_x86
def test_a_candidate_that_fails_its_check_is_skipped_with_one_line(libs, monkeypatch, tmp_path):
    """auto: the system library crashes on this CPU, so the wheel's runs, after one line naming the
    system one, the reason, the CPU's vector extensions and what comes next; both failing: the
    bundled BLAS stays, no re-run."""
    system, wheel, install = libs
    install(system), install(wheel)
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(CPU_AVX2)
    monkeypatch.setattr(blas, "CPUINFO", cpuinfo)
    bad = {str(system)}
    monkeypatch.setattr(blas, "probe", lambda env: (False, "killed by SIGILL in a matmul")
                        if env["LD_PRELOAD"] in bad else (True, ""))
    calls, lines = [], []
    monkeypatch.setattr(blas.os, "execve", lambda exe, argv, env: calls.append(env))
    monkeypatch.delenv(blas.REEXEC_MARK, raising=False)
    blas.ensure_fast_blas(["generate"], "auto", log=lines.append)
    assert [env["LD_PRELOAD"] for env in calls] == [str(wheel)]
    skip, rerun = lines
    assert skip.startswith(f"[blas] skipping {system} (system OpenBLAS): killed by SIGILL")
    assert "AMD EPYC 7B12" in skip and "avx2 fma, no avx512f" in skip and "trying the OpenBLAS of" in skip
    assert rerun.startswith("[blas] re-running with the OpenBLAS of the ngsolve-openblas wheel")
    bad.add(str(wheel))
    (blas.cache_dir() / blas.VERDICTS).unlink()
    lines.clear()
    blas.ensure_fast_blas(["generate"], "auto", log=lines.append)
    assert len(calls) == 1 and len(lines) == 2 and "running on mlx's bundled reference BLAS" in lines[-1]


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
    assert blas.candidates("auto") == []
    with pytest.raises(FileNotFoundError, match="NGRAM_SPEC_CACHE_DIR"):
        blas.candidates("wheel")


RE_RUN_PROBE = """
import json, os, sys
from mlx_backend.machine import blas
def execve(exe, argv, env):  # the moment of the re-run: which mlx-lm modules were loaded before it
    print(json.dumps(sorted(m for m in sys.modules if m == "mlx_lm" or m.startswith("mlx_lm."))))
    sys.stdout.flush()
    os._exit(0)
blas.os.execve = execve
blas.candidates = lambda choice: [("OpenBLAS", {"LD_PRELOAD": "libopenblas.so.0", "OPENBLAS_NUM_THREADS": "1"})]
blas.first_working = lambda found, log=None: found[0]
sys.argv = ["ngram-spec", *sys.argv[1:]]
from mlx_backend.cli import main
sys.exit(main(sys.argv[1:]) or 3)  # 3: returned without re-running
"""


def user_env() -> dict[str, str]:
    """This environment as a user's shell has it: no fast-BLAS choice, re-run mark or preloaded library."""
    return {k: v for k, v in os.environ.items() if k not in (blas.REEXEC_MARK, blas.ENV_CHOICE, "LD_PRELOAD")}


def run_probe(*argv: str) -> subprocess.CompletedProcess:
    """``ngram-spec *argv`` through RE_RUN_PROBE, with no fast-BLAS choice or re-run mark inherited."""
    pytest.importorskip("mlx_lm")
    env = user_env()
    return subprocess.run([sys.executable, "-c", RE_RUN_PROBE, *argv], capture_output=True, text=True, env=env,
                          cwd=Path(__file__).parents[3], timeout=300)


@pytest.mark.parametrize("argv", [["generate", "--prompt", "hi", "--max-tokens", "2"], ["serve"]],
                         ids=["generate", "serve"])
def test_generate_and_serve_re_run_before_importing_mlx_lm(argv):
    """Everything a command imports before the re-run is imported again after it: ``generate`` and
    ``serve`` re-run themselves with the fast BLAS before importing mlx-lm (about 1 s here)."""
    out = run_probe(*argv)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.splitlines()[-1]) == []


@pytest.mark.parametrize("flag", [["--port", "70000"], ["--max-tokens", "0"], ["--draft-max", "-1"],
                                  ["--decode-concurrency", "0"]],
                         ids=["port", "max-tokens", "draft-max", "decode-concurrency"])
def test_serve_refuses_bad_arguments_before_re_running(flag):
    """A bad ``serve`` argument is one error line, exit 2, without the fast-BLAS re-run (and its note)
    first: the checks come before it."""
    out = run_probe("serve", *flag)
    assert out.returncode == 2 and out.stdout == "", (out.stdout, out.stderr[-2000:])
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "error:" in lines[0] and flag[0] in lines[0], lines


# --- the check itself, on real child processes ------------------------------------------------------

@linux_x86
def test_the_check_refuses_a_crashing_a_wrong_and_an_unloadable_library_and_passes_a_real_one(fake_blas):
    pytest.importorskip("mlx.core")
    ok, why = blas.probe({"LD_PRELOAD": str(fake_blas["trap"])})
    assert not ok and why == "killed by SIGILL in a matmul"
    ok, why = blas.probe({"LD_PRELOAD": str(fake_blas["wrong"])})
    assert not ok and why.startswith("wrong results (relative error") and " @ " in why
    ok, why = blas.probe({"LD_PRELOAD": str(fake_blas["trap"].with_name("libmissing.so"))})
    assert not ok and why.startswith("the dynamic loader did not load it") and "libmissing.so" in why
    real = [env for _, env in blas.candidates("auto")]
    if not real:
        # CI installs the mlx extra, whose ngsolve-openblas wheel must be found: a broken search would skip here
        assert not os.environ.get("CI"), "CI: the mlx extra's ngsolve-openblas wheel was not found by candidates()"
        pytest.skip("no optimized BLAS installed (ngsolve-openblas or the system's) to pass the check")
    assert blas.probe(real[0]) == (True, "")


@linux_x86
def test_a_check_stopped_by_ctrl_c_stops_the_command_and_keeps_no_verdict(fake_blas, tmp_path, monkeypatch):
    """A check interrupted with the command is no verdict on the library (else Ctrl-C at the wrong moment
    would have it skipped for good): the interrupt goes on, nothing is recorded."""
    pytest.importorskip("mlx.core")
    monkeypatch.setenv("NGRAM_SPEC_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(KeyboardInterrupt):
        blas.checked({"LD_PRELOAD": str(fake_blas["interrupted"])})
    assert not (tmp_path / "cache" / blas.VERDICTS).exists()


@linux_x86
def test_a_verdict_is_kept_per_cpu_and_library_file(fake_blas, tmp_path, monkeypatch):
    """Checked once per (CPU model and flags, library file); the same library on another CPU (its
    flags read from a fixture file), or a changed library file, is checked again."""
    monkeypatch.setenv("NGRAM_SPEC_CACHE_DIR", str(tmp_path / "cache"))
    runs = []
    real_probe = blas.probe
    monkeypatch.setattr(blas, "probe", lambda env: runs.append(env["LD_PRELOAD"]) or real_probe(env))
    avx2, avx512 = tmp_path / "cpuinfo-avx2", tmp_path / "cpuinfo-avx512"
    avx2.write_text(CPU_AVX2)
    avx512.write_text(CPU_AVX512)
    assert blas.cpu_identity(avx2)["model"] == "AMD EPYC 7B12 64-Core Processor"
    assert "avx512f" in blas.cpu_identity(avx512)["flags"] and "avx512f" not in blas.cpu_identity(avx2)["flags"]
    lib = tmp_path / "libtrapblas.so"
    shutil.copy(fake_blas["trap"], lib)
    env = {"LD_PRELOAD": str(lib)}
    assert blas.checked(env, avx2) == (False, "killed by SIGILL in a matmul", False) and len(runs) == 1
    assert blas.checked(env, avx2) == (False, "killed by SIGILL in a matmul", True) and len(runs) == 1
    assert blas.checked(env, avx512)[2] is False and len(runs) == 2          # another CPU: checked again
    assert blas.checked(env, avx512)[2] is True and len(runs) == 2
    shutil.copy(fake_blas["wrong"], lib)                                     # the file changed
    ok, why, cached = blas.checked(env, avx2)
    assert (ok, cached) == (False, False) and why.startswith("wrong results") and len(runs) == 3
    kept = json.loads((tmp_path / "cache" / blas.VERDICTS).read_text())
    assert len(kept) == 3 and {v["library"] for v in kept.values()} == {str(lib)}
    assert {v["simd"] for v in kept.values()} == {"avx2 fma, no avx512f", "avx2 fma avx512f avx512bw avx512vl"}


def _generate(tmp_path, blas_choice: str) -> subprocess.CompletedProcess:
    """``ngram-spec generate`` on a tiny model as a user starts it, with ``--blas blas_choice``."""
    from reference.models.tiny import write_tiny_model

    model = tmp_path / "model"
    if not model.exists():
        write_tiny_model(model, "llama", seed=1)
    env = user_env()
    env["NGRAM_SPEC_CACHE_DIR"] = str(tmp_path / "cache")
    return subprocess.run([sys.executable, "-m", "mlx_backend.cli", "generate", "--backend", "mlx", "--model", str(model),
                           "--prompt", "the cat sat on the mat", "--max-tokens", "6", "--json", "--blas", blas_choice],
                          capture_output=True, text=True, env=env, timeout=300, cwd=Path(__file__).parents[3])


@linux_x86
@pytest.mark.parametrize("kind", ["trap", "wrong"])
def test_generate_falls_back_from_a_bad_blas_and_succeeds(fake_blas, tmp_path, kind):
    """The command a user runs: the bad library is named in one line with the reason, the command runs
    on the bundled BLAS and prints its record (before: SIGILL, exit -4; or silently wrong tokens)."""
    pytest.importorskip("mlx_lm")
    out = _generate(tmp_path, str(fake_blas[kind]))
    assert out.returncode == 0, out.stderr[-3000:]
    record = json.loads(out.stdout.splitlines()[-1])
    assert record["blas"] == "reference BLAS (bundled with mlx-cpu)" and len(record["tokens"]) == 6
    lines = [line for line in out.stderr.splitlines() if line.startswith("[blas]")]
    reason = "killed by SIGILL" if kind == "trap" else "wrong results"
    assert len(lines) == 1 and str(fake_blas[kind]) in lines[0] and reason in lines[0], out.stderr
    assert lines[0].endswith("running on mlx's bundled reference BLAS")
    again = _generate(tmp_path, str(fake_blas[kind]))                       # the verdict is kept: no second check
    assert again.returncode == 0 and [line for line in again.stderr.splitlines() if line.startswith("[blas]")] == lines


@linux_x86
def test_a_cache_directory_that_is_a_file_is_named_as_the_fix_not_installing_the_wheel(libs, monkeypatch, tmp_path):
    """``auto`` with the wheel installed but ``$NGRAM_SPEC_CACHE_DIR`` unusable (a file here) stays on the bundled
    BLAS with a note naming the cache directory (before: "pip install ngsolve-openblas", which is installed)."""
    system, wheel, install = libs
    install(wheel)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("NGRAM_SPEC_CACHE_DIR", str(blocker))
    monkeypatch.setattr(blas, "blas_in_use", lambda: "reference BLAS (bundled with mlx-cpu)")
    monkeypatch.delenv(blas.REEXEC_MARK, raising=False)
    notes = []
    blas.ensure_fast_blas(["demo"], "auto", log=notes.append)
    note, = notes
    assert f"{blocker} is not a writable folder (set NGRAM_SPEC_CACHE_DIR to one)" in note
    assert "pip install" not in note
    blocker.unlink()                                     # without the wheel the note still says how to get it
    wheel.unlink()
    notes.clear()
    blas.ensure_fast_blas(["demo"], "auto", log=notes.append)
    assert "pip install ngsolve-openblas" in notes[0]


def test_a_bad_blas_variable_is_refused_naming_the_variable(monkeypatch):
    """(before: "unknown BLAS choice 'foo'", which a user who gave no --blas could not place); --blas wins."""
    monkeypatch.setenv(blas.ENV_CHOICE, "foo")
    monkeypatch.delenv(blas.REEXEC_MARK, raising=False)
    with pytest.raises(ValueError, match=r"^\$NGRAM_SPEC_BLAS is 'foo', neither one of auto, .* unset it for auto"):
        blas.ensure_fast_blas(["demo"], log=lambda msg: None)
    blas.ensure_fast_blas(["demo"], "bundled", log=lambda msg: None)   # nothing to do, no error


@pytest.mark.parametrize("system, machine", [("linux", "aarch64"), ("darwin", "arm64")])
def test_off_linux_x86_64_no_install_is_named_and_a_named_blas_is_said_to_be_ignored(libs, monkeypatch, system, machine):
    """Linux aarch64 and macOS (simulated): nothing is interposed there, so ``auto``'s note must not say "pip install
    ngsolve-openblas" (no aarch64 or macOS wheel; the system path is x86-64's) and ``--blas wheel`` is said to be
    ignored instead of doing nothing silently; macOS with ``auto`` says nothing (Metal / Accelerate)."""
    monkeypatch.setattr(blas.sys, "platform", system)
    monkeypatch.setattr(blas.platform, "machine", lambda: machine)
    monkeypatch.delenv(blas.REEXEC_MARK, raising=False)
    monkeypatch.setattr(blas.os, "execve", lambda *a: pytest.fail("re-executed off Linux x86-64"))
    notes = []
    blas.ensure_fast_blas(["demo"], "auto", log=notes.append)
    if system == "linux":
        note, = notes
        assert "reference BLAS" in note and "Linux x86-64 only" in note and "aarch64" in note
        assert "pip install" not in note and "apt-get" not in note
    else:
        assert notes == []
    notes.clear()
    blas.ensure_fast_blas(["demo"], "wheel", log=notes.append)
    note, = notes
    assert "'wheel' ignored" in note and machine in note
    notes.clear()
    blas.ensure_fast_blas(["demo"], "bundled", log=notes.append)
    assert notes == []


@pytest.mark.parametrize("metal", [True, False])
def test_on_a_gpu_no_blas_is_named_tried_or_interposed(libs, monkeypatch, metal):
    """mlx on a GPU (simulated: Metal on a Mac, mlx[cuda] on Linux x86-64): the matmuls are the GPU's kernels, so
    the records name no BLAS, no library is probed or interposed, and a named --blas is said to be ignored
    (before: "reference BLAS (bundled with mlx-cpu)" in every record of a CUDA run, and a re-run with OpenBLAS
    interposed that changed nothing)."""
    import mlx.core as mx

    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu))
    monkeypatch.setattr(mx.metal, "is_available", lambda: metal)
    monkeypatch.delenv(blas.REEXEC_MARK, raising=False)
    monkeypatch.setattr(blas, "candidates", lambda choice: pytest.fail("a BLAS was looked for on a GPU"))
    monkeypatch.setattr(blas.os, "execve", lambda *a: pytest.fail("re-executed on a GPU"))
    assert blas.blas_in_use() == f"none: matmuls on the GPU ({'Metal' if metal else 'CUDA'})"
    notes = []
    blas.ensure_fast_blas(["demo"], "auto", log=notes.append)
    assert notes == []
    blas.ensure_fast_blas(["demo"], "wheel", log=notes.append)
    note, = notes
    assert "'wheel' ignored" in note and ("Metal" if metal else "CUDA") in note
