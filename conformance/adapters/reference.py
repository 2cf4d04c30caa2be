"""``--backend reference``: the NumPy reference (``reference.api``, ``reference.models``,
``reference.speculative``) through the conformance protocol. The reference generates greedily
only, so it has no ``sample_step`` and the sampling area is not applicable to it."""
from __future__ import annotations

import numpy as np

from reference.api import (  # noqa: F401  (protocol members)
    NgramDrafter,
    build_static,
    cache_entries,
    load_cache,
    merge_caches,
    replay,
    save_cache,
)
from reference.models import load_model  # noqa: F401
from reference.speculative import greedy_generate, speculative_generate


def context_counts(drafter):
    """The drafter's context cache ``c_ctx``."""
    return drafter.c_ctx


def generate_step(model, prompt, max_tokens, drafter=None, draft_max=4, eos=()):
    """Greedy generation, speculative when a drafter is given; ``from_draft`` is not reported (None)."""
    if drafter is None:
        tokens = greedy_generate(model, prompt, max_tokens, eos=eos)
    else:
        tokens, _ = speculative_generate(model, prompt, max_tokens, drafter, draft_max, eos=eos)
    for token in tokens:
        yield token, None


def make_cache(model):
    return model.make_cache()


def forward(model, tokens, cache) -> np.ndarray:
    return model.forward(tokens, cache)


def keep(cache, m: int) -> None:
    cache.keep(m)
