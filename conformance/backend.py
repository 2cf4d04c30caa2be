"""The backend under test, chosen by one setting (like array-api-tests' ``ARRAY_API_TESTS_MODULE``).

``--backend`` or ``$NGRAM_SPEC_BACKEND`` is ``reference``, ``mlx``, or ``module.path:object`` (or a
plain ``module.path``) naming any object that has some of the protocol members below. The two
built-in names point at the adapters in :mod:`conformance.adapters`, which map our own packages
onto the protocol. The protocol is documented, with signatures, in ``docs/conformance.md``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

ENV = "NGRAM_SPEC_BACKEND"  # the same variable mlx_backend/machine/backends.py reads
BUILTIN = {"reference": "conformance.adapters.reference", "mlx": "conformance.adapters.mlx"}

# The protocol: member -> what it is. A backend provides any subset; checks needing a missing member
# are reported as not applicable.
PROTOCOL = {
    "NgramDrafter": "class NgramDrafter(c_st=None, c_dyn=None): reset(prompt), extend(tokens), draft(n_draft) -> list[int] (n_draft < 0 raises ValueError)",
    "build_static": "build_static(tokens) -> cache of the 2-gram counts of tokens (llama-lookup-create)",
    "context_counts": "context_counts(drafter) -> cache: the drafter's context cache c_ctx",
    "cache_entries": "cache_entries(cache) -> rows (n, t0, t1, t2, t3, token, count)",
    "merge_caches": "merge_caches(caches) -> cache with the summed counts (llama-lookup-merge)",
    "load_cache": "load_cache(path) -> cache, from llama.cpp's cache file format",
    "save_cache": "save_cache(cache, path): write llama.cpp's cache file format",
    "replay": "replay(tokens, n_ctx, n_draft, c_st=None, c_dyn=None, on_draft=None) -> stats "
              "(n_chunks, n_draft_calls, n_drafted, n_accept; optionally accept in percent); on_draft(pos, "
              "drafts) per draft call; n_draft = 0 drafts nothing, n_draft < 0 raises ValueError",
    "suffix_drafter": "suffix_drafter(history=(), max_tokens=None, factor=None, max_match=None) -> a suffix "
                      "drafter (reference/suffix/drafter.py's rule and ladder; None: the rule's defaults, 1 << 18, "
                      "4.0, 64) over a history bounded by max_tokens that starts with the sequences of history, "
                      "oldest first: reset(prompt), extend(tokens), draft(k) -> list[int], match_length (L of the "
                      "last draft), add_history(tokens) (a finished sequence joins the history)",
    "load_model": "load_model(model_dir) -> model, from an mlx-lm model directory",
    "generate_step": "generate_step(model, prompt, max_tokens, drafter=None, draft_max=4, eos=()) yields "
                     "(token, from_draft): greedy decoding, speculative with drafts from drafter (any object with "
                     "reset/extend/draft) when given; with a drafter, a prompt id outside the vocabulary raises "
                     "ValueError and from_draft is required: True exactly for "
                     "accepted drafts; draft_max=None: the backend's own draft-length policy (any, e.g. a fixed "
                     "length or a cost-aware one)",
    "stream_generate": "stream_generate(model, prompt, max_tokens=None, drafter=None, draft_max=4, eos=()) yields "
                       "mlx-lm's GenerationResponse objects, one per generated token (token, generation_tokens, "
                       "finish_reason, prompt_tokens, prompt_tps, generation_tps, peak_memory in GB); max_tokens "
                       "None: mlx-lm's default, 256",
    "sample_step": "sample_step(model, prompt, max_tokens, temperature, seed, drafter=None, draft_max=4) "
                   "yields tokens sampled at temperature > 0, reproducibly from seed",
    "make_cache": "make_cache(model) -> an empty model state (KV rows, conv windows, recurrent states)",
    "forward": "forward(model, tokens, cache) -> logits [len(tokens), vocab] as a NumPy array",
    "keep": "keep(cache, m): after a forward over S tokens, keep the state after the first m of them",
}


@dataclass
class Backend:
    """The object under test and how it was named."""

    name: str
    impl: object

    def missing(self, needs: tuple[str, ...]) -> list[str]:
        """The members of ``needs`` this backend does not provide."""
        return [n for n in needs if getattr(self.impl, n, None) is None]

    def provided(self) -> list[str]:
        return [n for n in PROTOCOL if getattr(self.impl, n, None) is not None]

    def label(self) -> str:
        """How reports name it: ``'mlx' (conformance.adapters.mlx)`` for a built-in name, else ``'mod:obj'``."""
        return f"{self.name!r}" + (f" ({BUILTIN[self.name]})" if self.name in BUILTIN else "")


def resolve(spec: str | None = None) -> Backend:
    """The backend named by ``spec`` (default ``$NGRAM_SPEC_BACKEND``, then the fast backend where it is
    installed, else ``reference``: :func:`mlx_backend.machine.backends.default_backend`, as for every command).

    Every way a name can fail is a ``ValueError`` naming the problem and the fix: a module that is not
    found (not on the import path: ``python -m conformance`` looks in the current folder, ``ngram-spec``
    and ``pytest`` do not), one that is found but fails to import (whatever it raises), a missing attribute.
    """
    from mlx_backend.machine.backends import default_backend, import_object

    if spec is not None and not spec.strip():
        raise ValueError(f"an empty backend name names no backend: give one (mlx, reference or module.path:object), "
                         f"or leave the option out for ${ENV} or the default")
    spec = spec or os.environ.get(ENV) or default_backend()
    impl = import_object(spec, BUILTIN.get(spec, spec))
    if not any(getattr(impl, n, None) is not None for n in PROTOCOL):
        raise ValueError(f"backend {spec!r} provides none of the protocol members "
                         f"({', '.join(PROTOCOL)}); see docs/conformance.md")
    return Backend(spec, impl)


