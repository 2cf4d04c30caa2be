"""Which BLAS serves mlx's float matmuls on Linux, and how a command gets an optimized one safely.

The mlx-cpu wheel links the Netlib reference BLAS it bundles (``mlx_cpu.libs/libblas-*.so``), whose
``sgemm`` costs about S one-row products for S rows: verifying S tokens costs about S steps. An
optimized ``cblas_sgemm`` interposed with ``LD_PRELOAD`` makes S rows cost about one row with
float32 weights, like a bandwidth-bound accelerator (docs/benchmarks.md). The dynamic loader reads
``LD_PRELOAD`` only when a process starts, so :func:`ensure_fast_blas` re-executes the command with
it set. Where the library comes from (``--blas`` / ``$NGRAM_SPEC_BLAS``):

* ``system``: Debian/Ubuntu's ``libopenblas0-pthread`` (:data:`SYSTEM_OPENBLAS`, built with
  ``DYNAMIC_ARCH``: kernels picked for the CPU at load time);
* ``wheel``: the OpenBLAS of the PyPI wheel ``ngsolve-openblas`` (BSD-3-Clause, 13 MB; the ``mlx``
  extra installs it on Linux x86-64), also a ``DYNAMIC_ARCH`` build (Haswell, Zen, SkylakeX,
  Sapphire Rapids kernels, ...). Its unprefixed ``libopenblas`` needs ``libgfortran.so.5``, which a
  stock machine lacks; the mlx-cpu wheel bundles one under a hashed name, so a folder of symbolic
  links in the user's cache directory offers it under the name the loader looks for
  (``LD_LIBRARY_PATH``);
* a path: any library file exporting ``cblas_sgemm`` (MKL's ``libmkl_rt.so``, a BLIS build, ...);
* ``auto`` (default): ``system`` if installed, else ``wheel``, else the bundled BLAS with a note;
* ``bundled``: mlx's own reference BLAS, no re-execution.

**No re-run into an unchecked library.** A single-target build (the ``cmeel-openblas`` wheel is one,
``SKYLAKEX``) dies with SIGILL on a CPU without AVX-512 at the first matmul. So a candidate is first
run in a child process (:data:`PROBE`) that preloads it and multiplies matrices of the shapes a
verify forward uses, through mlx, against float64 products from NumPy (whose own OpenBLAS uses
prefixed symbols, untouched by ``LD_PRELOAD``). The verdict is kept per (CPU model and flags,
library file: path, size, mtime) in ``blas-verdicts.json`` in the user's cache directory; a candidate
that crashed, hung, was not loaded or gave wrong numbers is skipped with one line saying which, why
and what runs instead.

OpenBLAS runs single-threaded there (``OPENBLAS_NUM_THREADS=1`` unless set): one-token steps are too
small to gain from threads and the machine's other cores stay free.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

from mlx_backend.machine.user_cache import cache_dir
from reference.atomic import atomic_write

CHOICES = ("auto", "system", "wheel", "bundled")
HELP = ("Linux x86-64: the optimized BLAS to re-run with (LD_PRELOAD), each checked once on this CPU first. "
        "auto: the system's OpenBLAS if installed, else the ngsolve-openblas "
        "wheel's; system / wheel: require that one; a path: that library file (e.g. MKL's libmkl_rt.so); "
        "bundled: keep mlx's reference BLAS")
ENV_CHOICE = "NGRAM_SPEC_BLAS"
SYSTEM_OPENBLAS = Path("/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0")
WHEEL = "ngsolve-openblas"
GFORTRAN = "libgfortran.so.5"
REEXEC_MARK = "NGRAM_SPEC_BLAS_SET"  # set in the re-executed process: never re-execute twice
CPUINFO = Path("/proc/cpuinfo")
VERDICTS = "blas-verdicts.json"
PROBE_TIMEOUT_S = 120.0
TOLERANCE = 1e-4  # max |mlx - float64| / max |float64| of a product: float32 sums of 576-4096 terms give ~1e-6

# The child that tries a candidate: mlx products of a verify forward's shapes (SmolLM2-135M: hidden 576,
# MLP 1536, vocabulary 49152 split in blocks; 1 to 33 rows; x @ W.T as nn.Linear does, addmm with a
# bias, batched attention scores, odd sizes that take OpenBLAS's small-matrix kernels) against float64.
PROBE = r"""
import json, os, sys
import numpy as np
import mlx.core as mx
lib = os.path.realpath(os.environ["LD_PRELOAD"])
if not any(line.rstrip().endswith(lib) for line in open("/proc/self/maps")):
    print(json.dumps({"loaded": False})); sys.exit(0)
rng = np.random.default_rng(0)
worst = (0.0, "")
def check(name, got, want):
    global worst
    err = float(np.abs(np.array(got, dtype=np.float64) - want).max() / np.abs(want).max())
    if np.isnan(err) or err > worst[0]:  # a NaN is the worst, for good
        worst = (float("inf") if np.isnan(err) else err, name)
for m in (1, 2, 9, 33):
    for k, n in ((576, 1536), (1536, 576), (576, 4096)):
        x = rng.standard_normal((m, k), dtype=np.float32); w = rng.standard_normal((n, k), dtype=np.float32)
        check(f"{m}x{k} @ ({n}x{k}).T", mx.array(x) @ mx.array(w).T, x.astype(np.float64) @ w.T.astype(np.float64))
        b = rng.standard_normal((n,), dtype=np.float32)
        check(f"{m}x{k} @ ({n}x{k}).T + bias", mx.addmm(mx.array(b), mx.array(x), mx.array(w).T),
              b + x.astype(np.float64) @ w.T.astype(np.float64))
q = rng.standard_normal((1, 9, 9, 64), dtype=np.float32); kt = rng.standard_normal((1, 9, 64, 200), dtype=np.float32)
check("9 heads: 9x64 @ 64x200", mx.array(q) @ mx.array(kt), q.astype(np.float64) @ kt.astype(np.float64))
for m, k, n in ((3, 5, 7), (17, 33, 45), (2, 64, 3)):
    a = rng.standard_normal((m, k), dtype=np.float32); c = rng.standard_normal((k, n), dtype=np.float32)
    check(f"{m}x{k} @ {k}x{n}", mx.array(a) @ mx.array(c), a.astype(np.float64) @ c.astype(np.float64))
print(json.dumps({"loaded": True, "error": worst[0], "worst": worst[1]}))
"""


def _is_choice(text: str) -> bool:
    """One of :data:`CHOICES`, or the path of an existing library file."""
    return text in CHOICES or Path(text).is_file()


def parse_choice(text: str) -> str:
    """``--blas``'s type (:func:`_is_choice`)."""
    if _is_choice(text):
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is neither one of {', '.join(CHOICES)} nor an existing library file")


def add_option(parser: argparse.ArgumentParser) -> None:
    """The ``--blas`` option of ``generate``, ``demo`` and ``serve``."""
    parser.add_argument("--blas", type=parse_choice, default=None, metavar="{auto,system,wheel,bundled,PATH}",
                        help=HELP + " (default: $NGRAM_SPEC_BLAS or auto)")


def _preloaded_blas() -> list[str]:
    """The BLAS libraries named in ``LD_PRELOAD`` (OpenBLAS, BLIS, MKL, any ``*blas*``)."""
    return [p for p in os.environ.get("LD_PRELOAD", "").replace(":", " ").split()
            if any(name in Path(p).name.lower() for name in ("blas", "blis", "mkl"))]


def _mapped(path: str) -> bool:
    """Whether the library file ``path`` is mapped into this process (``/proc/self/maps``; True where
    that file does not exist)."""
    maps = Path("/proc/self/maps")
    if not maps.exists():
        return True
    return os.path.realpath(path) in maps.read_text()


def blas_in_use() -> str:
    """The BLAS that serves mlx's matmuls in this process.

    On a GPU (Metal, CUDA) no BLAS does: the matmuls are the GPU's kernels. On the CPU, a BLAS named in
    ``LD_PRELOAD`` and actually loaded interposes on the one libmlx links (numpy's bundled OpenBLAS uses
    prefixed symbols and does not); otherwise on Linux it is the reference BLAS that the mlx-cpu wheel
    bundles, on macOS Accelerate.
    """
    import mlx.core as mx
    if mx.default_device() == mx.gpu:
        return f"none: matmuls on the GPU ({'Metal' if mx.metal.is_available() else 'CUDA'})"
    if sys.platform == "darwin":
        return "Accelerate"
    for lib in _preloaded_blas():
        if _mapped(lib):
            return f"{lib} via LD_PRELOAD (OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'default')})"
    return "reference BLAS (bundled with mlx-cpu)"


def wheel_openblas() -> Path | None:
    """The ``libopenblas*.so*`` of the installed ``ngsolve-openblas`` wheel, or None."""
    try:
        dist = importlib.metadata.distribution(WHEEL)
    except importlib.metadata.PackageNotFoundError:
        return None
    libs = sorted(Path(dist.locate_file(f)) for f in dist.files or []
                  if f.parent.name == "ngsolve_openblas" and f.name.startswith("libopenblas") and ".so" in f.name)
    return next((lib for lib in libs if lib.is_file()), None)


def gfortran_folder() -> Path | None:
    """A folder in the user's cache directory where ``libgfortran.so.5`` (and the libraries it
    links by their hashed names) are symbolic links to the copies bundled with the mlx-cpu wheel;
    None when that wheel bundles none or the folder cannot be written. Links are made once,
    atomically (link then rename)."""
    try:
        files = importlib.metadata.distribution("mlx-cpu").files or []
    except importlib.metadata.PackageNotFoundError:
        return None
    libs = [Path(importlib.metadata.distribution("mlx-cpu").locate_file(f)) for f in files
            if str(f).startswith("mlx_cpu.libs/")]
    gfortran = next((lib for lib in libs if lib.name.startswith("libgfortran")), None)
    if gfortran is None:
        return None
    folder = cache_dir() / "blas-libs"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for name, target in [(GFORTRAN, gfortran), *((lib.name, lib) for lib in libs)]:
            link = folder / name
            if link.is_symlink() and os.readlink(link) == str(target):
                continue
            tmp = folder / f".{name}.{os.getpid()}.tmp"
            tmp.unlink(missing_ok=True)
            os.symlink(target, tmp)
            os.replace(tmp, link)
    except OSError:   # a read-only cache directory: the wheel's library cannot be loaded
        return None
    return folder


# --- the check of a candidate on this CPU ---------------------------------------------------------

def cpu_identity(cpuinfo: Path | None = None) -> dict:
    """This CPU as the verdicts are keyed: ``model`` name and sorted ``flags`` of the first processor
    in ``cpuinfo`` (default :data:`CPUINFO`; Linux's ``/proc/cpuinfo`` format), else :func:`platform.processor`."""
    fields = {}
    try:
        for line in Path(cpuinfo or CPUINFO).read_text().splitlines():
            if not line.strip():
                break                                  # the end of the first processor's block
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
    except OSError:
        pass
    return {"model": fields.get("model name") or platform.processor() or platform.machine(),
            "flags": sorted(fields.get("flags", "").split())}


def _simd(cpu: dict) -> str:
    """The vector extensions that decide which kernels run, as one phrase: ``avx2 fma, no avx512f``."""
    have = [f for f in ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "amx_tile") if f in cpu["flags"]]
    return " ".join(have) + ("" if "avx512f" in have else (", " if have else "") + "no avx512f")


def _verdict_key(cpu: dict, library: str) -> str:
    """One key per (CPU model and flags, library file: real path, size, mtime)."""
    path = os.path.realpath(library)
    st = os.stat(path)
    ident = json.dumps([cpu["model"], cpu["flags"], path, st.st_size, st.st_mtime_ns])
    return hashlib.sha256(ident.encode()).hexdigest()[:32]


def probe(env: dict[str, str], timeout: float = PROBE_TIMEOUT_S) -> tuple[bool, str]:
    """Run :data:`PROBE` with ``env`` (``LD_PRELOAD`` naming the candidate) added to this environment:
    ``(True, "")`` when mlx's products through it equal float64 ones to :data:`TOLERANCE`, else
    ``(False, why)``: killed by which signal, hung, exited with an error, not loaded, wrong results. A
    child ended by SIGINT or SIGTERM was stopped with the command (Ctrl-C reaches the whole process
    group), not by the library: that is raised here, and no verdict is kept."""
    child_env = {k: v for k, v in os.environ.items() if k != REEXEC_MARK}
    child_env.update(env)
    try:
        out = subprocess.run([sys.executable, "-c", PROBE], env=child_env, capture_output=True, text=True,
                             timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return False, f"its check did not finish in {timeout:.0f} s"
    if -out.returncode in (signal.SIGINT, signal.SIGTERM):   # the user stopped the command: no verdict
        raise KeyboardInterrupt if -out.returncode == signal.SIGINT else SystemExit(128 + signal.SIGTERM)
    if out.returncode < 0:
        return False, f"killed by {signal.Signals(-out.returncode).name} in a matmul"
    last = (out.stdout.strip().splitlines() or [""])[-1]
    try:
        result = json.loads(last)
    except ValueError:
        error = next((line for line in reversed(out.stderr.splitlines()) if line.strip()), "no output")
        return False, f"its check exited with code {out.returncode}: {error.strip()}"
    if not result["loaded"]:
        loader = next((line for line in out.stderr.splitlines() if "LD_PRELOAD" in line or "ld.so" in line), "")
        return False, "the dynamic loader did not load it" + (f" ({loader.strip()})" if loader else "")
    if not result["error"] <= TOLERANCE:
        return False, f"wrong results (relative error {result['error']:.1e} on {result['worst']})"
    return True, ""


def checked(env: dict[str, str], cpuinfo: Path | None = None) -> tuple[bool, str, bool]:
    """The verdict on the library ``env["LD_PRELOAD"]`` for this CPU: ``(ok, why, cached)``, from
    ``blas-verdicts.json`` when this (CPU, library file) was checked before, else :func:`probe`
    once and recorded (atomically; a read-only cache directory just checks again next time)."""
    cpu = cpu_identity(cpuinfo)
    library = env["LD_PRELOAD"]
    key = _verdict_key(cpu, library)
    path = cache_dir() / VERDICTS
    try:
        verdicts = json.loads(path.read_text())
    except (OSError, ValueError):
        verdicts = {}
    if isinstance(verdicts.get(key), dict) and "ok" in verdicts[key]:
        return bool(verdicts[key]["ok"]), str(verdicts[key].get("why", "")), True
    ok, why = probe(env)
    verdicts[key] = {"ok": ok, "why": why, "library": os.path.realpath(library), "cpu": cpu["model"],
                     "simd": _simd(cpu), "checked": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_write(path, "w") as f:
            json.dump(verdicts, f, indent=1)
    except OSError:
        pass
    return ok, why, False


# --- choosing and re-running ----------------------------------------------------------------------

def candidates(choice: str = "auto") -> list[tuple[str, dict[str, str]]]:
    """The libraries ``choice`` allows, best first, each as (what it is, the environment that
    interposes it): none where there is nothing to do (not Linux x86-64, ``bundled``, a BLAS already
    preloaded by hand, or ``auto`` with none installed). A named one that is not installed is an
    error that names the fix."""
    if not _is_choice(choice):
        raise ValueError(f"unknown BLAS choice {choice!r}; choose one of {', '.join(CHOICES)} or a library file")
    if choice == "bundled" or not sys.platform.startswith("linux") or platform.machine() != "x86_64" \
            or _preloaded_blas():
        return []
    if choice not in CHOICES:
        # absolute: the loader takes a bare LD_PRELOAD name for a library to search for, not a file here
        return [("library given by --blas / $NGRAM_SPEC_BLAS", _env(Path(choice).resolve(), gfortran_folder()))]
    found = []
    if choice in ("auto", "system"):
        if SYSTEM_OPENBLAS.is_file():
            found.append(("system OpenBLAS", _env(SYSTEM_OPENBLAS)))
        elif choice == "system":
            raise FileNotFoundError(f"{SYSTEM_OPENBLAS} not found; install it with: apt-get install "
                                    "libopenblas0-pthread (or use --blas wheel)")
    if choice in ("auto", "wheel"):
        wheel = wheel_openblas()
        if wheel is None and choice == "wheel":
            raise FileNotFoundError(f"the {WHEEL} wheel is not installed; install it with: pip install {WHEEL}")
        folder = gfortran_folder() if wheel is not None else None
        if folder is not None:
            found.append((f"OpenBLAS of the {WHEEL} wheel", _env(wheel, folder)))
        elif wheel is not None and choice == "wheel":
            raise FileNotFoundError(f"no {GFORTRAN} for the {WHEEL} wheel: mlx-cpu bundles none here, or "
                                    f"{cache_dir()} is not writable (set NGRAM_SPEC_CACHE_DIR)")
    return found


def _env(library: Path, gfortran: Path | None = None) -> dict[str, str]:
    """The variables that preload ``library`` single-threaded; with ``gfortran`` (:func:`gfortran_folder`),
    also that folder, which offers mlx-cpu's ``libgfortran.so.5``, on the loader's path."""
    env = {"LD_PRELOAD": str(library), "OPENBLAS_NUM_THREADS": os.environ.get("OPENBLAS_NUM_THREADS", "1")}
    if gfortran is not None:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(gfortran), os.environ.get("LD_LIBRARY_PATH")) if p)
    return env


def first_working(found: list[tuple[str, dict[str, str]]], *, log=None) -> tuple[str, dict[str, str]] | None:
    """The first of ``found`` (:func:`candidates`) that passed its check on this CPU, or None. Each
    one that failed is one line on ``log``: which library, why, the CPU, and what comes instead."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    for i, (source, env) in enumerate(found):
        ok, why, _ = checked(env)
        if ok:
            return source, env
        cpu = cpu_identity()
        instead = f"trying the {found[i + 1][0]}" if i + 1 < len(found) else "running on mlx's bundled reference BLAS"
        log(f"[blas] skipping {env['LD_PRELOAD']} ({source}): {why}, on this CPU ({cpu['model']}; {_simd(cpu)}); "
            f"{instead}")
    return None


def ensure_fast_blas(argv: list[str], choice: str | None = None, *, log=None) -> None:
    """Re-execute ``python -m mlx_backend.cli *argv`` with an optimized BLAS interposed when
    :func:`candidates` offers one that works on this CPU (never returns then); otherwise return,
    after a note on stderr naming what to do when the bundled reference BLAS stays. ``choice``
    defaults to ``$NGRAM_SPEC_BLAS`` (refused, naming the variable, when it is not a choice) or ``auto``.
    Call it before the model is loaded: the process is replaced."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    if not choice and os.environ.get(ENV_CHOICE) and not _is_choice(os.environ[ENV_CHOICE]):
        raise ValueError(f"${ENV_CHOICE} is {os.environ[ENV_CHOICE]!r}, neither one of {', '.join(CHOICES)} nor an "
                         "existing library file; set it to one, or unset it for auto")
    choice = choice or os.environ.get(ENV_CHOICE) or "auto"
    if os.environ.get(REEXEC_MARK):
        if choice != "bundled" and blas_in_use().startswith("reference"):
            log(f"[blas] warning: {os.environ.get('LD_PRELOAD')} could not be loaded; running on mlx's bundled "
                "reference BLAS")
        return
    in_use = blas_in_use()
    if in_use.startswith("none"):   # mlx[cuda] on Linux x86-64: the matmuls are not a BLAS's to speed up
        if choice not in ("auto", "bundled"):
            log(f"[blas] --blas / ${ENV_CHOICE} {choice!r} ignored: {in_use[len('none: '):]}")
        return
    found = candidates(choice)
    if not found:
        # off Linux x86-64 nothing is interposed: say so, rather than name an install that would change nothing
        # (ngsolve-openblas has no wheel but Linux x86-64 and Windows; SYSTEM_OPENBLAS is x86-64's path)
        x86_linux = sys.platform.startswith("linux") and platform.machine() == "x86_64"
        where = f"{'macOS' if sys.platform == 'darwin' else sys.platform} {platform.machine()}"
        if not x86_linux and choice not in ("auto", "bundled"):
            log(f"[blas] --blas / ${ENV_CHOICE} {choice!r} ignored on {where}: an optimized BLAS is "
                "interposed on Linux x86-64 only")
        elif choice == "auto" and sys.platform.startswith("linux") and in_use.startswith("reference"):
            fix = (f"an optimized BLAS is interposed on Linux x86-64 only, not on {where}" if not x86_linux else
                   f"no {GFORTRAN} for the {WHEEL} wheel that is installed: mlx-cpu bundles none here, or "
                   f"{cache_dir()} is not a writable folder (set NGRAM_SPEC_CACHE_DIR to one)"
                   if wheel_openblas() is not None else
                   f"pip install {WHEEL} (or apt-get install libopenblas0-pthread) for the fast configuration")
            log(f"[blas] mlx's bundled reference BLAS: every verified token costs about a full step here; {fix}")
        return
    chosen = first_working(found, log=log)
    if chosen is None:
        return
    source, env = chosen
    log(f"[blas] re-running with the {source}: LD_PRELOAD={env['LD_PRELOAD']} "
        f"OPENBLAS_NUM_THREADS={env['OPENBLAS_NUM_THREADS']} (--blas bundled keeps mlx's own BLAS)")
    os.execve(sys.executable, [sys.executable, "-m", "mlx_backend.cli", *argv], {**os.environ, **env, REEXEC_MARK: choice})
