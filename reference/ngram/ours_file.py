"""ngram-spec's memory-mapped cache format (``NGRAMSPC``, docs/cache-format.md), read field by field.

The fast backend maps these files (``mlx_backend/ngram/cache_file.py``); the reference reads the same
bytes plainly, following the document: the 384-byte header (magic, version, byte-order mark, header
size, vocabulary size, tokenizer fingerprint, four section entries, CRC-32), then per n-gram size the
arrays ``keys``, ``offsets``, ``tokens``, ``counts`` and ``top``. Every rule of the document is
checked, with the byte offset of the first violation.
"""
from __future__ import annotations

import hashlib
import os
import struct
import zlib

import numpy as np

from reference.ngram.file_errors import OURS_MAGIC as MAGIC
from reference.ngram.file_errors import OursFileError
from reference.ngram.draft import try_static
from reference.ngram.cache import LLAMA_NGRAM_MAX, NgramCache

VERSION = 1
BOM = 0x0A0B0C0D
HEADER_SIZE = 384
ALIGN = 64
PREFIX = struct.Struct("<8sIIQQ32s")  # magic, version, byte-order mark, header size, vocab size, fingerprint
SECTION = struct.Struct("<8Q")  # n_keys, n_entries, total, offsets of keys, offsets, tokens, counts, top
CRC_AT = PREFIX.size + LLAMA_NGRAM_MAX * SECTION.size  # 320: CRC-32 of bytes 0..319


def key_slots(w0: int, w1: int) -> list[int]:
    """The four slots ``t0..t3`` of the key words ``w0 = t0 << 32 | (t1 & 0xFFFFFFFF)``, ``w1`` likewise."""
    def low(w: int) -> int:  # the low 32 bits as a signed int32 (-1 pads)
        return (w & 0xFFFFFFFF) - ((w & 0x80000000) << 1)
    return [w0 >> 32, low(w0), w1 >> 32, low(w1)]


def vocab_fingerprint(vocab: dict) -> bytes:
    """A tokenizer fingerprint: SHA-256 over the ``token -> id`` pairs sorted by id (str or bytes tokens).

    >>> len(vocab_fingerprint({"a": 0, "b": 1})), vocab_fingerprint({"a": 0, "b": 1}) == vocab_fingerprint({"a": 1, "b": 0})
    (32, False)
    """
    h = hashlib.sha256()
    for tok, i in sorted(vocab.items(), key=lambda kv: kv[1]):
        b = tok if isinstance(tok, bytes) else str(tok).encode("utf-8", "surrogatepass")
        h.update(struct.pack("<iI", int(i), len(b)) + b)
    return h.digest()


def tokenizer_fingerprint(tokenizer) -> tuple[int, bytes]:
    """``(vocab_size, fingerprint)`` of a tokenizer with ``get_vocab()`` (``tokenizers.Tokenizer``,
    transformers tokenizers) or of a ``token -> id`` dict, for the header of our format."""
    vocab = tokenizer if isinstance(tokenizer, dict) else tokenizer.get_vocab()
    return (max(vocab.values()) + 1 if vocab else 0), vocab_fingerprint(vocab)


def detect_format(path: str | os.PathLike) -> str:
    """``"ours"`` if the file starts with our magic, else ``"llama"`` (which has no magic)."""
    with open(path, "rb") as f:
        head = f.read(len(MAGIC))
    return "ours" if head == MAGIC else "llama"


def file_tokenizer(path: str | os.PathLike) -> tuple[int, bytes] | None:
    """The ``(vocab_size, fingerprint)`` the header of cache file ``path`` records, or None for a file that is
    not of our format (llama.cpp's records no tokenizer) or too short to hold a header."""
    with open(path, "rb") as f:
        head = f.read(PREFIX.size)
    if len(head) < PREFIX.size or not head.startswith(MAGIC):
        return None
    *_, cache_vocab, cache_fingerprint = PREFIX.unpack(head)
    return cache_vocab, cache_fingerprint


def check_file_tokenizer(tokenizer, *paths: str | os.PathLike | None) -> None:
    """Refuse a cache file of our format that records another tokenizer than ``tokenizer`` (anything
    :func:`tokenizer_fingerprint` takes, or its ``(vocab_size, fingerprint)``; None: unknown, nothing
    checked). Only headers are read (:func:`file_tokenizer`); paths that are None or missing are skipped."""
    in_use = None
    for path in paths:
        if tokenizer is None or path is None or not os.path.isfile(path):
            continue
        recorded = file_tokenizer(path)
        if recorded is None:
            continue
        if in_use is None:   # once: a fingerprint hashes the whole vocabulary
            in_use = tokenizer if isinstance(tokenizer, tuple) else tokenizer_fingerprint(tokenizer)
        problem = tokenizer_mismatch(*recorded, *in_use)
        if problem:
            raise ValueError(f"cache file {path}: {problem}")


def tokenizer_mismatch(cache_vocab: int, cache_fingerprint: bytes, vocab_size: int | None,
                       fingerprint: bytes | None, fix: str = "rebuild the cache with this tokenizer") -> str | None:
    """Why a cache recording tokenizer ``(cache_vocab, cache_fingerprint)`` (0 / zeros: unknown) must not
    be used with tokenizer ``(vocab_size, fingerprint)`` (None: unknown), or None if it may; the reason ends
    with ``fix`` (the suffix histories of ``serve --history`` follow the same rule with their own fix)."""
    if vocab_size and cache_vocab and cache_vocab != vocab_size:
        return f"built for a vocabulary of {cache_vocab} tokens, the tokenizer in use has {vocab_size}: {fix}"
    if fingerprint and any(cache_fingerprint) and bytes(fingerprint) != bytes(cache_fingerprint):
        return (f"built with another tokenizer (fingerprint {bytes(cache_fingerprint).hex()[:16]}..., in use "
                f"{bytes(fingerprint).hex()[:16]}...): {fix}")
    return None


def read_ours(path: str | os.PathLike, data: bytes) -> NgramCache:
    """The cache held by ``data``, the bytes of the file ``path`` in our format. The returned cache also
    carries the header's ``vocab_size`` (0: unknown) and tokenizer ``fingerprint`` (zeros: unknown)."""
    if len(data) < HEADER_SIZE:
        raise OursFileError(path, len(data), f"truncated header: {len(data)} bytes, the header needs {HEADER_SIZE}")
    magic, version, bom, header_size, vocab_size, fingerprint = PREFIX.unpack_from(data)
    if bom != BOM:
        raise OursFileError(path, 12, f"byte-order mark {bom:#010x} (expected {BOM:#010x}): wrong endianness")
    if version != VERSION:
        raise OursFileError(path, 8, f"unsupported version {version} of our format (this build reads {VERSION})")
    (crc,) = struct.unpack_from("<I", data, CRC_AT)
    if header_size != HEADER_SIZE or crc != zlib.crc32(data[:CRC_AT]):
        raise OursFileError(path, CRC_AT, "header checksum mismatch (corrupt header)")
    counts: dict[tuple[int, ...], dict[int, int]] = {}
    end = HEADER_SIZE
    for n in range(1, LLAMA_NGRAM_MAX + 1):
        at = PREFIX.size + (n - 1) * SECTION.size
        K, E, total, keys_off, offsets_off, tokens_off, counts_off, top_off = SECTION.unpack_from(data, at)

        def array(offset: int, count: int, dtype: str) -> np.ndarray:
            nonlocal end
            nbytes = count * np.dtype(dtype).itemsize
            if offset % ALIGN or offset < HEADER_SIZE:
                raise OursFileError(path, at, f"section n={n}: misaligned array offset {offset}")
            if offset + nbytes > len(data):
                raise OursFileError(path, len(data), f"truncated file: section n={n} needs bytes up to "
                                                     f"{offset + nbytes}, the file has {len(data)}")
            end = max(end, offset + nbytes)
            return np.frombuffer(data, dtype, count, offset)

        width = 1 if n <= 2 else 2  # key words per n-gram
        words = array(keys_off, K * width, "<i8").reshape(K, width).tolist()
        offsets = array(offsets_off, K + 1, "<u4").tolist()
        tokens = array(tokens_off, E, "<i4").tolist()
        cnts = array(counts_off, E, "<i4").tolist()
        top = array(top_off, K, "<i4").tolist()
        if offsets[0] != 0 or offsets[-1] != E or sum(cnts) != total:
            raise OursFileError(path, offsets_off, f"section n={n}: offsets or total disagree with the entries")
        previous = None
        for i, w in enumerate(words):
            slots = key_slots(*w) if n >= 3 else key_slots(w[0], -1)
            eta = tuple(slots[:n])
            lo, hi = offsets[i], offsets[i + 1]
            followers = tokens[lo:hi]
            if min(eta) < 0 or any(s != -1 for s in slots[n:]) or (previous is not None and w <= previous):
                raise OursFileError(path, keys_off, f"section n={n}: key {i} {slots} is invalid or out of order")
            if hi <= lo or followers != sorted(set(followers)) or followers[0] < 0:
                raise OursFileError(path, tokens_off + 4 * lo, f"section n={n}: the followers of n-gram {eta} are "
                                                               "empty, unsorted, repeated or negative")
            if min(cnts[lo:hi]) <= 0:
                raise OursFileError(path, counts_off + 4 * lo, f"section n={n}: non-positive count of n-gram {eta}")
            part = dict(zip(followers, cnts[lo:hi]))
            expected = try_static(part)
            if top[i] != (-1 if expected is None else expected):
                raise OursFileError(path, top_off + 4 * i, f"section n={n}: the stored static draft {top[i]} of "
                                                           f"n-gram {eta} disagrees with its counts")
            counts[eta] = part
            previous = w
    if len(data) != end:
        raise OursFileError(path, end, f"{len(data) - end} unexpected trailing bytes")
    cache = NgramCache(counts)
    cache.vocab_size, cache.fingerprint = vocab_size, fingerprint
    return cache
