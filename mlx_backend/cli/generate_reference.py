"""``ngram-spec generate --backend reference``: the NumPy specification's greedy decoding, plain or
speculative (:mod:`reference.speculative`), on a model directory in mlx-lm's format."""
from __future__ import annotations

import json
import os
from pathlib import Path

from mlx_backend.cli import UserError
from mlx_backend.cli.generate_record import drafter_name, extra_eos_id, generation_record, lookup_part, save_dynamic
from mlx_backend.cli.prompts import chat_messages
from reference.ngram.ours_file import check_file_tokenizer, detect_format
from reference.speculative import REFERENCE_DRAFT_MAX


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
        from reference.ngram.tokens import read_tokens

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


def eos_ids(model_dir: Path, tokenizer, extra=(), n_vocab: int = 2**31) -> set[int]:
    """EOS ids as mlx-lm finds them: generation_config.json's ``eos_token_id``, else config.json's (an id
    or a list), else the tokenizer's; plus the ``extra`` tokens (ids, or token strings of the tokenizer),
    as mlx-lm's ``TokenizerWrapper.add_eos_token``; an extra id outside ``0..n_vocab-1`` is refused, as
    the mlx backend refuses it (it could never stop generation)."""
    eos = None
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        if eos is None and path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    ids = set() if eos is None else set(eos) if isinstance(eos, list) else {eos}
    for token in extra:
        ids.add(extra_eos_id(tokenizer, token, n_vocab))
    return ids


def check_dynamic_writable(args) -> None:
    """Before any work: the reference reads a --dynamic file of our format but writes llama.cpp's only, so
    saving it back would change its format unasked."""
    if args.dynamic and not args.no_spec and Path(args.dynamic).is_file() and detect_format(args.dynamic) == "ours":
        raise UserError(f"--dynamic {args.dynamic} is in ngram-spec's own format, which --backend reference reads "
                        f"but does not write; use --backend mlx, or convert it first: ngram-spec convert "
                        f"{args.dynamic} --to llama -o OTHER_FILE")


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
    check_dynamic_writable(args)
    model_dir = Path(args.model)
    model = load_model(model_dir, np.float64 if args.dtype == "float64" else np.float32)
    tokenizer = load_tokenizer(model_dir, required=args.prompt is not None)
    prompt = prompt_ids(args, tokenizer)
    eos = eos_ids(model_dir, tokenizer, args.extra_eos_token, model.vocab_size)
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
        save_dynamic(c_dyn.merge(lookup_part(drafter).c_ctx), args.dynamic)

    finish_reason = "stop" if tokens[-1] in eos else "length"
    n_emitted = len(tokens)
    if finish_reason == "stop":
        tokens = tokens[:-1]  # the EOS token ends the text and is not part of it (mlx-lm's convention)
    text = tokenizer.decode(tokens) if tokenizer is not None else None
    record = generation_record(
        backend="reference", model=str(model_dir), blas=numpy_blas(), spec=not args.no_spec,
        draft_max=0 if args.no_spec else draft_max, draft_policy="none" if args.no_spec else "fixed",
        drafter="none" if args.no_spec else drafter_name(args),
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
              f"draft max {draft_max}, drafter {drafter_name(args)}")
    print(f"backend: reference, model: {model_dir}")
    return 0


def numpy_blas() -> str:
    """The BLAS numpy was built with (``numpy.show_config``'s structured form)."""
    import numpy as np

    try:
        blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        return f"{blas.get('name', 'unknown')} {blas.get('version', '')} (numpy)".replace("  ", " ")
    except (TypeError, KeyError):  # numpy < 1.26 has no mode="dicts"
        return "unknown (numpy)"


def make_drafter(args):
    """The drafter --drafter names (:func:`reference.suffix.auto.make_drafter`) with the --static cache and
    the --dynamic cache (empty when the file is new), and that dynamic cache."""
    from reference.ngram.cache_file import load_cache
    from reference.ngram.cache import NgramCache
    from reference.suffix.auto import make_drafter as make_named

    c_st = load_cache(args.static) if args.static else None
    c_dyn = None
    if args.dynamic:
        c_dyn = load_cache(args.dynamic) if Path(args.dynamic).exists() else NgramCache()
    return make_named(drafter_name(args), c_st=c_st, c_dyn=c_dyn), c_dyn
