"""Replaying recorded requests: how many verify steps a drafter would have saved, without a model.

A request is a prompt and the output greedy decoding gave for it. Speculative decoding emits exactly
that output (:func:`reference.speculative.speculative_generate`), so its steps can be replayed with the
output standing in for the model: the model's token after any prefix of the output is the output's
next token. Per request, with ``N = len(output)`` and the loop of ``speculative_generate``::

    drafter   = make_drafter(history); drafter.reset(prompt)
    k         = 0 at the first step, else min(draft_max, N - emitted - 1)
    d_1..d_k  = drafter.draft(k) (not called when k = 0), cut to k and before any id outside the vocabulary
    n         = largest n with d_1..d_n == output[emitted : emitted + n]         accepted drafts
    step      = output[emitted : emitted + n + 1]                               n + 1 tokens
    drafter.extend(step); emitted += n + 1                                      one verify step

``history`` (``None``: each request on its own) is a ``SuffixHistory`` of either backend shared by all
requests, in file order, as a server sees them: after request ``i`` is replayed, ``prompt_i + output_i``
is added to it, so request ``i`` drafts from requests ``0 .. i-1``. Drafters that do not read a history
(llama.cpp's lookup) are given it and ignore it.

>>> from reference.suffix.drafter import SuffixDrafter
>>> r = replay_requests([([1, 2, 3, 4], [1, 2, 3, 4, 5])], lambda history: SuffixDrafter(history), 8)
>>> r.verify_steps, r.drafted, r.accepted     # 1 (k = 0) | "2 3 4" drafted after "1" (k = 3), accepted, + 5
(2, 3, 3)
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from reference.ngram.tokens import check_token_list
from reference.speculative import in_vocab


@dataclass
class RequestReplay:
    """Counts of one replayed request."""

    output_tokens: int = 0
    verify_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    draft_seconds: float = 0.0  # time spent in the drafter (reset, draft, extend)


@dataclass
class ReplayResult:
    """Totals over the requests (sums of :attr:`per_request`) and the per-request counts."""

    per_request: list[RequestReplay] = field(default_factory=list)

    def _sum(self, name: str):
        return sum(getattr(r, name) for r in self.per_request)

    @property
    def requests(self) -> int:
        return len(self.per_request)

    @property
    def output_tokens(self) -> int:
        return self._sum("output_tokens")

    @property
    def verify_steps(self) -> int:
        return self._sum("verify_steps")

    @property
    def drafted(self) -> int:
        return self._sum("drafted")

    @property
    def accepted(self) -> int:
        return self._sum("accepted")

    @property
    def draft_seconds(self) -> float:
        return self._sum("draft_seconds")

    @property
    def tokens_per_step(self) -> float:
        """Output tokens per verify step (1.0 without drafts; 0 for no requests)."""
        return self.output_tokens / self.verify_steps if self.verify_steps else 0.0

    @property
    def draft_us_per_token(self) -> float:
        """Microseconds of drafter work per output token."""
        return 1e6 * self.draft_seconds / self.output_tokens if self.output_tokens else 0.0


def replay_request(prompt: Sequence[int], output: Sequence[int], drafter, draft_max: int,
                   vocab_size: int | None = None, on_tokens: Callable[[int], None] | None = None) -> RequestReplay:
    """Replay one request with ``drafter`` (the rule of the module docstring). The prompt's and the output's
    ids are checked here, each error naming the sequence and the id's index in it, not the drafter's step."""
    checked = {}
    for name, ids in (("prompt", prompt), ("output", output)):
        try:
            checked[name] = check_token_list(ids)
        except ValueError as exc:
            raise ValueError(f"the {name}: {exc}") from None
    prompt, output = checked["prompt"], checked["output"]
    if not prompt:
        raise ValueError("the prompt is empty: generation needs at least one prompt token")
    if not output:
        raise ValueError("the output is empty: generation emits at least one token")
    if draft_max < 0:
        raise ValueError(f"draft_max must be >= 0, got {draft_max}")
    r = RequestReplay(output_tokens=len(output))
    clock = time.perf_counter
    t0 = clock()
    drafter.reset(prompt)
    r.draft_seconds += clock() - t0
    emitted = 0
    while emitted < len(output):
        k = min(draft_max, len(output) - emitted - 1) if emitted else 0
        drafts = []
        if k:
            t0 = clock()
            drafts = [int(t) for t in drafter.draft(k)][:k]
            r.draft_seconds += clock() - t0
            drafts = in_vocab(drafts, vocab_size)
        n = 0
        while n < len(drafts) and drafts[n] == output[emitted + n]:
            n += 1
        step = output[emitted:emitted + n + 1]
        t0 = clock()
        drafter.extend(step)
        r.draft_seconds += clock() - t0
        r.verify_steps += 1
        r.drafted += len(drafts)
        r.accepted += n
        emitted += n + 1
        if on_tokens:
            on_tokens(n + 1)
    return r


def replay_requests(requests: Iterable[tuple[Sequence[int], Sequence[int]]], make_drafter: Callable, draft_max: int,
                    history=None, vocab_size: int | None = None,
                    progress: Callable[[int, int], None] | None = None) -> ReplayResult:
    """Replay ``requests`` (``(prompt, output)`` pairs of token ids, in order) with a fresh
    ``make_drafter(history)`` each; ``history``: ``None``, or a ``SuffixHistory`` that every replayed
    request's prompt and output are added to. ``progress(done, total)`` counts output tokens."""
    requests = [(list(p), list(o)) for p, o in requests]
    total = sum(len(o) for _, o in requests)
    done = 0
    result = ReplayResult()

    def advance(n: int) -> None:
        nonlocal done
        done += n
        progress(done, total)

    for i, (prompt, output) in enumerate(requests):
        try:
            r = replay_request(prompt, output, make_drafter(history), draft_max, vocab_size,
                               advance if progress else None)
        except ValueError as exc:
            raise ValueError(f"request {i + 1}: {exc}") from exc
        result.per_request.append(r)
        if history is not None:
            history.add(prompt + output)
    if progress and total == 0:
        progress(0, 0)
    return result
