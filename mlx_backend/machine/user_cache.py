"""Where ngram-spec keeps what it learns about this machine (step costs, the BLAS link folder).

The user's cache directory from ``platformdirs`` (``~/.cache/ngram-spec`` on Linux,
``~/Library/Caches/ngram-spec`` on macOS), or ``$NGRAM_SPEC_CACHE_DIR`` when set. Everything in it
can be deleted at any time: it is measured or rebuilt on the next run.
"""
from __future__ import annotations

import os
from pathlib import Path

ENV = "NGRAM_SPEC_CACHE_DIR"


def cache_dir() -> Path:
    """``$NGRAM_SPEC_CACHE_DIR``, else ``platformdirs.user_cache_dir("ngram-spec")`` (not created here)."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV])
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("ngram-spec", appauthor=False))
