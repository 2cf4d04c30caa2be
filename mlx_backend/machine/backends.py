"""Backend selection: one setting (``--backend`` or ``NGRAM_SPEC_BACKEND``) picks the implementation.

``reference`` and ``mlx`` name our two backends; ``module.path`` or ``module.path:object`` names any
other object exporting the same n-gram API (``reference/ngram/api.py`` lists it).
"""
from __future__ import annotations

import importlib
import importlib.util
import os

BACKENDS = {"reference": "reference.ngram.api", "mlx": "mlx_backend.ngram.api"}
# The default: the fast backend wherever it is installed (its array kernels need numba; mlx itself
# for generation), else the reference. ``--help`` of every command says so (DEFAULT_HELP).
FAST_NEEDS = ("mlx", "numba")
DEFAULT_HELP = "default: $NGRAM_SPEC_BACKEND, else mlx where mlx and numba are installed, else reference"


def default_backend() -> str:
    """``"mlx"`` if mlx and numba are importable, else ``"reference"``."""
    return "mlx" if all(importlib.util.find_spec(m) is not None for m in FAST_NEEDS) else "reference"


def get_backend(name: str | None = None):
    """The object implementing the n-gram API for ``name`` (default: ``$NGRAM_SPEC_BACKEND``, else
    :func:`default_backend`). A name that names nothing is a ``ValueError`` saying where it came from
    (the variable, when no name was given) and what to give instead.

    >>> get_backend("reference").__name__
    'reference.ngram.api'
    """
    source = "" if name or not os.environ.get("NGRAM_SPEC_BACKEND") else " (from $NGRAM_SPEC_BACKEND)"
    name = name or os.environ.get("NGRAM_SPEC_BACKEND") or default_backend()
    module_name, _, attr = BACKENDS.get(name, name).partition(":")
    if name not in BACKENDS and "." not in module_name and not attr:
        raise ValueError(f"unknown backend {name!r}{source}; choose one of {', '.join(BACKENDS)} "
                         "or module.path:object")
    try:
        impl = importlib.import_module(module_name)
    except ImportError as exc:
        hint = "install it with: pip install 'ngram-spec[mlx]'" if name == "mlx" else "is it installed?"
        raise ValueError(f"backend {name!r}{source} is not available ({exc}); {hint}") from exc
    for part in filter(None, attr.split(".")):
        try:
            impl = getattr(impl, part)
        except AttributeError:
            raise ValueError(f"backend {name!r}{source}: {module_name} has no {attr!r}; give module.path:object "
                             f"naming an object of {module_name}, or one of {', '.join(BACKENDS)}") from None
    return impl
