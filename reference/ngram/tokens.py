"""Token files: raw little-endian int32 (``.i32``, no header) or NumPy ``.npy``.

Any other suffix is read as raw int32; a trailing ``.xz`` is decompressed on the fly (the shipped
conformance vectors). Token ids are non-negative and fit in int32 (llama.cpp's ``llama_token``).

>>> import tempfile, os
>>> path = os.path.join(tempfile.mkdtemp(), "t.i32")
>>> write_tokens(path, [3, 1, 4, 1, 5])
>>> read_tokens(path)
array([3, 1, 4, 1, 5], dtype=int32)
>>> open(path, "ab").write(b"\\x00")   # one stray byte
1
>>> read_tokens(path)
Traceback (most recent call last):
...
ValueError: token file ... has 21 bytes, not a multiple of 4 (raw little-endian int32 expected); is it a token file?
"""
from __future__ import annotations

import io
import lzma
import numbers
import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from reference.atomic import atomic_write

INT32_MAX = 2**31 - 1
NPY_MAGIC = b"\x93NUMPY"  # the first bytes of every .npy file


def read_bytes(path: str | os.PathLike) -> bytes:
    """The bytes of ``path``, decompressed if its name ends in ``.xz`` (a damaged ``.xz`` file is a
    ``ValueError`` naming it, not the decompressor's bare error)."""
    path = Path(path)
    if path.suffix == ".xz":
        try:
            with lzma.open(path) as f:
                return f.read()
        except (lzma.LZMAError, EOFError) as exc:
            raise ValueError(f"{path}: not a valid .xz file ({exc}); `xz -t {path}` tests it: give the file "
                             "uncompressed, or compressed again") from None
    return path.read_bytes()


def read_tokens(path: str | os.PathLike) -> np.ndarray:
    """The tokens of a ``.i32`` (raw little-endian int32) or ``.npy`` file as an int32 array."""
    path = Path(path)
    name = path.name[:-3] if path.suffix == ".xz" else path.name
    if name.endswith(".npy"):
        with (io.BytesIO(read_bytes(path)) if path.suffix == ".xz" else open(path, "rb")) as f:
            if f.read(len(NPY_MAGIC)) != NPY_MAGIC:
                raise ValueError(f"token file {path}: not a .npy file (it does not start with NumPy's magic); "
                                 "name raw little-endian int32 token files .i32")
            f.seek(0)
            try:
                arr = np.load(f, allow_pickle=False)
            except ValueError as exc:
                raise ValueError(f"token file {path}: not a valid .npy file ({exc})") from exc
        if arr.ndim != 1 or arr.dtype.kind not in "iu":
            raise ValueError(
                f"token file {path}: expected a 1-D integer array, got shape {arr.shape} dtype {arr.dtype}")
        check_range(arr, f"token file {path}")  # before the cast, which would wrap ids outside int32
        tokens = arr.astype(np.int32)
    else:
        data = read_bytes(path)
        if len(data) % 4:
            raise ValueError(
                f"token file {path} has {len(data)} bytes, not a multiple of 4 "
                "(raw little-endian int32 expected); is it a token file?")
        tokens = np.frombuffer(data, dtype="<i4").astype(np.int32)
    check_tokens(tokens, f"token file {path}")
    return tokens


def check_range(arr: np.ndarray, what: str) -> None:
    """Raise ``ValueError`` naming the first id outside ``[0, 2**31-1]`` of an integer array of any width
    (checked on the array's own dtype, so nothing wraps before the check)."""
    bad = np.flatnonzero((arr < 0) | (arr > INT32_MAX))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{what}: token id {int(arr[i])} at index {i} is outside [0, 2**31-1] "
                         f"({bad.size} such ids); token ids are non-negative int32")


def check_tokens(tokens: np.ndarray, what: str = "tokens") -> None:
    """Raise ``ValueError`` naming the first negative token id, if any."""
    negative = np.flatnonzero(tokens < 0)
    if negative.size:
        i = int(negative[0])
        raise ValueError(f"{what}: negative token id {int(tokens[i])} at index {i} "
                         f"({negative.size} negative ids); token ids must be >= 0")


def is_whole(x) -> bool:
    """An integer (Python's or NumPy's), not a bool: what a token id, a count or a length must be."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def check_token_list(tokens: Iterable[int]) -> list[int]:
    """``tokens`` as a list of Python ints, each checked to be a valid id: an integer (a float is refused, not
    truncated) with 0 <= t <= 2**31-1."""
    if isinstance(tokens, np.ndarray) and tokens.dtype == np.int32:
        check_tokens(tokens)
        return tokens.tolist()
    tokens = list(tokens)
    bad = next((i for i, t in enumerate(tokens) if not isinstance(t, numbers.Integral)), None)
    if bad is not None:
        raise ValueError(f"token id {tokens[bad]!r} at index {bad} is not an integer; token ids are integers "
                         "(tokenize text first)")
    out = [int(t) for t in tokens]
    for i, t in enumerate(out):
        if not 0 <= t <= INT32_MAX:
            raise ValueError(f"invalid token id {t} at index {i}; token ids must be in [0, 2**31-1]")
    return out


def write_tokens(path: str | os.PathLike, tokens: Iterable[int]) -> None:
    """Write ``tokens`` as ``.npy`` if the name ends in ``.npy``, else as raw little-endian int32."""
    with atomic_write(path) as f:
        write_tokens_into(f, path, tokens)


def write_tokens_into(f, path: str | os.PathLike, tokens: Iterable[int]) -> None:
    """:func:`write_tokens` into ``f``, a file open for writing that will become ``path`` (its name picks
    the format): for a caller that renames it in later, together with another output."""
    arr = np.asarray(check_token_list(tokens) if not isinstance(tokens, np.ndarray) else tokens)
    check_range(arr, "tokens")
    if str(path).endswith(".npy"):
        np.save(f, arr.astype(np.int32))
    else:
        arr.astype("<i4").tofile(f)
