"""``ngram-spec demo`` and ``ngram-spec generate --backend mlx`` on SmolLM2 (reduced token counts).

The real demo runs once per configuration (cost-aware and ``--draft-max 4``), both subprocesses at the
same time (each keeps one core busy: mlx's bundled BLAS is single-threaded), and every ``test_demo_*``
asserts on those two shared runs (:func:`demo_runs`); ``test_table_*`` check the table on constructed
records, without the model.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("mlx.core")
from mlx_backend.cli import demo as mlx_cli  # noqa: E402
from mlx_backend.models import gguf  # noqa: E402
from mlx_backend.cli import main  # noqa: E402

ROOT = Path(__file__).parents[3]
DEMO_CONFIGS = {"auto": [], "4": ["--draft-max", "4"]}   # --draft-max of each shared demo run
DEMO_TIMEOUT = 900   # seconds for both runs together


@pytest.fixture(scope="module")
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


def start_demo(out: Path, *args) -> subprocess.Popen:
    """``python -m mlx_backend.cli demo ... --json`` in a subprocess, as a user runs it, with mlx's bundled BLAS:
    the tests neither depend on OpenBLAS nor change OPENBLAS_* settings (the demo's default re-runs
    itself with OpenBLAS interposed when it is installed, docs/benchmarks.md). Its stdout and stderr go to
    ``out.stdout`` and ``out.stderr`` (files: no pipe to drain while another run is awaited)."""
    with open(out.with_suffix(".stdout"), "w") as stdout, open(out.with_suffix(".stderr"), "w") as stderr:
        return subprocess.Popen([sys.executable, "-m", "mlx_backend.cli", "demo", "--json", "--blas", "bundled", *args],
                                stdout=stdout, stderr=stderr, text=True, cwd=ROOT)


@pytest.fixture(scope="module")
def demo_runs(needs_smollm2, tmp_path_factory) -> dict[str, tuple[int, str, str]]:
    """``{draft: (returncode, stdout, stderr)}`` of ``demo --max-tokens 16`` for each of
    :data:`DEMO_CONFIGS`, started together and shared by every ``test_demo_*`` test."""
    tmp = tmp_path_factory.mktemp("demo")
    procs = {draft: start_demo(tmp / f"draft-{draft}", "--max-tokens", "16", *extra)
             for draft, extra in DEMO_CONFIGS.items()}
    deadline = time.monotonic() + DEMO_TIMEOUT
    try:
        for proc in procs.values():
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return {draft: (proc.returncode, (tmp / f"draft-{draft}.stdout").read_text(),
                    (tmp / f"draft-{draft}.stderr").read_text()) for draft, proc in procs.items()}


def demo_records(demo_runs, draft: str) -> list[dict]:
    """The records of the shared demo run with ``--draft-max draft`` (which must have exited 0)."""
    returncode, out, err = demo_runs[draft]
    assert returncode == 0, err[-2000:]
    return [json.loads(line) for line in out.splitlines()]


DRAFTS = pytest.mark.parametrize("draft", list(DEMO_CONFIGS))


@pytest.mark.slow
@DRAFTS
def test_demo_runs_every_prompt(demo_runs, draft):
    records = demo_records(demo_runs, draft)
    assert [r["prompt"] for r in records] == [p.name for p in mlx_cli.DEMO_PROMPTS]
    for r in records:
        assert {"plain_tok_s", "spec_tok_s", "accept", "identical", "speedup", "tokens_per_forward"} <= r.keys()
        assert r["plain_tok_s"] > 0 and r["spec_tok_s"] > 0 and r["draft_max"] == (draft if draft == "auto" else 4)


@pytest.mark.slow
@DRAFTS
def test_demo_outputs_are_identical(demo_runs, draft):
    for r in demo_records(demo_runs, draft):
        assert _identical_or_near_tie(r), r


@pytest.mark.slow
@DRAFTS
def test_demo_table_has_one_row_per_prompt(demo_runs, draft):
    records = demo_records(demo_runs, draft)
    table = mlx_cli.format_table(records).splitlines()
    assert table[0].split()[:3] == ["prompt", "kind", "tokens"] and table[0].rstrip().endswith("identical")
    rows = table[2:2 + len(records)]
    assert [row.split()[0] for row in rows] == [r["prompt"] for r in records]
    # a prompt whose speculative runs drafted nothing shows "no drafts*" and a footnote, not a speedup
    for r, row in zip(records, rows):
        assert ("no drafts*" in row) == (r["drafted"] == 0), (row, r)
    assert (len(table) > 2 + len(records)) == any(r["drafted"] == 0 for r in records)


@pytest.mark.slow
@DRAFTS
def test_demo_speedup_only_where_drafts_ran(demo_runs, draft):
    """``speedup`` is null exactly where neither timed speculative run verified a draft (``drafted`` 0,
    ``no_drafts`` says why); elsewhere it is spec tok/s over plain tok/s."""
    for r in demo_records(demo_runs, draft):
        assert r["drafted"] >= r["n_drafted"] and r["proposed"] >= r["drafted"]
        if r["drafted"] == 0:
            assert r["speedup"] is None, r
            expected = ("no-proposal" if r["proposed"] == 0 else "policy" if draft == "auto" else "no-room")
            assert r["no_drafts"] == expected, r
        else:
            assert r["no_drafts"] is None
            # both tok/s are printed to 2 decimals: their ratio is off by up to 0.005 / tok/s of each
            slack = 0.005 / r["spec_tok_s"] + 0.005 / r["plain_tok_s"]
            assert r["speedup"] == pytest.approx(r["spec_tok_s"] / r["plain_tok_s"], rel=0.01 + slack)
        if draft == "auto":   # the cost-aware policy's state after the second speculative run
            assert set(r["policy"]) == {"cost_rel", "plain_cost_rel", "accept", "accept_by_match", "decisions"}
        else:
            assert r["policy"] is None


@pytest.mark.slow
def test_demo_forced_drafting_is_not_vacuous(demo_runs):
    """With drafting forced (``--draft-max 4``) the comparison of outputs is not vacuous."""
    records = demo_records(demo_runs, "4")
    grounded = [r for r in records if r["kind"] == "input-grounded"]
    assert len(grounded) == 3 and all(r["n_drafted"] > 0 for r in grounded)
    repeat = next(r for r in records if r["prompt"] == "repeat-list")
    assert repeat["accept"] > 50 and repeat["tokens_per_forward"] > 1.5


# --- the table on constructed records (no model) -----------------------------------------------

FLAT_COSTS = {"cost_rel": [1.0, 2.04, 3.09, 4.13, 5.18, 6.22, 7.27, 8.31, 9.36], "plain_cost_rel": 1.0,
              "accept": [0.55] + [0.5] * 7, "decisions": {"0": 16}}   # bundled BLAS: c(S) ~ S c(1)


def record(prompt: str, drafted: int, *, proposed: int = 10, no_drafts=None, policy=None, **extra) -> dict:
    r = {"prompt": prompt, "kind": "input-grounded", "prompt_tokens": 80, "tokens": 16, "plain_tok_s": 1.22,
         "spec_tok_s": 1.31, "speedup": None if drafted == 0 else 1.074, "accept": 0.0 if drafted == 0 else 75.0,
         "tokens_per_forward": 1.0 if drafted == 0 else 1.6, "identical": True, "divergence": None,
         "steps": 16, "n_drafted": drafted // 2, "n_accept": 0, "drafted": drafted, "proposed": proposed,
         "no_drafts": no_drafts, "policy": policy}
    return {**r, **extra}


def test_table_says_no_drafts_instead_of_a_speedup():
    """The issue's case: on the bundled BLAS the cost-aware policy drafts nothing, and spec tok/s over
    plain tok/s (1.07 here) is noise: the row says "no drafts*" and the footnote says why."""
    records = [record("edit-code", 0, no_drafts="policy", policy=FLAT_COSTS),
               record("repeat-list", 12, policy=FLAT_COSTS),
               record("quote-passage", 0, no_drafts="policy", policy=FLAT_COSTS)]
    lines = mlx_cli.format_table(records, "reference BLAS (bundled with mlx-cpu)").splitlines()
    head, rows, notes = lines[0], lines[2:5], lines[5:]
    speedup = slice(head.index("spec tok/s") + len("spec tok/s"), head.index("speedup") + len("speedup"))
    assert [row[speedup].strip() for row in rows] == ["no drafts*", "1.07x", "no drafts*"]
    note = " ".join(line.strip() for line in notes[1:])
    assert notes[0] == "" and note.startswith("* no drafts (edit-code, quote-passage): the cost-aware draft policy")
    assert "chose k = 0 at every step" in note and "c(S)/c(1), S = 1..9: 1.00 2.04 3.09" in note
    assert "verifying k drafted tokens costs about k more steps" in note and "bundled reference BLAS" in note
    assert "noise, not a speed-up" in note
    assert all(len(line) <= len(head) for line in lines)
    optimized = " ".join(mlx_cli.format_table(records, "/usr/lib/libopenblas.so.0 via LD_PRELOAD").splitlines()[5:])
    assert "bundled reference BLAS" not in optimized and "1.00 2.04 3.09" in optimized  # no claim about this BLAS


def test_table_footnote_names_some_of_65_costs():
    """The cost-aware policy learns c(S) for S = 1..65: the footnote names a few of them in a line or two (the
    stderr line above the table has every one), where it once repeated all 65."""
    costs = [1.0 + 0.25 * s for s in range(65)]
    lines = mlx_cli.format_table([record("free-writing", 0, no_drafts="policy",
                                         policy={**FLAT_COSTS, "cost_rel": costs})]).splitlines()
    note = " ".join(line.strip() for line in lines[4:])
    assert "c(S)/c(1) at S = 1, 2, 3, 5, 9, 17, 33, 65 (of 1..65): 1.00 1.25 1.50 2.00 3.00 5.00 9.00 17.00;" in note
    assert "1.75" not in note and len(lines[4:]) <= 4, lines[4:]


@pytest.mark.parametrize("reason, policy, says, not_says", [
    ("no-proposal", None, "the drafter found nothing to propose", "draft policy"),
    ("no-room", None, "no draft fitted before --max-tokens", "draft policy"),
    ("policy", {**FLAT_COSTS, "cost_rel": None, "plain_cost_rel": None}, "verify costs not being learned yet",
     "BLAS"),
    # cheap verification (an optimized BLAS): k = 0 came from low acceptance, not from the BLAS
    ("policy", {**FLAT_COSTS, "cost_rel": [1.0, 1.05, 1.1, 1.15, 1.2, 1.25, 1.3, 1.35, 1.4]}, "1.00 1.05 1.10",
     "BLAS"),
])
def test_table_footnote_names_why_nothing_was_drafted(reason, policy, says, not_says):
    lines = mlx_cli.format_table([record("free-writing", 0, proposed=0 if reason == "no-proposal" else 4,
                                         no_drafts=reason, policy=policy)]).splitlines()
    assert "no drafts*" in lines[2]
    note = " ".join(line.strip() for line in lines[4:])
    assert note.startswith("* no drafts (free-writing): ") and says in note and not_says not in note
    assert note.endswith("noise, not a speed-up.")


def test_table_without_runs_lacking_drafts_has_no_footnote():
    table = mlx_cli.format_table([record("repeat-list", 12), record("edit-code", 3, speedup=0.912)])
    assert table.splitlines()[2].rstrip().endswith("1.07x     75%     1.60  yes")
    assert "0.91x" in table.splitlines()[3] and "no drafts" not in table and len(table.splitlines()) == 4


@pytest.mark.parametrize("near_tie, rc", [(False, 1), (True, 0)])
@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_demo_exit_code_says_whether_outputs_differ(monkeypatch, capsys, near_tie, rc, json_flag):
    """Exit code 1 when spec and plain differ other than at a near-tie, with or without --json (before, the
    --json branch returned 0 whatever the outputs)."""
    differ = {**record("edit-code", 4), "identical": False, "plain_text": "x",
              "divergence": {"index": 2, "top2_gap": 0.5, "near_tie": near_tie}}
    monkeypatch.setattr(mlx_cli, "load_model", lambda model, dtype: (None, None, "stub"))
    monkeypatch.setattr(mlx_cli, "demo_records", lambda *a, **k: [differ])
    assert main(["demo", "--blas", "bundled", *json_flag]) == rc
    out = capsys.readouterr().out
    assert (json.loads(out)["identical"] is False) if json_flag else ("edit-code" in out)


def _generate(capsys, *extra) -> dict:
    assert main(["generate", "--max-tokens", "14", "--json", *extra]) == 0
    (record,) = _records(capsys)
    return record


@pytest.fixture
def load_once(monkeypatch):
    """``generate``'s ``load_model`` loading each (model, dtype) once for the test: the CLI's own load
    the first time, the same model and tokenizer for the test's later ``generate`` runs."""
    from mlx_backend.cli import generate_mlx

    loaded, load = {}, generate_mlx.load_model

    def load_model(model, dtype=None):
        if (model, dtype) not in loaded:
            loaded[model, dtype] = load(model, dtype)
        return loaded[model, dtype]

    monkeypatch.setattr(generate_mlx, "load_model", load_model)


@pytest.mark.usefixtures("needs_smollm2", "load_once")
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
    from reference.models.tiny import write_tiny_model

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
    from reference.models.tiny import write_tiny_model

    model_dir = write_tiny_model(tmp_path / "tiny", "llama", seed=0)
    if config is not None:
        (model_dir / "config.json").write_text(config)
    if weights is not None:
        (model_dir / "model.safetensors").write_bytes(weights)
    assert main(["generate", "--model", str(model_dir), "--prompt", "hi", "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ngram-spec generate: error: --model {model_dir}: mlx-lm cannot load this model directory")
    assert message in err and err.count("\n") == 1

@pytest.mark.usefixtures("needs_smollm2")
def test_main_job_doc_examples_run(capsys):
    """The ```python blocks of docs/main-job.md, executed in order in one namespace."""
    text = (Path(__file__).parents[3] / "docs" / "main-job.md").read_text()
    blocks = [b.split("```", 1)[0] for b in text.split("```python\n")[1:]]
    assert len(blocks) >= 2
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "docs/main-job.md", "exec"), namespace)
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if "tokens: the prompt's forward, then" in line)
    assert line in text, (line, "the doc says what the example prints")


@pytest.mark.parametrize("which", [1, 2])
def test_a_divergence_in_either_timed_speculative_run_is_reported(monkeypatch, which):
    """``identical`` covers both timed speculative runs of a prompt: scripted runs (no model) where only the
    first, or only the second, speculative run parts from plain greedy at token 2, where plain's top-2
    log-probability gap is 0.5 (no near-tie), give ``identical`` false and that divergence."""
    import mlx.core as mx

    class Tokenizer:
        eos_token_ids = [99]
        has_chat_template = False

        def encode(self, text):
            return [1, 2, 3]

        def decode(self, tokens):
            return " ".join(map(str, tokens))

    plain = [5, 6, 7, 8]
    rows = [mx.array([-0.1, -3.0, -4.0]), mx.array([-0.2, -2.0, -5.0]), mx.array([-0.1, -0.6, -5.0]),
            mx.array([-0.3, -1.5, -2.0])]
    spec_calls = []

    def scripted(model, prompt, max_tokens, eos, *, spec, draft_max, drafter, stats, desc, draft_policy=None):
        if not spec:
            return list(plain), 1.0, list(rows)
        spec_calls.append(desc)
        timed = len(spec_calls) - 1           # the first speculative run is the warm-up
        return ([5, 6, 9, 8] if timed == which else list(plain)), 0.5, []

    monkeypatch.setattr(mlx_cli, "_generate", scripted)
    prompts = (mlx_cli.DemoPrompt("p", "free writing", "x"),)
    (r,) = mlx_cli.demo_records(None, Tokenizer(), prompts, max_tokens=4, draft_max=4, log=lambda msg: None)
    assert len(spec_calls) == 3
    assert r["identical"] is False
    assert r["divergence"]["index"] == 2 and not r["divergence"]["near_tie"]
    assert r["divergence"]["top2_gap"] == pytest.approx(0.5)


def test_divergence_by_hand():
    """Where two outputs first differ and plain's top-2 log-probability gap there (the larger minus the
    second), a near-tie only below NEAR_TIE; an output that stops early differs where it ends."""
    import mlx.core as mx

    rows = [mx.array([-0.1, -3.0, -4.0]), mx.array([-2.0, -0.25, -0.75]), mx.array([-0.6, -0.6002, -5.0])]
    assert mlx_cli._divergence([5, 6, 7], [5, 6, 7], rows) is None
    d = mlx_cli._divergence([5, 6, 7], [5, 9, 7], rows)
    assert (d["index"], d["near_tie"]) == (1, False) and d["top2_gap"] == pytest.approx(0.5)
    d = mlx_cli._divergence([5, 6, 7], [5, 6, 8], rows)
    assert (d["index"], d["near_tie"]) == (2, True) and d["top2_gap"] == pytest.approx(2e-4, abs=1e-6)
    assert mlx_cli._divergence([5, 6, 7], [5, 6, 7, 8], rows) == {"index": 3, "top2_gap": None, "near_tie": False}
