"""docs/hybrid-state.md: its ```python blocks run in order in one namespace, the printed layer shapes
match the page, and its ```console commands run."""
from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[2] / "docs" / "hybrid-state.md"


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


def test_hybrid_state_page_commands_run(tmp_path):
    pytest.importorskip("transformers")  # --prompt is tokenized
    commands = [line[2:] for block in blocks("console") for line in block.splitlines() if line.startswith("$ ")]
    assert len(commands) == 3
    outputs = []
    for command in commands:
        argv = shlex.split(command)
        assert argv[0] == "ngram-spec"
        proc = subprocess.run([sys.executable, "-m", "mlx_backend.cli", *argv[1:]], cwd=tmp_path, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        outputs.append(proc.stdout)
    spec, plain = (json.loads(out) for out in outputs[1:])
    assert spec["tokens"] == plain["tokens"] and plain["steps"] == len(plain["tokens"])
