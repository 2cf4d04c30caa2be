"""Where numba keeps the machine code of ngram-spec's kernels (``njit(cache=True)``): ``$NUMBA_CACHE_DIR``
when set, else ``<cache_dir()>/numba`` (:mod:`mlx_backend.machine.user_cache`), never numba's default
``__pycache__`` beside the modules.

Why: in an installed (not editable) package those files are in no record of pip's, so an uninstall
leaves ``site-packages/mlx_backend/**/__pycache__`` behind, an empty namespace package that then
shadows an editable install (the README's two quickstart commands run in one environment gave
``No module named 'mlx_backend.ngram.dynamic_cache'`` everywhere but in the clone). The kernels'
modules import ``njit`` from here, so the place is set before any kernel is decorated (numba picks
a kernel's cache folder then).
"""
from __future__ import annotations

from numba import config, njit

from mlx_backend.machine.user_cache import cache_dir

if not config.CACHE_DIR:   # $NUMBA_CACHE_DIR, read by numba at its import
    config.CACHE_DIR = str(cache_dir() / "numba")

__all__ = ["njit"]
