"""``python -m conformance`` / ``ngram-spec conformance`` end to end: the report, the JSON, exit
codes, backends named ``module.path:object``, not-applicable areas, and the wheel's contents."""
from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conformance.cli import main as conformance_main
from mlx_backend.cli import main as ngram_spec_main

ROOT = Path(__file__).resolve().parents[2]
META = ROOT / "tests" / "conformance" / "meta"


def run(*args, env=None):
    """``python -m conformance ARGS`` in a subprocess (tests/conformance/meta importable for its example backends;
    the caller's PYTHONPATH kept, so CI's run against the oldest allowed hypothesis reaches it)."""
    path = [str(META), str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), **(env or {})}
    return subprocess.run([sys.executable, "-m", "conformance", *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=600)


def test_broken_backend_fails_with_example_seed_and_json(tmp_path):
    out = tmp_path / "report.json"
    p = run("--backend", "example_backends:truncating", "--seed", "7", "--area", "drafting", "--json", str(out))
    assert p.returncode == 1, p.stdout + p.stderr
    text = p.stdout
    assert "drafting and fallback            FAILED" in text
    assert "smallest failing example: drafts_follow_the_rules_context_only(" in text
    assert ("reproduce: python -m conformance --backend example_backends:truncating --seed 7 "
            "--check drafting.drafts_follow_the_rules_context_only") in text
    assert "FAILED: 4 of 6 checks failed" in text
    report = json.loads(out.read_text())
    assert report["passed"] is False and report["seed"] == 7
    areas = {a["area"]: a for a in report["areas"]}
    assert areas["drafting"]["status"] == "failed" and areas["counts"]["status"] == "not selected"
    failed = [c for c in areas["drafting"]["checks"] if c["status"] == "failed"]
    assert {c["id"] for c in failed} == {"drafting.drafts_follow_the_rules_context_only",
                                          "drafting.golden_draft_dumps", "drafting.golden_draft_dumps_text",
                                          "drafting.long_drafts_and_negative_lengths"}
    assert all(c["message"] and c["seed"] == 7 for c in failed)


def test_exitfirst_stops_at_the_first_failed_check(tmp_path):
    out = tmp_path / "report.json"
    p = run("--backend", "example_backends:truncating", "--seed", "7", "--area", "drafting", "-x", "--json", str(out))
    assert p.returncode == 1, p.stdout + p.stderr
    checks = [c for a in json.loads(out.read_text())["areas"] for c in a["checks"]]
    assert [c["status"] for c in checks][-1] == "failed"
    assert sum(c["status"] == "failed" for c in checks) == 1 and len(checks) < 4


def test_reproduce_line_reproduces_the_same_example():
    args = ["--backend", "example_backends:truncating", "--seed", "7", "--check",
            "thresholds.tiny_vocabulary_context_only"]
    first, second = run(*args), run(*args)
    example = re.search(r"smallest failing example: (.*?)\n    reproduce", first.stdout, re.S)
    assert example and example.group(1) in second.stdout


def test_smallest_example_is_the_shrunk_one_as_drawn():
    """The runner records the example itself (no hypothesis prose): the shrunk one, as drawn before the
    backend could mutate it."""
    from hypothesis import strategies as st

    from conformance.backend import Backend
    from conformance.registry import Check
    from conformance.runner import FAILED, Options, run_check

    def sum_at_most_100(impl, xs):
        total = sum(xs)
        xs.clear()  # a backend that mutates its input must not change the example shown
        if total > 100:
            raise AssertionError(f"sum {total}")

    check = Check("drafting", "sum_at_most_100", "sums stay small", sum_at_most_100,
                  given={"xs": st.lists(st.integers(0, 1000))}, examples=200)
    result = run_check(check, Backend("none", object()), Options(seed=3))
    assert result.status == FAILED and result.message == "sum 101"
    assert result.example == "sum_at_most_100(xs=[101])"


def test_missing_members_are_not_applicable_not_passed(tmp_path):
    out = tmp_path / "r.json"
    p = run("--backend", "example_backends:drafter_only", "--seed", "1", "--examples", "3",
            "--area", "counts", "--area", "drafting", "--area", "cache_files", "--json", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    assert re.search(r"cache files\s+not applicable\s+3 not applicable", p.stdout)
    assert "(the backend does not provide load_cache)" in p.stdout
    status = {a["area"]: a["status"] for a in json.loads(out.read_text())["areas"]}
    assert status == {"counts": "not applicable", "drafting": "passed", "thresholds": "not selected",
                      "cache_files": "not applicable", "replay": "not selected", "suffix": "not selected",
                      "rollback": "not selected",
                      "greedy": "not selected", "sampling": "not selected"}


def test_bad_backend_names_are_explained(capsys):
    assert conformance_main(["--backend", "no_such_module_xyz"]) == 2
    assert "use reference, mlx, or module.path:object" in capsys.readouterr().err
    assert conformance_main(["--backend", "json"]) == 2  # importable, but not a backend
    assert "provides none of the protocol members" in capsys.readouterr().err


def test_a_backend_module_that_fails_to_import_is_one_line(tmp_path, monkeypatch, capsys):
    """Whatever a backend's module raises on import is one line with its place (before: a traceback and exit 1
    for anything but ImportError; a missing dependency blamed the backend's name)."""
    (tmp_path / "port_syntax.py").write_text("def f(:\n")
    (tmp_path / "port_raises.py").write_text("x = 1\nraise RuntimeError('no GPU here')\n")
    (tmp_path / "port_needs.py").write_text("import no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    expected = {"port_syntax": f"importing 'port_syntax' raised SyntaxError: invalid syntax (at {tmp_path}/port_syntax.py:1)",
                "port_raises": f"importing 'port_raises' raised RuntimeError: no GPU here (at {tmp_path}/port_raises.py:2)",
                "port_needs": "importing 'port_needs' raised ModuleNotFoundError: No module named 'no_such_dependency_xyz' "
                              f"(at {tmp_path}/port_needs.py:1)"}
    for module, message in expected.items():
        assert conformance_main(["--backend", f"{module}:backend"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err


def test_a_backend_module_not_found_says_where_modules_are_looked_for(capsys):
    """The module itself not found: the fix is the import path (``ngram-spec`` and pytest do not look in the
    current folder as ``python -m`` does); an attribute missing deep in the object names the missing part."""
    assert conformance_main(["--backend", "no_such_port_xyz:backend"]) == 2
    assert "no module named 'no_such_port_xyz'" in (err := capsys.readouterr().err) and "PYTHONPATH" in err, err
    assert conformance_main(["--backend", "conformance.adapters.reference:NgramDrafter.no_such"]) == 2
    assert "conformance.adapters.reference:NgramDrafter has no attribute 'no_such'" in capsys.readouterr().err


def test_a_run_that_no_selected_check_can_run_on_is_refused(monkeypatch, capsys):
    """Every selected check not applicable (a module named instead of its protocol object, an area the backend
    lacks) is a usage error before the run (before: "PASSED: no check failed (0 of 8 ran)", exit 0)."""
    monkeypatch.syspath_prepend(str(META))
    assert conformance_main(["--backend", "example_backends:drafter_only", "--area", "counts"]) == 2
    captured = capsys.readouterr()
    assert "PASSED" not in captured.out, captured.out
    assert ("none of the 8 selected checks can run: each needs a member that backend "
            "'example_backends:drafter_only' lacks (it provides only NgramDrafter)") in captured.err, captured.err


def test_a_backend_declines_an_architecture_with_not_implemented_error(monkeypatch, capsys):
    """A port that runs llama models only raises NotImplementedError from load_model for the others: the model
    checks run on llama and say what they left out (before: 10 of 12 failed with "raised NotImplementedError");
    a port that runs no model yet gets the model areas not applicable and exit 2, nothing checked."""
    monkeypatch.syspath_prepend(str(META))
    args = ["--seed", "1", "--examples", "5", "--area", "rollback", "--area", "greedy"]
    assert conformance_main(["--backend", "example_backends:llama_only", *args]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "PASSED: no check failed (13 of 14 ran and passed)" in out, out[-3000:]
    assert ("greedy.draft_max_0_is_plain_decoding: not run on the tiny qwen3_5, qwen3_next models, which the "
            "backend does not support (load_model raised NotImplementedError: this backend supports only llama, "
            "not qwen3_5; ...)") in out, out[-3000:]
    # which unsupported models a property check drew (then rejected) depends on hypothesis's release: one at least
    assert re.search(r"rollback\.forward_equals_the_reference: examples drawn without the tiny (qwen3_5|qwen3_next)",
                     out), out[-3000:]
    assert conformance_main(["--backend", "example_backends:no_models", *args]) == 2
    out = " ".join(capsys.readouterr().out.split())
    assert "state rollback not applicable 4 not applicable (the tiny llama, llama_sliding, qwen3_5, qwen3_next" in out
    assert "NOTHING CHECKED: none of the 14 checks ran" in out and "PASSED" not in out, out[-3000:]


def test_the_rule_shown_is_the_whole_first_paragraph(capsys):
    """A rule whose first sentence spans lines is shown whole (before: cut at its first source line,
    "...; a sum past")."""
    assert conformance_main(["--list", "--check", "counts.merged_counts_past_16_and_31_bits"]) == 0
    listed = " ".join(capsys.readouterr().out.split())
    assert ("a sum past 2^31 - 1 (2^31 exactly, 2^31 + 5) is either exact or refused with an error, never "
            "wrapped. [needs load_cache") in listed, listed


def test_help_names_the_usage_exit_and_the_import_path(capsys):
    with pytest.raises(SystemExit):
        conformance_main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "2 for a usage error" in help_text and "on PYTHONPATH" in help_text, help_text


def test_pytest_entry_point_refuses_a_bad_seed_or_backend_in_one_line():
    """``pytest --pyargs conformance``: one line and pytest's usage-error exit (before: the same traceback
    for every check)."""
    for env, message in ((dict(NGRAM_SPEC_BACKEND="reference", NGRAM_SPEC_CONFORMANCE_SEED="abc"),
                          "NGRAM_SPEC_CONFORMANCE_SEED must be an integer, got 'abc'"),
                         (dict(NGRAM_SPEC_BACKEND="no_such_port_xyz:backend"), "no module named 'no_such_port_xyz'")):
        p = subprocess.run([sys.executable, "-m", "pytest", "--pyargs", "conformance", "-q", "-p", "no:cacheprovider",
                            "-k", "drafting.long_drafts"], capture_output=True, text=True, cwd=ROOT, timeout=300,
                           env={**os.environ, **env})
        assert p.returncode == 4 and message in p.stdout and "Traceback" not in p.stdout, p.stdout[-2000:]


def pytest_conformance(env, *args):
    return subprocess.run([sys.executable, "-m", "pytest", "--pyargs", "conformance", "-q", "-p", "no:cacheprovider",
                           *args], capture_output=True, text=True, cwd=ROOT, timeout=300, env={**os.environ, **env})


def test_pytest_entry_point_names_the_backend_and_fails_a_run_that_checked_nothing():
    """The first test prints the backend under test and where its name came from (before: nothing, so a
    misspelt variable ran mlx unseen); a selection whose checks all skip exits 5 with a line (before: 0,
    "1 skipped"), as python -m conformance refuses it."""
    p = pytest_conformance({"NGRAM_SPEC_BACKEND": "reference"}, "-k", "drafting.long_drafts")
    assert p.returncode == 0, p.stdout[-2000:]
    assert "conformance: backend 'reference' (conformance.adapters.reference) ($NGRAM_SPEC_BACKEND)" in p.stdout
    p = pytest_conformance({"NGRAM_SPEC_BACKEND": "reference"}, "-k", "sampling")   # the reference does not sample
    assert p.returncode == 5, p.stdout[-2000:]
    assert "conformance: no selected check ran against backend 'reference'" in p.stdout, p.stdout[-2000:]


@pytest.mark.parametrize("value, ok", [("false", True), ("off", True), ("TRUE", True), ("maybe", False)])
def test_pytest_entry_point_reads_thorough_as_a_yes_or_no(value, ok):
    """NGRAM_SPEC_CONFORMANCE_THOROUGH=false meant the thorough run (anything but "" and "0" did); now the
    usual words for yes and no, anything else one line and exit 4."""
    from conformance.test_conformance import read_options

    env = {"NGRAM_SPEC_BACKEND": "reference", "NGRAM_SPEC_CONFORMANCE_THOROUGH": value}
    if not ok:
        p = pytest_conformance(env, "-k", "drafting.long_drafts")
        assert p.returncode == 4 and "NGRAM_SPEC_CONFORMANCE_THOROUGH must be 1, true" in p.stdout, p.stdout[-2000:]
        return
    assert read_options(env).thorough == (value.lower() in ("true", "on"))


def test_an_empty_backend_name_is_refused(capsys):
    """``--backend ""`` silently ran the default backend."""
    assert conformance_main(["--backend", " ", "--area", "counts"]) == 2
    assert "an empty backend name names no backend" in capsys.readouterr().err


def test_environment_variable_selects_the_backend():
    p = run("--check", "drafting.long_drafts_and_negative_lengths", "--seed", "1",
            env={"NGRAM_SPEC_BACKEND": "example_backends:drafter_only"})
    assert "backend 'example_backends:drafter_only'" in p.stdout and p.returncode == 0


def test_ngram_spec_conformance_subcommand(capsys):
    with pytest.raises(SystemExit) as exc:
        ngram_spec_main(["conformance", "--help"])
    assert exc.value.code == 0
    help_text = capsys.readouterr().out
    assert "--backend" in help_text and "not applicable" in help_text and "--thorough" in help_text
    assert ngram_spec_main(["conformance", "--backend", "reference", "--list"]) == 0
    assert "cache_files.golden_files_load" in capsys.readouterr().out


@pytest.mark.slow
def test_reference_passes_the_default_run(tmp_path):
    out = tmp_path / "r.json"
    p = run("--backend", "reference", "--json", str(out))
    assert p.returncode == 0, p.stdout[-3000:]
    status = {a["area"]: a["status"] for a in json.loads(out.read_text())["areas"]}
    assert status.pop("sampling") == "not applicable"  # the reference decodes greedily only
    assert set(status.values()) == {"passed"}, status


@pytest.mark.slow
@pytest.mark.skipif(not all(__import__("importlib").util.find_spec(m) for m in ("mlx", "mlx_lm")),
                    reason="needs mlx and mlx-lm")
def test_mlx_passes_the_default_run(tmp_path):
    out = tmp_path / "r.json"
    p = run("--backend", "mlx", "--json", str(out))
    assert p.returncode == 0, p.stdout[-3000:]
    assert {a["status"] for a in json.loads(out.read_text())["areas"]} == {"passed"}


@pytest.mark.slow
def test_wheel_ships_the_golden_vectors(tmp_path):
    """The suite must work from an installed wheel, with no repository around it."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q",
                    "-w", str(tmp_path), str(ROOT)], check=True, timeout=300)
    (wheel,) = glob.glob(str(tmp_path / "ngram_spec-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {str(p.relative_to(ROOT)) for p in (ROOT / "conformance" / "vectors").rglob("*") if p.is_file()}
    assert shipped and shipped <= names, sorted(shipped - names)[:5]
    assert {"conformance/checks/drafting.py", "conformance/adapters/mlx.py", "conformance/__main__.py"} <= names


def test_without_hypothesis_the_cli_still_loads_and_explains():
    """hypothesis is a test extra: ngram-spec must work without it, and conformance must say what is missing."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'hypothesis': raise ImportError('hypothesis blocked')\n"
        "sys.meta_path.insert(0, Block())\n"
        "from mlx_backend.cli import main\n"
        "sys.exit(main(['conformance', '--backend', 'reference']))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert p.returncode == 2
    assert "needs hypothesis: pip install 'ngram-spec[test]'" in p.stderr


def test_a_json_report_that_cannot_be_written_is_refused_before_the_run(tmp_path, capsys):
    """--json in a missing folder: one line at the start (before: the whole suite ran, then the open
    failed with a traceback)."""
    out = tmp_path / "nodir" / "r.json"
    assert conformance_main(["--backend", "reference", "--json", str(out)]) == 2
    captured = capsys.readouterr()
    assert "checks" not in captured.out, captured.out          # no check ran
    assert f"--json {out}: the folder {out.parent} does not exist" in captured.err, captured.err


def test_a_run_leaves_no_hypothesis_folder_where_it_was_started(tmp_path, monkeypatch, capsys):
    """hypothesis writes a ``.hypothesis/`` folder of cached constants into the working directory even with
    no example database: a user's folder gained one after every run; now it goes to a temporary folder,
    and the home directory hypothesis had before is back after the run."""
    import hypothesis.configuration as configuration

    monkeypatch.chdir(tmp_path)
    before = getattr(configuration, "__hypothesis_home_directory")
    assert conformance_main(["--backend", "reference", "--check", "counts.*", "--examples", "2", "-q"]) == 0
    capsys.readouterr()
    assert list(tmp_path.iterdir()) == []
    assert getattr(configuration, "__hypothesis_home_directory") == before


def test_a_run_keeps_no_converted_copies_of_its_temporary_files(tmp_path, monkeypatch, capsys):
    """The checks hand the backend llama.cpp-format temporary files; the mlx backend kept a copy in our format
    of each in the user's cache folder (``converted/``: ~180 files, 15 MB a run, copies of files already
    deleted) and printed a line for each. Now the run keeps none and says nothing of them."""
    monkeypatch.setenv("NGRAM_SPEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("NGRAM_SPEC_NO_CONVERTED_COPY", raising=False)
    assert ngram_spec_main(["conformance", "--backend", "mlx", "--check", "cache_files.golden_files_load",
                            "--check", "drafting.golden_draft_dumps", "-q"]) == 0
    err = capsys.readouterr().err
    assert "llama.cpp's format" not in err, err
    assert not (tmp_path / "cache" / "converted").exists()   # (vectors/: the shipped vectors, decompressed once)


def test_a_damaged_files_bytes_are_shown_a_group_per_int32_field():
    """The bytes a cache_files failure shows start a group at every 4th byte from the first, where the format's
    little-endian int32 fields start (before: bytes.hex(' ', 4) grouped from the last byte, so a file of 65
    bytes read '01 00000002 000000ff ...' for its first field 01000000)."""
    from conformance.checks.cache_files import int32_hex

    data = (1).to_bytes(4, "little") + (2).to_bytes(4, "little") + bytes([0xFF])
    assert int32_hex(data) == "01000000 02000000 ff"


def test_a_reader_that_stops_early_ends_the_listing_quietly():
    """``python -m conformance --list | head``: stdout closed by its reader is the end of the listing, exit 0 and
    nothing on stderr (before: a BrokenPipeError traceback, exit 1). Here the pipe's reading end is closed before
    the run starts, so every write fails, as the last ones do behind ``head``."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run([sys.executable, "-m", "conformance", "--list"], stdout=write_end,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)
    assert (proc.returncode, proc.stderr) == (0, "")
