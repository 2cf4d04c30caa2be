"""``ngram-spec convert`` and the n-gram commands with ``--backend mlx`` on files of either format."""
from __future__ import annotations

import json

import numpy as np
import pytest

import mlx_backend.ngram.api as api
import reference.ngram.api as ref
from conformance import vectors
from mlx_backend.cli import main


@pytest.fixture
def llama_file(tmp_path):
    return vectors.local_path("syn-static.bin")


def test_convert_round_trip_multiset_equal(tmp_path, llama_file, capsys):
    ours, back = tmp_path / "s.ngc", tmp_path / "s.bin"
    assert main(["convert", str(llama_file), "-o", str(ours), "--to", "ours"]) == 0
    assert ours.read_bytes()[:8] == b"NGRAMSPC"
    assert main(["convert", str(ours), "-o", str(back), "--to", "llama"]) == 0
    want = ref.load_cache(llama_file).entries()
    assert api.load_cache(ours).entries() == want
    assert ref.load_cache(back).entries() == want  # the reference reads what we wrote
    assert "512 entries" in capsys.readouterr().err


def test_convert_records_vocab_size(tmp_path, llama_file):
    out = tmp_path / "s.ngc"
    assert main(["convert", str(llama_file), "-o", str(out), "--vocab-size", "8"]) == 0
    assert api.load_cache(out).vocab_size == 8
    assert main(["convert", str(llama_file), "-o", str(tmp_path / "t.ngc"), "--vocab-size", "7"]) == 2


def test_convert_errors(tmp_path, llama_file, capsys):
    out = tmp_path / "s.ngc"
    out.write_bytes(b"")
    assert main(["convert", str(llama_file), "-o", str(out)]) == 2
    assert "exists; pass --force" in capsys.readouterr().err
    assert main(["convert", str(llama_file), "-o", str(out), "--force"]) == 0
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"\x01\x00\x00\x00" * 3)
    assert main(["convert", str(bad), "-o", str(tmp_path / "x.ngc")]) == 2
    err = capsys.readouterr().err
    assert "truncated record" in err and "at byte offset 0" in err
    assert main(["convert", str(tmp_path / "missing.bin"), "-o", str(tmp_path / "y.ngc")]) == 2
    assert main(["convert", str(out), "-o", str(out), "--force"]) == 2
    assert "same file" in capsys.readouterr().err


def test_stats_mlx_backend_reads_our_format(tmp_path, llama_file, capsys):
    """``stats --backend mlx`` with a static cache in our format gives the numbers of the golden case."""
    ours = tmp_path / "s.ngc"
    assert main(["convert", str(llama_file), "-o", str(ours)]) == 0
    case = vectors.load_case("s3-syn-v8-rep-static-c2048-d8")
    capsys.readouterr()
    assert main(["stats", str(vectors.local_path(case.tokens)), "--static", str(ours), "--n-ctx", "2048",
                 "--n-draft", "8", "--json", "--backend", "mlx"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["n_drafted"], out["n_accept"]) == (case.n_drafted, case.n_accept)


def test_merge_and_inspect_mlx_backend_mixed_formats(tmp_path, capsys):
    a = api.build_static(np.array([1, 2, 3, 1, 2, 4], np.int32))
    api.save_cache(a, tmp_path / "a.ngc", format="ours")
    api.save_cache(a, tmp_path / "a.bin", format="llama")
    assert main(["merge", str(tmp_path / "a.ngc"), str(tmp_path / "a.bin"), "-o", str(tmp_path / "m.bin"),
                 "--backend", "mlx"]) == 0
    assert ref.load_cache(tmp_path / "m.bin").counts[(1, 2)] == {3: 2, 4: 2}
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "a.ngc"), "--json", "--backend", "mlx"]) == 0
    assert json.loads(capsys.readouterr().out)["entries"] == 4


def test_convert_help_explains():
    with pytest.raises(SystemExit):
        main(["convert", "--help"])


@pytest.mark.parametrize("seed", range(4))
def test_describe_cache_equals_inspect_summary(seed):
    """``describe_cache`` (vectorized, for ``inspect`` on big caches) = the reference CLI's summary."""
    from mlx_backend.cli.ngram import describe
    from reference.ngram.cache import NgramCache

    rng = np.random.default_rng(seed)
    s = rng.integers(0, [3, 30, 300, 3000][seed], 2000).tolist()
    c = NgramCache()
    c.update(s, len(s))
    for top in (0, 7):
        assert api.describe_cache(api.as_sorted(c), top) == describe(c.entries(), top)


def test_the_fast_backend_is_the_default_where_installed(tmp_path, capsys, monkeypatch):
    """With mlx and numba importable every n-gram command runs mlx unless told otherwise (it ran the slow
    reference before), says which ran (--json, stderr lines), and --help says what the default is."""
    from mlx_backend.machine.backends import default_backend

    monkeypatch.delenv("NGRAM_SPEC_BACKEND", raising=False)
    assert default_backend() == "mlx"
    toks = vectors.local_path("edge-rep5.i32")
    assert main(["stats", str(toks), "--n-ctx", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["backend"] == "mlx"
    assert main(["inspect", str(vectors.local_path("syn-static.bin")), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["backend"] == "mlx"
    for argv in (["create", str(toks), "-o", str(tmp_path / "c.bin")], ["merge", str(tmp_path / "c.bin"), "-o",
                 str(tmp_path / "m.bin")], ["convert", str(tmp_path / "c.bin"), "-o", str(tmp_path / "c.ngc")]):
        assert main(argv) == 0
        assert "backend mlx" in capsys.readouterr().err, argv
    monkeypatch.setenv("NGRAM_SPEC_BACKEND", "reference")
    assert main(["stats", str(toks), "--n-ctx", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["backend"] == "reference"
    for command in ("create", "stats", "merge", "inspect", "convert"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert "else mlx where mlx and numba are installed, else reference" in " ".join(
            capsys.readouterr().out.split()), command


@pytest.mark.parametrize("backend", ["reference", "mlx"])
def test_every_command_reads_both_formats_with_either_backend(tmp_path, llama_file, capsys, backend):
    """Our format and llama.cpp's give the same results on both backends (the reference refused ours)."""
    ours = tmp_path / "s.ngc"
    assert main(["convert", str(llama_file), "-o", str(ours), "--to", "ours", "--backend", "mlx"]) == 0
    toks = vectors.local_path("edge-rep5.i32")
    results = []
    for cache in (llama_file, ours):
        assert main(["inspect", str(cache), "--json", "--backend", backend]) == 0
        inspected = json.loads(capsys.readouterr().out)
        assert main(["stats", str(toks), "--n-ctx", "8", "--static", str(cache), "--json", "--backend", backend]) == 0
        stats = json.loads(capsys.readouterr().out)
        merged = tmp_path / f"m-{cache.name}.bin"
        assert main(["merge", str(cache), str(llama_file), "-o", str(merged), "--backend", backend]) == 0
        back = tmp_path / f"c-{cache.name}.bin"
        assert main(["convert", str(cache), "-o", str(back), "--to", "llama", "--backend", backend]) == 0
        capsys.readouterr()
        results.append(({k: v for k, v in inspected.items() if k != "file"},
                        {k: stats[k] for k in ("n_drafted", "n_accept", "n_draft_calls")},
                        merged.read_bytes(), back.read_bytes()))
    assert results[0] == results[1]
    assert ref.load_cache(tmp_path / "c-s.ngc.bin") == ref.load_cache(llama_file)


def test_convert_to_ours_needs_the_fast_backend(tmp_path, llama_file, capsys):
    assert main(["convert", str(llama_file), "-o", str(tmp_path / "x.ngc"), "--backend", "reference"]) == 2
    assert "--to ours needs --backend mlx" in capsys.readouterr().err


def test_convert_writes_only_its_output(tmp_path, llama_file, capsys, monkeypatch):
    """Before: converting a llama.cpp-format file also left a second copy of it in our format in the user's
    cache folder (``converted/``, as any load of such a file does), and said so."""
    monkeypatch.setenv("NGRAM_SPEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("NGRAM_SPEC_NO_CONVERTED_COPY", raising=False)
    out = tmp_path / "s.ngc"
    assert main(["convert", str(llama_file), "-o", str(out)]) == 0
    assert "converted" not in capsys.readouterr().err
    assert not (tmp_path / "cache").exists() or list((tmp_path / "cache").rglob("*")) == []
    assert api.load_cache(out).entries() == ref.load_cache(llama_file).entries()
