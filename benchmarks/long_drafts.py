"""Long drafts on SmolLM2: fixed draft lengths k against the cost-aware policy (``draft_max=None``) and
plain decoding, side by side, with the suffix drafter, on the edit-code demo prompt (the model rewrites
code it was shown) and on the free-writing prompt.

Every round runs every configuration once, in a rotated order (round i starts at configuration i), so
machine load hits all alike; the report is the median tokens/s, the tokens per forward and the
policy's draft-length histogram of the last round. ``auto-fresh`` starts from an empty step-cost cache
(a first run: the in-process costs and the step-cost file are dropped before and after each of its runs);
``auto`` keeps what earlier runs of this process learned. The step costs live in the script's own
temporary directory, deleted at exit (``NGRAM_SPEC_CACHE_DIR`` is set to it, overriding any value the user
set): the script never reads, writes or deletes anything in the user's cache directory. ``cost_rel`` is
null in the report when the policy timed no step::

    python benchmarks/long_drafts.py --rounds 3 --edit-tokens 200 --free-tokens 64
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler

from mlx_backend.cli import demo as cli
from mlx_backend.cli.prompts import prompt_tokens
from mlx_backend.decode import draft_policy
from mlx_backend.decode.generate import SpecStats, ngram_speculative_generate_step
from mlx_backend.machine.user_cache import ENV as CACHE_ENV
from mlx_backend.models.loading import load_model
from reference.atomic import atomic_write, check_outputs, terminate_handler

_OWN_CACHE: str | None = None   # the temporary cache directory of this process (own_cache_dir)


def suffix_drafter():
    try:
        from mlx_backend.ngram.default import make_drafter
        return make_drafter("suffix")
    except (ImportError, AttributeError):
        from reference.suffix.drafter import SuffixDrafter
        return SuffixDrafter()


def own_cache_dir() -> str:
    """The script's step-cost cache: a temporary directory made on first use, deleted at exit, and named by
    ``$NGRAM_SPEC_CACHE_DIR`` from then on (a directory the user set there is overridden, never touched)."""
    global _OWN_CACHE
    if _OWN_CACHE is None:
        _OWN_CACHE = tempfile.mkdtemp(prefix="ngram-spec-bench-")
        atexit.register(shutil.rmtree, _OWN_CACHE, ignore_errors=True)
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:   # kill: exit through atexit, not around it
            signal.signal(signal.SIGTERM, terminate_handler)
    os.environ[CACHE_ENV] = _OWN_CACHE
    return _OWN_CACHE


def forget_costs() -> None:
    """Drop the learned step costs: this process's, and the step-cost file of :func:`own_cache_dir` (only
    that file: the directory may hold other things, such as the BLAS link folder)."""
    draft_policy._COSTS.clear()
    (Path(own_cache_dir()) / draft_policy.COST_FILE).unlink(missing_ok=True)


def run(model, prompt, max_tokens, eos, config):
    greedy = make_sampler(0.0)
    stats = SpecStats()
    own_cache_dir()
    if config == "plain":
        steps = ((t, lp, False) for t, lp in generate_step(mx.array(prompt), model, max_tokens=max_tokens,
                                                           sampler=greedy))
    else:
        if config == "auto-fresh":   # a first run: no step costs in this process or on disk
            forget_costs()
        k = None if config.startswith("auto") else int(config[1:])
        steps = ngram_speculative_generate_step(mx.array(prompt), model, max_tokens=max_tokens, sampler=greedy,
                                                draft_max=k, drafter=suffix_drafter(), stats=stats)
    out = []
    t0 = time.perf_counter()
    for token, _, _ in steps:
        out.append(int(token))
        if token in eos:
            break
    seconds = time.perf_counter() - t0
    if config == "auto-fresh":   # what it learned is not for the other runs
        forget_costs()
    return out, len(out) / seconds, stats


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--edit-tokens", type=int, default=200)
    parser.add_argument("--free-tokens", type=int, default=64)
    parser.add_argument("--edit-configs", default="plain,k8,k16,k32,k64,auto,auto-fresh")
    parser.add_argument("--free-configs", default="plain,auto,auto-fresh")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    for flag in ("rounds", "edit_tokens", "free_tokens"):   # before the model loads
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be >= 1")
    try:   # before the model loads and the runs: not a missing folder after minutes of them
        check_outputs({"--json": args.json}, inputs=[])
    except ValueError as exc:
        parser.error(str(exc))
    own_cache_dir()   # before anything reads or writes step costs
    model, tokenizer, desc = load_model(None, None)
    eos = set(tokenizer.eos_token_ids)
    prompts = {p.name: p for p in cli.DEMO_PROMPTS}
    tasks = [("edit-code", args.edit_tokens, args.edit_configs.split(",")),
             ("free-writing", args.free_tokens, args.free_configs.split(","))]
    results = {}
    for name, max_tokens, configs in [t for t in tasks if t[2] != [""]]:   # --edit-configs "": skip the edit
        prompt = prompt_tokens(tokenizer, prompts[name].text)
        run(model, prompt, 8, eos, "auto")   # warm-up (compiles, graph caches)
        rates = {c: [] for c in configs}
        last = {}
        reference = None
        for r in range(args.rounds):
            order = configs[r % len(configs):] + configs[:r % len(configs)]
            for c in order:
                out, rate, stats = run(model, prompt, max_tokens, eos, c)
                reference = reference or out
                assert out == reference, f"{c}: greedy output differs"
                rates[c].append(rate)
                last[c] = stats
                print(f"  {name} round {r} {c}: {rate:.2f} tok/s, {stats.tokens_per_forward:.2f} tok/fwd",
                      file=sys.stderr, flush=True)
        res = {}
        for c in configs:
            s = last[c]
            res[c] = {"tok_s_median": round(statistics.median(rates[c]), 2),
                      "tok_s": [round(x, 2) for x in rates[c]],
                      "tokens_per_forward": round(s.tokens_per_forward, 2) if c != "plain" else 1.0,
                      "plain_steps": s.plain_steps, "draft_lengths": dict(sorted(s.draft_lengths.items())),
                      "accept": round(s.accept, 1)}
            if s.policy:
                res[c]["policy_accept_by_match"] = {b: a[:3] for b, a in s.policy["accept_by_match"].items()}
                costs = s.policy["cost_rel"]   # None: no step was timed (a very short run)
                res[c]["cost_rel"] = costs[::8] if costs is not None else None
        results[name] = {"tokens": len(reference), "configs": res}
        print(json.dumps({name: results[name]}, indent=1), flush=True)
    results["model"] = desc
    if args.json:
        with atomic_write(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
