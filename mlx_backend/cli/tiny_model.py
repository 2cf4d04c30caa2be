"""``ngram-spec tiny-model``: a tiny random model directory in mlx-lm's format, to try the loop without a
download (:mod:`reference.models.tiny`)."""
from __future__ import annotations

import argparse
import json


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
    p.add_argument("-o", "--out", required=True, metavar="DIR", help="directory to write (created if needed)")
    p.set_defaults(func=cmd_tiny_model)


def cmd_tiny_model(args) -> int:
    from reference.models.tiny import write_tiny_model

    out = write_tiny_model(args.out, args.arch, seed=args.seed)
    config = json.loads((out / "config.json").read_text())
    print(f"wrote a tiny {args.arch} model (seed {args.seed}, {config['num_hidden_layers']} layers, "
          f"hidden {config['hidden_size']}, vocab {config['vocab_size']}) to {out}")
    return 0
