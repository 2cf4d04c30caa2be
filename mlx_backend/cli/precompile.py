"""``ngram-spec precompile``: compile every numba kernel the commands use, once, after installing.

numba compiles a kernel the first time a process calls it with a new combination of argument types
and keeps the machine code in its cache (:mod:`mlx_backend.machine.numba_cache`: ``$NUMBA_CACHE_DIR``, else ours);
later processes load it in milliseconds. Without this command the first ``stats``, ``create`` or
drafting ``generate`` after an install pays that compilation (about 10 s for ``stats`` on a 2-core
x86-64 VM). Here every such command runs once on tiny inputs in a temporary directory -- the very
code paths, argument types and file formats of real runs (a static cache in both formats, with a
follower list long enough for the reader's batched sort; a dynamic cache; a tiny random model for
``generate``) -- so each kernel lands in the cache; then the suffix drafter (:mod:`mlx_backend.suffix`)
drafts once, with a history, for its kernels. ``tests/mlx_backend/cli/test_precompile.py`` checks that
after it the commands compile nothing.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import signal
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from reference.atomic import defer_if_unsafe, take_pending

# what each command imports (numba, mlx) is imported when the command runs, not when the parser is built


def _inputs(d: Path) -> dict[str, Path]:
    """A token file longer than stats' n_ctx (its tables grow) in which 2-gram (1, 2) has more than
    ``SMALL`` distinct followers (the reader's batched sort), a dynamic cache and a prompt."""
    from mlx_backend.ngram.cache_file import SMALL
    from reference.ngram.cache_file import save_cache
    from reference.ngram.cache import NgramCache

    rng = np.random.default_rng(0)
    text = np.concatenate([np.array([1, 2, 3 + k], np.int32) for k in range(SMALL + 8)]
                          + [rng.integers(0, 2000, 10_000).astype(np.int32)])
    paths = {"tokens": d / "tokens.i32", "prompt": d / "prompt.i32", "dynamic": d / "dyn.bin"}
    text.astype("<i4").tofile(paths["tokens"])
    np.tile(np.arange(5, 25, dtype=np.int32), 6).astype("<i4").tofile(paths["prompt"])
    c_dy = NgramCache()  # a dynamic cache as generate --dynamic leaves it: n-grams of sizes 1..4
    c_dy.update(text[:500].tolist(), 500, 1, 4)
    save_cache(c_dy, paths["dynamic"])
    return paths


def commands(d: Path, with_model: bool = True) -> list[list[str]]:
    """The command lines run, in order, on the tiny inputs written to ``d``."""
    f = {k: str(v) for k, v in _inputs(d).items()}
    out = {name: str(d / name) for name in ("st.bin", "st.ngc", "merged.bin", "conv.ngc", "model", "drafts.i32",
                                           "new-dyn.bin")}
    runs = [
        ["create", f["tokens"], "-o", out["st.bin"]],
        ["create", f["tokens"], "-o", out["st.ngc"], "--format", "ours"],
        ["stats", f["tokens"], "--json"],
        ["stats", f["tokens"], "--static", out["st.bin"], "--json", "--drafts-out", out["drafts.i32"]],
        ["stats", f["tokens"], "--static", out["st.ngc"], "--dynamic", f["dynamic"], "--json"],
        ["merge", out["st.bin"], out["st.ngc"], "-o", out["merged.bin"]],
        ["inspect", out["merged.bin"]],
        ["convert", out["st.bin"], "-o", out["conv.ngc"], "--to", "ours"],
    ]
    if with_model:
        runs += [["tiny-model", "--arch", "llama", "--out", out["model"]]]
        runs += [["generate", "--model", out["model"], "--prompt-tokens", f["prompt"], "--max-tokens", "80",
                  "--json"] + extra for extra in ([], ["--static", out["st.ngc"]], ["--dynamic", f["dynamic"]],
                                                  ["--static", out["st.bin"], "--dynamic", out["new-dyn.bin"]])]
    return runs


def compile_suffix_kernels() -> None:
    """Index a history and a sequence and draft from both: every kernel of :mod:`mlx_backend.suffix.index`
    with the argument types drafting uses (they do not depend on the inputs)."""
    from mlx_backend.suffix.drafter import SuffixDrafter, SuffixHistory

    history = SuffixHistory(max_tokens=64)
    for seq in ([1, 2, 3, 4, 5], list(range(60)), [7, 8, 9, 1, 2]):   # the last one drops the first
        history.add(seq)
    drafter = SuffixDrafter(history)
    drafter.reset(np.array([5, 6, 7, 8, 9], np.int32))
    drafter.draft(8)
    drafter.extend([1, 2])
    drafter.draft(8)


def _stop(signum: int) -> BaseException:
    return KeyboardInterrupt() if signum == signal.SIGINT else SystemExit(128 + signum)


@contextlib.contextmanager
def _stops_remembered() -> Iterator[Callable[[], None]]:
    """While the block runs, Ctrl-C raises ``KeyboardInterrupt`` and SIGTERM ``SystemExit(143)`` (it would
    kill the process outright and leave the temporary directory), and each signal is also remembered:
    one that lands inside a third-party import can be swallowed there (seen on Linux: Ctrl-C during
    numba's import of scipy, the command then ran to completion), so the caller calls the function
    yielded after each command, which raises it again. The handler raises only the first time: a signal
    after that (delivered again after landing inside numba, or a second Ctrl-C) is only remembered, so
    it cannot cut the temporary directory's removal short. Only the main thread can install handlers; elsewhere
    nothing changes."""
    seen: list[int] = []
    stopping: list[int] = []

    def stop_if_signalled() -> None:   # also after a command that swallowed the stop raised in it
        if seen:
            stopping.append(seen[0])
            raise _stop(seen[0])

    if threading.current_thread() is not threading.main_thread():
        yield stop_if_signalled
        return

    def on_signal(signum, frame):
        seen.append(signum)
        if stopping or defer_if_unsafe(signum, frame):  # inside numba (importing, compiling, a kernel's callback)
            return
        stopping.append(signum)
        raise _stop(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)
                if signal.getsignal(s) is not signal.SIG_IGN}  # an ignored signal (nohup, cron) stays ignored
    try:
        yield stop_if_signalled
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        take_pending()  # a signal put off inside numba is not delivered again: it stopped precompile already


def precompile(progress: bool | None = None, with_model: bool = True) -> int:
    """Run :func:`commands` in a temporary directory (user cache directory there too, so nothing of the
    user's is read or written) on the mlx backend whatever ``$NGRAM_SPEC_BACKEND`` says (its kernels are
    the ones to compile), then :func:`compile_suffix_kernels`; output is discarded. Returns the
    number of commands run. Ctrl-C and SIGTERM stop it with the temporary directory removed."""
    from unittest import mock

    from tqdm import tqdm

    from mlx_backend.ngram.converted_copy import ENV_OFF
    from mlx_backend.cli import UserError, build_parser

    parser = build_parser()
    with _stops_remembered() as stop_if_signalled, tempfile.TemporaryDirectory(prefix="ngram-spec-precompile-") as tmp, \
            mock.patch.dict(os.environ, {"NGRAM_SPEC_CACHE_DIR": str(Path(tmp) / "user-cache"), ENV_OFF: "1",
                                         "NGRAM_SPEC_BACKEND": "mlx"}):
        runs = commands(Path(tmp), with_model)
        for argv in tqdm(runs, desc="compile kernels", unit="command",
                         disable=None if progress is None else not progress):
            sink, args = io.StringIO(), parser.parse_args(argv)
            try:  # the command itself, not main(): Ctrl-C and SIGTERM reach the caller as they are
                with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
                    code = args.func(args)
            except (UserError, ValueError, OSError) as exc:
                raise UserError(f"`ngram-spec {' '.join(argv)}` failed: {exc} {sink.getvalue()[-2000:]}") from exc
            if code:
                raise UserError(f"`ngram-spec {' '.join(argv)}` exited with {code}: {sink.getvalue()[-2000:]}")
            stop_if_signalled()
        compile_suffix_kernels()
        stop_if_signalled()
    return len(runs)


def run_precompile(args: argparse.Namespace) -> int:
    import importlib.util
    import time

    from mlx_backend.cli import UserError

    missing = [m for m in ("numba",) + (() if args.no_model else ("mlx_lm",)) if importlib.util.find_spec(m) is None]
    if missing:
        raise UserError(f"precompile compiles the mlx backend's kernels, which need {', '.join(missing)}: "
                        "pip install 'ngram-spec[mlx]'")
    t = time.perf_counter()
    n = precompile(progress=None if not args.quiet else False, with_model=not args.no_model)
    if not args.quiet:
        print(f"ngram-spec precompile: {n} commands run, kernels cached in {time.perf_counter() - t:.1f} s")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "precompile", formatter_class=argparse.RawDescriptionHelpFormatter,
        help="compile and cache every numba kernel once (run after installing: later first runs start fast)",
        description=(
            "Compile the numba kernels of create, stats, merge, inspect, convert and generate (with --static\n"
            "and --dynamic) by running each once on tiny inputs in a temporary directory, and the suffix\n"
            "drafter's, so that numba's cache holds them. Without it, the first run of each command after\n"
            "installing compiles what it needs (about 10 s for stats on a 2-core machine); after it, about 1 s. The cache:\n"
            "$NUMBA_CACHE_DIR when set, else numba/ in ngram-spec's cache folder ($NGRAM_SPEC_CACHE_DIR, or\n"
            "~/.cache/ngram-spec on Linux); run this again after upgrading ngram-spec or numba, or with\n"
            "another cache folder.\n\n"
            "example: ngram-spec precompile"),
    )
    p.add_argument("--no-model", action="store_true",
                   help="skip generate's kernels (and the import of mlx-lm they need)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar or summary line")
    p.add_argument("--backend", choices=("mlx",), default="mlx",
                   help="mlx only: the reference has no compiled kernels (accepted, like every command's --backend)")
    p.set_defaults(func=run_precompile)
