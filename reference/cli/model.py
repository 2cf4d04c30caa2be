"""``ngram-spec generate | tiny-model``: generate with n-gram speculative decoding, and write tiny models.

``generate --backend reference`` runs the NumPy reference (:mod:`reference.models`) with the loop of
:mod:`reference.speculative` on a model directory in mlx-lm's format; ``--backend mlx`` (the default)
hands the same arguments to ``mlx_backend.cli.run_generate``. ``tiny-model`` writes a tiny random model
directory (:mod:`reference.tiny`) that both backends load.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from mlx_backend.blas import CHOICES as BLAS_CHOICES  # stdlib only: no mlx needed
from reference.cli import UserError

REFERENCE_DRAFT_MAX = 16  # llama.cpp's --draft-max default

GENERATE_EXAMPLES = """\
examples:
  ngram-spec tiny-model --arch qwen3_5 --out tiny-qwen
  ngram-spec generate --backend reference --model tiny-qwen --prompt "the cat sat on the mat. the cat"
  ngram-spec generate --backend reference --model tiny-qwen --prompt-tokens prompt.i32 --json
  ngram-spec generate --prompt "Repeat this list: apples, pears, plums"      (mlx, default model)
"""


def register(subparsers) -> None:
    fmt = argparse.RawDescriptionHelpFormatter
    p = subparsers.add_parser(
        "generate", formatter_class=fmt, help="generate text with n-gram self-speculative decoding",
        description="Generate a continuation of the prompt. Each step drafts up to --draft-max tokens by\n"
                    "prompt lookup (llama.cpp's n-gram caches over the prompt and the text so far, plus the\n"
                    "optional --static and --dynamic cache files), verifies them in one forward pass and keeps\n"
                    "the longest prefix greedy decoding agrees with, plus one more token. Greedy output is\n"
                    "identical to plain decoding (--no-spec); only the number of forward passes changes.\n\n"
                    + GENERATE_EXAMPLES)
    p.add_argument("--backend", choices=("reference", "mlx"), default="mlx",
                   help="mlx: fast, any mlx-lm model (default); reference: the NumPy specification, greedy "
                        "only, a model directory in mlx-lm's format (qwen3_5, qwen3_next, llama)")
    p.add_argument("--model", metavar="PATH",
                   help="model directory (config.json + safetensors). Required for --backend reference; "
                        "--backend mlx defaults to the bundled SmolLM2-135M-Instruct GGUF")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", metavar="TEXT", help="prompt text (tokenized with the model's tokenizer)")
    src.add_argument("--prompt-tokens", metavar="FILE", help="prompt token ids: .i32 (raw little-endian int32) or .npy")
    p.add_argument("--max-tokens", type=int, default=100, help="maximum tokens to generate (default: %(default)s)")
    p.add_argument("--draft-max", type=int, default=None, metavar="K",
                   help=f"maximum draft tokens verified per forward pass (default: {REFERENCE_DRAFT_MAX}, llama.cpp's, "
                        "for --backend reference; the cost-aware choice for --backend mlx)")
    p.add_argument("--no-spec", action="store_true", help="plain decoding, one forward pass per token (the baseline)")
    p.add_argument("--static", metavar="FILE", help="static n-gram cache file (from `ngram-spec create`), read only")
    p.add_argument("--dynamic", metavar="FILE",
                   help="dynamic n-gram cache file: loaded if it exists, updated with this run's n-grams and "
                        "saved atomically at the end (llama.cpp's lookup -lcd)")
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature; 0 = greedy (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0, help="sampling top-p (default: %(default)s)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument("--ignore-chat-template", action="store_true",
                   help="use the prompt text as is (by default chat models get it wrapped in their chat template)")
    p.add_argument("--dtype", choices=("auto", "float32", "float64", "float16", "bfloat16", "quantized"),
                   default="auto",
                   help="reference: float32 (auto) or float64 arithmetic; mlx: the weights' type (auto: the "
                        "backend's choice for the machine)")
    p.add_argument("--blas", choices=BLAS_CHOICES, default=None,
                   help="mlx on Linux x86-64: the BLAS to re-run with (auto: the system's OpenBLAS, else the "
                        "cmeel-openblas wheel's; system; wheel; bundled: mlx's own; default: $NGRAM_SPEC_BLAS or auto)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON record: tokens (generated ids, prompt and a final EOS excluded), text, "
                        "finish_reason (stop: EOS, length: --max-tokens), n_forward, steps, n_drafted, n_accept, "
                        "accept, tokens_per_forward")
    p.set_defaults(func=cmd_generate)

    from reference.tiny import ARCHS

    p = subparsers.add_parser(
        "tiny-model", formatter_class=fmt, help="write a tiny random model directory in mlx-lm's format",
        description="Write a tiny random model (config.json, model.safetensors, a byte-level tokenizer) that\n"
                    "mlx-lm and the NumPy reference both load: try the loop without a download. The same\n"
                    "--seed gives the same weights. Token ids 0..255 are UTF-8 bytes; 256 is <|endoftext|>.\n\n"
                    "example: ngram-spec tiny-model --arch qwen3_next --seed 1 --out tiny-next")
    p.add_argument("--arch", choices=ARCHS, required=True,
                   help="qwen3_5 / qwen3_next: hybrid GatedDeltaNet + attention; llama: attention only")
    p.add_argument("--seed", type=int, default=0, help="random seed of the weights (default: %(default)s)")
    p.add_argument("-o", "--out", required=True, metavar="DIR", help="directory to write (created if needed)")
    p.set_defaults(func=cmd_tiny_model)


def cmd_tiny_model(args) -> int:
    from reference.tiny import write_tiny_model

    out = write_tiny_model(args.out, args.arch, seed=args.seed)
    config = json.loads((out / "config.json").read_text())
    print(f"wrote a tiny {args.arch} model (seed {args.seed}, {config['num_hidden_layers']} layers, "
          f"hidden {config['hidden_size']}, vocab {config['vocab_size']}) to {out}")
    return 0


def cmd_generate(args) -> int:
    if args.max_tokens < 1:
        raise UserError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    if args.draft_max is not None and args.draft_max < 0:
        raise UserError(f"--draft-max must be >= 0, got {args.draft_max}")
    if args.no_spec:
        drafting = [flag for flag, value in (("--draft-max", args.draft_max), ("--static", args.static),
                                             ("--dynamic", args.dynamic)) if value is not None]
        if drafting:
            raise UserError(f"--no-spec decodes without drafts, so {' and '.join(drafting)} would be ignored: "
                            f"drop {'it' if len(drafting) == 1 else 'them'}, or drop --no-spec")
    if args.backend == "mlx":
        try:
            from mlx_backend.cli import run_generate
        except ImportError as exc:
            raise UserError(f"--backend mlx is not available ({exc}); install it with: pip install "
                            "'ngram-spec[mlx]', or use --backend reference --model DIR") from exc
        return run_generate(args)
    return run_reference(args)


def load_tokenizer(model_dir: Path, required: bool):
    """The model directory's Hugging Face tokenizer (transformers' AutoTokenizer), or None when it has none.

    Without ``transformers`` installed it is None too, unless ``required`` (a text prompt to tokenize).
    """
    if not (model_dir / "tokenizer.json").is_file() and not (model_dir / "tokenizer_config.json").is_file():
        return None
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        from transformers import AutoTokenizer
    except ImportError:
        if required:
            raise UserError("tokenizing --prompt needs the transformers package: pip install transformers, "
                            "or give the prompt as --prompt-tokens FILE") from None
        return None
    return AutoTokenizer.from_pretrained(str(model_dir))


def prompt_ids(args, tokenizer) -> list[int]:
    """The prompt as token ids: from --prompt-tokens, or --prompt tokenized (in the chat template if any)."""
    if args.prompt_tokens is not None:
        from reference.tokens import read_tokens

        return [int(t) for t in read_tokens(args.prompt_tokens)]
    if args.prompt is None:
        raise UserError("give the prompt as --prompt TEXT or --prompt-tokens FILE")
    if tokenizer is None:
        raise UserError(f"{args.model} has no tokenizer (tokenizer.json); give the prompt as --prompt-tokens FILE")
    if getattr(tokenizer, "chat_template", None) and not args.ignore_chat_template:
        messages = [{"role": "user", "content": args.prompt}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(args.prompt)


def eos_ids(model_dir: Path, tokenizer) -> set[int]:
    """EOS ids as mlx-lm finds them: generation_config.json's ``eos_token_id``, else config.json's (an id
    or a list), else the tokenizer's."""
    eos = None
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        if eos is None and path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, list) else {eos}


def run_reference(args) -> int:
    import numpy as np
    from tqdm import tqdm

    from reference.models import load_model
    from reference.speculative import SpecStats, greedy_generate, speculative_generate

    if args.temp != 0.0 or args.top_p != 1.0:
        raise UserError("--backend reference decodes greedily: drop --temp/--top-p, or use --backend mlx to sample")
    if args.model is None:
        raise UserError("--backend reference needs --model DIR, a model directory in mlx-lm's format "
                        "(make a tiny one with: ngram-spec tiny-model --arch qwen3_5 --out DIR)")
    if args.dtype not in ("auto", "float32", "float64"):
        raise UserError(f"--backend reference computes in float32 or float64, not {args.dtype}")
    draft_max = REFERENCE_DRAFT_MAX if args.draft_max is None else args.draft_max
    model_dir = Path(args.model)
    model = load_model(model_dir, np.float64 if args.dtype == "float64" else np.float32)
    tokenizer = load_tokenizer(model_dir, required=args.prompt is not None)
    prompt = prompt_ids(args, tokenizer)
    eos = eos_ids(model_dir, tokenizer)

    with tqdm(total=args.max_tokens, unit="tok", desc="generate", disable=None, leave=False) as bar:

        def progress(new_tokens):
            bar.update(len(new_tokens))

        if args.no_spec:
            tokens = greedy_generate(model, prompt, args.max_tokens, eos=eos, on_tokens=progress)
            stats = SpecStats(steps=len(tokens) - 1, n_forward=len(tokens), tokens_per_forward=1.0)
        else:
            drafter, c_dyn = make_drafter(args)
            tokens, stats = speculative_generate(model, prompt, args.max_tokens, drafter, draft_max, eos=eos,
                                                 on_tokens=progress)
    if not args.no_spec and args.dynamic:
        save_dynamic(c_dyn.merge(drafter.c_ctx), args.dynamic)

    finish_reason = "stop" if tokens[-1] in eos else "length"
    if finish_reason == "stop":
        tokens = tokens[:-1]  # the EOS token ends the text and is not part of it (mlx-lm's convention)
    text = tokenizer.decode(tokens) if tokenizer is not None else None
    record = {"backend": "reference", "model": str(model_dir), "spec": not args.no_spec,
              "draft_max": 0 if args.no_spec else draft_max, "prompt_tokens": len(prompt), "tokens": tokens,
              "text": text, "finish_reason": finish_reason, "n_forward": stats.n_forward, "steps": stats.steps,
              "n_drafted": stats.n_drafted, "n_accept": stats.n_accept, "accept": round(stats.accept, 2),
              "tokens_per_forward": round(stats.tokens_per_forward, 4)}
    if args.json:
        print(json.dumps(record))
        return 0
    if text is not None:
        print(text)
        print("==========")
    print("tokens:", " ".join(map(str, tokens)))
    print(f"prompt: {len(prompt)} tokens; generated: {len(tokens)} tokens in {stats.n_forward} forward passes "
          f"({stats.tokens_per_forward:.2f} tokens per forward)")
    if not args.no_spec:
        print(f"drafted: {stats.n_drafted}, accepted: {stats.n_accept} ({stats.accept:.1f}%), "
              f"draft max {draft_max}")
    return 0


def make_drafter(args):
    """The n-gram drafter with the --static cache and the --dynamic cache (empty when the file is new)."""
    from reference.cache_file import load_cache
    from reference.drafter import NgramDrafter
    from reference.ngram_cache import NgramCache

    c_st = load_cache(args.static) if args.static else None
    c_dyn = None
    if args.dynamic:
        c_dyn = load_cache(args.dynamic) if Path(args.dynamic).exists() else NgramCache()
    return NgramDrafter(c_st=c_st, c_dyn=c_dyn), c_dyn


def save_dynamic(cache, path: str) -> None:
    """Write ``cache`` to a temporary file next to ``path``, then rename it: never a half-written cache."""
    from reference.cache_file import save_cache

    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        save_cache(cache, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    print(f"saved the dynamic cache to {path}", file=sys.stderr)
