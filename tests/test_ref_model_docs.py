"""docs/hybrid-state.md: its ```python blocks run in order in one namespace, and the printed layer
shapes match the page."""
from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

PAGE = Path(__file__).resolve().parents[1] / "docs" / "hybrid-state.md"


def blocks(kind: str) -> list[str]:
    return re.findall(rf"^```{kind}\n(.*?)^```$", PAGE.read_text(), flags=re.S | re.M)


def test_hybrid_state_page_runs_and_prints_what_it_shows():
    code = blocks("python")
    assert len(code) >= 5
    namespace: dict = {}
    out = io.StringIO()
    for i, block in enumerate(code):
        with contextlib.redirect_stdout(out):
            exec(compile(block, f"{PAGE.name}[python block {i}]", "exec"), namespace)
    shown = blocks("text")[0]  # the printed state table
    assert out.getvalue().startswith(shown)
