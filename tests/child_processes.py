"""Processes the tests start, never left running: a failed assertion or an exception between a process's
start and its end must not leave it (and its children: a server's, ``mlx.launch``'s ranks) holding a port
and a CPU through the rest of the run. ``from child_processes import running`` (tests/ is on the path, as
for bench_knobs).

* :func:`start` is ``subprocess.Popen`` in a new session: the process leads its own process group, which
  its children join;
* :func:`end` kills that group with SIGKILL (what is still running of it) and reaps the process; a no-op
  after a normal end, so it can always run in a ``finally``;
* :func:`running` is ``with running(argv, ...) as proc:``, :func:`start` then :func:`end` at the block's end;
* :func:`run` is ``subprocess.run``'s, its timeout or an exception ending the whole group (``subprocess.run``
  kills the child alone, leaving its children running).
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator


def start(*args, **kwargs) -> subprocess.Popen:
    """``subprocess.Popen(*args, **kwargs)`` leading a process group of its own (``start_new_session``)."""
    return subprocess.Popen(*args, start_new_session=True, **kwargs)


def end(proc: subprocess.Popen) -> None:
    """Kill ``proc``'s process group (those of its members still running), ``proc`` itself in any case,
    and reap it. Its pipes stay open, for what it wrote to be read after."""
    if proc.returncode is None:   # not reaped: its pid, the group's id, is not anyone else's
        with contextlib.suppress(ProcessLookupError, PermissionError):   # no group: not started by start()
            os.killpg(proc.pid, signal.SIGKILL)
        proc.kill()
    proc.wait()


@contextlib.contextmanager
def running(*args, **kwargs) -> Iterator[subprocess.Popen]:
    """``with running(argv, ...) as proc:`` the process :func:`start` starts, :func:`end`-ed at the end."""
    proc = start(*args, **kwargs)
    try:
        yield proc
    finally:
        end(proc)


def run(*args, timeout: float | None = None, capture_output: bool = False, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(*args, ...)`` without ``check`` or ``input``, whose timeout ends the process's whole group."""
    if capture_output:
        kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    with running(*args, **kwargs) as proc:
        out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
