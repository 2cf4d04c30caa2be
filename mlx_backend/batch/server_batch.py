"""mlx-lm's ``BatchGenerator``, as mlx-lm's server loop uses it, on top of :class:`BatchSpeculativeDecoder`.

``mlx_lm.server.ResponseGenerator._generate`` (mlx-lm 0.32) serves concurrent requests with a
``BatchGenerator`` (mlx_lm/generate.py) and uses exactly: ``insert_segments(segments, max_tokens, caches,
all_tokens, samplers, logits_processors, stop_sequences) -> [uid]``, ``next() -> (prompt_responses,
generation_responses)``, ``extract_cache(uids) -> {uid: (cache, tokens)}``, ``remove(uids)``,
``prompt_cache_nbytes`` and ``close()``. :class:`SpeculativeBatchGenerator` implements those, with
mlx-lm's meanings:

* A sequence is prefilled alone, segment by segment; one ``next()`` prefills at most ``prefill_step_size``
  tokens, going on to the next waiting sequence when one joins (so that requests arriving together start
  decoding together, as after mlx-lm's batched prefill, instead of one more decode step per request)
  (one :class:`PromptResponse` per chunk: ``progress`` = (tokens done, total), ``end_of_segment``), into
  its own per-request cache: ``caches[i]`` (a prompt cache from mlx-lm's LRU, holding ``all_tokens[i]``)
  or a fresh one. As in mlx-lm the prompt's last token is not fed; when only it is left the sequence
  joins the decoder (:meth:`BatchSpeculativeDecoder.join`) and a response with ``end_of_prompt`` says so.
  A sequence starts only while fewer than ``completion_batch_size`` rows decode. If the cache already
  holds the whole prompt, one token is trimmed off it (or, for a cache that cannot be trimmed, such as a
  GatedDeltaNet state, the prompt is prefilled afresh) so that there is a last token to feed.
* Each ``next()`` first runs one speculative step of every decoding row (ONE verify forward), then the
  prefill chunks. A step emits 1..k+1 tokens per row: one :class:`GenerationResponse` per token, in order,
  a ``finish_reason`` on the last only. mlx-lm's loop turns each into one server ``Response`` on the
  request's queue (with ``logprobs[token]``), so a client sees them as if they came one per step.
* Finish: ``"stop"`` when the row's ``stop_sequences`` matcher (mlx-lm's ``make_stop_sequences``: the
  EOS tokens and the stop words) completes at a token, the step's tokens after it dropped; else
  ``"length"`` at ``max_tokens`` (mlx-lm's ``GenerationBatch.next`` order: a stop match wins). The last
  response carries the row's ``prompt_cache`` (per-request caches, mlx-lm's ``extract``) and
  ``all_tokens``: the tokens that cache holds, i.e. every token fed (the row's tokens but the last one
  emitted, or all of them after a pipelined plain step, as in mlx-lm; a step cut by a stop word may have
  fed accepted tokens after the stop), under which mlx-lm's
  loop stores it in its LRU, so that reuse stays exact for caches that cannot be trimmed.
* ``remove`` drops a sequence at any stage; uids not live (finished, removed) are ignored, as mlx-lm's.

Per sequence, ``plan(all_tokens, prompt)`` (called by ``insert_segments``; ``prompt`` is the whole prompt)
gives its :class:`RowPlan`: the drafter and the draft length (0: plain decoding) and ``on_finish``,
called once with a :class:`RowReport` when the sequence finishes (``completed``) or is removed or closed
(not). ``on_forward(rows)`` is called after each verify forward with the number of rows it verified.

The decoder's width follows the burst rule of :mod:`mlx_backend.batch.policy` (the time until the last
row ends) while no sequence waits for or is in prefill, else the summed tokens per cost (a row that ends
early lets a waiting one start).
"""
from __future__ import annotations

import copy
import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import StopSequences
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from mlx_backend.batch.generate import BatchSpeculativeDecoder, check_batch_model, check_batchable
from mlx_backend.decode.rollback import RollbackUnsupported


@dataclass
class PromptResponse:
    """mlx-lm's ``PromptProcessingBatch.Response``: prefill progress of sequence ``uid``."""

    uid: int
    progress: tuple
    end_of_segment: bool
    end_of_prompt: bool


@dataclass
class GenerationResponse:
    """mlx-lm's ``GenerationBatch.Response``: one token of ``uid``; the last one has the finish fields."""

    uid: int
    token: int
    logprobs: mx.array
    finish_reason: Optional[str]
    prompt_cache: Optional[list] = None
    all_tokens: Optional[list[int]] = None


@dataclass
class RowReport:
    """What one sequence did: ``output`` (the tokens it emitted, the stop token included), the verify
    forwards it took part in (``steps``), drafts verified / accepted, prefill and decode seconds, and when
    its prefill began (until then it waited for a free row)."""

    uid: int
    output: list[int]
    completed: bool
    steps: int = 0
    n_drafted: int = 0
    n_accept: int = 0
    t_prompt: float = 0.0
    t_generate: float = 0.0
    t_start: Optional[float] = None   # when its prefill began (``time.perf_counter``); None: it never began


@dataclass
class RowPlan:
    """A sequence's speculation: ``drafter`` (None or ``draft_max=0``: plain decoding; ``draft_max=None``: the
    cost-aware width of :mod:`mlx_backend.batch.policy`) and ``on_finish``."""

    drafter: Any = None
    draft_max: Optional[int] = 0
    on_finish: Optional[Callable[[RowReport], None]] = None


@dataclass
class _Sequence:
    uid: int
    segments: list[list[int]]      # still to prefill; the last one is the prompt's last token alone
    cache: Optional[list]          # the per-request cache while prefilling (None once joined)
    tokens: list[int]              # the tokens that cache holds
    max_tokens: int
    sampler: Optional[Callable]
    logits_processors: Optional[list]
    matcher: Any
    plan: RowPlan
    total: int
    done: int = 0
    duid: Optional[int] = None     # the decoder's uid once joined
    row: Any = None                # the decoder's row once joined
    output: list[int] = field(default_factory=list)
    steps: int = 0
    t0: Optional[float] = None
    t_join: Optional[float] = None


def feed_the_last(cache: Optional[list], prompt: list[int]) -> tuple[Optional[list], list[int]]:
    """For a prompt cache holding the whole ``prompt``, which leaves a generator no last token to feed: the cache
    and the tokens to feed, the last one trimmed off a cache that can be trimmed, else no cache and the whole
    prompt (a recurrent state cannot be trimmed: the prompt is prefilled afresh)."""
    if cache is not None and can_trim_prompt_cache(cache):
        trim_prompt_cache(cache, 1)
        return cache, prompt[-1:]
    return None, list(prompt)


def batch_unsupported(model: nn.Module) -> Optional[str]:
    """None when :class:`BatchSpeculativeDecoder` can batch ``model``'s caches, else the reason (naming the
    cache), from the checks its ``join`` makes (:func:`~mlx_backend.batch.generate.check_batch_model`)."""
    try:
        check_batch_model(model)
    except RollbackUnsupported as exc:
        return str(exc)
    return None


class SpeculativeBatchGenerator:
    """mlx-lm's ``BatchGenerator`` interface with speculative steps (see the module docstring).

    ``completion_batch_size``: at most this many rows decode together (mlx-lm's ``--decode-concurrency``).
    ``max_batch_tokens``: the decoder's per-step cap on real tokens (None: none). ``stream``: the mlx
    stream every forward runs on (mlx-lm's server passes its generation stream).
    """

    def __init__(self, model: nn.Module, *, plan: Optional[Callable[[list, list], RowPlan]] = None,
                 on_forward: Optional[Callable[[int], None]] = None, completion_batch_size: int = 32,
                 prefill_step_size: int = 2048, max_tokens: int = 128, max_batch_tokens: Optional[int] = None,
                 stream=None, **_ignored):
        if completion_batch_size < 1:
            raise ValueError(f"completion_batch_size must be >= 1, got {completion_batch_size}")
        if prefill_step_size < 1:
            raise ValueError(f"prefill_step_size must be >= 1, got {prefill_step_size}")
        self.model, self.plan, self.on_forward = model, plan, on_forward
        self.completion_batch_size, self.prefill_step_size, self.max_tokens = (completion_batch_size,
                                                                               prefill_step_size, max_tokens)
        self.decoder = BatchSpeculativeDecoder(model, max_batch_tokens=max_batch_tokens, keep_finished_caches=True,
                                               burst=lambda: not self._pending)
        self._stream = stream or mx.default_stream(mx.default_device())
        self._uids = itertools.count()
        self._pending: deque[_Sequence] = deque()   # waiting for or in prefill, in order
        self._live: dict[int, _Sequence] = {}       # uid -> every sequence not finished or removed
        self._joined: dict[int, _Sequence] = {}     # decoder uid -> decoding sequence

    @property
    def stream(self):
        return self._stream

    def insert(self, prompts, max_tokens=None, caches=None, all_tokens=None, samplers=None,
               logits_processors=None, stop_sequences=None) -> list[int]:
        """``insert_segments`` with one segment per prompt (mlx-lm's ``insert``)."""
        return self.insert_segments([[p] for p in prompts], max_tokens, caches, all_tokens, samplers,
                                    logits_processors, stop_sequences)

    def insert_segments(self, segments, max_tokens=None, caches=None, all_tokens=None, samplers=None,
                        logits_processors=None, stop_sequences=None) -> list[int]:
        """Queue sequences (each a list of prompt segments, the tokens after ``all_tokens``); their uids."""
        n = len(segments)
        options = {"max_tokens": max_tokens or [self.max_tokens] * n, "caches": caches or [None] * n,
                   "all_tokens": all_tokens or [[] for _ in range(n)], "samplers": samplers or [None] * n,
                   "logits_processors": logits_processors or [None] * n,
                   "stop_sequences": stop_sequences or [StopSequences()] * n}
        for name, values in options.items():
            if len(values) != n:
                raise ValueError(f"{name} must have one entry per sequence: expected {n}, got {len(values)}")
        made = [self._sequence(next(self._uids), *fields) for fields in zip(segments, *options.values())]
        for seq in made:
            self._pending.append(seq)
            self._live[seq.uid] = seq
        return [seq.uid for seq in made]

    def _sequence(self, uid, segments, max_tokens, cache, all_tokens, sampler, processors, stop) -> _Sequence:
        segs = [[int(t) for t in s] for s in segments if len(s)]
        cached = [int(t) for t in all_tokens]
        if max_tokens < 1:
            raise ValueError(f"sequence {uid}: max_tokens must be >= 1, got {max_tokens}")
        if not segs:   # the cache holds the whole prompt: there must be a last token to feed
            if not cached:
                raise ValueError(f"sequence {uid} has an empty prompt: give at least one token")
            cache, rest = feed_the_last(cache, cached)
            segs, cached = [rest], cached[:len(cached) - len(rest)]
        if len(segs[-1]) != 1:
            segs[-1:] = [segs[-1][:-1], segs[-1][-1:]]
        cache = make_prompt_cache(self.model) if cache is None else cache
        check_batchable(cache)
        prompt = cached + [t for s in segs for t in s]
        plan = self.plan(list(cached), prompt) if self.plan is not None else RowPlan()
        return _Sequence(uid, segs, cache, cached, max_tokens, sampler, processors, stop.matcher(), plan,
                         total=sum(len(s) for s in segs))

    def next(self) -> tuple[list[PromptResponse], list[GenerationResponse]]:
        """One speculative step of the decoding rows, then one prefill chunk (module docstring)."""
        with mx.stream(self._stream):
            generated = self._decode() if self.decoder.rows else []
            prompt, budget = [], self.prefill_step_size
            while budget > 0 and self._pending and len(self.decoder.rows) < self.completion_batch_size:
                response, used = self._prefill(budget)
                prompt.append(response)
                budget -= used
            return prompt, generated

    def _prefill(self, budget: int) -> tuple[PromptResponse, int]:
        """One chunk of at most ``budget`` tokens of the first waiting sequence, or its join; the tokens fed."""
        seq = self._pending[0]
        if seq.t0 is None:
            seq.t0 = time.perf_counter()
        if len(seq.segments) == 1 and len(seq.segments[0]) == 1:
            self._pending.popleft()
            self._join(seq)
            return PromptResponse(seq.uid, (seq.total, seq.total), True, True), 0
        segment = seq.segments[0]
        chunk = segment[:budget]
        self.model(mx.array(chunk, mx.uint32)[None], cache=seq.cache)
        mx.eval([c.state for c in seq.cache])
        seq.tokens.extend(chunk)
        seq.done += len(chunk)
        del segment[:len(chunk)]
        if not segment:
            seq.segments.pop(0)
        return PromptResponse(seq.uid, (seq.done, seq.total), not segment, False), len(chunk)

    def _join(self, seq: _Sequence) -> None:
        drafter = seq.plan.drafter if seq.plan.draft_max != 0 else None
        seq.duid = self.decoder.join(seq.cache, seq.tokens + seq.segments[0], max_tokens=seq.max_tokens,
                                     drafter=drafter, draft_max=seq.plan.draft_max if drafter else 0,
                                     sampler=seq.sampler, logits_processors=seq.logits_processors or None)
        seq.row = self.decoder.rows[-1]
        seq.cache, seq.done, seq.t_join = None, seq.total, time.perf_counter()
        self._joined[seq.duid] = seq

    def _decode(self) -> list[GenerationResponse]:
        rows = len(self.decoder.rows)
        new = self.decoder.step()
        if self.on_forward is not None:
            self.on_forward(rows)
        out = []
        for duid, tokens in new.items():
            seq = self._joined[duid]
            seq.steps += 1
            out += self._emit(seq, tokens)
        return out

    def _emit(self, seq: _Sequence, tokens: list[int]) -> list[GenerationResponse]:
        logprobs = self.decoder.last_logprobs[seq.duid]
        length = self.decoder.finished.pop(seq.duid, None)   # the decoder ends rows at max_tokens only
        out, reason = [], None
        for j, token in enumerate(tokens):
            if seq.matcher.advance(token):
                reason = "stop"
            elif j == len(tokens) - 1 and length is not None:
                reason = length
            out.append(GenerationResponse(seq.uid, token, logprobs[j], reason))
            seq.output.append(token)
            if reason is not None:
                break
        if reason is not None:
            if seq.duid in self.decoder.finished_caches:
                cache, held = self.decoder.finished_caches.pop(seq.duid)
            else:
                cache, held = self.decoder.extract(seq.duid), self.decoder.cached_tokens(seq.duid)
                self.decoder.remove(seq.duid)
            out[-1].prompt_cache, out[-1].all_tokens = cache, held
            self._end(seq, completed=True)
        return out

    def _end(self, seq: _Sequence, completed: bool) -> None:
        self._live.pop(seq.uid, None)
        if seq.duid is not None:
            self._joined.pop(seq.duid, None)
        now = time.perf_counter()
        row = seq.row
        report = RowReport(seq.uid, list(seq.output), completed, seq.steps,
                           row.n_drafted if row is not None else 0, row.n_accept if row is not None else 0,
                           t_prompt=((seq.t_join or now) - seq.t0) if seq.t0 is not None else 0.0,
                           t_generate=now - seq.t_join if seq.t_join is not None else 0.0, t_start=seq.t0)
        if seq.plan.on_finish is not None:
            seq.plan.on_finish(report)

    def extract_cache(self, uids) -> dict[int, tuple[list, list[int]]]:
        """``{uid: (a copy of its cache, the tokens it holds)}`` for the live sequences among ``uids``."""
        out = {}
        for uid in uids:
            seq = self._live.get(uid)
            if seq is None:
                continue
            if seq.duid is None:
                out[uid] = (copy.deepcopy(seq.cache), list(seq.tokens))
            else:
                out[uid] = (self.decoder.extract(seq.duid), self.decoder.cached_tokens(seq.duid))
        return out

    def remove(self, uids, return_prompt_caches: bool = False) -> dict:
        """Drop the live sequences among ``uids`` (their ``on_finish`` says not completed)."""
        caches = self.extract_cache(uids) if return_prompt_caches else {}
        for uid in uids:
            seq = self._live.get(uid)
            if seq is None:
                continue
            if seq.duid is None:
                self._pending.remove(seq)
            else:
                self.decoder.remove(seq.duid)
            self._end(seq, completed=False)
        return caches

    @property
    def prompt_cache_nbytes(self) -> int:
        total = sum(c.nbytes for seq in self._pending for c in seq.cache)
        return total + sum(c.nbytes for c in (self.decoder.cache or []))

    def close(self) -> None:
        """End every live sequence (not completed) and give the model's layers their own classes back."""
        for seq in list(self._live.values()):
            self._end(seq, completed=False)
        self._pending.clear()
        self.decoder.close()
