"""``ngram-spec conformance`` and ``python -m conformance``: run the suite, print the report."""
from __future__ import annotations

import argparse
import contextlib
import fnmatch
import json
import os
import sys
import tempfile
import textwrap

from conformance.backend import ENV, PROTOCOL, resolve
from conformance.registry import AREAS, THOROUGH
from reference.atomic import atomic_write, check_outputs

# The checks need hypothesis (``pip install 'ngram-spec[test]'``); it is imported only when they run,
# so that ``ngram-spec`` works without it.

DESCRIPTION = f"""\
Check that a backend implements n-gram speculative decoding correctly: llama.cpp's n-gram counts,
drafting, thresholds and ties, cache files and replay statistics (against llama.cpp's own outputs
and the rules), suffix drafting (against hand-worked cases and the rule), and, for a backend that
generates, exact state rollback, greedy output identical to plain greedy decoding, and an unchanged
sampling distribution.

Your own backend: --backend module.path:object, any object (a module, an instance, a SimpleNamespace)
with some of the protocol members that --list shows and docs/conformance.md defines. The module must
be importable: installed, on PYTHONPATH, or (python -m conformance only) in the current folder.

Each area is reported as passed, failed, skipped, or not applicable (the backend does not provide
what the area needs, or its load_model raises NotImplementedError for every tiny model's architecture).
A failure shows the smallest failing example and the seed that reproduces it.
The exit code is 1 if any check failed; 2 for a usage error (a bad option, a backend that cannot be
loaded, or one that none of the selected checks can run on) and for a run in which no check ran;
0 otherwise.

Areas: {", ".join(AREAS)}.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", metavar="NAME",
                        help=f"reference, mlx, or module.path:object (default: ${ENV}, else mlx where it is installed, else reference)")
    parser.add_argument("--json", metavar="FILE", help="also write the report as JSON to FILE")
    parser.add_argument("--thorough", action="store_true",
                        help=f"{THOROUGH}x more random examples and every golden case (default run: < 3 min)")
    parser.add_argument("--seed", type=int, help="the seed of the random examples (default: a new one, printed)")
    parser.add_argument("--area", action="append", choices=list(AREAS), metavar="AREA",
                        help="run only this area (repeatable); one of " + ", ".join(AREAS))
    parser.add_argument("--check", action="append", metavar="ID",
                        help="run only checks whose id matches (a glob such as 'drafting.*'; repeatable)")
    parser.add_argument("--examples", type=int, metavar="N", help="random examples per property check")
    parser.add_argument("-x", "--exitfirst", action="store_true",
                        help="stop at the first failed check (the checks after it are not run or reported)")
    parser.add_argument("--list", action="store_true", help="list the checks and the backend protocol, run nothing")
    parser.add_argument("-q", "--quiet", action="store_true", help="print only the summary")


def run(args: argparse.Namespace) -> int:
    try:
        import hypothesis  # noqa: F401
    except ImportError:
        raise ValueError("the conformance suite needs hypothesis: pip install 'ngram-spec[test]' "
                         "(or: pip install hypothesis)") from None
    from conformance.checks import all_checks
    from conformance.report import progress_line, summary
    from conformance.runner import PASSED, Options, run_suite

    checks = [c for c in all_checks()
              if (not args.area or c.area in args.area)
              and (not args.check or any(fnmatch.fnmatch(c.id, p) or c.id == p for p in args.check))]
    if args.list:
        return _list(checks)
    if not checks:
        raise ValueError("no check matches --area/--check; see --list")
    if args.examples is not None and args.examples < 1:
        raise ValueError(f"--examples must be >= 1, got {args.examples}")
    check_outputs({"--json": args.json}, inputs=[])   # before the run: not a missing folder after minutes
    backend = resolve(args.backend)
    if all(backend.missing(c.needs) for c in checks):  # a run that checks nothing must not read as passed
        raise ValueError(f"none of the {len(checks)} selected checks can run: each needs a member that backend "
                         f"{backend.name!r} lacks (it provides only {', '.join(backend.provided())}); name the "
                         f"object that holds the protocol members, or select other checks (--list shows what each needs)")
    options = Options(thorough=args.thorough, examples=args.examples, exitfirst=args.exitfirst)
    if args.seed is not None:
        options.seed = args.seed
    print(f"ngram-spec conformance: backend {backend.label()}, "
          f"seed {options.seed}, {'thorough' if args.thorough else 'default'} run, {len(checks)} checks")
    print(f"  provides: {', '.join(backend.provided()) or 'nothing'}")
    live = sys.stdout.isatty() and not args.quiet
    area = None

    def starting(check):
        nonlocal area
        if not args.quiet and check.area != area:
            print(f"\n{AREAS[check.area]}")
        area = check.area
        if live:  # the name of the running check, replaced by its result line
            print(f"  ....  {check.id}", end="\r", flush=True)

    def finished(result):
        if not args.quiet:
            print(progress_line(result), flush=True)

    with _hypothesis_files_elsewhere(), _no_converted_copies():
        report = run_suite(backend, checks, options, on_result=finished, on_start=starting)
    rerun = (f"python -m conformance --backend {backend.name}" + (" --thorough" if args.thorough else "")
             + (f" --examples {args.examples}" if args.examples else ""))
    print(summary(report, rerun))
    if args.json:
        with atomic_write(args.json, "w") as f:
            json.dump(report.as_dict(), f, indent=2)
            f.write("\n")
    return 1 if report.failed else 0 if any(r.status == PASSED for r in report.results) else 2


@contextlib.contextmanager
def _hypothesis_files_elsewhere():
    """hypothesis's own files (a ``.hypothesis/`` folder of cached constants, even with no example database)
    in a temporary folder, removed after the run, not in the folder the command was run from."""
    import hypothesis.configuration as configuration

    before = getattr(configuration, "__hypothesis_home_directory", None)
    with tempfile.TemporaryDirectory(prefix="ngram-spec-conformance-") as home:
        configuration.set_hypothesis_home_dir(home)
        try:
            yield
        finally:
            configuration.set_hypothesis_home_dir(before)


@contextlib.contextmanager
def _no_converted_copies():
    """No copy in our format of the llama.cpp-format files the checks load (mlx_backend.ngram.converted_copy):
    they are the suite's temporary files, deleted after each check. Before: each run left ~180 copies of
    them in the user's cache folder (``converted/``) and printed a line for each."""
    from unittest import mock

    from mlx_backend.ngram.converted_copy import ENV_OFF

    with mock.patch.dict(os.environ, {ENV_OFF: "1"}):
        yield


def _list(checks) -> int:
    print("Checks (area.name: the rule):")
    for c in checks:
        needs = f"  [needs {', '.join(c.needs)}]" if c.needs else ""
        print(textwrap.fill(f"{c.id}: {c.doc}{needs}", 110, initial_indent="  ", subsequent_indent="      ",
                            break_on_hyphens=False))
    print("\nBackend protocol (docs/conformance.md):")
    for name, what in PROTOCOL.items():
        print(f"  {what}")
    return 0


def register(subparsers) -> None:
    """Add ``ngram-spec conformance``."""
    parser = subparsers.add_parser("conformance", help="run the conformance suite against a backend",
                                   description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.set_defaults(func=run)


def main(argv: list[str] | None = None) -> int:
    """``python -m conformance``."""
    parser = argparse.ArgumentParser(prog="python -m conformance", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except BrokenPipeError:   # `python -m conformance --list | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # no second error when Python flushes
        return 0
    except ValueError as exc:
        print(f"python -m conformance: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
