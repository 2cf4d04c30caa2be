"""Meta-tests: the conformance suite catches deliberately broken backends (tests/conformance/meta/mutants.py).

For each mutant every check named for it in docs/conformance.md runs with a fixed seed, on its own,
against the backend cut down to the members that check's area needs, and must fail. The unbroken backends must pass the very same runs, so a failure
is the mutant's doing and not the suite's.
"""
from __future__ import annotations

import importlib.util
import pytest

from conformance.backend import Backend, resolve
from conformance.checks import all_checks
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


def run_on_its_own(backend_name, check_id):
    """The check alone, against the backend cut down to the members its area needs (issue 11: every
    area stands on its own; a drafting bug must be caught without replay)."""
    check = next(c for c in all_checks() if c.id == check_id)
    needs = tuple(sorted({n for c in all_checks() if c.area == check.area for n in c.needs}))
    key = (backend_name, needs)
    if key not in _CUT_DOWN:  # kept alive: conformance.models caches loaded models by id(backend)
        impl = resolve(backend_name).impl
        _CUT_DOWN[key] = Backend(f"{backend_name} ({', '.join(needs)} only)", Only(impl, needs))
    return run_suite(_CUT_DOWN[key], [check], Options(seed=SEED, examples=EXAMPLES)).results[0]


class Only:
    """``impl`` showing only the members ``names``, read when used (so a mutant's patch is seen)."""

    def __init__(self, impl, names):
        self._impl, self._names = impl, set(names)

    def __getattr__(self, name):
        if name in self._names:
            return getattr(self._impl, name)
        raise AttributeError(name)


_CUT_DOWN: dict = {}


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
    # the adapter imported before the mutant's patch: imported inside it (the first test of a run that skips
    # test_unbroken_backend_..., as a -k selection does), it would bind the patched function and keep it after
    # the patch is undone, hiding the next mutant of the same function
    resolve(backend_name)
    with mutant():
        failed = {c: r for c in catching if (r := run_on_its_own(backend_name, c)).status == FAILED}
    missed = [c for c in catching if c not in failed]
    assert not missed, f"mutant {name!r} was not caught by {missed}; failing checks: {sorted(failed) or 'none'}"
    assert all(failed[c].message for c in catching), "a failure must say what went wrong"
