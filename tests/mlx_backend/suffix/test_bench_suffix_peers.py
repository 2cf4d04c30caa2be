"""Our drafters next to Arctic Inference's SuffixDecoding (vLLM's ``suffix`` method) on the edit traces:
``pytest tests/mlx_backend/suffix/test_bench_suffix_peers.py --benchmark-only -s``.

Tokens per verify step per request (median over the requests, and pooled: all output tokens over all
steps) for our ``suffix``, ``auto`` and ``lookup`` drafters and SuffixDecoding at vLLM's defaults
(``max_tree_depth`` 24) and at depth 64 (``SuffixDecodingCache``'s own default), at k = 8, 16, 32, 64,
each request on its own (history ``none``) or after the earlier ones in arrival order (``requests``).
The traces are ``benchmarks/data/edit-traces.jsonl.xz`` tokenized as ``ngram-spec stats --requests``
does (SmolLM2's tokenizer, no special tokens). The last test prints the side-by-side table and our
``suffix`` over SuffixDecoding at each k; every benchmark's ``extra_info`` holds its figures
(``--benchmark-json``).

Counting. Every drafter, SuffixDecoding included, runs through :func:`reference.suffix.replay.replay_request`
(first step without drafts, ``k = min(draft_max, remaining - 1)``, accepted = matching prefix, the step's
``n + 1`` tokens then appended). SuffixDecoding is driven as vLLM's proposer drives it
(``vllm/v1/spec_decode/suffix_decoding.py``, ``SuffixDecodingProposer.propose``): ``start_request(prompt)``,
``add_active_response(step tokens)`` after every step, ``speculate(last max_tree_depth tokens of prompt +
output, max_spec_tokens=k, max_spec_factor, min_token_prob)`` and the draft's ``token_ids``. vLLM's
defaults (``vllm/config/speculative.py``): ``suffix_decoding_max_tree_depth`` 24,
``suffix_decoding_max_cached_requests`` 10000, ``suffix_decoding_max_spec_factor`` 1.0,
``suffix_decoding_min_token_prob`` 0.1; ``max_spec_offset`` is not passed (0.0, the cache's default);
path (not tree) speculation.

History. vLLM keeps one ``SuffixDecodingCache`` for all requests: the *global* tree holds the responses
(every request's generated tokens, the running one's included, up to 10000 requests, FIFO), while a
request's prompt lives only in its *local* tree, dropped by ``stop_request`` when the request leaves
the batch. So with history ``requests`` SuffixDecoding sees the earlier requests' outputs, not their
prompts (ours sees both: ``SuffixHistory`` gets ``prompt + output``); with history ``none`` each request
gets a fresh cache (its prompt and its own output so far, as in vLLM's first request).

SuffixDecoding itself. ``arctic-inference`` publishes no binary wheel with SuffixDecoding (PyPI has the
0.3.0 sdist, whose own build needs torch, and an unrelated pure-Python 0.0.4 wheel). When
``arctic_inference.suffix_decoding`` is importable it is used as it is; otherwise the ``peer`` fixture
builds its native ``_C`` from the 0.3.0 sdist once, without torch or vLLM, and keeps the result in
``<cache_dir()>/arctic-inference-0.3.0/<interpreter>/site`` (:func:`mlx_backend.machine.user_cache.cache_dir`
as pytest found it at collection: ``$NGRAM_SPEC_CACHE_DIR`` or the user cache dir; ``built`` marks a
finished build, delete the folder to rebuild). The steps (cmake >= 3.18 and a C++20 compiler needed; anything failing skips the SuffixDecoding
benchmarks, naming the step, and ours still run)::

    # the sdist, by PyPI's simple index (PEP 691) with its sha256 checked: `pip download` would
    # prepare its metadata, which runs its setup.py (imports torch; build isolation installs torch)
    tar xzf arctic_inference-0.3.0.tar.gz -C src
    pip install --no-deps --target nanobind nanobind==2.9.2      # not into the project's environment
    PYTHONPATH=nanobind cmake -S src/arctic_inference-0.3.0/csrc/suffix_decoding -B build \\
        -DPython_EXECUTABLE=$(which python) -Dnanobind_DIR=$(PYTHONPATH=nanobind python -m nanobind --cmake_dir)
    cmake --build build -j2
    mkdir -p site/arctic_inference/suffix_decoding && cd src/arctic_inference-0.3.0/arctic_inference
    cp __init__.py site/arctic_inference/ && cp suffix_decoding/{__init__,cache}.py build/_C.*.so \\
        site/arctic_inference/suffix_decoding/
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.machinery
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
import urllib.request
from pathlib import Path

import pytest

from reference.suffix.replay import replay_request

pytest.importorskip("numba")

TRACES = Path(__file__).resolve().parents[3] / "benchmarks" / "data" / "edit-traces.jsonl.xz"
KS = [8, 16, 32, 64]
HISTORIES = ["none", "requests"]
TARGET_RATIO = 1.1  # ours over SuffixDecoding, tokens per step
LOOKUP_TARGETS = {8: 1.25, 32: 2.0}  # issue 27: suffix over lookup, tokens per step, on every repository
# vLLM's SpeculativeConfig defaults for method "suffix"
VLLM_DEFAULTS = {"max_tree_depth": 24, "max_cached_requests": 10000, "max_spec_factor": 1.0,
                 "min_token_prob": 0.1, "max_spec_offset": 0.0}
OURS = ["suffix", "auto", "lookup"]
PEERS = {"suffixdecoding_d24": 24, "suffixdecoding_d64": 64}
DRAFTERS = OURS + list(PEERS)


# ============================================================================ SuffixDecoding, built from the sdist

ARCTIC_VERSION = "0.3.0"
ARCTIC_SDIST = f"arctic_inference-{ARCTIC_VERSION}.tar.gz"
ARCTIC_SDIST_SHA256 = "7f22e3e1b1071c6061c0d6951be17c0fb50b08d06d6e543144c8f52faba60a36"  # PyPI's, 0.3.0
NANOBIND_VERSION = "2.9.2"   # the sdist's build-system pin
BUILD_TIMEOUT_S = 1800


class BuildStepFailed(Exception):
    def __init__(self, step: str, detail: str):
        super().__init__(f"{step} failed: {detail}")
        self.step, self.detail = step, detail


def _user_cache_dir() -> Path | None:
    from mlx_backend.machine.user_cache import cache_dir

    try:
        return cache_dir()
    except Exception:   # no platformdirs: arctic_root() says so when the build is wanted
        return None


# Read at collection: the repository's conftest points $NGRAM_SPEC_CACHE_DIR at a fresh temporary folder
# for the session's tests, and the build is to outlive the session.
_CACHE_DIR = _user_cache_dir()


def arctic_root() -> Path:
    """``<cache_dir()>/arctic-inference-0.3.0`` (``cache_dir()`` as it was before the session's tests
    started): the sdist, and one build per interpreter under it."""
    if _CACHE_DIR is None:
        from mlx_backend.machine.user_cache import cache_dir

        return cache_dir() / f"arctic-inference-{ARCTIC_VERSION}"   # raises what made it fail at collection
    return _CACHE_DIR / f"arctic-inference-{ARCTIC_VERSION}"


def _interpreter_tag() -> str:
    return f"{sys.implementation.cache_tag}-{platform.system().lower()}-{platform.machine().lower()}"


def _run(step: str, cmd: list[str], log: Path, env: dict | None = None, timeout: float = BUILD_TIMEOUT_S) -> str:
    """Runs ``cmd``, its output appended to ``log``; :class:`BuildStepFailed` unless it exits 0."""
    with open(log, "a") as f:
        f.write(f"\n$ {' '.join(cmd)}\n")
        f.flush()
        try:
            p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=env, timeout=timeout)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise BuildStepFailed(step, f"{type(exc).__name__}: {exc}; log {log}") from None
        f.write(p.stdout)
    if p.returncode != 0:
        last = (p.stdout.strip().splitlines() or ["no output"])[-1].strip()
        raise BuildStepFailed(step, f"exit {p.returncode} ({last[:200]}); log {log}")
    return p.stdout


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def package_index() -> str:
    """pip's index (``$PIP_INDEX_URL``, else pip's own default): where ``pip download`` would look."""
    if os.environ.get("PIP_INDEX_URL"):
        return os.environ["PIP_INDEX_URL"]
    from pip._internal.models.index import PyPI   # pip's default index, as pip itself names it

    return PyPI.simple_url


def _fetch_sdist(root: Path) -> Path:
    """The 0.3.0 sdist in ``root`` (kept there once its sha256 matches)."""
    sdist = root / ARCTIC_SDIST
    if sdist.is_file() and _sha256(sdist) == ARCTIC_SDIST_SHA256:
        return sdist
    step = f"download of {ARCTIC_SDIST} from the package index"
    try:
        simple_index = f"{package_index().rstrip('/')}/arctic-inference/"
        req = urllib.request.Request(simple_index, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            files = json.load(r)["files"]
        url = next(f["url"] for f in files if f["filename"] == ARCTIC_SDIST)
        tmp = sdist.with_suffix(".part")
        with urllib.request.urlopen(url, timeout=300) as r, open(tmp, "wb") as f:
            shutil.copyfileobj(r, f)
    except StopIteration:
        raise BuildStepFailed(step, f"{simple_index} lists no {ARCTIC_SDIST}") from None
    except (OSError, ValueError, KeyError) as exc:
        raise BuildStepFailed(step, f"{type(exc).__name__}: {exc}") from None
    got = _sha256(tmp)
    if got != ARCTIC_SDIST_SHA256:
        tmp.unlink()
        raise BuildStepFailed(step, f"sha256 {got}, expected {ARCTIC_SDIST_SHA256}")
    tmp.replace(sdist)
    return sdist


def _build(root: Path, work: Path) -> None:
    """Builds ``work / "site"`` (module docstring); ``work`` is emptied first."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    log = work / "build.log"
    sdist = _fetch_sdist(root)

    src = work / "src"
    top = f"arctic_inference-{ARCTIC_VERSION}"
    wanted = (f"{top}/csrc/suffix_decoding/", f"{top}/arctic_inference/__init__.py",
              f"{top}/arctic_inference/suffix_decoding/__init__.py", f"{top}/arctic_inference/suffix_decoding/cache.py")
    try:
        with tarfile.open(sdist) as tar:
            members = [m for m in tar.getmembers() if (m.isfile() or m.isdir()) and m.name.startswith(wanted)]
            kw = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            tar.extractall(src, members=members, **kw)
    except (OSError, tarfile.TarError) as exc:
        raise BuildStepFailed(f"unpacking {sdist}", str(exc)) from None
    pkg, csrc = src / top / "arctic_inference", src / top / "csrc" / "suffix_decoding"

    nb = work / "nanobind"
    _run(f"pip install --target of nanobind=={NANOBIND_VERSION}",
         [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
          "--target", str(nb), f"nanobind=={NANOBIND_VERSION}"], log)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(nb)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    nb_out = _run("python -m nanobind --cmake_dir", [sys.executable, "-m", "nanobind", "--cmake_dir"], log,
                  env=env, timeout=120).strip().splitlines()
    if not nb_out or not Path(nb_out[-1]).is_dir():
        raise BuildStepFailed("python -m nanobind --cmake_dir", f"no cmake folder in its output; log {log}")
    nb_cmake = nb_out[-1]

    cmake = shutil.which("cmake")
    if cmake is None:
        raise BuildStepFailed("cmake configure", "cmake is not on PATH")
    build = work / "build"
    _run("cmake configure", [cmake, "-S", str(csrc), "-B", str(build), f"-DPython_EXECUTABLE={sys.executable}",
                             f"-Dnanobind_DIR={nb_cmake}", "-DCMAKE_BUILD_TYPE=Release"], log, env=env)
    _run("cmake --build", [cmake, "--build", str(build), "-j2"], log, env=env)

    site = work / "site"
    dest = site / "arctic_inference" / "suffix_decoding"
    dest.mkdir(parents=True)
    ext = [p for p in build.iterdir() if p.name.startswith("_C.")
           and any(p.name.endswith(s) for s in importlib.machinery.EXTENSION_SUFFIXES)]
    if not ext:
        raise BuildStepFailed("cmake --build", f"no _C extension module in {build}; log {log}")
    shutil.copy2(pkg / "__init__.py", site / "arctic_inference")
    for p in (pkg / "suffix_decoding" / "__init__.py", pkg / "suffix_decoding" / "cache.py", *ext):
        shutil.copy2(p, dest)
    meta = site / f"arctic_inference-{ARCTIC_VERSION}.dist-info"   # so importlib.metadata knows the version
    meta.mkdir()
    (meta / "METADATA").write_text(f"Metadata-Version: 2.1\nName: arctic_inference\nVersion: {ARCTIC_VERSION}\n")


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive lock on ``path`` where ``fcntl`` exists (two pytest processes building at once)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def built_site() -> tuple[Path, str]:
    """``(site dir, how it came)``: the cached build of arctic-inference 0.3.0's SuffixDecoding for this
    interpreter, built first when its ``built`` marker is missing; :class:`BuildStepFailed` when a step fails."""
    try:
        root = arctic_root()
        root.mkdir(parents=True, exist_ok=True)
    except Exception as exc:
        raise BuildStepFailed("creating the cache dir", f"{type(exc).__name__}: {exc}") from None
    work = root / _interpreter_tag()
    marker = work / "built"
    with _locked(root / ".lock"):
        if marker.is_file():
            return work / "site", f"cached build in {work}"
        t0 = time.perf_counter()
        _build(root, work)
        dt = time.perf_counter() - t0
        marker.write_text(json.dumps({"python": sys.executable, "version": sys.version, "build_s": round(dt, 1)}) + "\n")
    return work / "site", f"built in {dt:.0f} s into {work}"


def native_cache_class():
    """``(SuffixDecodingCache, version)`` of an importable ``arctic_inference``, else ``(None, reason)``."""
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache
    except ImportError as exc:
        return None, f"arctic_inference.suffix_decoding is not importable ({exc})"
    try:
        from importlib.metadata import version

        v = version("arctic-inference")
    except Exception:  # built from the sdist without installing its metadata
        v = "unknown version (no package metadata)"
    return SuffixDecodingCache, v


def _forget_arctic_inference() -> None:
    """Drops an ``arctic_inference`` imported from elsewhere (e.g. the unrelated 0.0.4 wheel)."""
    for name in [m for m in sys.modules if m == "arctic_inference" or m.startswith("arctic_inference.")]:
        del sys.modules[name]
    importlib.invalidate_caches()


# ============================================================================ SuffixDecoding as a drafter


class SuffixDecodingDrafter:
    """One request of ``cache`` with the ``reset`` / ``draft`` / ``extend`` calls the replay makes, as
    vLLM's ``SuffixDecodingProposer.propose`` calls the cache (module docstring)."""

    def __init__(self, cache, req_id, depth: int, factor: float, min_prob: float):
        self.cache, self.req_id, self.depth = cache, req_id, depth
        self.factor, self.min_prob = factor, min_prob
        self.context: list[int] = []

    def reset(self, prompt):
        for rid in list(self.cache.active_requests):   # vLLM stops requests that left the batch
            self.cache.stop_request(rid)
        self.context = [int(t) for t in prompt]
        self.cache.start_request(self.req_id, self._arr(self.context))

    @staticmethod
    def _arr(tokens):
        import numpy as np

        return np.asarray(tokens, np.int32)

    def extend(self, tokens):
        tokens = [int(t) for t in tokens]
        self.context += tokens
        self.cache.add_active_response(self.req_id, tokens)

    def draft(self, k: int):
        pattern = self._arr(self.context[-self.depth:])
        d = self.cache.speculate(self.req_id, pattern, max_spec_tokens=k, max_spec_factor=self.factor,
                                 min_token_prob=self.min_prob)
        return [int(t) for t in d.token_ids]


def replay_suffix_decoding(requests, k: int, depth: int, history: str, cache_class):
    """Per-request ``RequestReplay`` of SuffixDecoding at draft length ``k`` and tree depth ``depth``."""
    d = VLLM_DEFAULTS
    shared = cache_class(max_tree_depth=depth, max_cached_requests=d["max_cached_requests"])
    out = []
    for i, (prompt, output) in enumerate(requests):
        cache = shared if history == "requests" else cache_class(max_tree_depth=depth,
                                                                 max_cached_requests=d["max_cached_requests"])
        drafter = SuffixDecodingDrafter(cache, f"req-{i}", depth, d["max_spec_factor"], d["min_token_prob"])
        out.append(replay_request(prompt, output, drafter, k))
    return out


def replay_ours(requests, name: str, k: int, history: str):
    from mlx_backend.ngram.default import make_drafter, suffix_api

    hist = suffix_api().SuffixHistory() if history == "requests" else None
    out = []
    for prompt, output in requests:
        out.append(replay_request(prompt, output, make_drafter(name, history=hist), k))
        if hist is not None:
            hist.add(prompt + output)
    return out


def figures(per_request) -> dict:
    steps = sum(r.verify_steps for r in per_request)
    tokens = sum(r.output_tokens for r in per_request)
    return {"median": round(statistics.median(r.output_tokens / r.verify_steps for r in per_request), 3),
            "pooled": round(tokens / steps, 3), "verify_steps": steps, "output_tokens": tokens,
            "accepted": sum(r.accepted for r in per_request), "drafted": sum(r.drafted for r in per_request)}


# ============================================================================ benchmarks


def cpu_model() -> str:
    """The CPU's model name, as the BLAS verdicts name it."""
    from mlx_backend.machine.blas import cpu_identity

    return cpu_identity()["model"]


@pytest.fixture(scope="module")
def requests():
    """The edit traces as token ids (``ngram-spec stats --requests``'s tokenization)."""
    if not TRACES.is_file():
        pytest.skip(f"{TRACES} is missing")
    from mlx_backend.cli.ngram import read_request_lines, tokenize_requests
    from mlx_backend.cli import UserError

    try:
        reqs, _, _ = tokenize_requests(str(TRACES), read_request_lines(str(TRACES)), None)
    except (ImportError, UserError) as exc:  # the default tokenizer needs the mlx extra and the bundled SmolLM2
        pytest.skip(f"cannot tokenize the traces with the default tokenizer: {exc}")
    return reqs


@pytest.fixture(scope="module")
def packages(requests):
    """The package (repository) of each trace, in the order of :func:`requests`."""
    from mlx_backend.cli.ngram import read_request_lines

    return [obj.get("package", "?") for _, obj in read_request_lines(str(TRACES))]


@pytest.fixture(scope="module")
def peer():
    """arctic-inference's ``SuffixDecodingCache``: the importable one, else the cached build from the 0.3.0
    sdist (built here the first time, module docstring); skips, naming the failing step, when that fails."""
    cls, version = native_cache_class()
    if cls is not None:
        yield {"cls": cls, "impl": f"arctic-inference {version} (native arctic_inference.suffix_decoding._C)"}
        return
    try:
        site, how = built_site()
    except BuildStepFailed as exc:
        pytest.skip(f"cannot build arctic-inference {ARCTIC_VERSION}'s SuffixDecoding: {exc}")
    sys.path.insert(0, str(site))
    _forget_arctic_inference()
    try:
        cls, version = native_cache_class()
        if cls is None:
            pytest.skip(f"import of the arctic-inference {ARCTIC_VERSION} build in {site} failed: {version}")
        yield {"cls": cls, "impl": f"arctic-inference {version} (native arctic_inference.suffix_decoding._C, "
                                  f"{how})"}
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(str(site))


RESULTS: dict = {}  # (drafter, history) -> {k: figures}
PER_REQUEST: dict = {}  # (drafter, history) -> {k: [RequestReplay, ...]}, ours only


def info(benchmark, **kw) -> None:
    benchmark.extra_info.update(machine=f"{os.cpu_count()} CPUs, {cpu_model()}", traces=TRACES.name, **kw)


@pytest.mark.parametrize("history", HISTORIES)
@pytest.mark.parametrize("drafter", DRAFTERS)
def test_bench_tokens_per_step(benchmark, request, requests, drafter, history):
    """Replays of ``drafter`` at every k (the benchmark's time: all four replays)."""
    peer = request.getfixturevalue("peer") if drafter in PEERS else None   # ours run without the build
    if drafter in OURS:   # numba compiles outside the clock
        replay_ours(requests[:2], drafter, 4, history)

    result, per_k = {}, {}

    def run():
        for k in KS:
            if drafter in OURS:
                per = per_k[k] = replay_ours(requests, drafter, k, history)
            else:
                per = replay_suffix_decoding(requests, k, PEERS[drafter], history, peer["cls"])
            result[k] = figures(per)

    benchmark.pedantic(run, rounds=1, iterations=1)
    RESULTS[(drafter, history)] = dict(result)
    if per_k:
        PER_REQUEST[(drafter, history)] = dict(per_k)
    kw = {"suffix_decoding_impl": peer["impl"], "vllm_defaults": VLLM_DEFAULTS,
          "max_tree_depth": PEERS[drafter]} if drafter in PEERS else {}
    info(benchmark, drafter=drafter, history=history, tokens_per_step={str(k): v for k, v in result.items()}, **kw)


def test_bench_table(benchmark, peer, capsys):
    """The side-by-side table and our ``suffix`` over SuffixDecoding (needs the replays above, same run)."""
    missing = [(d, h) for d in DRAFTERS for h in HISTORIES if (d, h) not in RESULTS]
    if missing:
        pytest.skip(f"run with test_bench_tokens_per_step in the same session (missing {missing})")
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    lines = [f"tokens per verify step per request, median / pooled; {len(RESULTS)} replays; "
             f"SuffixDecoding: {peer['impl']}"]
    ratios = {}
    for h in HISTORIES:
        lines.append(f"\nhistory {h}")
        lines.append(f"{'drafter':<20}" + "".join(f"{f'k={k}':>16}" for k in KS))
        for d in DRAFTERS:
            lines.append(f"{d:<20}" + "".join(f"{RESULTS[d, h][k]['median']:>8.2f} /{RESULTS[d, h][k]['pooled']:>6.2f}"
                                               for k in KS))
        for p in PEERS:
            for ours in ("suffix", "auto"):
                row = {k: {m: round(RESULTS[ours, h][k][m] / RESULTS[p, h][k][m], 3) for m in ("median", "pooled")}
                       for k in KS}
                ratios[f"{ours}/{p}/{h}"] = row
                lines.append(f"{ours + '/' + p.replace('suffixdecoding_', 'SD '):<20}"
                             + "".join(f"{row[k]['median']:>8.2f}x/{row[k]['pooled']:>5.2f}x" for k in KS))
    text = "\n".join(lines)
    with capsys.disabled():
        print("\n" + text)
    info(benchmark, suffix_decoding_impl=peer["impl"], target_ratio=TARGET_RATIO, ratios=ratios,
         table={f"{d}/{h}": {str(k): v for k, v in RESULTS[d, h].items()} for d in DRAFTERS for h in HISTORIES},
         table_text=text)


def test_bench_per_package(benchmark, packages, capsys):
    """``suffix`` and ``auto`` over ``lookup`` in each package (repository) of the traces, median / pooled, at
    every k: issue 27 asks for >= 1.25x at k = 8 and >= 2x at k = 32 on every repository (needs the replays
    of ours above, same run; SuffixDecoding is not needed)."""
    missing = [(d, h) for d in OURS for h in HISTORIES if (d, h) not in PER_REQUEST]
    if missing:
        pytest.skip(f"run with test_bench_tokens_per_step in the same session (missing {missing})")
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    names = sorted(set(packages))
    ratios, lines = {}, ["tokens per verify step over lookup's, per package, median / pooled"]
    for h in HISTORIES:
        for ours in ("suffix", "auto"):
            lines.append(f"\n{ours} / lookup, history {h}")
            lines.append(f"{'package':<20}{'edits':>6}" + "".join(f"{f'k={k}':>16}" for k in KS))
            below = {k: [] for k in LOOKUP_TARGETS}
            for name in names:
                rows = [i for i, p in enumerate(packages) if p == name]
                cells = {}
                for k in KS:
                    a = figures([PER_REQUEST[ours, h][k][i] for i in rows])
                    b = figures([PER_REQUEST["lookup", h][k][i] for i in rows])
                    cells[k] = {m: round(a[m] / b[m], 3) for m in ("median", "pooled")}
                    if k in LOOKUP_TARGETS and cells[k]["pooled"] < LOOKUP_TARGETS[k]:
                        below[k].append(name)
                ratios[f"{ours}/lookup/{h}/{name}"] = cells
                lines.append(f"{name:<20}{len(rows):>6}"
                             + "".join(f"{cells[k]['median']:>8.2f}x/{cells[k]['pooled']:>5.2f}x" for k in KS))
            for k, target in LOOKUP_TARGETS.items():
                lines.append(f"k={k}: pooled below {target}x in {len(below[k])} of {len(names)} packages"
                             + (f" ({', '.join(below[k])})" if below[k] else ""))
    text = "\n".join(lines)
    with capsys.disabled():
        print("\n" + text)
    info(benchmark, lookup_targets=LOOKUP_TARGETS, ratios=ratios, table_text=text)
