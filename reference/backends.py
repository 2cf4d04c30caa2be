"""Backend selection: one setting (``--backend`` or ``NGRAM_SPEC_BACKEND``) picks the implementation.

``reference`` and ``mlx`` name our two backends; ``module.path`` or ``module.path:object`` names any
other object exporting the same n-gram API (``reference/api.py`` lists it).
"""
from __future__ import annotations

import importlib
import os

BACKENDS = {"reference": "reference.api", "mlx": "mlx_backend.api"}
DEFAULT = "reference"


def get_backend(name: str | None = None):
    """The object implementing the n-gram API for ``name`` (default: ``$NGRAM_SPEC_BACKEND`` or reference).

    >>> get_backend("reference").__name__
    'reference.api'
    """
    name = name or os.environ.get("NGRAM_SPEC_BACKEND") or DEFAULT
    module_name, _, attr = BACKENDS.get(name, name).partition(":")
    if name not in BACKENDS and "." not in module_name and not attr:
        raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)} or module.path:object")
    try:
        impl = importlib.import_module(module_name)
    except ImportError as exc:
        hint = "install it with: pip install 'ngram-spec[mlx]'" if name == "mlx" else "is it installed?"
        raise ValueError(f"backend {name!r} is not available ({exc}); {hint}") from exc
    for part in filter(None, attr.split(".")):
        impl = getattr(impl, part)
    return impl
