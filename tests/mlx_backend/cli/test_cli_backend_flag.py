"""Every ``ngram-spec`` command accepts ``--backend`` (issue 9): the n-gram commands and generate choose
with it, the mlx-only commands (demo, serve, precompile) accept ``mlx`` and refuse ``reference`` with argparse's one
line, and tiny-model accepts both."""
from __future__ import annotations

import pytest

from mlx_backend.cli import build_parser

REQUIRED = {"create": ["in.i32", "-o", "out.bin"], "stats": ["in.i32"], "merge": ["a.bin", "-o", "b.bin"],
            "inspect": ["a.bin"], "generate": [], "tiny-model": ["--arch", "llama", "--out", "d"], "demo": [],
            "convert": ["a.bin", "-o", "b.bin", "--to", "llama"], "serve": [], "conformance": [], "precompile": []}


def commands() -> list[str]:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return list(sub.choices)


def test_every_command_is_covered():
    assert sorted(commands()) == sorted(REQUIRED)


@pytest.mark.parametrize("command", sorted(REQUIRED))
def test_every_command_accepts_backend_mlx(command):
    args = build_parser().parse_args([command, *REQUIRED[command], "--backend", "mlx"])
    assert args.backend == "mlx"


@pytest.mark.parametrize("command", ["demo", "serve", "precompile"])
def test_mlx_only_commands_refuse_the_reference_in_one_line(command, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([command, "--backend", "reference"])
    assert exc.value.code == 2
    assert "invalid choice: 'reference'" in capsys.readouterr().err


def test_version_prints_the_package_version(capsys, monkeypatch):
    """``--version`` / ``-V``: the installed package's version; from a source tree not installed, pyproject.toml's,
    said so (before: "error: the following arguments are required: COMMAND", exit 2)."""
    import importlib.metadata
    import tomllib
    from pathlib import Path

    from mlx_backend.cli import main

    installed = importlib.metadata.version("ngram-spec")
    for flag in ("--version", "-V"):
        with pytest.raises(SystemExit) as exc:
            main([flag])
        assert exc.value.code == 0 and capsys.readouterr().out == f"ngram-spec {installed}\n"

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)
    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    source = tomllib.loads((Path(__file__).resolve().parents[3] / "pyproject.toml").read_text())["project"]["version"]
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out == f"ngram-spec {source} (source tree, not installed)\n"
