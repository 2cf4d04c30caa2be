"""``ngram-spec tiny-model``: a tiny random model directory in mlx-lm's format, to try the loop without a
download (:mod:`reference.models.tiny`)."""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path


def register(subparsers) -> None:
    fmt = argparse.RawDescriptionHelpFormatter
    from reference.models.tiny import ARCHS

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
    p.add_argument("-o", "--out", required=True, metavar="DIR",
                   help="directory to write (created if needed): new, empty, or an earlier tiny model's, "
                        "which is replaced")
    p.set_defaults(func=cmd_tiny_model)


# what write_tiny_model writes
TINY_FILES = frozenset({"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"})


def check_out(out: str) -> None:
    """Refuse an ``--out`` folder that holds something and is not an earlier tiny model (only
    :data:`TINY_FILES`, with a tiny ``config.json``): a real model's config and weights would be
    replaced, and its other files (shards, tokenizer, generation config) left to load with the tiny
    model. A new or empty folder is fine; an earlier tiny model is replaced."""
    from mlx_backend.cli import UserError
    from reference.models.tiny import ARCHS, tiny_config

    if os.path.exists(out) and not os.path.isdir(out):
        raise UserError(f"--out {out} is a file, not a folder: a model is a folder of files; give a new or empty "
                        "folder")
    if not os.path.isdir(out) or not os.listdir(out):
        return
    others = sorted(set(os.listdir(out)) - TINY_FILES)
    try:
        tiny = json.loads(Path(out, "config.json").read_text()) in [tiny_config(arch) for arch in ARCHS]
    except (OSError, ValueError):
        tiny = False
    if others or not tiny:
        held = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "") if others \
            else "a config.json that is not a tiny model's"
        raise UserError(f"--out {out} is not empty and not an earlier tiny model (it holds {held}); give a new "
                        "or empty folder")


def cmd_tiny_model(args) -> int:
    from mlx_backend.cli import UserError
    from reference.models.tiny import write_tiny_model

    if args.seed < 0:   # numpy's default_rng would say only "expected non-negative integer"
        raise UserError(f"--seed must be >= 0, got {args.seed}")
    check_out(args.out)
    try:
        out = write_tiny_model(args.out, args.arch, seed=args.seed)
    except Exception as exc:
        if not _write_failure(exc):
            raise
        raise UserError(f"--out {args.out}: cannot write the model ({exc}); nothing of it was kept") from None
    config = json.loads((out / "config.json").read_text())
    print(f"wrote a tiny {args.arch} model (seed {args.seed}, {config['num_hidden_layers']} layers, "
          f"hidden {config['hidden_size']}, vocab {config['vocab_size']}) to {out}")
    return 0


def _write_failure(exc: Exception) -> bool:
    """Whether ``exc`` is a library's report of a failed write (a full disk, an I/O error): safetensors
    raises its ``SafetensorError``, tokenizers a plain ``Exception`` ("No space left on device (os error
    28)"); neither is an ``OSError``, so before they reached the user as a traceback."""
    try:
        from safetensors import SafetensorError
    except ImportError:
        SafetensorError = ()
    return isinstance(exc, SafetensorError) or type(exc) is Exception
