"""The drafters generation uses by default: llama.cpp's lookup on the array tables (:mod:`mlx_backend.ngram.api`)
where numba is installed, else the reference's (:mod:`reference.ngram.api`); and :func:`make_drafter`, the
drafter named ``lookup``, ``suffix`` or ``auto`` (:mod:`reference.suffix.auto`) on the fast backend."""
from __future__ import annotations

from reference.suffix.auto import AUTO_MIN_MATCH, DRAFTERS


def ngram_api():
    """The n-gram module used by default: ``mlx_backend.ngram.api`` (array-based) if present, else ``reference.ngram.api``."""
    try:
        import mlx_backend.ngram.api as api
    except ImportError:
        import reference.ngram.api as api
    return api


def suffix_api():
    """The suffix drafter's module: ``mlx_backend.suffix.drafter`` (hash indexes) if numba is installed,
    else ``reference.suffix.drafter``."""
    try:
        import mlx_backend.suffix.drafter as api
    except ImportError:
        import reference.suffix.drafter as api
    return api


def _shared(share_dyn: bool) -> dict:
    """``share_dyn`` for the fast ``NgramDrafter`` (the reference's has no such option: it copies)."""
    return {"share_dyn": True} if share_dyn and ngram_api().NAME == "mlx" else {}


def lookup_drafter(c_st=None, c_dyn=None, share_dyn: bool = False):
    """llama.cpp's lookup drafter over ``c_st`` / ``c_dyn`` (caches or cache file paths) from :func:`ngram_api`:
    :func:`make_drafter`'s ``lookup`` (the default drafter is ``auto``). ``share_dyn``: read the ``HashTable``
    ``c_dyn`` as it is (no copy; the caller changes it only between drafts)."""
    return ngram_api().NgramDrafter(c_st=c_st, c_dyn=c_dyn, **_shared(share_dyn))


def make_drafter(name: str, *, c_st=None, c_dyn=None, history=None, score: str = "exact",
                 min_match: int = AUTO_MIN_MATCH, share_dyn: bool = False):
    """The fast drafter called ``name`` (one of :data:`DRAFTERS`), as :func:`reference.suffix.auto.make_drafter`
    builds the reference's: ``lookup`` llama.cpp's (:func:`lookup_drafter`'s ``NgramDrafter``; ``c_st``,
    ``c_dyn``, ``score``), ``suffix`` :func:`suffix_api`'s ``SuffixDrafter`` (``history``: a ``SuffixHistory``
    of the same module, or None), ``auto`` the two in :class:`reference.suffix.auto.AutoDrafter`.

    >>> make_drafter("sufix")
    Traceback (most recent call last):
    ...
    ValueError: unknown drafter 'sufix': choose one of lookup, suffix, auto
    """
    from reference.suffix.auto import AutoDrafter

    SuffixDrafter = suffix_api().SuffixDrafter
    if name not in DRAFTERS:
        raise ValueError(f"unknown drafter {name!r}: choose one of {', '.join(DRAFTERS)}")
    if name == "suffix":
        return SuffixDrafter(history)
    lookup = ngram_api().NgramDrafter(c_st=c_st, c_dyn=c_dyn, score=score, **_shared(share_dyn))
    if name == "lookup":
        return lookup
    return AutoDrafter(SuffixDrafter(history), lookup, min_match=min_match)
