"""``ngram-spec convert``: n-gram cache files between llama.cpp's format and ours (docs/cache-format.md)."""
from __future__ import annotations

import argparse
import os
import sys
import time

from reference.atomic import check_outputs
from mlx_backend.machine.backends import get_backend
from mlx_backend.cli.ngram import (add_backend_arg, backend_name, check_cache_outputs, check_format, check_input_file,
                                 load_cache_file, save_cache_file)

FORMATS = ("ours", "llama")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "convert",
        help="convert an n-gram cache file between llama.cpp's format and ours",
        description=(
            "Convert an n-gram cache file. The input format is detected from the file's first bytes "
            "(ours starts with the magic NGRAMSPC; llama.cpp's format, written by llama-lookup-create, "
            "llama-lookup and llama-lookup-merge, has no header). The content is unchanged: both files "
            "hold the same (n-gram, token, count) multiset. Our format is memory-mapped when loaded "
            "(nothing parsed), see docs/cache-format.md."),
        epilog="example: ngram-spec convert static.bin -o static.ngc --to ours",
    )
    p.add_argument("input", help="cache file to read (either format; llama.cpp's may be .xz-compressed)")
    p.add_argument("-o", "--output", required=True, help="cache file to write")
    p.add_argument("--to", choices=FORMATS, default="ours",
                   help="output format: ours (memory-mapped, default) or llama (llama.cpp's)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="record this vocabulary size (1..2**31) in our format's header, checked when the file is "
                        "used (--to ours only: llama.cpp's format has no header)")
    p.add_argument("--force", action="store_true", help="overwrite OUTPUT if it exists")
    add_backend_arg(p)
    p.set_defaults(func=run_convert)


def run_convert(args: argparse.Namespace) -> int:
    check_input_file(args.input, "input cache file")
    check_cache_outputs({"-o": args.output})
    check_outputs({"-o": args.output}, inputs=[args.input])
    if os.path.exists(args.output) and not args.force:
        raise ValueError(f"{args.output} exists; pass --force to overwrite it")
    if args.vocab_size is not None and not 0 < args.vocab_size <= 2**31:
        raise ValueError(f"--vocab-size must be 1..2147483648 (token ids are int32), got {args.vocab_size}")
    if args.vocab_size is not None and args.to != "ours":
        raise ValueError("--vocab-size is recorded in our format's header; llama.cpp's has none: pass --to ours")
    backend = get_backend(args.backend)
    check_format(backend, args.to, "--to")
    t0 = time.perf_counter()
    if hasattr(backend, "convert"):  # mlx: checks every array of our format, can record --vocab-size
        from mlx_backend.ngram.cache_file import check_tokenizer
        from mlx_backend.ngram.caches import load_cache

        cache = load_cache(args.input, verify=True, keep_copy=False)   # the output is the one copy asked for
        if args.vocab_size:
            check_tokenizer(cache, args.input, args.vocab_size, None)
            top = max((int(s.tokens.max()) for s in cache.sections.values() if s.n_entries), default=-1)
            top = max([top] + [int(s.key_words()[0].max() >> 32) for s in cache.sections.values()])
            if top >= args.vocab_size:
                raise ValueError(f"token id {top} in {args.input} does not fit --vocab-size {args.vocab_size}")
            cache.vocab_size = args.vocab_size
    else:  # the reference reads either format, writes llama.cpp's (check_format: --to ours needs mlx)
        cache = load_cache_file(backend, args.input, "input")
    save_cache_file(backend, cache, args.output, args.to)
    print(f"{args.input} -> {args.output} ({args.to}, backend {backend_name(backend)}): {len(cache)} n-grams, "
          f"{cache.n_entries()} entries, {os.path.getsize(args.output)} bytes, {time.perf_counter() - t0:.2f} s",
          file=sys.stderr)
    return 0
