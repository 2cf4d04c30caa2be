"""n-gram speculation on a model sharded with ``mx.distributed`` (run under ``mlx.launch``).

The model is split by mlx-lm's own methods (:func:`shard_model`): ``model.shard(group)``, tensor
parallel (every layer's heads and MLP columns split over the ranks, an ``all_sum`` after each
attention/GatedDeltaNet block and each MLP), or ``model.model.pipeline(group)``, pipeline parallel
(each rank runs a contiguous stage of layers, hidden states go rank to rank by ``send``/``recv``
and are ``all_gather``-ed at the end so every rank computes the logits). Each rank then runs the
same generator, :func:`mlx_backend.decode.generate.ngram_speculative_generate_step`, on its shard; every
collective inside a forward pairs up because every rank runs the same forward.

Every rank must take the same decisions (prompt, drafts, accepted length, rollback), or the
ranks run forwards of different lengths and the collectives no longer match. The scheme:

* **Tokens come from rank 0.** The sampler is wrapped (:class:`Rank0Tokens`) so that the
  tokens a step emits are ``all_sum(tokens * [rank == 0])``: rank 0's draw, sent to every rank
  inside the step's own graph (one more small collective per forward, no extra synchronisation;
  plain steps stay pipelined). Each rank then compares the *same* tokens with its drafts, so the
  accepted length and the rollback ``keep(m)`` are the same everywhere. This does not rely on the
  ranks' logits being bit-identical (the ring backend makes them so, but MPI/JACCL and
  non-identical machines need not), nor on the ranks' random states: a sampled run follows rank
  0's seed.
* **Drafts are made on every rank from identical state.** The n-gram drafter is a deterministic
  function of the prompt, the emitted tokens and its cache files: the prompt is rank 0's
  (:func:`broadcast_ints`), the emitted tokens are rank 0's (above), and the cache files are
  checked to be the same on all ranks at the start (:func:`check_same`). The cost-aware policy's
  measured costs differ between ranks, so rank 0's are used everywhere. Drafting needs no
  collective at all.
* **Divergence check.** Each rank hashes everything that shapes its forwards (every proposal,
  every emitted token, per step); :meth:`ShardedRun.check` all-gathers the digests and raises
  :class:`RankDivergence` if they differ.
* **No hang.** A :class:`Watchdog` thread ends the process with a message when no forward was
  started and no token produced for ``timeout`` seconds (a rank died or its link hangs), so every
  collective wait is bounded.

Rollback on a shard: attention caches hold the rank's heads (tensor) or its layers (pipeline)
and are trimmed as usual; a GatedDeltaNet layer sharded by ``shard()`` holds its rank's heads and
conv channels, and :mod:`mlx_backend.decode.rollback`'s recording forward runs on them unchanged (the
``all_sum`` after ``out_proj`` included).
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Generator, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import make_prompt_cache

from reference.drafter import Drafter
from mlx_backend.decode.draft_policy import DEFAULT_K_MAX, DraftPolicy, measure_verify_cost
from mlx_backend.decode.generate import SpecStats, as_token_ids, ngram_speculative_generate_step, run_drafter
from mlx_backend.decode.rollback import VerifyCache, layer_replay_qualifies, set_layer_replay
from mlx_backend.decode.sampling import greedy

SHARD_MODES = ("tensor", "pipeline")
DEFAULT_TIMEOUT = 120.0   # seconds without progress before a rank gives up
WATCHDOG_EXIT = 3


def mlx_launch() -> str:
    """The path of mlx's ``mlx.launch`` for this interpreter: the one next to ``sys.executable`` first (a
    virtual environment's ``bin/``, found even when that folder is not on PATH, i.e. the environment's
    python run by its full path without activating it), else the first on PATH. FileNotFoundError, naming
    the fix, when there is none.

    ``sys.executable`` is not resolved: a venv's ``bin/python`` is a link to the base interpreter, whose
    folder holds another environment's scripts (or none).
    """
    here = Path(sys.executable).parent
    for name in ("mlx.launch", "mlx.launch.exe"):
        candidate = here / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("mlx.launch")
    if found:
        return found
    raise FileNotFoundError(
        f"mlx.launch not found next to {sys.executable} nor on PATH: it comes with the mlx package; install "
        f"it into this environment ({sys.executable} -m pip install mlx), then run {here / 'mlx.launch'} by "
        f"its full path or activate the environment")


class ShardError(ValueError):
    """The model cannot be sharded the way it was asked (architecture, mode or group size)."""


class RankDivergence(ValueError):
    """The ranks did not take the same decisions (different drafter inputs or drafts). A ValueError, as
    the usual cause is input that differs between the ranks (``--static`` / ``--dynamic`` files): the
    command line reports it in one line, ``ngram-spec generate: error: rank R disagrees with rank 0 ...``."""


def _arch(model: nn.Module) -> str:
    return getattr(model, "model_type", None) or type(model).__module__.rsplit(".", 1)[-1]


def shard_model(model: nn.Module, mode: str, group) -> nn.Module:
    """Shard ``model`` in place with mlx-lm's own method: ``model.shard(group)`` for ``"tensor"``,
    ``model.model.pipeline(group)`` for ``"pipeline"`` (the checks of ``mlx_lm.utils.sharded_load``,
    with messages naming the way out). Raises :class:`ShardError` on every rank alike."""
    import mlx_lm

    if mode not in SHARD_MODES:
        raise ShardError(f"--shard must be one of {', '.join(SHARD_MODES)}, got {mode!r}")
    arch, version = _arch(model), mlx_lm.__version__
    can = {"tensor": hasattr(model, "shard"),
           "pipeline": hasattr(getattr(model, "model", None), "pipeline")}
    if not any(can.values()):
        raise ShardError(f"mlx-lm {version} cannot shard {arch} models (no shard() or pipeline() method): "
                         f"run it on one machine, without --shard")
    if not can[mode]:
        other = next(m for m in SHARD_MODES if can[m])
        raise ShardError(f"mlx-lm {version} has no {mode}-parallel sharding for {arch} models "
                         f"({'shard()' if mode == 'tensor' else 'model.pipeline()'} is missing): "
                         f"use --shard {other}")
    try:
        if mode == "tensor":
            model.shard(group)
        else:
            model.model.pipeline(group)
        # build (not run) one forward: a split that does not fit the heads fails here, on every rank
        model(mx.zeros((1, 1), mx.uint32))
    except (AssertionError, ValueError) as exc:
        raise ShardError(f"mlx-lm's {mode}-parallel sharding of this {arch} model does not fit "
                         f"{group.size()} ranks ({exc or type(exc).__name__}): use a number of ranks that "
                         f"divides its heads and vocabulary"
                         + (", or --shard pipeline" if can["pipeline"] and mode == "tensor" else "")) from exc
    mx.eval(model.parameters())
    return model


def load_sharded(path: Optional[str], mode: str, group, dtype: Optional[str] = None):
    """``(model, tokenizer, description)`` of ``--model`` sharded over ``group``.

    An mlx-lm directory is loaded lazily (``mlx_lm.utils.load(lazy=True)``), so each rank reads
    only the weights of its shard; a GGUF file (or the default SmolLM2) is loaded whole, then sharded.
    """
    from mlx_backend.models.loading import load_model

    if path is not None and Path(path).is_dir():
        from mlx_lm.utils import load

        try:
            model, tokenizer = load(path, lazy=True)
        except (ValueError, RuntimeError) as exc:
            raise ValueError(f"--model {path}: mlx-lm cannot load this model directory: {exc}") from exc
        desc = str(path)
    else:
        model, tokenizer, desc = load_model(path, dtype)
    shard_model(model, mode, group)
    return model, tokenizer, f"{desc}, {mode}-parallel over {group.size()} ranks"


def model_fingerprint(path: Optional[str], model: nn.Module) -> list:
    """What tells two ranks' ``--model`` apart without reading every rank's whole weights: a directory's
    ``config.json`` and its weight files' names and sizes, a file's size, and the embeddings of four
    token ids (the embedding table is whole on every rank, in both sharding modes). Ranks that load
    different models (another checkpoint, quantization or fine-tune) would combine partial results of
    different weights into confident garbage, with no error (their shapes may agree)."""
    parts: list = []
    if path is not None and Path(path).is_dir():
        config = Path(path) / "config.json"
        parts.append(config.read_bytes() if config.is_file() else None)
        parts += sorted((f.name, f.stat().st_size) for f in Path(path).glob("*.safetensors"))
    elif path is not None:
        parts.append(Path(path).stat().st_size)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if embed is not None:
        n = embed.weight.shape[0]
        rows = embed(mx.array([0, 1, n // 2, n - 1])).astype(mx.float32)
        parts.append(bytes(memoryview(rows)))
    return parts


# --- collectives of the decision scheme --------------------------------------------------------

def settle() -> None:
    """Wait for the work in flight on the generation and default streams. A collective run outside
    a forward's graph must not overlap one inside it: on another stream (thread) their messages
    would interleave on the same links (mlx-lm's ``generate_step`` leaves one step in flight)."""
    mx.synchronize(generation_stream)
    mx.synchronize()


def broadcast_ints(values: Optional[list[int]], group) -> list[int]:
    """Rank 0's list of ints on every rank (two ``all_sum``: the length, then the zero-padded values)."""
    settle()
    mine = group.rank() == 0
    n = mx.distributed.all_sum(mx.array([len(values) if mine else 0], mx.int32), group=group, stream=mx.cpu)
    n = int(n.item())
    buf = mx.array(values, mx.int32) if mine else mx.zeros((n,), mx.int32)
    return mx.distributed.all_sum(buf, group=group, stream=mx.cpu).tolist() if n else []


def broadcast_floats(values: list[float], group) -> list[float]:
    """Rank 0's floats on every rank (same length on all ranks; ``x + 0.0`` is exact)."""
    settle()
    buf = mx.array(values, mx.float32) * (1.0 if group.rank() == 0 else 0.0)
    return mx.distributed.all_sum(buf, group=group, stream=mx.cpu).tolist()


def _digest_words(h) -> mx.array:
    return mx.array(list(memoryview(h.digest()).cast("I")), mx.uint32)


def _each_rank(flag: bool, group) -> list[bool]:
    """Every rank's ``flag``, in rank order, on every rank (one ``all_gather``)."""
    settle()
    return [bool(f) for f in mx.distributed.all_gather(mx.array([int(flag)], mx.int32), group=group,
                                                       stream=mx.cpu).tolist()]


def check_same(what: str, parts: list, group) -> None:
    """Raise :class:`RankDivergence` unless every rank holds the same ``parts`` (one ``all_gather``
    of a 64-bit hash; ``parts`` are ``repr``-ed, ``Path`` objects are hashed by content)."""
    h = hashlib.blake2b(digest_size=8)
    for p in parts:
        h.update(_file_digest(p) if isinstance(p, Path) else repr(p).encode())
    _gather_compare(what, h, group)


def _gather_compare(what: str, h, group) -> None:
    settle()
    words = mx.distributed.all_gather(_digest_words(h)[None], group=group, stream=mx.cpu).tolist()
    differ = [r for r, w in enumerate(words) if w != words[0]]
    if differ:
        raise RankDivergence(f"rank{'s' if len(differ) > 1 else ''} {', '.join(map(str, differ))} "
                             f"disagree{'' if len(differ) > 1 else 's'} with rank 0 on {what}")


def _file_digest(path: Path) -> bytes:
    if not path.exists():
        return b"<missing>"
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.digest()


class Rank0Tokens:
    """A sampler whose tokens are rank 0's on every rank: ``all_sum(sampler(logprobs) * [rank == 0])``.

    The collective sits in the step's graph; every rank still computes its own draw from its own
    logits (so its whole forward, collectives included, is evaluated) and multiplies it by 0.
    """

    def __init__(self, sampler: Optional[Callable[[mx.array], mx.array]], group):
        self.sampler = sampler or greedy
        self.group = group
        self.own = 1 if group.rank() == 0 else 0

    def __call__(self, logprobs: mx.array) -> mx.array:
        tokens = self.sampler(logprobs).astype(mx.uint32)
        return mx.distributed.all_sum(tokens * self.own, group=self.group)


class _HashingDrafter:
    """Pass-through :class:`reference.drafter.Drafter` that folds every proposal and every emitted token
    into ``digest``."""

    def __init__(self, drafter: Drafter, digest):
        self._drafter, self._digest = drafter, digest

    def reset(self, prompt):
        self._digest.update(b"R" + repr(list(prompt)).encode())
        self._drafter.reset(prompt)

    def extend(self, tokens):
        self._digest.update(b"E" + repr(list(tokens)).encode())
        self._drafter.extend(tokens)

    def draft(self, n):
        proposal = [int(t) for t in self._drafter.draft(n)]
        self._digest.update(b"D" + repr(proposal).encode())
        return proposal

    def __getattr__(self, name):   # c_ctx etc. of the wrapped drafter
        return getattr(self._drafter, name)


class Watchdog:
    """Ends this process (exit code 3, a one-line message on stderr) when :meth:`beat` was not
    called for ``timeout`` seconds: a collective that waits for a dead or stuck rank never returns.
    mlx's waits release the GIL, so this thread runs while the main thread is blocked in one."""

    def __init__(self, timeout: float, rank: int, prog: str = "ngram-spec"):
        if not timeout > 0:
            raise ValueError(f"the shard timeout must be > 0 seconds, got {timeout}")
        self.timeout, self.rank, self.prog = timeout, rank, prog
        self._last, self._paused = time.monotonic(), False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="ngram-spec-watchdog", daemon=True)
        self._thread.start()

    def beat(self) -> None:
        self._last = time.monotonic()

    @contextlib.contextmanager
    def paused(self):
        """The time inside is not counted: this rank's own work (reading its shard) or its caller's (between the
        tokens a generator yields), not a wait for the other ranks. A probe: a loop that paused 10 s after a token
        ended the process with "no progress ... waiting for the other ranks"."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False
            self.beat()

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout / 4)):
            if not self._paused and time.monotonic() - self._last > self.timeout:
                os.write(2, (f"{self.prog}: error: rank {self.rank}: no progress for {self.timeout:g} s "
                             f"waiting for the other ranks (one died or its link is down); exiting\n").encode())
                os._exit(WATCHDOG_EXIT)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


class _Beating:
    """The model, with a watchdog beat each time a forward is built (prefill chunks, steps)."""

    def __init__(self, model: nn.Module, watchdog: Watchdog):
        self.__dict__.update(_model=model, _watchdog=watchdog)

    def __call__(self, *args, **kwargs):
        self._watchdog.beat()
        return self._model(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._model, name)


class ShardedRun:
    """One rank's side of a sharded speculative run: the group, the watchdog and the decision scheme.

    >>> run = ShardedRun()                       # group of 1 outside mlx.launch
    >>> run.rank, run.size
    (0, 1)
    >>> run.close()
    """

    def __init__(self, group=None, timeout: float = DEFAULT_TIMEOUT):
        self.group = group if group is not None else mx.distributed.init()
        self.rank, self.size = self.group.rank(), self.group.size()
        self.watchdog = Watchdog(timeout, self.rank)
        self.digest = hashlib.blake2b(digest_size=8)

    def prompt(self, prompt) -> list[int]:
        """Rank 0's prompt token ids. A prompt that is no 1-D run of ids is the unsharded run's TypeError, on every
        rank before the collective (a probe: text gave "invalid literal for int() with base 10: 't'")."""
        self.watchdog.beat()
        ids = as_token_ids(prompt)
        return broadcast_ints(ids if self.rank == 0 else None, self.group)

    def agree(self, settings: dict) -> None:
        """Raise :class:`RankDivergence` naming the first of ``settings`` (flag -> value; a ``Path`` compared by
        content) in which a rank differs from rank 0, before any collective that depends on them: a rank with
        another --max-tokens or --no-spec would otherwise wait in a collective the others never make, and the
        first mismatched one would be blamed (a probe: --no-spec on rank 1 was reported as different cache files)."""
        self.watchdog.beat()
        for flag, value in settings.items():
            check_same(f"{flag}: give every rank the same flags", [value], self.group)

    def policy(self, model: nn.Module, gdn_path: Optional[str] = None) -> DraftPolicy:
        """The cost-aware policy on rank 0's measured costs (every rank measures, in lockstep)."""
        self.watchdog.beat()
        costs = measure_verify_cost(_Beating(model, self.watchdog), DEFAULT_K_MAX + 1, gdn_path=gdn_path)
        return DraftPolicy(broadcast_floats(list(costs), self.group))   # fixed costs: no per-rank learning

    def spec_kwargs(self, model: nn.Module, *, sampler=None, draft_max: Optional[int] = None, drafter=None,
                    c_st=None, c_dyn=None, draft_policy: Optional[DraftPolicy] = None,
                    gdn_path: Optional[str] = None) -> dict:
        """Keyword arguments for :func:`ngram_speculative_generate_step` / ``stream_generate`` on the
        shard ``model``: rank-0 tokens, the hashing drafter, the shared policy, the beating model.

        ``c_st`` / ``c_dyn`` given as file paths are checked to have the same content on all ranks
        (in-memory caches and a custom ``drafter`` must be the same on all ranks by construction).
        """
        files = [Path(c) if isinstance(c, (str, os.PathLike)) else type(c).__name__ for c in (c_st, c_dyn)]
        self.watchdog.beat()
        check_same("the n-gram cache files (--static / --dynamic): give every rank the same files", files,
                   self.group)
        check_same("the draft settings", [draft_max, gdn_path, drafter if isinstance(drafter, str) else
                                          type(drafter).__name__], self.group)
        if draft_max != 0:
            self.agree_rollback(model)
        if draft_max != 0 and (drafter is None or isinstance(drafter, str)):   # a name: lookup, suffix, auto
            drafter = run_drafter(drafter, draft_max, c_st=c_st, c_dyn=c_dyn)
        if draft_max is None and draft_policy is None:
            draft_policy = self.policy(model, gdn_path)
        return dict(model=_Beating(model, self.watchdog), sampler=Rank0Tokens(sampler, self.group),
                    drafter=_HashingDrafter(drafter, self.digest) if drafter is not None else None,
                    draft_max=draft_max, draft_policy=draft_policy, gdn_path=gdn_path)

    def agree_rollback(self, model: nn.Module) -> None:
        """Every rank takes rejected tokens back the same way (a rank re-running the model alone, or
        skipping a collective another rank runs, would leave the others waiting).

        Caches that only a replay restores (Mamba, RWKV, ...: :class:`VerifyCache` ``replayed``):
        where every rank holds some, each rank runs the layer-replay check (the same forwards on
        every rank) and the layer replay is used only if every rank qualified, else the full replay
        on all of them; where only some ranks hold them (a pipeline split), :class:`ShardError`: their
        full replay would re-run the model on those ranks alone.
        """
        self.watchdog.beat()
        probe = VerifyCache(model, make_prompt_cache(model), layer_replay=False)   # no forward
        held = bool(probe.replayed)
        probe.close()
        flags = _each_rank(held, self.group)
        if not any(flags):
            return
        if not all(flags):
            ranks = [str(r) for r, f in enumerate(flags) if f]
            raise ShardError(f"speculation on this split would wait forever: rank{'s' if len(ranks) > 1 else ''} "
                             f"{', '.join(ranks)} hold{'' if len(ranks) > 1 else 's'} recurrent layers whose caches "
                             "only a replay of the model takes back, and the other ranks hold none; use --shard "
                             "tensor, or --no-spec")
        set_layer_replay(model, all(_each_rank(layer_replay_qualifies(_Beating(model, self.watchdog)), self.group)))

    def load(self, path: Optional[str], mode: str, dtype: Optional[str] = None, prog: str = "ngram-spec"):
        """:func:`load_sharded` on every rank, then agree: if any rank failed, rank 0 prints the reason
        (its own, or which rank failed; a rank's own failure is printed by that rank) and every rank
        exits with status 2 (``SystemExit``), none is left waiting."""
        error, loaded = None, None
        try:
            with self.watchdog.paused():   # reading this rank's shard: no collective, however long it takes
                loaded = load_sharded(path, mode, self.group, dtype)
        except (ValueError, OSError) as exc:   # ShardError, unreadable files, ...
            error = exc
        self.watchdog.beat()
        settle()
        failed = mx.distributed.all_gather(mx.array([[error is not None]], mx.int32), group=self.group,
                                           stream=mx.cpu).reshape(-1).tolist()
        if not any(failed):
            check_same("the model (--model): give every rank the same model, at the same path or a copy",
                       model_fingerprint(path, loaded[0]), self.group)
            return loaded
        if self.rank == 0:
            reason = error if error is not None else (
                f"rank {', '.join(str(r) for r, f in enumerate(failed) if f)} could not load the model "
                f"(the reason is on that rank's own line, '{prog}: error: rank R: ...')")
            os.write(2, f"{prog}: error: {reason}\n".encode())
        elif error is not None and not failed[0]:
            os.write(2, f"{prog}: error: rank {self.rank}: {error}\n".encode())
        broadcast_floats([0.0], self.group)   # everything is printed before any rank exits
        raise SystemExit(2)

    def beat(self) -> None:
        self.watchdog.beat()

    def check(self) -> None:
        """Raise :class:`RankDivergence` unless every rank proposed and emitted the same tokens."""
        self.watchdog.beat()
        _gather_compare("the drafts and emitted tokens of this run", self.digest, self.group)

    def close(self) -> None:
        self.watchdog.close()


def sharded_generate_step(prompt, model: nn.Module, *, group=None, timeout: float = DEFAULT_TIMEOUT,
                          sampler=None, draft_max: Optional[int] = None, drafter=None, c_st=None, c_dyn=None,
                          draft_policy: Optional[DraftPolicy] = None, gdn_path: Optional[str] = None,
                          stats: Optional[SpecStats] = None, **kwargs
                          ) -> Generator[tuple[int, mx.array, bool], None, None]:
    """:func:`ngram_speculative_generate_step` on a sharded ``model`` (see :func:`shard_model`),
    run by every rank of ``group``; yields the same ``(token, logprobs, from_draft)`` on every rank.

    The prompt is rank 0's; tokens are rank 0's draws; drafts are made on every rank from the same
    state. When the generator ends (exhausted or closed) the ranks check that they took the same
    decisions (:class:`RankDivergence` otherwise). Any collective that waits more than ``timeout``
    seconds ends the process (:class:`Watchdog`).
    """
    run = ShardedRun(group, timeout)
    try:
        ids = run.prompt(prompt)
        spec = run.spec_kwargs(model, sampler=sampler, draft_max=draft_max, drafter=drafter, c_st=c_st,
                               c_dyn=c_dyn, draft_policy=draft_policy, gdn_path=gdn_path)
        steps = ngram_speculative_generate_step(mx.array(ids), spec.pop("model"), stats=stats, **spec, **kwargs)
        try:
            for out in steps:
                run.beat()
                with run.watchdog.paused():   # the caller's time between tokens is not a wait for the other ranks
                    yield out
        except GeneratorExit:
            steps.close()
            run.check()
            raise
        run.check()
    finally:
        run.close()


def cli_run(timeout: float = DEFAULT_TIMEOUT) -> ShardedRun:
    """The :class:`ShardedRun` of ``ngram-spec generate --shard``. Only rank 0 prints: the other
    ranks' ``sys.stdout`` and ``sys.stderr`` go to ``os.devnull`` (the watchdog and
    :meth:`ShardedRun.load` write their messages to file descriptor 2 directly). A process alone
    (not started by ``mlx.launch``, or ``-n 1``) is refused: it would run the whole model unsharded. So is a
    launch whose ranks ``mx.distributed.init()`` cannot join (``mlx.launch -n 1`` of mlx 0.32 writes a host file
    holding only a newline, which init refuses with a JSON parse error)."""
    fix = ("run it as mlx.launch -n 2 --backend ring -- ngram-spec generate ... --shard tensor (docs/distributed.md), "
           "or drop --shard")
    try:
        group = mx.distributed.init()
    except RuntimeError as exc:
        raise ValueError(f"--shard: mx.distributed.init() could not join the ranks of this launch ({exc}): "
                         f"{fix}") from None
    if group.size() == 1:
        raise ValueError(f"--shard splits the model over the ranks that mlx.launch starts, and this process is "
                         f"alone: {fix}")
    if group.rank() != 0:   # silenced first, so that a bad timeout is reported once
        sys.stdout = open(os.devnull, "w")
        sys.stderr = open(os.devnull, "w")
    return ShardedRun(group, timeout)

