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
