"""A suffix history kept in a file (``ngram-spec serve --history``), so that a restarted server drafts from
the prompts and answers it saw before, as its dynamic n-gram cache file lets ``lookup`` do.

The file is a NumPy ``.npz`` archive of two arrays: ``tokens`` (int32, the sequences one after another,
oldest first) and ``lengths`` (int64, one per sequence, each >= 1, summing to ``len(tokens)``). It is written
atomically (:func:`reference.atomic.atomic_write`) and read back into a history of any ``max_tokens``: the
sequences are added in order, so a smaller bound keeps the newest ones, as it would have live.

>>> import tempfile, os
>>> from mlx_backend.suffix.drafter import SuffixHistory
>>> h = SuffixHistory(max_tokens=100)
>>> h.add([1, 2, 3]); h.add([4, 5])
>>> path = os.path.join(tempfile.mkdtemp(), "history")
>>> save_history(path, h)
>>> load_history(path, SuffixHistory(max_tokens=100)).sequences
[[1, 2, 3], [4, 5]]
>>> load_history(path, SuffixHistory(max_tokens=2)).sequences
[[4, 5]]
"""
from __future__ import annotations

import os
import zipfile

import numpy as np

from reference.atomic import atomic_write
from reference.ngram.tokens import INT32_MAX


def save_history(path: str | os.PathLike, history) -> None:
    """Write ``history``'s sequences (oldest first) to ``path`` atomically."""
    sequences = history.sequences
    lengths = np.array([len(s) for s in sequences], np.int64)
    tokens = (np.concatenate([np.asarray(s, np.int32) for s in sequences]) if sequences
              else np.zeros(0, np.int32))
    with atomic_write(path) as f:
        np.savez(f, tokens=tokens, lengths=lengths)


def read_history(path: str | os.PathLike) -> tuple[np.ndarray, np.ndarray]:
    """The ``tokens`` and ``lengths`` saved at ``path``, checked but not indexed (what ``serve`` checks every
    user's file with at start; each is indexed at that user's first request). A file that is not a history
    (not an ``.npz`` archive of the two arrays above, ids outside 0..2**31-1, lengths that do not add up)
    raises ``ValueError`` naming it: it would be written back. Anything but a zip archive is refused before
    ``np.load`` reads it: a single array (``.npy``) would come back as an array (before: a ``TypeError``
    traceback at start), and other bytes as numpy's advice to load pickled data unsafely."""
    try:
        if not zipfile.is_zipfile(path):
            raise ValueError("it is not a zip archive")
        with np.load(path, allow_pickle=False) as archive:
            tokens, lengths = archive["tokens"], archive["lengths"]
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as exc:
        raise ValueError(f"{path}: not a suffix history file (an .npz archive of 'tokens' and 'lengths'): "
                         f"{exc}") from None
    if tokens.ndim != 1 or lengths.ndim != 1 or tokens.dtype.kind not in "iu" or lengths.dtype.kind not in "iu":
        raise ValueError(f"{path}: not a suffix history file: 'tokens' and 'lengths' must be 1-D integer arrays")
    if (lengths < 1).any() or int(lengths.sum()) != tokens.size:
        raise ValueError(f"{path}: damaged suffix history: its {lengths.size} lengths (each >= 1) must add up to "
                         f"its {tokens.size} tokens")
    if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) > INT32_MAX):
        raise ValueError(f"{path}: damaged suffix history: a token id outside 0..{INT32_MAX}")
    return tokens, lengths


def load_history(path: str | os.PathLike, history):
    """Add the sequences saved at ``path`` (:func:`read_history`) to ``history`` (oldest first) and return it;
    a missing file adds nothing."""
    if not os.path.exists(path):
        return history
    tokens, lengths = read_history(path)
    for end, length in zip(np.cumsum(lengths).tolist(), lengths.tolist()):
        history.add(tokens[end - length:end].astype(np.int32))
    return history
