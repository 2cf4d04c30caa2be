"""The ``ngram-spec`` command line.

Each subcommand lives in its own module with a ``register(subparsers)`` function that adds its
parser and sets ``func`` (called with the parsed arguments, returns the exit code).
"""
from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import importlib.metadata
import logging
import os
import signal
import sys
import tomllib
from pathlib import Path

from reference.atomic import interrupts_at_safe_points

# Modules that contribute subcommands, in the order ``--help`` lists them.
COMMAND_MODULES = (
    "mlx_backend.cli.ngram",  # create, stats, merge, inspect
    "mlx_backend.cli.generate",  # generate
    "mlx_backend.cli.tiny_model",  # tiny-model
    "mlx_backend.cli.demo",  # demo
    "mlx_backend.cli.convert",  # convert
    "mlx_backend.cli.serve",  # serve
    "mlx_backend.cli.precompile",  # precompile
    "conformance.cli",  # conformance
)

# Commands of these modules need the optional mlx stack (``pip install 'ngram-spec[mlx]'``).
OPTIONAL_DEPENDENCIES = ("mlx", "mlx_lm")


class UserError(Exception):
    """Bad input from the user: printed as ``ngram-spec: error: ...`` with exit code 2, no traceback."""


def package_version() -> str:
    """The installed ngram-spec's version; run from a source tree that is not installed, pyproject.toml's, said so."""
    try:
        return importlib.metadata.version("ngram-spec")
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        with open(Path(__file__).resolve().parents[2] / "pyproject.toml", "rb") as f:
            return f"{tomllib.load(f)['project']['version']} (source tree, not installed)"
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return "unknown (not installed)"


class _CommandParser(argparse.ArgumentParser):
    """A subcommand's parser: an unknown argument is its error (``ngram-spec inspect: error: unrecognized
    arguments: ...`` under its usage). argparse's own passes a subcommand's unknown arguments up to the top
    parser, which named no command (``ngram-spec: error: ...``) and showed only the top usage."""

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ngram-spec",
        description=(
            "n-gram (prompt-lookup) self-speculative decoding: llama.cpp's n-gram caches as a NumPy "
            "reference, and a fast MLX backend that speeds up mlx-lm generation with no draft model."
        ),
    )
    parser.add_argument("-V", "--version", action="version", version=f"%(prog)s {package_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=_CommandParser)
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name not in OPTIONAL_DEPENDENCIES:
                raise
            _register_unavailable(sub, name, exc.name)
            continue
        module.register(sub)
    return parser


def _register_unavailable(sub, module_name: str, missing: str) -> None:
    """Keep the command line usable without mlx: the mlx commands then explain how to get them."""
    help_text = f"(needs {missing}: pip install 'ngram-spec[mlx]')"
    commands = {"mlx_backend.cli.demo": ["demo"], "mlx_backend.cli.convert": ["convert"],
                "mlx_backend.cli.serve": ["serve"]}.get(module_name, [])
    for command in commands:
        parser = sub.add_parser(command, help=help_text, description=help_text)

        def unavailable(args, missing=missing):
            raise UserError(f"this command needs the {missing} package; install it with: pip install 'ngram-spec[mlx]'")

        parser.set_defaults(func=unavailable)


def _describe(exc: Exception) -> str:
    """One line for the user: an OS error names its file first (``out/x.bin: No such file or directory``)."""
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        return f"{exc.filename}: {exc.strerror}"
    return str(exc)


class _StderrNotes(logging.Handler):
    """Prints each record on the current ``sys.stderr`` (looked up per record, as tests replace it)."""

    def emit(self, record: logging.LogRecord) -> None:
        print(self.format(record), file=sys.stderr, flush=True)


def show_cache_notes(command: str) -> None:
    """Print the cache loaders' notes (logger ``ngram_spec.cache``: a llama.cpp-format file read and kept
    in our format, or its copy mapped) on stderr, one line each, named by ``command``."""
    log = logging.getLogger("ngram_spec.cache")
    handler = next((h for h in log.handlers if isinstance(h, _StderrNotes)), None)
    if handler is None:
        handler = _StderrNotes()
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    handler.setFormatter(logging.Formatter(f"ngram-spec {command}: %(message)s"))


def _stop_in(exc: BaseException) -> BaseException | None:
    """The ``KeyboardInterrupt`` (Ctrl-C) or ``SystemExit`` (SIGTERM, see ``reference.atomic``) that ``exc``
    is or was raised from or during (its ``__cause__``/``__context__`` chain), if any: a compiled kernel
    interrupted in a callback reports ``SystemError: ... returned a result with an exception set`` caused
    by the interrupt."""
    todo, seen = [exc], set()
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            return e
        todo += [e.__cause__, e.__context__]
    return None


def _interrupted(command: str | None) -> int:
    """Ctrl-C: one line on stderr and exit status 130 (128 + SIGINT), in every phase of every command. On a
    terminal that shows both streams the line starts a line of its own, not the end of a streamed text."""
    fresh_line = ""
    with contextlib.suppress(Exception):  # stdout closed
        sys.stdout.flush()
        fresh_line = "\n" if sys.stdout.isatty() and sys.stderr.isatty() else ""
    with contextlib.suppress(Exception):  # stderr closed: the exit status says it
        print(f"{fresh_line}{_prog(command)}: interrupted", file=sys.stderr, flush=True)
    return 128 + int(signal.SIGINT)


def _prog(command: str | None) -> str:
    return f"ngram-spec {command}" if command else "ngram-spec"


def _whole_lines_on_stderr() -> None:
    """A rank of ``mlx.launch`` writes each stderr line in one piece. The launcher relays each rank's output in
    the pieces the rank wrote, and under ``PYTHONUNBUFFERED=1`` (or ``python -u``) a ``print`` writes its text and
    its newline apart: another rank's line could land between them, two error lines then read as one. Line
    buffering (Python's own default for stderr) writes the text and its newline together."""
    if "MLX_RANK" in os.environ and hasattr(sys.stderr, "reconfigure"):
        sys.stderr.reconfigure(line_buffering=True, write_through=False)


def main(argv: list[str] | None = None) -> int:
    command = None
    _whole_lines_on_stderr()
    try:
        with interrupts_at_safe_points():  # Ctrl-C never raises inside numba's callbacks (reference.atomic)
            parser = build_parser()
            args = parser.parse_args(argv)
            command = args.command
            show_cache_notes(command)
            return int(args.func(args) or 0)
    except BaseException as exc:
        stop = _stop_in(exc)
        if isinstance(stop, KeyboardInterrupt):
            return _interrupted(command)
        if isinstance(stop, SystemExit) and stop is not exc:  # SIGTERM garbled by a compiled kernel's callback
            raise SystemExit(stop.code) from None
        if isinstance(exc, (UserError, ValueError, OSError)):  # bad input: one clear line, no traceback
            if isinstance(exc, OSError) and exc.errno == errno.EPIPE:  # `ngram-spec ... | head`: not an error
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
                return 0
            print(f"{_prog(command)}: error: {_describe(exc)}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
