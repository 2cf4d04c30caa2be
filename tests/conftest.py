"""Shared fixtures: the golden vectors of llama.cpp's n-gram code (conformance/vectors/)."""
from __future__ import annotations

import functools

import pytest

from conformance import vectors
from reference.ngram.cache_file import load_cache
from reference.ngram.cache import NgramCache
from reference.ngram.tokens import read_tokens


@functools.cache
def _vector_cache(name: str) -> NgramCache:
    return load_cache(vectors.shipped_path(name))


@pytest.fixture(scope="session")
def vector_cache():
    """``vector_cache("static-small.bin")``: a vector cache file loaded once per session by the reference
    (treat it as read-only: ``.copy()`` before modifying)."""
    return _vector_cache


@pytest.fixture(scope="session")
def vector_tokens():
    """``vector_tokens("text-a.i32")``: a vector token file as an int32 array."""
    return lambda name: read_tokens(vectors.shipped_path(name))
