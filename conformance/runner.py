"""Run the checks against a backend and collect one result per check.

A property check runs under hypothesis with a fixed seed (printed in the report), so a failure is
reproduced by ``--seed``; hypothesis shrinks it to the smallest failing example, which the report
shows (the runner records the drawn arguments itself, not hypothesis's prose). No example database
is written: the seed alone reproduces a run.
"""
from __future__ import annotations

import random
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import hypothesis
from hypothesis import HealthCheck

from conformance.backend import Backend
from conformance.registry import THOROUGH, Check

PASSED, FAILED, SKIPPED, NOT_APPLICABLE = "passed", "failed", "skipped", "not applicable"


class Skip(Exception):
    """Raised by a check that cannot run here (e.g. an optional file is absent): reported as skipped."""


class Unsupported(Exception):
    """A model architecture the backend does not support: its ``load_model`` raised ``NotImplementedError``
    (the protocol's way to say so). A property check draws other examples instead, and the report notes
    what was left out; a check that has no other model to run on is not applicable."""

    def __init__(self, reasons: dict[str, str]):
        super().__init__(unsupported_models(reasons))
        self.reasons = reasons  # architecture -> why


@dataclass
class Options:
    seed: int = field(default_factory=lambda: random.randrange(2**31))
    thorough: bool = False
    examples: int | None = None  # overrides every property check's number of examples
    exitfirst: bool = False      # stop after the first failed check

    def max_examples(self, check: Check) -> int:
        if self.examples is not None:
            return self.examples
        return check.examples * (THOROUGH if self.thorough else 1)


@dataclass
class CheckResult:
    id: str
    area: str
    rule: str
    status: str
    seconds: float = 0.0
    message: str = ""  # why it failed, was skipped or does not apply
    example: str = ""  # the smallest failing example (property checks)
    seed: int | None = None
    notes: list[str] = field(default_factory=list)  # what a passing check accepted (e.g. near-ties)

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v not in ("", None, [])}


_current = Options(seed=0)
_notes: list[str] = []


def current_options() -> Options:
    """The options of the run in progress (checks that choose golden cases read ``thorough``)."""
    return _current


def note(message: str) -> None:
    """Record something a passing check accepted and the report must show (at most 5 kept)."""
    if len(_notes) < 5 and message not in _notes:
        _notes.append(message)


def run_check(check: Check, backend: Backend, options: Options) -> CheckResult:
    """Run one check; never raises (a crash of the backend is a failure of the check)."""
    global _current
    _current = options
    _notes.clear()
    result = CheckResult(check.id, check.area, check.doc, PASSED)
    missing = backend.missing(check.needs)
    if missing:
        result.status = NOT_APPLICABLE
        result.message = f"the backend does not provide {', '.join(missing)}"
        return result
    failing: list[str] = []  # the examples that failed, in the order hypothesis ran them
    t0 = time.perf_counter()
    unsupported: dict[str, str] = {}  # architecture -> why, for the examples left out
    try:
        _call(check, backend.impl, options, failing, unsupported)
    except Skip as exc:
        result.status, result.message = SKIPPED, str(exc)
    except Unsupported as exc:
        result.status, result.message = NOT_APPLICABLE, str(exc)
    except hypothesis.errors.Unsatisfiable:
        if not unsupported:
            raise
        result.status, result.message = NOT_APPLICABLE, str(Unsupported(unsupported))
    except Exception as exc:  # noqa: BLE001 - any exception is the check failing
        result.status = FAILED
        result.message = _describe(exc)
        result.example = failing[-1] if failing else ""
        result.seed = options.seed
    result.seconds = round(time.perf_counter() - t0, 3)
    if result.status == PASSED and unsupported:
        note(f"examples drawn without {unsupported_models(unsupported)}")
    result.notes = list(_notes)
    return result


def unsupported_models(reasons: dict[str, str]) -> str:
    """``{architecture: why}`` in words: "the tiny qwen3_5, qwen3_next models, which the backend does not
    support (load_model raised NotImplementedError: ...)", the first reason given."""
    first = reasons[min(reasons)]
    return (f"the tiny {', '.join(sorted(reasons))} models, which the backend does not support "
            f"({first}{'; ...' if len(set(reasons.values())) > 1 else ''})")


def _call(check: Check, impl: object, options: Options, failing: list[str], unsupported: dict[str, str]) -> None:
    """Run ``check``; a property check appends each example that fails to ``failing``, and rejects (draws
    again instead of) each example on a model the backend does not support, named in ``unsupported``.

    Hypothesis replays the shrunk example last before it raises, so ``failing[-1]`` is the smallest
    failing example: recorded from the drawn arguments themselves, not from hypothesis's report
    prose (whose wording changes between releases).
    """
    if not check.is_property:
        check.fn(impl)
        return

    def run_example(**drawn):
        example = _example_call(check.name, drawn)  # before the call: a backend may mutate its inputs
        try:
            check.fn(impl, **drawn)
        except Unsupported as exc:
            unsupported.update(exc.reasons)
            hypothesis.reject()
        except Exception:
            failing.append(example)
            raise

    run_example.__name__ = run_example.__qualname__ = check.name
    test = hypothesis.given(**check.given)(run_example)
    test = hypothesis.settings(
        max_examples=options.max_examples(check), deadline=None, database=None,
        derandomize=False, report_multiple_bugs=False, print_blob=False,
        suppress_health_check=list(HealthCheck), phases=[p for p in hypothesis.Phase if p != hypothesis.Phase.explain],
    )(test)
    hypothesis.seed(options.seed)(test)()


def _describe(exc: BaseException) -> str:
    """The failure in words: the check's own message, or where the backend crashed."""
    if isinstance(exc, AssertionError) and str(exc):
        return str(exc)
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    if frames and _in_suite(frames[-1].filename):
        # The suite itself failed on something the backend handed it (a draft() that returned None, stats
        # without an attribute): name the suite's line, whose call shows which member returned it.
        where += (f", in the suite's line `{frames[-1].line}`: a value the backend returned there is not what "
                  f"the protocol says (docs/conformance.md, the backend protocol)")
    return f"raised {type(exc).__name__}: {exc}{where}"


def _in_suite(filename: str) -> bool:
    """Whether ``filename`` is one of the suite's own modules (conformance/, not the backend's)."""
    import os

    here = os.path.dirname(os.path.abspath(__file__))
    return os.path.abspath(filename).startswith(here + os.sep)


def _example_call(name: str, drawn: dict) -> str:
    """The example as a call: ``name(arg=value, ...)``, values by ``repr``."""
    return f"{name}({', '.join(f'{k}={v!r}' for k, v in drawn.items())})"


@dataclass
class Report:
    backend: str
    seed: int
    thorough: bool
    results: list[CheckResult] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def failed(self) -> bool:
        return any(r.status == FAILED for r in self.results)

    def area_status(self, area: str) -> str:
        """failed if any check failed; passed if some passed; else skipped or not applicable."""
        statuses = {r.status for r in self.results if r.area == area}
        for status in (FAILED, PASSED, SKIPPED, NOT_APPLICABLE):
            if status in statuses:
                return status
        return SKIPPED  # no check of this area ran

    def as_dict(self) -> dict:
        from conformance.registry import AREAS

        return {
            "backend": self.backend, "seed": self.seed, "thorough": self.thorough,
            "passed": not self.failed, "seconds": round(self.seconds, 2),
            "areas": [{"area": a, "title": t,
                       "status": self.area_status(a) if any(r.area == a for r in self.results) else "not selected",
                       "checks": [r.as_dict() for r in self.results if r.area == a]}
                      for a, t in AREAS.items()],
        }


def run_suite(backend: Backend, checks: Iterable[Check], options: Options,
              on_result: Callable[[CheckResult], None] | None = None,
              on_start: Callable[[Check], None] | None = None) -> Report:
    """Run ``checks`` in order; ``on_start`` / ``on_result`` see each check begin and end (progress output)."""
    report = Report(backend.name, options.seed, options.thorough)
    t0 = time.perf_counter()
    for check in checks:
        if on_start:
            on_start(check)
        result = run_check(check, backend, options)
        report.results.append(result)
        if on_result:
            on_result(result)
        if options.exitfirst and result.status == FAILED:
            break
    report.seconds = time.perf_counter() - t0
    return report
