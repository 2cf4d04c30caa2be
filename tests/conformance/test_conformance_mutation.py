"""The mutation campaign's set-up (conformance/mutation.py): the modules it mutates and its table."""
from __future__ import annotations

from conformance import mutation
from conformance.registry import AREAS


def test_every_rule_module_exists_and_names_real_areas():
    for module, (backend, areas) in mutation.MODULES.items():
        assert (mutation.ROOT / module).is_file(), module
        assert backend in ("reference", "mlx") and set(areas) <= set(AREAS), (module, areas)
        assert module.startswith("reference/" if backend == "reference" else "mlx_backend/")


def test_the_test_command_is_the_default_run_of_the_areas_at_a_fixed_seed():
    text = mutation.config_text("reference/ngram/draft.py", "reference", ("drafting", "replay"), 7, 60.0)
    command = next(line for line in text.splitlines() if line.startswith("test-command"))
    assert command.endswith('-m conformance --backend reference --seed 7 -q --exitfirst --area drafting --area replay"')
    assert "--thorough" not in command and 'module-path = "reference/ngram/draft.py"' in text


def test_report_of_a_session_with_nothing_run(tmp_path):
    table = mutation.report(tmp_path, ["reference/ngram/draft.py"])
    assert "| `reference/ngram/draft.py` | 0 | 0 (0) | 0 | 0 | 0 | - |" in table and "none" in table


def test_wilson_interval_holds_the_proportion_and_narrows_with_n():
    lo, hi = mutation.wilson(36, 40)
    assert lo < 0.9 < hi and 0.75 < lo and hi < 0.97
    lo2, hi2 = mutation.wilson(360, 400)
    assert lo < lo2 < 0.9 < hi2 < hi
    assert mutation.wilson(0, 0) == (0.0, 1.0) and mutation.wilson(5, 5)[1] == 1.0


def test_stratified_estimate_weighs_modules_by_size_and_is_exact_for_whole_modules():
    est, half = mutation.stratified([(900, 1.0, 30), (100, 0.5, 30)])
    assert abs(est - 0.95) < 1e-12 and 0 < half < 0.05
    est, half = mutation.stratified([(30, 0.9, 30), (10, 0.5, 10)])  # every mutant tested: no sampling error
    assert abs(est - 0.8) < 1e-12 and half == 0.0


def test_sample_keeps_n_mutants_and_the_same_ones_for_the_same_seed(tmp_path):
    import shutil
    import subprocess

    if shutil.which("cosmic-ray") is None:
        import pytest
        pytest.skip("cosmic-ray is not installed")
    picks = []
    for name in ("a", "b"):
        session = tmp_path / name
        session.mkdir()
        config, db = mutation.session_paths(session, "reference/speculative.py")
        config.write_text(mutation.config_text("reference/speculative.py", "reference", ("greedy",), 3, 60.0))
        subprocess.run(["cosmic-ray", "init", str(config), str(db)], cwd=mutation.ROOT, check=True)
        mutation.sample(db, 5, seed=3)
        from cosmic_ray.work_db import WorkDB, use_db
        with use_db(str(db), WorkDB.Mode.open) as work_db:
            picks.append(sorted((str(i.mutations[0].module_path), tuple(i.mutations[0].start_pos), i.mutations[0].operator_name,
                                 i.mutations[0].occurrence) for i in work_db.pending_work_items))
        t = mutation.tally(session, "reference/speculative.py")
        assert t["pending"] == 5 and t["not_sampled"] > 0 and t["killed"] == t["survived"] == 0
    assert picks[0] == picks[1]
    from cosmic_ray.work_item import TestOutcome, WorkerOutcome, WorkResult
    with use_db(str(db), WorkDB.Mode.open) as work_db:   # two tested: one survives, one is killed
        first, second = list(work_db.pending_work_items)[:2]
        for item, outcome in ((first, TestOutcome.SURVIVED), (second, TestOutcome.KILLED)):
            work_db.set_result(item.job_id, WorkResult(worker_outcome=WorkerOutcome.NORMAL, test_outcome=outcome,
                                                       output="", diff=""))
    assert mutation.tally(session, "reference/speculative.py")["pending"] == 3
    assert mutation.forget_survivors(session, "reference/speculative.py") == 1
    t = mutation.tally(session, "reference/speculative.py")
    assert t["pending"] == 4 and t["killed"] == 1 and t["survived"] == 0


def test_mutants_inside_annotations_are_found_and_nothing_else():
    source = (mutation.ROOT / "reference/ngram/draft.py").read_text().splitlines()
    spans = mutation.annotation_spans("reference/ngram/draft.py")
    line = next(i for i, text in enumerate(source, 1) if text.startswith("def draft("))
    col = source[line - 1].index("| None")
    assert any(a <= (line, col) < b for a, b in spans)  # the | of "c_dyn: NgramCache | None"
    body = next(i for i, text in enumerate(source, 1) if "y_best = min(part_st" in text)
    assert not any(a[0] <= body <= b[0] for a, b in spans)


def test_every_line_out_of_reach_is_a_line_of_its_module():
    """OUT_OF_REACH names surviving mutants by their original line: a line that moved or changed leaves a
    stale entry behind (and its mutant counted as unexplained)."""
    stale = [(module, line) for module, line in mutation.OUT_OF_REACH
             if line not in {x.strip() for x in (mutation.ROOT / module).read_text().splitlines()}]
    assert stale == []


def test_report_or_rerun_of_a_session_that_does_not_exist_is_one_usage_error(tmp_path, capsys):
    """Before: ``--session /tmp/typo --report`` made the folder and printed an all-zero table (exit 0), and
    ``--rerun-survivors`` started a whole new campaign there."""
    import pytest

    typo = tmp_path / "typo"
    for flag in ("--report", "--rerun-survivors"):
        with pytest.raises(SystemExit) as exit_:
            mutation.main(["--session", str(typo), flag])
        assert exit_.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert f"--session {typo}: no such session directory" in err and flag in err, err
        assert not typo.exists()
    file = tmp_path / "session.txt"
    file.write_text("")
    with pytest.raises(SystemExit) as exit_:
        mutation.main(["--session", str(file), "--report"])
    assert exit_.value.code == 2 and f"--session {file} is a file" in capsys.readouterr().err


def test_the_usage_lines_of_the_docstring_are_the_parser_s():
    """Before: the docstring showed ``--report SESSION_DIR``; --report takes no value (the session is --session)."""
    usage = [line.split("#")[0].split()[3:] for line in mutation.__doc__.splitlines()
             if line.strip().startswith("python -m conformance.mutation")]
    assert len(usage) == 5 and ["--session", "DIR", "--report"] in usage
    for argv in usage:   # a usage line the parser refuses exits 2 here
        mutation.build_parser().parse_args([a.replace("DIR", "/tmp/x") for a in argv])
