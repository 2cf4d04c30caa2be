"""docs/conformance.md stays true: its Python snippets run, and its tables of checks and mutants are
exactly the suite's checks and tests/conformance/meta's mutants."""
from __future__ import annotations

import contextlib
import io
import re
import sys
from pathlib import Path

from conformance.backend import PROTOCOL
from conformance.checks import all_checks
from conformance.registry import AREAS

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "conformance.md").read_text()


def section(title: str) -> str:
    return DOC.split(f"## {title}", 1)[1].split("\n## ", 1)[0]


def test_python_snippets_run_and_print_what_the_page_says():
    blocks = re.findall(r"```python\n(.*?)```", DOC, re.S)
    assert blocks
    namespace: dict = {}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for block in blocks:
            exec(compile(block, "docs/conformance.md", "exec"), namespace)
    assert out.getvalue().strip() == "passed / not applicable"
    assert "prints `passed / not applicable`" in DOC


def test_every_check_is_listed_under_its_area():
    table = section("The areas and where their expected values come from")
    for area, title in AREAS.items():
        row = next(line for line in table.splitlines() if line.startswith(f"| {title} (`--area {area}`) |"))
        assert set(re.findall(r"`([a-z_]+\.[a-z0-9_]+)`", row)) == {c.id for c in all_checks() if c.area == area}


def test_every_protocol_member_is_documented():
    table = section("The backend protocol")
    for name in PROTOCOL:
        assert f"`{name}" in table or f", `{name}(" in table, name


def test_mutant_table_is_the_meta_tests_table():
    sys.path.insert(0, str(ROOT / "tests" / "conformance" / "meta"))
    try:
        from mutants import MUTANTS
    finally:
        sys.path.pop(0)
    rows = re.findall(r"^\| (.+?) \| (`.+`) \|$", section("Proof that it can fail: the mutants"), re.M)
    documented = {name: re.findall(r"`([^`]+)`", checks) for name, checks in rows}
    assert documented == {name: catching for name, (_, _, catching) in MUTANTS.items()}
    ids = {c.id for c in all_checks()}
    assert all(c in ids for catching in documented.values() for c in catching)


def test_doctests_of_the_suite():
    """conformance/ is not in the repository's doctest paths; its examples run here."""
    import doctest

    import conformance.llama_format
    import conformance.oracle

    for module in (conformance.oracle, conformance.llama_format):
        result = doctest.testmod(module)
        assert result.attempted and not result.failed, module.__name__
