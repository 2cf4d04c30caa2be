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


def test_environment_variable_selects_the_backend():
    p = run("--check", "counts.static_cache_counts_2grams", "--seed", "1",
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
