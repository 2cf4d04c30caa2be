"""``ngram-spec generate``: the command line of both backends' generation (mlx_lm.generate's flags, plus
the drafting ones), the checks made before anything is loaded, and the hand-over to the backend that
runs it (:mod:`mlx_backend.cli.generate_mlx`, :mod:`mlx_backend.cli.generate_reference`; imported
only when chosen, so an install without mlx runs the reference)."""
from __future__ import annotations

import argparse
import importlib.util
import os

from mlx_backend.cli import UserError
from mlx_backend.cli.prompts import read_stdin_prompt
from mlx_backend.machine.blas import add_option as add_blas_option  # stdlib only: no mlx needed
from reference.atomic import check_outputs
from reference.sampling import check_sampling
from reference.speculative import DRAFT_MAX_LIMIT, REFERENCE_DRAFT_MAX
from reference.suffix.auto import DEFAULT_DRAFTER, DRAFTERS

GENERATE_EXAMPLES = """\
examples:
  ngram-spec tiny-model --arch qwen3_5 --out tiny-qwen
  ngram-spec generate --backend reference --model tiny-qwen --prompt "the cat sat on the mat. the cat"
  ngram-spec generate --backend reference --model tiny-qwen --prompt-tokens prompt.i32 --json
      (prompt.i32: token ids as raw little-endian int32, e.g. numpy's
       np.tile(np.arange(5, 25), 6).astype('<i4').tofile('prompt.i32'))
  ngram-spec generate --prompt "Repeat exactly: red, green, blue, red, green, blue"   (mlx, default model)
"""


def default_backend(strict: bool = False) -> str:
    """generate's backend when --backend is not given: ``$NGRAM_SPEC_BACKEND`` if set (``strict``: any other
    value than reference or mlx is a UserError, as the other commands refuse a name that names nothing; not
    strict, for the help text, it is passed over), else mlx where mlx-lm is installed (the fast one), else
    the reference."""
    name = os.environ.get("NGRAM_SPEC_BACKEND")
    if name in ("reference", "mlx"):
        return name
    if name and strict:
        raise UserError(f"unknown backend {name!r} (from $NGRAM_SPEC_BACKEND): generate runs reference or mlx; "
                        "set the variable to one of them, unset it, or give --backend")
    return "mlx" if importlib.util.find_spec("mlx_lm") is not None else "reference"


def _str2bool(text: str) -> bool:
    """mlx_lm.generate's --verbose: anything but false / f (any case) is true."""
    return text.lower() not in ("false", "f")


def register(subparsers) -> None:
    fmt = argparse.RawDescriptionHelpFormatter
    backend = default_backend()
    p = subparsers.add_parser(
        "generate", formatter_class=fmt, help="generate text with n-gram self-speculative decoding",
        description="Generate a continuation of the prompt. Each step drafts up to --draft-max tokens by\n"
                    "prompt lookup (--drafter lookup: llama.cpp's n-gram caches over the prompt and the text so\n"
                    "far, plus the optional --static and --dynamic cache files; suffix: a copy of what followed\n"
                    "the latest earlier occurrence of the text's end; auto, the default: suffix wherever the\n"
                    "text's end occurred earlier, else lookup), verifies them in one forward pass and keeps\n"
                    "the longest prefix greedy decoding agrees with, plus one more token. Greedy output is\n"
                    "identical to plain decoding (--no-spec); only the number of forward passes changes.\n"
                    "Both backends draft and count alike (llama.cpp's lookup): no drafts for the first token,\n"
                    "then at most what fits in --max-tokens with the model's own token; a step is counted and\n"
                    "learned (--dynamic) whole, even past an EOS inside it.\n\n"
                    "Flags follow mlx_lm.generate (--prompt - reads stdin, --system-prompt, --temp, --top-p,\n"
                    "--min-p, --top-k, --max-kv-size, --extra-eos-token, --verbose).\n\n"
                    + GENERATE_EXAMPLES)
    p.add_argument("--backend", choices=("reference", "mlx"), default=None,   # None: default_backend(strict=True)
                   help=f"mlx: fast, any mlx-lm model; reference: the NumPy specification, greedy only, a model "
                        f"directory in mlx-lm's format (qwen3_5, qwen3_next, llama). Default here: {backend} "
                        "($NGRAM_SPEC_BACKEND, else mlx where mlx-lm is installed); --json names the one that ran")
    _add_prompt_and_drafting_args(p)
    _add_sampling_args(p)
    _add_model_and_output_args(p)
    p.set_defaults(func=cmd_generate)


def _add_prompt_and_drafting_args(p) -> None:
    p.add_argument("--model", metavar="PATH",
                   help="model directory (config.json + safetensors). Required for --backend reference; "
                        "--backend mlx defaults to the bundled SmolLM2-135M-Instruct GGUF")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", "-p", metavar="TEXT",
                     help="prompt text (tokenized with the model's tokenizer); '-' reads it from stdin")
    src.add_argument("--prompt-tokens", metavar="FILE", help="prompt token ids: .i32 (raw little-endian int32) or .npy")
    p.add_argument("--system-prompt", metavar="TEXT", help="system message of the chat template")
    p.add_argument("--max-tokens", "-m", type=int, default=100, help="maximum tokens to generate (default: %(default)s)")
    p.add_argument("--draft-max", "--n-draft", type=int, default=None, metavar="K",
                   help=f"maximum draft tokens verified per forward pass (llama.cpp's --draft-max, alias "
                        f"--n-draft; default: {REFERENCE_DRAFT_MAX}, llama.cpp's, for --backend reference; "
                        "the cost-aware choice for --backend mlx)")
    p.add_argument("--drafter", metavar="|".join(DRAFTERS), default=None,
                   help="what drafts: lookup (llama.cpp's n-gram caches), suffix (a copy of what followed the "
                        "latest earlier occurrence of the text's end), auto (suffix where the text's end occurred "
                        f"earlier, else lookup); default: {DEFAULT_DRAFTER}. --static and --dynamic are lookup's caches")
    p.add_argument("--no-spec", action="store_true", help="plain decoding, one forward pass per token (the baseline)")
    p.add_argument("--static", metavar="FILE", help="static n-gram cache file (from `ngram-spec create`), read only")
    p.add_argument("--dynamic", metavar="FILE",
                   help="dynamic n-gram cache file: loaded if it exists, updated with this run's n-grams and "
                        "saved atomically at the end, in the format it had (a new file: llama.cpp's) (llama.cpp's "
                        "lookup -lcd); a run interrupted before the end (Ctrl-C) learns nothing and leaves the "
                        "file as it was")


def _add_sampling_args(p) -> None:
    p.add_argument("--temp", type=float, default=0.0,
                   help="sampling temperature; 0 = greedy (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="sampling top-p, in (0, 1]; 1 = off (default: %(default)s)")
    p.add_argument("--min-p", type=float, default=0.0,
                   help="sampling min-p, in [0, 1]; 0 = off (default: %(default)s)")
    p.add_argument("--min-tokens-to-keep", type=int, default=1,
                   help="tokens that min-p always keeps (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=0,
                   help="sampling top-k; 0 = off (default: %(default)s)")
    p.add_argument("--seed", type=int, default=None,
                   help="random seed for sampling (0..2**64-1); the same seed gives the same text: with --temp > 0 "
                        "and no --draft-max the draft length is then fixed at 8, since the cost-aware one follows "
                        "the machine's timings and would change the random draws")


def _add_model_and_output_args(p) -> None:
    p.add_argument("--ignore-chat-template", action="store_true",
                   help="use the prompt text as is (by default chat models get it wrapped in their chat template)")
    p.add_argument("--extra-eos-token", nargs="+", default=(), metavar="TOKEN",
                   help="more tokens (ids or token strings) that stop generation, like mlx_lm.generate's")
    p.add_argument("--max-kv-size", type=int, default=None, metavar="N",
                   help="mlx: keep at most N positions in the attention caches (mlx-lm's rotating cache); "
                        "refused for a model that makes its own caches (mlx-lm's llama and qwen3_5 among them), "
                        "which mlx-lm would size itself; the reference keeps all")
    p.add_argument("--dtype", choices=("auto", "float32", "float64", "float16", "bfloat16", "quantized"),
                   default="auto",
                   help="reference: float32 (auto) or float64 arithmetic; mlx: the weights' type: a GGUF file is "
                        "dequantized to it or kept quantized (auto: the backend's choice for the machine), an "
                        "mlx-lm directory is cast to float32/float16/bfloat16 (auto: as stored)")
    p.add_argument("--shard", choices=("tensor", "pipeline"), default=None,
                   help="under mlx.launch (2 or more ranks; refused in a process alone): shard the model over "
                        "the ranks with mlx-lm's own tensor-parallel shard() or pipeline() split; only rank 0 "
                        "prints; not with --prompt - (the launcher never closes stdin) (docs/distributed.md)")
    p.add_argument("--shard-timeout", type=float, default=120.0, metavar="SECONDS",
                   help="with --shard: exit when the other ranks give no sign of life for this long "
                        "(default: %(default)s)")
    p.add_argument("--verbose", type=_str2bool, default=True, metavar="BOOL",
                   help="print the statistics after the text (default); False or F: only the text, as mlx_lm.generate")
    add_blas_option(p)
    p.add_argument("--json", action="store_true",
                   help="print one JSON record, the same keys on both backends: backend (the one that ran), model, "
                        "blas, spec, draft_max (an int: the fixed K, or the cost-aware policy's maximum), "
                        "draft_policy (fixed, auto or none), drafter (lookup, suffix or auto; none with --no-spec), "
                        "prompt_tokens, tokens (generated ids, prompt and a final EOS excluded), text, finish_reason "
                        "(stop: EOS, length: --max-tokens), steps (forward passes that emitted tokens), n_forward "
                        "(steps and the prompt's prefill passes), n_drafted, n_accept, accept, tokens_per_forward "
                        "(tokens, EOS included, per step), prompt_tps, generation_tps")


def check_drafter_caches(drafter: str | None, static: str | None, dynamic: str | None) -> None:
    """Refuse --static / --dynamic with --drafter suffix, which would ignore them (generate, stats --requests)."""
    if drafter == "suffix" and (static or dynamic):
        raise UserError("--static and --dynamic are the lookup drafter's caches, unused by --drafter suffix: "
                        "drop them, or use --drafter lookup or auto")


def check_generate_args(args) -> None:
    """Refuse values with no meaning before any work, one line each (both backends)."""
    if args.backend is None:
        args.backend = default_backend(strict=True)
    check_sampling(args.temp, args.top_p, args.min_p, args.top_k, args.min_tokens_to_keep, cli=True)
    rules = (("--max-tokens", args.max_tokens, args.max_tokens >= 1, "at least 1"),
             ("--draft-max", args.draft_max, args.draft_max is None or 0 <= args.draft_max <= DRAFT_MAX_LIMIT,
              f"in 0..{DRAFT_MAX_LIMIT} (a verify forward's memory grows with it)"),
             ("--max-kv-size", args.max_kv_size, args.max_kv_size is None or args.max_kv_size >= 1, "at least 1"),
             ("--seed", args.seed, args.seed is None or 0 <= args.seed < 2**64, "in 0..2**64-1 (mx.random.seed's range)"))
    for flag, value, ok, rule in rules:
        if not ok:
            raise UserError(f"{flag} must be {rule}, got {value}")
    if args.drafter is not None and args.drafter not in DRAFTERS:
        raise UserError(f"--drafter must be one of {', '.join(DRAFTERS)}, got {args.drafter!r}")
    check_drafter_caches(args.drafter, args.static, args.dynamic)
    if args.no_spec:
        drafting = [flag for flag, value in (("--draft-max", args.draft_max), ("--static", args.static),
                                             ("--dynamic", args.dynamic), ("--drafter", args.drafter))
                    if value is not None]
        if drafting:
            raise UserError(f"--no-spec decodes without drafts, so {' and '.join(drafting)} would be ignored: "
                            f"drop {'it' if len(drafting) == 1 else 'them'}, or drop --no-spec")
    if args.system_prompt is not None and args.ignore_chat_template:
        raise UserError("--system-prompt is a message of the chat template, which --ignore-chat-template turns off: "
                        "drop one of them")
    if args.shard is not None and args.backend != "mlx":
        raise UserError("--shard runs the model sharded with mlx; drop --backend reference")
    if args.shard is not None and args.prompt == "-":   # mlx.launch forwards its stdin but never closes it
        raise UserError("--prompt - with --shard would wait forever: mlx.launch never closes the ranks' stdin; "
                        "give the text as --prompt \"$(cat FILE)\" or the token ids as --prompt-tokens FILE")
    check_outputs({"--dynamic": args.dynamic}, inputs=[args.static, args.prompt_tokens])


def cmd_generate(args) -> int:
    check_generate_args(args)
    if args.backend == "mlx":   # reads `--prompt -` itself, after its BLAS re-run (which would find stdin used up)
        try:
            from mlx_backend.cli.generate_mlx import run_generate
        except ImportError as exc:
            raise UserError(f"--backend mlx is not available ({exc}); install it with: pip install "
                            "'ngram-spec[mlx]', or use --backend reference --model DIR") from exc
        return run_generate(args)
    from mlx_backend.cli.generate_reference import run_reference

    read_stdin_prompt(args)
    return run_reference(args)
