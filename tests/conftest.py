"""Shared fixtures: the golden vectors of llama.cpp's n-gram code (conformance/vectors/)."""
from __future__ import annotations

import functools
import signal

import pytest

from conformance import vectors
from reference.ngram.cache_file import load_cache
from reference.ngram.cache import NgramCache
from reference.ngram.tokens import read_tokens


def pytest_configure(config):
    """Run with Ctrl-C delivered even where the shell started pytest with SIGINT ignored (``nohup cmd &``,
    a background job of a script): the ignore is inherited by every child, so the tests that raise SIGINT
    in a child (the BLAS check, precompile's cleanup) would see no interrupt at all. A Python handler is
    reset to the default in children at exec, unlike an ignore."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


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
