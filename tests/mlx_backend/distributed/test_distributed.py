"""Speculation on a model sharded over 2 local ranks (``mlx.launch -n 2 --backend ring``).

Truth: the single-process runs of the same tiny mlx-lm model (mlx-lm's plain greedy
``generate_step``, and our speculative sampler run with the same seed), computed inside each
launch by :mod:`tests.dist_worker` before the model is sharded. Greedy speculative output on the
shards must equal plain greedy output for draft lengths 0..8 (a difference only at a proven
near-tie), every rank must emit the same tokens, and sampled runs must give rank 0's tokens on every
rank whatever the other ranks' seeds. ``mlx.launch`` exits 0 even when a rank fails (it only prints
``[WARN] Node with rank R exited with code C`` on stderr), so :func:`launch` runs it with ``--verbose``
and checks the exit status it reports for every rank (``Node with rank R completed`` for 0): a rank that
died fails the test even where rank 0 wrote its result; the tests also read the worker's JSON, and show
the launch's output when it is missing.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import child_processes
import pytest

from mlx_backend.distributed import sharded as distributed
from mlx_backend.distributed.sharded import WATCHDOG_EXIT, ShardError, mlx_launch, shard_model
from mlx_backend.models.tiny import tiny_model

ROOT = Path(__file__).resolve().parents[3]
NEAR_TIE = 1e-3   # top-2 log-probability gap under which greedy may legitimately part (float32)
LAUNCH_TIMEOUT = 900


# mlx.launch's own report of each rank's end (mlx._distributed_utils.launch; "completed" with --verbose only)
RING_RETRY = re.compile(r"\(error: \d+ \)\s*$")   # the ring backend's "waiting 1000 ms (error: 111 )"
RANK_END = re.compile(r"Node with rank (\d+) (completed|exited with code (-?\d+)|was killed)")


def rank_exits(stderr: str) -> dict[int, int | str]:
    """``{rank: exit status}`` as ``mlx.launch --verbose`` reports them on stderr (0: completed, a negative
    status: killed by that signal, ``"killed"``: terminated by the launcher)."""
    exits = {}
    for m in RANK_END.finditer(stderr):
        exits[int(m[1])] = 0 if m[2] == "completed" else "killed" if m[2] == "was killed" else int(m[3])
    return exits


def launch(args: list[str], tmp_path: Path, timeout: int = LAUNCH_TIMEOUT, check: bool = True
           ) -> subprocess.CompletedProcess:
    """``mlx.launch --verbose -n 2 --backend ring -- <python> args`` from the repository root, with this
    interpreter's ``mlx.launch`` (:func:`mlx_backend.distributed.sharded.mlx_launch`). ``check``: fail unless
    every rank exited with status 0 (``mlx.launch`` itself exits 0 either way). A timeout (or an exception) kills
    the ranks too, not the launcher alone (:func:`child_processes.run`). The launcher relays each rank's output
    in the pieces the rank wrote, so a rank's script writes each line whole (``sys.stdout.write(line + "\\n")``):
    under ``PYTHONUNBUFFERED=1`` a ``print`` writes its arguments, spaces and newline apart, and the other
    rank's line can land between them (seen in CI: "rankrank 1 refused: ...")."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = child_processes.run([mlx_launch(), "--verbose", "-n", "2", "--backend", "ring", "--starting-port",
                                str(_free_port_pair()), "--", sys.executable, *args],
                               cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if check:
        check_ranks(proc)
    return proc


def refused_lines(proc: subprocess.CompletedProcess) -> list[str]:
    """The ``error:`` lines of a launch that every rank must have refused: each rank exited non-zero (status
    2, or the launcher's SIGTERM when the other rank ended first), and no traceback was printed. The "[ring] ..."
    lines are the ring backend's connection log (on with --verbose: "(error: 111 )" is a retry; the two ranks'
    logs can interleave mid-line, leaving " ms (error: 111 )" on a line of its own)."""
    exits = rank_exits(proc.stderr)
    assert sorted(exits) == [0, 1] and 0 not in exits.values(), proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    return [line for line in proc.stderr.splitlines()
            if "error:" in line and not line.startswith("[ring] ") and not RING_RETRY.search(line)]


def _free_port_pair() -> int:
    """A port p with p and p + 1 free (the ring's two ranks listen there): mlx.launch's default, 32323 for
    every launch, lets two test sessions on one machine join each other's rings (seen: 'rank 1 could not load
    the model' with no reason, from a rank of another session's launch)."""
    for _ in range(100):
        base = _free_ports(1)[0]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", base + 1))
            return base
        except OSError:
            continue
    raise RuntimeError("no two consecutive free ports")


def check_ranks(proc: subprocess.CompletedProcess) -> None:
    """Fail unless ``mlx.launch --verbose`` reported both ranks completed (exit status 0)."""
    assert rank_exits(proc.stderr) == {0: 0, 1: 0}, \
        f"a rank failed (mlx.launch exited {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


def _script(folder: Path, name: str = "mlx.launch") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text("#!/bin/sh\n")
    (folder / name).chmod(0o755)
    return folder / name


def test_mlx_launch_is_found_next_to_the_interpreter(monkeypatch, tmp_path):
    """A venv's python run by its full path, its bin/ not on PATH (another mlx.launch is): the venv's own."""
    venv = _script(tmp_path / "venv" / "bin")
    monkeypatch.setattr(distributed.sys, "executable", str(venv.parent / "python"))
    monkeypatch.setenv("PATH", str(_script(tmp_path / "elsewhere").parent))
    assert mlx_launch() == str(venv)
    monkeypatch.undo()
    if (Path(sys.executable).parent / "mlx.launch").is_file():   # this environment's, with an empty PATH
        monkeypatch.setenv("PATH", "")
        assert mlx_launch() == str(Path(sys.executable).parent / "mlx.launch")


def test_mlx_launch_falls_back_to_path_then_names_the_fix(monkeypatch, tmp_path):
    monkeypatch.setattr(distributed.sys, "executable", str(tmp_path / "venv" / "bin" / "python"))
    elsewhere = _script(tmp_path / "elsewhere")
    monkeypatch.setenv("PATH", str(elsewhere.parent))
    assert mlx_launch() == str(elsewhere)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError, match=r"mlx.launch not found next to .*venv/bin/python nor on PATH: .*"
                                                r"-m pip install mlx.*by its full path or activate the environment"):
        mlx_launch()


def test_a_dead_rank_fails_the_launch_check(tmp_path):
    """``mlx.launch`` exits 0 when a rank is killed (what docs/distributed.md tells users to look for
    instead), and a killed rank fails :func:`launch`'s check even though rank 0 wrote its result."""
    out = tmp_path / "result.txt"
    script = textwrap.dedent(f"""
        import os, signal
        import mlx.core as mx
        group = mx.distributed.init()
        if group.rank() == 0:
            open({str(out)!r}, "w").write("done")
        mx.eval(mx.distributed.all_sum(mx.array([1]), group=group, stream=mx.cpu))
        if group.rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = launch(["-c", script], tmp_path, timeout=300, check=False)
    assert out.read_text() == "done"
    assert proc.returncode == 0, "mlx.launch now reports a dead rank: update docs/distributed.md"
    assert rank_exits(proc.stderr)[1] == -signal.SIGKILL, proc.stderr
    with pytest.raises(AssertionError, match="a rank failed"):
        check_ranks(proc)


def first_divergence(truth: list[int], gaps: list[float], tokens: list[int]) -> int | None:
    """Index where ``tokens`` leaves ``truth`` (None if equal); a divergence must be a near-tie."""
    assert len(tokens) == len(truth), (truth, tokens)
    for i, (a, b) in enumerate(zip(truth, tokens)):
        if a != b:
            assert gaps[i] < NEAR_TIE, f"token {i}: plain {a} != {b} with top-2 gap {gaps[i]:.3g}"
            return i
    return None


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next", "llama"])
def test_sharded_speculation_equals_plain(arch, tmp_path):
    out = tmp_path / "result.json"
    proc = launch(["tests/mlx_backend/distributed/dist_worker.py", arch, str(out)], tmp_path)
    assert out.exists(), f"the launch wrote no result:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    data = json.loads(out.read_text())
    assert data["size"] == 2
    modes = {"qwen3_5": ["tensor", "pipeline"], "qwen3_next": ["pipeline"], "llama": ["tensor"]}[arch]
    assert [r["mode"] for r in data["results"]] == modes
    for r in data["results"]:
        where = f"{arch} {r['mode']}"
        truth, gaps = r["truth"], r["top2_gap"]
        # the fact behind "every rank computes the same logits" on the ring backend
        assert len(set(r["logits_bits_per_rank"])) == 1, f"{where}: ranks computed different logits"
        first_divergence(truth, gaps, r["sharded_plain"])
        runs = {run["name"]: run for run in r["runs"]}
        for k in range(9):
            run = runs[f"greedy k={k}"]
            assert len(set(run["tokens_per_rank"])) == 1, f"{where} k={k}: ranks emitted different tokens"
            first_divergence(truth, gaps, run["tokens"])
            if k == 0:
                assert run["n_drafted"] == 0
            else:   # the scripted drafter makes some drafts right and some wrong
                assert 0 < run["n_accept"] < run["n_drafted"], f"{where} k={k}: {run}"
                assert run["steps"] < len(truth)
        replay = runs["greedy k=4, gdn_path=replay"]
        assert len(set(replay["tokens_per_rank"])) == 1 and 0 < replay["n_accept"] < replay["n_drafted"]
        first_divergence(truth, gaps, replay["tokens"])
        if r["mode"] == modes[0]:
            run = runs["greedy policy, n-gram drafter"]
            assert len(set(run["tokens_per_rank"])) == 1
            first_divergence(truth, gaps, run["tokens"])
        same, other = runs["sampled, same seed on all ranks"], runs["sampled, other seeds on ranks > 0"]
        assert len(set(same["tokens_per_rank"])) == 1 and len(set(other["tokens_per_rank"])) == 1
        # the drafter offers greedy's tokens: a sampled run accepts them only while it follows greedy, which
        # depends on the draw (tiny llama leaves greedy at its first sampled token); drafts must be verified
        assert same["n_accept"] < same["n_drafted"], f"{where}: {same}"
        if arch != "llama":
            assert same["n_accept"] > 0, f"{where}: {same}"
        # rank 0's seed decides: equal to the single-process speculative run with that seed
        assert same["tokens"] == r["ref_sampled"], where
        assert other["tokens"] == r["ref_sampled"], where


@pytest.mark.slow
@pytest.mark.parametrize("arch, mode, force, layer_replay", [
    ("kimi_k3", "pipeline", "none", True),
    ("kimi_k3", "tensor", "rank1-differs", False),
    ("bailing_hybrid", "pipeline", "rank1-differs", False),
])
def test_ranks_roll_replayed_layers_back_the_same_way(arch, mode, force, layer_replay, tmp_path):
    """Recurrent layers that only a replay restores (kimi_k3's and bailing_hybrid's linear attention), on
    shards. The ranks run the layer-replay check in lockstep and agree on one verdict: where rank 1's check
    finds other caches, every rank takes the full replay (before: rank 0 cut its caches alone while rank 1
    re-ran the model and waited on collectives rank 0 never joined: the ring connection lost). On a pipeline
    split that qualifies, every rank re-runs its own layers (before: the check left the pipeline's receive
    unevaluated and the ranks waited for each other until the watchdog ended them). Output equals the
    shards' plain greedy with drafts partly accepted."""
    proc = launch(["tests/mlx_backend/distributed/replay_worker.py", arch, mode, force], tmp_path, timeout=600)
    rows = sorted((json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")),
                  key=lambda r: r["rank"])
    assert [r["rank"] for r in rows] == [0, 1], proc.stdout + proc.stderr
    for r in rows:
        assert r["equal"] and 0 < r["n_accept"] < r["n_drafted"], r
        assert r["layer_replay"] is layer_replay, r


def test_a_split_with_replayed_layers_on_some_ranks_only_is_refused(tmp_path):
    """Rank 1 holding Mamba layers and rank 0 none (as a pipeline split can): rank 1's full replay would re-run
    the model alone and wait forever for rank 0. Refused on both ranks, before any forward, naming the fix."""
    script = textwrap.dedent("""
        import sys
        import mlx.core as mx
        from mlx_backend.distributed.sharded import ShardError, ShardedRun
        from mlx_backend.models.compat import build
        run = ShardedRun()
        model = build("llama" if run.rank == 0 else "mamba", seed=1)
        try:
            run.agree_rollback(model)
            sys.stdout.write(f"rank {run.rank} agreed\\n")
        except ShardError as exc:
            sys.stdout.write(f"rank {run.rank} refused: {exc}\\n")
        run.close()
    """)
    proc = launch(["-c", script], tmp_path, timeout=300)
    for rank in (0, 1):
        assert (f"rank {rank} refused: speculation on this split would wait forever: rank 1 holds recurrent "
                "layers whose caches only a replay of the model takes back, and the other ranks hold none; use "
                "--shard tensor, or --no-spec") in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.parametrize("arch, mode, message", [
    ("qwen3_next", "tensor", "no tensor-parallel sharding for qwen3_next models .*use --shard pipeline"),
    ("llama", "pipeline", "no pipeline-parallel sharding for llama models .*use --shard tensor"),
    ("qwen3_5", "sideways", "--shard must be one of tensor, pipeline"),
])
def test_shard_mismatch_is_refused(arch, mode, message):
    import mlx.core as mx

    with pytest.raises(ShardError, match=message):
        shard_model(tiny_model(arch), mode, mx.distributed.init())


def test_architecture_mlx_lm_cannot_shard_is_refused():
    import mlx.core as mx
    import mlx.nn as nn

    class Unshardable(nn.Module):
        model_type = "toy"

    with pytest.raises(ShardError, match="cannot shard toy models .*without --shard"):
        shard_model(Unshardable(), "tensor", mx.distributed.init())


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def test_a_stuck_rank_does_not_hang_the_others(tmp_path):
    """Two ring ranks started by hand (no launcher to kill the survivor): rank 1 joins the group and
    then never takes part; rank 0's watchdog must end it with a message instead of waiting forever."""
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in _free_ports(2)]))
    script = textwrap.dedent("""
        import sys, time
        import mlx.core as mx
        from mlx_backend.distributed.sharded import sharded_generate_step
        from mlx_backend.models.tiny import tiny_model
        group = mx.distributed.init(strict=True, backend="ring")
        if group.rank() == 1:
            time.sleep(60)
        list(sharded_generate_step([1, 2, 3], tiny_model("llama"), group=group, timeout=2, max_tokens=4, draft_max=2))
    """)
    env = dict(os.environ, PYTHONPATH=str(ROOT), MLX_HOSTFILE=str(hostfile))
    procs = [subprocess.Popen([sys.executable, "-c", script], env=dict(env, MLX_RANK=str(r)), cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        t0 = time.monotonic()
        _, err = procs[0].communicate(timeout=120)
        assert procs[0].returncode == WATCHDOG_EXIT, err
        assert "rank 0: no progress for 2 s waiting for the other ranks" in err
        assert time.monotonic() - t0 < 60
    finally:
        for p in procs:
            p.kill()
            p.communicate()


@pytest.mark.slow
def test_cli_shard_prints_once_and_equals_plain(tmp_path):
    """``ngram-spec generate --shard`` on 2 ranks: one JSON record (rank 0's), the tokens of the
    single-process plain run; a --shard that does not fit the model: one message, every rank exits."""
    model = tmp_path / "tiny"
    subprocess.run([sys.executable, "-m", "mlx_backend.cli", "tiny-model", "--arch", "qwen3_5", "--out", str(model)],
                   cwd=ROOT, check=True, capture_output=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    prompt = ["--prompt", "ab ab ab ab ab ab ab ab", "--max-tokens", "12", "--json"]
    plain = subprocess.run([sys.executable, "-m", "mlx_backend.cli", "generate", "--model", str(model), "--no-spec",
                            *prompt], cwd=ROOT, check=True, capture_output=True, text=True,
                           env=dict(os.environ, PYTHONPATH=str(ROOT)))
    proc = launch(["-m", "mlx_backend.cli", "generate", "--model", str(model), "--shard", "pipeline",
                   "--draft-max", "3", *prompt], tmp_path)
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(records) == 1, proc.stdout + proc.stderr
    assert records[0]["tokens"] == json.loads(plain.stdout)["tokens"]
    assert "pipeline-parallel over 2 ranks" in records[0]["model"]

    llama = tmp_path / "llama"
    subprocess.run([sys.executable, "-m", "mlx_backend.cli", "tiny-model", "--arch", "llama", "--out", str(llama)],
                   cwd=ROOT, check=True, capture_output=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    proc = launch(["-m", "mlx_backend.cli", "generate", "--model", str(llama), "--shard", "pipeline", *prompt],
                  tmp_path, timeout=300, check=False)
    errors = refused_lines(proc)
    assert len(errors) == 1, proc.stderr
    assert errors[0].startswith("ngram-spec generate: error: mlx-lm ")
    assert errors[0].endswith("has no pipeline-parallel sharding for llama models (model.pipeline() is missing): "
                              "use --shard tensor")


@pytest.mark.slow
def test_ranks_with_different_cache_files_are_stopped(tmp_path):
    """The start-of-run check: rank 1 holding another --static file than rank 0 is refused on both
    ranks (the drafts, and so the forward lengths, would differ)."""
    for rank in (0, 1):
        (tmp_path / f"static-{rank}.bin").write_bytes(bytes([rank]) * 16)
    script = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        import mlx.core as mx
        from mlx_backend.distributed.sharded import RankDivergence, check_same
        group = mx.distributed.init()
        try:
            check_same("the n-gram cache files", [Path({str(tmp_path)!r}) / f"static-{{group.rank()}}.bin"], group)
            sys.stdout.write(f"rank {{group.rank()}} agreed\\n")
        except RankDivergence as exc:
            sys.stdout.write(f"rank {{group.rank()}} refused: {{exc}}\\n")
    """)
    proc = launch(["-c", script], tmp_path, timeout=300)
    for rank in (0, 1):
        assert f"rank {rank} refused: rank 1 disagrees with rank 0 on the n-gram cache files" in proc.stdout, \
            proc.stdout + proc.stderr


def _tiny_model_and_prompt(tmp_path: Path) -> tuple[Path, Path]:
    model = tmp_path / "tiny"
    subprocess.run([sys.executable, "-m", "mlx_backend.cli", "tiny-model", "--arch", "qwen3_5", "--out", str(model)],
                   cwd=ROOT, check=True, capture_output=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    prompt = tmp_path / "prompt.i32"
    prompt.write_bytes(bytes(b for t in range(5, 25) for b in t.to_bytes(4, "little")))
    return model, prompt


def test_cli_shard_cost_line_and_blas_note_are_rank_0s(tmp_path):
    """The cost-aware draft length on 2 ranks: the stderr line names the costs the run used (rank 0's,
    measured on the shards, kept nowhere), and the BLAS re-run note comes from rank 0 alone. Before:
    the line said the costs were not known yet and would be learned and kept in step-costs.json, and
    each rank printed its own ``[blas] re-running ...``."""
    model, prompt = _tiny_model_and_prompt(tmp_path)
    proc = launch(["-m", "mlx_backend.cli", "generate", "--model", str(model), "--shard", "tensor",
                   "--prompt-tokens", str(prompt), "--max-tokens", "4", "--json"], tmp_path, timeout=300)
    assert proc.stderr.count("[blas] re-running") <= 1, proc.stderr
    costs = [line for line in proc.stderr.splitlines() if line.startswith("[generate] draft length:")]
    assert len(costs) == 1, proc.stderr
    assert costs[0].startswith("[generate] draft length: cost-aware; verify cost c(S)/c(1), S = 1..65: 1.00 ")
    assert costs[0].endswith("(rank 0's, measured on the shards before generating; --shard keeps no costs "
                             "for later runs)")


def test_cli_model_missing_on_one_rank_is_named(tmp_path):
    """``--model`` missing on rank 1 only: rank 1 prints its reason, rank 0 names rank 1 and points at
    that line (which the launcher may print before or after rank 0's), every rank exits non-zero (status 2,
    or the launcher's SIGTERM when the other rank ended first)."""
    model, prompt = _tiny_model_and_prompt(tmp_path)
    script = textwrap.dedent(f"""
        import os, sys
        from mlx_backend.cli import main
        model = {str(model)!r} + ("" if os.environ["MLX_RANK"] == "0" else "-missing")
        sys.exit(main(["generate", "--model", model, "--shard", "tensor", "--prompt-tokens", {str(prompt)!r},
                       "--max-tokens", "2"]))
    """)
    proc = launch(["-c", script], tmp_path, timeout=300, check=False)
    errors = sorted(refused_lines(proc))
    assert errors == [
        "ngram-spec generate: error: rank 1 could not load the model (the reason is on that rank's own line, "
        "'ngram-spec generate: error: rank R: ...')",
        f"ngram-spec generate: error: rank 1: --model {model}-missing: not a .gguf file or an mlx-lm model directory",
    ], proc.stderr


def test_cli_seed_gives_the_single_process_text_when_sharded(tmp_path):
    """A sampled run with --seed: the same tokens tensor-parallel as in one process (its logits differ from
    one process's by ~1e-6, far below the gaps the sampler's Gumbel noise leaves here). Before: the seed was
    set before loading, and the layers mlx-lm's shard() builds drew from the random state, so the sharded run
    sampled another text than the one-process run."""
    model, prompt = _tiny_model_and_prompt(tmp_path)
    args = ["-m", "mlx_backend.cli", "generate", "--model", str(model), "--prompt-tokens", str(prompt),
            "--max-tokens", "16", "--temp", "0.8", "--seed", "3", "--json"]
    alone = subprocess.run([sys.executable, *args], cwd=ROOT, check=True, capture_output=True, text=True,
                           env=dict(os.environ, PYTHONPATH=str(ROOT)))
    proc = launch([*args, "--shard", "tensor"], tmp_path, timeout=300)
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(records) == 1, proc.stdout + proc.stderr
    assert records[0]["tokens"] == json.loads(alone.stdout)["tokens"]


def test_cli_ranks_with_different_static_files_get_one_line(tmp_path):
    """``--static`` holding other n-grams on rank 1: refused by the start-of-run check in one line naming
    the fix, no traceback. Before: RankDivergence was a RuntimeError, shown as a traceback."""
    model, prompt = _tiny_model_and_prompt(tmp_path)
    for rank in (0, 1):
        corpus = tmp_path / f"corpus{rank}.i32"
        corpus.write_bytes(bytes(b for t in range(5 + 30 * rank, 25 + 30 * rank) for b in t.to_bytes(4, "little")))
        subprocess.run([sys.executable, "-m", "mlx_backend.cli", "create", str(corpus), "-o",
                        str(tmp_path / f"static{rank}.bin")], cwd=ROOT, check=True, capture_output=True,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    script = textwrap.dedent(f"""
        import os, sys
        from mlx_backend.cli import main
        static = {str(tmp_path)!r} + f"/static{{os.environ['MLX_RANK']}}.bin"
        sys.exit(main(["generate", "--model", {str(model)!r}, "--shard", "tensor", "--static", static,
                       "--prompt-tokens", {str(prompt)!r}, "--max-tokens", "2", "--draft-max", "2"]))
    """)
    proc = launch(["-c", script], tmp_path, timeout=300, check=False)
    errors = refused_lines(proc)
    assert errors == ["ngram-spec generate: error: rank 1 disagrees with rank 0 on --static: give every rank the "
                      "same flags"], proc.stderr


@pytest.mark.parametrize("rank1, flag", [(["--max-tokens", "3"], "--max-tokens"), (["--no-spec"], "--no-spec"),
                                         (["--draft-max", "3"], "--draft-max")])
def test_cli_ranks_with_different_flags_get_one_line_naming_the_flag(tmp_path, rank1, flag):
    """A probe gave rank 1 other flags: --draft-max said only "the draft settings", --no-spec was blamed on cache
    files no rank was given, and --max-tokens ended in a "[ring] connection to a peer was lost" traceback or a
    wrong divergence message. The flags are compared after loading, each by name."""
    model, prompt = _tiny_model_and_prompt(tmp_path)
    script = textwrap.dedent(f"""
        import os, sys
        from mlx_backend.cli import main
        extra = {rank1!r} if os.environ["MLX_RANK"] == "1" else []
        sys.exit(main(["generate", "--model", {str(model)!r}, "--shard", "tensor", "--prompt-tokens", {str(prompt)!r},
                       "--max-tokens", "2", *extra]))   # the last --max-tokens counts
    """)
    proc = launch(["-c", script], tmp_path, timeout=300, check=False)
    assert refused_lines(proc) == [f"ngram-spec generate: error: rank 1 disagrees with rank 0 on {flag}: give every "
                                   f"rank the same flags"], proc.stderr


def test_cli_ranks_with_different_models_get_one_line(tmp_path):
    """Rank 1 loading another model of the same shapes (a tiny qwen3_5 of another seed: the same config and
    file sizes, other weights, as a fine-tune would be): refused at load in one line naming the fix. Before:
    the run went on, each all_sum adding partial results of different weights, and printed garbage."""
    model, prompt = _tiny_model_and_prompt(tmp_path)
    other = tmp_path / "tiny-seed-1"
    subprocess.run([sys.executable, "-m", "mlx_backend.cli", "tiny-model", "--arch", "qwen3_5", "--seed", "1", "--out",
                    str(other)], cwd=ROOT, check=True, capture_output=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    script = textwrap.dedent(f"""
        import os, sys
        from mlx_backend.cli import main
        model = {str(model)!r} if os.environ["MLX_RANK"] == "0" else {str(other)!r}
        sys.exit(main(["generate", "--model", model, "--shard", "tensor", "--prompt-tokens", {str(prompt)!r},
                       "--max-tokens", "2"]))
    """)
    proc = launch(["-c", script], tmp_path, timeout=300, check=False)
    errors = refused_lines(proc)
    assert errors == ["ngram-spec generate: error: rank 1 disagrees with rank 0 on the model (--model): give every "
                      "rank the same model, at the same path or a copy"], proc.stderr


def test_the_ranks_digest_covers_every_proposal_not_only_the_emitted_tokens():
    """The end-of-run divergence check compares one digest per rank. Emitted tokens are rank 0's on every rank,
    so a rank whose drafter proposes other tokens (and so runs forwards of other lengths) shows only in its
    proposals: two ranks that saw the same prompt and tokens but proposed differently must hash differently,
    and ranks that did the same must hash the same. The proposals pass through unchanged."""
    import hashlib

    class Scripted:
        def __init__(self, proposals):
            self.proposals = list(proposals)

        def reset(self, prompt):
            pass

        def extend(self, tokens):
            pass

        def draft(self, n):
            return self.proposals.pop(0)[:n]

    def digest(proposals):
        h = hashlib.blake2b(digest_size=8)
        drafter = distributed._HashingDrafter(Scripted(proposals), h)
        drafter.reset([5, 6, 7])
        seen = []
        for _ in proposals:
            seen.append(drafter.draft(3))
            drafter.extend([1, 2])
        return h.digest(), seen

    same, seen = digest([[1, 2, 3], [4]])
    assert seen == [[1, 2, 3], [4]]
    assert digest([[1, 2, 3], [4]])[0] == same
    assert digest([[1, 2, 9], [4]])[0] != same and digest([[1, 2, 3], []])[0] != same


def test_a_caller_slower_than_the_timeout_between_tokens_is_not_a_dead_rank(tmp_path):
    """A probe's loop over sharded_generate_step paused 10 s after a token with a 5 s timeout: the watchdog
    counted the pause and ended the process ("no progress ... waiting for the other ranks", exit 3). The time
    the generator waits at its yield is now not counted: both ranks pause 3 s with a 1 s timeout and finish."""
    script = textwrap.dedent("""
        import sys, time
        import mlx.core as mx
        from mlx_backend.distributed.sharded import shard_model, sharded_generate_step
        from mlx_backend.models.tiny import tiny_model
        group = mx.distributed.init()
        model = shard_model(tiny_model("qwen3_5", vocab_size=64, seed=1), "tensor", group)
        tokens = []
        for token, _, _ in sharded_generate_step([5, 6, 7, 5, 6, 7], model, max_tokens=6, group=group, timeout=1,
                                                  draft_max=2):
            tokens.append(int(token))
            if len(tokens) == 2:
                time.sleep(3)
        sys.stdout.write(f"rank {group.rank()} tokens {tokens}\\n")
    """)
    proc = launch(["-c", script], tmp_path, timeout=300)
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("rank "))
    assert len(lines) == 2 and lines[0].split(" tokens ")[1] == lines[1].split(" tokens ")[1], proc.stdout


def test_a_prompt_that_is_no_run_of_ids_is_the_unsharded_type_error():
    """A probe: sharded_generate_step("the cat", ...) raised "invalid literal for int() with base 10: 't'" and a 2-D
    array "int() argument must be ..."; the unsharded run names the problem. Checked on every rank, here a
    group of one."""
    import mlx.core as mx

    from mlx_backend.distributed.sharded import ShardedRun

    run = ShardedRun()
    try:
        for prompt, got in (("the cat", "str"), (mx.array([[1, 2, 3]]), "an array of shape")):
            with pytest.raises(TypeError, match=f"the prompt must be a 1-D sequence of integer token ids, got {got}"):
                run.prompt(prompt)
        assert run.prompt(mx.array([4, 5])) == [4, 5]
    finally:
        run.close()
