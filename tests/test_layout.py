"""The shape of the code, read from its imports with ``ast`` (docs/architecture.md): folders are floors,
each uses only the floors below it; no import cycles; the specification imports nothing of the
backend, the suite or the command line; no folder over 14 modules; no function over 80 lines; the
speculative step in one screen. Every import counts, those inside functions too."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("reference", "mlx_backend", "conformance")

# floor of each folder (the longest matching prefix decides); a module may import its own floor and
# the floors below it, never one above
FLOORS = {
    "reference": 0,
    "mlx_backend.machine": 1,
    "mlx_backend.ngram": 2,
    "mlx_backend.suffix": 2,
    "mlx_backend.decode": 3,
    "mlx_backend.models": 4,
    "mlx_backend.batch": 4,
    "mlx_backend.distributed": 5,
    "mlx_backend.serve": 5,
    "conformance": 5,
    "mlx_backend.cli": 6,
    "mlx_backend": 7,   # the package itself: the public names, re-exported from the floors below
}
SPEC_MUST_NOT_IMPORT = ("mlx_backend", "conformance", "argparse", "tqdm")
MAX_MODULES_PER_FOLDER = 14
MAX_FUNCTION_LINES = 80
STEP = ("mlx_backend/decode/generate.py", "ngram_speculative_generate_step", 60)


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of ours and the outside top-level packages that ``name`` imports anywhere in its file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*up, base] if base else up)
            # `from pkg import sub` imports the module pkg.sub; `from mod import name` imports mod
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known and "." in target:
                target = target.rpartition(".")[0]
            if target != name:
                out.add(target)
    return out


def floor(name: str) -> int:
    return FLOORS[max((p for p in FLOORS if name == p or name.startswith(p + ".")), key=len)]


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles(graph):
    assert cycles(graph) == []


def test_no_arrow_runs_up(graph):
    up = sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets
                if b in graph and floor(b) > floor(a))
    assert up == []


def test_the_specification_imports_no_backend_suite_cli_or_progress_bar(graph):
    bad = sorted(f"{a} -> {b}" for a, targets in graph.items() if a.startswith("reference")
                 for b in targets if b.split(".")[0] in SPEC_MUST_NOT_IMPORT)
    assert bad == []


def test_no_folder_holds_more_than_14_modules():
    folders = {}
    for path in modules().values():
        if path.name != "__init__.py":
            folders.setdefault(path.parent.relative_to(ROOT), []).append(path.name)
    assert {str(f): len(m) for f, m in folders.items() if len(m) > MAX_MODULES_PER_FOLDER} == {}


def test_no_function_is_longer_than_80_lines():
    long = []
    for path in modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {lines} lines")
    assert long == []


def test_the_speculative_step_fits_one_screen():
    path, name, limit = STEP
    step = next(node for node in ast.walk(ast.parse((ROOT / path).read_text()))
                if isinstance(node, ast.FunctionDef) and node.name == name)
    assert step.end_lineno - step.lineno + 1 <= limit
