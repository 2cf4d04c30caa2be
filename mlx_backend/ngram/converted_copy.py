"""A copy in our format of each llama.cpp-format cache file loaded, so that the next load maps it.

Reading llama.cpp's format means parsing and sorting every record (about a second for a 170 MiB
static cache); our format is memory-mapped in a millisecond. After a llama.cpp-format file is read,
its content is written in our format to the user's cache directory (:mod:`mlx_backend.machine.user_cache`),
in ``converted/``, named by the file's absolute path and its identity: size, modification time and
SHA-256 of its first and last MiB. A later load of the same unchanged file maps that copy; a changed
file (another size, time or head/tail) is read again and its copy replaced. Only the newest copy of
each path is kept, and the folder is bounded: after a copy is written, the least recently used copies
(by modification time; a reuse touches its copy) are deleted until the folder holds at most
``MAX_BYTES`` (``NGRAM_SPEC_CONVERTED_MAX_BYTES``, default 4 GiB, about 24 copies of a 171 MiB static
cache; the copy just written is always kept), so copies of files deleted or changed long ago do not
accumulate. A copy that cannot be written (read-only or full cache directory) is skipped: the
load itself has succeeded. A copy that fails our format's checks is deleted and the file read again.

>>> import os, tempfile
>>> from mlx_backend.ngram.sorted_cache import build_static
>>> from mlx_backend.ngram.caches import load_cache, save_cache
>>> os.environ["NGRAM_SPEC_CACHE_DIR"] = tempfile.mkdtemp()
>>> path = os.path.join(tempfile.mkdtemp(), "static.bin")
>>> save_cache(build_static(np.array([1, 2, 3, 1, 2, 4], np.int32)), path, format="llama")
>>> first, second = load_cache(path), load_cache(path)
>>> first.converted_copy[1], second.converted_copy[1], first == second
('written', 'reused', True)
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import time
from pathlib import Path

import numpy as np  # noqa: F401 - used by the doctest

from mlx_backend.ngram.cache_file import CacheFormatError, open_ours, read_llama, save_ours
from mlx_backend.machine.user_cache import cache_dir

FOLDER = "converted"
ENV_OFF = "NGRAM_SPEC_NO_CONVERTED_COPY"  # set to 1: never write or use copies
PART = 1 << 20  # bytes hashed at each end of the file
ENV_MAX_BYTES = "NGRAM_SPEC_CONVERTED_MAX_BYTES"
MAX_BYTES = 4 << 30  # the folder's bound when ENV_MAX_BYTES is unset
log = logging.getLogger("ngram_spec.cache")  # the command line prints its records on stderr


def copy_path(path: str | os.PathLike) -> Path:
    """Where the copy of llama.cpp-format file ``path`` (as it is now) is kept."""
    path = Path(path).resolve()
    st = path.stat()
    h = hashlib.sha256(f"{st.st_size}:{st.st_mtime_ns}:".encode())
    with open(path, "rb") as f:
        h.update(f.read(PART))
        if st.st_size > PART:
            f.seek(max(PART, st.st_size - PART))
            h.update(f.read(PART))
    where = hashlib.sha256(str(path).encode()).hexdigest()[:16]
    return cache_dir() / FOLDER / f"{where}-{h.hexdigest()[:16]}.ngc"


def load_via_copy(path: str | os.PathLike, verify: bool = False, keep_copy: bool = True):
    """``read_llama(path)``, or the mapped copy of an earlier read of the unchanged file (``verify``:
    check its every array). The result's ``converted_copy`` is ``(copy path, "reused" | "written")``,
    or None where no copy was kept; each case is logged (``ngram_spec.cache``, INFO). ``keep_copy=False``,
    or ``NGRAM_SPEC_NO_CONVERTED_COPY=1``: the file is read, no copy used or written, nothing logged."""
    if not keep_copy or os.environ.get(ENV_OFF, "") not in ("", "0"):
        cache = read_llama(path)
        cache.converted_copy = None
        return cache
    bound, copy = max_bytes(), copy_path(path)   # a bad bound is refused before the file is read
    if copy.is_file():
        try:
            cache = open_ours(copy, verify=verify)
        except CacheFormatError:  # damaged or of another version of our format: read the file again
            copy.unlink(missing_ok=True)
        except FileNotFoundError:  # removed since is_file() by another process (a newer version's cleanup)
            pass
        else:
            with contextlib.suppress(OSError):  # recently used: the folder's bound deletes it last
                os.utime(copy)
            cache.source, cache.converted_copy = str(path), (copy, "reused")
            log.info("%s is in llama.cpp's format: mapped its copy in our format %s (written by an earlier "
                     "load; %s=1 reads the file instead)", path, copy, ENV_OFF)
            return cache
    t = time.perf_counter()
    cache = read_llama(path)
    seconds = time.perf_counter() - t
    cache.converted_copy = None
    try:
        copy.parent.mkdir(parents=True, exist_ok=True)
        save_ours(cache, copy)
    except OSError as exc:
        log.info("%s is in llama.cpp's format: read in %.2f s; no copy in our format kept (%s)", path, seconds, exc)
        return cache
    for old in copy.parent.glob(copy.name.split("-")[0] + "-*.ngc"):  # earlier versions of this path
        if old != copy:
            old.unlink(missing_ok=True)
    _bound_folder(copy, bound)
    cache.converted_copy = (copy, "written")
    log.info("%s is in llama.cpp's format: read in %.2f s and kept in our format as %s, which later loads "
             "map in milliseconds (%s=1: no copies)", path, seconds, copy, ENV_OFF)
    return cache


def max_bytes() -> int:
    """The folder's bound in bytes: ``NGRAM_SPEC_CONVERTED_MAX_BYTES`` (an integer >= 0), else ``MAX_BYTES``."""
    value = os.environ.get(ENV_MAX_BYTES, "")
    if not value:
        return MAX_BYTES
    try:
        bound = int(value)
    except ValueError:
        bound = -1
    if bound < 0:
        raise ValueError(f"{ENV_MAX_BYTES}={value!r}: the converted copies' bound must be a number of bytes "
                         f">= 0 (e.g. {MAX_BYTES} for 4 GiB); unset it for that default")
    return bound


def _bound_folder(keep: Path, bound: int) -> None:
    """Delete the least recently used copies in ``keep``'s folder (oldest modification time first) until
    it holds at most ``bound`` bytes; ``keep`` (the copy just written) is never deleted."""
    copies = []
    for p in keep.parent.glob("*.ngc"):
        with contextlib.suppress(OSError):           # removed meanwhile by another process
            st = p.stat()
            copies.append((st.st_mtime_ns, st.st_size, p))
    total = sum(size for _, size, _ in copies)
    for _, size, p in sorted(copies, key=lambda c: c[:2]):
        if total <= bound:
            break
        if p != keep:
            p.unlink(missing_ok=True)
            total -= size
