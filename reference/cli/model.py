"""``ngram-spec generate | tiny-model``: generate with n-gram speculative decoding, and write tiny models.

``generate --backend reference`` runs the NumPy reference (:mod:`reference.models`) with the loop of
:mod:`reference.speculative` on a model directory in mlx-lm's format; ``--backend mlx`` (the default)
hands the same arguments to ``mlx_backend.cli.run_generate``. ``tiny-model`` writes a tiny random model
directory (:mod:`reference.tiny`) that both backends load.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

from reference.atomic import check_outputs
from mlx_backend.blas import add_option as add_blas_option  # stdlib only: no mlx needed
from reference.cli import UserError
from reference.ours_file import check_file_tokenizer

REFERENCE_DRAFT_MAX = 16  # llama.cpp's --draft-max default

GENERATE_EXAMPLES = """\
examples:
  ngram-spec tiny-model --arch qwen3_5 --out tiny-qwen
  ngram-spec generate --backend reference --model tiny-qwen --prompt "the cat sat on the mat. the cat"
  ngram-spec generate --backend reference --model tiny-qwen --prompt-tokens prompt.i32 --json
  ngram-spec generate --prompt "Repeat this list: apples, pears, plums"      (mlx, default model)
"""


def default_backend() -> str:
    """generate's backend when --backend is not given: ``$NGRAM_SPEC_BACKEND`` if it names one of ours,
    else mlx where mlx-lm is installed (the fast one), else the reference."""
    name = os.environ.get("NGRAM_SPEC_BACKEND")
    if name in ("reference", "mlx"):
        return name
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
                    "prompt lookup (llama.cpp's n-gram caches over the prompt and the text so far, plus the\n"
                    "optional --static and --dynamic cache files), verifies them in one forward pass and keeps\n"
                    "the longest prefix greedy decoding agrees with, plus one more token. Greedy output is\n"
                    "identical to plain decoding (--no-spec); only the number of forward passes changes.\n"
                    "Both backends draft and count alike (llama.cpp's lookup): no drafts for the first token,\n"
                    "then at most what fits in --max-tokens with the model's own token; a step is counted and\n"
                    "learned (--dynamic) whole, even past an EOS inside it.\n\n"
                    "Flags follow mlx_lm.generate (--prompt - reads stdin, --system-prompt, --temp, --top-p,\n"
                    "--min-p, --top-k, --max-kv-size, --extra-eos-token, --verbose).\n\n"
                    + GENERATE_EXAMPLES)
    p.add_argument("--backend", choices=("reference", "mlx"), default=backend,
                   help=f"mlx: fast, any mlx-lm model; reference: the NumPy specification, greedy only, a model "
                        f"directory in mlx-lm's format (qwen3_5, qwen3_next, llama). Default here: {backend} "
                        "($NGRAM_SPEC_BACKEND, else mlx where mlx-lm is installed); --json names the one that ran")
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
    p.add_argument("--no-spec", action="store_true", help="plain decoding, one forward pass per token (the baseline)")
    p.add_argument("--static", metavar="FILE", help="static n-gram cache file (from `ngram-spec create`), read only")
    p.add_argument("--dynamic", metavar="FILE",
                   help="dynamic n-gram cache file: loaded if it exists, updated with this run's n-grams and "
                        "saved atomically at the end (llama.cpp's lookup -lcd); a run interrupted before the end "
                        "(Ctrl-C) learns nothing and leaves the file as it was")
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
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument("--ignore-chat-template", action="store_true",
                   help="use the prompt text as is (by default chat models get it wrapped in their chat template)")
    p.add_argument("--extra-eos-token", nargs="+", default=(), metavar="TOKEN",
                   help="more tokens (ids or token strings) that stop generation, like mlx_lm.generate's")
    p.add_argument("--max-kv-size", type=int, default=None, metavar="N",
                   help="mlx: keep at most N positions in the attention caches (mlx-lm's rotating cache); "
                        "the reference keeps all")
    p.add_argument("--dtype", choices=("auto", "float32", "float64", "float16", "bfloat16", "quantized"),
                   default="auto",
                   help="reference: float32 (auto) or float64 arithmetic; mlx: the weights' type: a GGUF file is "
                        "dequantized to it or kept quantized (auto: the backend's choice for the machine), an "
                        "mlx-lm directory is cast to float32/float16/bfloat16 (auto: as stored)")
    p.add_argument("--shard", choices=("tensor", "pipeline"), default=None,
                   help="under mlx.launch: shard the model over the ranks with mlx-lm's own tensor-parallel "
                        "shard() or pipeline() split; only rank 0 prints (docs/distributed.md)")
    p.add_argument("--shard-timeout", type=float, default=120.0, metavar="SECONDS",
                   help="with --shard: exit when the other ranks give no sign of life for this long "
                        "(default: %(default)s)")
    p.add_argument("--verbose", type=_str2bool, default=True, metavar="BOOL",
                   help="print the statistics after the text (default); False or F: only the text, as mlx_lm.generate")
    add_blas_option(p)
    p.add_argument("--json", action="store_true",
                   help="print one JSON record, the same keys on both backends: backend (the one that ran), model, "
                        "blas, spec, draft_max (an int: the fixed K, or the cost-aware policy's maximum), "
                        "draft_policy (fixed, auto or none), prompt_tokens, tokens (generated ids, prompt and a "
                        "final EOS excluded), text, finish_reason (stop: EOS, length: --max-tokens), steps (forward "
                        "passes that emitted tokens), n_forward (steps and the prompt's prefill passes), n_drafted, "
                        "n_accept, accept, tokens_per_forward (tokens, EOS included, per step), prompt_tps, "
                        "generation_tps")
    p.set_defaults(func=cmd_generate)

    from reference.tiny import ARCHS

    p = subparsers.add_parser(
        "tiny-model", formatter_class=fmt, help="write a tiny random model directory in mlx-lm's format",
        description="Write a tiny random model (config.json, model.safetensors, a byte-level tokenizer) that\n"
                    "mlx-lm and the NumPy reference both load: try the loop without a download. The same\n"
                    "--seed gives the same weights. Token ids 0..255 are UTF-8 bytes; 256 is <|endoftext|>.\n\n"
                    "example: ngram-spec tiny-model --arch qwen3_next --seed 1 --out tiny-next")
    p.add_argument("--backend", choices=("reference", "mlx"), default=None,
                   help="accepted like every command's --backend; the files written are the same for both "
                        "(written with NumPy, read by either backend)")
    p.add_argument("--arch", choices=ARCHS, required=True,
                   help="qwen3_5 / qwen3_next: hybrid GatedDeltaNet + attention; llama: attention only; "
                        "llama_sliding: llama with sliding-window layers (the last 4 tokens)")
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


def check_sampling(temp: float, top_p: float = 1.0, min_p: float = 0.0, top_k: int = 0,
                   min_tokens_to_keep: int = 1, cli: bool = False) -> None:
    """Refuse sampling arguments with no meaning (ValueError naming the argument, its value and its range):
    ``temp >= 0``, ``0 < top_p <= 1`` (1 = off), ``0 <= min_p <= 1``, ``top_k >= 0``, ``min_tokens_to_keep >= 1``.
    Used by ``generate`` (``cli``: names as flags) and by ``mlx_backend.sampling.Sampler``."""
    rules = (("temp", temp, 0 <= temp < float("inf"), "a number >= 0 (0 = greedy)"),
             ("top_p", top_p, 0 < top_p <= 1, "in (0, 1] (1 = off)"),
             ("min_p", min_p, 0 <= min_p <= 1, "in [0, 1] (0 = off)"),
             ("top_k", top_k, top_k >= 0, ">= 0 (0 = off)"),
             ("min_tokens_to_keep", min_tokens_to_keep, min_tokens_to_keep >= 1, "at least 1"))
    for name, value, ok, rule in rules:
        if not ok:
            raise ValueError(f"{'--' + name.replace('_', '-') if cli else name} must be {rule}, got {value}")


def check_generate_args(args) -> None:
    """Refuse values with no meaning before any work, one line each (both backends)."""
    check_sampling(args.temp, args.top_p, args.min_p, args.top_k, args.min_tokens_to_keep, cli=True)
    rules = (("--max-tokens", args.max_tokens, args.max_tokens >= 1, "at least 1"),
             ("--draft-max", args.draft_max, args.draft_max is None or args.draft_max >= 0, ">= 0"),
             ("--max-kv-size", args.max_kv_size, args.max_kv_size is None or args.max_kv_size >= 1, "at least 1"))
    for flag, value, ok, rule in rules:
        if not ok:
            raise UserError(f"{flag} must be {rule}, got {value}")
    if args.no_spec:
        drafting = [flag for flag, value in (("--draft-max", args.draft_max), ("--static", args.static),
                                             ("--dynamic", args.dynamic)) if value is not None]
        if drafting:
            raise UserError(f"--no-spec decodes without drafts, so {' and '.join(drafting)} would be ignored: "
                            f"drop {'it' if len(drafting) == 1 else 'them'}, or drop --no-spec")
    if args.shard is not None and args.backend != "mlx":
        raise UserError("--shard runs the model sharded with mlx; drop --backend reference")
    check_outputs({"--dynamic": args.dynamic}, inputs=[args.static, args.prompt_tokens])


def cmd_generate(args) -> int:
    check_generate_args(args)
    if args.prompt == "-":
        args.prompt = sys.stdin.read()  # mlx_lm.generate's convention
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
    """The prompt as token ids: from --prompt-tokens, or --prompt tokenized (in the chat template if any,
    after the --system-prompt message)."""
    if args.prompt_tokens is not None:
        from reference.tokens import read_tokens

        return [int(t) for t in read_tokens(args.prompt_tokens)]
    if args.prompt is None:
        raise UserError("give the prompt as --prompt TEXT or --prompt-tokens FILE")
    if tokenizer is None:
        raise UserError(f"{args.model} has no tokenizer (tokenizer.json); give the prompt as --prompt-tokens FILE")
    if getattr(tokenizer, "chat_template", None) and not args.ignore_chat_template:
        messages = chat_messages(args.prompt, args.system_prompt)
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(args.prompt)


def chat_messages(prompt: str, system_prompt: str | None = None) -> list[dict]:
    """The chat of mlx_lm.generate: an optional system message, then the user's prompt."""
    system = [] if system_prompt is None else [{"role": "system", "content": system_prompt}]
    return [*system, {"role": "user", "content": prompt}]


def eos_ids(model_dir: Path, tokenizer, extra=()) -> set[int]:
    """EOS ids as mlx-lm finds them: generation_config.json's ``eos_token_id``, else config.json's (an id
    or a list), else the tokenizer's; plus the ``extra`` tokens (ids, or token strings of the tokenizer),
    as mlx-lm's ``TokenizerWrapper.add_eos_token``."""
    eos = None
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        if eos is None and path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    ids = set() if eos is None else set(eos) if isinstance(eos, list) else {eos}
    for token in extra:
        try:
            ids.add(int(token))
        except ValueError:
            token_id = tokenizer.convert_tokens_to_ids(token) if tokenizer is not None else None
            if token_id is None or token_id == getattr(tokenizer, "unk_token_id", None):
                raise UserError(f"--extra-eos-token {token!r} is not a token of this tokenizer") from None
            ids.add(token_id)
    return ids


def run_reference(args) -> int:
    import time

    import numpy as np
    from tqdm import tqdm

    from reference.models import load_model
    from reference.speculative import SpecStats, greedy_generate, speculative_generate

    if args.temp != 0.0 or args.top_p != 1.0 or args.min_p != 0.0 or args.top_k != 0:
        raise UserError("--backend reference decodes greedily: drop --temp/--top-p/--min-p/--top-k, or use "
                        "--backend mlx to sample")
    if args.max_kv_size is not None:
        raise UserError("--backend reference keeps every position: drop --max-kv-size, or use --backend mlx")
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
    eos = eos_ids(model_dir, tokenizer, args.extra_eos_token)
    check_file_tokenizer(tokenizer, args.static, args.dynamic)

    t_first = []
    with tqdm(total=args.max_tokens, unit="tok", desc="generate", disable=None, leave=False) as bar:

        def progress(new_tokens):
            if not t_first:
                t_first.append(time.perf_counter())
            bar.update(len(new_tokens))

        t0 = time.perf_counter()
        if args.no_spec:
            tokens = greedy_generate(model, prompt, args.max_tokens, eos=eos, on_tokens=progress)
            stats = SpecStats(steps=len(tokens), n_forward=len(tokens) + (len(prompt) > 1), tokens_per_forward=1.0)
        else:
            drafter, c_dyn = make_drafter(args)
            tokens, stats = speculative_generate(model, prompt, args.max_tokens, drafter, draft_max, eos=eos,
                                                 on_tokens=progress)
        t_end = time.perf_counter()
    if not args.no_spec and args.dynamic:
        save_dynamic(c_dyn.merge(drafter.c_ctx), args.dynamic)

    finish_reason = "stop" if tokens[-1] in eos else "length"
    n_emitted = len(tokens)
    if finish_reason == "stop":
        tokens = tokens[:-1]  # the EOS token ends the text and is not part of it (mlx-lm's convention)
    text = tokenizer.decode(tokens) if tokenizer is not None else None
    record = generation_record(
        backend="reference", model=str(model_dir), blas=numpy_blas(), spec=not args.no_spec,
        draft_max=0 if args.no_spec else draft_max, draft_policy="none" if args.no_spec else "fixed",
        prompt=prompt, tokens=tokens, text=text, finish_reason=finish_reason, stats=stats, n_emitted=n_emitted,
        prompt_tps=len(prompt) / (t_first[0] - t0), generation_tps=n_emitted / max(t_end - t_first[0], 1e-9))
    if args.json:
        print(json.dumps(record))
        return 0
    if text is not None:
        print(text)
    if not args.verbose:
        return 0
    if text is not None:
        print("==========")
    print("tokens:", " ".join(map(str, tokens)))
    print(f"prompt: {len(prompt)} tokens; generated: {len(tokens)} tokens in {stats.n_forward} forward passes "
          f"({record['tokens_per_forward']:.2f} tokens per step)")
    if not args.no_spec:
        print(f"drafted: {stats.n_drafted}, accepted: {stats.n_accept} ({stats.accept:.1f}%), "
              f"draft max {draft_max}")
    print(f"backend: reference, model: {model_dir}")
    return 0


def generation_record(*, backend: str, model: str, blas: str, spec: bool, draft_max: int, draft_policy: str,
                      prompt: list[int], tokens: list[int], text, finish_reason: str, stats, n_emitted: int,
                      prompt_tps: float, generation_tps: float) -> dict:
    """``generate --json``'s record, one set of keys for both backends (``stats``: either SpecStats).

    ``n_emitted`` counts the generated tokens with a final EOS; ``tokens_per_forward`` is it per step."""
    return {"backend": backend, "model": model, "blas": blas, "spec": spec, "draft_max": draft_max,
            "draft_policy": draft_policy, "prompt_tokens": len(prompt), "tokens": tokens, "text": text,
            "finish_reason": finish_reason, "steps": stats.steps, "n_forward": stats.n_forward,
            "n_drafted": stats.n_drafted, "n_accept": stats.n_accept, "accept": round(stats.accept, 2),
            "tokens_per_forward": round(n_emitted / stats.steps, 4), "prompt_tps": round(prompt_tps, 2),
            "generation_tps": round(generation_tps, 2)}


def numpy_blas() -> str:
    """The BLAS numpy was built with (``numpy.show_config``'s structured form)."""
    import numpy as np

    try:
        blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        return f"{blas.get('name', 'unknown')} {blas.get('version', '')} (numpy)".replace("  ", " ")
    except (TypeError, KeyError):  # numpy < 1.26 has no mode="dicts"
        return "unknown (numpy)"


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
    """Write ``cache`` atomically (``save_cache`` uses reference.atomic): never a half-written cache."""
    from reference.cache_file import save_cache

    save_cache(cache, path)
    print(f"saved the dynamic cache to {path}", file=sys.stderr)
