"""The mutation campaign: cosmic-ray mutates the rule modules, the conformance suite kills the mutants.

    python -m conformance.mutation                                # every rule module (hours)
    python -m conformance.mutation --module reference/ngram/draft.py    # one module
    python -m conformance.mutation --sample 40 --jobs 2           # 40 mutants a module, two at a time
    python -m conformance.mutation --session DIR --rerun-survivors  # after strengthening the suite
    python -m conformance.mutation --session DIR --report         # the table of a (partial) session

Each rule module is mutated by cosmic-ray (https://cosmic-ray.readthedocs.io; ``pip install
'ngram-spec[test]'``) in a copy of the packages under the session directory, so no file of the
checkout is touched. The test command of every mutant is the suite's default run at a fixed seed,
restricted to the areas whose checks call the module (:data:`MODULES`) and stopped at the first
failed check (``--exitfirst``): exit status 1 (a check failed) kills the mutant, 0 lets it survive; a mutant that cannot be imported or runs past the
timeout counts as killed, as cosmic-ray counts it. Survivors listed in :data:`EQUIVALENT` (by the
mutated line: a mutant that changes no behaviour, with the reason) are reported as equivalent. A session can be stopped
and run again with the same ``--session``: cosmic-ray resumes the mutants not yet tested.

``--sample N`` tests a uniform random sample of N mutants of each module (drawn with ``--seed``; the
others are marked skipped and reported as "not sampled"): the killed share of a sample estimates the
module's, and the report gives its 95 % interval (Wilson). Each module is mutated in a copy of its own,
so ``--jobs`` modules run at once.
"""
from __future__ import annotations

import argparse
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from reference.atomic import terminate_handler

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("conformance", "reference", "mlx_backend")
RULES_NGRAM = ("counts", "drafting", "thresholds", "cache_files", "replay")

# rule module -> (backend that runs it, the areas whose checks call it)
MODULES = {
    "reference/ngram/draft.py": ("reference", ("drafting", "thresholds", "replay")),
    "reference/ngram/cache.py": ("reference", RULES_NGRAM),
    "reference/ngram/drafter.py": ("reference", ("counts", "drafting", "thresholds", "greedy")),
    "reference/ngram/replay.py": ("reference", ("replay",)),
    "reference/ngram/cache_file.py": ("reference", ("cache_files", "drafting", "replay")),
    "reference/speculative.py": ("reference", ("greedy",)),
    "reference/models/cache.py": ("reference", ("rollback", "greedy")),
    "reference/suffix/drafter.py": ("reference", ("suffix",)),
    "mlx_backend/decode/generate.py": ("mlx", ("greedy", "sampling")),
    "mlx_backend/decode/sampling.py": ("mlx", ("sampling", "greedy")),
    "mlx_backend/decode/rollback.py": ("mlx", ("rollback", "greedy")),
    "mlx_backend/ngram/hash_table.py": ("mlx", RULES_NGRAM),
    "mlx_backend/ngram/sorted_cache.py": ("mlx", RULES_NGRAM),
}

# (module, the mutated line as cosmic-ray writes it) -> why that mutant changes no behaviour a backend
# can show (so it cannot be killed).
EQUIVALENT: dict[tuple[str, str], str] = {
    ("reference/suffix/drafter.py", "while l != min(limit, e, n) and a[e - 1 - l] == b[n - 1 - l]:"):
        "l starts at 0 <= the bound and grows by 1: l != bound is l < bound",
    ("reference/suffix/drafter.py", "for e in range(end_limit - 1, m >> 1, -1):"):
        "an end e < m makes source[e-m:e] shorter than m tokens (its negative start wraps or clamps): never the "
        "m-token suffix",
    ("reference/suffix/drafter.py", "for e in range(end_limit - 1, m - 2, -1):"):
        "an end e < m makes source[e-m:e] shorter than m tokens (its negative start wraps or clamps): never the "
        "m-token suffix",
    ("reference/suffix/drafter.py", "if found is None or k < 0:"): "k = 0 drafts min(0, ...) = 0 tokens either way",
    ("reference/suffix/drafter.py", "if e > 0:"): "latest_end returns -1 or an end e >= m >= 1",
    ("reference/ngram/draft.py", "LAX = Thresholds(a_n=(2, 2, 1, 0), p_n=(66, 50, 50, 50))  # context cache"):
        "lax a_4 = 1 -> 0: a level is consulted only for an n-gram in the cache, whose count sum is >= 1",
    ("reference/ngram/draft.py", "LAX = Thresholds(a_n=(2, 2, 0, 1), p_n=(66, 50, 50, 50))  # context cache"):
        "lax a_3 = 1 -> 0: a level is consulted only for an n-gram in the cache, whose count sum is >= 1",
    ("reference/ngram/draft.py", "y_best = min(part_st, key=lambda y: (~part_st[y], y))"):
        "~c = -c - 1 orders the counts as -c does",
    ("reference/ngram/draft.py", "return (x - 2**31) % 2**32 - 2**31"): "-2^31 and +2^31 are equal modulo 2^32",
    ("reference/ngram/draft.py", "ngrams = [tuple(window[-n:]) if n <= L else None for n in range(LLAMA_NGRAM_MIN, "
                           "LLAMA_NGRAM_MAX ^ 1)]"): "4 ^ 1 = 5 = 4 + 1",
    ("reference/ngram/draft.py", "window = window[1:] + [y] if len(window) is LLAMA_NGRAM_MAX else window + [y]"):
        "CPython keeps one object per small int, so len(window) is 4 exactly when it equals 4",
    ("reference/ngram/draft.py", "c_st = part_st.get(y, -1)"): "the default is only compared with > 0: -1 and 0 both fail it",
    ("reference/ngram/draft.py", "window = window[ 0:] + [y] if len(window) == LLAMA_NGRAM_MAX else window + [y]"):
        "the window keeps growing instead of sliding, but only its last 4 tokens are read",
    ("reference/ngram/draft.py", "return (x ^ 2**31) % 2**32 - 2**31"):
        "adding 2^31 modulo 2^32 flips bit 31, as the xor does",
    ("reference/ngram/draft.py", "window = [int(t) for t in inp[not LLAMA_NGRAM_MAX:]]  # the tail of S that the n-grams reach"):
        "the whole input instead of its last 4 tokens: only the last 4 are read",
    ("mlx_backend/decode/generate.py", "self.verifier = VerifyCache(model, self.cache, gdn_path) if draft_max != -1 else None"):
        "draft_max = -1 is refused above, so a verifier is also made for draft_max = 0, a run that never "
        "verifies: the same tokens, one unused wrapper",
    ("mlx_backend/ngram/sorted_cache.py", "new_key[1:] |= w1[1:] > w1[:-1]"):
        "the rows are sorted by (w0, w1): within one w0, w1 only grows, so != is >; where w0 changes the key "
        "is already new",
    ("mlx_backend/ngram/sorted_cache.py", "if j == 0 or key > (packed[j - 1] >> bits):"):
        "the packed triples are sorted: a key differs from the previous one exactly when it is larger",
    ("mlx_backend/ngram/sorted_cache.py",
     "BUILD_CHUNK = 1 << 23  # tokens per sorted chunk of the static build (bounded memory)"):
        "the chunk length of the static build bounds its memory; the merged counts are the same",
    ("mlx_backend/ngram/sorted_cache.py", "if int(t.max()) >= 1 + PACK_BITS:"):
        "ids from 22 up take the unpacked build (cache_from_rows) instead of the packed one: the same counts",
    ("mlx_backend/decode/rollback.py", 'return "replay" if not on_metal else "states"'):
        "both GatedDeltaNet rollback paths are exact (replay recomputes the kept prefix, states stores each "
        "token's state): the choice by device is one of speed",
    ("mlx_backend/decode/rollback.py", "S = self.conv_input.shape[1] + layer.conv_kernel_size + 1"):
        "S is a shortcut for m = S: without it, the states path returns states[S - 1], the same final state",
    ("mlx_backend/decode/sampling.py", "if i is k:"): "CPython keeps one object per small int: i is k exactly when i == k "
                                               "for draft lengths up to 256",
    ("mlx_backend/decode/sampling.py", "if 0 < self.top_p < 2:"):
        "top-p filtering at p = 1 keeps every token of positive probability: the same law",
    ("mlx_backend/decode/sampling.py", "return int(mx.random.categorical(mx.log(residual), axis=+1).item()), False"):
        "the residual is [1, V]: axis 1 is axis -1",
    ("reference/models/cache.py", "self.pending = -1"):
        "keep() before any forward raises ValueError either way (-1 fails the range test 0 <= m <= pending)",
    ("reference/models/cache.py", "self.recurrent = states[+1]"):
        "the reference's loops follow every multi-token forward with keep(m), which sets the recurrent state "
        "from the trace (states[m]); after a one-token forward states[+1] is states[-1]",
    ("mlx_backend/decode/rollback.py", "@functools.lru_cache(maxsize= 255)"):
        "the size of the memo of rotating-cache masks: a mask that is not kept is computed again, the same",
    ("mlx_backend/ngram/hash_table.py", "while k <= n_draft:"):
        "this loop runs only when n_draft > n_ctx + 4, and it leaves at the chunk's end (L + k - 1 >= n_ctx) "
        "before k can reach n_draft",
    ("mlx_backend/decode/sampling.py", "while n is not k and tokens[n] == drafts[n]:"):
        "CPython keeps one object per small int: n is not k exactly when n != k for draft lengths up to 256, "
        "and n only grows from 0 to k",
    ("mlx_backend/decode/sampling.py", "if isinstance(sampler, Sampler) and sampler.temp == 0:"):
        "for a drafter's single proposal d, drawing t ~ p and accepting d iff t = d emits each token with "
        "probability p, as accepting d with probability p(d) and else drawing from p without d does: the same law",
    ("mlx_backend/ngram/sorted_cache.py", "if j is b0.size:"):
        "numba compiles `is` between two integers as equality, and j never passes b0.size",
    ("mlx_backend/ngram/hash_table.py", "t = list(ngram) + [-1] * (NGRAM_MAX // len(ngram))"):
        "4 // n = 4 - n for n = 2, 3; for n = 1, 4 it pads one -1 more, past the 4 slots that are read",
    ("mlx_backend/ngram/hash_table.py",
     "best_y, best_c, best_w, best_s = np.int64(-1), np.int64( 1), np.int64(1), np.int64(0)"):
        "exact scores: the start (-1, c=1, w=1) is kept only when the most frequent follower is a static one, "
        "whose score c * 100 * c_st >= 100 beats it, as every other static follower's does; a follower with "
        "w = 1 never wins then; int32 scores compare best_s, not best_c",
}
ANNOTATION = "an annotation, never evaluated (from __future__ import annotations)"

_STATS = ("a counter of the mlx backend's plain mode (enter_plain, leave_plain) that --json reports; the "
          "protocol's counts are steps, n_drafted, n_accept, accept, draft_lengths and the times")
_TIMING = ("lookup-stats' t_draft in microseconds: the protocol bounds a time by the call's wall time, and a "
           "time that is too small (t_draft_ns % 1000) stays within it")
_PROCESSORS = ("logits processors (mlx-lm's repetition penalty and the like), which the protocol's sample_step "
               "does not take; tests/mlx_backend/decode/test_mlx_sampling.py covers them")
_REPLAYED = ("the snapshot-and-re-run rollback of caches the recorder does not know (an unknown recurrent layer, a "
             "cache type without trim): no protocol model has one; tests/mlx_backend/decode/test_mlx_rollback.py covers it")
# (module, the original line of a surviving mutant) -> why the suite cannot see that line: the mutant
# changes behaviour, but none that the protocol defines. Still counted as survivors.
OUT_OF_REACH: dict[tuple[str, str], str] = {
    ("mlx_backend/decode/generate.py", "stats.leave_plain += 1"): _STATS,
    ("mlx_backend/decode/generate.py", "stats.enter_plain += 1"): _STATS,
    ("reference/ngram/replay.py", "t_draft_us = t_draft_ns / 1e3"): _TIMING,
    ("reference/suffix/drafter.py", "if not ladder or not all(is_whole(m) and m >= 1 for m in lengths):"):
        "SuffixDrafter's ladder argument: the protocol's suffix_drafter drafts with the rule's ladder (checked by "
        "suffix.ladder_lengths_are_the_rules) and passes none",
    ("reference/ngram/replay.py", "progress(i_start + n_ctx, len(chunk_starts) * n_ctx)"):
        "the work done that a caller's progress callback is told (a progress bar's advance)",
    ("reference/ngram/cache_file.py", "progress(4 * end, len(data))"):
        "the bytes parsed that a caller's progress callback is told (a progress bar's advance)",
    ("mlx_backend/decode/sampling.py", "for i in range(k + 1):"): _PROCESSORS,
    ("mlx_backend/decode/sampling.py", "seen = mx.array(list(history or []) + drafts[:i])"): _PROCESSORS,
    ("mlx_backend/decode/rollback.py", 'elif hasattr(c, "trim") and c.is_trimmable():'):
        "a cache with trim() that is not trimmable: among mlx-lm's caches only a RotatingKVCache past its size "
        "(taken by the line before) and a BatchRotatingKVCache past its size (batched generation; speculation "
        "runs batch size 1), neither of which the protocol's models make",
    ("mlx_backend/decode/rollback.py", "seen = seen[np.array(one).reshape(-1)]"):
        "mlx-lm's one-token mask inside a ring larger than its layer's window (window_size < max_size): no "
        "protocol model has one (each sliding layer's ring is its window, as mlx-lm's models make it); "
        "tests/mlx_backend/decode/test_mlx_windowed.py covers it (llama-window-in-bigger-ring)",
    ("mlx_backend/decode/rollback.py", "self._cut(0)"): _REPLAYED,
    ("mlx_backend/decode/rollback.py", "for layer, _ in self.gdn:"):
        "resetting the GatedDeltaNet recorder's flags: left set, the next steps record their states too (the "
        "same outputs and state, more work); the protocol checks what is generated, not how",
    ("mlx_backend/ngram/hash_table.py", "n = max(0, end - max(start, 1))"):
        "HashTable.update, called by the server's dynamic-cache learning only (the drafter counts inside its "
        "kernel); tests/mlx_backend/serve/test_server.py covers it",
    ("mlx_backend/ngram/sorted_cache.py", 'h.update("".join(" ".join(map(str, r)) + "\\n" for r in rows[i:i + (1 << 18)]'
                                     '.tolist()).encode())'):
        "SortedCache.canonical_sha256, a method the protocol does not call (the suite hashes cache_entries itself)",
    ("mlx_backend/ngram/sorted_cache.py", "if counts.size and counts.max() > INT32_MAX:"):
        "build_static's refusal of a 2-gram seen more than 2^31 - 1 times: a stream of over 2 billion tokens",
    ("mlx_backend/decode/sampling.py", "return (mx.arange(logprobs.shape[-1]) == greedy(logprobs)[..., None])"
                                ".astype(mx.float32)"):
        "Sampler.probs at temperature 0 (a one-hot law), which speculative sampling never asks for: greedy "
        "verification compares argmaxes (the server's logprobs use it; tests/mlx_backend/serve/test_server.py)",
    ("mlx_backend/ngram/hash_table.py", "t = list(ngram) + [-1] * (NGRAM_MAX - len(ngram))"):
        "ngram_words, the converter of the reference's NgramCache into the mlx tables (api.from_reference), "
        "which no protocol member calls",
    ("mlx_backend/decode/generate.py", "max_tokens: int = 256,"):
        "the default of ngram_speculative_generate_step's max_tokens, an argument the protocol's generate_step "
        "always passes (stream_generate's own default is checked)",
    ("mlx_backend/decode/generate.py", "proposal = self.propose(1 + self.room(self.n_out + 1)) if policy.k_max else []   "
                                       "# draft_max=0: no drafter calls"):
        "the length of the proposal the cost-aware policy weighs in plain mode: it changes which drafts are "
        "verified (speed), never a token or a flag; the protocol checks what is generated, not how fast",
    ("mlx_backend/decode/generate.py", 'f"{n_vocab} tokens (ids 0..{n_vocab - 1}): was the prompt made with another '
                                'tokenizer?")'):
        "the wording of an error message (the error itself is tested in tests/mlx_backend/decode/test_mlx_generate.py)",
}


def annotation_spans(module: str) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """``(start, end)`` (line, column) of every annotation in ``module``: mutants inside are equivalent."""
    import ast

    spans = []
    for node in ast.walk(ast.parse((ROOT / module).read_text())):
        note = (node.annotation if isinstance(node, (ast.arg, ast.AnnAssign))
                else node.returns if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None)
        if note is not None:
            spans.append(((note.lineno, note.col_offset), (note.end_lineno, note.end_col_offset)))
    return spans


def config_text(module: str, backend: str, areas, seed: int, timeout: float) -> str:
    areas_args = " ".join(f"--area {a}" for a in areas)
    command = f"{sys.executable} -m conformance --backend {backend} --seed {seed} -q --exitfirst {areas_args}"
    return (f'[cosmic-ray]\nmodule-path = "{module}"\ntimeout = {timeout}\nexcluded-modules = []\n'
            f'test-command = "{command}"\n\n[cosmic-ray.distributor]\nname = "local"\n')


def session_paths(session: Path, module: str) -> tuple[Path, Path]:
    stem = module.replace("/", "_").removesuffix(".py")
    return session / f"{stem}.toml", session / f"{stem}.sqlite"


def sample(db: Path, n: int, seed: int, name: str | None = None) -> None:
    """Mark all but a seeded uniform sample of ``n`` of the pending mutants as skipped (not sampled);
    ``name``: the session database's file name that seeds the draw (default ``db``'s own)."""
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkResult

    with use_db(str(db), WorkDB.Mode.open) as work_db:
        items = sorted(work_db.pending_work_items, key=lambda i: (  # job ids are random: order by the mutation
            str(i.mutations[0].module_path), tuple(i.mutations[0].start_pos), i.mutations[0].operator_name,
            i.mutations[0].occurrence))
        if len(items) > n:
            keep = {i.job_id for i in random.Random(f"{seed}:{name or db.name}").sample(items, n)}
            work_db.set_multiple_results([i.job_id for i in items if i.job_id not in keep],
                                         WorkResult(worker_outcome=WorkerOutcome.SKIPPED))


def forget_survivors(session: Path, module: str) -> int:
    """Make the survivors of ``module``'s session that no reason explains (not equivalent, not out of the
    protocol's reach) pending again, to test them against a strengthened suite."""
    import sqlite3

    jobs = tally(session, module)["unexplained"]
    with sqlite3.connect(session_paths(session, module)[1]) as con:
        con.executemany("DELETE FROM work_results WHERE job_id = ?", [(j,) for j in jobs])
    return len(jobs)


def run_module(session: Path, module: str, seed: int, timeout: float, n_sample: int | None,
               rerun_survivors: bool = False) -> None:
    """Initialise (once) and execute the cosmic-ray session of ``module`` in its copy under ``session``;
    the copy is refreshed from the checkout when the module's session is new (its mutants are drawn from
    the checkout's code) and with ``rerun_survivors``, which also makes the survivors pending."""
    backend, areas = MODULES[module]
    config, db = session_paths(session, module)
    tree = session / "trees" / config.stem
    if not tree.exists() or rerun_survivors or not db.exists():
        refresh_tree(tree)
    if rerun_survivors and db.exists():
        print(f"{module}: {forget_survivors(session, module)} survivors to test again", flush=True)
    env = dict(os.environ, PYTHONPATH=str(tree))
    if not db.exists():   # initialised whole or not at all (an interrupted init is started again)
        config.write_text(config_text(module, backend, areas, seed, timeout))
        part = db.with_name(f".{db.name}.{os.getpid()}.init")
        try:
            _run(["cosmic-ray", "init", str(config), str(part)], cwd=tree, env=env)
            if n_sample is not None:
                sample(part, n_sample, seed, name=db.name)
            os.replace(part, db)
        finally:
            for leftover in (part, *(part.with_name(part.name + s) for s in ("-journal", "-wal", "-shm"))):
                leftover.unlink(missing_ok=True)
    _run(["cosmic-ray", "exec", str(config), str(db)], cwd=tree, env=env)


_children: set[subprocess.Popen] = set()   # the cosmic-ray processes running now (stopped on an interrupt)
_children_lock = threading.Lock()


def _run(cmd: list[str], **kwargs) -> None:
    """``subprocess.run(cmd, check=True, **kwargs)``, the process kept in :data:`_children` while it runs."""
    proc = subprocess.Popen(cmd, **kwargs)
    with _children_lock:
        _children.add(proc)
    try:
        rc = proc.wait()
    finally:
        with _children_lock:
            _children.discard(proc)
    if rc:
        raise subprocess.CalledProcessError(rc, cmd)


def _stop_children(signum: int) -> None:
    with _children_lock:
        for proc in _children:
            if proc.poll() is None:
                proc.send_signal(signum)


_stopping = threading.Event()   # set on an interrupt: a module not started yet is not started


def _unless_stopping(*args) -> None:
    if not _stopping.is_set():
        run_module(*args)


def refresh_tree(tree: Path) -> None:
    """``tree`` := a fresh copy of the checkout's :data:`PACKAGES`, swapped in whole: copied beside it
    first, so an interrupted copy leaves the old tree (or, between the two renames, none, which the next
    run copies again), never one whose packages come from two checkouts."""
    part = tree.with_name(f".{tree.name}.{os.getpid()}.tmp")
    shutil.rmtree(part, ignore_errors=True)
    try:
        part.mkdir(parents=True)
        for package in PACKAGES:
            shutil.copytree(ROOT / package, part / package, ignore=shutil.ignore_patterns("__pycache__"))
        old = tree.with_name(f".{tree.name}.{os.getpid()}.old")
        if tree.exists():
            os.replace(tree, old)
        os.replace(part, tree)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(part, ignore_errors=True)


def tally(session: Path, module: str) -> dict:
    """killed / survived / equivalent / pending counts of ``module``'s session, and the survivors."""
    from cosmic_ray.work_db import WorkDB, use_db

    from cosmic_ray.work_item import WorkerOutcome

    out = {"killed": 0, "survived": 0, "out_of_reach": 0, "equivalent": 0, "pending": 0, "not_sampled": 0,
           "survivors": [], "equivalents": [], "unexplained": []}
    _, db = session_paths(session, module)
    if not db.exists():
        return out
    annotations = annotation_spans(module)
    with use_db(str(db), WorkDB.Mode.open) as work_db:
        out["pending"] = sum(1 for _ in work_db.pending_work_items)
        for item, result in work_db.completed_work_items:
            if result.worker_outcome == WorkerOutcome.SKIPPED:
                out["not_sampled"] += 1
                continue
            spec = item.mutations[0]
            changed = [line for line in (result.diff or "").splitlines()
                       if line[:1] in "+-" and line[:3] not in ("---", "+++")]
            added = next((line[1:].strip() for line in changed if line.startswith("+")), "")
            if result.is_killed:
                out["killed"] += 1
            else:
                where = f"{module}:{spec.start_pos[0]} {spec.operator_name}: " + " / ".join(l.strip() for l in changed)
                reason = EQUIVALENT.get((module, added)) or (
                    ANNOTATION if any(a <= tuple(spec.start_pos) < b for a, b in annotations) else None)
                if reason:
                    out["equivalent"] += 1
                    out["equivalents"].append(f"{where} ({reason})")
                else:
                    out["survived"] += 1
                    removed = next((line[1:].strip() for line in changed if line.startswith("-")), "")
                    why = OUT_OF_REACH.get((module, removed))
                    out["out_of_reach"] += why is not None
                    out["survivors"].append(f"{where} (out of the protocol's reach: {why})" if why else where)
                    if why is None:
                        out["unexplained"].append(item.job_id)
    return out


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95 % Wilson score interval of a proportion k / n."""
    if n == 0:
        return 0.0, 1.0
    p, d = k / n, 1 + z * z / n
    mid, half = (p + z * z / (2 * n)) / d, z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return max(0.0, mid - half), min(1.0, mid + half)


def stratified(strata) -> tuple[float, float]:
    """The killed share of all mutants estimated from per-module samples ``(module size, killed share, sample
    size)``: the size-weighted mean of the shares and the half-width of its 95 % normal interval."""
    total = sum(size for size, _, _ in strata)
    est = sum(size * p for size, p, _ in strata) / total
    var = sum((size / total) ** 2 * p * (1 - p) / n * max(0.0, 1 - n / size) for size, p, n in strata)
    return est, 1.96 * math.sqrt(var)


def report(session: Path, modules) -> str:
    lines = ["| module | killed | survived (out of reach) | equivalent | not run | not sampled "
             "| killed / non-equivalent (95 % interval) |",
             "|---|---|---|---|---|---|---|"]
    survivors, equivalents, total, strata = [], [], [0, 0], []
    for module in modules:
        t = tally(session, module)
        done = t["killed"] + t["survived"]
        total[0] += t["killed"]
        total[1] += done
        if done:  # (mutants of the module, its sample's killed share, sample size) for the weighted estimate
            tested = done + t["equivalent"]
            size = (tested + t["pending"] + t["not_sampled"]) * done / tested
            strata.append((size, t["killed"] / done, done))
        lo, hi = wilson(t["killed"], done)
        rate = f"{100 * t['killed'] / done:.0f} % ({100 * lo:.0f}-{100 * hi:.0f})" if done else "-"
        lines.append(f"| `{module}` | {t['killed']} | {t['survived']} ({t['out_of_reach']}) | {t['equivalent']} "
                     f"| {t['pending']} "
                     f"| {t['not_sampled']} | {rate} |")
        survivors += t["survivors"]
        equivalents += t["equivalents"]
    if total[1]:
        lo, hi = wilson(*total)
        lines.append(f"| all (the samples pooled) | {total[0]} | {total[1] - total[0]} | | | | "
                     f"{100 * total[0] / total[1]:.1f} % ({100 * lo:.0f}-{100 * hi:.0f}) |")
        if any(size > n for size, _, n in strata):  # sampled: weigh each module by its non-equivalent mutants
            est, half = stratified(strata)
            lines.append(f"| all (weighted by each module's mutants) | | | | | | {100 * est:.1f} % "
                         f"({100 * max(0.0, est - half):.0f}-{100 * min(1.0, est + half):.0f}) |")
    return "\n".join(lines + ["", "survivors:"] + [f"  {s}" for s in survivors or ["none"]]
                     + ["", "equivalent:"] + [f"  {s}" for s in equivalents or ["none"]])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m conformance.mutation", description=__doc__.split("\n\n")[0])
    parser.add_argument("--module", action="append", choices=list(MODULES),
                        help="a rule module to mutate (repeatable; default: all of them)")
    parser.add_argument("--session", type=Path, help="session directory (kept; default: a new temporary one)")
    parser.add_argument("--seed", type=int, default=1, help="the suite's seed (default 1)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per mutant before it counts as killed")
    parser.add_argument("--sample", type=int, metavar="N",
                        help="test a random sample of N mutants of each module (drawn with --seed; default: all)")
    parser.add_argument("--jobs", type=int, default=1, help="modules mutated at once, each in its own copy (default 1)")
    parser.add_argument("--rerun-survivors", action="store_true",
                        help="test the survivors of --session that no reason explains again, against the "
                             "checkout's current suite")
    parser.add_argument("--report", action="store_true", help="only print the table of --session")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    modules = args.module or list(MODULES)
    reading = "--report" if args.report else "--rerun-survivors" if args.rerun_survivors else None
    if args.session is not None and args.session.exists() and not args.session.is_dir():
        parser.error(f"--session {args.session} is a file; give a directory (made if missing)")
    if reading and args.session is None:
        parser.error(f"{reading} needs --session DIR")
    if reading and not args.session.exists():   # a typo would start a new, empty session
        parser.error(f"--session {args.session}: no such session directory; give the folder of an earlier run "
                     f"to {reading}")
    if args.sample is not None and args.sample < 1 or args.jobs < 1:
        parser.error("--sample and --jobs must be >= 1")
    if shutil.which("cosmic-ray") is None:
        parser.error("cosmic-ray is not installed: pip install 'ngram-spec[test]'")
    session = args.session or Path(tempfile.mkdtemp(prefix="ngram-spec-mutation-"))
    session.mkdir(parents=True, exist_ok=True)
    if not args.report:
        print(f"session: {session}", flush=True)
        _stopping.clear()
        previous = signal.signal(signal.SIGTERM, terminate_handler)
        try:
            with ThreadPoolExecutor(args.jobs) as pool:
                futures = [pool.submit(_unless_stopping, session, m, args.seed, args.timeout, args.sample,
                                       args.rerun_survivors) for m in modules]
                try:
                    for done in futures:
                        done.result()
                except (KeyboardInterrupt, SystemExit) as exc:   # Ctrl-C, SIGTERM: no module starts after it,
                    # the running ones stop (a module that fails otherwise lets the others run, as before)
                    _stopping.set()
                    pool.shutdown(wait=False, cancel_futures=True)
                    _stop_children(signal.SIGTERM if isinstance(exc, SystemExit) else signal.SIGINT)
                    raise
        except (KeyboardInterrupt, SystemExit) as exc:
            code = 130 if isinstance(exc, KeyboardInterrupt) else exc.code
            print(f"{parser.prog}: interrupted; the session {session} keeps what was done: run again with "
                  f"--session {session} to go on", file=sys.stderr, flush=True)
            return code
        finally:
            signal.signal(signal.SIGTERM, previous)
    print(report(session, modules))
    return 0


if __name__ == "__main__":
    sys.exit(main())
