"""``ngram-spec tiny-model --out DIR`` into a folder that already holds something: an earlier tiny model is
replaced, anything else is refused with one line before a file is written (``check_out``)."""
from __future__ import annotations

import json

import pytest

from mlx_backend.cli import main


def _snapshot(folder):
    return {p.name: p.read_bytes() for p in folder.iterdir()}


@pytest.mark.parametrize("files", [
    {"config.json": json.dumps({"model_type": "llama", "vocab_size": 49152}), "model.safetensors": "weights"},
    {"model-00001-of-00002.safetensors": "shard", "tokenizer.model": "spm", "notes.txt": "mine"},
], ids=["a-real-model", "other-files"])
def test_a_folder_that_is_not_a_tiny_model_is_refused_and_left_as_it_was(tmp_path, capsys, files):
    """(before: config.json, model.safetensors and the tokenizer files were replaced and the rest left beside
    them, so a real model's folder became a mix mlx-lm would load shards of both from)."""
    out = tmp_path / "model"
    out.mkdir()
    for name, text in files.items():
        (out / name).write_text(text)
    before = _snapshot(out)
    assert main(["tiny-model", "--arch", "llama", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ngram-spec tiny-model: error: --out {out} is not empty and not an earlier tiny model")
    assert "give a new or empty folder" in err and len(err.strip().splitlines()) == 1
    assert _snapshot(out) == before


def test_a_file_as_the_output_folder_is_named_with_the_fix(tmp_path, capsys):
    """(before: 'error: PATH: Not a directory', naming neither the flag nor what to give)."""
    out = tmp_path / "tokens.i32"
    out.write_bytes(b"\x01\x00\x00\x00")
    assert main(["tiny-model", "--arch", "llama", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == (f"ngram-spec tiny-model: error: --out {out} is a file, not a folder: a model is a folder "
                           "of files; give a new or empty folder")
    assert out.read_bytes() == b"\x01\x00\x00\x00"


def test_an_earlier_tiny_model_or_an_empty_folder_is_written(tmp_path, capsys):
    out = tmp_path / "model"
    out.mkdir()
    assert main(["tiny-model", "--arch", "llama", "--out", str(out)]) == 0
    first = _snapshot(out)
    assert main(["tiny-model", "--arch", "qwen3_next", "--seed", "2", "--out", str(out)]) == 0
    assert set(_snapshot(out)) == set(first) and _snapshot(out) != first
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen3_next"


def test_a_negative_seed_is_named_with_its_flag(tmp_path, capsys):
    """(before: "ngram-spec tiny-model: error: expected non-negative integer", numpy's words, naming no flag)"""
    assert main(["tiny-model", "--arch", "llama", "--seed", "-1", "--out", str(tmp_path / "m")]) == 2
    assert capsys.readouterr().err == "ngram-spec tiny-model: error: --seed must be >= 0, got -1\n"
    assert not (tmp_path / "m").exists()
