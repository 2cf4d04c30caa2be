"""``ngram-spec serve``: the command line of :mod:`mlx_backend.serve.server`.

Every ``ngram-spec`` command builds the whole parser, so registering ``serve`` must not import the
server (mlx_lm.server, the n-gram tables and their compiled loops: about 0.5-1 s); it is imported
when ``serve`` runs.
"""
from __future__ import annotations

import argparse
import faulthandler
import importlib.util
import json
import os
import sys

import mlx.core  # noqa: F401  (without mlx or mlx-lm, mlx_backend.cli lists `serve` with the install hint)

from mlx_backend.machine.blas import add_option as add_blas_option
from mlx_backend.ngram.dynamic_cache import DYNAMIC_MAX_ENTRIES, check_max_entries
from reference.atomic import check_outputs
from reference.sampling import check_sampling
from reference.suffix.auto import DEFAULT_DRAFTER, DRAFTERS
from reference.speculative import DRAFT_MAX_LIMIT
from reference.suffix.drafter import HISTORY_MAX_TOKENS

if importlib.util.find_spec("mlx_lm") is None:
    raise ModuleNotFoundError("No module named 'mlx_lm'", name="mlx_lm")


def _size(text: str) -> int:
    """A size in bytes as mlx_lm.server reads it (``--prompt-cache-bytes``); anything else is one usage
    error (mlx-lm's parser raises decimal or key errors, which argparse would show as a traceback)."""
    from mlx_lm.server import _parse_size

    try:
        return _parse_size(text)
    except (ArithmeticError, KeyError, ValueError) as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: a number of bytes, optionally with M, MB, G "
                                         f"or GB (e.g. 512M, 8G)") from exc


def check_args(args) -> None:
    """The checks the parser cannot make, before anything is loaded (or re-run with a fast BLAS)."""
    if "MLX_RANK" in os.environ:   # set by mlx.launch for each rank
        raise ValueError("serve runs in one process, and this one is a rank of mlx.launch (MLX_RANK is set): every "
                         "rank would load the whole model and bind the same port. Start ngram-spec serve without "
                         "mlx.launch; sharded serving is not built (docs/distributed.md)")
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    if args.draft_max is not None and not 0 <= args.draft_max <= DRAFT_MAX_LIMIT:
        raise ValueError(f"--draft-max must be in 0..{DRAFT_MAX_LIMIT} (0: plain decoding; a verify forward's memory "
                         f"grows with it), got {args.draft_max}")
    if args.drafter not in DRAFTERS:
        raise ValueError(f"--drafter must be one of {', '.join(DRAFTERS)}, got {args.drafter!r}")
    if args.max_users < 0:
        raise ValueError(f"--max-users must be >= 0 (0: no limit), got {args.max_users}")
    check_max_entries(args.dynamic_max_entries)
    if args.history_max_tokens < 0:
        raise ValueError(f"--history-max-tokens must be >= 0 (0: no history), got {args.history_max_tokens}")
    if args.decode_concurrency < 1:
        raise ValueError(f"--decode-concurrency must be at least 1 (1: one request at a time), got "
                         f"{args.decode_concurrency}")
    if args.prefill_step_size < 1:
        raise ValueError(f"--prefill-step-size must be at least 1, got {args.prefill_step_size}")
    if args.ctx_size is not None and args.ctx_size < 1:
        raise ValueError(f"--ctx-size must be at least 1 (or left out: the model's context), got {args.ctx_size}")
    check_sampling(args.temp, args.top_p, args.min_p, args.top_k, cli=True)   # generate's checks and words
    if args.prompt_cache_size < 0:
        raise ValueError(f"--prompt-cache-size must be >= 0 (0: keep no prompt cache), got {args.prompt_cache_size}")
    check_kept(args.dynamic, args.history, args.dynamic_scope, args.static)
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    check_listen(args.host, args.port)


def check_kept(dynamic, history, scope: str, static) -> None:
    """``--dynamic`` and ``--history`` are each one file with ``--dynamic-scope server`` (written as
    ``generate --dynamic`` is: not a directory, in a folder that exists, not the ``--static`` file, not each
    other) and a directory (made if missing) of one file per user with ``--dynamic-scope user`` (the same
    directory will do: ``user-*.history`` beside ``user-*.ngram``)."""
    for flag, path, what, same in (("--dynamic", dynamic, "cache", ""), ("--history", history, "history",
                                                                         "; --dynamic's will do")):
        if path is None:
            continue
        if scope == "user" and os.path.exists(path) and not os.path.isdir(path):
            raise ValueError(f"{flag} {path} is a file, but --dynamic-scope user keeps one {what} per user in a "
                             f"directory: name a directory (made if missing{same}), or use --dynamic-scope server")
        if scope == "server" and os.path.isdir(path):
            raise ValueError(f"{flag} {path} is a directory, but --dynamic-scope server keeps one {what} file: "
                             "name a file, or use --dynamic-scope user")
    if scope == "server":
        check_outputs({"--dynamic": dynamic, "--history": history}, inputs=[static])


def check_listen(host: str, port: int) -> None:
    """Bind ``host:port`` as mlx-lm's server will (the first address ``getaddrinfo`` gives, SO_REUSEADDR as
    ``http.server.HTTPServer`` sets it) and let go at once, so a port in use or an unknown host is one line
    before the model loads, not an OSError traceback after it."""
    import socket

    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise ValueError(f"--host {host}: not an address this machine can listen on ({e.strerror})") from None
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as e:
            raise ValueError(f"--host {host} --port {port}: cannot listen there ({e.strerror}); another server "
                             "may hold the port: stop it or choose another --port") from None


def run_serve(args) -> int:
    check_args(args)
    if sys.argv[1:2] == ["serve"]:  # this process is `ngram-spec serve` (not called in-process): re-run with
        from mlx_backend.machine.blas import ensure_fast_blas  # a fast BLAS before mlx-lm's server is imported

        # a native crash (SIGILL from a BLAS built for another CPU, SIGSEGV, ...) cannot be caught: the log
        # then names the signal and every thread's Python stack, and the process dies by the signal
        faulthandler.enable(file=sys.stderr, all_threads=True)
        ensure_fast_blas(sys.argv[1:], args.blas)
    from mlx_backend.serve.server import run_serve as serve

    return serve(args)


DESCRIPTION = (
    "Serve a model over HTTP with mlx-lm's own OpenAI-compatible server (/v1/chat/completions,\n"
    "/v1/completions, streaming, chat templates, tool calls, prompt-cache reuse), generating with n-gram\n"
    "speculation. Greedy output is plain greedy output, token for token. Per request: \"speculative\":\n"
    "false, \"draft_max\" (alias \"n_draft\"), \"drafter\" (lookup, suffix, auto), \"user\" (scope of the\n"
    "dynamic cache and the suffix history). Speculation metrics in every response\n"
    "(usage.completion_tokens_details, timings); totals at GET /v1/stats.\n\n"
    "examples:\n  ngram-spec serve\n  ngram-spec serve --port 8081 --dynamic dyn.ngram\n"
    "  ngram-spec serve --drafter suffix --history-max-tokens 200000\n"
    "  curl localhost:8080/v1/chat/completions -H 'Content-Type: application/json' \\\n"
    "    -d '{\"messages\": [{\"role\": \"user\", \"content\": \"Repeat: a b c a b c\"}]}'")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "serve", formatter_class=argparse.RawDescriptionHelpFormatter,
        help="an OpenAI-compatible HTTP server (mlx_lm.server) generating with n-gram speculation",
        description=DESCRIPTION,
    )
    p.add_argument("--backend", choices=("mlx",), default="mlx",
                   help="mlx only: the server is mlx_lm.server (accepted, like every command's --backend)")
    p.add_argument("--model", metavar="PATH",
                   help="a .gguf file (llama architecture) or an mlx-lm model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", choices=("auto", "quantized", "float32", "float16", "bfloat16"), default="auto",
                   help="weights of a GGUF model (default: float32 on the CPU, quantized on a GPU)")
    p.add_argument("--host", default="127.0.0.1", help="host to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=8080, help="port to listen on (default: %(default)s)")
    p.add_argument("--draft-max", type=int, default=None, metavar="K",
                   help="drafts per step by default (0: plain decoding; default: the cost-aware choice)")
    p.add_argument("--drafter", metavar="|".join(DRAFTERS), default=DEFAULT_DRAFTER,
                   help="the drafter of requests that name none (field \"drafter\"): lookup (llama.cpp's n-gram "
                        "caches: context, --dynamic, --static), suffix (a copy of what followed the latest earlier "
                        "occurrence of the text's end, in the request or in earlier requests' prompts and answers), "
                        "auto (suffix where the text's end occurred earlier, else lookup) (default: %(default)s)")
    p.add_argument("--history-max-tokens", type=int, default=HISTORY_MAX_TOKENS, metavar="N",
                   help="earlier requests' prompts and answers kept for the suffix and auto drafters, in tokens, "
                        "oldest dropped first, scoped like the dynamic cache (--dynamic-scope), in memory unless "
                        "--history; 0: none (default: %(default)s)")
    p.add_argument("--history", metavar="PATH",
                   help="keep the suffix history in this file (with --dynamic-scope user: this directory, which may "
                        "be --dynamic's), as --dynamic keeps the dynamic cache: loaded at start, saved atomically "
                        "every --save-every requests and on shutdown, so a restarted server drafts from the "
                        "prompts and answers it saw before (default: in memory only)")
    p.add_argument("--no-spec", action="store_true", help="serve plainly (mlx-lm's own generation) by default")
    p.add_argument("--static", metavar="FILE", help="a static n-gram cache (ngram-spec create), read only")
    p.add_argument("--dynamic", metavar="PATH",
                   help="keep the dynamic n-gram cache in this file (with --dynamic-scope user: this directory): "
                        "loaded at start, saved atomically every --save-every requests and on shutdown "
                        "(default: learned in memory only)")
    p.add_argument("--dynamic-scope", choices=("server", "user"), default="server",
                   help="one dynamic cache (and suffix history) for all requests, or one per request `user` field "
                        "so one user's text is never drafted into another's answer (default: %(default)s)")
    p.add_argument("--dynamic-max-entries", type=int, default=DYNAMIC_MAX_ENTRIES, metavar="N",
                   help="keep at most N entries in each dynamic cache: one that goes over keeps its 3/4 N most counted "
                        "(the latest learned first among equal counts); 0: no limit, as llama.cpp (default: "
                        "%(default)s, about 300 MB)")
    p.add_argument("--max-users", type=int, default=0, metavar="N", help="with --dynamic-scope user: keep at most N "
                   "users' dynamic caches and suffix histories in memory; the least recently used one is written to its "
                   "files (--dynamic, --history) and read back at its next request, or, kept in memory only, forgotten "
                   "(default: %(default)s, no limit)")
    p.add_argument("--save-every", type=int, default=20, metavar="N", help="save the dynamic cache (and --history) "
                   "every N completed requests, but no sooner after a save than 19 times what it took, so saving is at "
                   "most 5%% of the time (default: %(default)s)")
    p.add_argument("--ctx-size", type=int, default=None, metavar="N",
                   help="refuse requests whose prompt + max_tokens exceed N tokens (default: the model's context)")
    # mlx_lm.server's own flags (same names and defaults); its parser is local to mlx_lm.server.main
    p.add_argument("--allowed-origins", type=lambda x: x.split(","), default="*",
                   help="allowed CORS origins (default: *)")
    p.add_argument("--temp", type=float, default=0.0, help="default sampling temperature (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0, help="default nucleus sampling top-p (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=0, help="default top-k sampling, 0 disables (default: %(default)s)")
    p.add_argument("--min-p", type=float, default=0.0, help="default min-p sampling (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=512,
                   help="default maximum number of tokens to generate (default: %(default)s)")
    p.add_argument("--chat-template-args", type=json.loads, default="{}",
                   help="JSON arguments for the tokenizer's apply_chat_template, e.g. '{\"enable_thinking\":false}'")
    p.add_argument("--prefill-step-size", type=int, default=2048, help="prompt tokens per prefill step (default: %(default)s)")
    p.add_argument("--decode-concurrency", type=int, default=32, metavar="N",
                   help="decode up to N requests together: one verify forward for all their drafts (batched "
                        "speculation, where the model's caches allow it); 1: one request at a time, each with the "
                        "cost-aware draft length (default: %(default)s, mlx_lm.server's)")
    p.add_argument("--prompt-cache-size", type=int, default=10,
                   help="maximum number of distinct prompt caches kept for reuse (default: %(default)s)")
    p.add_argument("--prompt-cache-bytes", type=_size, default=None,
                   help="maximum size in bytes of the kept prompt caches")
    add_blas_option(p)
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
                   help="logging level (default: %(default)s)")
    p.set_defaults(func=run_serve)
