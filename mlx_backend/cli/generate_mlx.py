"""``ngram-spec generate --backend mlx``: n-gram speculation on a real mlx-lm model (the parser and the
argument checks are :mod:`mlx_backend.cli.generate`'s)."""
from __future__ import annotations

import faulthandler
import json
import os
import sys
import threading
from pathlib import Path

import mlx.core as mx

from mlx_backend.cli.demo import cost_curve, describe_costs
from mlx_backend.cli.generate_record import drafter_name, extra_eos_id, generation_record, lookup_part
from mlx_backend.cli.prompts import prompt_tokens, read_stdin_prompt
from mlx_backend.machine.blas import blas_in_use, ensure_fast_blas
from mlx_backend.models.loading import load_model


PREFILL_STEP_SIZE = 2048  # prompt tokens per prefill forward, both modes (mlx_lm.generate's default)


def _warm_drafter(name: str) -> None:
    """Import the drafter ``name`` and run it once, so that its compiled loops are loaded."""
    from mlx_backend.ngram.default import make_drafter

    drafter = make_drafter(name)
    drafter.reset([0, 1, 0, 1])
    drafter.draft(2)


def context_drafter():
    """The drafter of a one-shot ``generate`` with no static or dynamic cache: the reference's, over the
    context cache alone. It follows the same rules as the array tables (the conformance suite holds both
    to them) and does this run's whole drafting work in less time than loading the tables' compiled
    loops takes (numba: 0.5-0.9 s per process on the 2-core build machine, against 4 us per prompt
    token and 20-35 us per step for the reference's, measured with contexts of 100 to 20,000 tokens)."""
    from reference.ngram.api import NgramDrafter

    return NgramDrafter()


def run_generate(args) -> int:
    """``ngram-spec generate --backend mlx`` (the parser and the argument checks are mlx_backend/cli/generate.py's)."""
    if sys.argv[1:2] == ["generate"]:  # only when this process is `ngram-spec generate` (not called in-process);
        faulthandler.enable(all_threads=True)  # a native crash (e.g. SIGILL in a BLAS) names its signal and stack
        other_rank = getattr(args, "shard", None) and os.environ.get("MLX_RANK", "0") != "0"   # set by mlx.launch
        ensure_fast_blas(sys.argv[1:], getattr(args, "blas", None),   # first: the re-run imports mlx-lm again
                         log=(lambda msg: None) if other_rank else None)   # --shard: only rank 0 prints
    read_stdin_prompt(args)   # after the re-run, which gets this process's stdin unread
    import math

    from mlx_backend.decode.draft_policy import DEFAULT_K_MAX, SEEDED_DRAFT_MAX
    from mlx_backend.decode.generate import SpecStats
    from mlx_backend.ngram.dynamic_cache import save_dynamic
    from reference.ngram.ours_file import tokenizer_fingerprint

    if args.seed is not None and args.temp > 0 and args.draft_max is None and not args.no_spec:
        args.draft_max = SEEDED_DRAFT_MAX   # the seed then reproduces the text (draft_policy.SEEDED_DRAFT_MAX)

    model, tokenizer, desc, run = _load(args)
    prompt = _prompt(args, model, tokenizer, run)
    responses, stats, drafter, c_dyn = _responses(args, model, tokenizer, prompt, run)
    tokens, text, last = [], [], None
    for last in responses:
        tokens.append(int(last.token))
        text.append(last.text)
        if not args.json:
            print(last.text, end="", flush=True)
    if not args.json:
        print(flush=True)   # the text's line ends before any note on stderr (a terminal shows both)
    n_emitted = len(tokens)
    if tokens and last.finish_reason == "stop":
        tokens.pop()  # the EOS token, not part of the text (mlx-lm's convention)
    run.check()
    run.close()
    if drafter is not None and args.dynamic and run.rank == 0:
        save_dynamic(args.dynamic, c_dyn, lookup_part(drafter).c_ctx, tokenizer=tokenizer_fingerprint(tokenizer))
        print(f"saved the dynamic cache to {args.dynamic}", file=sys.stderr)
    if not args.no_spec and args.draft_max is None:
        print(_describe_costs(args, model, stats), file=sys.stderr)
    if args.no_spec:   # mlx-lm's generate_step: the prompt but its last token in chunks, then one step a token
        stats = SpecStats(steps=n_emitted, n_forward=n_emitted + math.ceil((len(prompt) - 1) / PREFILL_STEP_SIZE))
    draft_max, policy = ((0, "none") if args.no_spec else (DEFAULT_K_MAX, "auto") if args.draft_max is None
                         else (args.draft_max, "fixed"))
    record = generation_record(
        backend="mlx", model=desc, blas=blas_in_use(), spec=not args.no_spec, draft_max=draft_max,
        draft_policy=policy, drafter="none" if args.no_spec else drafter_name(args), prompt=prompt, tokens=tokens,
        text="".join(text), finish_reason=last.finish_reason,
        stats=stats, n_emitted=n_emitted, prompt_tps=last.prompt_tps, generation_tps=last.generation_tps)
    if args.json:
        print(json.dumps(record))
    else:
        _print_summary(args, record, prompt, tokens, stats,
                       f"draft max {draft_max} ({policy}), drafter {record['drafter']}", desc)
    return 0


def _describe_costs(args, model, stats) -> str:
    """The line naming the verify costs the cost-aware draft length used: learned from this run's steps and
    kept for later runs, or with --shard rank 0's, measured on the shards before generating and not kept."""
    prefix = "[generate] draft length: cost-aware; "
    if not getattr(args, "shard", None):
        return describe_costs(model, prefix)
    return (f"{prefix}verify cost {cost_curve(stats.policy['cost_rel'])} (rank 0's, measured on the shards before "
            "generating; --shard keeps no costs for later runs)")


class LocalRun:
    """The run of one process: what :class:`mlx_backend.distributed.sharded.ShardedRun` does for a model
    sharded over ``mlx.launch`` ranks (load the shard, agree on the prompt, wrap the model, the sampler
    and the drafter, check the ranks agreed), done here with nothing to share: one generation path."""

    rank = 0

    def load(self, path, mode, dtype, prog):
        return load_model(path, dtype)

    def prompt(self, prompt: list[int]) -> list[int]:
        return prompt

    def agree(self, settings: dict) -> None:
        pass

    def spec_kwargs(self, model, *, sampler, draft_max, drafter, c_st, c_dyn) -> dict:
        return dict(model=model, sampler=sampler, draft_max=draft_max, drafter=drafter)

    def check(self) -> None:
        pass

    def close(self) -> None:
        pass


def _load(args):
    """The model, its tokenizer (with --extra-eos-token), a description, and the run: sharded under
    ``mlx.launch --shard``, else :class:`LocalRun`; the drafter's compiled loops load meanwhile. --seed
    seeds mlx's random state once the model is loaded: building the model, and with --shard the sharded
    layers that mlx-lm's ``shard()`` builds, draw from it, so a seed gives the same text sharded or not."""
    dtype = None if args.dtype in (None, "auto") else args.dtype
    if dtype == "float64":
        raise ValueError("--dtype float64 is for --backend reference; mlx takes quantized, float32, float16, bfloat16")
    if not args.no_spec and (args.static or args.dynamic or drafter_name(args) != "lookup"):
        threading.Thread(target=_warm_drafter, args=(drafter_name(args),), daemon=True).start()   # with the model
    run = LocalRun()
    if getattr(args, "shard", None):   # under mlx.launch: see mlx_backend/distributed/sharded.py
        from mlx_backend.distributed.sharded import cli_run

        run = cli_run(args.shard_timeout)
    model, tokenizer, desc = run.load(args.model, args.shard, dtype, "ngram-spec generate")
    # the flags that shape the run's collectives and its text; the prompt is rank 0's by design
    run.agree({flag: Path(value) if flag in ("--static", "--dynamic") and value else value for flag, value in (
        ("--no-spec", args.no_spec), ("--draft-max", args.draft_max), ("--drafter", args.drafter),
        ("--max-tokens", args.max_tokens), ("--temp", args.temp), ("--top-p", args.top_p), ("--top-k", args.top_k),
        ("--min-p", args.min_p), ("--seed", args.seed), ("--max-kv-size", args.max_kv_size),
        ("--extra-eos-token", args.extra_eos_token), ("--static", args.static), ("--dynamic", args.dynamic))})
    if args.seed is not None:
        mx.random.seed(args.seed)
    if args.max_kv_size is not None and hasattr(model, "make_cache"):
        raise ValueError(f"--max-kv-size: {desc} makes its own caches (model.make_cache), so mlx-lm's "
                         "make_prompt_cache ignores max_kv_size for it; drop --max-kv-size")
    from mlx_backend.decode.generate import vocab_size

    n_vocab = vocab_size(model) or 2**31
    for token in args.extra_eos_token:   # mlx-lm takes any id, and any text (as the unknown token's id)
        tokenizer.add_eos_token(str(extra_eos_id(tokenizer, token, n_vocab)))
    return model, tokenizer, desc, run


def _prompt(args, model, tokenizer, run) -> list[int]:
    """The prompt's token ids (--prompt-tokens, or --prompt through the chat template), checked against
    the model's vocabulary before any forward (an id past the embedding is garbage or a crash)."""
    from mlx_backend.decode.generate import check_prompt

    if args.prompt_tokens is not None:
        from reference.ngram.tokens import read_tokens

        prompt = [int(t) for t in read_tokens(args.prompt_tokens)]
    elif args.prompt is not None:
        prompt = prompt_tokens(tokenizer, args.prompt, chat_template=not args.ignore_chat_template,
                               system_prompt=args.system_prompt)
    else:
        raise ValueError("give the prompt as --prompt TEXT or --prompt-tokens FILE")
    prompt = run.prompt(prompt)
    check_prompt(prompt, model)
    return prompt


def _responses(args, model, tokenizer, prompt, run):
    """mlx-lm's ``GenerationResponse`` stream: plain (--no-spec, mlx-lm's own stream_generate) or with
    n-gram speculation; with the run's counters, its drafter and dynamic cache."""
    from mlx_lm.generate import stream_generate as plain_stream_generate
    from mlx_lm.sample_utils import make_sampler

    from mlx_backend.decode.generate import SpecStats, stream_generate
    from mlx_backend.ngram.default import lookup_drafter, make_drafter
    from mlx_backend.ngram.dynamic_cache import load_dynamic
    from reference.ngram.ours_file import check_file_tokenizer

    sampler = make_sampler(args.temp, args.top_p, args.min_p, args.min_tokens_to_keep, top_k=args.top_k)
    common = dict(max_tokens=args.max_tokens, sampler=sampler, prefill_step_size=PREFILL_STEP_SIZE,
                  max_kv_size=args.max_kv_size)
    stats = SpecStats()
    if args.no_spec:
        return plain_stream_generate(model, tokenizer, mx.array(prompt), **common), stats, None, None
    check_file_tokenizer(tokenizer, args.static, args.dynamic)
    c_dyn = load_dynamic(args.dynamic) if args.dynamic else None
    name = drafter_name(args)
    if name != "lookup":
        drafter = make_drafter(name, c_st=args.static, c_dyn=c_dyn)
    else:   # llama.cpp's lookup, as before the other drafters existed
        drafter = lookup_drafter(c_st=args.static, c_dyn=c_dyn) if args.static or args.dynamic else context_drafter()
    spec = run.spec_kwargs(model, sampler=sampler, draft_max=args.draft_max, drafter=drafter,
                             c_st=args.static, c_dyn=args.dynamic)
    responses = stream_generate(tokenizer=tokenizer, prompt=mx.array(prompt), stats=stats, **{**common, **spec})
    return responses, stats, drafter, c_dyn


def _print_summary(args, record: dict, prompt, tokens, stats, draft: str, desc: str) -> None:
    """mlx_lm.generate's statistics after the text (--verbose), plus the speculation's."""
    if not args.verbose:
        return
    print("==========")
    print(f"Prompt: {len(prompt)} tokens, {record['prompt_tps']:.1f} tokens-per-sec")
    print(f"Generation: {len(tokens)} tokens, {record['generation_tps']:.1f} tokens-per-sec")
    if not args.no_spec:
        print(f"Speculative: {stats.steps} steps, {record['tokens_per_forward']:.2f} tokens per step, "
              f"drafted {stats.n_drafted}, accepted {stats.n_accept} ({stats.accept:.0f} %), {draft}")
    print(f"Backend: mlx, model: {desc}, BLAS: {record['blas']}")
