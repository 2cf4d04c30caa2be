"""``ngram-spec demo`` and ``ngram-spec generate --backend mlx`` on SmolLM2 (reduced token counts)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mlx.core")
from mlx_backend import cli as mlx_cli  # noqa: E402
from mlx_backend import gguf  # noqa: E402
from reference.cli import main  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def needs_smollm2():
    try:
        gguf.default_model_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


def _records(capsys) -> list[dict]:
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]


def _identical_or_near_tie(record: dict) -> bool:
    if record["identical"]:
        return True
    div = record["divergence"]  # a difference is allowed only where plain greedy had a near-tie
    return div["top2_gap"] is not None and div["top2_gap"] < mlx_cli.NEAR_TIE


def run_demo(*args) -> list[dict]:
    """``python -m reference demo ... --json`` in a subprocess, as a user runs it, with mlx's bundled BLAS:
    the tests neither depend on OpenBLAS nor change OPENBLAS_* settings (the demo's default re-runs
    itself with OpenBLAS interposed when it is installed, docs/benchmarks.md)."""
    out = subprocess.run([sys.executable, "-m", "reference", "demo", "--json", "--blas", "bundled", *args],
                         capture_output=True,
                         text=True, timeout=600, cwd=Path(__file__).parents[1])
    assert out.returncode == 0, out.stderr[-2000:]
    return [json.loads(line) for line in out.stdout.splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("draft", ["auto", "4"])
def test_demo_outputs_are_identical(draft):
    records = run_demo("--max-tokens", "16", *([] if draft == "auto" else ["--draft-max", draft]))
    assert [r["prompt"] for r in records] == [p.name for p in mlx_cli.DEMO_PROMPTS]
    for r in records:
        assert {"plain_tok_s", "spec_tok_s", "accept", "identical", "speedup", "tokens_per_forward"} <= r.keys()
        assert r["plain_tok_s"] > 0 and r["spec_tok_s"] > 0 and r["draft_max"] == (draft if draft == "auto" else 4)
        assert _identical_or_near_tie(r), r
    table = mlx_cli.format_table(records).splitlines()
    assert table[0].split()[:3] == ["prompt", "kind", "tokens"] and table[0].rstrip().endswith("identical")
    assert [row.split()[0] for row in table[2:]] == [r["prompt"] for r in records]
    if draft != "auto":  # with drafting forced the comparison is not vacuous
        grounded = [r for r in records if r["kind"] == "input-grounded"]
        assert len(grounded) == 3 and all(r["n_drafted"] > 0 for r in grounded)
        repeat = next(r for r in records if r["prompt"] == "repeat-list")
        assert repeat["accept"] > 50 and repeat["tokens_per_forward"] > 1.5


def _generate(capsys, *extra) -> dict:
    assert main(["generate", "--max-tokens", "14", "--json", *extra]) == 0
    (record,) = _records(capsys)
    return record


def test_generate_spec_equals_no_spec(capsys, tmp_path):
    prompt = ["--prompt", "red, green, blue, red, green, blue, red, green, blue, red,", "--ignore-chat-template"]
    plain = _generate(capsys, *prompt, "--no-spec", "--dtype", "float32")
    dyn = tmp_path / "dyn.bin"
    spec = _generate(capsys, *prompt, "--draft-max", "4", "--dynamic", str(dyn), "--dtype", "float32")
    assert spec["tokens"] == plain["tokens"] and spec["text"] == plain["text"]
    assert spec["n_drafted"] > 0 and spec["steps"] < len(spec["tokens"])
    assert plain["backend"] == "mlx" and plain["tokens_per_forward"] == 1.0
    assert dyn.stat().st_size > 0  # the dynamic cache was written
    again = _generate(capsys, *prompt, "--draft-max", "4", "--dynamic", str(dyn), "--dtype", "float32")
    assert again["tokens"] == plain["tokens"]


def test_generate_mlx_lm_model_directory(capsys, tmp_path):
    from reference.tiny import write_tiny_model

    model_dir = write_tiny_model(tmp_path / "tiny", "llama", seed=0)
    args = ["--model", str(model_dir), "--prompt", "the cat sat on the mat. the cat sat on the",
            "--ignore-chat-template"]
    plain = _generate(capsys, *args, "--no-spec")
    spec = _generate(capsys, *args, "--draft-max", "3")
    assert spec["tokens"] == plain["tokens"] and len(plain["tokens"]) > 0


def test_generate_bad_model_path_is_a_clear_error(capsys, tmp_path):
    assert main(["generate", "--model", str(tmp_path / "nope"), "--prompt", "hi"]) == 2
    assert "not a .gguf file or an mlx-lm model directory" in capsys.readouterr().err



@pytest.mark.parametrize("config, weights, message", [
    ("{model_type: llama", None, "line 1 column 2"),  # config.json that is not JSON
    ('{"model_type": "gpt9"}', None, "gpt9"),  # an architecture mlx-lm does not know
    (None, b"", "mlx-lm cannot load this model directory"),  # an empty safetensors file
])
def test_generate_unloadable_model_directory_is_one_clear_line(capsys, tmp_path, config, weights, message):
    from reference.tiny import write_tiny_model

    model_dir = write_tiny_model(tmp_path / "tiny", "llama", seed=0)
    if config is not None:
        (model_dir / "config.json").write_text(config)
    if weights is not None:
        (model_dir / "model.safetensors").write_bytes(weights)
    assert main(["generate", "--model", str(model_dir), "--prompt", "hi", "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ngram-spec generate: error: --model {model_dir}: mlx-lm cannot load this model directory")
    assert message in err and err.count("\n") == 1

def test_main_job_doc_examples_run(capsys):
    """The ```python blocks of docs/main-job.md, executed in order in one namespace."""
    text = (Path(__file__).parents[1] / "docs" / "main-job.md").read_text()
    blocks = [b.split("```", 1)[0] for b in text.split("```python\n")[1:]]
    assert len(blocks) >= 2
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "docs/main-job.md", "exec"), namespace)
    assert "tokens in" in capsys.readouterr().out
