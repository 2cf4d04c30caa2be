"""Backend selection: one setting (``--backend`` or ``NGRAM_SPEC_BACKEND``) picks the implementation.

``reference`` and ``mlx`` name our two backends; ``module.path`` or ``module.path:object`` names any
other object exporting the same n-gram API (``reference/ngram/api.py`` lists it).
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import traceback

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
    return import_object(name, BACKENDS.get(name, name), source)


def import_object(spec: str, target: str, source: str = ""):
    """The object ``target`` names (``module.path``, or ``module.path:object``, ``object`` dotted), for
    the backend ``spec`` (as the user gave it; ``source`` says where from). Every way it can fail is a
    ``ValueError`` naming the problem and the fix: a module that is not found, one that is found but
    fails to import (whatever it raises: the user's to see, in one line), a missing attribute."""
    module_name, _, attr = target.partition(":")
    if not module_name:
        raise ValueError(f"unknown backend {spec!r}{source}: use reference, mlx, or module.path:object")
    try:
        impl = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001
        raise ValueError(_import_failure(spec, source, module_name, exc)) from exc
    for i, part in enumerate(filter(None, attr.split("."))):
        try:
            impl = getattr(impl, part)
        except AttributeError:
            owner = module_name + (":" + ".".join(attr.split(".")[:i]) if i else "")
            raise ValueError(f"backend {spec!r}{source}: {owner} has no attribute {part!r}; give "
                             f"module.path:object naming an object of {module_name}, or one of "
                             f"{', '.join(BACKENDS)}") from None
    return impl


def _import_failure(spec: str, source: str, module_name: str, exc: Exception) -> str:
    """Why the module of ``spec`` did not import, and what to do about it."""
    if spec == "mlx" and isinstance(exc, ImportError):
        return f"backend 'mlx'{source} cannot be imported: {exc} (install it with: pip install 'ngram-spec[mlx]')"
    missing = getattr(exc, "name", None) if isinstance(exc, ModuleNotFoundError) else None
    if missing and (module_name == missing or module_name.startswith(missing + ".")):
        return (f"backend {spec!r}{source}: no module named {missing!r}; use reference, mlx, or module.path:object "
                f"naming an importable module (install its package, or put its folder on PYTHONPATH)")
    if isinstance(exc, SyntaxError):  # the place is the error's own, not the import machinery's frame
        what, where = exc.msg, f" (at {exc.filename}:{exc.lineno})"
    else:
        frames = traceback.extract_tb(exc.__traceback__)
        what, where = exc, f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"backend {spec!r}{source}: importing {module_name!r} raised {type(exc).__name__}: {what}{where}"
