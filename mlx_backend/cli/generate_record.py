"""What ``generate`` reports on both backends: the ``--json`` record (one set of keys), the drafter that
ran, the reference's dynamic cache saved atomically; and the id ``--extra-eos-token`` names, read alike by both."""
from __future__ import annotations

import sys

from mlx_backend.cli import UserError
from reference.suffix.auto import DEFAULT_DRAFTER


def generation_record(*, backend: str, model: str, blas: str, spec: bool, draft_max: int, draft_policy: str,
                      drafter: str, prompt: list[int], tokens: list[int], text, finish_reason: str, stats,
                      n_emitted: int, prompt_tps: float, generation_tps: float) -> dict:
    """``generate --json``'s record, one set of keys for both backends (``stats``: either SpecStats).

    ``drafter`` names the drafter that ran (lookup, suffix, auto; none when plain). ``n_emitted`` counts the
    generated tokens with a final EOS; ``tokens_per_forward`` is it per step."""
    return {"backend": backend, "model": model, "blas": blas, "spec": spec, "draft_max": draft_max,
            "draft_policy": draft_policy, "drafter": drafter, "prompt_tokens": len(prompt), "tokens": tokens,
            "text": text,
            "finish_reason": finish_reason, "steps": stats.steps, "n_forward": stats.n_forward,
            "n_drafted": stats.n_drafted, "n_accept": stats.n_accept, "accept": round(stats.accept, 2),
            "tokens_per_forward": round(n_emitted / stats.steps, 4), "prompt_tps": round(prompt_tps, 2),
            "generation_tps": round(generation_tps, 2)}


def save_dynamic(cache, path: str) -> None:
    """Write ``cache`` atomically (``save_cache`` uses reference.atomic): never a half-written cache."""
    from reference.ngram.cache_file import save_cache

    save_cache(cache, path)
    print(f"saved the dynamic cache to {path}", file=sys.stderr)


def drafter_name(args) -> str:
    """The drafter --drafter names (default: :data:`reference.suffix.auto.DEFAULT_DRAFTER`)."""
    return args.drafter or DEFAULT_DRAFTER


def lookup_part(drafter):
    """The llama.cpp lookup drafter inside ``drafter`` (itself, or an auto drafter's ``lookup``): its
    context cache ``c_ctx`` is what --dynamic learns. None for a suffix drafter."""
    return drafter if hasattr(drafter, "c_ctx") else getattr(drafter, "lookup", None)


def extra_eos_id(tokenizer, token: str, n_vocab: int) -> int:
    """The id ``--extra-eos-token`` names: a number as it is, else the tokenizer's token of that text, as
    mlx-lm's ``TokenizerWrapper.add_eos_token`` reads it. Refused (UserError): a text that is not a token
    (Hugging Face tokenizers answer it with the unknown token's id, which would stop generation at that
    token instead: for SmolLM2 ``<|endoftext|>``) and an id outside ``0..n_vocab-1`` (it could never stop
    generation)."""
    try:
        token_id = int(token)
    except ValueError:
        token_id = tokenizer.convert_tokens_to_ids(token) if tokenizer is not None else None
        unk_id, unk = getattr(tokenizer, "unk_token_id", None), getattr(tokenizer, "unk_token", None)
        if not isinstance(token_id, int) or (token_id == unk_id and token != unk):
            raise UserError(f"--extra-eos-token {token!r} is not a token of this tokenizer (give a token's exact "
                            "text, e.g. <|im_end|>, or its id)") from None
    if not 0 <= token_id < n_vocab:
        raise UserError(f"--extra-eos-token {token}: outside the model's vocabulary (ids 0..{n_vocab - 1}), "
                        "so it could never stop generation")
    return token_id
