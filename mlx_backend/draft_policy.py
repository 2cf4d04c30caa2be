"""Cost-aware draft length: draft only as many tokens as pay off on this model and machine.

A verify forward over ``S = n + 1`` tokens costs ``c(S)`` (measured once per model and machine
by :func:`measure_verify_cost`, kept in memory and optionally in a JSON file). With ``a_i`` the
probability that draft token i is accepted given that tokens 1..i-1 were, drafting n tokens
yields on average

    E(n) = 1 + sum_{j=1..n} prod_{i<=j} a_i          tokens per forward,

so the policy drafts the ``n`` (at most the drafter's proposal length) that maximises the token
rate ``E(n) / c(n + 1)``; ``n = 0`` (a plain step) whenever no draft length beats ``1 / c(1)``.

``n = 0`` means plain decoding, which the generator pipelines like mlx-lm's ``generate_step``
(the next one-token step is built while the current one runs), so it is valued at the measured
pipelined cost ``c_p`` (``c(1)`` times :func:`measure_pipelining`) rather than ``c(1)``. While pipelined, the
token in flight is not known yet, so a proposal ``P`` made before it guesses that token with
``P[0]``; leaving plain mode to verify ``P[1..n]`` next yields on average (``P[0]`` right with
probability ``a_1``)

    E(n + 1) - a_1 = 1 + sum_{j=2..n+1} prod_{i<=j} a_i      tokens, in time c(n + 1),

and costs the pipeline: the first plain step after it is built while the device waits, ``c(1)``
instead of ``c_p``. The generator leaves plain mode (:meth:`DraftPolicy.leave_plain`) when for some n

    E(n + 1) - a_1 > (c(n + 1) + c(1) - c_p) / c_p,

the tokens plain mode would have produced in that time.

``a_i`` is an exponentially weighted moving average (weight ``alpha``) updated from *every*
proposal of the drafter, verified or not: a proposal made before position t is compared with
the tokens the model then emits at t+1, t+2, ... (for verified drafts this is the verification
itself; for drafts the policy did not verify, the later output tells the same thing). The policy
therefore keeps learning while it drafts nothing, and starts drafting when acceptance rises.

>>> policy = DraftPolicy([1.0, 1.1, 1.2, 1.3], prior=0.9)   # verify of 2..4 tokens nearly free
>>> policy.choose(3)
3
>>> flat = DraftPolicy([1.0, 2.0, 3.0, 4.0], prior=0.9)     # every extra row costs a full row
>>> flat.choose(3)
0
>>> policy.leave_plain(3), DraftPolicy([1.0, 1.1, 1.2, 1.3], prior=0.3).leave_plain(3)
(True, False)
"""
from __future__ import annotations

import json
import os
import platform
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from mlx_backend.rollback import VerifyCache

DEFAULT_K_MAX = 8
_COSTS: dict[str, list[float]] = {}


class DraftPolicy:
    """Chooses the draft length from verify costs ``costs[S - 1]``, the pipelined plain cost and
    tracked acceptance; ``plain_cost`` defaults to ``c(1)`` (no pipelining gain)."""

    def __init__(self, costs: list[float], *, plain_cost: float | None = None, alpha: float = 0.1,
                 prior: float = 0.5):
        if len(costs) < 1 or costs[0] <= 0:
            raise ValueError("costs must hold c(1) > 0, c(2), ...")
        self.costs = [max(costs[: i + 1]) for i in range(len(costs))]  # c(S) never decreases
        self.plain_cost = plain_cost if plain_cost is not None else self.costs[0]
        self.k_max = len(costs) - 1
        self.alpha = alpha
        self.accept = [prior] * self.k_max      # a_i, i = 1..k_max
        self.decisions: dict[int, int] = {}     # chosen n per decode step (0: a plain step)
        self.pipelined = True                   # n = 0 steps run in pipelined plain mode
        self._pending: list[list] = []          # [proposal, tokens matched so far]

    def expected_tokens(self, n: int) -> float:
        """E(n): the mean number of tokens emitted by a forward that verifies n drafts."""
        total, run = 1.0, 1.0
        for a in self.accept[:n]:
            run *= a
            total += run
        return total

    def choose(self, n_available: int) -> int:
        """The draft length (at most ``n_available``) with the best tokens per unit of cost."""
        limit = min(n_available, self.k_max)
        rates = [1 / self.plain_cost] + [self.expected_tokens(n) / self.costs[n] for n in range(1, limit + 1)]
        n = max(range(limit + 1), key=lambda i: (rates[i], -i))
        self.decisions[n] = self.decisions.get(n, 0) + 1
        return n

    def leave_plain(self, n_available: int) -> bool:
        """Whether to stop pipelining, given a proposal of ``n_available`` tokens whose first one
        guesses the token in flight: some ``n <= n_available - 1`` has
        ``E(n + 1) - a_1 > (c(n + 1) + c(1) - c_p) / c_p``. Staying counts as a plain step."""
        restart = max(self.costs[0] - self.plain_cost, 0.0)   # the pipeline's lost overlap
        limit = min(n_available - 1, self.k_max - 1)
        leave = any(self.expected_tokens(n + 1) - self.accept[0] > (self.costs[n] + restart) / self.plain_cost
                    for n in range(1, limit + 1))
        if not leave:
            self.decisions[0] = self.decisions.get(0, 0) + 1
        return leave

    def observe(self, proposal: list[int], emitted: list[int]) -> None:
        """Record the drafter's ``proposal`` for this step, then the tokens the model emitted."""
        if proposal:
            self._pending.append([list(proposal[: self.k_max]), 0])
        for t in emitted:
            still = []
            for entry in self._pending:
                proposal_, j = entry
                hit = proposal_[j] == t
                self.accept[j] += self.alpha * (float(hit) - self.accept[j])
                entry[1] = j + 1
                if hit and j + 1 < len(proposal_):
                    still.append(entry)
            self._pending = still

    def summary(self) -> dict:
        """The measured costs relative to c(1), the acceptance estimates and the decisions."""
        return {"cost_rel": [round(c / self.costs[0], 3) for c in self.costs],
                "plain_cost_rel": round(self.plain_cost / self.costs[0], 3),
                "accept": [round(a, 3) for a in self.accept],
                "decisions": dict(sorted(self.decisions.items()))}


class FixedDraftLength:
    """``draft_max=k``: every step verifies up to k of the drafter's proposal, waiting for each
    step's tokens (an explicit draft length means verifying every proposal where it is made);
    ``k = 0`` is plain decoding, pipelined throughout."""

    def __init__(self, k_max: int):
        self.k_max = k_max
        self.pipelined = k_max == 0

    def choose(self, n_available: int) -> int:
        return min(n_available, self.k_max)

    def leave_plain(self, n_available: int) -> bool:
        return False

    def observe(self, proposal: list[int], emitted: list[int]) -> None:
        pass

    def summary(self) -> None:
        return None


def model_key(model: nn.Module, what) -> str:
    """What a step cost depends on: the measurement ``what``, architecture and sizes, dtype,
    device, machine, BLAS."""
    params = tree_flatten(model.parameters())
    shapes = sorted((name, tuple(p.shape), str(p.dtype)) for name, p in params)
    return json.dumps([type(model).__module__, repr(shapes), what, str(mx.default_device()),
                       platform.machine(), platform.node(), mx.__version__,
                       os.environ.get("LD_PRELOAD", "")])


def _remembered(key: str, cache_file, measure):
    """``measure()`` once per key: remembered for this process and, with ``cache_file``, across
    processes (a JSON object ``{key: value}``, written atomically)."""
    if key in _COSTS:
        return _COSTS[key]
    stored = _read_json(cache_file)
    if key in stored:
        _COSTS[key] = stored[key]
        return stored[key]
    _COSTS[key] = measure()
    if cache_file is not None:
        _write_json(cache_file, {**_read_json(cache_file), key: _COSTS[key]})
    return _COSTS[key]


def _warm_cache(model: nn.Module, context: int) -> list:
    cache = make_prompt_cache(model)
    model(mx.arange(context).reshape(1, -1) % 2, cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def measure_verify_cost(model: nn.Module, s_max: int = DEFAULT_K_MAX + 1, *, reps: int = 3,
                        context: int = 32, gdn_path: str | None = None,
                        cache_file: str | os.PathLike | None = None) -> list[float]:
    """Seconds per verify forward of S = 1..s_max tokens (fastest of ``reps`` rounds), each run
    and waited for on its own; measured once per :func:`model_key` (see :func:`_remembered`)."""

    def measure():
        cache = _warm_cache(model, context)
        verifier = VerifyCache(model, cache, gdn_path)
        times: list[list[float]] = [[] for _ in range(s_max)]
        for r in range(reps + 1):              # round 0 warms up (graph building, allocation)
            for S in range(1, s_max + 1):      # S interleaved, so a load change hits all S alike
                tokens = mx.arange(S, dtype=mx.uint32) % 2
                t0 = time.perf_counter()
                logits = verifier.forward(tokens, record=True)
                mx.eval(logits, [c.state for c in cache])
                if r:
                    times[S - 1].append(time.perf_counter() - t0)
                verifier.keep(0)
        verifier.close()
        return [min(t) for t in times]

    return _remembered(model_key(model, s_max), cache_file, measure)


def measure_pipelining(model: nn.Module, *, steps: int = 8, reps: int = 3, context: int = 32,
                       cache_file: str | os.PathLike | None = None) -> float:
    """``c_p / c(1)``: the time per token of plain greedy decoding pipelined as in mlx-lm's
    ``generate_step`` (step t+1 is built and launched before token t is read) over the time per
    token when each step is waited for. Both are runs of ``steps`` tokens, interleaved, fastest of
    ``reps`` each (so machine load biases neither); measured once per :func:`model_key`."""

    def measure():
        cache = _warm_cache(model, context)

        def step(y):
            token = mx.argmax(model(y.reshape(1, 1), cache=cache)[:, -1, :], axis=-1)
            mx.async_eval(token)
            return token

        def run(pipelined: bool) -> float:
            t0 = time.perf_counter()
            y = step(mx.array([1], mx.uint32))
            for _ in range(steps - 1):
                if pipelined:
                    y_next = step(y)
                    y.item()
                    y = y_next
                else:
                    y.item()
                    y = step(y)
            y.item()
            return time.perf_counter() - t0

        times = {True: [], False: []}
        for r in range(reps + 1):              # round 0 warms up
            for pipelined in times:
                t = run(pipelined)
                if r:
                    times[pipelined].append(t)
        return min(times[True]) / min(times[False])

    return _remembered(model_key(model, "pipelining"), cache_file, measure)


def _read_json(path) -> dict:
    if path is None or not Path(path).exists():
        return {}
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}   # a damaged cost cache is only a cache: measure again


def _write_json(path, data: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)
