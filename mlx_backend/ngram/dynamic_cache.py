"""The dynamic n-gram cache ``c_dyn`` across runs: load, learn from this run, save atomically.

As llama.cpp's lookup example (``--lookup-cache-dynamic``): ``c_dyn`` is loaded before generation
(empty if the file does not exist yet), used read-only for drafting, and at the end the run's
context cache ``c_ctx`` is merged into it and the result written back with
:func:`reference.atomic.atomic_write` (a temporary file in the same directory, fsync'ed, renamed over
the old one), so an interrupted run leaves either the old or the new cache, never a truncated one.

>>> import tempfile, os, reference.ngram.api as api
>>> path = os.path.join(tempfile.mkdtemp(), "dyn.bin")
>>> c_dyn = load_dynamic(path, api)          # no file yet: an empty cache
>>> api.cache_entries(c_dyn)
[]
>>> run = api.NgramDrafter(c_dyn=c_dyn); run.reset([5, 6, 7, 5, 6])
>>> learned = save_dynamic(path, c_dyn, run.c_ctx, api)
>>> api.cache_entries(load_dynamic(path, api)) == api.cache_entries(learned)
True
"""
from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType

#: ``ngram-spec serve --dynamic-max-entries``'s default: the (n-gram, follower) entries one dynamic cache keeps
#: (``NgramSpeculator``). Unbounded (llama.cpp's), a server-wide cache grew by 1.2 (source code) to 4.0 (random
#: tokens) entries, 148 to 591 bytes, per learned token (5 M tokens: 0.74 / 2.95 GB, a save 6 / 25 s; measured,
#: docs/server.md). At this bound it stays 300-360 MB and a save about 1 s, and the entries dropped are the
#: least counted (seen once: alone, none drafts, llama.cpp's dynamic cache needs an n-gram seen 2 to 4 times).
DYNAMIC_MAX_ENTRIES = 2**21


def check_max_entries(n) -> None:
    """Refuse a bad ``--dynamic-max-entries`` (ValueError, one line).

    >>> check_max_entries(-1)
    Traceback (most recent call last):
    ...
    ValueError: --dynamic-max-entries must be an integer >= 0 (0: no limit, llama.cpp's unbounded cache), got -1
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"--dynamic-max-entries must be an integer >= 0 (0: no limit, llama.cpp's unbounded "
                         f"cache), got {n!r}")


def _api(api: ModuleType | None) -> ModuleType:
    if api is None:
        from mlx_backend.ngram.default import ngram_api
        api = ngram_api()
    return api


def load_dynamic(path: str | os.PathLike, api: ModuleType | None = None):
    """The cache stored at ``path``, or an empty cache if there is no such file yet. Every array is
    checked (the mlx backend's ``verify``; the reference parses the whole file anyway): the cache is
    written back, so a damaged one must stop the run, not be copied into the new file."""
    api = _api(api)
    if not Path(path).exists():
        return api.merge_caches([])
    if hasattr(api, "detect_format"):   # the mlx backend maps our format lazily unless asked to check
        return api.load_cache(path, verify=True)
    return api.load_cache(path)


def save_dynamic(path: str | os.PathLike, c_dyn, c_ctx, api: ModuleType | None = None, *, ours: bool = False,
                 tokenizer: tuple[int, bytes] | None = None):
    """Merge ``c_ctx`` into (a copy of) ``c_dyn``, write it to ``path`` atomically, return it. The file
    keeps its format: a file of our format is written in ours, any other (or a new one) in llama.cpp's;
    ``ours`` (the mlx backend): always in ours, which later loads map without a converted copy. A file of
    our format records ``tokenizer`` (``(vocab_size, fingerprint)``, the one the ids are of; None: what the
    caches record), so that a later run with another tokenizer refuses it (llama.cpp's format has no room)."""
    api = _api(api)
    learned = api.merge_caches([c for c in (c_dyn, c_ctx) if c is not None])
    if hasattr(api, "detect_format") and (ours or Path(path).is_file() and api.detect_format(path) == "ours"):
        if tokenizer is not None:
            learned.vocab_size, learned.fingerprint = tokenizer
        api.save_cache(learned, path, format="ours")
    else:
        api.save_cache(learned, path)  # both backends write through reference.atomic.atomic_write
    return learned
