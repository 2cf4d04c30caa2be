"""``ngram-spec tiny-model`` and ``ngram-spec generate --backend reference``."""
from __future__ import annotations

import json
import subprocess
import sys
import types

import numpy as np
import pytest

from mlx_backend.cli import main
from reference.ngram.tokens import write_tokens

REPETITIVE = list(b"the cat sat on the mat. the cat sat on the mat. the cat sat")
PLAIN = list(b"Quick zephyrs blow, vexing daft Jim")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    out = {}
    for arch in ("qwen3_5", "qwen3_next", "llama"):
        out[arch] = root / arch
        assert main(["tiny-model", "--arch", arch, "--seed", "1", "--out", str(out[arch])]) == 0
    return out


def generate_json(capsys, *argv) -> dict:
    assert main(["generate", "--backend", "reference", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_tiny_model_is_deterministic_in_the_seed(tmp_path, capsys):
    for name, seed in (("a", 3), ("b", 3), ("c", 4)):
        assert main(["tiny-model", "--arch", "qwen3_next", "--seed", str(seed), "--out", str(tmp_path / name)]) == 0
    assert "wrote a tiny qwen3_next model (seed 3" in capsys.readouterr().out
    weights = {n: (tmp_path / n / "model.safetensors").read_bytes() for n in "abc"}
    assert weights["a"] == weights["b"] != weights["c"]



def test_tiny_model_takes_o_like_the_other_commands(tmp_path, capsys):
    assert main(["tiny-model", "--arch", "llama", "-o", str(tmp_path / "m")]) == 0
    assert (tmp_path / "m" / "config.json").is_file()

def test_tiny_model_runs_as_a_console_script(tmp_path):
    out = tmp_path / "m"
    proc = subprocess.run([sys.executable, "-m", "mlx_backend.cli", "tiny-model", "--arch", "llama", "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next", "llama"])
@pytest.mark.parametrize("prompt", [REPETITIVE, PLAIN], ids=["repetitive", "plain"])
def test_spec_and_no_spec_give_identical_tokens(models, tmp_path, capsys, arch, prompt):
    path = tmp_path / "prompt.i32"
    write_tokens(path, prompt)
    common = ["--model", str(models[arch]), "--prompt-tokens", str(path), "--max-tokens", "40"]
    spec = generate_json(capsys, *common, "--draft-max", "5")
    plain = generate_json(capsys, *common, "--no-spec")
    assert spec["tokens"] == plain["tokens"] and 1 <= len(spec["tokens"]) <= 40
    assert spec["finish_reason"] == plain["finish_reason"]
    emitted = len(plain["tokens"]) + (plain["finish_reason"] == "stop")  # the EOS token is not listed
    assert plain["steps"] == emitted == plain["n_forward"] - 1 and plain["n_drafted"] == 0  # + 1 prefill
    # each step: its accepted drafts and one token of the model's own; an EOS inside a step stops it early
    assert emitted <= spec["n_accept"] + spec["steps"]
    assert emitted == spec["n_accept"] + spec["steps"] or spec["finish_reason"] == "stop"
    assert spec["prompt_tokens"] == len(prompt)


def test_prompt_lookup_saves_forward_passes_on_a_repeating_model(models, tmp_path, capsys):
    path = tmp_path / "prompt.npy"
    np.save(path, np.array(REPETITIVE, dtype=np.int64))
    record = generate_json(capsys, "--model", str(models["llama"]), "--prompt-tokens", str(path),
                           "--max-tokens", "40", "--draft-max", "8")
    assert record["n_accept"] > 10 and record["n_forward"] < 30
    assert record["tokens_per_forward"] == pytest.approx(len(record["tokens"]) / record["steps"], abs=1e-4)


def test_text_prompt_goes_through_the_chat_template(models, tmp_path, capsys):
    pytest.importorskip("transformers")  # tokenizes --prompt
    text = "the cat sat"
    chat = generate_json(capsys, "--model", str(models["llama"]), "--prompt", text, "--max-tokens", "8")
    templated = [257, *b"user\n", *text.encode(), 258, *b"\n", 257, *b"assistant\n"]  # ChatML, ids = bytes
    path = tmp_path / "p.i32"
    write_tokens(path, templated)
    by_ids = generate_json(capsys, "--model", str(models["llama"]), "--prompt-tokens", str(path), "--max-tokens", "8")
    assert chat["prompt_tokens"] == len(templated) and chat["tokens"] == by_ids["tokens"]
    raw = generate_json(capsys, "--model", str(models["llama"]), "--prompt", text, "--ignore-chat-template",
                        "--max-tokens", "8")
    assert raw["prompt_tokens"] == len(text)
    assert isinstance(chat["text"], str)


def test_plain_output_shows_text_tokens_and_stats(models, capsys):
    pytest.importorskip("transformers")  # tokenizes --prompt
    assert main(["generate", "--backend", "reference", "--model", str(models["llama"]), "--prompt", "abcabc",
                 "--max-tokens", "6", "--ignore-chat-template"]) == 0
    out = capsys.readouterr().out
    assert "==========" in out and "tokens: " in out and "forward passes" in out and "accepted:" in out


def test_dynamic_cache_is_created_and_reused(models, tmp_path, capsys):
    pytest.importorskip("transformers")  # tokenizes --prompt
    from reference.ngram.cache_file import load_cache

    dyn = tmp_path / "dyn.bin"
    argv = ["--model", str(models["llama"]), "--prompt", "abc abc abc", "--ignore-chat-template",
            "--max-tokens", "12", "--dynamic", str(dyn)]
    first = generate_json(capsys, *argv)
    cache = load_cache(dyn)
    assert cache.counts[(97, 98)] == {99: 3}  # "ab" -> "c", three times in the prompt
    second = generate_json(capsys, *argv)
    assert second["tokens"] == first["tokens"]
    assert load_cache(dyn).counts[(97, 98)] == {99: 6}  # merged again
    assert not list(tmp_path.glob("*.tmp.*"))


def test_static_cache_drafts_and_changes_nothing_but_the_count(models, tmp_path, capsys):
    pytest.importorskip("transformers")  # tokenizes --prompt
    from reference.ngram.api import build_static, save_cache

    common = ["--model", str(models["qwen3_5"]), "--prompt", "x", "--ignore-chat-template", "--max-tokens", "30"]
    plain = generate_json(capsys, *common, "--no-spec")
    corpus = [*b"x", *plain["tokens"]] * 3  # a corpus that happens to contain this very continuation
    save_cache(build_static(corpus), tmp_path / "static.bin")
    spec = generate_json(capsys, *common, "--static", str(tmp_path / "static.bin"))
    assert spec["tokens"] == plain["tokens"]
    assert spec["n_accept"] > 0


def test_generation_stops_at_eos_from_the_model_directory(models, tmp_path, capsys):
    pytest.importorskip("transformers")  # tokenizes --prompt
    import shutil

    common = ["--prompt", "abc", "--ignore-chat-template", "--max-tokens", "20"]
    plain = generate_json(capsys, "--model", str(models["qwen3_5"]), *common)
    stop = plain["tokens"][5]
    model = shutil.copytree(models["qwen3_5"], tmp_path / "m")
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [stop, 999]}))
    assert plain["finish_reason"] == "length"
    for flag in ("--no-spec", "--draft-max=4"):
        record = generate_json(capsys, "--model", str(model), *common, flag)
        assert record["tokens"] == plain["tokens"][:plain["tokens"].index(stop)]  # EOS itself not included
        assert record["finish_reason"] == "stop"


@pytest.mark.parametrize("argv, message", [
    (["--prompt", "hi"], "needs --model DIR"),
    (["--model", "{llama}", "--prompt", "hi", "--temp", "0.7"], "decodes greedily"),
    (["--model", "{llama}"], "--prompt TEXT or --prompt-tokens FILE"),
    (["--model", "{missing}", "--prompt", "hi"], "no config.json"),
    (["--model", "{garbled}", "--prompt", "hi"], "config.json: not valid JSON"),
    (["--model", "{bad_weights}", "--prompt", "hi"], "model.safetensors: not a readable safetensors file"),
    (["--model", "{llama}", "--prompt", "hi", "--max-tokens", "0"], "--max-tokens must be at least 1"),
    (["--model", "{llama}", "--prompt-tokens", "{bad}"], "not a multiple of 4"),
    (["--model", "{llama}", "--prompt-tokens", "{big}"], "outside the vocabulary"),
    (["--model", "{llama}", "--prompt", "hi", "--dtype", "bfloat16"], "float32 or float64, not bfloat16"),
    (["--model", "{llama}", "--prompt", "hi", "--draft-max", "-1"], "--draft-max must be in 0..1024"),
    (["--model", "{llama}", "--prompt", "hi", "--draft-max", "1000000"], "--draft-max must be in 0..1024"),
    (["--model", "{llama}", "--prompt", "hi", "--no-spec", "--static", "{bad}"], "--static would be ignored"),
    (["--model", "{llama}", "--prompt", "hi", "--no-spec", "--draft-max", "4", "--dynamic", "{bad}"],
     "--draft-max and --dynamic would be ignored"),
])
def test_bad_input_gets_one_clear_line(models, tmp_path, capsys, argv, message):
    (tmp_path / "bad.i32").write_bytes(b"\x01\x00\x00")
    write_tokens(tmp_path / "big.i32", [1, 5000])
    (tmp_path / "garbled").mkdir()
    (tmp_path / "garbled" / "config.json").write_text("{model_type: llama")
    (tmp_path / "bad_weights").mkdir()
    (tmp_path / "bad_weights" / "config.json").write_bytes((models["llama"] / "config.json").read_bytes())
    (tmp_path / "bad_weights" / "model.safetensors").write_bytes(b"")
    names = {"llama": models["llama"], "missing": tmp_path / "nope", "bad": tmp_path / "bad.i32",
             "big": tmp_path / "big.i32", "garbled": tmp_path / "garbled",
             "bad_weights": tmp_path / "bad_weights"}
    argv = [a.format(**names) for a in argv]
    assert main(["generate", "--backend", "reference", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1


def test_backend_mlx_hands_the_arguments_to_the_mlx_backend(monkeypatch):
    seen = []
    fake = types.ModuleType("mlx_backend.cli.generate_mlx")
    fake.run_generate = lambda args: seen.append(args) or 0
    monkeypatch.setitem(sys.modules, "mlx_backend.cli.generate_mlx", fake)
    assert main(["generate", "--prompt", "hi", "--draft-max", "3", "--temp", "0.5", "--seed", "1"]) == 0
    args = seen[0]
    assert (args.backend, args.prompt, args.draft_max, args.temp, args.seed) == ("mlx", "hi", 3, 0.5, 1)
    assert args.model is None
    assert main(["generate", "--prompt", "hi"]) == 0
    assert (seen[1].draft_max, seen[1].dtype) == (None, "auto")  # the backend's own choices
