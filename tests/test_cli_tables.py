"""``ngram-spec convert`` and the n-gram commands with ``--backend mlx`` on files of either format."""
from __future__ import annotations

import json

import numpy as np
import pytest

import mlx_backend.api as api
import reference.api as ref
from conformance import vectors
from reference.cli import main


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
    from reference.cli.ngram import describe
    from reference.ngram_cache import NgramCache

    rng = np.random.default_rng(seed)
    s = rng.integers(0, [3, 30, 300, 3000][seed], 2000).tolist()
    c = NgramCache()
    c.update(s, len(s))
    for top in (0, 7):
        assert api.describe_cache(api.as_sorted(c), top) == describe(c.entries(), top)
