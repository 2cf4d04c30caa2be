"""``--backend reference``: the NumPy reference (``reference.ngram.api``, ``reference.models``,
``reference.speculative``, ``reference.suffix.drafter``) through the conformance protocol. The
reference generates greedily only, so it has no ``sample_step`` and the sampling area is not
applicable to it."""
from __future__ import annotations

import numpy as np

from reference.ngram.api import (  # noqa: F401  (protocol members)
    NgramDrafter,
    build_static,
    cache_entries,
    load_cache,
    merge_caches,
    replay,
    save_cache,
)
from reference.speculative import REFERENCE_DRAFT_MAX
from reference.models import load_model  # noqa: F401
from reference.speculative import greedy_generate, speculative_generate
from reference.suffix.drafter import SuffixDrafter, SuffixHistory

from conformance.adapters.suffix import suffix_adapter

suffix_drafter = suffix_adapter(SuffixDrafter, SuffixHistory)  # reference/suffix/drafter.py


def context_counts(drafter):
    """The drafter's context cache ``c_ctx``."""
    return drafter.c_ctx


class _Recorded:
    """A drafter whose drafts are recorded, so that each step's emitted tokens can be matched to them."""

    def __init__(self, drafter):
        self.drafter, self.drafts = drafter, []

    def reset(self, prompt):
        self.drafter.reset(prompt)

    def extend(self, tokens):
        self.drafter.extend(tokens)

    def draft(self, n_draft):
        self.drafts.append([int(t) for t in self.drafter.draft(n_draft)][:n_draft])
        return self.drafts[-1]


def generate_step(model, prompt, max_tokens, drafter=None, draft_max=4, eos=(), stats=None):
    """Greedy generation, speculative when a drafter is given; ``from_draft`` marks the emitted tokens
    that are accepted drafts (a step emits its accepted drafts, then the model's own token); ``stats``
    (a dict) receives the counts of :class:`reference.speculative.SpecStats`."""
    if drafter is None:
        for token in greedy_generate(model, prompt, max_tokens, eos=eos):
            yield token, False
        return
    recorded, steps = _Recorded(drafter), []
    draft_max = REFERENCE_DRAFT_MAX if draft_max is None else draft_max  # the reference's own length: fixed
    _, counts = speculative_generate(model, prompt, max_tokens, recorded, draft_max, eos=eos, on_tokens=steps.append)
    if stats is not None:
        stats.update(steps=counts.steps, n_drafted=counts.n_drafted, n_accept=counts.n_accept, accept=counts.accept)
    drafts = [[]] + recorded.drafts  # the prompt's forward emits the first token, with no draft
    drafts += [[]] * (len(steps) - len(drafts))  # a step with no room for drafts (k = 0) calls no draft()
    for emitted, d in zip(steps, drafts):
        n_accept = next((i for i, (a, b) in enumerate(zip(emitted, d)) if a != b), min(len(emitted), len(d)))
        for i, token in enumerate(emitted):
            yield token, i < n_accept


def make_cache(model):
    return model.make_cache()


def forward(model, tokens, cache) -> np.ndarray:
    return model.forward(tokens, cache)


def keep(cache, m: int) -> None:
    cache.keep(m)
