"""The fast backend of ngram-spec: n-gram speculative decoding for mlx-lm models, floors by concern
(docs/architecture.md): ``machine`` < ``ngram``, ``suffix`` < ``decode`` < ``models``, ``batch`` <
``distributed``, ``serve`` < ``cli``.

The names a user's code starts from, in mlx-lm's shape::

    from mlx_backend import load, stream_generate     # mlx_lm.load, GGUF files too; mlx_lm.stream_generate
    from mlx_backend import generate                  # mlx_lm.generate: the whole text

They are imported on first use: ``import mlx_backend`` alone imports no mlx (the command line of an
install without mlx runs the reference's commands).
"""
from __future__ import annotations

import importlib

PUBLIC = {
    "stream_generate": "mlx_backend.decode.generate",
    "generate": "mlx_backend.decode.generate",
    "ngram_speculative_generate_step": "mlx_backend.decode.generate",
    "SpecStats": "mlx_backend.decode.generate",
    "load": "mlx_backend.models.loading",
}
__all__ = list(PUBLIC)


def __getattr__(name: str):
    if name not in PUBLIC:
        raise AttributeError(f"module 'mlx_backend' has no attribute {name!r}")
    return getattr(importlib.import_module(PUBLIC[name]), name)
