"""Backend selection: one setting (``--backend`` or ``NGRAM_SPEC_BACKEND``) picks the implementation."""
from __future__ import annotations

import importlib
import os
from types import ModuleType

BACKENDS = {"reference": "reference.api", "mlx": "mlx_backend.api"}
DEFAULT = "reference"


def get_backend(name: str | None = None) -> ModuleType:
    """The module implementing the n-gram API for ``name`` (default: ``$NGRAM_SPEC_BACKEND`` or reference)."""
    name = name or os.environ.get("NGRAM_SPEC_BACKEND") or DEFAULT
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    try:
        return importlib.import_module(BACKENDS[name])
    except ImportError as exc:
        raise ValueError(
            f"backend {name!r} is not available ({exc}); install it with: pip install 'ngram-spec[mlx]'"
        ) from exc
