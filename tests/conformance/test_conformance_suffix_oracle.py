"""The suffix-drafting oracle (the second part of conformance/oracle.py) agrees with the reference's rule
and with the hand-worked cases; the adapters' suffix_drafter is not applicable only where a backend has
none."""
from __future__ import annotations

import sys
import types

from hypothesis import given, settings
from hypothesis import strategies as st

from conformance import oracle as rule
from conformance.adapters.suffix import optional_suffix_adapter
from conformance.backend import Backend
from conformance.checks import all_checks
from conformance.checks.suffix import CASES, DEFAULTS
from conformance.runner import FAILED, NOT_APPLICABLE, PASSED, Options, run_suite
from reference.suffix.drafter import LADDER, SuffixDrafter, SuffixHistory

tokens = st.lists(st.integers(0, 3), max_size=40)


@settings(max_examples=300, deadline=None, database=None)
@given(T=tokens, added=st.lists(st.lists(st.integers(0, 3), max_size=20), max_size=4),
       max_tokens=st.one_of(st.just(1 << 20), st.integers(0, 50)),
       factor=st.one_of(st.sampled_from([0.25, 0.5, 1.0, 1.5, 2.0]), st.floats(0.01, 5.0)),
       max_match=st.one_of(st.just(64), st.integers(1, 10)),
       ladder=st.one_of(st.just(LADDER), st.lists(st.integers(1, 9), min_size=1, max_size=4)),
       k=st.integers(0, 12))
def test_oracle_agrees_with_the_reference(T, added, max_tokens, factor, max_match, ladder, k):
    """Any factor (the oracle floors the same float product the reference truncates), any ladder."""
    history = SuffixHistory(max_tokens)
    for seq in added:
        history.add(seq)
    assert rule.kept_history(added, max_tokens) == history.sequences
    drafter = SuffixDrafter(history, factor=factor, max_match=max_match, ladder=ladder)
    drafter.reset(T)
    got = drafter.draft(k)
    want = rule.suffix_draft(T, k, history.sequences, factor=factor, max_match=max_match, ladder=ladder)
    assert (got, drafter.match_length) == (want.draft, want.match_length)


def test_the_oracles_ladder_and_defaults_are_the_rules():
    import reference.suffix.drafter as ref

    assert (rule.SUFFIX_LADDER, rule.SUFFIX_MAX_MATCH, rule.SUFFIX_FACTOR, rule.SUFFIX_HISTORY_MAX_TOKENS) == (
        ref.LADDER, ref.MAX_MATCH, ref.FACTOR, ref.HISTORY_MAX_TOKENS)


def test_oracle_reproduces_the_hand_worked_cases():
    for name, overrides, steps in CASES:
        s = {**DEFAULTS, **overrides}
        added, T = [list(h) for h in s["history"]], []
        for step in steps:
            if step[0] == "reset":
                T = list(step[1])
            elif step[0] == "extend":
                T += step[1]
            elif step[0] == "add_history":
                added.append(list(step[1]))
            else:
                _, k, want, L = step
                got = rule.suffix_draft(T, k, rule.kept_history(added, s["max_tokens"]), factor=s["factor"],
                                   max_match=s["max_match"])
                assert (got.draft, got.match_length) == (want, L), (name, T, k, got)


def test_a_backend_without_suffix_drafter_is_not_applicable():
    checks = [c for c in all_checks() if c.area == "suffix"]
    assert len(checks) >= 4
    import reference.ngram.api as api

    report = run_suite(Backend("drafter-only", types.SimpleNamespace(NgramDrafter=api.NgramDrafter)), checks,
                       Options(seed=1, examples=2))
    assert report.area_status("suffix") == NOT_APPLICABLE
    assert all("suffix_drafter" in r.message for r in report.results)


def test_a_missing_fast_module_is_not_applicable_and_a_broken_one_fails(monkeypatch):
    assert optional_suffix_adapter("conformance.no_such_package_xyz.drafter") is None
    assert optional_suffix_adapter("conformance.no_such_module_xyz") is None
    broken = types.ModuleType("conformance.broken_suffix_xyz")
    broken.SuffixHistory = SuffixHistory  # no SuffixDrafter
    monkeypatch.setitem(sys.modules, "conformance.broken_suffix_xyz", broken)
    suffix_drafter = optional_suffix_adapter("conformance.broken_suffix_xyz")
    assert suffix_drafter is not None
    checks = [c for c in all_checks() if c.area == "suffix"]
    report = run_suite(Backend("broken", types.SimpleNamespace(suffix_drafter=suffix_drafter)), checks,
                       Options(seed=1, examples=2))
    assert {r.status for r in report.results} == {FAILED}
    assert all("SuffixDrafter" in r.message for r in report.results)
    fine = optional_suffix_adapter("reference.suffix.drafter")
    report = run_suite(Backend("reference", types.SimpleNamespace(suffix_drafter=fine)), checks,
                       Options(seed=1, examples=5))
    assert {r.status for r in report.results} == {PASSED}
