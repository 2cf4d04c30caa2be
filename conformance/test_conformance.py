"""``pytest --pyargs conformance``: the same checks as ``python -m conformance``, one test each.

The backend comes from ``$NGRAM_SPEC_BACKEND`` (default: mlx where installed, else ``reference``); ``$NGRAM_SPEC_CONFORMANCE_SEED``
fixes the seed and ``NGRAM_SPEC_CONFORMANCE_THOROUGH=1`` runs the thorough variant. A check that
does not apply to the backend is skipped with the reason "not applicable: ...". A backend that cannot
be loaded, or a seed that is not an integer, stops the session with one line (pytest's usage-error exit, 4).
"""
import os

import pytest

from conformance.backend import resolve
from conformance.checks import all_checks
from conformance.runner import FAILED, NOT_APPLICABLE, SKIPPED, Options, run_check

CHECKS = all_checks()


@pytest.fixture(scope="session")
def backend():
    try:
        return resolve(None)
    except ValueError as exc:  # once, not a traceback per check
        pytest.exit(f"conformance: {exc}", returncode=pytest.ExitCode.USAGE_ERROR)


@pytest.fixture(scope="session")
def options():
    opts = Options(thorough=os.environ.get("NGRAM_SPEC_CONFORMANCE_THOROUGH", "") not in ("", "0"))
    seed = os.environ.get("NGRAM_SPEC_CONFORMANCE_SEED")
    if seed:
        try:
            opts.seed = int(seed)
        except ValueError:
            pytest.exit(f"conformance: NGRAM_SPEC_CONFORMANCE_SEED must be an integer, got {seed!r}",
                        returncode=pytest.ExitCode.USAGE_ERROR)
    return opts


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
