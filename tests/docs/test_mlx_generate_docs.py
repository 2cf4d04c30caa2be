"""Runs every ```python block of docs/mlx-backend.md, in order, in one namespace."""
from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "mlx-backend.md"


def test_docs_python_blocks_run(capsys):
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) >= 6
    namespace: dict = {}
    for i, block in enumerate(blocks):
        exec(compile(block, f"{DOC.name}[block {i}]", "exec"), namespace)
    out = capsys.readouterr().out
    assert "batched ArraysCache" in out   # the refusal example printed
