"""``ngram-spec serve``: mlx-lm's OpenAI-compatible server, with n-gram speculative generation.

The HTTP side is ``mlx_lm.server`` itself: its ``APIHandler`` (request parsing, validation, chat
templates, tool calls, SSE streaming), its ``ResponseGenerator`` (the generation thread, the request
queue, stop sequences, the LRU of prompt caches) and its ``_run_http_server``. Four seams plug ours in:

* the **draft-model seam**: ``ModelProvider.draft_model`` is an :class:`NgramSpeculator` (server-wide
  drafting state: static and dynamic n-gram caches, totals);
* **batched serving**: mlx-lm's generation loop ``ResponseGenerator._generate`` is run with the name
  ``BatchGenerator`` bound to :class:`mlx_backend.batch.server_batch.SpeculativeBatchGenerator` (speculative
  steps, one verify forward for all decoding rows), where the model's caches allow it
  (:func:`~mlx_backend.batch.server_batch.batch_unsupported`) and ``--decode-concurrency`` > 1
  (``is_batchable``); mlx-lm itself serves seeded requests one at a time (``_is_batchable``);
* otherwise ``_serve_single`` (one request at a time) is mlx-lm's own code, run with the name
  ``stream_generate`` bound to :meth:`SpecResponseGenerator.stream_generate` (each function is rebuilt
  from mlx-lm's code object with that one global replaced; no mlx-lm module is modified);
* the **prompt-cache LRU** (:class:`HeldPromptCache`) stores each cache under the tokens it really holds:
  after a speculative run that is the prompt and the tokens the client got, no more (rejected drafts were
  rolled back, see :mod:`mlx_backend.decode.rollback`; accepted drafts past where the client stopped are not
  kept, and the last token is fed at the run's end: ``_Run.emit`` and ``_Run.finish`` in
  :mod:`mlx_backend.decode.generate`). So reuse stays exact for
  hybrid models, whose GatedDeltaNet state cannot be trimmed afterwards, and for models without an attention
  layer (Mamba, Mamba2, RWKV7), whose cache is stored under the tokens fed (:func:`held_tokens`) and, as it
  cannot be trimmed at all, reused only where it holds exactly a prefix of the new prompt (mlx-lm's LRU).

Per request (JSON body): ``"speculative": false`` (mlx-lm's own plain generation), ``"draft_max"`` /
``"n_draft"`` / ``"num_draft_tokens"`` (drafts per step; ``0`` = plain, ``null`` = the cost-aware policy),
``"drafter"`` (``lookup``, ``suffix`` or ``auto``; default ``--drafter``), ``"user"`` (scope of the dynamic cache
and the suffix history with ``--dynamic-scope user``). Every response carries
``usage.completion_tokens_details.accepted_prediction_tokens`` / ``rejected_prediction_tokens`` and a
``timings`` object with llama.cpp's names (``draft_n``, ``draft_n_accepted``, ...); ``GET /v1/stats`` has
the totals. A request's error is that request's; a failure of the generation worker is logged with its
traceback, answered with HTTP 500 to every request in flight or waiting, and stops the server with exit
status 1 (:class:`SpecResponseGenerator`). See docs/server.md.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import math
import select
import signal
import socket
import sys
import threading
import time
import types
from http.server import ThreadingHTTPServer
from pathlib import Path
from queue import Empty as QueueEmpty
from typing import Any, Optional

import mlx.core as mx
import numpy as np
from mlx_lm import __version__ as MLX_LM_VERSION
from mlx_lm import server as mlx_server
from mlx_lm.generate import stream_generate as plain_stream_generate
from mlx_lm.models.cache import LRUPromptCache
from mlx_lm.utils import maybe_set_recommended_wired_limit

from reference.drafter import Drafter
from reference.ngram.ours_file import check_file_tokenizer, tokenizer_fingerprint
from mlx_backend.ngram.api import HashTable, as_table, load_cache
from mlx_backend.ngram.dynamic_cache import DYNAMIC_MAX_ENTRIES, check_max_entries, load_dynamic, save_dynamic
from mlx_backend.batch.server_batch import (RowPlan, RowReport, SpeculativeBatchGenerator, batch_unsupported,
                                           feed_the_last)
from mlx_backend.decode.draft_policy import DEFAULT_K_MAX, SEEDED_DRAFT_MAX
from mlx_backend.decode.generate import SpecStats, stream_generate as spec_stream_generate, vocab_size
from mlx_backend.ngram.default import lookup_drafter, make_drafter, suffix_api
from mlx_backend.suffix.history_file import load_history, read_history, save_history
from reference.suffix.auto import DEFAULT_DRAFTER, DRAFTERS
from reference.suffix.drafter import HISTORY_MAX_TOKENS

log = logging.getLogger("ngram_spec.server")

# Body fields mlx_lm.server reads (APIHandler.do_POST, handle_*_completions), ours, and OpenAI fields that
# change nothing here. Anything else is refused (400), as OpenAI's API does, instead of silently ignored.
MLX_LM_FIELDS = frozenset((
    "stream", "stream_options", "model", "draft_model", "num_draft_tokens", "adapters", "max_completion_tokens",
    "max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "repetition_context_size",
    "presence_penalty", "presence_context_size", "frequency_penalty", "frequency_context_size", "xtc_probability",
    "xtc_threshold", "logit_bias", "logprobs", "top_logprobs", "seed", "chat_template_kwargs", "stop", "messages",
    "tools", "role_mapping", "prompt"))
SPEC_FIELDS = frozenset(("speculative", "draft_max", "n_draft", "drafter"))
OPENAI_FIELDS = frozenset(("user", "n", "tool_choice", "parallel_tool_calls"))
# Fields that mlx-lm (or this server) checks as integers: ``true`` and ``false`` pass ``isinstance(value, int)``
# (a bool is an int in Python) and were read as 1 and 0; they are refused here (draft_max and its aliases: below)
INT_FIELDS = ("max_tokens", "max_completion_tokens", "top_k", "repetition_context_size", "presence_context_size",
              "frequency_context_size", "top_logprobs", "seed", "n")


class FieldError(ValueError):
    """A request field with a bad value: HTTP 400 with OpenAI's ``param`` naming the field."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def check_same_setting(given: dict) -> None:
    """Refuse two fields of one setting (``given``: name -> value, as in the body) that disagree."""
    if len(set(map(json.dumps, given.values()))) > 1:
        raise FieldError(next(iter(given)), f"{' and '.join(given)} are the same setting; give one of them")


class RequestError(ValueError):
    """A request the server refuses with HTTP ``status`` (raised in the generation thread, e.g. too long)."""

    status = 400


class ModelNotServed(LookupError):
    """The request names a model this server does not serve (HTTP 404, OpenAI's ``model_not_found``)."""


class WorkerFailure(RuntimeError):
    """The generation worker failed: the answer (HTTP 500) of every request in flight or waiting, after which
    the server stops and exits with status 1 (see :class:`SpecResponseGenerator`)."""

    status = 500


class ServerStopping(RuntimeError):
    """The server is stopping (Ctrl-C, SIGTERM) before this request's answer was complete: the answer (HTTP
    503, or a last ``data: {"error": ...}`` event in a stream that has begun) of every request the generation
    worker had not finished when it stopped (see ``run_serve``)."""

    status = 503


STOPPING = ("the server is stopping (Ctrl-C or SIGTERM) and did not finish this request: send it again once the "
            "server is back")


class _WorkerStopped(Exception):
    """Raised out of ``serve_forever`` (:meth:`SpecHTTPServer.service_actions`) once the worker has failed."""


ANSWER_TIMEOUT_S = 10.0  # after a worker failure or a stop: how long the handlers get to send their error answers
#: periodic saves (``--save-every``) take at most this share of the generation thread's time: a save writes each
#: changed cache whole while every decoding request waits (a server-wide dynamic cache of 2.4 M entries: ~2 s)
SAVE_SHARE = 0.05
_clock = time.monotonic   # the time periodic saves are spaced by (a test replaces it)


@dataclasses.dataclass
class RequestSpec:
    """Per-request speculation settings and what the generation reports back to the handler."""

    speculative: bool
    draft_max: Optional[int]
    user: Optional[str]
    drafter: Optional[str] = None  # lookup, suffix or auto (None: the server's --drafter)
    seeded: bool = False  # sampled with a seed: drafted from its own text only, so the seed reproduces it
    stats: SpecStats = dataclasses.field(default_factory=SpecStats)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    t_prompt: float = 0.0
    t_generate: float = 0.0
    t_arrive: float = dataclasses.field(default_factory=time.perf_counter)   # when the handler read the request
    t_queue: float = 0.0   # from t_arrive until the server began its prompt (queued, or waiting for a free row)
    cancelled: bool = False  # the client went away mid-response
    batched: bool = False  # decoded in a batch (SpeculativeBatchGenerator), not alone
    done: threading.Event = dataclasses.field(default_factory=threading.Event)

    def timings(self) -> dict:
        """llama.cpp's ``timings`` (server.cpp ``result_timings``) plus tokens per decode forward and the
        request's wait before its prompt began (``queue_ms``)."""
        s = self.stats
        prompt_n = self.prompt_tokens - self.cached_tokens
        return {
            "queue_ms": 1e3 * self.t_queue,
            "cache_n": self.cached_tokens, "prompt_n": prompt_n, "prompt_ms": 1e3 * self.t_prompt,
            "prompt_per_second": prompt_n / self.t_prompt if self.t_prompt else 0.0,
            "predicted_n": s.n_tokens, "predicted_ms": 1e3 * self.t_generate,
            "predicted_per_second": s.n_tokens / self.t_generate if self.t_generate else 0.0,
            "draft_n": s.n_drafted, "draft_n_accepted": s.n_accept,
            "decode_forwards": s.steps, "tokens_per_forward": s.tokens_per_forward,
            "speculative": self.speculative,
            "draft_max": 0 if not self.speculative else "auto" if self.draft_max is None else self.draft_max,
            "drafter": self.drafter if self.speculative and self.draft_max != 0 else "none",
        }

    def prediction_details(self) -> dict:
        """OpenAI's ``usage.completion_tokens_details`` names for drafted tokens the model kept / rejected."""
        return {"accepted_prediction_tokens": self.stats.n_accept,
                "rejected_prediction_tokens": self.stats.n_drafted - self.stats.n_accept}


@dataclasses.dataclass
class SpecCompletionRequest(mlx_server.CompletionRequest):
    """mlx-lm's ``CompletionRequest`` carrying the request's :class:`RequestSpec`."""

    spec: Optional[RequestSpec] = None


class _EosCutDrafter:
    """A drafter seeing the whole prompt (the prompt cache's prefix too) that never drafts past an EOS token.

    ``ngram_speculative_generate_step`` resets the drafter with the uncached rest of the prompt; the
    n-gram context cache must count the whole conversation, so ``prefix`` is prepended. Tokens after an
    EOS are never shown to the client, so drafting them would only leave unwanted rows in the cache.
    Wraps any :class:`reference.drafter.Drafter` (lookup, suffix, auto); :attr:`tokens` is what it was
    shown, :attr:`match_length` the inner drafter's (0 if it has none), which the draft policy reads.
    """

    def __init__(self, inner: Drafter, prefix: list[int], eos: set[int]):
        self.inner, self.prefix, self.eos = inner, prefix, eos
        self.tokens: list[int] = list(prefix)

    def reset(self, prompt) -> None:
        self.tokens = self.prefix + [int(t) for t in prompt]
        self.inner.reset(list(self.tokens))

    def extend(self, tokens) -> None:
        tokens = [int(t) for t in tokens]
        self.tokens.extend(tokens)
        self.inner.extend(tokens)

    @property
    def match_length(self) -> int:
        return getattr(self.inner, "match_length", 0)

    def draft(self, n: int) -> list[int]:
        proposal = self.inner.draft(n)
        for i, t in enumerate(proposal):
            if t in self.eos:
                return proposal[:i + 1]
        return proposal


def check_drafter(name, what: str = "drafter") -> None:
    """Refuse a drafter name that is not one of :data:`reference.suffix.auto.DRAFTERS` (ValueError naming them)."""
    if name not in DRAFTERS:
        raise FieldError(what, f"{what} must be one of {', '.join(DRAFTERS)}, got {name!r}")


def _scope_name(key: Optional[str]) -> str:
    """A scope as /v1/stats names it: ``server``, or ``user`` and a hash of the user's name."""
    return "server" if key is None else f"user {hashlib.sha256(key.encode()).hexdigest()[:8]}"


def _scope_file(directory: Path, user: str, suffix: str = ".ngram") -> Path:
    """The file of ``user`` under ``directory``: the dynamic cache (``.ngram``) or the suffix history
    (``.history``) (a hash: user names never appear on disk)."""
    return directory / f"user-{hashlib.sha256(user.encode()).hexdigest()[:32]}{suffix}"


def check_user_files(directory: Path, flag: str, suffix: str, load, what: str) -> None:
    """Read every user's file (``user-*`` + ``suffix``) under ``directory`` once at start with ``load`` (each is
    loaded again, lazily, at that user's first request). Before, a damaged, empty or foreign dynamic cache was
    found only then, inside the generation worker: that one user's request stopped the whole server (exit
    status 1, every request in flight answered 500). Now it is one line before the model loads (ValueError:
    exit status 2)."""
    for file in sorted(directory.glob(f"user-*{suffix}")):
        try:
            load(file)
        except (ValueError, OSError) as exc:
            raise ValueError(f"{flag} {directory}: a user's {what} cannot be read ({exc}); move it "
                             f"away or delete it (that user's {what} then starts empty)") from None


class NgramSpeculator:
    """Server-wide drafting state, plugged in where mlx-lm's server keeps its draft model.

    ``c_st``: a static cache (read only). Dynamic caches ``c_dyn`` learn from every completed response
    (the n-grams whose followers are response tokens) and are used by later requests: one for the whole
    server (``scope="server"``, file ``dynamic``) or one per request ``user`` (``scope="user"``, files
    under the directory ``dynamic``; requests without ``user`` then neither use nor feed one), each of at most
    ``dynamic_max_entries`` entries (0: no limit; see :meth:`_bound`). Saved
    atomically (:func:`mlx_backend.ngram.dynamic_cache.save_dynamic`) every ``save_every`` completed requests,
    but no sooner after a save than (1 - :data:`SAVE_SHARE`) / :data:`SAVE_SHARE` times what it took, and on
    shutdown. Suffix histories (``SuffixHistory``, at most ``history_max_tokens`` tokens each; 0: none)
    hold each completed request's prompt followed by its output, scoped like ``c_dyn``, for the ``suffix``
    and ``auto`` drafters; in memory, or kept in ``history`` (a file, or with ``scope="user"`` a directory)
    like the dynamic caches in ``dynamic`` (:mod:`mlx_backend.suffix.history_file`), each recording the served
    tokenizer once :meth:`use_tokenizer` has named it (until then: unknown, as in the Python API; nothing
    checked). ``drafter``: the drafter requests get unless they name one.
    """

    def __init__(self, *, draft_max: Optional[int] = None, speculative: bool = True, static=None,
                 dynamic: Optional[str] = None, scope: str = "server", save_every: int = 20,
                 drafter: str = DEFAULT_DRAFTER, history_max_tokens: int = HISTORY_MAX_TOKENS,
                 history: Optional[str] = None, max_users: int = 0,
                 dynamic_max_entries: int = DYNAMIC_MAX_ENTRIES):
        if scope not in ("server", "user"):
            raise ValueError(f"--dynamic-scope must be server or user, got {scope!r}")
        if save_every < 1:
            raise ValueError(f"--save-every must be at least 1, got {save_every}")
        if max_users < 0:
            raise ValueError(f"--max-users must be >= 0 (0: no limit), got {max_users}")
        check_max_entries(dynamic_max_entries)
        check_drafter(drafter, "--drafter")
        if history_max_tokens < 0:
            raise ValueError(f"--history-max-tokens must be >= 0 (0: no history), got {history_max_tokens}")
        if history is not None and history_max_tokens == 0:
            raise ValueError("--history keeps the suffix history, but --history-max-tokens 0 keeps none: drop one "
                             "of them")
        self.draft_max, self.speculative, self.scope, self.save_every = draft_max, speculative, scope, save_every
        self.drafter_name, self.history_max_tokens = drafter, history_max_tokens
        # with scope="user": the users whose dynamic cache or history is in memory, least recently used first;
        # beyond max_users (0: no limit) the least recently used one is written to its files and dropped
        self.max_users, self.dynamic_max_entries = max_users, dynamic_max_entries
        self._recent: collections.OrderedDict = collections.OrderedDict()
        self.histories: dict[Optional[str], Any] = {}
        self.static_path, self.c_st = static, None if static is None else load_cache(static)
        self.path = None if dynamic is None else Path(dynamic)
        self.c_dyn: dict[Optional[str], Any] = {}
        self._dirty: set = set()
        self.lock = threading.Lock()
        self.totals = {"requests": 0, "speculative_requests": 0, "completed": 0, "cancelled": 0,
                       "prompt_tokens": 0, "cached_tokens": 0, "completion_tokens": 0, "decode_forwards": 0,
                       "draft_n": 0, "draft_n_accepted": 0, "generation_seconds": 0.0, "dynamic_saves": 0,
                       "drafters": {name: 0 for name in DRAFTERS}, "verify_forwards": 0, "queue_seconds": 0.0,
                       "users_dropped": 0, "dynamic_entries_dropped": 0}
        if self.path is not None and scope == "user":
            self.path.mkdir(parents=True, exist_ok=True)
            check_user_files(self.path, "--dynamic", ".ngram", load_dynamic, "dynamic cache")
        elif self.path is not None:
            self.c_dyn[None] = as_table(load_dynamic(self.path), copy=False)
            self._bound(None, self.c_dyn[None])
        self.history_path = None if history is None else Path(history)
        self._dirty_histories: set = set()
        self.tokenizer = dict(vocab_size=None, fingerprint=None, n_vocab=None)   # use_tokenizer's; None: unknown
        if self.history_path is not None and scope == "user":
            self.history_path.mkdir(parents=True, exist_ok=True)
            check_user_files(self.history_path, "--history", ".history", read_history, "suffix history")
        elif self.history_path is not None:
            self.histories[None] = load_history(self.history_path, self._new_history())
        self._rows = [0, 0]  # rows summed over the verify forwards, the most in one
        self._queue_max = 0.0  # the longest wait of a request before its prompt began
        self._since_save = 0
        self._next_save = 0.0   # no periodic save before this time (_clock; SAVE_SHARE)

    def use_tokenizer(self, vocab_size: Optional[int], fingerprint: Optional[bytes],
                      n_vocab: Optional[int] = None) -> None:
        """The served tokenizer's ``vocab_size`` and ``fingerprint``
        (:func:`reference.ngram.ours_file.tokenizer_fingerprint`) and the token ids its model takes (``n_vocab``),
        known once the model is loaded, after the files were checked at start: recorded in every history, and
        every dynamic cache of our format, saved from now on; the cache files are checked against them now
        (:meth:`_check_cache_files`), and every history file read
        (:func:`mlx_backend.suffix.history_file.read_history`, the cache files' rule): the server's, or every
        user's, now (arrays only, not indexed); a user's again at their first request. A file of another
        tokenizer is a ``ValueError`` naming it, as a damaged one is (``serve``: one line, exit status 2, before
        the first request); one recording no tokenizer (written before this check) is checked by its ids only.
        Before, it was read silently and every draft from it meant other text."""
        self.tokenizer = dict(vocab_size=vocab_size, fingerprint=fingerprint, n_vocab=n_vocab)
        self._check_cache_files()
        if self.history_path is not None and self.scope == "user":
            check_user_files(self.history_path, "--history", ".history",
                             functools.partial(read_history, **self.tokenizer), "suffix history")
        elif self.history_path is not None and self.history_path.exists():
            read_history(self.history_path, **self.tokenizer)

    def _check_cache_files(self) -> None:
        """The n-gram cache files against the served tokenizer, as ``generate`` checks its own
        (:func:`reference.ngram.ours_file.check_file_tokenizer`, headers only): ``--static``, the ``--dynamic``
        file or every user's. A file of our format recording another tokenizer is a ``ValueError`` naming it;
        llama.cpp's format records none. Before, ``serve`` drafted from it silently (``generate`` refused it)."""
        in_use = (self.tokenizer["vocab_size"], self.tokenizer["fingerprint"])
        if self.static_path is not None:
            try:
                check_file_tokenizer(in_use, self.static_path)
            except ValueError as exc:
                raise ValueError(f"--static: {exc}") from None
        if self.path is not None and self.scope == "user":
            check_user_files(self.path, "--dynamic", ".ngram", lambda f: check_file_tokenizer(in_use, f),
                             "dynamic cache")
        elif self.path is not None:
            try:
                check_file_tokenizer(in_use, self.path)
            except ValueError as exc:
                raise ValueError(f"--dynamic: {exc}; or give --dynamic another path") from None

    def _recorded(self) -> Optional[tuple]:
        """``(vocab_size, fingerprint)`` for a cache file to record: the served tokenizer's, once known."""
        known = self.tokenizer["vocab_size"] is not None
        return (self.tokenizer["vocab_size"], self.tokenizer["fingerprint"]) if known else None

    def make_cache(self) -> list:
        """mlx-lm appends the draft model's cache to the model's (``make_prompt_cache``): none here."""
        return []

    def _key(self, user: Optional[str]):
        return None if self.scope == "server" else user

    def dynamic_for(self, user: Optional[str]):
        """The dynamic cache that drafts for ``user`` (``None``: none in use)."""
        if self.scope == "user" and user is None:
            return None
        key = self._key(user)
        if key not in self.c_dyn:
            if self.path is not None and self.scope == "user":
                self.c_dyn[key] = as_table(load_dynamic(_scope_file(self.path, user)), copy=False)
                self._bound(key, self.c_dyn[key])
            else:
                self.c_dyn[key] = HashTable()
        table = self.c_dyn[key]
        self._used(key)
        return table

    def history_for(self, user: Optional[str]):
        """The suffix history that drafts for ``user`` (``None``: none in use, or ``--history-max-tokens 0``)."""
        if (self.scope == "user" and user is None) or self.history_max_tokens == 0:
            return None
        key = self._key(user)
        if key not in self.histories:
            self.histories[key] = self._new_history()
            if self.history_path is not None and self.scope == "user":
                load_history(_scope_file(self.history_path, user, ".history"), self.histories[key],
                             **self.tokenizer)
        history = self.histories[key]
        self._used(key)
        return history

    def _used(self, user: Optional[str]) -> None:
        """``user``'s dynamic cache or history is in use now. Keep at most ``max_users`` users' in memory: the
        least recently used one is written to its files (``--dynamic``, ``--history``; read back at its next
        request) and dropped; without files what it learned is forgotten. Before, every ``user`` seen since start
        stayed in memory (~47 KB each after one short request, up to ``--history-max-tokens`` of history each)
        and in ``/v1/stats``. A user whose file cannot be written stays (logged; tried again later)."""
        if self.scope != "user" or user is None or not self.max_users:
            return
        self._recent[user] = None
        self._recent.move_to_end(user)
        while len(self._recent) > self.max_users:
            oldest = next(iter(self._recent))
            try:
                self.save(only={oldest})
            except Exception:  # noqa: BLE001  (logged by save; that user stays in memory, saved later)
                self._recent.move_to_end(oldest)
                return
            self.c_dyn.pop(oldest, None)
            self.histories.pop(oldest, None)
            self._dirty.discard(oldest)
            self._dirty_histories.discard(oldest)
            del self._recent[oldest]
            with self.lock:
                self.totals["users_dropped"] += 1

    def _new_history(self):
        return suffix_api().SuffixHistory(self.history_max_tokens)

    def drafter(self, user: Optional[str], prefix: list[int], eos: set[int], name: Optional[str] = None,
                shared: bool = True) -> Drafter:
        """The drafter ``name`` (None: ``--drafter``) for ``user``: ``lookup`` over the static and the user's
        dynamic cache (llama.cpp's, as always), ``suffix`` over the user's history, ``auto`` over both.
        ``shared=False``: without what earlier requests taught (dynamic cache, history), so that the drafts,
        and with them a seeded sampled answer, depend on the request alone."""
        name = name or self.drafter_name
        c_dyn = self.dynamic_for(user) if shared else None
        # the drafter reads the scope's table itself, not a copy: a copy cost every request time and memory in
        # proportion to everything the server has learned (1.1 s and 368 MiB per row at 2.4 M entries), and the
        # table only changes in finish(), on this (generation) thread, between two drafts
        if name == "lookup":
            inner = lookup_drafter(c_st=self.c_st, c_dyn=c_dyn, share_dyn=True)
        else:
            inner = make_drafter(name, c_st=self.c_st, c_dyn=c_dyn if name == "auto" else None,
                                 history=self.history_for(user) if shared else None, share_dyn=True)
        return _EosCutDrafter(inner, prefix, eos)

    def finish(self, spec: RequestSpec, full: list[int], n_prompt: int, completed: bool) -> None:
        """Count the request; if it completed, learn its response n-grams and add ``full`` (its prompt, then
        its output) to the suffix history; save every ``save_every``."""
        s = spec.stats
        with self.lock:
            t = self.totals
            t["requests"] += 1
            t["speculative_requests"] += spec.speculative
            t["completed" if completed else "cancelled"] += 1
            t["prompt_tokens"] += spec.prompt_tokens
            t["cached_tokens"] += spec.cached_tokens
            t["completion_tokens"] += s.n_tokens
            t["decode_forwards"] += s.steps
            t["draft_n"] += s.n_drafted
            t["draft_n_accepted"] += s.n_accept
            t["generation_seconds"] += spec.t_generate
            t["queue_seconds"] += spec.t_queue
            self._queue_max = max(self._queue_max, spec.t_queue)
            if spec.speculative and spec.draft_max != 0:
                t["drafters"][spec.drafter or self.drafter_name] += 1
            if not spec.batched:  # decoded alone: each of its decode forwards held one row
                t["verify_forwards"] += s.steps
                self._rows[0] += s.steps
                self._rows[1] = max(self._rows[1], 1 if s.steps else 0)
        if not completed or (self.scope == "user" and spec.user is None):
            return
        history = self.history_for(spec.user)
        if history is not None:
            history.add(full)
            self._dirty_histories.add(self._key(spec.user))
        if len(full) > n_prompt:   # else no output: nothing to learn (and a cache still empty has no file to save)
            table = self.dynamic_for(spec.user)
            table.update(np.asarray(full, np.int32), n_prompt, len(full))
            self._dirty.add(self._key(spec.user))
            self._bound(self._key(spec.user), table)
        self._since_save += 1
        if ((self.path is not None or self.history_path is not None) and self._since_save >= self.save_every
                and _clock() >= self._next_save):
            start = _clock()
            try:
                self.save()
            finally:   # saving took at most SAVE_SHARE of the time until the next one: 2 s, then 38 s without
                self._next_save = start + (_clock() - start) / SAVE_SHARE

    def _bound(self, key, table) -> None:
        """Keep the dynamic cache ``table`` (scope ``key``) within ``dynamic_max_entries`` (0: no limit). Until a
        cache holds more it is llama.cpp's, unchanged; a response (or a file loaded) that takes it over the bound
        leaves it with the ``N - N // 4`` entries of the largest counts, the latest learned first among equal
        counts, their counts unchanged (:meth:`HashTable.keep_most_counted`; the n-grams left without a follower
        go too), and room for the next ``N // 4`` without growing. A quarter at once: each rebuild costs time in
        proportion to the cache (~1 s at 2 M entries), so it comes once per ``N // 4`` entries learned, not at
        every request. Before, a cache grew without bound (148-591 bytes per learned token; 5 M random tokens:
        2.95 GB, a save 25 s)."""
        n = self.dynamic_max_entries
        if not n or table.n_entries() <= n:
            return
        start, before = time.perf_counter(), table.n_entries()
        keep = n - n // 4
        dropped = table.keep_most_counted(keep, room=n + n // 4 - keep)
        self._dirty.add(key)
        with self.lock:
            self.totals["dynamic_entries_dropped"] += dropped
        log.info("the dynamic n-gram cache (%s) went over --dynamic-max-entries %d (%d entries): kept the %d most "
                 "counted, dropped %d (%.2f s)", _scope_name(key), n, before, table.n_entries(), dropped,
                 time.perf_counter() - start)

    def count_forward(self, rows: int) -> None:
        """One batched verify forward over ``rows`` rows (``/v1/stats`` ``verify_forwards``, ``rows_per_forward``)."""
        with self.lock:
            self.totals["verify_forwards"] += 1
            self._rows[0] += rows
            self._rows[1] = max(self._rows[1], rows)

    def save(self, only: Optional[set] = None) -> None:
        """Write every changed dynamic cache, and suffix history kept in a file (of the users in ``only``, if
        given), to its file atomically. One
        that cannot be written stays changed (written at the next save) and its file keeps its last save; the
        others are still written, then the first failure is raised (before: the first failure stopped the loop,
        so with ``--dynamic-scope user`` one user's unwritable file lost every later user's save)."""
        failures = []
        if self.path is not None:
            # a user's file (named by a hash, read by nothing but this server) is written in our format: a
            # llama.cpp-format one was parsed and sorted at every start and first request (~34 ms a file: 310 s
            # to start with 9,000 users) and left a converted copy of itself in the user's cache directory
            saved = self._write_changed("dynamic n-gram cache", self.path, ".ngram", self._dirty, failures, only,
                                        lambda path, key: save_dynamic(path, self.c_dyn[key], None,
                                                                       ours=self.scope == "user",
                                                                       tokenizer=self._recorded()))
            if saved:
                with self.lock:
                    self.totals["dynamic_saves"] += 1
        if self.history_path is not None:
            self._write_changed("suffix history", self.history_path, ".history", self._dirty_histories, failures,
                                only, lambda path, key: save_history(path, self.histories[key],
                                                                     self.tokenizer["vocab_size"],
                                                                     self.tokenizer["fingerprint"]))
        if only is None:
            self._since_save = 0
        if failures:
            raise failures[0]

    def _write_changed(self, what: str, folder: Path, suffix: str, dirty: set, failures: list, only, write) -> int:
        """``write(path, key)`` for every scope ``key`` in ``dirty``, each to its file (``folder`` itself with
        ``scope="server"``); the written ones leave ``dirty``, a failure is logged and appended to ``failures``.
        Returns how many were written."""
        saved = 0
        for key in sorted(dirty if only is None else dirty & only, key=str):
            path = folder if self.scope == "server" else _scope_file(folder, key, suffix)
            try:
                write(path, key)
            except Exception as exc:
                log.error("the %s %s cannot be saved (%s: %s); the file keeps its last save",
                          what, path, type(exc).__name__, exc)
                failures.append(exc)
                continue
            dirty.discard(key)
            saved += 1
        if saved:
            (log.info if only is None else log.debug)("saved %d %s(s) to %s", saved, what, folder)
        return saved

    def stats(self) -> dict:
        """Totals since start (``GET /v1/stats``)."""
        with self.lock:
            t = dict(self.totals, drafters=dict(self.totals["drafters"]))
            n = t["verify_forwards"]
            t["rows_per_forward"] = {"mean": self._rows[0] / n if n else 0.0, "max": self._rows[1]}
            t["queue_wait"] = {"mean": t["queue_seconds"] / t["requests"] if t["requests"] else 0.0,
                               "max": self._queue_max}
        t["accept"] = 100.0 * t["draft_n_accepted"] / t["draft_n"] if t["draft_n"] else 0.0
        t["tokens_per_forward"] = t["completion_tokens"] / t["decode_forwards"] if t["decode_forwards"] else 0.0
        t["accepted_per_row_step"] = t["draft_n_accepted"] / t["decode_forwards"] if t["decode_forwards"] else 0.0
        t["predicted_per_second"] = (t["completion_tokens"] / t["generation_seconds"]
                                     if t["generation_seconds"] else 0.0)
        t["dynamic_caches"] = {_scope_name(k): {"ngrams": len(v), "entries": v.n_entries(),
                                                "bytes": sum(a.nbytes for a in v.T)}
                               for k, v in list(self.c_dyn.items())}
        t["suffix_histories"] = {_scope_name(k): {"tokens": v.n_tokens} for k, v in list(self.histories.items())}
        t["draft_max"] = "auto" if self.draft_max is None else self.draft_max
        t["drafter"], t["history_max_tokens"] = self.drafter_name, self.history_max_tokens
        t["dynamic_max_entries"] = self.dynamic_max_entries
        t["speculative"] = self.speculative
        return t


class HeldPromptCache(LRUPromptCache):
    """mlx-lm's LRU of prompt caches, storing a cache under the tokens it really holds when told (:meth:`hold`),
    and never handing out one that holds the whole prompt (:meth:`fetch_nearest_cache`)."""

    _held: Optional[tuple[list, list[int]]] = None

    def fetch_nearest_cache(self, model, tokens):
        """mlx-lm's nearest cache and the tokens left to feed, except that a cache holding the whole prompt (its
        exact hit: an earlier prompt and its whole answer sent again) leaves one token to feed, as a generator
        needs: the last token trimmed off an attention cache; a recurrent state cannot be trimmed, so none (the
        prompt is prefilled afresh). So the cached tokens reported are the ones reused. Before, serving one
        request at a time got nothing to feed (HTTP 400; plain ``mlx_lm.server`` 0.32.2 drops the connection)."""
        cache, rest = super().fetch_nearest_cache(model, tokens)
        if cache is not None and not len(rest) and len(tokens):
            return feed_the_last(cache, tokens)
        return cache, rest

    def hold(self, prompt_cache: list, tokens: list[int]) -> None:
        """The next :meth:`insert_cache` of ``prompt_cache`` stores it under ``tokens``."""
        self._held = (prompt_cache, tokens)

    def insert_cache(self, model, tokens, prompt_cache, **kwargs):
        held, self._held = self._held, None
        if held is not None and held[0] is prompt_cache:
            tokens = held[1]
        super().insert_cache(model, tokens, prompt_cache, **kwargs)


def held_tokens(prompt_cache: list, n_fed: int) -> int:
    """How many tokens the cache holds after a request served alone: the offset of its attention layers, read
    from the cache itself; for a model without one (Mamba, Mamba2, RWKV7: recurrent states only, no length to
    read) ``n_fed``, the prompt and every token the client got. Both generators leave exactly those in a cache
    they were given: mlx-lm's ``generate_step`` feeds each token before yielding it, and a speculative run
    feeds the last one at its end (``_Run.finish`` in :mod:`mlx_backend.decode.generate`) and keeps no more
    drafts than its consumer took."""
    return next((c.offset for c in prompt_cache if hasattr(c, "offset")), n_fed)


class InjectedModelProvider(mlx_server.ModelProvider):
    """mlx-lm's ``ModelProvider`` holding a model loaded by us (a GGUF file or an mlx-lm directory).

    ``is_batchable`` (mlx-lm's switch between its batched loop and ``_serve_single``) is true when
    ``--decode-concurrency`` > 1 and :class:`~mlx_backend.batch.generate.BatchSpeculativeDecoder` supports
    the model's caches; ``unbatched_reason`` says why not otherwise."""

    def __init__(self, cli_args, model, tokenizer, model_id: str, speculator: NgramSpeculator):
        super().__init__(cli_args)
        self.model_id = model_id
        self._served = (model, tokenizer, speculator)
        concurrency = getattr(cli_args, "decode_concurrency", 1)
        self.unbatched_reason = (f"--decode-concurrency {concurrency}" if concurrency <= 1
                                 else batch_unsupported(model))
        self.n_vocab = vocab_size(model)   # read by every request's checks: once, not a walk of the modules each
        self._install()

    def _install(self) -> None:
        self.model, self.tokenizer, self.draft_model = self._served
        self.model_key, self.processor = (self.model_id, None, None), None
        self.is_batchable = self.unbatched_reason is None

    def load(self, model_path, adapter_path=None, draft_model_path=None):
        if model_path not in ("default_model", self.model_id):
            raise ModelNotServed(f"The model `{model_path}` does not exist on this server; it serves "
                                 f"`{self.model_id}`")
        if adapter_path is not None or draft_model_path not in (None, "default_model"):
            raise ModelNotServed("this server serves no adapters or draft models (n-gram speculation needs none)")
        if self.model is None:
            self._install()
        return self.model, self.tokenizer


def _rebind(function, **names):
    """``function`` with the global ``names`` bound to other objects (its own module is left unchanged)."""
    scope = dict(function.__globals__, **names)
    out = types.FunctionType(function.__code__, scope, function.__name__, function.__defaults__, function.__closure__)
    out.__kwdefaults__ = function.__kwdefaults__
    return out


class SpecResponseGenerator(mlx_server.ResponseGenerator):
    """mlx-lm's ``ResponseGenerator``; its single-sequence path generates with n-gram speculation.

    Failures follow mlx-lm's split between one request's error and the generation thread's death, the
    latter made fatal. A request's own error stays that request's (mlx-lm answers it; the server keeps
    serving): anything raised while the request is set up (validation, chat template, tokenization, a
    :class:`RequestError`) and a ``ValueError`` raised by its generation (mlx and mlx-lm's samplers raise
    ``ValueError`` for arguments they refuse, e.g. a ``top_k`` beyond the vocabulary). Any other exception
    raised by the generation itself (prefill, model forwards, the n-gram drafter, verification, rollback,
    the dynamic cache) or escaping mlx-lm's generation loop is the worker's failure: the shared state
    (prompt caches, dynamic caches, mlx's streams) is in an unknown state and every later request would
    meet the same broken model, BLAS or code. It is logged with its traceback, the request in flight and
    every waiting one are answered with HTTP 500 (:class:`WorkerFailure`, naming the exception), the HTTP
    server stops accepting connections and ``run_serve`` returns 1, for a supervisor to restart it.

    Batched (mlx-lm's ``_generate`` loop with :class:`~mlx_backend.batch.server_batch.SpeculativeBatchGenerator`):
    the same split. A request's setup errors, and a ``ValueError`` of its sampler or logits processors
    (tried on a dummy row in :meth:`_tokenize`, :meth:`_check_sampling`), are its own; any exception of the
    shared step escapes mlx-lm's loop and is the worker's failure (the requests in the batch get their 500
    from ``_await_response`` once the thread is marked failed).
    """

    def __init__(self, model_provider: InjectedModelProvider, prompt_cache: HeldPromptCache,
                 n_ctx: Optional[int] = None):
        self.n_ctx = n_ctx
        self._current: Optional[tuple[SpecCompletionRequest, list[int]]] = None
        self.failure: Optional[BaseException] = None  # the worker's failure, once it failed
        self.failed = threading.Event()  # set once the waiting requests have been answered with it
        self._answering = threading.Condition()
        self._n_answering = 0
        serve_single = types.MethodType(
            _rebind(mlx_server.ResponseGenerator._serve_single, stream_generate=self.stream_generate), self)

        def serve_single_or_fail(request, stream):
            serve_single(request, stream)  # a failure of the generation is already that request's answer
            if self.failure is not None:
                raise self.failure  # out of mlx-lm's generation loop: the worker stops (_run_generate)

        self._serve_single = serve_single_or_fail
        self._generate = types.MethodType(
            _rebind(mlx_server.ResponseGenerator._generate, BatchGenerator=self._batch_generator), self)
        super().__init__(model_provider, prompt_cache)

    def _batch_generator(self, model, *, completion_batch_size: int, prefill_step_size: int, stream=None, **_):
        """What mlx-lm's ``_generate`` builds instead of its ``BatchGenerator`` (one per batch it serves)."""
        return SpeculativeBatchGenerator(model, plan=self._plan_row, completion_batch_size=completion_batch_size,
                                         on_forward=self.model_provider.draft_model.count_forward,
                                         prefill_step_size=prefill_step_size, stream=stream)

    def _plan_row(self, cached: list[int], prompt: list[int]) -> RowPlan:
        """A batched request's drafter and draft length, and what its finish records (its metrics, then
        :meth:`NgramSpeculator.finish`: totals, dynamic cache, suffix history). The request is the one
        :meth:`_tokenize` saw last: mlx-lm's loop inserts each request right after tokenizing it, in the same
        (generation) thread. Draft length: the request's ``draft_max`` (default ``--draft-max``), else the
        cost-aware width of the batch (:mod:`mlx_backend.batch.policy`)."""
        request, _ = self._current
        spec, speculator = request.spec, self.model_provider.draft_model
        spec.batched, spec.prompt_tokens, spec.cached_tokens = True, len(prompt), len(cached)
        drafter, draft_max = None, 0
        if spec.speculative and spec.draft_max != 0:
            draft_max = spec.draft_max
            drafter = speculator.drafter(spec.user, [], set(self.model_provider.tokenizer.eos_token_ids),
                                         spec.drafter, shared=not spec.seeded)
        else:
            spec.speculative = False

        def on_finish(report: RowReport) -> None:
            s = spec.stats
            s.n_tokens, s.steps, s.n_drafted, s.n_accept = (len(report.output), report.steps, report.n_drafted,
                                                            report.n_accept)
            spec.t_prompt, spec.t_generate = report.t_prompt, report.t_generate
            started = report.t_start if report.t_start is not None else time.perf_counter()   # None: never began
            spec.t_queue = max(0.0, started - spec.t_arrive)
            try:
                speculator.finish(spec, prompt + report.output, len(prompt), report.completed and not spec.cancelled)
            finally:
                spec.done.set()

        return RowPlan(drafter, draft_max, on_finish)

    def _check_sampling(self, tokenizer, args, prompt: list[int]) -> None:
        """Run a batched request's logits processors and sampler once on a dummy row. In a batch they run
        inside the shared step, where a ``ValueError`` (an argument mlx refuses only there) would be the
        worker's failure; here it stays the request's own error (HTTP 400), as in ``_serve_single``."""
        n_vocab = self.model_provider.n_vocab
        if n_vocab is None:
            return
        logits = mx.zeros((1, n_vocab))
        try:
            for processor in mlx_server._make_logits_processors(args):
                logits = processor(mx.array(prompt[-1:] or [0]), logits)
            mx.eval(mlx_server._make_sampler(args, tokenizer)(logits))
        except ValueError as exc:   # raised before the request's answer began: a RequestError is answered 400
            raise RequestError(str(exc)) from exc

    def _run_generate(self):
        """mlx-lm's generation thread (its ``_generate`` loop), failing the server if it raises, and
        destroying the mlx streams it made before it ends: a thread-local stream left to the thread's
        teardown can abort the process at exit (mlx's ``clear_streams``)."""
        try:
            self._generate()
        except BaseException as exc:  # noqa: BLE001 (whatever ends the worker fails the server)
            self._fail(exc)
        finally:
            mx.clear_streams()

    def _fail(self, exc: BaseException) -> None:
        """The worker failed with ``exc``: log it, answer every waiting request, let the server stop."""
        self.failure = self.failure or exc
        self._generation_failed = True  # mlx-lm's flag: /health answers 503, new requests are refused
        log.critical("the generation worker failed: %s: %s. Requests in flight and waiting are answered with "
                     "HTTP 500; the server stops (exit status 1)", type(exc).__name__, exc, exc_info=exc)
        error = self.failure_error()
        while True:  # a request queued after this is refused by _await_response within its 1 s poll
            try:
                rqueue = self.requests.get_nowait()[0]
            except QueueEmpty:
                break
            rqueue.put(error)
        self.failed.set()

    def failure_error(self) -> WorkerFailure:
        f = self.failure
        return WorkerFailure(f"the server's generation worker failed ({type(f).__name__}: {f}); the server "
                             "is stopping")

    def generate(self, request, generation_args, progress_callback=None):
        if self.failure is not None:
            raise self.failure_error()
        if self.stopping:
            raise ServerStopping(STOPPING)
        return super().generate(request, generation_args, progress_callback)

    def _await_response(self, response_queue):
        try:
            return super()._await_response(response_queue)
        except RuntimeError:  # mlx-lm's "generation thread died"
            if self.failure is not None:
                raise self.failure_error() from None
            if self.stopping:
                raise ServerStopping(STOPPING) from None
            raise

    stopping = False

    def stop_and_join(self):
        """Stop the generation thread (Ctrl-C, SIGTERM): a batch stops after its current step, a request
        served alone (``_serve_single``) is finished first. Every request it had not finished, decoding or
        waiting, is then answered with :class:`ServerStopping` by its handler (:meth:`_await_response`
        notices the thread has ended within its 1 s poll); ``run_serve`` waits for those answers
        (:meth:`wait_answered`) before the process exits, so no client is left with an answer cut short
        without an error."""
        self.stopping = True
        super().stop_and_join()

    @contextlib.contextmanager
    def answering(self):
        """Held by each request's handler while it answers (:meth:`wait_answered` waits for none left)."""
        with self._answering:
            self._n_answering += 1
        try:
            yield
        finally:
            with self._answering:
                self._n_answering -= 1
                self._answering.notify_all()

    def wait_answered(self, timeout: float) -> bool:
        with self._answering:
            return self._answering.wait_for(lambda: self._n_answering == 0, timeout)

    def _tokenize(self, tokenizer, request, args):
        result = super()._tokenize(tokenizer, request, args)
        prompt = result[0]
        if self.n_ctx is not None and len(prompt) + args.max_tokens > self.n_ctx:
            raise RequestError(
                f"This model's maximum context length is {self.n_ctx} tokens; the request needs "
                f"{len(prompt) + args.max_tokens} ({len(prompt)} in the prompt + {args.max_tokens} max_tokens): "
                "shorten the prompt or lower max_tokens")
        batched = self.model_provider.is_batchable and self._is_batchable(args)
        if batched:
            self._check_sampling(tokenizer, args, prompt)
        waiting = self.requests.qsize()
        if waiting and not self.model_provider.is_batchable:
            log.info("%d more request(s) waiting: requests are served one at a time (%s; docs/server.md)", waiting,
                     self.model_provider.unbatched_reason)
        self._current = (request, list(prompt))
        return result

    def stream_generate(self, *args, **kwargs):
        """What ``_serve_single`` calls instead of ``mlx_lm.generate.stream_generate``
        (:meth:`_stream_generate`); an exception other than a ``ValueError`` is the worker's failure."""
        try:
            yield from self._stream_generate(*args, **kwargs)
        except ValueError:  # this request's (RequestError, or arguments mlx refuses): the server keeps serving
            raise
        except Exception as exc:
            self.failure = exc
            raise self.failure_error() from exc

    def _stream_generate(self, model, tokenizer, prompt, max_tokens, draft_model=None, num_draft_tokens=None,
                         prompt_cache=None, **kwargs):
        """``draft_model`` is the :class:`NgramSpeculator`; the request and its full prompt come from
        :meth:`_tokenize`, called just before by ``_serve_single`` in the same (generation) thread.
        """
        request, full = self._current
        spec, speculator = request.spec, draft_model
        rest = [int(t) for t in prompt]
        n_cached = len(full) - len(rest)
        spec.prompt_tokens, spec.cached_tokens = len(full), n_cached
        drafter = None
        if spec.speculative and spec.draft_max != 0:
            if kwargs.get("input_embeddings") is not None:
                raise RequestError("images are not supported by ngram-spec serve")
            drafter = speculator.drafter(spec.user, full[:n_cached], set(tokenizer.eos_token_ids), spec.drafter,
                                         shared=not spec.seeded)
            if spec.seeded and spec.draft_max is None:
                # the cost-aware length changes as the policy learns, and with it the random draws of the
                # verification: a seeded request verifies a fixed length so that the seed reproduces it
                spec.draft_max = SEEDED_DRAFT_MAX
            responses = spec_stream_generate(
                model, tokenizer, mx.array(rest), max_tokens, sampler=kwargs.get("sampler"),
                logits_processors=kwargs.get("logits_processors"), prompt_cache=prompt_cache,
                prefill_step_size=kwargs.get("prefill_step_size", 2048), draft_max=spec.draft_max,
                drafter=drafter, stats=spec.stats, prompt_progress_callback=kwargs.get("prompt_progress_callback"),
                **({"stream": kwargs["stream"]} if "stream" in kwargs else {}))   # mlx-lm's server's stream
        else:
            spec.speculative = False
            responses = plain_stream_generate(model, tokenizer, mx.array(rest), max_tokens,
                                              prompt_cache=prompt_cache, **kwargs)
        yielded: list[int] = []
        completed = False
        t0 = t1 = time.perf_counter()
        spec.t_queue = max(0.0, t0 - spec.t_arrive)
        try:
            for response in responses:
                if not yielded:
                    t1 = time.perf_counter()
                    spec.t_prompt = t1 - t0
                yielded.append(int(response.token))
                yield response
            completed = True
        except GeneratorExit:  # _serve_single stopped reading: finished (EOS, length, stop word) or client gone
            completed = not spec.cancelled
            raise
        finally:
            responses.close()
            spec.t_generate = time.perf_counter() - t1
            if drafter is None:
                spec.stats.n_tokens = spec.stats.steps = len(yielded)
                history = full + yielded
            else:
                # the tokens the client got: a step is counted whole, but one that accepted a drafted EOS
                # also holds the model's token after it, which no one sees
                spec.stats.n_tokens = min(spec.stats.n_tokens, len(yielded))
                history = [int(t) for t in drafter.tokens]
            self.prompt_cache.hold(prompt_cache, history[:held_tokens(prompt_cache, len(full) + len(yielded))])
            try:
                speculator.finish(spec, full + yielded, len(full), completed)
            finally:
                spec.done.set()


def check_request_fields(body: dict, logit_bias: dict | None, n_vocab: int | None) -> None:
    """The fields mlx-lm takes without checking their type or range, each a ``ValueError`` (HTTP 400) here.
    Before, each one of these failed later: an empty prompt, or a ``stop`` that is not text, in the batched
    generation worker, which stopped the whole server (exit 1); a ``logit_bias`` id outside the vocabulary
    wrote past the logits (a segmentation fault on a later request); ``tools``, ``chat_template_kwargs`` or
    a content part other than text in mlx-lm's tokenization (HTTP 404). Checked here too, where mlx-lm decided
    silently: a bool given for an integer (``"max_tokens": true`` was 1), and ``max_tokens`` and
    ``max_completion_tokens`` that disagree (``max_completion_tokens`` won)."""
    for name in INT_FIELDS:
        if isinstance(body.get(name), bool):
            raise FieldError(name, f"{name} must be an integer, got {json.dumps(body[name])}")
    check_same_setting({k: body[k] for k in ("max_tokens", "max_completion_tokens") if body.get(k) is not None})
    if "prompt" in body and not isinstance(body["prompt"], str):
        raise FieldError("prompt", "prompt must be a string")
    if body.get("prompt") == "":
        raise FieldError("prompt", "prompt is empty: give at least one character")
    stop = body.get("stop")
    if stop is not None and not (isinstance(stop, str) or (isinstance(stop, list)
                                                           and all(isinstance(x, str) for x in stop))):
        raise FieldError("stop", "stop must be a string or a list of strings")
    for name, kind in (("tools", list), ("chat_template_kwargs", dict), ("stream_options", dict),
                       ("role_mapping", dict)):
        if body.get(name) is not None and not isinstance(body[name], kind):
            raise FieldError(name, f"{name} must be {'a list' if kind is list else 'an object'}")
    if isinstance(body.get("tools"), list) and not all(isinstance(t, dict) for t in body["tools"]):
        raise FieldError("tools", "tools must be a list of objects")
    for i, message in enumerate(body.get("messages") or []):
        content = message.get("content")
        if not (content is None or isinstance(content, str) or (isinstance(content, list) and all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content))):
            raise FieldError("messages", f"messages[{i}].content must be text, or a list of text parts "
                             '({"type": "text", "text": "..."}): this server reads text only')
    for token, bias in (logit_bias or {}).items():
        if token < 0 or (n_vocab is not None and token >= n_vocab):
            raise FieldError("logit_bias", f"logit_bias token id {token} is outside the vocabulary (ids 0..{(n_vocab or 2**31) - 1})")
        if not math.isfinite(bias):
            raise FieldError("logit_bias", f"logit_bias of token {token} must be a finite number")


class _DepthCheckedJSON:
    """The ``json`` that mlx-lm's ``APIHandler.do_POST`` parses the body with: a body nested deeper than Python's
    parser goes (``[[[...]]]``, a ``RecursionError``, which escaped ``do_POST`` and dropped the connection with no
    answer) is a ``JSONDecodeError`` like any malformed body, answered by mlx-lm with 400 ``Invalid JSON in request
    body: ...``."""

    JSONDecodeError = json.JSONDecodeError
    dumps = staticmethod(json.dumps)

    @staticmethod
    def loads(text: str):
        try:
            return json.loads(text)
        except RecursionError:
            raise json.JSONDecodeError("Nested too deeply to parse", text, 0) from None


class SpecAPIHandler(mlx_server.APIHandler):
    """mlx-lm's ``APIHandler`` plus the speculation fields, metrics in every response, ``GET /v1/stats``
    and OpenAI-style error bodies (``{"error": {"message", "type", "param", "code"}}``)."""

    _status = 0  # the status sent, 0 before any
    _error: Optional[BaseException] = None  # the exception being answered, if any
    _headers_sent = False
    spec: Optional[RequestSpec] = None

    def setup(self):
        super().setup()
        self.wfile = _OpenAIErrorBodies(self.wfile, self)

    def send_response(self, code, message=None):
        # mlx-lm answers every failure of a request's setup with 404 (meant for "model not found"); a
        # RequestError raised in the generation thread (e.g. a prompt beyond the context) is the client's: 400
        # (a WorkerFailure: 500, ServerStopping: 503)
        exc = sys.exc_info()[1]
        if code == 404 and isinstance(exc, (RequestError, WorkerFailure, ServerStopping)):
            code = exc.status
        self._status, self._error = code, exc
        super().send_response(code, message)

    def end_headers(self):
        self._headers_sent = True
        super().end_headers()

    _mlx_do_POST = _rebind(mlx_server.APIHandler.do_POST, json=_DepthCheckedJSON)

    def do_POST(self):
        with self.response_generator.answering():
            try:
                self._mlx_do_POST()
            except (ValueError, AssertionError) as exc:  # mlx-lm 0.32.0 lets bad-request errors escape do_POST
                if self._status:
                    raise
                self._set_completion_headers(400)
                self.end_headers()
                self.wfile.write(json.dumps({"error": str(exc)}).encode())

    def handle_completion(self, request, stop_words):
        """mlx-lm's, answering an error raised once the response has begun (mlx-lm lets it escape and the
        connection is dropped): an error response if nothing was sent yet, else a last ``data: {"error":
        ...}`` event (the ``openai`` client raises it as an ``APIError``); then the connection is closed.
        The request is stopped as soon as its client hangs up (:class:`_HangUpWatch`), streamed or not."""
        shared = self.response_generator
        self.response_generator = _HangUpWatch(shared, self)
        try:
            super().handle_completion(request, stop_words)
        except Exception as exc:
            if isinstance(exc, OSError):  # writing failed: the client went away, there is no one to answer
                raise
            status = getattr(exc, "status", 400 if isinstance(exc, ValueError) else 500)
            if isinstance(exc, ServerStopping):
                log.info("request cut short: the server is stopping")
            elif not isinstance(exc, WorkerFailure):  # the worker logged its own failure
                log.error("request failed: %s: %s", type(exc).__name__, exc, exc_info=exc)
            error = {"message": str(exc), "type": _ERROR_TYPES.get(status, "server_error"),
                     "param": getattr(exc, "param", None), "code": None}
            self.close_connection = True
            if self._headers_sent:  # a stream has begun (a whole non-streamed answer was sent: nothing to add)
                if self.stream:
                    self.wfile.write(f"data: {json.dumps({'error': error})}\n\n".encode())
                    self.wfile.flush()
            else:  # the success headers are still buffered: replace them
                self._headers_buffer = []
                self._json(status, {"error": error})
        finally:
            self.response_generator = shared  # the next request on this connection wraps it anew

    def validate_model_parameters(self) -> None:
        super().validate_model_parameters()
        body = self.body
        if self.max_tokens < 1:  # mlx-lm 0.32.0 accepts 0 and then fails mid-response
            raise FieldError("max_tokens", "max_tokens must be at least 1")
        unknown = sorted(set(body) - MLX_LM_FIELDS - SPEC_FIELDS - OPENAI_FIELDS)
        if unknown:
            raise ValueError(f"Unrecognized request argument(s) supplied: {', '.join(unknown)}")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, float) and not math.isfinite(value):
                raise FieldError(name, f"{name} must be a finite number")
        if body.get("n", 1) != 1:
            raise FieldError("n", "n must be 1 (one choice per request)")
        if body.get("tool_choice", "auto") not in ("auto", "none"):
            raise FieldError("tool_choice", "tool_choice must be 'auto' or 'none' on this server")
        if "messages" in body and not (isinstance(body["messages"], list) and body["messages"]
                                       and all(isinstance(m, dict) and "role" in m for m in body["messages"])):
            raise FieldError("messages", "messages must be a non-empty list of objects with a role")
        check_request_fields(body, self.logit_bias, self.response_generator.model_provider.n_vocab)
        if self.seed is not None and not 0 <= self.seed < 2 ** 64:  # mx.random.seed's range
            raise FieldError("seed", "seed must be an integer in 0..2**64-1")
        user = body.get("user")
        if user is not None and not isinstance(user, str):
            raise FieldError("user", "user must be a string")
        speculator = self.response_generator.model_provider.draft_model
        speculative = body.get("speculative", speculator.speculative)
        if not isinstance(speculative, bool):
            raise FieldError("speculative", "speculative must be true or false")
        given = {k: body[k] for k in ("draft_max", "n_draft", "num_draft_tokens") if k in body}
        for name, value in given.items():
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise FieldError(name, f"{name} must be an integer >= 0, or null for the cost-aware choice")
            if value is not None and value > max(DEFAULT_K_MAX, speculator.draft_max or 0):
                # one request's fixed width is every batched row's: a client may not make all forwards wide
                raise FieldError(name, f"{name} must be at most {max(DEFAULT_K_MAX, speculator.draft_max or 0)} "
                                       "(the cost-aware choice's limit, or the server's --draft-max if larger), "
                                       f"got {value}")
        check_same_setting(given)
        if body.get("speculative") is False:
            drafts = [f"{k}: {json.dumps(body[k])}" for k in (*given, "drafter")
                      if body.get(k) is not None and body[k] != 0]  # fields asking for speculation
            if drafts:
                raise FieldError("speculative", f"speculative: false and {' and '.join(drafts)} contradict each "
                                                "other; give one of them")
        draft_max = next(iter(given.values())) if given else speculator.draft_max
        drafter = body.get("drafter")
        drafter = speculator.drafter_name if drafter is None else drafter
        check_drafter(drafter)
        self.spec = RequestSpec(speculative=speculative, draft_max=draft_max, user=user, drafter=drafter,
                                seeded=self.seed is not None and self.temperature > 0)

    def _with_spec(self, request) -> SpecCompletionRequest:
        fields = {f.name: getattr(request, f.name) for f in dataclasses.fields(mlx_server.CompletionRequest)}
        return SpecCompletionRequest(**fields, spec=self.spec)

    def handle_chat_completions(self):
        return self._with_spec(super().handle_chat_completions())

    def handle_text_completions(self):
        return self._with_spec(super().handle_text_completions())

    def _metrics(self, response: dict) -> dict:
        if self.spec is not None:
            self.spec.done.wait(5.0)  # the generation thread has finished the request's statistics
            response["timings"] = self.spec.timings()
            if "usage" in response:
                response["usage"]["completion_tokens_details"] = self.spec.prediction_details()
        return response

    def generate_response(self, text, finish_reason, *args, **kwargs):
        response = super().generate_response(text, finish_reason, *args, **kwargs)
        self._fix_top_logprobs(response, kwargs.get("tokens"), kwargs.get("token_logprobs"), kwargs.get("top_tokens"))
        return self._metrics(response) if finish_reason is not None else response

    def _fix_top_logprobs(self, response: dict, tokens, token_logprobs, top_tokens) -> None:
        """With ``top_logprobs``, mlx-lm 0.32 writes each ``logprobs.content`` entry as the FIRST of the top
        tokens in ``mx.argpartition`` order (not sorted): not the generated token, nor the most likely one, and
        changing with the last bits of the logits (so between speculative and plain decoding). Here each entry is
        the generated token (id, text, log-probability) and its ``top_logprobs`` are sorted, most likely first,
        as OpenAI's API gives them."""
        content = (response["choices"][0].get("logprobs") or {}).get("content")
        if not (content and top_tokens and tokens and len(tokens) == len(top_tokens) == len(content)):
            return
        tokenizer = self.response_generator.model_provider.tokenizer
        texts = tokenizer.convert_ids_to_tokens([int(t) for t in tokens])
        fixed = []
        for i, (token, tops) in enumerate(zip(tokens, top_tokens)):
            tops = sorted(tops or (), key=lambda e: -e["logprob"])
            logprob = (token_logprobs[i] if token_logprobs and i < len(token_logprobs)
                       else next((e["logprob"] for e in tops if e["id"] == token), None))
            fixed.append({"id": int(token), "token": texts[i], "logprob": logprob, "top_logprobs": tops})
        response["choices"][0]["logprobs"]["content"] = fixed

    def completion_usage_response(self, *args, **kwargs):
        return self._metrics(super().completion_usage_response(*args, **kwargs))

    def do_GET(self):
        if self.path == "/v1/stats":
            self._json(200, self.response_generator.model_provider.draft_model.stats())
        elif self.path.startswith("/v1/models"):
            provider = self.response_generator.model_provider
            self._json(200, {"object": "list", "data": [{"id": provider.model_id, "object": "model",
                                                         "created": self.created, "owned_by": "ngram-spec"}]})
        else:
            super().do_GET()

    def _json(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self._set_completion_headers(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()


_ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 411: "invalid_request_error"}


def client_hung_up(sock: socket.socket) -> bool:
    """Whether the client closed its end of ``sock``: it reads as ended (EOF) or fails (reset). A client sends
    nothing while it waits for its answer, so readable data (a pipelined next request) is not an end."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


class _HangUpWatch:
    """The shared generator as one request's handler uses it: before each token (and each prompt-progress
    report) is handed on, the client's socket is looked at (:func:`client_hung_up`, one ``select``); once the
    client has hung up, the request is stopped (``ctx.stop()``: its row leaves the batch at the next step,
    counted ``cancelled``) and ``ConnectionAbortedError`` ends the handler. Without it, a non-streamed request
    whose client went away (a timeout, Ctrl-C) decoded to ``max_tokens`` before a write could fail (mlx-lm's
    server does), holding a row of the batch all that time."""

    def __init__(self, shared: SpecResponseGenerator, handler: "SpecAPIHandler"):
        self._shared, self._handler = shared, handler

    def _check(self, ctx) -> None:
        if client_hung_up(self._handler.connection):
            if self._handler.spec is not None:
                self._handler.spec.cancelled = True
            ctx.stop()
            raise ConnectionAbortedError("the client hung up before its answer was complete")

    def generate(self, request, generation_args, progress_callback=None):
        ctx = None

        def progress(*report):
            if ctx is not None:
                self._check(ctx)
            if progress_callback is not None:
                progress_callback(*report)

        ctx, response = self._shared.generate(request, generation_args, progress)

        def watched():
            for item in response:
                self._check(ctx)
                yield item

        return ctx, watched()

    def __getattr__(self, name):
        return getattr(self._shared, name)


class _OpenAIErrorBodies:
    """The handler's output stream: mlx-lm writes an error as ``{"error": "text"}`` (or ``Not Found``) in one
    write after the headers; it goes out in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, raw, handler: SpecAPIHandler):
        self._raw, self._handler = raw, handler

    def write(self, data: bytes):
        try:
            return self._raw.write(self._openai(data))
        except OSError:  # the client went away: the generation thread stops at its next token (ctx.stop())
            if self._handler.spec is not None:
                self._handler.spec.cancelled = True
            raise

    def _openai(self, data: bytes) -> bytes:
        status = self._handler._status
        if status >= 400 and not data.startswith(b"HTTP/"):
            try:
                error = json.loads(data)["error"]
            except (ValueError, KeyError, TypeError):
                error = data.decode(errors="replace")
            if not isinstance(error, dict):
                code = "model_not_found" if isinstance(self._handler._error, ModelNotServed) else None
                error = {"message": str(error), "type": _ERROR_TYPES.get(status, "server_error"),
                         "param": getattr(self._handler._error, "param", None), "code": code}
            data = json.dumps({"error": error}).encode()
        return data

    def __getattr__(self, name):
        return getattr(self._raw, name)


class SpecHTTPServer(ThreadingHTTPServer):
    """mlx-lm's HTTP server class, stopping once the generation worker has failed and logging (instead of
    printing) a request's unexpected exception. ``run_serve`` serves with a subclass naming its generator."""

    generator: SpecResponseGenerator
    # socketserver's listen backlog is 5: a burst of clients connecting at once (agents fanning out) overflowed it
    # and some got "connection reset" before the accept loop reached them; 1024 (the kernel caps it at somaxconn)
    request_queue_size = 1024

    def service_actions(self):  # run by serve_forever at least every 0.5 s
        if self.generator.failed.is_set():
            self.server_close()  # from now on the system refuses connections: nobody waits for an answer
            raise _WorkerStopped

    def handle_error(self, request, client_address):
        exc = sys.exc_info()[1]
        if isinstance(exc, ConnectionError):
            log.info("client %s went away: %s", client_address[0], exc)
        else:
            log.error("request from %s failed", client_address[0], exc_info=exc)


def context_length(model) -> Optional[int]:
    """The model's trained context (``max_position_embeddings``; a GGUF file's ``context_length``), if known."""
    args = getattr(model, "args", None)
    for source in (args, getattr(args, "text_config", None)):
        n = getattr(source, "max_position_embeddings", None) if source is not None else None
        if isinstance(source, dict):
            n = source.get("max_position_embeddings")
        if n:
            return int(n)
    return None


def build_server_args(args) -> argparse.Namespace:
    """The namespace mlx_lm.server's classes read (its ``main()`` flags), from ``serve``'s arguments."""
    return argparse.Namespace(
        model=args.model_id, adapter_path=None, draft_model=None, num_draft_tokens=3, trust_remote_code=False,
        chat_template="", use_default_chat_template=False, host=args.host, port=args.port,
        allowed_origins=args.allowed_origins, temp=args.temp, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        max_tokens=args.max_tokens, chat_template_args=args.chat_template_args,
        decode_concurrency=args.decode_concurrency,
        prompt_concurrency=1, prefill_step_size=args.prefill_step_size, prompt_cache_size=args.prompt_cache_size,
        prompt_cache_bytes=args.prompt_cache_bytes, kv_bits=None, kv_group_size=64,
        quantized_kv_start=mlx_server.DEFAULT_QUANTIZED_KV_START, pipeline=False, log_level=args.log_level)


def check_mlx_lm() -> None:
    """Refuse an mlx-lm whose single-sequence path no longer calls ``stream_generate`` or whose generation loop
    no longer builds a ``BatchGenerator`` (the two names rebound here)."""
    for method, name in (("_serve_single", "stream_generate"), ("_generate", "BatchGenerator")):
        if name not in getattr(mlx_server.ResponseGenerator, method).__code__.co_names:
            raise ValueError(f"mlx-lm {MLX_LM_VERSION}: ResponseGenerator.{method} no longer uses {name}; ngram-spec "
                             "serve supports mlx-lm >=0.32.0,<0.33 (pip install 'mlx-lm>=0.32.0,<0.33')")


def run_serve(args) -> int:
    from mlx_backend.models.loading import load_model

    check_mlx_lm()
    logging.basicConfig(level=getattr(logging, args.log_level), format="%(asctime)s - %(levelname)s - %(message)s")
    speculator = NgramSpeculator(draft_max=args.draft_max, speculative=not args.no_spec, static=args.static,
                                 dynamic=args.dynamic, scope=args.dynamic_scope, save_every=args.save_every,
                                 drafter=args.drafter, history_max_tokens=args.history_max_tokens,
                                 history=args.history, max_users=args.max_users,
                                 dynamic_max_entries=args.dynamic_max_entries)
    dtype = None if args.dtype in (None, "auto") else args.dtype
    model, tokenizer, desc = load_model(args.model, dtype)
    # cache and history files of another tokenizer: refused before serving
    speculator.use_tokenizer(*tokenizer_fingerprint(tokenizer), n_vocab=vocab_size(model))
    # as mlx_lm.server's main (bypassed here): on Metal, wire the recommended working set for the server's life
    # (the batched path has no per-request wired_limit); a no-op on the CPU
    maybe_set_recommended_wired_limit()
    args.model_id = Path(args.model).name if args.model else "SmolLM2-135M-Instruct"
    n_ctx = args.ctx_size or context_length(model)
    if speculator.speculative:  # compile the drafter's loops now rather than in the first request
        warm = speculator.drafter(None, [], set())
        warm.reset([1, 2, 1])
        warm.draft(1)
    cli_args = build_server_args(args)
    provider = InjectedModelProvider(cli_args, model, tokenizer, args.model_id, speculator)
    # the generation thread starts here: from now on a stop (SIGTERM, Ctrl-C) must reach the finally below,
    # which stops it (before: a SIGTERM right after the start line, before the handlers were in place, left the
    # thread running and the process hung at exit)
    with _stopped_once_by_signals():
        generator = SpecResponseGenerator(provider, HeldPromptCache(args.prompt_cache_size), n_ctx=n_ctx)
        server_class = type(SpecHTTPServer.__name__, (SpecHTTPServer,), {"generator": generator})
        try:
            log.info("serving %s as `%s` (context %s, speculation %s, draft %s, drafter %s, dynamic cache %s, suffix "
                     "history %s); %s", desc, args.model_id, n_ctx, "on" if speculator.speculative else "off",
                     "auto" if args.draft_max is None else args.draft_max, args.drafter,
                     f"{args.dynamic} ({args.dynamic_scope})" if args.dynamic else "in memory",
                     f"{args.history_max_tokens} tokens, " + (f"kept in {args.history}" if args.history else "in memory"),
                     f"up to {args.decode_concurrency} requests decode together (one verify forward for all)"
                     if provider.is_batchable else f"requests are served one at a time ({provider.unbatched_reason})")
            mlx_server._run_http_server(args.host, args.port, generator, server_class=server_class,
                                        handler_class=SpecAPIHandler)
        except (_WorkerStopped, KeyboardInterrupt):   # a stop before serve_forever took it over, too
            pass
        finally:
            generator.stop_and_join()
            saved = generator.failure is not None or _save_on_shutdown(speculator)
        if generator.failure is None:
            if not generator.wait_answered(ANSWER_TIMEOUT_S):
                log.warning("some requests were still being answered %.0f s after the server stopped",
                            ANSWER_TIMEOUT_S)
            if not saved:
                log.error("stopped, but a dynamic n-gram cache or suffix history was not saved (above): what was "
                          "learned since its last save is lost (exit status 1)")
                return 1
            return 0
        if not generator.wait_answered(ANSWER_TIMEOUT_S):
            log.error("some requests were still being answered %.0f s after the failure", ANSWER_TIMEOUT_S)
    for kept in (speculator.path, speculator.history_path):
        if kept is not None:
            log.warning("what was learned is not saved after a failure: %s keeps its last save", kept)
    log.critical("stopped after the generation worker failed (exit status 1)")
    return 1


def _save_on_shutdown(speculator: NgramSpeculator) -> bool:
    """Save the dynamic caches once the server has stopped; False if one could not be written (``save`` logs
    it, the other users' files are still written, and the exit status is 1; before, a one-line ``error:`` and
    exit status 2, that of a bad flag). A second SIGTERM meanwhile meets :func:`_stopped_once_by_signals`'
    handler, which ``atomic_write`` leaves in place: logged and ignored, the save completes."""
    try:
        speculator.save()
    except Exception:  # noqa: BLE001  (logged by save; reported by the exit status)
        return False
    return True


@contextlib.contextmanager
def _stopped_once_by_signals():
    """SIGTERM and SIGINT stop the server once: the first raises ``KeyboardInterrupt`` in the main thread
    (mlx-lm's ``serve_forever`` shuts the server down on it); later ones, while the requests in flight are
    answered and the dynamic cache and suffix history are saved, are logged and ignored (before: a second signal broke the
    shutdown, exit 130, 143 or 134, sometimes before the save). The previous handlers come back after."""
    stopping = []

    def stop(signum, frame):
        if stopping:
            log.warning("%s again: already stopping (answering the requests in flight, then saving what was "
                        "learned: --dynamic, --history)", signal.Signals(signum).name)
            return
        stopping.append(signum)
        raise KeyboardInterrupt

    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
