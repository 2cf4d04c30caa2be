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
    text = mutation.config_text("reference/draft.py", "reference", ("drafting", "replay"), 7, 60.0)
    command = next(line for line in text.splitlines() if line.startswith("test-command"))
    assert command.endswith('-m conformance --backend reference --seed 7 -q --area drafting --area replay"')
    assert "--thorough" not in command and 'module-path = "reference/draft.py"' in text


def test_report_of_a_session_with_nothing_run(tmp_path):
    table = mutation.report(tmp_path, ["reference/draft.py"])
    assert "| `reference/draft.py` | 0 | 0 | 0 | 0 | - |" in table and "none" in table


def test_mutants_inside_annotations_are_found_and_nothing_else():
    source = (mutation.ROOT / "reference/draft.py").read_text().splitlines()
    spans = mutation.annotation_spans("reference/draft.py")
    line = next(i for i, text in enumerate(source, 1) if text.startswith("def draft("))
    col = source[line - 1].index("| None")
    assert any(a <= (line, col) < b for a, b in spans)  # the | of "c_dyn: NgramCache | None"
    body = next(i for i, text in enumerate(source, 1) if "y_best = min(part_st" in text)
    assert not any(a[0] <= body <= b[0] for a, b in spans)
