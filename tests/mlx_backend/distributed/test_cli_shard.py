"""``ngram-spec generate --shard`` refused before any work where it cannot run as asked (no launch).

A process alone has no ranks to share the model with (``mx.distributed.init()`` gives a group of 1),
and ``mlx.launch`` forwards its stdin to the ranks but never closes it, so ``--prompt -`` would wait
forever: both are one line on stderr and exit status 2.
"""
from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mlx_backend.cli import main
from reference.models.tiny import write_tiny_model
from reference.ngram.tokens import write_tokens

pytest.importorskip("mlx_lm")

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("shard-cli") / "qwen3_5", "qwen3_5", seed=1)


def test_shard_in_a_process_alone_is_refused(model, tmp_path, capsys):
    """Before: it ran the whole model in the one process and called it "tensor-parallel over 1 ranks"."""
    write_tokens(tmp_path / "prompt.i32", list(range(5, 25)))
    code = main(["generate", "--model", str(model), "--shard", "tensor", "--prompt-tokens",
                 str(tmp_path / "prompt.i32"), "--max-tokens", "2", "--json"])
    out, err = capsys.readouterr()
    assert code == 2 and out == "", out
    assert err.strip().splitlines() == [
        "ngram-spec generate: error: --shard splits the model over the ranks that mlx.launch starts, and this "
        "process is alone: run it as mlx.launch -n 2 --backend ring -- ngram-spec generate ... --shard tensor "
        "(docs/distributed.md), or drop --shard"]


def test_prompt_from_stdin_with_shard_is_refused(model, capsys, monkeypatch):
    """Before: every rank read stdin until an end of file that mlx.launch never sends (a hang)."""
    monkeypatch.setattr(sys, "stdin", io.StringIO("abc abc"))
    code = main(["generate", "--model", str(model), "--shard", "pipeline", "--prompt", "-", "--max-tokens", "2"])
    out, err = capsys.readouterr()
    assert code == 2 and out == "", out
    assert err.strip().splitlines() == [
        "ngram-spec generate: error: --prompt - with --shard would wait forever: mlx.launch never closes the "
        "ranks' stdin; give the text as --prompt \"$(cat FILE)\" or the token ids as --prompt-tokens FILE"]
    assert sys.stdin.read() == "abc abc"   # refused before reading it


def test_a_launch_whose_ranks_init_cannot_join_is_one_line(model, tmp_path):
    """``mlx.launch -n 1 --backend ring`` (mlx 0.32) gives its one rank a host file holding only a newline, which
    ``mx.distributed.init()`` refuses: one line naming the fix, exit status 2. Before: a traceback ending in
    'RuntimeError: [json.exception.parse_error.101] ...', exit 1."""
    hosts = tmp_path / "hosts.json"
    hosts.write_text("\n")   # what mlx.launch -n 1 writes
    proc = subprocess.run([sys.executable, "-m", "mlx_backend.cli", "generate", "--model", str(model), "--shard",
                           "tensor", "--prompt", "hi", "--blas", "bundled"], capture_output=True, text=True,
                          env=dict(os.environ, MLX_HOSTFILE=str(hosts), MLX_RANK="0", PYTHONPATH=str(ROOT)), cwd=ROOT,
                          timeout=300)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("ngram-spec generate: error: --shard: mx.distributed.init() could not join the ranks "
                               "of this launch ([json.exception.parse_error.101]")
    assert lines[0].endswith("run it as mlx.launch -n 2 --backend ring -- ngram-spec generate ... --shard tensor "
                             "(docs/distributed.md), or drop --shard")


class _Writes(io.RawIOBase):
    """A raw stream that keeps each write it is given, as the pipe to ``mlx.launch`` would receive them."""

    def __init__(self):
        self.writes: list[bytes] = []

    def writable(self):
        return True

    def write(self, b):
        self.writes.append(bytes(b))
        return len(b)


def test_a_ranks_error_line_is_written_in_one_piece(model, monkeypatch):
    """A rank under ``PYTHONUNBUFFERED=1`` (stderr's text written through at once): the error line and its newline
    reach the pipe in one write, so the launcher cannot put the other rank's line between them. Before: two
    writes, the text and then the newline."""
    raw = _Writes()
    monkeypatch.setattr(sys, "stderr", io.TextIOWrapper(raw, encoding="utf-8", write_through=True))
    monkeypatch.setenv("MLX_RANK", "1")
    assert main(["generate", "--model", str(model), "--shard", "tensor", "--prompt", "x"]) == 2  # a process alone
    sys.stderr.flush()
    assert len(raw.writes) == 1, raw.writes
    assert raw.writes[0].startswith(b"ngram-spec generate: error: --shard splits the model over the ranks")
    assert raw.writes[0].count(b"\n") == 1 and raw.writes[0].endswith(b"\n"), raw.writes
