"""The areas of the suite and the checks in each.

A check is a function of the backend under test (and, for a property check, of examples drawn by
hypothesis strategies) that raises ``AssertionError`` with a readable message when the backend does
something the specification forbids. ``needs`` names the protocol members it uses
(``docs/conformance.md``); a backend without them gets "not applicable" for that check, not "passed".
"""
from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

THOROUGH = 10  # --thorough runs this many times the default number of examples per property check

# Areas in report order: id -> what a reader sees.
AREAS = {
    "counts": "n-gram counts",
    "drafting": "drafting and fallback",
    "thresholds": "thresholds and ties",
    "cache_files": "cache files",
    "replay": "replay statistics",
    "suffix": "suffix drafting",
    "rollback": "state rollback",
    "greedy": "speculative greedy equivalence",
    "sampling": "sampling distribution",
}


@dataclass(frozen=True)
class Check:
    area: str
    name: str
    doc: str  # the rule the check holds the backend to: the docstring's first paragraph
    fn: Callable[..., None]
    needs: tuple[str, ...] = ()
    given: dict[str, Any] = field(default_factory=dict)  # hypothesis strategies, by argument name
    examples: int = 0  # property checks: examples in a default run (``--thorough``: x THOROUGH)
    fast: bool = True  # run by the meta-tests' cut-down suites (tests/conformance/meta/test_mutants.py)

    @property
    def id(self) -> str:
        return f"{self.area}.{self.name}"

    @property
    def is_property(self) -> bool:
        return bool(self.given)


_CHECKS: list[Check] = []


def check(area: str, *, needs: tuple[str, ...] = (), given: dict[str, Any] | None = None,
          examples: int = 20, fast: bool = True):
    """Register the decorated function as a check of ``area``; its docstring's first paragraph states the rule
    (the whole paragraph, on one line: a rule cut at the end of its first source line can read as another)."""
    if area not in AREAS:
        raise ValueError(f"unknown area {area!r}; areas are {', '.join(AREAS)}")

    def register(fn: Callable[..., None]) -> Callable[..., None]:
        doc = " ".join((inspect.getdoc(fn) or fn.__name__).split("\n\n")[0].split())
        _CHECKS.append(Check(area, fn.__name__, doc, fn, tuple(needs), dict(given or {}),
                             examples if given else 0, fast))
        return fn

    return register


def registered() -> list[Check]:
    """The checks registered so far, in area order then definition order (:func:`conformance.checks.all_checks`
    imports every check module first)."""
    order = list(AREAS)
    return sorted(_CHECKS, key=lambda c: order.index(c.area))
