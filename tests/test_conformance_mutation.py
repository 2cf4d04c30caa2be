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
