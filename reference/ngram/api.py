"""The n-gram API of the reference backend (``--backend reference``).

``mlx_backend.machine.backends.get_backend(name)`` returns this module or ``mlx_backend.ngram.api``; both export the
same names, so commands and tests are written once for either backend.

>>> import reference.ngram.api as api
>>> c = api.build_static([1, 2, 3, 1, 2, 4])
>>> api.cache_entries(c)
[(2, 1, 2, -1, -1, 3, 1), (2, 1, 2, -1, -1, 4, 1), (2, 2, 3, -1, -1, 1, 1), (2, 3, 1, -1, -1, 2, 1)]
>>> api.cache_entries(api.merge_caches([c, c]))[0]
(2, 1, 2, -1, -1, 3, 2)
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from reference.ngram.cache_file import CacheFileError, load_cache, save_cache
from reference.ngram.drafter import NgramDrafter
from reference.ngram.cache import LLAMA_NGRAM_STATIC, NgramCache
from reference.ngram.replay import ReplayStats, replay
from reference.ngram.tokens import check_token_list, read_tokens, write_tokens

NAME = "reference"
BUILD_BLOCK = 1 << 20  # tokens per progress report of build_static

__all__ = [
    "NAME", "CacheFileError", "NgramCache", "NgramDrafter", "ReplayStats", "build_static", "cache_entries",
    "load_cache", "merge_caches", "read_tokens", "replay", "save_cache", "write_tokens",
]


def build_static(tokens: Sequence[int], progress: Callable[[int, int], None] | None = None) -> NgramCache:
    """The static cache of a token stream, as ``llama-lookup-create`` builds it (lookup-create.cpp:30-37):
    2-grams only, ``c_st((t[i-2], t[i-1]), t[i]) += 1`` for ``i = 2..N-1``.

    Counted block by block; ``progress(done, total)`` (optional) is called with the tokens counted so far.
    """
    inp = check_token_list(tokens)
    cache = NgramCache()
    n = LLAMA_NGRAM_STATIC
    for start in range(0, len(inp), BUILD_BLOCK):
        end = min(start + BUILD_BLOCK, len(inp))
        lo = max(0, start - n)  # the block's positions need the n tokens before them
        cache.update(inp[lo:end], end - start, n, n)  # counts positions start..end-1
        if progress is not None:
            progress(end, len(inp))
    return cache


def merge_caches(caches: Iterable[NgramCache]) -> NgramCache:
    """A new cache with the counts of all ``caches`` summed (``llama-lookup-merge``, lookup-merge.cpp:59-87);
    the inputs are not modified."""
    merged = NgramCache()
    for cache in caches:
        merged.merge(cache)
    return merged


def cache_entries(cache: NgramCache) -> list[tuple[int, int, int, int, int, int, int]]:
    """Canonical sorted rows ``(n, t0, t1, t2, t3, token, count)`` (see :meth:`NgramCache.entries`)."""
    return cache.entries()
