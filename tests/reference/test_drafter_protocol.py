"""The Drafter protocol (reference/drafter.py) is the one interface generation, the server, sharded
runs and the conformance suite hand drafters through: every drafter we ship or wrap implements it,
and an object lacking one of its methods does not."""
from __future__ import annotations

import importlib.util

import pytest

from reference.drafter import Drafter
from reference.ngram.drafter import NgramDrafter


class NoExtend:
    def reset(self, prompt):
        pass

    def draft(self, k):
        return []


def test_the_reference_drafter_is_a_drafter_and_an_incomplete_one_is_not():
    assert isinstance(NgramDrafter(), Drafter)
    assert not isinstance(NoExtend(), Drafter)


def test_the_conformance_suites_scripted_drafter_is_a_drafter():
    from conformance.models import ScriptedDrafter

    assert isinstance(ScriptedDrafter([1, 2, 3], [("true", 2)]), Drafter)


@pytest.mark.skipif(not all(importlib.util.find_spec(m) for m in ("mlx", "mlx_lm", "numba")),
                    reason="the fast drafter and its wrappers need mlx, mlx-lm and numba")
def test_the_fast_drafter_and_the_wrappers_of_the_server_and_sharded_runs_are_drafters():
    import hashlib

    from mlx_backend.distributed.sharded import _HashingDrafter
    from mlx_backend.ngram.drafter import NgramDrafter as FastDrafter
    from mlx_backend.serve.server import _EosCutDrafter

    fast = FastDrafter()
    for drafter in (fast, _EosCutDrafter(fast, [1, 2], {0}), _HashingDrafter(fast, hashlib.sha256())):
        assert isinstance(drafter, Drafter), type(drafter).__name__
        drafter.reset([5, 6, 5, 6, 5])
        assert drafter.draft(3) == [6, 5, 6]   # each wrapper passes the inner drafter's proposal on
