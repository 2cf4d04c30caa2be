"""The n-gram implementation generation uses by default: the array tables (:mod:`mlx_backend.ngram.api`)
where numba is installed, else the reference's (:mod:`reference.ngram.api`), both llama.cpp's lookup."""
from __future__ import annotations


def ngram_api():
    """The n-gram module used by default: ``mlx_backend.ngram.api`` (array-based) if present, else ``reference.ngram.api``."""
    try:
        import mlx_backend.ngram.api as api
    except ImportError:
        import reference.ngram.api as api
    return api


def default_drafter(c_st=None, c_dyn=None):
    """A drafter over ``c_st`` / ``c_dyn`` (caches or cache file paths) from :func:`ngram_api`."""
    return ngram_api().NgramDrafter(c_st=c_st, c_dyn=c_dyn)
