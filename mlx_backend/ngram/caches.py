"""Any n-gram cache as the kind a caller needs, and cache files of either format.

A cache comes as a reference ``NgramCache``, a mutable :class:`HashTable` (context and dynamic
caches), an immutable :class:`SortedCache` (static caches, memory-mapped from our format) or a
file path of either format; :func:`as_sorted` and :func:`as_table` turn any of them into the
kind needed. :func:`load_cache` reads either format (a llama.cpp-format file through a converted
copy in our format, :mod:`mlx_backend.ngram.converted_copy`), :func:`save_cache` writes either.

>>> import tempfile, os
>>> d = tempfile.mkdtemp()
>>> c = as_sorted(NgramCache({(1, 2): {3: 1, 4: 1}}))
>>> save_cache(c, os.path.join(d, "c.ngc"), format="ours")
>>> save_cache(c, os.path.join(d, "c.bin"), format="llama")
>>> load_cache(os.path.join(d, "c.ngc")) == load_cache(os.path.join(d, "c.bin")) == c
True
"""
from __future__ import annotations

import os

import numpy as np

from mlx_backend.ngram.cache_file import (FORMATS, INT32_MAX, check_tokenizer, detect_format, open_ours,
                                          save_llama, save_ours)
from mlx_backend.ngram.converted_copy import load_via_copy
from mlx_backend.ngram.hash_table import HashTable, ngram_words
from mlx_backend.ngram.sorted_cache import SortedCache, cache_from_rows, from_table
from reference.ngram.cache import NgramCache


def from_reference(cache: NgramCache) -> SortedCache:
    """The sorted form of a reference ``NgramCache``."""
    rows = [(eta, y, c) for eta, part in cache.counts.items() for y, c in part.items()]
    if not rows:
        return SortedCache()
    words = np.array([ngram_words(eta) for eta, _, _ in rows], np.int64)
    return cache_from_rows(words[:, 0], words[:, 1], [y for _, y, _ in rows], [c for _, _, c in rows])


def as_sorted(cache) -> SortedCache:
    """``cache`` as a :class:`SortedCache` (``None`` -> empty; a path is loaded, either format)."""
    if cache is None:
        return SortedCache()
    if isinstance(cache, SortedCache):
        return cache
    if isinstance(cache, HashTable):
        return from_table(cache)
    if isinstance(cache, NgramCache):
        return from_reference(cache)
    if isinstance(cache, (str, os.PathLike)):
        return load_cache(cache)
    raise TypeError(f"not a cache: {type(cache).__name__}")


def as_table(cache, copy: bool = True) -> HashTable:
    """``cache`` as a mutable :class:`HashTable` (copied unless ``copy=False`` and it already is one)."""
    if isinstance(cache, HashTable):
        return cache.copy() if copy else cache
    return as_sorted(cache).to_hash_table()


def load_cache(path: str | os.PathLike, *, verify: bool = False, vocab_size: int | None = None,
               fingerprint: bytes | None = None, keep_copy: bool = True) -> SortedCache:
    """A cache file of either format, detected from its first bytes. ``vocab_size``/``fingerprint``:
    the tokenizer the caller uses; a file of our format that records a different one is refused.
    A llama.cpp-format file is read once and then mapped from a copy in our format
    (:mod:`mlx_backend.ngram.converted_copy`; the result's ``converted_copy`` says which), unless
    ``keep_copy=False``: then it is read itself and no copy is used or kept (``ngram-spec convert``)."""
    if str(path).endswith(".xz") or detect_format(path) == "llama":
        cache = load_via_copy(path, verify=verify, keep_copy=keep_copy)
    else:
        cache = open_ours(path, verify=verify)
    check_tokenizer(cache, path, vocab_size, fingerprint)
    return cache


def save_cache(cache, path: str | os.PathLike, format: str = "llama") -> None:
    """Write ``cache`` (a :class:`SortedCache`, a ``HashTable`` or a reference ``NgramCache``) in
    ``format`` ``"llama"`` (llama.cpp's, the default: a drop-in for the reference) or ``"ours"``."""
    cache = as_sorted(cache)
    if format == "ours":
        save_ours(cache, path)
    elif format == "llama":
        for s in cache.sections.values():
            if s.n_entries and int(s.counts.max()) > INT32_MAX:
                raise ValueError("counts must fit in int32")
        save_llama(cache, path)
    else:
        raise ValueError(f"unknown cache format {format!r}; choose one of {', '.join(FORMATS)}")
