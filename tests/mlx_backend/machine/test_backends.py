"""``--backend`` / ``$NGRAM_SPEC_BACKEND`` naming nothing: one line naming the value, where it came from and
what to give instead (:func:`mlx_backend.machine.backends.get_backend`)."""
from __future__ import annotations

import pytest

from mlx_backend.cli import main
from mlx_backend.machine.backends import get_backend


def test_a_module_path_without_the_object_is_a_value_error_not_a_traceback():
    """``module.path:object`` where the module has no such object (before: ``AttributeError`` and a traceback)."""
    with pytest.raises(ValueError, match=r"backend 'os\.path:nothing': os\.path has no attribute 'nothing'"):
        get_backend("os.path:nothing")


def test_an_unknown_backend_from_the_variable_names_the_variable(monkeypatch):
    monkeypatch.setenv("NGRAM_SPEC_BACKEND", "bogus")
    with pytest.raises(ValueError, match=r"unknown backend 'bogus' \(from \$NGRAM_SPEC_BACKEND\); choose one of"):
        get_backend()
    with pytest.raises(ValueError) as given:   # a name given as --backend is not blamed on the variable
        get_backend("bogus2")
    assert "NGRAM_SPEC_BACKEND" not in str(given.value)


def test_the_command_line_prints_one_line(monkeypatch, tmp_path, capsys):
    tokens = tmp_path / "t.i32"
    tokens.write_bytes(bytes(40))
    monkeypatch.setenv("NGRAM_SPEC_BACKEND", "os.path:nothing")
    assert main(["stats", str(tokens)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ngram-spec stats: error: backend 'os.path:nothing' (from $NGRAM_SPEC_BACKEND)")
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_backend_module_that_fails_to_import_is_one_line_naming_its_error(monkeypatch, tmp_path, capsys):
    """A module found on the path that raises while importing (not an ImportError): one line with what it
    raised and where, as the conformance suite says it (one resolver for both). Before: a traceback."""
    (tmp_path / "port_raises.py").write_text("x = 1\nraise RuntimeError('no GPU here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    tokens = tmp_path / "t.i32"
    tokens.write_bytes(bytes(40))
    assert main(["stats", str(tokens), "--backend", "port_raises:api"]) == 2
    err = capsys.readouterr().err
    assert err == (f"ngram-spec stats: error: backend 'port_raises:api': importing 'port_raises' raised RuntimeError: "
                   f"no GPU here (at {tmp_path}/port_raises.py:2)\n"), err
