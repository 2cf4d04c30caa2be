"""Replay the generator's draft-length decisions offline: fixed k against the cost-aware policy, on recorded
greedy outputs, at a given verify cost curve, with no timing noise.

:func:`replay` follows :func:`mlx_backend.decode.generate.ngram_speculative_generate_step` step by step
(the first token plain, the room rule, plain mode with its shadow proposals and ``leave_plain``, a
verify accepting the drafts up to the first one the output does not continue) but takes the model's
tokens from ``out`` and charges each step its modelled cost: ``c(k + 1)`` a verify of k drafts, ``c(1)``
the first step of a plain run and ``c_p`` the next ones. The outputs are SmolLM2's greedy answers to the
demo prompts (generated here, ``--outputs`` caches them) and the edit traces of
``benchmarks/data/edit-traces.jsonl.xz`` (the file after the edit as the output: an agent that makes the
edit), tokenized with SmolLM2's tokenizer. Generating takes minutes: a progress bar on stderr counts its
tokens. ``--traces`` must be >= 1::

    python benchmarks/policy_replay.py --slope 0.045 --outputs /tmp/outputs.json
"""
from __future__ import annotations

import argparse
import json
import lzma
import os
import statistics
import sys
from pathlib import Path

from tqdm import tqdm

from mlx_backend.decode.draft_policy import DEFAULT_K_MAX, DraftPolicy, FixedDraftLength
from mlx_backend.ngram.default import make_drafter
from reference.atomic import atomic_write, check_outputs

TRACES = Path(__file__).with_name("data") / "edit-traces.jsonl.xz"
MAX_TOKENS = 300   # of each demo prompt's greedy answer


def replay(prompt: list[int], out: list[int], policy, costs: list[float], c_p: float | None = None,
           drafter: str = "suffix") -> dict:
    """Tokens per forward and modelled speed (tokens per ``c_p``) of ``policy`` generating ``out``."""
    c_p = costs[0] if c_p is None else c_p
    d = make_drafter(drafter)
    d.reset(prompt)
    n_out, steps, seconds, match = 0, 0, 0.0, 0

    def propose(n):
        nonlocal match
        p = [int(t) for t in d.draft(n)[:n]] if n > 0 else []
        match = getattr(d, "match_length", 0) if p else 0
        return p

    def room(n_done):
        return 0 if n_done == 0 else min(policy.k_max, len(out) - n_done - 1)

    def learn(p, emitted):
        policy.observe(p, emitted, match)
        d.extend(emitted)

    while n_out < len(out):
        proposal = propose(room(n_out))
        k = policy.choose(len(proposal), match)
        if k == 0 and policy.pipelined:
            first = True
            while True:
                leave = len(out) <= n_out + 1 or policy.leave_plain(len(proposal), match)
                seconds += costs[0] if first else c_p
                first, steps = False, steps + 1
                learn(proposal, [out[n_out]])
                n_out += 1
                if leave:
                    break
                proposal = propose(1 + room(n_out + 1)) if policy.k_max else []
            continue
        n_acc = 0
        while n_acc < k and n_out + n_acc < len(out) and proposal[n_acc] == out[n_out + n_acc]:
            n_acc += 1
        seconds += costs[k]
        steps += 1
        emitted = out[n_out:n_out + n_acc + 1]
        learn(proposal, emitted)
        n_out += len(emitted)
    return {"tokens_per_forward": n_out / steps, "speed": n_out * c_p / seconds}


def outputs(path: str | None, n_traces: int) -> list[tuple[str, list[int], list[int]]]:
    """(name, prompt, output) of the demo prompts (greedy SmolLM2) and of ``n_traces`` edit traces."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    from mlx_backend.cli import demo as cli
    from mlx_backend.cli.prompts import prompt_tokens
    from mlx_backend.models.loading import load_model

    if path and os.path.exists(path):
        return [tuple(x) for x in json.loads(Path(path).read_text())]
    model, tokenizer, _ = load_model(None, None)
    eos, res = set(tokenizer.eos_token_ids), []
    with tqdm(total=len(cli.DEMO_PROMPTS) * MAX_TOKENS, desc="generate (demo prompts)", unit="tok",
              file=sys.stderr) as bar:
        for p in cli.DEMO_PROMPTS:
            prompt, out = prompt_tokens(tokenizer, p.text), []
            for t, _ in generate_step(mx.array(prompt), model, max_tokens=MAX_TOKENS, sampler=make_sampler(0.0)):
                out.append(int(t))
                bar.update()
                if t in eos:
                    break
            bar.update(MAX_TOKENS - len(out))   # an answer that ended early: the rest of its budget
            res.append((p.name, prompt, out))
    traces = [json.loads(line) for line in lzma.open(TRACES, "rt")]
    kept = [(t["package"] + ":" + t["path"], prompt_tokens(tokenizer, t["prompt"]),
             tokenizer.encode(t["output"], add_special_tokens=False)) for t in traces]
    kept = [k for k in kept if 150 <= len(k[2]) <= 900]
    res += kept[::max(1, len(kept) // n_traces)][:n_traces]
    if path:
        with atomic_write(path, "w") as f:
            f.write(json.dumps(res))
    return res


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slope", type=float, default=0.045, help="c(S) / c(1) = 1 + slope (S - 1)")
    parser.add_argument("--plain", type=float, default=1.0, help="c_p / c(1) (pipelining gain)")
    parser.add_argument("--traces", type=int, default=16, help="edit traces to replay, >= 1 (default %(default)s)")
    parser.add_argument("--outputs", default=None, help="cache of the outputs (JSON)")
    args = parser.parse_args(argv)
    if args.traces < 1:   # before the model loads
        parser.error(f"--traces {args.traces}: must be >= 1 (the number of edit traces to replay)")
    if args.slope < 0 or args.plain <= 0:
        parser.error(f"--slope must be >= 0 and --plain > 0 (relative step costs), got {args.slope} and {args.plain}")
    if args.outputs is not None and not os.path.isfile(args.outputs):   # written after the generation
        try:
            check_outputs({"--outputs": args.outputs}, inputs=[])
        except ValueError as exc:
            parser.error(str(exc))
    costs = [1 + args.slope * s for s in range(DEFAULT_K_MAX + 1)]
    ratios = []
    print("| output | tokens | k=8 | k=16 | k=32 | k=64 | auto | auto / best k |")
    for name, prompt, out in outputs(args.outputs, args.traces):
        row = {k: replay(prompt, out, FixedDraftLength(k), costs[:k + 1], args.plain) for k in (8, 16, 32, 64)}
        auto = replay(prompt, out, DraftPolicy(costs, plain_cost=args.plain), costs, args.plain)
        ratios.append(auto["speed"] / max(r["speed"] for r in row.values()))
        cells = [f'{r["tokens_per_forward"]:.2f} / {r["speed"]:.2f}' for r in [*row.values(), auto]]
        print(f"| {name[:40]} | {len(out)} | " + " | ".join(cells) + f" | {ratios[-1]:.3f} |")
    print(f"auto / best fixed k: median {statistics.median(ratios):.3f}, min {min(ratios):.3f}, "
          f"within 5 %: {sum(r >= 0.95 for r in ratios)} of {len(ratios)}")


if __name__ == "__main__":
    main()
