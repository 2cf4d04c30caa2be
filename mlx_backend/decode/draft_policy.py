"""Cost-aware draft length: draft only as many tokens as pay off on this model and machine.

A verify forward over ``S = n + 1`` tokens costs ``c(S)``, learned from the timings of the real
steps of generation (:class:`StepCosts`: no separate measurement, so it never costs the user time;
kept per model and machine in the user's cache directory, :func:`learned_costs`). With ``a_i`` the
probability that draft token i is accepted given that tokens 1..i-1 were, drafting n tokens
yields on average

    E(n) = 1 + sum_{j=1..n} prod_{i<=j} a_i          tokens per forward,

so the policy drafts the ``n`` (at most the drafter's proposal length) that maximises the token
rate ``E(n) / c(n + 1)``; ``n = 0`` (a plain step) whenever no draft length beats ``1 / c(1)``.

``n = 0`` means plain decoding, which the generator pipelines like mlx-lm's ``generate_step``
(the next one-token step is built while the current one runs), so it is valued at the measured
pipelined cost ``c_p`` (the time per token of the real plain steps) rather than ``c(1)``. While pipelined, the
token in flight is not known yet, so a proposal ``P`` made before it guesses that token with
``P[0]``; leaving plain mode to verify ``P[1..n]`` next yields on average (``P[0]`` right with
probability ``a_1``)

    E(n + 1) - a_1 = 1 + sum_{j=2..n+1} prod_{i<=j} a_i      tokens, in time c(n + 1),

and costs the pipeline: the first plain step after it is built while the device waits, ``c(1)``
instead of ``c_p``. The generator leaves plain mode (:meth:`DraftPolicy.leave_plain`) when for some n

    E(n + 1) - a_1 > (c(n + 1) + c(1) - c_p) / c_p,

the tokens plain mode would have produced in that time.

``a_i`` is learned from *every* proposal of the drafter, verified or not: a proposal made before
position t is compared with the tokens the model then emits at t+1, t+2, ... (for verified drafts
this is the verification itself; for drafts the policy did not verify, the later output tells the
same thing). The policy therefore keeps learning while it drafts nothing, and starts drafting when
acceptance rises. It is kept per *match-length bucket*: a suffix drafter (``match_length`` after
each draft) that copies after a 40-token match is right far more often than one guessing after a
1-token match, so ``a_i`` is learned and used separately for L = 0 (no match, or the lookup drafter,
which has no match length), 1, 2-3, 4-7, 8-15, 16-31 and 32+ (:data:`MATCH_BUCKETS`). Each estimate
starts at a prior (:data:`PRIORS`, rising with L) and moves with the observations: per position for
L = 0, one for all positions of a suffix match (:class:`DraftPolicy`). Untimed verify sizes beyond
those timed are costed conservatively (:meth:`StepCosts.estimate`), so the policy lengthens its
drafts as it times longer verifies, up to :data:`DEFAULT_K_MAX` = 64.

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

import bisect
import itertools
import json
import logging
import math
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from mlx_backend.machine.blas import blas_in_use
from mlx_backend.decode.rollback import VerifyCache
from mlx_backend.machine.user_cache import cache_dir
from reference.atomic import atomic_write, locked_folder

log = logging.getLogger(__name__)

DEFAULT_K_MAX = 64
#: Draft length of a seeded sampled run without a fixed one (``generate --seed``, a request with ``seed``): the
#: verification draws one random number a verified token, so a length that follows the learned timings (the
#: cost-aware one) would make the draws, and so the text, differ from run to run; a fixed one lets the seed
#: reproduce the output.
SEEDED_DRAFT_MAX = 8
PRIOR_SLOPE = 0.25  # c(S) / c(1) grows by this per extra token until a verify step is timed
#: Lower ends of the match-length buckets acceptance is kept by: L = 0 (no match, or a drafter without
#: match lengths: the lookup), 1, 2-3, 4-7, 8-15, 16-31, 32+.
MATCH_BUCKETS = (0, 1, 2, 4, 8, 16, 32)
BUCKET_LABELS = ("0", "1", "2-3", "4-7", "8-15", "16-31", "32+")
#: a_i per bucket before any observation: bucket 0 keeps the lookup's 0.5; the others are about what
#: the suffix drafter's copies achieve on SmolLM2's demo answers and on free writing (per draft token:
#: L = 1 0.2, 2-3 0.5-0.8, 4-7 0.8-0.96, 8+ 0.85-0.98). A constant a caps E(n) at 1 / (1 - a) whatever
#: n, so even the 32+ prior (E <= 33) does not draft 64 tokens untested unless verifying them is free.
PRIORS = (0.5, 0.2, 0.5, 0.85, 0.92, 0.95, 0.97)
PRIOR_WEIGHT = 2    # observations a prior counts as: the first ones move an estimate fast
WINDOW = 16         # timings kept per S (the estimate is their median)
#: plain timings needed before c_p is known: their median, so that one stalled step (a kernel compiled or
#: loaded on its first call, seen at 1 s against 1-100 ms) does not become the c_p that verify timings
#: are divided by (seen: a first run's learned c(S)/c(1) flat at 1.01 up to S = 65, kept for later runs)
MIN_PLAIN = 3
#: the layout and meaning of the kept timings; part of the key, so that timings of an earlier meaning are
#: not read (2: verify timings related to a c_p of at least MIN_PLAIN plain timings)
COSTS_VERSION = 2
COST_FILE = "step-costs.json"
_COSTS: dict[str, "StepCosts"] = {}


class StepCosts:
    """``c(S)``, S = 1..s_max, and the pipelined plain cost ``c_p``, from the timings of real steps.

    ``samples[0]`` holds seconds per token of pipelined plain steps (``c_p``, timed token to token;
    not the first step of a plain run, which also pays for the rollback and graph changes of the
    verify step before it, nor its last, launched a step before it is waited for); ``samples[S]``, S >= 1, the seconds of a verify step over S tokens (the
    forward, reading its tokens and the rollback) divided by ``c_p`` at that time, so that a change
    of machine load between runs cancels out. ``c_p`` is the median of the plain timings and is known
    once there are :data:`MIN_PLAIN` of them: before, nothing is estimated (the policy decodes plainly,
    which times more) and a verify timing is dropped. ``c(1)`` is ``c_p`` until timed (a fixed-length
    policy's empty draft; the cost-aware one pipelines those steps). Each keeps its last :data:`WINDOW` values and is estimated by their median, made
    non-decreasing in S (:func:`_non_decreasing`, weighted by the number of timings). An S
    never timed is interpolated linearly between timed ones, and beyond the largest timed S
    extrapolated conservatively (:meth:`estimate`; :data:`PRIOR_SLOPE` a token before any).

    >>> costs = StepCosts(4)
    >>> costs.add(0, 1.0); costs.add(0, 0.1)      # a stalled plain step, a plain step of 100 ms
    >>> costs.estimate() is None                  # c_p not known yet: fewer than MIN_PLAIN timings
    True
    >>> costs.add(0, 0.1); costs.add(3, 0.12)     # c_p = median(1.0, 0.1, 0.1); a verify of 3 in 120 ms
    >>> [round(c, 3) for c in costs.estimate()[0]]
    [0.1, 0.11, 0.12, 0.13]
    """

    def __init__(self, s_max: int, samples: dict[int, list[float]] | None = None, key: str | None = None):
        self.s_max = s_max
        self.key = key
        self.samples = {S: list(v)[-WINDOW:] for S, v in (samples or {}).items() if 0 <= S <= s_max and v}
        self.n_new = 0   # timings added by this process
        self._medians: dict[int, float] = {}   # per S, dropped when S gets a timing

    def _median(self, S: int) -> float:
        if S not in self._medians:
            self._medians[S] = statistics.median(self.samples[S])
        return self._medians[S]

    def c_p_known(self) -> bool:
        """Whether ``c_p`` is known: :data:`MIN_PLAIN` plain timings to take the median of."""
        return len(self.samples.get(0, ())) >= MIN_PLAIN

    def add(self, S: int, seconds: float) -> None:
        """Record a step: S = 0 a pipelined plain step, S >= 1 a forward over S tokens waited for."""
        if S > 0:
            if not self.c_p_known():
                return   # relative to c_p: not known yet
            seconds /= self._median(0)
        self.samples.setdefault(S, []).append(seconds)
        del self.samples[S][:-WINDOW]
        self._medians.pop(S, None)
        self.n_new += 1

    def estimate(self) -> tuple[list[float], float] | None:
        """``([c(1), ..., c(s_max)], c_p)`` in seconds, or None before :data:`MIN_PLAIN` timed plain steps.

        Beyond the largest timed size ``T`` the estimate is conservative: up to ``2 T`` it grows with
        the steeper of the mean slope from S = 1 and the slope over the upper half of the timed range
        (a curve that is flat while the forward is bandwidth-bound and then rises is not taken as
        flat), beyond ``2 T`` at least by :data:`PRIOR_SLOPE` per token, so the policy tries sizes at
        most about twice those it has timed (each timed size then widens the range)."""
        if not self.c_p_known():
            return None
        c_p = self._median(0)
        known = sorted({1, *(S for S in self.samples if S > 0)})
        medians = [self._median(S) if S in self.samples else 1.0 for S in known]
        weights = [len(self.samples.get(S, ())) or 1 for S in known]
        rel = _non_decreasing(medians, weights)
        last = known[-1]
        slope = PRIOR_SLOPE
        if last > 1:
            slope = (rel[-1] - rel[0]) / (last - 1)
            mid = bisect.bisect_right(known, (1 + last) / 2) - 1     # the upper half's first timed size
            if known[mid] < last:
                slope = max(slope, (rel[-1] - rel[mid]) / (last - known[mid]))
        far = max(slope, PRIOR_SLOPE)
        costs, j = [], 0
        for S in range(1, self.s_max + 1):
            if S >= last:
                r = rel[-1] + slope * (min(S, 2 * last) - last) + far * max(S - 2 * last, 0)
            else:
                while known[j + 1] <= S:
                    j += 1
                lo, hi = known[j], known[j + 1]
                r = rel[j] + (rel[j + 1] - rel[j]) * (S - lo) / (hi - lo)
            costs.append(r * c_p)
        return costs, c_p


def _non_decreasing(values: list[float], weights: list[float]) -> list[float]:
    """The non-decreasing sequence closest to ``values`` in weighted least squares (pool adjacent
    violators): a verify over more tokens never costs less, and a size timed once weighs less than
    one timed sixteen times.

    >>> _non_decreasing([1.0, 3.0, 2.0, 2.5], [1, 1, 3, 1])
    [1.0, 2.25, 2.25, 2.5]
    """
    blocks: list[list[float]] = []   # [mean, weight, count]
    for v, w in zip(values, weights):
        blocks.append([v, w, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (v1, w1, n1), (v2, w2, n2) = blocks.pop(-2), blocks.pop()
            blocks.append([(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    return [v for v, _, n in blocks for _ in range(n)]


def match_bucket(match_length: int) -> int:
    """The index of the match-length bucket of ``L`` (:data:`MATCH_BUCKETS`: 0, 1, 2-3, 4-7, 8-15,
    16-31, 32+; 0 also for a drafter without a match length, the lookup).

    >>> [match_bucket(L) for L in (0, 1, 2, 3, 4, 7, 8, 16, 31, 32, 64)]
    [0, 1, 2, 2, 3, 3, 4, 5, 5, 6, 6]
    """
    return bisect.bisect_right(MATCH_BUCKETS, max(int(match_length), 0)) - 1


class DraftPolicy:
    """Chooses the draft length from verify costs ``costs[S - 1]``, the pipelined plain cost and
    tracked acceptance; ``plain_cost`` defaults to ``c(1)`` (no pipelining gain). With
    ``step_costs`` instead of ``costs``, the costs are learned from the steps the generator times
    (:meth:`observe_cost`); until c_p is known (:data:`MIN_PLAIN` plain steps) it drafts nothing.

    Acceptance ``a_i`` is kept per match-length bucket (:func:`match_bucket` of the drafter's
    ``match_length`` when it proposed): ``accept_by[b][i - 1]``. ``prior`` is the acceptance before
    any observation: one value for every bucket, a sequence of one per bucket, or None for
    :data:`PRIORS`. Bucket 0 (no match; the lookup drafter's proposals, whose acceptance depends on
    the position) keeps one estimate per position: the mean of the prior (weighing
    :data:`PRIOR_WEIGHT` observations) and the observations while they are few, then an EWMA of
    weight ``alpha``. A suffix match's copy is about as likely right at its 30th token as at its
    3rd, so buckets >= 1 keep one ``a`` for all positions: ``(PRIOR_WEIGHT * prior + hits) /
    (PRIOR_WEIGHT + trials)`` over every position, hits and trials forgetting by ``1 - alpha`` per
    proposal in the bucket (about the last ``1 / alpha`` proposals: hundreds of observations on a
    long copy, so a ~0.99 acceptance is told from 0.95 within a few verifies, which per-position
    averages of a few observations each could not). ``alpha = 0`` freezes every estimate at its
    prior. :attr:`accept` is bucket 0's (the lookup's, or no match)."""

    def __init__(self, costs: list[float] | None = None, *, plain_cost: float | None = None,
                 step_costs: StepCosts | None = None, alpha: float = 0.1,
                 prior: float | Sequence[float] | None = None):
        if (costs is None) == (step_costs is None):
            raise ValueError("give either costs or step_costs")
        if costs is not None and (len(costs) < 1 or costs[0] <= 0):
            raise ValueError("costs must hold c(1) > 0, c(2), ...")
        self.step_costs = step_costs
        self.k_max = (len(costs) if costs is not None else step_costs.s_max) - 1
        self.costs: list[float] | None = None
        self.plain_cost: float | None = None
        self._set_costs((costs, plain_cost) if costs is not None else step_costs.estimate())
        self.alpha = alpha
        priors = PRIORS if prior is None else [prior] * len(MATCH_BUCKETS) if isinstance(prior, (int, float)) else prior
        if len(priors) != len(MATCH_BUCKETS):
            raise ValueError(f"prior: one value, or one per match-length bucket ({len(MATCH_BUCKETS)})")
        self.accept_by = [[float(p)] * self.k_max for p in priors]   # a_i per bucket, i = 1..k_max
        self._n_obs = [[0] * self.k_max for _ in priors]               # observations per bucket and i
        self._priors = [float(p) for p in priors]
        self._hits = [0.0] * len(priors)     # buckets >= 1: decayed hits and trials over all positions
        self._trials = [0.0] * len(priors)
        self._stale: set[int] = set()        # buckets >= 1 whose accept_by is to be recomputed
        self.decisions: dict[int, int] = {}     # chosen n per decode step (0: a plain step)
        self.pipelined = True                   # n = 0 steps run in pipelined plain mode
        self._pending: list[list] = []          # [proposal, tokens matched so far, bucket]

    @property
    def accept(self) -> list[float]:
        """Bucket 0's ``a_i`` (a drafter without match lengths puts every proposal there)."""
        return self.acceptance(0)

    @accept.setter
    def accept(self, values: list[float]) -> None:
        self.accept_by[0] = list(values)

    def _set_costs(self, estimate) -> None:
        if estimate is None:
            return
        costs, plain_cost = estimate
        self.costs = list(itertools.accumulate(costs, max))   # c(S) never decreases
        self.plain_cost = plain_cost if plain_cost is not None else self.costs[0]

    def observe_cost(self, S: int, seconds: float) -> None:
        """A timed step (S = 0: pipelined plain, else a forward over S tokens waited for); only
        learning policies (``step_costs``) use it."""
        if self.step_costs is not None:
            self.step_costs.add(S, seconds)
            self._set_costs(self.step_costs.estimate())

    def acceptance(self, match_length: int = 0) -> list[float]:
        """``a_i`` of the bucket of ``match_length``."""
        b = match_bucket(match_length)
        if b in self._stale:
            self._stale.discard(b)
            a = (PRIOR_WEIGHT * self._priors[b] + self._hits[b]) / (PRIOR_WEIGHT + self._trials[b])
            self.accept_by[b] = [a] * self.k_max
        return self.accept_by[b]

    def expected_tokens(self, n: int, match_length: int = 0) -> float:
        """E(n): the mean number of tokens emitted by a forward that verifies n drafts."""
        total, run = 1.0, 1.0
        for a in self.acceptance(match_length)[:n]:
            run *= a
            total += run
        return total

    def choose(self, n_available: int, match_length: int = 0) -> int:
        """The draft length (at most ``n_available``) with the best tokens per unit of cost, for a
        proposal made on a suffix match of ``match_length`` tokens."""
        limit = min(n_available, self.k_max) if self.costs is not None else 0
        n = 0
        if limit > 0:
            best, run, total, costs = 1 / self.plain_cost, 1.0, 1.0, self.costs
            for i, a in enumerate(self.acceptance(match_length)[:limit], 1):
                run *= a
                total += run
                if total / costs[i] > best:   # ties go to the shorter draft
                    best, n = total / costs[i], i
        self.decisions[n] = self.decisions.get(n, 0) + 1
        return n

    def leave_plain(self, n_available: int, match_length: int = 0) -> bool:
        """Whether to stop pipelining, given a proposal of ``n_available`` tokens whose first one
        guesses the token in flight: some ``n <= n_available - 1`` has
        ``E(n + 1) - a_1 > (c(n + 1) + c(1) - c_p) / c_p``. Staying counts as a plain step."""
        limit = min(n_available - 1, self.k_max - 1) if self.costs is not None else 0
        leave = False
        if limit > 0:
            accept = self.acceptance(match_length)
            restart = max(self.costs[0] - self.plain_cost, 0.0)   # the pipeline's lost overlap
            run, total = accept[0], 1.0                          # E(n + 1) - a_1 = 1 + a1 a2 + ...
            for n in range(1, limit + 1):
                run *= accept[n]
                total += run
                if total > (self.costs[n] + restart) / self.plain_cost:
                    leave = True
                    break
        if not leave:
            self.decisions[0] = self.decisions.get(0, 0) + 1
        return leave

    def observe(self, proposal: list[int], emitted: list[int], match_length: int = 0) -> None:
        """Record the drafter's ``proposal`` for this step (made on a match of ``match_length``),
        then the tokens the model emitted: each open proposal's next position is a hit or a miss.
        The work is one update per open proposal and emitted token; a proposal closes at its first
        miss or its end, so at most k_max are open."""
        if proposal:
            b = match_bucket(match_length)
            self._pending.append([proposal[: self.k_max], 0, b])
            if b:   # a suffix match: the bucket's counts forget by 1 - alpha a proposal
                self._hits[b] *= 1 - self.alpha
                self._trials[b] *= 1 - self.alpha
        pending, alpha, prior_w = self._pending, self.alpha, PRIOR_WEIGHT
        for t in emitted:
            if not pending:
                break
            still = []
            for entry in pending:
                proposal_, j, b = entry
                hit = proposal_[j] == t
                if alpha > 0:   # alpha = 0: estimates frozen at the prior
                    self._n_obs[b][j] += 1
                    if b:
                        self._hits[b] += hit
                        self._trials[b] += 1
                        self._stale.add(b)
                    else:
                        a = self.accept_by[0]
                        a[j] += max(alpha, 1.0 / (self._n_obs[0][j] + prior_w)) * (hit - a[j])
                entry[1] = j + 1
                if hit and j + 1 < len(proposal_):
                    still.append(entry)
            pending = still
        self._pending = pending

    def summary(self) -> dict:
        """The costs relative to c(1) (None before the first timed step), the acceptance estimates
        (``accept``: bucket 0's; ``accept_by_match``: every bucket observed, by its range of L, up to
        its last observed position) and the decisions."""
        known = self.costs is not None
        by_match = {}
        for b, n in enumerate(self._n_obs):
            a = self.acceptance(MATCH_BUCKETS[b])
            seen = max((i + 1 for i, c in enumerate(n) if c), default=0)
            if seen:
                by_match[BUCKET_LABELS[b]] = [round(x, 3) for x in a[:seen]]
        return {"cost_rel": [round(c / self.costs[0], 3) for c in self.costs] if known else None,
                "plain_cost_rel": round(self.plain_cost / self.costs[0], 3) if known else None,
                "accept": [round(a, 3) for a in self.acceptance(0)],
                "accept_by_match": by_match,
                "decisions": dict(sorted(self.decisions.items()))}


class FixedDraftLength:
    """``draft_max=k``: every step verifies up to k of the drafter's proposal, waiting for each
    step's tokens (an explicit draft length means verifying every proposal where it is made);
    ``k = 0`` is plain decoding, pipelined throughout."""

    def __init__(self, k_max: int):
        self.k_max = k_max
        self.pipelined = k_max == 0

    def choose(self, n_available: int, match_length: int = 0) -> int:
        return min(n_available, self.k_max)

    def leave_plain(self, n_available: int, match_length: int = 0) -> bool:
        return False

    def observe(self, proposal: list[int], emitted: list[int], match_length: int = 0) -> None:
        pass

    def observe_cost(self, S: int, seconds: float) -> None:
        pass

    def summary(self) -> None:
        return None


def machine_name() -> str:
    """The machine the timings were taken on: its host name (a cache directory may be shared by machines,
    a home folder on a cluster), except on macOS, whose host name follows the network it joins: there
    the chip and its memory (``mx.device_info()``), so a Mac keeps its learned costs from one network to
    the next."""
    if sys.platform == "darwin":
        info = mx.device_info()
        return f"{info.get('device_name', platform.processor())} {info.get('memory_size', '')}".strip()
    return platform.node()


def model_key(model: nn.Module, what) -> str:
    """What a step cost depends on: the measurement ``what``, architecture and sizes, dtype,
    device, machine (:func:`machine_name`), mlx version, BLAS; and :data:`COSTS_VERSION`, what the kept
    timings mean."""
    params = tree_flatten(model.parameters())
    shapes = sorted((name, tuple(p.shape), str(p.dtype)) for name, p in params)
    return json.dumps([COSTS_VERSION, type(model).__module__, repr(shapes), what, str(mx.default_device()),
                       platform.machine(), machine_name(), mx.__version__, blas_in_use()])


def cost_file() -> Path:
    """The file that keeps the learned step costs: ``step-costs.json`` in the user's cache directory
    (``$NGRAM_SPEC_CACHE_DIR`` overrides it, :func:`mlx_backend.machine.user_cache.cache_dir`)."""
    return cache_dir() / COST_FILE


def learned_costs(model: nn.Module, s_max: int = DEFAULT_K_MAX + 1, gdn_path: str | None = None) -> StepCosts:
    """The :class:`StepCosts` of this model and machine (:func:`model_key`): this process's, else
    those kept in :func:`cost_file` by earlier runs, else empty ones (learned while generating)."""
    key = model_key(model, [s_max, gdn_path])
    if key not in _COSTS:
        _COSTS[key] = StepCosts(s_max, _kept_samples(_read_json(cost_file()).get(key)), key=key)
    return _COSTS[key]


def _kept_samples(stored) -> dict[int, list[float]]:
    """The timings kept under one model key, ``{S: [positive finite numbers]}``; any other entry (a damaged or
    hand-edited file that is still JSON) is dropped, as a damaged file is: a cost cache is only a cache.
    Before, such an entry was a TypeError or a ZeroDivisionError in every run until the file was deleted.

    >>> _kept_samples({"0": [0.1, 0.2], "5": [0], "x": [1], "3": "abc", "4": [1.5, None]}), _kept_samples([1, 2])
    ({0: [0.1, 0.2]}, {})
    """
    if not isinstance(stored, dict):
        return {}
    kept = {}
    for S, v in stored.items():
        if (isinstance(S, str) and S.isdigit() and isinstance(v, list) and v
                and all(isinstance(t, (int, float)) and not isinstance(t, bool) and 0 < t < math.inf for t in v)):
            kept[int(S)] = [float(t) for t in v]
    return kept


def save_costs(costs: StepCosts) -> None:
    """Keep ``costs`` in :func:`cost_file` for later runs (atomic rewrite; a no-op without new timings)."""
    if costs.key is None or not costs.n_new:
        return
    path = cost_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with locked_folder(path.parent):   # processes saving at once each add their model's entry
            data = {**_read_json(path), costs.key: {str(S): v for S, v in costs.samples.items()}}
            with atomic_write(path, "w") as f:
                json.dump(data, f)
    except OSError as exc:   # only a cache: the run's output stands; say where, and how to move it
        log.warning("could not save the learned step costs to %s (%s); they are learned again next run. Set "
                    "NGRAM_SPEC_CACHE_DIR to a writable folder to keep them", path, exc.strerror or exc)
    costs.n_new = 0


def measured_sizes(s_max: int) -> list[int]:
    """The S that :func:`measure_verify_cost` times: every S up to 17, then 33 and 65 (and ``s_max``):
    19 forwards a round at k = 64 instead of 65, the others interpolated (the cost is close to linear in
    S past a few tokens).

    >>> measured_sizes(9), measured_sizes(65)[-4:]
    ([1, 2, 3, 4, 5, 6, 7, 8, 9], [16, 17, 33, 65])
    """
    return sorted({S for S in range(1, min(s_max, 17) + 1)} | {S for S in (33, 65) if S < s_max} | {s_max})


def measure_verify_cost(model: nn.Module, s_max: int = DEFAULT_K_MAX + 1, *, reps: int = 3,
                        context: int = 32, gdn_path: str | None = None) -> list[float]:
    """Seconds per verify forward of S = 1..s_max tokens (fastest of ``reps`` rounds), each run
    and waited for on its own, after ``context`` cached tokens (fewer where the model's window,
    a rotating cache's ``max_size``, is smaller: context + s_max never exceeds it); the S of
    :func:`measured_sizes` are timed, the others interpolated linearly between them. For benchmarks
    and explicit policies (``DraftPolicy(measure_verify_cost(model))``); generation learns the costs
    from its own steps instead."""
    cache = make_prompt_cache(model)
    window = min((getattr(c, "max_size", None) or math.inf) for c in cache)
    if s_max + 1 > window:
        raise ValueError(f"s_max={s_max} does not fit the model's attention window of {window} tokens")
    context = int(min(context, window - s_max))
    model(mx.arange(context).reshape(1, -1) % 2, cache=cache)
    mx.eval([c.state for c in cache])
    verifier = VerifyCache(model, cache, gdn_path)
    sizes = measured_sizes(s_max)
    times: dict[int, list[float]] = {S: [] for S in sizes}
    for r in range(reps + 1):              # round 0 warms up (graph building, allocation)
        for S in sizes:                    # S interleaved, so a load change hits all S alike
            tokens = mx.arange(S, dtype=mx.uint32) % 2
            t0 = time.perf_counter()
            logits = verifier.forward(tokens, record=True)
            mx.eval(logits, [c.state for c in cache])
            if r:
                times[S].append(time.perf_counter() - t0)
            verifier.keep(0)
    verifier.close()
    best = {S: min(t) for S, t in times.items()}
    costs = []
    for S in range(1, s_max + 1):
        lo, hi = max(x for x in sizes if x <= S), min(x for x in sizes if x >= S)
        costs.append(best[lo] if lo == hi else best[lo] + (best[hi] - best[lo]) * (S - lo) / (hi - lo))
    return costs


def _read_json(path) -> dict:
    if path is None or not Path(path).exists():
        return {}
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}   # a damaged cost cache is only a cache: learn again
    return data if isinstance(data, dict) else {}

