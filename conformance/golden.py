"""llama.cpp's golden outputs as the checks use them: tokens, caches, draft dump lines, differences.

The files ship inside the package (``conformance/vectors/``, read by :mod:`conformance.vectors`), so
this works from an installed wheel. Which cases a run uses: :data:`DEFAULT_CASES` in a default run,
every case with ``--thorough``.
"""
from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence

import numpy as np

from conformance import llama_format, vectors
from conformance.oracle import Cache

# Drafting cases replayed in a default run (small or synthetic: < 1 s each with the reference).
DEFAULT_CASES = ("e1-len1-c4096-d16", "e2-len2-c4096-d16", "e3-len5-c4096-d16", "e6-rep5-c4-d16",
                 "e7-rep5-c2-d16", "e8-neg-dyn-c8-d16", "edge-neg-dyn-build", "e4-len8192-c4096-d16",
                 "s3-syn-v8-rep-static-c2048-d8")


def tokens(name: str) -> list[int]:
    """A token file of the vector set as a list of ids."""
    return np.frombuffer(vectors.read_bytes(name), dtype="<i4").tolist()


def oracle_cache(name: str) -> Cache:
    """A cache file of the vector set, parsed independently of the backend."""
    return llama_format.from_bytes(vectors.read_bytes(name))


def backend_cache(impl, name: str | None):
    """A cache file of the vector set loaded by the backend (``None`` for no cache)."""
    return None if name is None else impl.load_cache(str(vectors.local_path(name)))


def to_backend(impl, cache: Cache | None):
    """Hand ``cache`` to the backend the way a user would: as a llama.cpp cache file it loads. An empty
    cache is handed as no cache (``None``, the same drafts): its file would be empty, which our backends
    refuse (docs/spec-map.md)."""
    if not cache:
        return None
    fd, path = tempfile.mkstemp(suffix=".bin", prefix="ngram-spec-conformance-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(llama_format.to_bytes(cache))
        return impl.load_cache(path)
    finally:
        os.unlink(path)


def dump_line(pos: int, drafts: Sequence[int]) -> str:
    """A draft dump line: ``pos k d_1 .. d_k``."""
    return " ".join(map(str, [pos, len(drafts), *drafts]))


def first_difference(got: Sequence[str], want: Sequence[str], what: str) -> str | None:
    """``None`` if equal, else where ``got`` first departs from ``want``, in words."""
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            return f"{what}: call {i + 1} of {len(want)} differs: expected '{w}', got '{g}'"
    if len(got) != len(want):
        return f"{what}: {len(got)} draft calls, expected {len(want)}"
    return None
