"""benchmarks/edit_traces.py, the builder of the edit traces, on archives made here (no network)."""
from __future__ import annotations

import importlib.util
import io
import tarfile
import zipfile
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[3] / "benchmarks" / "edit_traces.py"
spec = importlib.util.spec_from_file_location("edit_traces", PATH)
et = importlib.util.module_from_spec(spec)
spec.loader.exec_module(et)

BODY = "".join(f"line {i} of the module\n" for i in range(40))


@pytest.mark.parametrize("before, after, n", [
    ("a\nb\nc\n", "a\nB\nc\n", 1),                # one line edited
    ("a\nb\nc\n", "a\nb\nx\ny\nz\nc\n", 3),       # three inserted
    ("a\nb\nc\nd\n", "a\nd\n", 2),                # two deleted
    ("a\nb\nc\nd\n", "a\n1\n2\n3\n4\n5\nd\n", 5),  # two replaced by five
    ("a\nb\nc\nd\ne\n", "A\nb\nc\nd\nE\n", 2),    # two separate edits
    ("same\n", "same\n", 0),
])
def test_lines_changed(before, after, n):
    assert et.lines_changed(before, after) == n


def archive_files():
    a = {"pkg/a.py": BODY, "pkg/same.py": BODY, "pkg/many.py": BODY, "PKG-INFO": "Version: 1.0\n" + BODY,
         "pkg/big.py": BODY * 20, "pkg/gone.py": BODY, "data.bin.py": b"\xff\xfe" + BODY.encode(),
         "CHANGELOG.md": "# Changes\n\n## 1.0\n\n- first\n"}
    b = dict(a)
    b["pkg/a.py"] = BODY.replace("line 7 ", "line seven ")
    b["pkg/many.py"] = BODY.replace(" of ", " in ")
    b["PKG-INFO"] = "Version: 1.1\n" + BODY
    b["pkg/big.py"] = (BODY * 20).replace("line 3 ", "line three ", 1)
    b["pkg/new.py"] = BODY
    del b["pkg/gone.py"]
    b["CHANGELOG.md"] = ("# Changes\n\n## 1.1 (2024-01-02)\n\n- Fix the `frobnicate` bug "
                         "([#12](https://example.com/12))\n- other\n\n## 1.0\n\n- first\n")
    enc = lambda d: {k: v if isinstance(v, bytes) else v.encode() for k, v in d.items()}
    return enc(a), enc(b)


def test_only_files_changed_by_1_to_max_lines_lines_and_not_too_long_are_kept():
    a, b = archive_files()
    traces = et.pair_traces("pypi:demo", "1.0", "1.1", a, b, max_lines=20, max_chars=12000)
    assert [t["path"] for t in traces] == ["pkg/a.py"]
    t = traces[0]
    assert t["output"] == b["pkg/a.py"].decode() and t["lines_changed"] == 1
    instruction, before = t["prompt"].split("\n\n", 1)
    assert before == BODY
    assert instruction.startswith("Fix the frobnicate bug.") and "`pkg/a.py`" in instruction
    assert (t["package"], t["versions"], t["language"]) == ("pypi:demo", ["1.0", "1.1"], "python")
    more = et.pair_traces("pypi:demo", "1.0", "1.1", a, b, max_lines=40, max_chars=10**6)
    assert {t["path"] for t in more} == {"pkg/a.py", "pkg/many.py", "pkg/big.py"}  # PKG-INFO, binary: never


def test_without_a_changelog_entry_the_instruction_names_the_version():
    a, b = archive_files()
    del b["CHANGELOG.md"]
    t, = et.pair_traces("npm:demo", "1.0", "1.1", a, b, max_lines=20, max_chars=12000)
    assert t["prompt"].startswith("Update demo to version 1.1.\n")


def test_archives_are_read_with_their_top_directory_stripped(tmp_path):
    tgz = tmp_path / "demo-1.0.tar.gz"
    with tarfile.open(tgz, "w:gz") as t:
        for name, data in (("demo-1.0/src/x.py", b"x = 1\n"), ("demo-1.0/README.md", b"hi\n")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    assert et.read_archive(tgz) == {"src/x.py": b"x = 1\n", "README.md": b"hi\n"}
    z = tmp_path / "demo-1.0.zip"
    with zipfile.ZipFile(z, "w") as f:
        f.writestr("demo-1.0/src/x.py", "x = 2\n")
    assert et.read_archive(z) == {"src/x.py": b"x = 2\n"}


def test_the_held_out_packages_are_refused(tmp_path):
    for spec_ in ("pypi:requests", "pypi:click", "npm:express"):
        with pytest.raises(et.BuildError, match="held out"):
            et.build({spec_: ["1", "2"]}, tmp_path, max_lines=20, max_chars=100)
    assert not set(et.HELD_OUT) & set(et.DEFAULT_RELEASES)


def test_the_default_set_has_two_languages_and_six_packages():
    assert len(et.DEFAULT_RELEASES) >= 6
    assert {s.split(":")[0] for s in et.DEFAULT_RELEASES} == {"pypi", "npm"}


def test_traces_round_trip_through_an_xz_file(tmp_path):
    a, b = archive_files()
    traces = et.pair_traces("pypi:demo", "1.0", "1.1", a, b, max_lines=40, max_chars=10**6)
    et.write_jsonl(tmp_path / "t.jsonl.xz", traces)
    assert (tmp_path / "t.jsonl.xz").read_bytes()[:6] == b"\xfd7zXZ\x00"
    assert et.read_jsonl(tmp_path / "t.jsonl.xz") == traces


def test_help_and_bad_package_names(capsys):
    with pytest.raises(SystemExit) as info:
        et.main(["--help"])
    assert info.value.code == 0 and "--latest" in capsys.readouterr().out
    assert et.main(["--package", "cargo:serde", "-o", "-"]) == 2
    assert "write pypi:NAME or npm:NAME" in capsys.readouterr().err


@pytest.fixture
def no_downloads(monkeypatch):
    """Downloading fails the test: every argument check comes first."""
    def refuse(*args, **kwargs):
        raise AssertionError("a download started before the arguments were checked")
    monkeypatch.setattr(et, "fetch", refuse)
    monkeypatch.setattr(et, "latest_versions", refuse)


def usage_error(capsys, info, *words: str) -> str:
    assert info.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("edit_traces.py: error: ") and all(w in line for w in words), line
    return line


@pytest.mark.parametrize("argv, flag", [
    (["--package", "npm:uuid"], "--package"),
    (["--package", "pypi:attrs", "--latest", "3"], "--package"),
    (["--limit-per-package", "0"], "--limit-per-package"),
    (["--max-lines", "5"], "--max-lines"),
])
def test_without_o_only_the_defaults_rebuild_the_committed_sample(no_downloads, capsys, argv, flag):
    """Other traces never overwrite benchmarks/data/edit-traces.jsonl.xz: ``-o`` is required."""
    sample = et.DEFAULT_OUTPUT.read_bytes()
    with pytest.raises(SystemExit) as info:
        et.main(argv)
    usage_error(capsys, info, flag, "needs -o FILE", "edit-traces.jsonl.xz")
    assert et.DEFAULT_OUTPUT.read_bytes() == sample


def test_without_o_the_defaults_still_rebuild_the_sample(no_downloads):
    with pytest.raises(AssertionError, match="a download started"):
        et.main([])


@pytest.mark.parametrize("where", ["missing/traces.jsonl", "."])
def test_an_output_without_its_folder_is_refused_before_any_download(tmp_path, no_downloads, capsys, where):
    with pytest.raises(SystemExit) as info:
        et.main(["--package", "npm:uuid", "-o", str(tmp_path / where)])
    usage_error(capsys, info, "-o ", "does not exist" if where != "." else "is a folder")


@pytest.mark.parametrize("value", ["-1", "-10"])
def test_a_negative_limit_per_package_is_refused(tmp_path, no_downloads, capsys, value):
    with pytest.raises(SystemExit) as info:
        et.main(["--limit-per-package", value, "-o", str(tmp_path / "t.jsonl")])
    usage_error(capsys, info, f"--limit-per-package {value}", ">= 0")
    assert not (tmp_path / "t.jsonl").exists()


def test_a_file_longer_than_max_chars_before_or_after_the_change_is_skipped():
    """``--max-chars`` caps both sides: a file that grows past it, or shrinks below it from above, is no trace."""
    long_ = BODY + "x" * 1000 + "\n"                        # BODY plus one line of 1001 characters
    a = {"grew.py": BODY.encode(), "shrank.py": long_.encode()}
    b = {"grew.py": long_.encode(), "shrank.py": BODY.encode()}
    assert et.pair_traces("pypi:demo", "1.0", "1.1", a, b, max_lines=20, max_chars=len(BODY) + 10) == []
    kept = et.pair_traces("pypi:demo", "1.0", "1.1", a, b, max_lines=20, max_chars=len(long_))
    assert [(t["path"], t["lines_changed"]) for t in kept] == [("grew.py", 1), ("shrank.py", 1)]


def test_limit_per_package_keeps_evenly_spaced_traces_of_each_package(tmp_path, monkeypatch):
    """10 traces of one package, limit 3: the 1st, 4th and 7th (every 10/3-th, in order); a package with
    fewer traces than the limit keeps them all."""
    made = {"pypi:demo": [f"p{i}" for i in range(10)], "npm:other": ["q0", "q1"]}
    monkeypatch.setattr(et, "latest_versions", lambda spec, n: ["1.0", "1.1"])
    monkeypatch.setattr(et, "build", lambda releases, cache, **kw: [
        {"package": spec, "path": path, "language": "python"} for spec in releases for path in made[spec]])
    out = tmp_path / "t.jsonl"
    assert et.main(["--package", "pypi:demo", "--package", "npm:other", "--limit-per-package", "3",
                    "-o", str(out)]) == 0
    assert [t["path"] for t in et.read_jsonl(out)] == ["p0", "p3", "p6", "q0", "q1"]


def test_changelogs_vendored_and_generated_files_are_never_traces():
    """Each of these changed by one line and long enough: only the package's own source is a trace; a
    changelog (it names the change), vendored ``node_modules``, ``.egg-info`` metadata, minified code and
    per-release metadata are not."""
    skipped = ["CHANGES.rst", "HISTORY.md", "docs/changelog.md", "node_modules/dep/index.js", "lib/node_modules/x.js",
               "demo.egg-info/SOURCES.txt", "demo.egg-info/top_level.txt", "dist/app.min.js", "package.json"]
    a = {p: BODY.encode() for p in [*skipped, "src/keep.js"]}
    b = {p: BODY.replace("line 7 ", "line seven ").encode() for p in a}
    traces = et.pair_traces("npm:demo", "1.0", "1.1", a, b, max_lines=20, max_chars=12000)
    assert [(t["path"], t["language"], t["lines_changed"]) for t in traces] == [("src/keep.js", "javascript", 1)]
