"""``ngram-spec stats | convert | create | merge``: out-of-range numbers and output names that could not
be read back are one line before any work, on both backends."""
from __future__ import annotations

import json

import pytest

from conformance import vectors
from mlx_backend.cli import main
from reference.ngram.tokens import write_tokens

V = vectors.shipped_path


def run(capsys, *argv):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("backend", ["reference", "mlx"])
def test_an_n_ctx_beyond_the_file_replays_nothing_whatever_its_size(capsys, tmp_path, backend):
    """The chunk tables are sized by the chunk, not by --n-ctx alone (before: the mlx backend sized them
    by n_ctx, 'a table holds at most 4294967295 n-grams' here, a 47.7 GiB allocation at --n-ctx 2e8)."""
    toks = tmp_path / "t.i32"
    write_tokens(toks, [1, 2, 3] * 5)
    rc, out, err = run(capsys, "stats", toks, "--n-ctx", 2**40, "--json", "--backend", backend)
    assert rc == 0, err
    assert json.loads(out)["n_chunks"] == 0 and "nothing replayed" in err


def test_n_draft_beyond_the_fast_backends_counters_is_one_line(capsys, tmp_path):
    """The mlx kernel counts a chunk's drafted tokens in int64 (before: a numba typing traceback for
    n_draft >= 2**63); the reference counts exactly, and 10**12 stays fine (test_replay_long_drafts.py)."""
    toks = tmp_path / "t.i32"
    write_tokens(toks, [1, 2, 3] * 5)
    rc, _, err = run(capsys, "stats", toks, "--n-ctx", 4, "--n-draft", 10**20, "--backend", "mlx")
    most = (2**63 - 1) // 3
    assert rc == 2 and err.strip() == (f"ngram-spec stats: error: n_draft must be at most {most} here (the fast "
                                       "backend counts the up to n_draft x (n_ctx - 1) tokens a chunk drafts in "
                                       f"int64), got {10**20}; --backend reference has no limit")
    for backend, n_draft in (("mlx", most), ("reference", 10**20)):
        rc, out, err = run(capsys, "stats", toks, "--n-ctx", 4, "--n-draft", n_draft, "--json", "--backend", backend)
        assert rc == 0 and json.loads(out)["n_drafted"] == 0, err


def test_convert_vocab_size_out_of_range_or_unrecordable_is_one_line(capsys, tmp_path):
    """Before: --vocab-size 1e20 ended in struct.error's traceback, and --to llama dropped it silently."""
    rc, _, err = run(capsys, "convert", V("syn-static.bin"), "-o", tmp_path / "a.ngc", "--vocab-size", 10**20)
    assert rc == 2 and "--vocab-size must be 1..2147483648" in err
    for backend in ("reference", "mlx"):
        out = tmp_path / f"{backend}.bin"
        rc, _, err = run(capsys, "convert", V("syn-static.bin"), "-o", out, "--to", "llama", "--vocab-size", 100,
                         "--backend", backend)
        assert rc == 2 and "llama.cpp's has none: pass --to ours" in err and not out.exists(), (backend, err)
    rc, _, err = run(capsys, "convert", V("syn-static.bin"), "-o", tmp_path / "b.ngc", "--vocab-size", 2**31)
    assert rc == 0, err


@pytest.mark.parametrize("argv", [
    ["create", V("syn-static-src.i32"), "-o", "{out}"],
    ["merge", V("syn-static.bin"), "-o", "{out}"],
    ["stats", V("edge-rep5.i32"), "--n-ctx", 2, "--save-dynamic", "{out}"],
    ["convert", V("syn-static.bin"), "-o", "{out}"],
], ids=lambda argv: argv[0])
def test_a_cache_output_named_xz_is_refused(capsys, tmp_path, argv):
    """Every command reads a .xz name as xz-compressed; a cache is written uncompressed, so such a name
    could never be read back (before: written, then refused by every command as 'not a valid .xz file')."""
    out = tmp_path / "cache.bin.xz"
    rc, _, err = run(capsys, *[str(out) if a == "{out}" else a for a in argv])
    assert rc == 2 and "a name ending in .xz is read back as xz-compressed; drop the .xz" in err, err
    assert not out.exists()


@pytest.mark.parametrize("backend", ["reference", "mlx"])
@pytest.mark.parametrize("flag", ["--static", "--dynamic"])
def test_stats_refuses_token_ids_beyond_the_vocabulary_a_cache_records(capsys, tmp_path, backend, flag):
    """A cache of our format recording 8 tokens, replayed against a file of other token ids: before,
    drafts were counted silently (docs/cache-format.md: the size is checked when the file is used)."""
    cache, toks = tmp_path / "v8.ngc", tmp_path / "t.i32"
    source = V("syn-static.bin")  # tokens 0..7
    if flag == "--dynamic":
        write_tokens(toks, [1, 2, 3, 7] * 5)
        source = tmp_path / "dyn.bin"
        assert run(capsys, "stats", toks, "--n-ctx", 4, "--save-dynamic", source)[0] == 0
    assert run(capsys, "convert", source, "-o", cache, "--vocab-size", 8)[0] == 0
    write_tokens(toks, [1, 2, 3, 8] * 5)
    rc, _, err = run(capsys, "stats", toks, "--n-ctx", 4, flag, cache, "--backend", backend)
    assert rc == 2 and err.strip().endswith(f"{toks} holds token id 8, outside the vocabulary of 8 tokens the "
                                            f"{flag[2:]} cache {cache} was built for: make the cache and the token "
                                            "file with the same tokenizer"), err
    write_tokens(toks, [1, 2, 3, 7] * 5)
    rc, _, err = run(capsys, "stats", toks, "--n-ctx", 4, flag, cache, "--backend", backend)
    assert rc == 0, err


@pytest.mark.parametrize("backend", ["reference", "mlx"])
def test_stats_requests_refuses_token_ids_beyond_the_vocabulary_a_cache_records(capsys, tmp_path, backend):
    """As for a token file: the requests' ids are checked against a --static / --dynamic cache's recorded
    size (before: replayed silently with drafts from a cache of another tokenizer)."""
    cache, requests = tmp_path / "v8.ngc", tmp_path / "r.jsonl"
    assert run(capsys, "convert", V("syn-static.bin"), "-o", cache, "--vocab-size", 8)[0] == 0
    for flag in ("--static", "--dynamic"):
        requests.write_text(json.dumps({"prompt": [1, 2, 3], "output": [1, 2, 8]}) + "\n")
        rc, _, err = run(capsys, "stats", "--requests", requests, "--drafter", "lookup", flag, cache,
                         "--backend", backend)
        assert rc == 2 and f"{requests} holds token id 8, outside the vocabulary of 8 tokens the {flag[2:]} " \
                           f"cache {cache} was built for" in err, err
        requests.write_text(json.dumps({"prompt": [1, 2, 3], "output": [1, 2, 7]}) + "\n")
        rc, _, err = run(capsys, "stats", "--requests", requests, "--drafter", "lookup", flag, cache,
                         "--backend", backend)
        assert rc == 0, err
