"""What both cache file formats share: the error that names the file and the byte offset, the
messages for an empty file or cache, and the first bytes that tell our format from llama.cpp's."""
from __future__ import annotations

import os

OURS_MAGIC = b"NGRAMSPC"  # first bytes of ngram-spec's memory-mapped format (docs/cache-format.md)
# llama.cpp's format has no header: an empty file would be an empty cache, which no user means.
EMPTY_FILE = ("empty file (0 bytes): an n-gram cache has at least one n-gram (a static cache: make one with "
              "`ngram-spec create`; a --dynamic file: delete it, and the run creates it)")
EMPTY_CACHE = ("the cache is empty: nothing to write (llama.cpp's format has no empty cache file; "
               "was anything replayed or counted?)")


class CacheFileError(ValueError):
    """A cache file that is truncated or corrupt; names the file and the byte offset. A truncation also
    says how many bytes the record (or int32) at ``offset`` needs (``needed``) and how many the file
    has from there (``left``). ``WHAT``: what the file may be instead, said last."""

    WHAT = "not an n-gram cache file in llama.cpp's format, or truncated/corrupt"

    def __init__(self, path: str | os.PathLike, offset: int, problem: str, *, needed: int | None = None,
                 left: int | None = None):
        self.path, self.offset, self.problem, self.needed, self.left = str(path), offset, problem, needed, left
        if needed is not None:
            problem += f" ({needed} bytes needed, {left} left)"
        super().__init__(f"cache file {path}: {problem} at byte offset {offset} ({self.WHAT})")


class OursFileError(CacheFileError):
    """A file that starts with our format's magic and is truncated or corrupt (not llama.cpp's to be told of)."""

    WHAT = "a file of ngram-spec's format, truncated or corrupt"
