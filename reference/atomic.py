"""Files users own: never written over one of the command's inputs, never left half-written.

Every file the project writes (cache files of both formats, dynamic caches, drafts dumps, token
files) goes through :func:`atomic_write`: the content is written to a temporary file in the target's
directory, flushed and ``fsync``'ed, then renamed over the target (``os.replace``, atomic on POSIX),
so the target holds either its old bytes or the complete new ones. On any exception, including
``KeyboardInterrupt`` (SIGINT) and SIGTERM (turned into ``SystemExit(143)`` while a write is open),
the temporary file is removed and the old file is left untouched; one left by a writer that nothing
could stop (SIGKILL, the OOM killer) is removed by a later complete write of the same file, once
``STALE_S`` old. A set of files that belong together
(``tiny-model``'s model folder, ``benchmarks/corpus.py``'s corpus) goes through :func:`atomic_files`:
written into a temporary folder, then renamed in together with the signals held back (by handlers that
note them, :func:`_signals_held`: a thread's signal mask would not hold a Ctrl-C that the kernel hands to
another thread) and the folder locked against another process renaming its own set in at once. An
existing output this process may not write is refused as ``open(path, "w")`` refuses it, and a write
that fails for want of room names the output.

Signal handlers that raise (SIGTERM's :func:`terminate_handler`, installed here and by the mutation
campaign and the benchmark scripts; Ctrl-C's :func:`interrupt_handler`, installed by ``mlx_backend.cli.main``
while a command runs) raise only where Python passes the exception on: a signal that
lands inside numba (a compiled kernel calling back into Python, an import, a compilation) is put off
and delivered again a moment later (:func:`defer_if_unsafe`), so it unwinds the command like any other.

>>> import tempfile, os
>>> d = tempfile.mkdtemp(); path = os.path.join(d, "out.bin")
>>> with atomic_write(path) as f:
...     _ = f.write(b"complete")
>>> open(path, "rb").read(), os.listdir(d)
(b'complete', ['out.bin'])
>>> with atomic_write(path) as f:
...     _ = f.write(b"half")
...     raise RuntimeError("interrupted mid-write")
Traceback (most recent call last):
...
RuntimeError: interrupted mid-write
>>> open(path, "rb").read(), os.listdir(d)
(b'complete', ['out.bin'])
>>> check_outputs({"-o": path}, inputs=[path])  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
ValueError: -o .../out.bin is the same file as the input .../out.bin: writing it would destroy that input; choose another output path
"""
from __future__ import annotations

import contextlib
import errno
import gc
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO

# Test hook: when set, atomic_write pauses this many seconds after the content is written and before
# the rename, so a test can deliver SIGINT/SIGTERM mid-write deterministically (tests/reference/test_atomic_writes.py).
HOLD_ENV = "NGRAM_SPEC_TEST_HOLD_BEFORE_RENAME"


# How long a signal that landed where raising is unsafe waits before it is delivered again (seconds).
RETRY_S = 0.02

_pending: set[int] = set()  # signals put off by defer_if_unsafe and not yet acted on
_pending_lock = threading.RLock()  # re-entrant: a handler runs in the main thread, maybe inside a locked block


def _unsafe_to_raise(frame) -> bool:
    """Whether an exception raised by a signal handler at ``frame`` (the main thread's innermost Python
    frame, where CPython runs the handler) could be lost or garbled rather than unwind the program:

    * inside numba (``numba.*`` frames anywhere on the stack): a compiled kernel calls back into Python to
      box the arrays of the tuple it returns (``numba.core.serialize._numba_unpickle``); an exception
      raised there is not passed on, and the kernel's caller gets ``SystemError: CPUDispatcher(...)
      returned a result with an exception set`` (a 35-line traceback and exit 1 instead of Ctrl-C's exit
      130; a signal that arrives while a kernel runs is handled right there, when it returns). numba's
      own import and compilation run third-party code that can swallow it (precompile.py);
    * inside a ``__del__`` or a garbage collector's callback (``gc.callbacks``: hypothesis times its
      collections with one): the exception is printed as "Exception ignored" and dropped, and the command
      ran on to its end (seen: ``conformance`` interrupted at 3 s reported PASSED, exit 0).
    """
    gc_callbacks = {getattr(callback, "__code__", None) for callback in gc.callbacks}
    while frame is not None:
        if (frame.f_code.co_name == "__del__" or frame.f_code in gc_callbacks
                or (frame.f_globals.get("__name__") or "").startswith("numba")):
            return True
        frame = frame.f_back
    return False


def _deliver_again(signum: int) -> None:
    with _pending_lock, contextlib.suppress(Exception):  # the process may be exiting
        if signum in _pending:
            signal.pthread_kill(threading.main_thread().ident, signum)


def defer_if_unsafe(signum: int, frame) -> bool:
    """For a signal handler that raises: ``True`` when it must not raise at ``frame`` now
    (:func:`_unsafe_to_raise`); the signal is then sent to the main thread again in ``RETRY_S``
    seconds, and so on until it lands on Python code where the handler can raise (at the latest when
    the kernel or the compilation returns). ``False``: raise now."""
    with _pending_lock:
        if not _unsafe_to_raise(frame):
            _pending.discard(signum)
            return False
        _pending.add(signum)
    timer = threading.Timer(RETRY_S, _deliver_again, (signum,))
    timer.daemon = True
    timer.start()
    return True


def take_pending() -> set[int]:
    """The signals put off by :func:`defer_if_unsafe` that no handler has acted on yet (none are sent
    again after this call): a command that returns with one pending was interrupted at its very end."""
    with _pending_lock:
        taken = set(_pending)
        _pending.clear()
    return taken


def interrupt_handler(signum, frame):
    """Python's default SIGINT handler (raise ``KeyboardInterrupt``), raising only where that is safe
    (:func:`defer_if_unsafe`). ``mlx_backend.cli.main`` installs it while a command runs."""
    if defer_if_unsafe(signum, frame):
        return
    raise KeyboardInterrupt


@contextlib.contextmanager
def interrupts_at_safe_points() -> Iterator[None]:
    """While the block runs, Ctrl-C raises ``KeyboardInterrupt`` as by default, but never inside numba's
    callbacks (:func:`interrupt_handler`); a signal still put off when the block ends is raised then
    (``KeyboardInterrupt``, or ``SystemExit(143)`` for SIGTERM) unless the block raised. The handler is
    installed only where SIGINT has Python's default one (not where it is ignored, as in a background
    job or under nohup) and in the main thread."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    signal.signal(signal.SIGINT, interrupt_handler)
    try:
        yield
    finally:
        try:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        except KeyboardInterrupt:  # signal.signal first runs a pending handler, which raised: not replaced yet
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise
        finally:
            late = take_pending()  # nothing is put off after the restore: none is sent again after this
    if late:
        raise KeyboardInterrupt if signal.SIGINT in late else SystemExit(128 + min(late))


def terminate_handler(signum, frame):
    """SIGTERM raises ``SystemExit(143)``, which unwinds through every ``finally`` and runs ``atexit``
    (temporaries are removed) where the default action would kill the process outright; raised only where
    that is safe (:func:`defer_if_unsafe`)."""
    if defer_if_unsafe(signum, frame):
        return
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """While the block runs, SIGTERM raises ``SystemExit(143)`` instead of killing the process outright
    (only the main thread can install a handler; elsewhere the default stays). A handler the program
    installed itself (``ngram-spec serve``'s, which ignores a second SIGTERM while it saves) is left in place:
    only the default action, which would kill the process mid-write, is replaced."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL):
        yield
        return
    previous = signal.signal(signal.SIGTERM, terminate_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "wb", **open_kwargs) -> Iterator[IO]:
    """Open a temporary file next to ``path`` for writing (``mode`` ``"wb"`` or ``"w"``); when the block
    ends normally it is fsync'ed and renamed over ``path``; on any exception it is removed.
    A ``path`` that exists and is not a regular file (``/dev/stdout``, a named pipe) is written directly.
    An existing file this process may not write (read-only) is refused, as ``open(path, "w")`` refuses it
    (the rename alone needs only the folder's permission). An error while writing that names no file (a
    full disk: numpy's ``tofile`` says "Not enough free space", a flush ``[Errno 28]``) is raised naming
    ``path``, as are a failed rename's (not the temporary's name, which is gone by then)."""
    if mode not in ("wb", "w"):
        raise ValueError(f"atomic_write writes whole files: mode 'wb' or 'w', not {mode!r}")
    if os.path.isdir(path):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
    if os.path.exists(path) and not os.path.isfile(path):  # /dev/stdout, a pipe: a stream, not a file to replace
        with open(path, mode, **open_kwargs) as f:
            yield f
        return
    given, path = path, Path(os.path.realpath(path))  # through a symbolic link, like open(path, "w")
    _check_writable(path, given)
    with sigterm_unwinds():
        tmp = None
        try:
            with _signals_held():   # a Ctrl-C right after mkstemp returns is raised once ``tmp`` is set
                try:
                    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=_tmp_prefix(path), suffix=".tmp")
                except OSError as exc:  # a missing or read-only folder: name the file the user gave
                    raise type(exc)(exc.errno, exc.strerror, str(given)) from None
            try:
                os.chmod(tmp, _file_mode(path))
                with os.fdopen(fd, mode, **open_kwargs) as f:
                    yield f
                    f.flush()
                    os.fsync(f.fileno())
            except OSError as exc:
                if exc.filename is not None or exc.errno not in (None, *WRITE_ERRNOS):
                    raise
                raise _write_error(exc, path, given) from exc
            hold = os.environ.get(HOLD_ENV)
            if hold:
                time.sleep(float(hold))
            try:
                os.replace(tmp, path)
            except OSError as exc:  # an immutable file (chattr +i), a folder made read-only meanwhile
                raise type(exc)(exc.errno, exc.strerror, str(given)) from None
            _remove_stale_temporaries(path)
        finally:
            if tmp is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)


# A temporary whose writer is gone is removed only once it is this old (seconds): a writer in another PID
# namespace (a container sharing the folder) may look gone while it still writes.
STALE_S = 600.0


def _tmp_prefix(path: Path) -> str:
    """``.NAME.PID.``: the temporaries of ``path`` name their writer's process."""
    return f".{path.name}.{os.getpid()}."


def _remove_stale_temporaries(path: Path) -> None:
    """Remove the temporaries of ``path`` left by writers that no signal could stop (SIGKILL, the OOM
    killer, a power cut): those whose process no longer exists and that have not changed for ``STALE_S``
    seconds. Called after each complete write of ``path``; a temporary of a live writer, of another
    user's process, or of a name this module did not make is left alone."""
    prefix = f".{path.name}."
    now = time.time()
    with contextlib.suppress(OSError):                          # an unreadable folder: nothing to tidy
        for entry in os.scandir(path.parent):
            if not (entry.name.startswith(prefix) and entry.name.endswith(".tmp")):
                continue
            pid_random = entry.name[len(prefix):-len(".tmp")].split(".")   # mkstemp's random part has no dots
            if len(pid_random) != 2 or not pid_random[0].isdigit() or not entry.is_file(follow_symlinks=False):
                continue
            try:
                os.kill(int(pid_random[0]), 0)
                continue                                        # its writer runs
            except ProcessLookupError:
                pass
            except (OSError, OverflowError):                    # another user's process; no such pid
                continue
            with contextlib.suppress(OSError):
                if now - entry.stat(follow_symlinks=False).st_mtime >= STALE_S:
                    os.unlink(entry.path)


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM held back while the block runs, then acted on as they would have been (the
    handlers in place before: ``KeyboardInterrupt``, ``SystemExit(143)``, the default action).

    Held by Python-level handlers that only note the signal, not by ``pthread_sigmask``: a mask holds
    back only the calling thread's signals, and a process-directed signal (Ctrl-C, ``kill``) is then
    delivered to any other thread (numba's, mlx's, tokenizers' pools) whose C handler still has the main
    thread raise at its next bytecode. Used where a temporary must be recorded before a handler can raise
    (``mkstemp``'s result) and around the renames of a set of files. Outside the main thread (where no
    handler runs) the block runs as is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    noted: list[int] = []
    before = {}
    try:
        for signum in (signal.SIGINT, signal.SIGTERM):
            if signal.getsignal(signum) is not None:   # None: a handler installed from C, left alone
                before[signum] = signal.signal(signum, lambda signum, frame: noted.append(signum))
        yield
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)
        for signum in dict.fromkeys(noted):   # each once, in the order they came
            signal.raise_signal(signum)   # to this thread: the restored handler acts on it now


# errno values of a write that failed for want of room or of a working disk (not a bug of the caller)
WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.EROFS)


def _write_error(exc: OSError, path: Path, given) -> OSError:
    """``exc`` (no file named) as an ``OSError`` naming ``given``: "out.bin: cannot write it: ...".
    numpy's ``tofile`` loses the errno ("Not enough free space to write N bytes", "N requested and M
    written"): a folder with less room left than a MiB is then said to be full."""
    detail = exc.strerror or str(exc)
    code = exc.errno
    if code is None:
        with contextlib.suppress(OSError):
            if shutil.disk_usage(path.parent).free < 1 << 20:
                code = errno.ENOSPC
                detail = f"{os.strerror(errno.ENOSPC)} ({detail})"
    return OSError(code, f"cannot write it: {detail}; no part of it was kept", str(given))


def _check_writable(path: Path, given) -> None:
    """Refuse an existing file this process may not write (``os.access``: root may write any)."""
    if os.path.isfile(path) and not os.access(path, os.W_OK):
        raise PermissionError(errno.EACCES, "the file is read-only: make it writable (chmod u+w) to replace "
                                            "it, or choose another output path", str(given))


@contextlib.contextmanager
def atomic_files(folder: str | os.PathLike) -> Iterator[Path]:
    """A temporary folder inside ``folder`` (created if needed) to write a set of files into; when the
    block ends normally each is renamed into ``folder`` (over any file of the same name, other files left
    alone) with SIGINT and SIGTERM held back until the last rename, so the folder holds the old set or
    the new one, never a mix; on any exception the temporary folder is removed (and ``folder`` too when
    this call created it and it is empty). The renames run under an exclusive lock on ``folder``
    (``flock``), so two processes writing sets into one folder at once leave one set or the other, never
    one's config beside the other's weights. A read-only file of the set is refused, as by :func:`atomic_write`."""
    if not os.fspath(folder):
        raise ValueError("the output folder is empty; give a folder path")
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(folder))
    with sigterm_unwinds():
        created = not folder.exists()
        folder.mkdir(parents=True, exist_ok=True)
        tmp = None
        try:
            with _signals_held():   # as in atomic_write: the folder is recorded before a signal can raise
                tmp = Path(tempfile.mkdtemp(dir=folder, prefix=".ngram-spec.", suffix=".tmp"))
            yield tmp
            hold = os.environ.get(HOLD_ENV)   # the tests' pause, as in atomic_write
            if hold:
                time.sleep(float(hold))
            files = sorted(tmp.iterdir())
            for f in files:
                _check_writable(folder / f.name, folder / f.name)
            with locked_folder(folder), _signals_held():
                for f in files:
                    os.chmod(f, _file_mode(folder / f.name))   # the old file's mode, else the umask's
                    os.replace(f, folder / f.name)
            tmp_done, tmp = tmp, None
            shutil.rmtree(tmp_done, ignore_errors=True)
        finally:
            if tmp is not None:   # failed or interrupted: nothing of the new set is left
                shutil.rmtree(tmp, ignore_errors=True)
                if created:
                    with contextlib.suppress(OSError):
                        folder.rmdir()   # only if empty


@contextlib.contextmanager
def locked_folder(folder: Path) -> Iterator[None]:
    """An exclusive ``flock`` on the folder itself (no lock file left behind), released at the end; where
    folders cannot be locked (no ``fcntl``, a file system without locks) the block runs unlocked. For a
    read-modify-write of a file in it by several processes (:func:`atomic_files`, the learned step costs)."""
    try:
        import fcntl
        fd = os.open(folder, os.O_RDONLY)
    except (ImportError, OSError):
        yield
        return
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)   # releases the lock


def _file_mode(path: Path) -> int:
    """The permissions the written file gets: the old file's, else what ``open`` would give (umask)."""
    try:
        return path.stat().st_mode & 0o7777
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def _check_folder_writable(flag: str, output, folder: str) -> None:
    """Create and remove a file in ``folder``, as :func:`atomic_write` will create its temporary: a folder this
    process may not write into (permissions, a read-only or immutable mount) is found now, not after the work.
    The probe's name is not a temporary's (``.ngram-spec-probe.PID.*.probe``), so nothing waiting for the
    writer's temporary file mistakes it for one."""
    tmp = None
    try:
        with _signals_held():   # a Ctrl-C right after mkstemp returns is raised once ``tmp`` is set
            fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".ngram-spec-probe.{os.getpid()}.", suffix=".probe")
        os.close(fd)
    except OSError as exc:
        raise ValueError(f"{flag} {output}: cannot create a file in the folder {folder} ({exc.strerror}); make the "
                         "folder writable or choose another output path") from None
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def check_outputs(outputs: dict[str, str | os.PathLike | None], inputs: Iterable[str | os.PathLike | None]) -> None:
    """Refuse an output path (``outputs``: option -> path, ``None`` = not given) that is the same file
    as one of ``inputs`` (``os.path.samefile``: symbolic and hard links included) or as another output,
    and one that cannot be written where it points (empty, a directory, a folder that does not exist or that
    this process may not create a file in):
    checked before any work, so a long run does not end in an error it could have given at the start."""
    given = {flag: path for flag, path in outputs.items() if path is not None}
    for flag, output in given.items():
        if not os.fspath(output):
            raise ValueError(f"{flag} is empty; give a file path")
        if os.path.isdir(output):
            raise ValueError(f"{flag} {output} is a directory; give a file path")
        folder = os.path.dirname(os.path.realpath(output))   # a symbolic link is written where it points
        if not os.path.isdir(folder):
            via = f" (where the link {output} points)" if os.path.islink(output) else ""
            raise ValueError(f"{flag} {output}: the folder {folder}{via} does not exist; create it first (mkdir -p)")
        if os.path.isfile(output) and not os.access(output, os.W_OK):
            raise ValueError(f"{flag} {output}: the file is read-only; make it writable (chmod u+w) to replace it, "
                             "or choose another output path")
        if not os.path.exists(output) or os.path.isfile(output):   # a stream (/dev/stdout) is written directly
            _check_folder_writable(flag, output, folder)
    existing = [path for path in inputs if path is not None and os.path.exists(path)]
    for flag, output in given.items():
        for path in existing:
            if os.path.exists(output) and os.path.samefile(output, path):
                raise ValueError(f"{flag} {output} is the same file as the input {path}: writing it would destroy "
                                 "that input; choose another output path")
    seen: dict[str, str] = {}
    for flag, output in given.items():
        key = os.path.realpath(output)
        if key in seen:
            raise ValueError(f"{seen[key]} and {flag} name the same file {output}; give each output its own path")
        seen[key] = flag
