"""The stateful drafter used during generation (llama.cpp's ``examples/lookup/lookup.cpp``).

The context cache ``c_ctx`` is filled from the prompt (``update(c_ctx, 1, 4, inp, N)``, lookup.cpp:54)
and then updated after every emitted token (``nnew = 1``); ``draft`` asks all three caches.

>>> d = NgramDrafter()
>>> d.reset([1, 2, 3, 1, 2, 3])
>>> d.draft(4)           # the 3-gram (1, 2, 3) was followed by 1 once: enough for the lax n = 3 level
[1, 2, 3, 1]
>>> d.extend([7])        # the model emitted 7 instead
>>> d.tokens[-3:], d.draft(4)
([2, 3, 7], [])
"""
from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

from reference.ngram.cache_file import load_cache
from reference.ngram.draft import SCORES, draft
from reference.ngram.cache import LLAMA_NGRAM_STATIC, NgramCache
from reference.ngram.tokens import check_token_list

CacheLike = NgramCache | str | os.PathLike | None


def as_cache(cache: CacheLike) -> NgramCache | None:
    """``cache`` itself, or the cache file it names loaded with :func:`load_cache`."""
    if cache is None or isinstance(cache, NgramCache):
        return cache
    return load_cache(cache)


def check_static(c_st: NgramCache | None) -> None:
    """A static cache holds 2-grams only (``llama-lookup-create``); drafting looks up nothing else, so
    other sizes mean a mix-up (e.g. a dynamic cache passed as static).

    >>> check_static(NgramCache({(1, 2, 3): {4: 1}}))
    Traceback (most recent call last):
    ...
    ValueError: the static cache holds n-grams of sizes [3]; a static cache must hold 2-grams only (make it with `ngram-spec create`; pass other caches as the dynamic cache)
    """
    if c_st is not None and c_st.sizes() - {LLAMA_NGRAM_STATIC}:
        raise ValueError(f"the static cache holds n-grams of sizes {sorted(c_st.sizes())}; a static cache must "
                         "hold 2-grams only (make it with `ngram-spec create`; pass other caches as the dynamic cache)")


class NgramDrafter:
    """Drafts from ``c_ctx`` (this sequence), ``c_dyn`` (earlier text) and ``c_st`` (a corpus).

    ``c_st`` and ``c_dyn`` are caches or cache file paths; they are only read. ``score`` is
    ``"exact"`` (integers) or ``"int32"`` (llama.cpp's wrapping product), see :mod:`reference.ngram.draft`.
    """

    def __init__(self, c_st: CacheLike = None, c_dyn: CacheLike = None, score: str = "exact"):
        if score not in SCORES:
            raise ValueError(f"score must be one of {SCORES}, got {score!r}")
        self.c_st = as_cache(c_st)
        check_static(self.c_st)
        self.c_dyn = as_cache(c_dyn)
        self.score = score
        self.tokens: list[int] = []
        self.c_ctx = NgramCache()

    def reset(self, prompt: Sequence[int]) -> None:
        """Start a new sequence: ``tokens = prompt``, ``c_ctx`` = its n-grams of sizes 1..4."""
        self.tokens = check_token_list(prompt)
        self.c_ctx = NgramCache()
        self.c_ctx.update(self.tokens, len(self.tokens))

    def extend(self, tokens: Iterable[int]) -> None:
        """Append emitted tokens one by one, updating ``c_ctx`` after each (``nnew = 1``)."""
        for t in check_token_list(tokens):
            self.tokens.append(t)
            self.c_ctx.update(self.tokens, 1)

    def draft(self, n_draft: int) -> list[int]:
        """Up to ``n_draft`` tokens predicted to follow :attr:`tokens` (see :func:`reference.ngram.draft.draft`)."""
        return draft(self.tokens, n_draft, self.c_ctx, self.c_dyn, self.c_st, score=self.score)
