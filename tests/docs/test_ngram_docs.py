"""Runs every command and snippet of docs/ngram.md (in order, in a scratch directory that sees the
repository's reference/ and conformance/ folders)."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from mlx_backend.cli import main

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "ngram.md"


def blocks(text: str) -> list[tuple[str, str]]:
    return re.findall(r"```(\w+)\n(.*?)```", text, flags=re.S)


@pytest.mark.slow
def test_ngram_page_runs(tmp_path, monkeypatch, capsys):
    for folder in ("reference", "conformance"):
        (tmp_path / folder).symlink_to(ROOT / folder)
    monkeypatch.chdir(tmp_path)
    found = blocks(PAGE.read_text())
    assert {lang for lang, _ in found} == {"sh", "python"}
    namespace: dict = {}
    for lang, body in found:
        if lang == "python":
            exec(compile(body, str(PAGE), "exec"), namespace)
            continue
        for line in body.splitlines():
            command, _, comment = line.partition("#")
            argv = shlex.split(command)
            assert argv[0] == "ngram-spec", line
            expected = 2 if "exits with status 2" in comment else 0
            assert main(argv[1:]) == expected, (line, capsys.readouterr().err)
    out = capsys.readouterr().out
    assert "n_accept     = " in out and "accept " in out
    # the stats command of the page reproduces llama.cpp's dump of case s3
    from conformance import vectors
    body = [x for x in Path("drafts.txt").read_text().splitlines() if not x.startswith("#")]
    assert body == vectors.dump_body(vectors.load_case("s3-syn-v8-rep-static-c2048-d8"))
