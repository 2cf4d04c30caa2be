"""``ngram-spec create | stats | merge | inspect``: llama.cpp's lookup-create, lookup-stats and
lookup-merge on token files, and a look inside cache files; ``stats --requests`` replays recorded
requests (prompt, output) with the lookup, suffix or auto drafter (:mod:`reference.suffix.replay`).

Token files are raw little-endian int32 (``.i32``) or ``.npy`` (``.xz`` is decompressed on the fly);
cache files use llama.cpp's ``common_ngram_cache_save`` format. ``--backend`` picks the
implementation (``reference`` = the readable NumPy/Python one; ``mlx`` = the fast one).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import gzip
import inspect
import io
import json
import lzma
import os
import sys
import time
from pathlib import Path

from reference.atomic import atomic_write, check_outputs
from mlx_backend.machine.backends import BACKENDS, DEFAULT_HELP, get_backend
from mlx_backend.cli import UserError
from mlx_backend.cli.generate import check_drafter_caches
from mlx_backend.cli.progress import add_option as add_progress_option, bar
from mlx_backend.cli.prompts import check_unicode
from reference.ngram.draft import SCORES
from reference.ngram.ours_file import check_file_tokenizer, tokenizer_fingerprint
from reference.ngram.replay import check_replay_args
from reference.ngram.tokens import read_bytes, write_tokens_into
from reference.suffix.auto import DEFAULT_DRAFTER, DRAFTERS
from reference.suffix.replay import replay_requests

DRAFT_DUMP_HEADER = "# pos k draft_1..draft_k  (pos = index in the token file of the token draft_1 predicts)\n"


def register(subparsers) -> None:
    fmt = argparse.RawDescriptionHelpFormatter

    p = subparsers.add_parser(
        "create", formatter_class=fmt, help="build a static n-gram cache (llama-lookup-create)",
        description="Build a static cache: the counts of every (2-gram, next token) of INPUT, like\n"
                    "llama-lookup-create. INPUT is a token file (.i32 raw little-endian int32, .npy), or a\n"
                    "UTF-8 text file when --tokenizer is given.\n\n"
                    "example: ngram-spec create corpus.i32 -o static.bin\n"
                    "         ngram-spec create corpus.txt --tokenizer path/to/tokenizer.json -o static.bin")
    p.add_argument("input", metavar="INPUT", help="token file, or text file with --tokenizer")
    p.add_argument("-o", "--output", required=True, metavar="OUTPUT",
                   help="cache file to write; an existing file is replaced once the new one is complete (as "
                        "llama.cpp's tools do; never one of the inputs)")
    p.add_argument("--tokenizer", metavar="PATH",
                   help="tokenize INPUT as text with this tokenizer: a Hugging Face tokenizer.json (or its directory), "
                        "or a .gguf model file")
    p.add_argument("--no-special", action="store_true",
                   help="with --tokenizer: do not add special tokens such as BOS (llama.cpp adds them)")
    p.add_argument("--tokens-out", metavar="FILE",
                   help="also write the tokens of INPUT to FILE (.npy if so named, else raw little-endian int32: "
                        ".i32)")
    add_format_arg(p)
    add_backend_arg(p)
    add_progress_option(p)
    p.set_defaults(func=cmd_create)

    register_stats(subparsers, fmt)

    p = subparsers.add_parser(
        "merge", formatter_class=fmt, help="sum the counts of cache files (llama-lookup-merge)",
        description="Merge cache files: the counts of equal (n-gram, token) pairs are summed, like\n"
                    "llama-lookup-merge. The result does not depend on the order of the inputs.\n\n"
                    "example: ngram-spec merge a.bin b.bin -o merged.bin")
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="cache files")
    p.add_argument("-o", "--output", required=True, metavar="OUTPUT",
                   help="cache file to write; an existing file is replaced once the new one is complete (as "
                        "llama.cpp's tools do; never one of the inputs)")
    add_format_arg(p)
    add_backend_arg(p)
    p.set_defaults(func=cmd_merge)

    p = subparsers.add_parser(
        "inspect", formatter_class=fmt, help="show what a cache file holds",
        description="Summarize a cache file: n-grams, (n-gram, follower) entries and the sum of counts\n"
                    "per n-gram size, how many followers the n-grams have, and the most frequent entries.\n\n"
                    "example: ngram-spec inspect static.bin --top 5")
    p.add_argument("file", metavar="FILE", help="cache file")
    p.add_argument("--top", type=int, default=10, help="how many top entries to list (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print JSON (with the backend that ran)")
    add_backend_arg(p)
    p.set_defaults(func=cmd_inspect)


def register_stats(subparsers, fmt) -> None:
    """The ``stats`` parser: a token file (llama-lookup-stats) or ``--requests``."""
    p = subparsers.add_parser(
        "stats", formatter_class=fmt,
        help="replay a token file (llama-lookup-stats) or recorded requests and count drafted/accepted tokens",
        description="Replay TOKENS as if a model had generated them, drafting with llama.cpp's n-gram\n"
                    "caches before every token, like llama-lookup-stats: the stream is cut into\n"
                    "floor((N-1)/n_ctx) chunks; each chunk starts with an empty context cache, which is merged\n"
                    "into the dynamic cache afterwards. Reports drafted and accepted tokens, the acceptance\n"
                    "rate, and the drafting time per drafted token.\n\n"
                    "With --requests FILE instead of TOKENS: replay recorded requests as the generation loop\n"
                    "would run them (reference/suffix/replay.py). FILE is JSON Lines (.jsonl, .jsonl.xz, .jsonl.gz),\n"
                    "one request a line: {\"prompt\": TEXT or [ids], \"output\": TEXT or [ids]}, the output\n"
                    "being what greedy decoding gave for the prompt; text is tokenized as is (no chat\n"
                    "template, no special tokens) with --model's tokenizer. Each request starts with k = 0\n"
                    "(the first token), then drafts k = min(--draft-max, tokens left - 1), accepts the drafts\n"
                    "that match the output, emits them and one more token: one verify step. Reports\n"
                    "verify steps and output tokens per step (the speed-up bound: a forward pass per step),\n"
                    "per request too with --json.\n\n"
                    "example: ngram-spec stats text.i32 --static static.bin --n-ctx 4096 --n-draft 16 --json\n"
                    "         ngram-spec stats --requests benchmarks/data/edit-traces.jsonl.xz --drafter auto \\\n"
                    "             --draft-max 16 --history requests --json")
    p.add_argument("tokens", metavar="TOKENS", nargs="?", help="token file to replay (.i32, .npy)")
    p.add_argument("--requests", metavar="FILE",
                   help="replay recorded requests instead: JSON Lines {prompt, output} (text or token ids)")
    p.add_argument("--static", metavar="FILE", help="static cache file (2-grams, from `create`); lookup-stats -lcs")
    p.add_argument("--dynamic", metavar="FILE", help="dynamic cache file loaded at start; lookup-stats -lcd")
    p.add_argument("--n-ctx", type=int, default=None,
                   help="chunk length, the model context (default: 4096; TOKENS only). llama-lookup-stats chunks "
                        "by llama_n_ctx(), its -c rounded up (to a multiple of 256 in current llama.cpp): to "
                        "reproduce `-c 1000`, pass --n-ctx 1024")
    p.add_argument("--n-draft", "--draft-max", type=int, default=16,
                   help="maximum tokens per draft (alias --draft-max, the name generate uses; default: %(default)s)")
    p.add_argument("--drafter", choices=DRAFTERS, default=None,
                   help=f"with --requests (default {DEFAULT_DRAFTER}, as generate and serve): lookup (llama.cpp's "
                        "n-gram caches; the only drafter of a token file), suffix (copy what followed "
                        "the longest earlier match of the sequence's end, in the sequence or the history) or auto "
                        "(suffix where the sequence's end occurred earlier, else lookup)")
    p.add_argument("--history", choices=("none", "requests"), default="none",
                   help="with --requests: none (each request on its own, default) or requests (the suffix "
                        "drafter also matches every earlier request's prompt and output, in file order, as a "
                        "server sees them; lookup ignores it)")
    p.add_argument("--model", metavar="PATH",
                   help="with --requests: the tokenizer for text requests, whose vocabulary every id is then "
                        "checked against: a .gguf model file, or a model directory / tokenizer.json (default: the "
                        "bundled SmolLM2-135M-Instruct GGUF, loaded only when a line holds text; a file of ids "
                        "alone is checked against a vocabulary only with --model)")
    p.add_argument("--score", choices=SCORES, default="exact",
                   help="score arithmetic: exact integers (default), or int32 = llama.cpp's wrapping 32-bit "
                        "product (identical unless a product exceeds 2**31-1)")
    p.add_argument("--drafts-out", metavar="FILE",
                   help="write one line 'pos k d_1 .. d_k' per draft call (the conformance vectors' dump format; "
                        "TOKENS only; an existing FILE is replaced once the run is complete)")
    p.add_argument("--save-dynamic", metavar="FILE",
                   help="save the dynamic cache after the replay (the --dynamic one plus every replayed chunk; "
                        "TOKENS only; an existing FILE is replaced once the run is complete, never the --dynamic "
                        "input itself)")
    p.add_argument("--json", action="store_true",
                   help="print a JSON summary (with the backend that ran) instead of lookup-stats' lines; with "
                        "--requests: requests, output_tokens, verify_steps, tokens_per_step, drafted, accepted, "
                        "draft_us_per_token (drafter time per output token) and per_request")
    add_progress_option(p)
    add_format_arg(p)
    add_backend_arg(p)
    p.set_defaults(func=cmd_stats)


def add_format_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--format", choices=("llama", "ours"), default="llama",
                   help="format of the cache file written: llama (llama.cpp's, default) or ours (memory-mapped, "
                        "docs/cache-format.md; written by --backend mlx). Either backend reads either format.")


def add_backend_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default=None, metavar="NAME",
                   help=f"implementation to use: {' or '.join(sorted(BACKENDS))} (or module.path:object "
                        f"exporting the same API; {DEFAULT_HELP}); the one that ran is named in the output")


# --- helpers -------------------------------------------------------------------------------------

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".text")  # create's INPUT: text to tokenize, not token ids


def tokenizer_file(path: str) -> Path:
    """The file ``--tokenizer PATH`` reads: PATH, or the ``tokenizer.json`` in it when it is a directory."""
    p = Path(path)
    return p / "tokenizer.json" if p.is_dir() else p


def load_tokenizer(path: str):
    """A Hugging Face tokenizer (``encode(text, add_special_tokens=...)``, ``get_vocab()``) from a
    ``tokenizer.json`` (or a directory holding one), or from the vocabulary stored in a ``.gguf`` model file."""
    p = Path(path)
    if p.suffix == ".gguf":
        try:
            from mlx_backend.models.tokenizer import load_gguf_tokenizer
        except ImportError as exc:
            raise UserError(f"a .gguf tokenizer needs the mlx extra ({exc}): pip install 'ngram-spec[mlx]'") from exc
        return load_gguf_tokenizer(p)._tokenizer
    file = tokenizer_file(path)
    if not file.is_file():
        raise UserError(f"tokenizer {path}: no tokenizer.json found (pass the file, the directory holding it, "
                        "or a .gguf model file)")
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:
        raise UserError("--tokenizer needs the 'tokenizers' package: pip install tokenizers") from exc
    try:
        return Tokenizer.from_file(str(file))
    except Exception as exc:  # the library raises its own exception type
        raise UserError(f"tokenizer {file}: cannot load it ({exc})") from exc


def encode(tokenizer, text: str, add_special: bool) -> list[int]:
    """``text`` as token ids (a ``tokenizers.Tokenizer`` returns an Encoding, transformers' a list)."""
    ids = tokenizer.encode(text, add_special_tokens=add_special)
    return ids if isinstance(ids, list) else ids.ids


def dump_line(pos: int, drafts: list[int]) -> str:
    """One draft call in the conformance vectors' dump format: ``pos k d_1 .. d_k`` and LF."""
    return " ".join(map(str, [pos, len(drafts), *drafts])) + "\n"


def backend_name(backend) -> str:
    """The backend's ``NAME``, else its module's name, else its type's (``--backend module.path:object`` may name
    any object exporting the API: a ``SimpleNamespace``, an instance)."""
    return getattr(backend, "NAME", None) or getattr(backend, "__name__", None) or type(backend).__name__


def check_input_file(path: str, what: str = "") -> None:
    """A user-given input path must be a file: say "is a directory", "no such file" or "not a regular file"
    (a device such as /dev/null, a pipe, a socket), one line."""
    if Path(path).is_dir():
        raise UserError(f"{what} {path}: is a directory, not a file".lstrip())
    if not Path(path).exists():
        raise UserError(f"{what} {path}: no such file".lstrip())
    if not Path(path).is_file():
        raise UserError(f"{what} {path}: not a regular file (a device, pipe or socket); name a file".lstrip())


def read_input_tokens(backend, path: str):
    check_input_file(path)
    return backend.read_tokens(path)


def load_cache_file(backend, path: str, what: str = ""):
    """The cache at ``path``, every array checked: the reference parses and checks the whole file; the
    mlx backend maps a file of our format and checks its arrays (``verify``: about 0.2-0.5 s for 120 MB),
    so a file damaged past its header checksum is refused here rather than drafted from or copied into
    an output."""
    check_input_file(path, f"{what} cache file".lstrip())
    if "progress" in inspect.signature(backend.load_cache).parameters:  # the reference parses the whole file
        return backend.load_cache(path, progress=bar(f"load {Path(path).name}", "B"))
    return backend.load_cache(path, verify=True)


def check_format(backend, fmt: str, flag: str = "--format") -> None:
    """Before any work: only the mlx backend writes our format."""
    if fmt != "llama" and not hasattr(backend, "detect_format"):
        raise UserError(f"{flag} {fmt} needs --backend mlx")


def check_cache_outputs(outputs: dict[str, str | None]) -> None:
    """Before any work: a cache file is written uncompressed, and every command reads a name ending in
    ``.xz`` as xz-compressed, so a cache output (option -> path, ``None`` = not given) so named could
    never be read back."""
    for flag, path in outputs.items():
        if path is not None and str(path).endswith(".xz"):
            raise UserError(f"{flag} {path}: cache files are written uncompressed, and a name ending in .xz is "
                            "read back as xz-compressed; drop the .xz (compress the file afterwards with xz -k)")


def save_cache_file(backend, cache, path: str, fmt: str) -> None:
    if fmt == "llama":
        backend.save_cache(cache, path)
    else:  # the mlx backend writes both formats (check_format)
        backend.save_cache(cache, path, format=fmt)


def cache_rows(backend, cache) -> list[tuple[int, ...]]:
    return backend.cache_entries(cache)


def check_static(backend, cache, path: str) -> None:
    """A static cache holds 2-grams only (llama-lookup-create); anything else is a mistake."""
    sizes = cache.sizes() if hasattr(cache, "sizes") else {row[0] for row in cache_rows(backend, cache)}
    if sizes - {2}:
        raise UserError(f"static cache {path} holds n-grams of sizes {sorted(sizes)}; a static cache must hold "
                        "2-grams only (make it with `ngram-spec create`; pass other caches as --dynamic)")


def check_vocabulary(tokens, path: str, caches: dict[str, tuple[str, object]]) -> None:
    """A cache file of our format that records its vocabulary size (``create --tokenizer``, ``convert
    --vocab-size``) is checked when used: a token id of ``path`` at or above it comes from another
    tokenizer, and replaying it against that cache would count drafts that mean nothing. ``caches``:
    what -> (file, cache), ``None`` caches skipped."""
    top = int(max(tokens)) if len(tokens) else -1
    for what, (file, cache) in caches.items():
        vocab = getattr(cache, "vocab_size", 0) if cache is not None else 0
        if vocab and top >= vocab:
            raise UserError(f"{path} holds token id {top}, outside the vocabulary of {vocab} tokens the {what} cache "
                            f"{file} was built for: make the cache and the token file with the same tokenizer")


# --- commands ------------------------------------------------------------------------------------

def cmd_create(args) -> int:
    backend = get_backend(args.backend)
    check_format(backend, args.format)
    if args.tokens_out and (args.tokens_out.endswith(".xz") or Path(args.tokens_out).suffix in TEXT_SUFFIXES):
        raise UserError(f"--tokens-out {args.tokens_out}: a name that reads back as something else (.xz is "
                        "decompressed, a text suffix is tokenized); name it .i32 (raw little-endian int32) or .npy")
    check_cache_outputs({"-o": args.output})
    check_outputs({"-o": args.output, "--tokens-out": args.tokens_out},
                  inputs=[args.input, args.tokenizer and tokenizer_file(args.tokenizer)])
    tokenizer = None
    if args.tokenizer:
        tokenizer = load_tokenizer(args.tokenizer)
        check_input_file(args.input)
        try:
            text = Path(args.input).read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise UserError(f"{args.input}: not UTF-8 text ({exc}); token files need no --tokenizer") from exc
        tokens = encode(tokenizer, text, not args.no_special)
    else:
        if Path(args.input).suffix in TEXT_SUFFIXES:
            raise UserError(f"{args.input} looks like a text file: pass --tokenizer PATH to tokenize it")
        tokens = read_input_tokens(backend, args.input)
    if len(tokens) == 0:
        raise UserError(f"{args.input} holds no tokens: nothing to count (a cache is made from at least 2 tokens)")
    t0 = time.perf_counter()
    cache = backend.build_static(tokens, progress=bar("create", "tok", False if args.no_progress else None))
    if tokenizer is not None and args.format == "ours":  # recorded, so the cache is refused with another tokenizer
        cache.vocab_size, cache.fingerprint = tokenizer_fingerprint(tokenizer)
    with contextlib.ExitStack() as outputs:
        if args.tokens_out:   # written first, renamed after the cache: a full disk for either leaves both as they were
            write_tokens_into(outputs.enter_context(atomic_write(args.tokens_out)), args.tokens_out, tokens)
        save_cache_file(backend, cache, args.output, args.format)
    print(f"{args.output}: {len(cache)} 2-grams, {cache.n_entries()} entries from {len(tokens)} tokens "
          f"({time.perf_counter() - t0:.2f} s, backend {backend_name(backend)})", file=sys.stderr)
    return 0


def cmd_stats(args) -> int:
    if args.requests is not None:
        return cmd_stats_requests(args)
    if args.tokens is None:
        raise UserError("stats needs a token file TOKENS, or --requests FILE")
    for flag, value, default in (("--drafter", args.drafter or "lookup", "lookup"),
                                 ("--history", args.history, "none"), ("--model", args.model, None)):
        if value != default:
            raise UserError(f"{flag} applies to --requests only (a token file is replayed with llama.cpp's lookup)")
    if args.n_ctx is None:
        args.n_ctx = 4096
    try:
        check_replay_args(args.n_ctx, args.n_draft)
    except ValueError as exc:   # the reference's rule, named as the flag is: "n_ctx must ..." -> "--n-ctx must ..."
        raise UserError("--" + str(exc).replace("_", "-", 1)) from exc
    backend = get_backend(args.backend)
    if args.save_dynamic:
        check_format(backend, args.format)
    check_cache_outputs({"--save-dynamic": args.save_dynamic})
    check_outputs({"--save-dynamic": args.save_dynamic, "--drafts-out": args.drafts_out},
                  inputs=[args.tokens, args.static, args.dynamic])
    tokens = read_input_tokens(backend, args.tokens)
    t0 = time.perf_counter()
    c_st = load_cache_file(backend, args.static, "static") if args.static else None
    c_dyn = load_cache_file(backend, args.dynamic, "dynamic") if args.dynamic else None
    load_ms = 1e3 * (time.perf_counter() - t0)  # t_draft_flat of lookup-stats
    if c_st is not None:
        check_static(backend, c_st, args.static)
    check_vocabulary(tokens, args.tokens, {"static": (args.static, c_st), "dynamic": (args.dynamic, c_dyn)})

    extra = {}
    if "progress" in inspect.signature(backend.replay).parameters:
        extra["progress"] = bar("replay", "tok", False if args.no_progress else None)  # None: a terminal only
    if args.drafts_out:  # compile the replay (numba, on a first run) before the dump's temporary file exists: a
        # signal is handled between Python bytecodes, so SIGTERM during a long compile would wait for it
        backend.replay(tokens[:3], n_ctx=2, n_draft=1, c_st=c_st, on_draft=lambda pos, drafts: None, score=args.score)
    with contextlib.ExitStack() as files:
        dump = files.enter_context(atomic_write(args.drafts_out, "w", newline="\n")) if args.drafts_out else None
        if dump is not None:
            dump.write(f"# variant={backend_name(backend)} n_ctx={args.n_ctx} n_draft={args.n_draft} "
                       f"static={args.static or ''} dynamic={args.dynamic or ''}\n")
            dump.write(DRAFT_DUMP_HEADER)
        on_draft = (lambda pos, drafts: dump.write(dump_line(pos, drafts))) if dump is not None else None
        stats = backend.replay(tokens, n_ctx=args.n_ctx, n_draft=args.n_draft, c_st=c_st, c_dyn=c_dyn,
                               on_draft=on_draft, score=args.score, **extra)
        if args.save_dynamic:   # inside: the dump is renamed after it, so a failed save leaves both as they were
            save_cache_file(backend, stats.c_dyn, args.save_dynamic, args.format)

    N = len(tokens)
    if stats.n_chunks == 0:  # not an error (llama-lookup-stats prints zeros too), but never silent
        print(f"ngram-spec stats: note: nothing replayed: {args.tokens} has {N} tokens, a chunk needs "
              f"n_ctx + 1 = {args.n_ctx + 1}; pass a smaller --n-ctx", file=sys.stderr)
    summary = {
        "n_input": N, "n_ctx": args.n_ctx, "n_draft": args.n_draft, "n_chunks": stats.n_chunks,
        "tokens_replayed": stats.n_chunks * args.n_ctx, "n_predict": N - N % args.n_ctx,
        "n_draft_calls": stats.n_draft_calls, "n_drafted": stats.n_drafted, "n_accept": stats.n_accept,
        "accept": stats.accept, "t_draft_us": stats.t_draft_us,
        "us_per_drafted_token": stats.us_per_drafted_token, "load_ms": load_ms,
        "backend": backend_name(backend), "score": args.score,
    }
    if args.json:
        print(json.dumps(summary, indent=1))
    else:  # the lines llama-lookup-stats prints (lookup-stats.cpp:143-150)
        t_draft_ms = stats.t_draft_us / 1e3
        tps = stats.n_drafted / (t_draft_ms / 1e3) if t_draft_ms else 0.0
        print(f"n_draft      = {args.n_draft}\n"
              f"n_predict    = {summary['n_predict']}\n"
              f"n_drafted    = {stats.n_drafted}\n"
              f"t_draft_flat = {load_ms:.2f} ms\n"
              f"t_draft      = {t_draft_ms:.2f} ms, {stats.us_per_drafted_token:.2f} us per token, "
              f"{tps:.2f} tokens per second\n"
              f"n_accept     = {stats.n_accept}\n"
              f"accept       = {stats.accept:.3f}%")
    return 0


# --- stats --requests: recorded requests replayed as the generation loop runs them -------------

KEYS = ("prompt", "output")


def check_request_args(args) -> None:
    """Options of the token-file replay that mean nothing here, and bad values: one line each."""
    if args.tokens is not None:
        raise UserError(f"pass either a token file ({args.tokens}) or --requests, not both")
    for flag, value in (("--n-ctx", args.n_ctx), ("--drafts-out", args.drafts_out),
                        ("--save-dynamic", args.save_dynamic)):
        if value is not None:
            raise UserError(f"{flag} applies to a token file only, not to --requests")
    if args.n_draft < 0:
        raise UserError(f"--draft-max must be >= 0, got {args.n_draft}")
    check_drafter_caches(args.drafter, args.static, args.dynamic)


GZIP_MAGIC, XZ_MAGIC = b"\x1f\x8b", b"\xfd7zXZ\x00"


def read_request_lines(path: str) -> list[tuple[int, dict]]:
    """``(line number, object)`` of every non-blank line of a JSON Lines file, UTF-8 (a byte-order mark
    allowed); xz- or gzip-compressed files are decompressed (known by their first bytes, whatever the name)."""
    check_input_file(path, "requests file")
    data = read_bytes(path)
    try:
        if data.startswith(GZIP_MAGIC):
            data = gzip.decompress(data)
        elif data.startswith(XZ_MAGIC):
            data = lzma.decompress(data)
    except (OSError, EOFError, lzma.LZMAError) as exc:
        raise UserError(f"{path}: a damaged compressed file ({exc})") from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise UserError(f"{path}: not UTF-8 text ({exc})") from exc
    rows = []
    for number, line in enumerate(io.StringIO(text), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}:{number}: not valid JSON ({exc.msg} at column {exc.colno})") from exc
        except (ValueError, RecursionError) as exc:   # an integer of over 4,300 digits; nesting too deep
            raise UserError(f"{path}:{number}: not valid JSON for a request ({type(exc).__name__}: "
                            f"{str(exc).split(';')[0]})") from None
        if not isinstance(obj, dict):
            raise UserError(f"{path}:{number}: a request must be a JSON object with \"prompt\" and \"output\", "
                            f"got {type(obj).__name__}")
        missing = [k for k in KEYS if k not in obj]
        if missing:
            raise UserError(f"{path}:{number}: missing key {' and '.join(repr(k) for k in missing)} "
                            "(a request is {\"prompt\": ..., \"output\": ...})")
        for key in KEYS:
            value = obj[key]
            ok = isinstance(value, str) or (isinstance(value, list) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in value))
            if not ok:
                raise UserError(f"{path}:{number}: {key!r} must be text or a list of token ids (integers)")
            if len(value) == 0:
                raise UserError(f"{path}:{number}: {key!r} is empty (a request has at least one prompt token "
                                "and one output token)")
            if isinstance(value, str):
                check_unicode(value, f"{path}:{number}: {key!r}")
        rows.append((number, obj))
    if not rows:
        raise UserError(f"{path}: no requests (one JSON object a line)")
    return rows


def resolve_tokenizer(model: str | None):
    """``(tokenizer, vocab_size)`` of ``--model`` (default: the bundled SmolLM2 GGUF). The size is the model's
    where a model directory states it (``config.json``'s ``vocab_size``, or its ``text_config``'s) and it is
    larger than the tokenizer's, as ``generate`` checks a prompt against the model (ids a model can emit that
    its tokenizer does not name, e.g. padding rows, are in a transcript it produced)."""
    if model is None:
        try:
            from mlx_backend.models.gguf_file import default_model_path
            model = str(default_model_path())
        except ImportError as exc:
            raise UserError(f"the default tokenizer needs the mlx extra ({exc}); pass --model PATH "
                            "(a tokenizer.json or its directory)") from exc
        except FileNotFoundError as exc:
            raise UserError(str(exc)) from exc
    elif not Path(model).exists():
        raise UserError(f"--model {model}: no such file or directory")
    tokenizer = load_tokenizer(model)
    size = tokenizer.get_vocab_size() if hasattr(tokenizer, "get_vocab_size") else len(tokenizer.get_vocab())
    return tokenizer, max(size, config_vocab_size(Path(model)))


def config_vocab_size(model: Path) -> int:
    """The ``vocab_size`` an mlx-lm model directory's ``config.json`` states (top level or ``text_config``), 0
    where there is none to read."""
    try:
        config = json.loads((model / "config.json").read_text())
    except (OSError, ValueError):
        return 0
    for where in (config, config.get("text_config") if isinstance(config, dict) else None):
        if isinstance(where, dict) and isinstance(where.get("vocab_size"), int):
            return where["vocab_size"]
    return 0


def tokenize_requests(path: str, rows, model: str | None
                      ) -> tuple[list[tuple[list[int], list[int]]], object, int | None]:
    """Token ids of every request (text through the tokenizer, as is), checked against the vocabulary
    when one is known (``--model`` given, or text in the file); with the tokenizer and the vocabulary size
    (None, None where neither is known)."""
    need = model is not None or any(isinstance(obj[k], str) for _, obj in rows for k in KEYS)
    tokenizer, vocab = resolve_tokenizer(model) if need else (None, None)
    requests = []
    for number, obj in rows:
        pair = []
        for key in KEYS:
            value = obj[key]
            ids = encode(tokenizer, value, False) if isinstance(value, str) else value
            if isinstance(value, str) and not ids:
                raise UserError(f"{path}:{number}: {key!r} tokenizes to no tokens")
            bad = next((t for t in ids if t < 0 or (vocab is not None and t >= vocab) or t > 2**31 - 1), None)
            if bad is not None:
                rule = f"0..{vocab - 1}, the vocabulary of {model or 'the default model'}" if vocab else "0..2**31-1"
                raise UserError(f"{path}:{number}: {key!r} holds token id {bad}, outside {rule}")
            pair.append(list(ids))
        requests.append(tuple(pair))
    return requests, tokenizer, vocab


def request_drafters(backend, name: str, c_st, c_dyn, score: str):
    """``(make_drafter(history), new_history, suffix_impl)`` for the backend that runs: the reference's
    drafters, or the fast ones (:func:`mlx_backend.ngram.default.make_drafter`, the suffix drafter of
    :func:`~mlx_backend.ngram.default.suffix_api` and its ``SuffixHistory``)."""
    if backend_name(backend) == "reference":
        from reference.suffix.auto import make_drafter
        from reference.suffix.drafter import SuffixHistory

        return (lambda history: make_drafter(name, c_st=c_st, c_dyn=c_dyn, history=history, score=score),
                SuffixHistory, "reference")
    from mlx_backend.ngram.default import make_drafter, suffix_api

    api = suffix_api()
    return (lambda history: make_drafter(name, c_st=c_st, c_dyn=c_dyn, history=history, score=score),
            api.SuffixHistory, "reference" if api.__name__.startswith("reference") else backend_name(backend))


def cmd_stats_requests(args) -> int:
    check_request_args(args)
    args.drafter = args.drafter or DEFAULT_DRAFTER   # generate's and serve's default: what they would do
    backend = get_backend(args.backend)
    rows = read_request_lines(args.requests)
    requests, tokenizer, vocab = tokenize_requests(args.requests, rows, args.model)
    check_file_tokenizer(tokenizer, args.static, args.dynamic)   # as generate checks them (headers only)
    c_st = load_cache_file(backend, args.static, "static") if args.static else None
    c_dyn = load_cache_file(backend, args.dynamic, "dynamic") if args.dynamic else None
    if c_st is not None:
        check_static(backend, c_st, args.static)
    check_vocabulary([max(max(p), max(o)) for p, o in requests], args.requests,
                     {"static": (args.static, c_st), "dynamic": (args.dynamic, c_dyn)})
    make, new_history, suffix_impl = request_drafters(backend, args.drafter, c_st, c_dyn, args.score)
    history = new_history() if args.history == "requests" else None
    replay_requests([([0, 1, 0, 1], [0, 1, 0, 1])], make, 2)  # compile (numba) outside the timed replay
    progress = bar("replay", "tok", False if args.no_progress else None)
    result = replay_requests(requests, make, args.n_draft, history=history, vocab_size=vocab, progress=progress)
    summary = {
        "requests": result.requests, "output_tokens": result.output_tokens, "verify_steps": result.verify_steps,
        "tokens_per_step": result.tokens_per_step, "drafted": result.drafted, "accepted": result.accepted,
        "accept": 100.0 * result.accepted / result.drafted if result.drafted else 0.0,
        "draft_us_per_token": result.draft_us_per_token,
        "drafter": args.drafter, "draft_max": args.n_draft, "history": args.history,
        "backend": backend_name(backend), "suffix_backend": suffix_impl if args.drafter != "lookup" else None,
        "per_request": [{"line": number, "output_tokens": r.output_tokens, "verify_steps": r.verify_steps,
                         "drafted": r.drafted, "accepted": r.accepted}
                        for (number, _), r in zip(rows, result.per_request)],
    }
    if args.json:
        print(json.dumps(summary, indent=1))
        return 0
    print(f"requests        = {result.requests}\n"
          f"drafter         = {args.drafter} (draft-max {args.n_draft}, history {args.history}, "
          f"backend {summary['backend']})\n"
          f"output_tokens   = {result.output_tokens}\n"
          f"verify_steps    = {result.verify_steps}\n"
          f"tokens_per_step = {result.tokens_per_step:.3f}\n"
          f"drafted         = {result.drafted}\n"
          f"accepted        = {result.accepted} ({summary['accept']:.1f}%)\n"
          f"draft time      = {result.draft_us_per_token:.2f} us per output token")
    return 0


def warn_repeated_inputs(paths) -> None:
    """``merge`` sums every input's counts, as ``llama-lookup-merge`` does, so a file given twice (by any path
    to it) counts twice: allowed (a way to weight a file), but said, as it is more often a slip."""
    seen: dict[tuple[int, int], list[str]] = {}
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            continue  # loading it names the problem
        seen.setdefault((st.st_dev, st.st_ino), []).append(str(path))
    for names in seen.values():
        if len(names) > 1:
            print(f"ngram-spec merge: warning: one file is given {len(names)} times ({', '.join(names)}): its counts are added "
                  f"{len(names)} times (give each file once unless you mean to weight it)", file=sys.stderr)


def cmd_merge(args) -> int:
    backend = get_backend(args.backend)
    check_format(backend, args.format)
    check_cache_outputs({"-o": args.output})
    check_outputs({"-o": args.output}, inputs=args.inputs)
    warn_repeated_inputs(args.inputs)
    caches = [load_cache_file(backend, path, "input") for path in args.inputs]
    merged = backend.merge_caches(caches)
    save_cache_file(backend, merged, args.output, args.format)
    print(f"{args.output}: {merged.n_entries()} entries, total count {merged.total()} "
          f"from {len(args.inputs)} file(s) (backend {backend_name(backend)})", file=sys.stderr)
    return 0


def describe(rows: list[tuple[int, ...]], top: int) -> dict:
    """Per-size totals, the follower distribution and the top entries of canonical cache rows."""
    per_n: dict[int, dict[str, int]] = {}
    followers: collections.Counter = collections.Counter()  # n-gram (n, t0..t3) -> number of followers
    for n, *slots, token, count in rows:
        d = per_n.setdefault(n, {"ngrams": 0, "entries": 0, "sum_counts": 0})
        d["entries"] += 1
        d["sum_counts"] += count
        followers[(n, *slots)] += 1
    for key in followers:
        per_n[key[0]]["ngrams"] += 1
    hist = collections.Counter(followers.values())
    top_rows = sorted(rows, key=lambda r: (-r[6], r))[:top]
    return {
        "ngrams": len(followers), "entries": len(rows), "sum_counts": sum(r[6] for r in rows),
        "per_n": {str(n): per_n[n] for n in sorted(per_n)},
        "followers": {
            "max": max(hist) if hist else 0,
            "mean": len(rows) / len(followers) if followers else 0.0,
            "ngrams_with_1": hist.get(1, 0),
            "histogram": {str(k): hist[k] for k in sorted(hist)[:20]},
        },
        "top": [{"ngram": [t for t in r[1:5] if t != -1], "token": r[5], "count": r[6]} for r in top_rows],
    }


def cmd_inspect(args) -> int:
    if args.top < 0:
        raise UserError(f"--top must be >= 0, got {args.top}")
    backend = get_backend(args.backend)
    cache = load_cache_file(backend, args.file)
    summary = (backend.describe_cache(cache, args.top) if hasattr(backend, "describe_cache")
               else describe(cache_rows(backend, cache), args.top))
    info = {"file": args.file, "backend": backend_name(backend), **summary}
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    print(f"{args.file}: {info['ngrams']} n-grams, {info['entries']} entries, total count {info['sum_counts']}")
    print(" n   n-grams   entries  sum of counts")
    for n, d in info["per_n"].items():
        print(f" {n} {d['ngrams']:9d} {d['entries']:9d} {d['sum_counts']:14d}")
    f = info["followers"]
    print(f"followers per n-gram: mean {f['mean']:.2f}, max {f['max']}, "
          f"{f['ngrams_with_1']} n-grams with exactly one")
    if info["top"]:
        print("top entries (n-gram -> token: count):")
        for e in info["top"]:
            print(f"  ({', '.join(map(str, e['ngram']))}) -> {e['token']}: {e['count']}")
    return 0
