"""The report as text: one line per check while it runs, then the areas, then each failure in full."""
from __future__ import annotations

import textwrap
from collections import Counter

from conformance.registry import AREAS
from conformance.runner import FAILED, NOT_APPLICABLE, PASSED, SKIPPED, CheckResult, Report

MARK = {PASSED: "ok  ", FAILED: "FAIL", SKIPPED: "skip", NOT_APPLICABLE: "n/a "}


def progress_line(r: CheckResult) -> str:
    """``  ok    drafting.name   the rule   (0.4 s)``"""
    tail = f"  ({r.seconds:.1f} s)" if r.status in (PASSED, FAILED) else f"  ({r.message})"
    return f"  {MARK[r.status]}  {r.id:<52} {tail}"


def summary(report: Report, rerun: str) -> str:
    """The area table, the failures with their smallest examples and seeds, and the verdict."""
    lines = ["", "Areas:"]
    for area, title in AREAS.items():
        results = [r for r in report.results if r.area == area]
        counts = Counter(r.status for r in results)
        detail = ", ".join(f"{counts[s]} {s}" for s in (PASSED, FAILED, SKIPPED, NOT_APPLICABLE) if counts[s])
        status = report.area_status(area)
        if not results:
            lines.append(f"  {title:<32} {'-':<15} not selected")
            continue
        lines.append(f"  {title:<32} {status.upper() if status == FAILED else status:<15} {detail}")
        if status == NOT_APPLICABLE:
            lines.append(f"  {'':<32} {'':<15} ({results[0].message})")
    noted = [r for r in report.results if r.notes]
    if noted:
        lines += ["", "Notes (tolerated by passing checks):"]
        lines += [f"  {r.id}: {n}" for r in noted for n in r.notes]
    failures = [r for r in report.results if r.status == FAILED]
    if failures:
        lines += ["", "Failures:"]
        for r in failures:
            lines += ["", f"  {r.id}  [{AREAS[r.area]}]", _block("rule:    ", r.rule),
                      _block("problem: ", r.message)]
            if r.example:
                lines.append(_block("smallest failing example: ", r.example))
            lines.append(f"    reproduce: {rerun} --seed {r.seed} --check {r.id}")
    n = len(report.results)
    ran = sum(r.status == PASSED for r in report.results)
    verdict = (f"FAILED: {len(failures)} of {n} checks failed" if failures
               else f"PASSED: no check failed ({ran} of {n} ran and passed)" if ran
               else f"NOTHING CHECKED: none of the {n} checks ran (each skipped or not applicable), and a run that "
                    f"checks nothing does not pass")
    lines += ["", f"{verdict}; {report.seconds:.1f} s; seed {report.seed}"
                  f"{'; thorough' if report.thorough else ''}."]
    return "\n".join(lines)


def _block(head: str, text: str) -> str:
    """``text`` under a heading, indented, long lines wrapped."""
    body = "\n".join(textwrap.fill(line, 100, subsequent_indent="      ") if len(line) > 100 else line
                     for line in text.strip().splitlines())
    first, *rest = body.splitlines() or [""]
    return "\n".join([f"    {head}{first}"] + [f"      {line}" for line in rest])
