"""The golden vectors: llama.cpp's own outputs for n-gram cache builds, replays and merges.

The files under ``conformance/vectors/`` are a copy of the DEV conformance vectors (their
``README.md`` says how llama.cpp produced them). Large files are shipped xz-compressed; every name
used here is the *decompressed* name (``text-a.i32``, ``cases/a1-...drafts.txt``) and the readers
find ``NAME`` or ``NAME.xz``, whichever is shipped.

>>> case = load_case("e6-rep5-c4-d16")
>>> case.tokens, case.n_ctx, case.n_draft, case.n_drafted, case.n_accept
('edge-rep5.i32', 4, 16, 16, 1)
>>> dump_body(case)[:2]
['1 0', '2 0']
>>> [c.name for c in drafting_cases()][:2]
['a1-text-a-nostatic-c4096-d16', 'a2-text-a-static-c4096-d16']
"""
from __future__ import annotations

import csv
import dataclasses
import functools
import hashlib
import json
import lzma
import os
import tempfile
from pathlib import Path

VECTOR_DIR = Path(__file__).resolve().parent / "vectors"


def shipped_path(name: str) -> Path:
    """The shipped file holding ``name`` (``name`` itself, or ``name.xz``)."""
    for candidate in (VECTOR_DIR / name, VECTOR_DIR / (name + ".xz")):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"conformance vector {name!r} not found in {VECTOR_DIR} (neither {name} nor {name}.xz)")


def read_bytes(name: str) -> bytes:
    """The decompressed content of vector file ``name``."""
    path = shipped_path(name)
    if path.suffix == ".xz" and not name.endswith(".xz"):
        with lzma.open(path) as f:
            return f.read()
    return path.read_bytes()


def read_text_lines(name: str) -> list[str]:
    """The lines of a text vector file, without their LF."""
    return read_bytes(name).decode().splitlines()


@functools.cache
def expected_sha256() -> dict[str, str]:
    """SHA-256 of each vector file's *decompressed* content, by decompressed name, from the set's own
    ``SHA256SUMS`` (shipped files) and ``inputs.json`` (decompressed inputs)."""
    sums: dict[str, str] = {}
    for line in (VECTOR_DIR / "SHA256SUMS").read_text().splitlines():
        digest, name = line.split(maxsplit=1)
        sums[name.lstrip("*")] = digest
    inputs = json.loads((VECTOR_DIR / "inputs.json").read_text())
    for entry in inputs["token_files"]:
        sums[entry["file"]] = entry["sha256"]
    for entry in inputs["cache_files"]:
        sums[entry["file"]] = entry["file_sha256"]
    return sums


def cache_dir() -> Path:
    """Where :func:`local_path` keeps decompressed copies (``$NGRAM_SPEC_CACHE_DIR`` or a temp dir)."""
    root = os.environ.get("NGRAM_SPEC_CACHE_DIR") or os.path.join(tempfile.gettempdir(), f"ngram-spec-{os.getuid()}")
    return Path(root) / "vectors"


def local_path(name: str) -> Path:
    """A plain, uncompressed file on disk holding vector ``name`` (for readers that memory-map or need
    a real path). Shipped uncompressed files are returned as they are; ``.xz`` ones are decompressed
    once into :func:`cache_dir`, checked against their expected SHA-256."""
    path = shipped_path(name)
    if path == VECTOR_DIR / name:
        return path
    digest = expected_sha256().get(name)
    target = cache_dir() / (digest[:16] if digest else "unverified") / name
    if not target.is_file():
        data = read_bytes(name)
        if digest and hashlib.sha256(data).hexdigest() != digest:
            raise ValueError(f"conformance vector {name}: SHA-256 mismatch after decompression")
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        tmp.replace(target)
    return target


@dataclasses.dataclass(frozen=True)
class Case:
    """One case of the vector set (``cases/NAME.json``); drafting-case fields are ``None`` otherwise."""

    name: str
    kind: str  # "stats", "create" or "merge"
    data: dict  # the whole case JSON
    tokens: str | None = None
    n_ctx: int | None = None
    n_draft: int | None = None
    static: str | None = None
    dynamic: str | None = None
    n_chunks: int | None = None
    n_draft_calls: int | None = None
    n_drafted: int | None = None
    n_accept: int | None = None
    int32_overflow_products: int | None = None
    body_sha256: str | None = None

    @property
    def dump_name(self) -> str:
        return f"cases/{self.name}.drafts.txt"

    @property
    def saved_dynamic(self) -> dict | None:
        """For ``--save-dynamic`` cases: file name, canonical_sha256, per_n ... of the saved cache."""
        return self.data.get("saved_dynamic")

    @property
    def output(self) -> dict | None:
        """For create/merge cases: the output cache's file name, canonical_sha256, per_n ..."""
        return self.data.get("output")

    @property
    def inputs(self) -> list[str]:
        """The input files, in command-line order."""
        return list(self.data.get("inputs_sha256", {}))


def _int_or_none(x: str) -> int | None:
    return None if x in ("", "-") else int(x)


@functools.cache
def _index() -> dict[str, dict[str, str]]:
    with open(VECTOR_DIR / "cases" / "INDEX.tsv", newline="") as f:
        return {row["case"]: row for row in csv.DictReader(f, delimiter="\t")}


def load_case(name: str) -> Case:
    """The case ``name`` (e.g. ``"a1-text-a-nostatic-c4096-d16"``, ``"create-syn-static"``)."""
    path = VECTOR_DIR / "cases" / f"{name}.json"
    if not path.is_file():
        raise FileNotFoundError(f"no conformance case {name!r} ({path} missing)")
    data = json.loads(path.read_text())
    row = _index().get(name)
    if row is None:
        return Case(name=name, kind=data["kind"], data=data)
    return Case(
        name=name, kind=row["kind"], data=data, tokens=row["tokens"], n_ctx=int(row["n_ctx"]),
        n_draft=int(row["n_draft"]), static=None if row["static"] == "-" else row["static"],
        dynamic=None if row["dynamic"] == "-" else row["dynamic"], n_chunks=int(row["n_chunks"]),
        n_draft_calls=int(row["n_draft_calls"]), n_drafted=int(row["n_drafted"]), n_accept=int(row["n_accept"]),
        int32_overflow_products=_int_or_none(row["int32_overflow_products"]), body_sha256=row["dump_body_sha256"])


def drafting_cases() -> list[Case]:
    """Every lookup-stats case of ``cases/INDEX.tsv``, in its order."""
    return [load_case(name) for name in _index()]


def all_cases() -> list[Case]:
    """Every case (stats, create, merge), sorted by name."""
    return [load_case(p.stem) for p in sorted((VECTOR_DIR / "cases").glob("*.json"))]


def dump_body(case: Case) -> list[str]:
    """The draft dump's lines ``pos k d_1 .. d_k`` without the ``#`` comment lines (and without LF)."""
    return [line for line in read_text_lines(case.dump_name) if not line.startswith("#")]


def canonical_sha256(rows) -> str:
    """SHA-256 of the canonical text (README 3.4) of ``(n, t0, t1, t2, t3, token, count)`` rows, e.g. a
    backend's ``cache_entries(cache)``; the rows are sorted here, so any order will do.

    >>> canonical_sha256([(2, 1, 1, -1, -1, 1, 3000000)]) == load_case("create-ovf-static").output["canonical_sha256"]
    True
    """
    text = "".join(" ".join(str(int(x)) for x in row) + "\n" for row in sorted(tuple(r) for r in rows))
    return hashlib.sha256(text.encode()).hexdigest()


def canonical_text_lines(name: str) -> list[str]:
    """The shipped canonical text of a small cache (``syn-static.bin`` -> ``syn-static.canon.txt``)."""
    return read_text_lines(name.removesuffix(".bin") + ".canon.txt")
