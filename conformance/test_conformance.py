"""``pytest --pyargs conformance``: the same checks as ``python -m conformance``, one test each.

The backend comes from ``$NGRAM_SPEC_BACKEND`` (default: mlx where installed, else ``reference``); ``$NGRAM_SPEC_CONFORMANCE_SEED``
fixes the seed and ``NGRAM_SPEC_CONFORMANCE_THOROUGH=1`` runs the thorough variant. The first test prints
the backend under test. A check that does not apply to the backend is skipped with the reason "not
applicable: ..."; a session whose selected checks were all skipped fails (exit 5). A backend that cannot be
loaded, or a seed or THOROUGH value that is not one, stops the session with one line (pytest's usage-error
exit, 4).
"""
import os

import pytest

from conformance.backend import ENV, resolve
from conformance.checks import all_checks
from conformance.runner import FAILED, NOT_APPLICABLE, SKIPPED, Options, run_check

CHECKS = all_checks()


class _NothingChecked:
    """Fails a session whose selected checks all skipped (none applied, or none could run): a run that checks
    nothing must not pass, as ``python -m conformance`` refuses it (exit code 5, pytest's "no tests ran")."""

    def __init__(self, name: str):
        self.name, self.ran = name, 0

    def pytest_runtest_logreport(self, report):
        if report.when == "call" and "test_conformance[" in report.nodeid and not report.skipped:
            self.ran += 1

    def pytest_sessionfinish(self, session, exitstatus):
        if exitstatus == pytest.ExitCode.OK and not self.ran:
            session.exitstatus = pytest.ExitCode.NO_TESTS_COLLECTED
            reporter = session.config.pluginmanager.get_plugin("terminalreporter")
            if reporter is not None:
                reporter.write("\n")
                reporter.write_line(f"conformance: no selected check ran against backend {self.name!r} (each was "
                                    f"skipped or not applicable): a run that checks nothing does not pass", red=True)


@pytest.fixture(scope="session")
def backend(request):
    try:
        backend = resolve(None)
    except ValueError as exc:  # once, not a traceback per check
        pytest.exit(f"conformance: {exc}", returncode=pytest.ExitCode.USAGE_ERROR)
    source = f"${ENV}" if os.environ.get(ENV) else f"the default; ${ENV} names another"
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capture is not None:   # which backend the checks test, as python -m conformance says
        with capture.global_and_fixture_disabled():
            reporter.write_line(f"conformance: backend {backend.label()} ({source})")
    request.config.pluginmanager.register(_NothingChecked(backend.name))
    return backend


def read_options(environ=os.environ) -> Options:
    """The run's options from ``NGRAM_SPEC_CONFORMANCE_THOROUGH`` and ``NGRAM_SPEC_CONFORMANCE_SEED``; a value
    that is not one raises ``ValueError`` naming the variable and what it takes."""
    thorough = environ.get("NGRAM_SPEC_CONFORMANCE_THOROUGH", "").strip().lower()
    if thorough not in ("", "0", "false", "no", "off", "1", "true", "yes", "on"):
        raise ValueError(f"NGRAM_SPEC_CONFORMANCE_THOROUGH must be 1, true, yes or on (the thorough run) or 0, "
                         f"false, no, off or empty (the default run), got {thorough!r}")
    opts = Options(thorough=thorough in ("1", "true", "yes", "on"))
    seed = environ.get("NGRAM_SPEC_CONFORMANCE_SEED")
    if seed:
        try:
            opts.seed = int(seed)
        except ValueError:
            raise ValueError(f"NGRAM_SPEC_CONFORMANCE_SEED must be an integer, got {seed!r}") from None
    return opts


@pytest.fixture(scope="session")
def options():
    try:
        return read_options()
    except ValueError as exc:
        pytest.exit(f"conformance: {exc}", returncode=pytest.ExitCode.USAGE_ERROR)


@pytest.mark.parametrize("check", CHECKS, ids=[c.id for c in CHECKS])
def test_conformance(check, backend, options):
    result = run_check(check, backend, options)
    if result.status == NOT_APPLICABLE:
        pytest.skip(f"not applicable: {result.message}")
    if result.status == SKIPPED:
        pytest.skip(result.message)
    if result.status == FAILED:
        example = f"\nsmallest failing example: {result.example}" if result.example else ""
        pytest.fail(f"{check.doc}\n{result.message}{example}\nseed {result.seed} "
                    f"(NGRAM_SPEC_CONFORMANCE_SEED={result.seed} reproduces it)", pytrace=False)
