"""The n-gram API of the fast backend (``--backend mlx``): the names of ``reference.ngram.api`` on array
tables (:mod:`mlx_backend.ngram.hash_table`, :mod:`mlx_backend.ngram.sorted_cache`,
:mod:`mlx_backend.ngram.cache_file`), with the same drafts, counts and cache contents.

Caches are :class:`SortedCache` (immutable sorted arrays, memory-mapped when opened from a file of
our format) or :class:`HashTable` (the mutable context/dynamic tables). Every function also accepts
the reference's ``NgramCache`` and file paths of either format.

>>> import mlx_backend.ngram.api as api
>>> c = api.build_static([1, 2, 3, 1, 2, 4])
>>> api.cache_entries(c)
[(2, 1, 2, -1, -1, 3, 1), (2, 1, 2, -1, -1, 4, 1), (2, 2, 3, -1, -1, 1, 1), (2, 3, 1, -1, -1, 2, 1)]
>>> api.cache_entries(api.merge_caches([c, c]))[0]
(2, 1, 2, -1, -1, 3, 2)
"""
from __future__ import annotations

import os

import numpy as np

from mlx_backend.ngram import sorted_cache
from mlx_backend.ngram.hash_table import HashTable
from mlx_backend.ngram.replay import replay
from mlx_backend.ngram.cache_file import CacheFormatError, detect_format, tokenizer_fingerprint, vocab_fingerprint
from mlx_backend.ngram.caches import as_sorted, as_table, load_cache, save_cache
from mlx_backend.ngram.drafter import NgramDrafter
from mlx_backend.ngram.sorted_cache import SortedCache
from reference.ngram.cache_file import CacheFileError
from reference.ngram.cache import NgramCache  # noqa: F401  (api.NgramCache, as in reference.ngram.api)
from reference.ngram.replay import ReplayStats
from reference.ngram.tokens import read_tokens, write_tokens

NAME = "mlx"

__all__ = [
    "NAME", "CacheFileError", "CacheFormatError", "HashTable", "NgramDrafter", "ReplayStats", "SortedCache",
    "as_sorted", "as_table", "build_static", "cache_entries", "context_counts", "convert", "describe_cache",
    "detect_format", "load_cache", "merge_caches", "read_tokens", "replay", "save_cache", "tokenizer_fingerprint",
    "vocab_fingerprint", "write_tokens",
]


def build_static(tokens, progress=None) -> SortedCache:
    """The static cache of a token stream (``llama-lookup-create``: 2-grams only), built vectorized in
    chunks. ``tokens`` may also be a token file path: a raw ``.i32`` file is memory-mapped, so a corpus
    larger than memory is read chunk by chunk (memory grows with the distinct triples only).
    ``progress(done, total)`` (optional): called after each chunk with the tokens counted so far."""
    if isinstance(tokens, (str, os.PathLike)):
        path = str(tokens)
        if path.endswith((".npy", ".xz")):
            tokens = read_tokens(path)
        elif os.path.getsize(path) % 4:
            tokens = read_tokens(path)  # raises the reference's clear error
        else:
            tokens = np.memmap(path, dtype="<i4", mode="r") if os.path.getsize(path) else np.zeros(0, np.int32)
    return sorted_cache.build_static(np.asarray(tokens) if not isinstance(tokens, np.memmap) else tokens,
                                      progress=progress)


def merge_caches(caches) -> SortedCache:
    """A new cache with the counts of all ``caches`` summed (``llama-lookup-merge``)."""
    return sorted_cache.merge_caches([as_sorted(c) if not isinstance(c, HashTable) else c for c in caches])


def cache_entries(cache) -> list[tuple[int, int, int, int, int, int, int]]:
    """Canonical sorted rows ``(n, t0, t1, t2, t3, token, count)``."""
    return as_sorted(cache).entries()


def context_counts(drafter: NgramDrafter) -> HashTable:
    """The drafter's context cache ``c_ctx``."""
    return drafter.c_ctx


def convert(src, dst, to: str = "ours") -> SortedCache:
    """Convert a cache file to format ``to`` (``"ours"`` or ``"llama"``); the content is unchanged."""
    cache = load_cache(src, verify=True)
    save_cache(cache, dst, format=to)
    return cache


def describe_cache(cache, top: int = 10) -> dict:
    """What ``ngram-spec inspect`` prints (``mlx_backend.cli.ngram.describe`` of the canonical rows),
    computed on the arrays: per-size totals, the follower distribution and the ``top`` entries."""
    cache = as_sorted(cache)
    per_n, fcounts = {}, []
    for n, s in cache.sections.items():
        f = np.diff(s.offsets.astype(np.int64))
        fcounts.append(f)
        per_n[str(n)] = {"ngrams": s.n_keys, "entries": s.n_entries, "sum_counts": int(s.counts.sum(dtype=np.int64))}
    f = np.concatenate(fcounts) if fcounts else np.zeros(0, np.int64)
    sizes, freq = np.unique(f, return_counts=True)
    rows = cache.canonical_array()
    if len(rows) and top:
        pick = np.lexsort(tuple(rows[:, c] for c in range(5, -1, -1)) + (-rows[:, 6],))[:top]
        top_rows = rows[pick].tolist()
    else:
        top_rows = []
    n_keys, n_entries = len(cache), cache.n_entries()
    return {
        "ngrams": n_keys, "entries": n_entries, "sum_counts": sum(d["sum_counts"] for d in per_n.values()),
        "per_n": per_n,
        "followers": {
            "max": int(f.max()) if f.size else 0,
            "mean": n_entries / n_keys if n_keys else 0.0,
            "ngrams_with_1": int((f == 1).sum()),
            "histogram": {str(int(k)): int(v) for k, v in zip(sizes[:20], freq[:20])},
        },
        "top": [{"ngram": [t for t in r[1:5] if t != -1], "token": r[5], "count": r[6]} for r in top_rows],
    }
