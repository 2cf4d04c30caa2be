"""The mutation campaign: cosmic-ray mutates the rule modules, the conformance suite kills the mutants.

    python -m conformance.mutation                                # every rule module (hours)
    python -m conformance.mutation --module reference/draft.py    # one module
    python -m conformance.mutation --report SESSION_DIR           # the table of a (partial) session

Each rule module is mutated by cosmic-ray (https://cosmic-ray.readthedocs.io; ``pip install
'ngram-spec[test]'``) in a copy of the packages under the session directory, so no file of the
checkout is touched. The test command of every mutant is the suite's default run at a fixed seed,
restricted to the areas whose checks call the module (:data:`MODULES`): exit status 1 (a check
failed) kills the mutant, 0 lets it survive; a mutant that cannot be imported or runs past the
timeout counts as killed, as cosmic-ray counts it. Survivors listed in :data:`EQUIVALENT` (by the
mutated line: a mutant that changes no behaviour, with the reason) are reported as equivalent. A session can be stopped
and run again with the same ``--session``: cosmic-ray resumes the mutants not yet tested.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("conformance", "reference", "mlx_backend")
RULES_NGRAM = ("counts", "drafting", "thresholds", "cache_files", "replay")

# rule module -> (backend that runs it, the areas whose checks call it)
MODULES = {
    "reference/draft.py": ("reference", ("drafting", "thresholds", "replay")),
    "reference/ngram_cache.py": ("reference", RULES_NGRAM),
    "reference/drafter.py": ("reference", ("counts", "drafting", "thresholds", "greedy")),
    "reference/replay.py": ("reference", ("replay",)),
    "reference/cache_file.py": ("reference", ("cache_files", "drafting", "replay")),
    "reference/speculative.py": ("reference", ("greedy",)),
    "reference/models/cache.py": ("reference", ("rollback", "greedy")),
    "mlx_backend/generate.py": ("mlx", ("greedy", "sampling")),
    "mlx_backend/sampling.py": ("mlx", ("sampling", "greedy")),
    "mlx_backend/rollback.py": ("mlx", ("rollback", "greedy")),
    "mlx_backend/ngram_tables.py": ("mlx", RULES_NGRAM),
    "mlx_backend/tables_sorted.py": ("mlx", RULES_NGRAM),
}

# (module, the mutated line as cosmic-ray writes it) -> why that mutant changes no behaviour a backend
# can show (so it cannot be killed).
EQUIVALENT: dict[tuple[str, str], str] = {
    ("reference/draft.py", "LAX = Thresholds(a_n=(2, 2, 1, 0), p_n=(66, 50, 50, 50))  # context cache"):
        "lax a_4 = 1 -> 0: a level is consulted only for an n-gram in the cache, whose count sum is >= 1",
    ("reference/draft.py", "LAX = Thresholds(a_n=(2, 2, 0, 1), p_n=(66, 50, 50, 50))  # context cache"):
        "lax a_3 = 1 -> 0: a level is consulted only for an n-gram in the cache, whose count sum is >= 1",
    ("reference/draft.py", "y_best = min(part_st, key=lambda y: (~part_st[y], y))"):
        "~c = -c - 1 orders the counts as -c does",
    ("reference/draft.py", "return (x - 2**31) % 2**32 - 2**31"): "-2^31 and +2^31 are equal modulo 2^32",
    ("reference/draft.py", "ngrams = [tuple(window[-n:]) if n <= L else None for n in range(LLAMA_NGRAM_MIN, "
                           "LLAMA_NGRAM_MAX ^ 1)]"): "4 ^ 1 = 5 = 4 + 1",
    ("reference/draft.py", "window = window[1:] + [y] if len(window) is LLAMA_NGRAM_MAX else window + [y]"):
        "CPython keeps one object per small int, so len(window) is 4 exactly when it equals 4",
    ("reference/draft.py", "c_st = part_st.get(y, -1)"): "the default is only compared with > 0: -1 and 0 both fail it",
    ("reference/draft.py", "window = window[ 0:] + [y] if len(window) == LLAMA_NGRAM_MAX else window + [y]"):
        "the window keeps growing instead of sliding, but only its last 4 tokens are read",
    ("reference/draft.py", "return (x ^ 2**31) % 2**32 - 2**31"):
        "adding 2^31 modulo 2^32 flips bit 31, as the xor does",
    ("reference/draft.py", "window = [int(t) for t in inp[not LLAMA_NGRAM_MAX:]]  # the tail of S that the n-grams reach"):
        "the whole input instead of its last 4 tokens: only the last 4 are read",
}
ANNOTATION = "an annotation, never evaluated (from __future__ import annotations)"


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
    command = f"{sys.executable} -m conformance --backend {backend} --seed {seed} -q {areas_args}"
    return (f'[cosmic-ray]\nmodule-path = "{module}"\ntimeout = {timeout}\nexcluded-modules = []\n'
            f'test-command = "{command}"\n\n[cosmic-ray.distributor]\nname = "local"\n')


def session_paths(session: Path, module: str) -> tuple[Path, Path]:
    stem = module.replace("/", "_").removesuffix(".py")
    return session / f"{stem}.toml", session / f"{stem}.sqlite"


def run_module(session: Path, module: str, seed: int, timeout: float) -> None:
    """Initialise (once) and execute the cosmic-ray session of ``module`` in the copy under ``session``."""
    backend, areas = MODULES[module]
    tree = session / "tree"
    if not tree.exists():
        for package in PACKAGES:
            shutil.copytree(ROOT / package, tree / package, ignore=shutil.ignore_patterns("__pycache__"))
    config, db = session_paths(session, module)
    env = dict(os.environ, PYTHONPATH=str(tree))
    if not db.exists():
        config.write_text(config_text(module, backend, areas, seed, timeout))
        subprocess.run(["cosmic-ray", "init", str(config), str(db)], cwd=tree, env=env, check=True)
    subprocess.run(["cosmic-ray", "exec", str(config), str(db)], cwd=tree, env=env, check=True)


def tally(session: Path, module: str) -> dict:
    """killed / survived / equivalent / pending counts of ``module``'s session, and the survivors."""
    from cosmic_ray.work_db import WorkDB, use_db

    out = {"killed": 0, "survived": 0, "equivalent": 0, "pending": 0, "survivors": [], "equivalents": []}
    _, db = session_paths(session, module)
    if not db.exists():
        return out
    annotations = annotation_spans(module)
    with use_db(str(db), WorkDB.Mode.open) as work_db:
        out["pending"] = sum(1 for _ in work_db.pending_work_items)
        for item, result in work_db.completed_work_items:
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
                    out["survivors"].append(where)
    return out


def report(session: Path, modules) -> str:
    lines = ["| module | killed | survived | equivalent | not run | killed / non-equivalent |",
             "|---|---|---|---|---|---|"]
    survivors, equivalents = [], []
    for module in modules:
        t = tally(session, module)
        done = t["killed"] + t["survived"]
        rate = f"{100 * t['killed'] / done:.0f} %" if done else "-"
        lines.append(f"| `{module}` | {t['killed']} | {t['survived']} | {t['equivalent']} | {t['pending']} | {rate} |")
        survivors += t["survivors"]
        equivalents += t["equivalents"]
    return "\n".join(lines + ["", "survivors:"] + [f"  {s}" for s in survivors or ["none"]]
                     + ["", "equivalent:"] + [f"  {s}" for s in equivalents or ["none"]])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conformance.mutation", description=__doc__.split("\n\n")[0])
    parser.add_argument("--module", action="append", choices=list(MODULES),
                        help="a rule module to mutate (repeatable; default: all of them)")
    parser.add_argument("--session", type=Path, help="session directory (kept; default: a new temporary one)")
    parser.add_argument("--seed", type=int, default=1, help="the suite's seed (default 1)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per mutant before it counts as killed")
    parser.add_argument("--report", action="store_true", help="only print the table of --session")
    args = parser.parse_args(argv)
    modules = args.module or list(MODULES)
    if args.report and args.session is None:
        parser.error("--report needs --session DIR")
    session = args.session or Path(tempfile.mkdtemp(prefix="ngram-spec-mutation-"))
    session.mkdir(parents=True, exist_ok=True)
    if shutil.which("cosmic-ray") is None:
        parser.error("cosmic-ray is not installed: pip install 'ngram-spec[test]'")
    if not args.report:
        print(f"session: {session}", flush=True)
        for module in modules:
            run_module(session, module, args.seed, args.timeout)
    print(report(session, modules))
    return 0


if __name__ == "__main__":
    sys.exit(main())
