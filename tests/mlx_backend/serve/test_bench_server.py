"""Benchmark: an agent edit loop against ``ngram-spec serve`` (default: the ``auto`` drafter), ``ngram-spec serve
--drafter lookup`` and plain ``mlx_lm.server`` on the same model.

A scripted multi-turn chat: each turn shows SmolLM2 a file and asks for the whole file back with a small
change; the next turn continues the conversation with another change. The file is real text no one here
wrote: the opening of the installed Python standard library's ``textwrap.py``. The servers load the same
mlx-lm model directory (SmolLM2's GGUF written out as float32 safetensors) and get the same requests,
the order reversed turn by turn, greedy. Reported per turn: tokens/s of each server (wall clock of the
request, as the client sees it), their ratios to plain (target, issue 27: >= 3x), acceptance and tokens per
forward; and the same loop run a second time with the dynamic cache and the suffix history learned from the
first run. ``test_bench_free_chat_vs_mlx_lm_server``: single-turn free-writing chats on the same servers, each
prompt a different one (target >= 0.97x). Each server first answers one untimed request (:func:`warm_up`).
The answers of all servers must be identical.

Run: ``python3 -m pytest --benchmark-only tests/mlx_backend/serve/test_bench_server.py`` (optionally with OpenBLAS, see
docs/benchmarks.md: ``LD_PRELOAD=... OPENBLAS_NUM_THREADS=1``; the servers inherit the environment).
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import textwrap
import time
from pathlib import Path

import pytest
from bench_knobs import whole_number

openai = pytest.importorskip("openai")
pytest.importorskip("mlx_lm")

from test_server import Server  # noqa: E402

MAX_TOKENS = whole_number("NGRAM_SPEC_BENCH_TOKENS", 160)
LINES = whole_number("NGRAM_SPEC_BENCH_LINES", 60)  # of textwrap.py shown in the first turn
SERVE_ARGS = os.environ.get("NGRAM_SPEC_BENCH_SERVE_ARGS", "").split()  # e.g. "--draft-max 4"
EDITS = (
    "Rename the class TextWrapper to LineWrapper everywhere.",
    "Change the default width from 70 to 80.",
    "Add a comment line '# edited' at the very top of the file.",
)


def source_file() -> str:
    """The first ``LINES`` lines of ``class TextWrapper`` in this interpreter's standard library textwrap.py."""
    lines = Path(textwrap.__file__).read_text().splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("class TextWrapper"))
    return "\n".join(lines[start:start + LINES]) + "\n"


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory):
    """SmolLM2 from the GGUF as an mlx-lm model directory, so that plain mlx_lm.server can load it too."""
    import mlx.core as mx
    from mlx_lm.utils import save_config, save_model

    from mlx_backend.models import gguf

    try:
        path = gguf.default_model_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    model, tokenizer = gguf.load(path, "float32")
    out = tmp_path_factory.mktemp("smollm2-mlx")
    save_model(out, model)
    config = {k: v for k, v in vars(model.args).items() if not k.startswith("_")}
    config["eos_token_id"] = sorted(tokenizer.eos_token_ids)
    save_config(config, out / "config.json")
    tokenizer._tokenizer.save_pretrained(str(out))
    del model
    mx.clear_cache()
    return out


WARM_UP = "Repeat this line exactly: the quick brown fox jumps over the lazy dog, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10."


def warm_up(server: Server) -> Server:
    """One short untimed chat that copies (verify steps of several widths), so that the timed requests pay no
    one-time cost: kernels compiled on first use (mlx's CUDA backend compiles some at run time), the drafters'
    numba kernels loaded."""
    server.client.chat.completions.create(model="default_model", max_tokens=48, temperature=0.0,
                                          messages=[{"role": "user", "content": WARM_UP}])
    return server


def run_turn(server: Server, messages: list[dict]) -> dict:
    t0 = time.perf_counter()
    r = server.client.chat.completions.create(model="default_model", messages=messages, max_tokens=MAX_TOKENS,
                                              temperature=0.0)
    seconds = time.perf_counter() - t0
    timings = (r.model_extra or {}).get("timings", {})
    return {"text": r.choices[0].message.content or "", "tokens": r.usage.completion_tokens, "seconds": seconds,
            "tok_s": r.usage.completion_tokens / seconds, "draft_n": timings.get("draft_n", 0),
            "accepted": timings.get("draft_n_accepted", 0), "tokens_per_forward": timings.get("tokens_per_forward", 1.0)}


def edit_loop(servers: dict[str, Server]) -> list[dict]:
    """The conversation, each turn sent to every server in turn (alternating which goes first)."""
    history = {name: [] for name in servers}
    rows = []
    for i, edit in enumerate(EDITS):
        user = (f"Here is a Python file:\n```python\n{source_file()}```\n{edit} Return the full file."
                if i == 0 else f"{edit} Return the full file again.")
        order = list(servers) if i % 2 == 0 else list(servers)[::-1]
        row = {"turn": i + 1}
        for name in order:
            history[name].append({"role": "user", "content": user})
            result = run_turn(servers[name], history[name])
            history[name].append({"role": "assistant", "content": result["text"]})
            row[name] = result
        rows.append(row)
    return rows


FREE_CHAT = (  # free writing: the answer copies nothing from the prompt
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain to a ten-year-old why the sky is blue.",
    "Write a poem about autumn rain in a small town.",
)
FREE_ROUNDS = whole_number("NGRAM_SPEC_BENCH_FREE_ROUNDS", 2)
FREE_ASKS = ("Write a short story about {}.", "Write a poem about {}.", "Describe {} to a ten-year-old.")
FREE_SUBJECTS = ("a lighthouse keeper", "autumn rain in a small town", "a busy fish market", "a lost umbrella",
                 "a mountain hut at dawn", "a cat who hates Mondays", "the first day of school", "an old bicycle",
                 "a night train", "a garden in winter", "a forgotten library", "a storm at sea")


def free_requests(n: int) -> list[str]:
    """``n`` different free-writing prompts: a prompt sent twice would be answered from the server's suffix
    history (the first answer copied), which is no longer free writing."""
    return [FREE_ASKS[(i + i // len(FREE_SUBJECTS)) % len(FREE_ASKS)].format(FREE_SUBJECTS[i % len(FREE_SUBJECTS)])
            for i in range(n)]


@pytest.fixture(scope="module")
def servers(smollm2_dir, tmp_path_factory):
    """``ngram-spec serve`` (default settings: the ``auto`` drafter, a suffix history, and a dynamic cache),
    the same with ``--drafter lookup`` (llama.cpp's lookup alone, as before issue 27) and plain
    ``mlx_lm.server``, on the same directory."""
    started = {}
    try:
        for name, drafter in (("ngram-spec", ()), ("lookup", ("--drafter", "lookup"))):
            dynamic = tmp_path_factory.mktemp("dynamic") / "dyn.ngram"
            started[name] = Server("--model", str(smollm2_dir), "--dynamic", str(dynamic), *drafter, *SERVE_ARGS,
                                   timeout=600, request_timeout=3600)
        started["mlx_lm"] = Server("server", "--model", str(smollm2_dir), module="mlx_lm", timeout=600,
                                   request_timeout=3600)
        for server in started.values():
            warm_up(server)
        yield started
    finally:
        for name, server in started.items():
            server.stop(check=name != "mlx_lm")  # mlx_lm.server does not handle SIGTERM


def conditions() -> dict:
    from mlx_backend.machine.blas import blas_in_use

    return dict(blas=blas_in_use(), machine=f"{platform.machine()}, {os.cpu_count()} CPUs",
                python=sys.version.split()[0], max_tokens=MAX_TOKENS, serve_args=" ".join(SERVE_ARGS),
                load_average=[round(x, 2) for x in os.getloadavg()])


def test_bench_edit_loop_vs_mlx_lm_server(benchmark, servers):
    runs = {}

    def both():
        runs["first"] = edit_loop(servers)
        runs["learned"] = edit_loop(servers)  # the dynamic cache holds the first run's answers

    benchmark.pedantic(both, rounds=1, iterations=1)
    report, differ = {}, []
    for run, rows in runs.items():
        for row in rows:
            a, lookup, b = row["ngram-spec"], row["lookup"], row["mlx_lm"]
            if not a["text"] == b["text"] == lookup["text"]:
                differ.append(f"{run} turn {row['turn']}")
            report[f"{run}_turn{row['turn']}"] = {
                "tokens": a["tokens"], "spec_tok_s": round(a["tok_s"], 2), "lookup_tok_s": round(lookup["tok_s"], 2),
                "mlx_lm_tok_s": round(b["tok_s"], 2), "speedup": round(a["tok_s"] / b["tok_s"], 3),
                "lookup_speedup": round(lookup["tok_s"] / b["tok_s"], 3),
                "accept": round(100.0 * a["accepted"] / a["draft_n"], 1) if a["draft_n"] else 0.0,
                "tokens_per_forward": round(a["tokens_per_forward"], 3),
                "lookup_tokens_per_forward": round(lookup["tokens_per_forward"], 3)}
        for name in ("ngram-spec", "lookup"):
            key = "median_speedup" if name == "ngram-spec" else "lookup_median_speedup"
            report[f"{run}_{key}"] = round(statistics.median(r[name]["tok_s"] / r["mlx_lm"]["tok_s"] for r in rows), 3)
    benchmark.extra_info.update(report)
    benchmark.extra_info.update(conditions(), file_lines=LINES, target=3.0)
    print(json.dumps(report, indent=1))
    assert not differ, f"answers differ in {differ}"


def test_bench_free_chat_vs_mlx_lm_server(benchmark, servers):
    """Single-turn free-writing chats, each sent to every server (alternating which goes first), ``FREE_ROUNDS``
    rounds of three, every prompt a different one; the speedup is the median of the per-request ratios
    (target >= 0.97)."""
    rows = []

    def chats():
        prompts = list(FREE_CHAT) + free_requests(len(FREE_CHAT) * FREE_ROUNDS)[len(FREE_CHAT):]
        for r in range(FREE_ROUNDS):
            for i, prompt in enumerate(prompts[r * len(FREE_CHAT):(r + 1) * len(FREE_CHAT)]):
                names = list(servers) if (r + i) % 2 == 0 else list(servers)[::-1]
                rows.append({name: run_turn(servers[name], [{"role": "user", "content": prompt}]) for name in names})

    benchmark.pedantic(chats, rounds=1, iterations=1)
    differ = [i for i, row in enumerate(rows)
              if not row["ngram-spec"]["text"] == row["lookup"]["text"] == row["mlx_lm"]["text"]]
    ratios = [row["ngram-spec"]["tok_s"] / row["mlx_lm"]["tok_s"] for row in rows]
    benchmark.extra_info.update(conditions(), target=0.97, ratios=[round(r, 3) for r in ratios],
                                median_speedup=round(statistics.median(ratios), 3),
                                spec_tok_s=round(statistics.median(r["ngram-spec"]["tok_s"] for r in rows), 2),
                                mlx_lm_tok_s=round(statistics.median(r["mlx_lm"]["tok_s"] for r in rows), 2),
                                drafted=sum(r["ngram-spec"]["draft_n"] for r in rows),
                                accepted=sum(r["ngram-spec"]["accepted"] for r in rows))
    print(json.dumps(benchmark.extra_info, indent=1))
    assert not differ, f"answers differ in chats {differ}"
