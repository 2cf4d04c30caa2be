"""The benchmarks' environment knobs (``NGRAM_SPEC_BENCH_*``), read with an error that names the variable.

A benchmark module reads its knobs at import; ``int("abc")`` there would fail with Python's own
``invalid literal for int()``, naming neither the variable nor what it wants. These do:

>>> import os
>>> os.environ["NGRAM_SPEC_BENCH_EXAMPLE"] = "12"
>>> whole_number("NGRAM_SPEC_BENCH_EXAMPLE", 5)
12
>>> os.environ["NGRAM_SPEC_BENCH_EXAMPLE"] = "1,2, 8"
>>> whole_numbers("NGRAM_SPEC_BENCH_EXAMPLE", "4")
[1, 2, 8]
>>> os.environ["NGRAM_SPEC_BENCH_EXAMPLE"] = "ten"
>>> whole_number("NGRAM_SPEC_BENCH_EXAMPLE", 5)
Traceback (most recent call last):
...
ValueError: NGRAM_SPEC_BENCH_EXAMPLE='ten': give a whole number >= 1 (default 5), or unset it
>>> os.environ["NGRAM_SPEC_BENCH_EXAMPLE"] = "1,x"
>>> whole_numbers("NGRAM_SPEC_BENCH_EXAMPLE", "4")
Traceback (most recent call last):
...
ValueError: NGRAM_SPEC_BENCH_EXAMPLE='1,x': give whole numbers >= 1, comma-separated (default 4), or unset it
>>> del os.environ["NGRAM_SPEC_BENCH_EXAMPLE"]
>>> whole_number("NGRAM_SPEC_BENCH_EXAMPLE", 5)
5
"""
from __future__ import annotations

import os


def whole_number(name: str, default: int | None) -> int | None:
    """``$name`` as an int >= 1, ``default`` when unset or empty."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{name}={text!r}: give a whole number >= 1 (default {default}), or unset it")
    return int(text)


def whole_numbers(name: str, default: str) -> list[int]:
    """``$name`` as a comma-separated list of ints >= 1 (``default``, in the same form, when unset)."""
    text = os.environ.get(name, "").strip() or default
    parts = [part.strip() for part in text.split(",")]
    if not all(part.isdigit() and int(part) >= 1 for part in parts):
        raise ValueError(f"{name}={text!r}: give whole numbers >= 1, comma-separated (default {default}), "
                         "or unset it")
    return [int(part) for part in parts]
