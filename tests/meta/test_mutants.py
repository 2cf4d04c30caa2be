"""Meta-tests: the conformance suite catches deliberately broken backends (tests/meta/mutants.py).

For each mutant the checks of the areas it breaks run with a fixed seed; every check named for it
in docs/conformance.md must fail. The unbroken backends must pass the very same runs, so a failure
is the mutant's doing and not the suite's.
"""
from __future__ import annotations

import importlib.util

import pytest

from conformance.backend import resolve
from conformance.registry import all_checks
from conformance.runner import FAILED, PASSED, Options, run_suite

from mutants import MUTANTS

SEED = 20261130
EXAMPLES = 25
HAS_MLX = importlib.util.find_spec("mlx") is not None and importlib.util.find_spec("mlx_lm") is not None


def checks_for(names):
    areas = {n.split(".")[0] for n in names}
    return [c for c in all_checks() if c.area in areas and c.fast]


def run(backend_name, names):
    return run_suite(resolve(backend_name), checks_for(names), Options(seed=SEED, examples=EXAMPLES))


def needs(backend_name):
    return pytest.mark.skipif(backend_name == "mlx" and not HAS_MLX, reason="needs mlx and mlx-lm")


@pytest.mark.parametrize("backend_name", ["reference", pytest.param("mlx", marks=needs("mlx"))])
def test_unbroken_backend_passes_what_the_mutants_fail(backend_name):
    names = [n for _, b, catching in MUTANTS.values() if b == backend_name for n in catching]
    report = run(backend_name, names)
    failed = [(r.id, r.message) for r in report.results if r.status == FAILED]
    assert not failed, failed
    assert {n for n in names} <= {r.id for r in report.results if r.status == PASSED}


@pytest.mark.parametrize("name", list(MUTANTS), ids=[n.replace(" ", "_") for n in MUTANTS])
def test_mutant_is_caught(name):
    mutant, backend_name, catching = MUTANTS[name]
    if backend_name == "mlx" and not HAS_MLX:
        pytest.skip("needs mlx and mlx-lm")
    with mutant():
        report = run(backend_name, catching)
    failed = {r.id: r for r in report.results if r.status == FAILED}
    missed = [c for c in catching if c not in failed]
    assert not missed, f"mutant {name!r} was not caught by {missed}; failing checks: {sorted(failed) or 'none'}"
    assert all(failed[c].message for c in catching), "a failure must say what went wrong"
