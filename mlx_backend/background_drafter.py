"""A drafter that loads while the model decodes: ``ngram-spec generate``'s default drafter.

Loading the n-gram drafter (importing numba and loading its compiled loops, about 0.6 s of CPU) in the
main thread would delay the first token, and loading it in a thread while the model loads slows the
model's loading, which holds the GIL. :class:`BackgroundDrafter` loads it in a thread once decoding has
begun: a decode step spends its time in ``mx.eval``, which releases the GIL, so the load runs beside the
model's forwards. Until it has loaded, it drafts nothing (the steps are plain ones; greedy output is the
same either way); then the drafter is reset with the prompt and every token handed so far, and drafts
as if it had been there from the start.
"""
from __future__ import annotations

import threading
from typing import Callable


class BackgroundDrafter:
    """``reset`` / ``extend`` / ``draft`` over the drafter ``make()`` returns, made in a thread started
    here; ``draft`` returns [] until it is ready. An error raised while making it is raised by the next
    call."""

    def __init__(self, make: Callable[[], object]):
        self._inner = None
        self._error: BaseException | None = None
        self._ready = threading.Event()
        self._tokens: list[int] | None = None   # reset() + extend() so far, not yet handed to the drafter
        threading.Thread(target=self._load, args=(make,), name="ngram-spec-drafter-load", daemon=True).start()

    def _load(self, make) -> None:
        try:
            drafter = make()
            drafter.reset([0, 1, 0, 1])   # the first calls load the compiled loops
            drafter.draft(2)
            self._inner = drafter
        except BaseException as exc:   # raised in the caller's thread by the next call
            self._error = exc
        finally:
            self._ready.set()

    def _drafter(self, wait: bool = False):
        """The loaded drafter, caught up with the tokens handed so far; None while it loads."""
        if not (self._ready.wait() if wait else self._ready.is_set()):
            return None
        if self._error is not None:
            raise self._error
        if self._tokens is not None:
            self._inner.reset(self._tokens)
            self._tokens = None
        return self._inner

    def reset(self, prompt) -> None:
        self._tokens = [int(t) for t in prompt]
        self._drafter()

    def extend(self, tokens) -> None:
        inner = self._drafter()
        if inner is None:
            self._tokens = (self._tokens or []) + [int(t) for t in tokens]
        else:
            inner.extend(tokens)

    def draft(self, n_draft: int) -> list[int]:
        if n_draft < 0:
            raise ValueError(f"n_draft must be >= 0, got {n_draft}")
        inner = self._drafter()
        return [] if inner is None else inner.draft(n_draft)

    @property
    def c_ctx(self):
        """The loaded drafter's context cache (waits for it to load)."""
        return self._drafter(wait=True).c_ctx
