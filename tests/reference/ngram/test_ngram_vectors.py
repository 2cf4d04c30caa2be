"""conformance.vectors: finding, decompressing and describing the golden vectors."""
from __future__ import annotations

import doctest
import hashlib

import pytest

from conformance import vectors


def test_doctests():
    result = doctest.testmod(vectors, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 4 and result.failed == 0


def test_local_path_decompresses_and_verifies(tmp_path, monkeypatch):
    monkeypatch.setenv("NGRAM_SPEC_CACHE_DIR", str(tmp_path))
    path = vectors.local_path("ovf.i32")  # shipped as ovf.i32.xz
    assert path.is_relative_to(tmp_path) and path.name == "ovf.i32"
    assert hashlib.sha256(path.read_bytes()).hexdigest() == vectors.expected_sha256()["ovf.i32"]
    assert vectors.local_path("ovf.i32") == path  # cached
    assert vectors.local_path("edge-neg.i32") == vectors.VECTOR_DIR / "edge-neg.i32"  # shipped plain


def test_local_path_rejects_a_corrupt_copy(tmp_path, monkeypatch):
    monkeypatch.setenv("NGRAM_SPEC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(vectors, "read_bytes", lambda name: b"\0\0\0\0")
    with pytest.raises(ValueError, match="SHA-256 mismatch"):
        vectors.local_path("ovf.i32")


def test_missing_vector():
    with pytest.raises(FileNotFoundError, match="not found"):
        vectors.shipped_path("nope.i32")
    with pytest.raises(FileNotFoundError, match="no conformance case"):
        vectors.load_case("nope")


def test_cases_are_complete():
    drafting = vectors.drafting_cases()
    assert len(drafting) == 19
    kinds = {c.kind for c in vectors.all_cases()}
    assert kinds == {"stats", "create", "merge"}
    for case in drafting:
        assert len(vectors.dump_body(case)) == case.n_draft_calls
        for name in [case.tokens, case.static, case.dynamic]:
            if name:
                vectors.shipped_path(name)
