"""A suffix history kept in a file (``ngram-spec serve --history``), so that a restarted server drafts from
the prompts and answers it saw before, as its dynamic n-gram cache file lets ``lookup`` do.

The file is a NumPy ``.npz`` archive of ``tokens`` (int32, the sequences one after another, oldest first),
``lengths`` (int64, one per sequence, each >= 1, summing to ``len(tokens)``) and the tokenizer the ids are of,
as a cache file of our format records it (docs/cache-format.md): ``vocab_size`` (int64, 0: unknown) and
``fingerprint`` (32 uint8, all zero: unknown; :func:`reference.ngram.ours_file.tokenizer_fingerprint`). A file
written before those two were (no such arrays) records no tokenizer: an unknown one, as an all-zero
fingerprint. Read with a tokenizer (``serve`` passes the model's), a file recording another one is refused
(:func:`reference.ngram.ours_file.tokenizer_mismatch`, the cache files' rule): its ids would mean other text,
and every draft from it would be rejected. It is written atomically (:func:`reference.atomic.atomic_write`)
and read back into a history of any ``max_tokens``: the sequences are added in order, so a smaller bound keeps
the newest ones, as it would have live.

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
>>> save_history(path, h, vocab_size=6, fingerprint=bytes(range(32)))
>>> load_history(path, SuffixHistory(max_tokens=100), vocab_size=7)  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
ValueError: .../history: built for a vocabulary of 6 tokens, the tokenizer in use has 7: a suffix history ...
"""
from __future__ import annotations

import os
import zipfile

import numpy as np

from reference.atomic import atomic_write
from reference.ngram.ours_file import tokenizer_mismatch
from reference.ngram.tokens import INT32_MAX

FIX = ("a suffix history written while serving another tokenizer's model (its ids mean other text here): give "
       "--history another path, or delete the file (the history then starts empty)")


def save_history(path: str | os.PathLike, history, vocab_size: int | None = None,
                 fingerprint: bytes | None = None) -> None:
    """Write ``history``'s sequences (oldest first) to ``path`` atomically, recording the tokenizer
    ``vocab_size`` / ``fingerprint`` (:func:`reference.ngram.ours_file.tokenizer_fingerprint`; None: unknown,
    written as 0 / zeros)."""
    sequences = history.sequences
    lengths = np.array([len(s) for s in sequences], np.int64)
    tokens = (np.concatenate([np.asarray(s, np.int32) for s in sequences]) if sequences
              else np.zeros(0, np.int32))
    fp = bytes(fingerprint or bytes(32))
    if len(fp) != 32:
        raise ValueError(f"tokenizer fingerprint must be 32 bytes, got {len(fp)}")
    with atomic_write(path) as f:
        np.savez(f, tokens=tokens, lengths=lengths, vocab_size=np.int64(vocab_size or 0),
                 fingerprint=np.frombuffer(fp, np.uint8))


def read_history(path: str | os.PathLike, vocab_size: int | None = None, fingerprint: bytes | None = None,
                 n_vocab: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The ``tokens`` and ``lengths`` saved at ``path``, checked but not indexed (what ``serve`` checks every
    user's file with at start; each is indexed at that user's first request). A file that is not a history
    (not an ``.npz`` archive of the arrays above, ids outside 0..2**31-1, lengths that do not add up)
    raises ``ValueError`` naming it: it would be written back. Anything but a zip archive is refused before
    ``np.load`` reads it: a single array (``.npy``) would come back as an array (before: a ``TypeError``
    traceback at start), and other bytes as numpy's advice to load pickled data unsafely.

    ``vocab_size`` / ``fingerprint``: the tokenizer in use (None: unknown; nothing checked), ``n_vocab``: the
    token ids the model takes (its embedding rows, which may be more than the tokenizer's). A file recording
    another tokenizer (:func:`reference.ngram.ours_file.tokenizer_mismatch`), or holding an id that neither
    the tokenizer nor the model in use has (>= both sizes, where known: all a file recording no tokenizer can
    be checked by), raises ``ValueError`` naming it, both tokenizers and the fix. Before, it was read
    silently: every draft from it meant other text."""
    tokens, lengths, recorded = _read_arrays(path)
    if tokens.ndim != 1 or lengths.ndim != 1 or tokens.dtype.kind not in "iu" or lengths.dtype.kind not in "iu":
        raise ValueError(f"{path}: not a suffix history file: 'tokens' and 'lengths' must be 1-D integer arrays")
    if (lengths < 1).any() or int(lengths.sum()) != tokens.size:
        raise ValueError(f"{path}: damaged suffix history: its {lengths.size} lengths (each >= 1) must add up to "
                         f"its {tokens.size} tokens")
    if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) > INT32_MAX):
        raise ValueError(f"{path}: damaged suffix history: a token id outside 0..{INT32_MAX}")
    problem = tokenizer_mismatch(*recorded, vocab_size, fingerprint, FIX)
    limit = max(vocab_size or 0, n_vocab or 0)
    if not problem and limit and tokens.size and int(tokens.max()) >= limit:
        problem = (f"token id {int(tokens.max())} is outside the ids the tokenizer and model in use take "
                   f"(0..{limit - 1}): {FIX}")
    if problem:
        raise ValueError(f"{path}: {problem}")
    return tokens, lengths


def _read_arrays(path) -> tuple[np.ndarray, np.ndarray, tuple[int, bytes]]:
    """``tokens``, ``lengths`` and the recorded ``(vocab_size, fingerprint)`` (0 and zeros where the file records
    none) of the archive at ``path``; only the archive and the tokenizer arrays' shapes are checked."""
    try:
        if not zipfile.is_zipfile(path):
            raise ValueError("it is not a zip archive")
        with np.load(path, allow_pickle=False) as archive:
            tokens, lengths = archive["tokens"], archive["lengths"]
            vocab = archive["vocab_size"] if "vocab_size" in archive.files else np.int64(0)
            fp = archive["fingerprint"] if "fingerprint" in archive.files else np.zeros(32, np.uint8)
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as exc:
        raise ValueError(f"{path}: not a suffix history file (an .npz archive of 'tokens' and 'lengths'): "
                         f"{exc}") from None
    vocab, fp = np.asarray(vocab), np.asarray(fp)
    if vocab.ndim or vocab.dtype.kind not in "iu" or vocab < 0 or fp.shape != (32,) or fp.dtype != np.uint8:
        raise ValueError(f"{path}: not a suffix history file: 'vocab_size' must be an integer >= 0 and "
                         "'fingerprint' 32 bytes (uint8)")
    return tokens, lengths, (int(vocab), fp.tobytes())


def load_history(path: str | os.PathLike, history, vocab_size: int | None = None,
                 fingerprint: bytes | None = None, n_vocab: int | None = None):
    """Add the sequences saved at ``path`` (:func:`read_history`, with the tokenizer and model in use where
    known) to ``history`` (oldest first) and return it; a missing file adds nothing."""
    if not os.path.exists(path):
        return history
    tokens, lengths = read_history(path, vocab_size, fingerprint, n_vocab)
    for end, length in zip(np.cumsum(lengths).tolist(), lengths.tolist()):
        history.add(tokens[end - length:end].astype(np.int32))
    return history
