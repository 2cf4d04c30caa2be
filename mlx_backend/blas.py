"""Which BLAS serves mlx's float matmuls on Linux, and how a command gets an optimized one.

The mlx-cpu wheel links the Netlib reference BLAS it bundles (``mlx_cpu.libs/libblas-*.so``), whose
``sgemm`` costs about S one-row products for S rows: verifying S tokens costs about S steps. An
optimized ``cblas_sgemm`` interposed with ``LD_PRELOAD`` makes S rows cost about one row with
float32 weights, like a bandwidth-bound accelerator (docs/benchmarks.md). The dynamic loader reads
``LD_PRELOAD`` only when a process starts, so :func:`ensure_fast_blas` re-executes the command with
it set. Where the library comes from (``--blas`` / ``$NGRAM_SPEC_BLAS``):

* ``system``: Debian/Ubuntu's ``libopenblas0-pthread`` (:data:`SYSTEM_OPENBLAS`);
* ``wheel``: the PyPI wheel ``cmeel-openblas`` (BSD-3-Clause, 20 MB; the ``mlx`` extra installs it on
  Linux x86-64). Its unprefixed ``libopenblas.so.0`` needs ``libgfortran.so.5``, which a stock
  machine lacks; the mlx-cpu wheel bundles one under a hashed name, so a folder of symbolic links in
  the user's cache directory offers it under the name the loader looks for (``LD_LIBRARY_PATH``);
* ``auto`` (default): ``system`` if installed, else ``wheel``, else the bundled BLAS with a note;
* ``bundled``: mlx's own reference BLAS, no re-execution.

OpenBLAS runs single-threaded there (``OPENBLAS_NUM_THREADS=1`` unless set): one-token steps are too
small to gain from threads and the machine's other cores stay free.
"""
from __future__ import annotations

import importlib.metadata
import os
import platform
import sys
from pathlib import Path

from mlx_backend.user_cache import cache_dir

CHOICES = ("auto", "system", "wheel", "bundled")
ENV_CHOICE = "NGRAM_SPEC_BLAS"
SYSTEM_OPENBLAS = Path("/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0")
WHEEL = "cmeel-openblas"
WHEEL_LIBRARY = "cmeel.prefix/lib/libopenblas.so.0"
GFORTRAN = "libgfortran.so.5"
REEXEC_MARK = "NGRAM_SPEC_BLAS_SET"  # set in the re-executed process: never re-execute twice


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

    A BLAS named in ``LD_PRELOAD`` and actually loaded interposes on the one libmlx links (numpy's
    bundled OpenBLAS uses prefixed symbols and does not); otherwise on Linux it is the reference
    BLAS that the mlx-cpu wheel bundles, on macOS Accelerate.
    """
    if sys.platform == "darwin":
        return "Accelerate"
    for lib in _preloaded_blas():
        if _mapped(lib):
            return f"{lib} via LD_PRELOAD (OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'default')})"
    return "reference BLAS (bundled with mlx-cpu)"


def wheel_openblas() -> Path | None:
    """``libopenblas.so.0`` of the installed ``cmeel-openblas`` wheel, or None."""
    try:
        path = Path(importlib.metadata.distribution(WHEEL).locate_file(WHEEL_LIBRARY))
    except importlib.metadata.PackageNotFoundError:
        return None
    return path if path.is_file() else None


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


def fast_blas_env(choice: str = "auto") -> dict[str, str] | None:
    """The environment variables that interpose an optimized BLAS for ``choice`` (see the module
    docstring), or None where there is nothing to do: not Linux x86-64, ``bundled``, a BLAS is
    already preloaded, or (``auto``) none is installed. ``system`` / ``wheel`` not installed is an
    error that names the fix."""
    if choice not in CHOICES:
        raise ValueError(f"unknown BLAS choice {choice!r}; choose one of {', '.join(CHOICES)}")
    if choice == "bundled" or not sys.platform.startswith("linux") or platform.machine() != "x86_64" \
            or _preloaded_blas():
        return None
    system = SYSTEM_OPENBLAS if SYSTEM_OPENBLAS.is_file() and choice in ("auto", "system") else None
    wheel = wheel_openblas() if choice in ("auto", "wheel") and system is None else None
    if choice == "system" and system is None:
        raise FileNotFoundError(f"{SYSTEM_OPENBLAS} not found; install it with: apt-get install libopenblas0-pthread "
                                "(or use --blas wheel)")
    if choice == "wheel" and wheel is None:
        raise FileNotFoundError(f"the {WHEEL} wheel is not installed; install it with: pip install {WHEEL}")
    if system is None and wheel is None:
        return None
    env = {"LD_PRELOAD": str(system or wheel), "OPENBLAS_NUM_THREADS": os.environ.get("OPENBLAS_NUM_THREADS", "1")}
    if wheel is not None:
        folder = gfortran_folder()
        if folder is None:
            if choice == "wheel":
                raise FileNotFoundError(f"no {GFORTRAN} for the {WHEEL} wheel: mlx-cpu bundles none here, or "
                                        f"{cache_dir()} is not writable (set NGRAM_SPEC_CACHE_DIR)")
            return None
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(folder), os.environ.get("LD_LIBRARY_PATH")) if p)
    return env


def ensure_fast_blas(argv: list[str], choice: str | None = None, *, module: str = "reference", log=None) -> None:
    """Re-execute ``python -m module *argv`` with an optimized BLAS interposed when
    :func:`fast_blas_env` finds one (never returns then); otherwise return, after a note on stderr
    when the bundled reference BLAS stays for lack of a better one. ``choice`` defaults to
    ``$NGRAM_SPEC_BLAS`` or ``auto``. Call it before the model is loaded: the process is replaced."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    choice = choice or os.environ.get(ENV_CHOICE) or "auto"
    if os.environ.get(REEXEC_MARK):
        if choice != "bundled" and blas_in_use().startswith("reference"):
            log(f"[blas] warning: {os.environ.get('LD_PRELOAD')} could not be loaded; running on mlx's bundled "
                "reference BLAS")
        return
    env = fast_blas_env(choice)
    if env is None:
        if choice == "auto" and sys.platform.startswith("linux") and blas_in_use().startswith("reference"):
            log(f"[blas] mlx's bundled reference BLAS: every verified token costs about a full step here; "
                f"pip install {WHEEL} (or apt-get install libopenblas0-pthread) for the fast configuration")
        return
    source = "system OpenBLAS" if env["LD_PRELOAD"] == str(SYSTEM_OPENBLAS) else f"OpenBLAS of the {WHEEL} wheel"
    log(f"[blas] re-running with the {source}: LD_PRELOAD={env['LD_PRELOAD']} "
        f"OPENBLAS_NUM_THREADS={env['OPENBLAS_NUM_THREADS']} (--blas bundled keeps mlx's own BLAS)")
    os.execve(sys.executable, [sys.executable, "-m", module, *argv], {**os.environ, **env, REEXEC_MARK: choice})
