"""Tiny random models for the model areas, and a drafter that offers what a schedule says.

Models are written once per process by :func:`reference.models.tiny.write_tiny_model` (mlx-lm's directory
format, float32, vocabulary 260) and loaded by the backend's own ``load_model``, so every backend
runs the same weights. Token ids below 256 are ordinary (bytes); 256 is EOS.
"""
from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

import numpy as np
from hypothesis import strategies as st

from conformance.runner import Unsupported, note, unsupported_models

ARCHS = ("qwen3_5", "qwen3_next", "llama", "llama_sliding")  # every architecture of reference.models.tiny
SEEDS = (0, 1)
WINDOW_PREFIX = [40, 41, 42, 43, 44, 45]  # longer than llama_sliding's window of 4: it wraps in the prompt
VOCAB = 256  # prompts and forced-wrong drafts stay below the special tokens

_dirs: dict[tuple[str, int], Path] = {}
_loaded: dict[tuple[int, str, int], object] = {}
_root: Path | None = None


def model_dir(arch: str, seed: int) -> Path:
    """The directory of the tiny ``arch`` model drawn from ``seed`` (written on first use)."""
    global _root
    from reference.models.tiny import write_tiny_model

    if (arch, seed) not in _dirs:
        if _root is None:
            _root = Path(tempfile.mkdtemp(prefix="ngram-spec-conformance-models-"))
            atexit.register(shutil.rmtree, _root, True)
        _dirs[arch, seed] = write_tiny_model(_root / f"{arch}-{seed}", arch, seed=seed)
    return _dirs[arch, seed]


def load(impl, arch: str, seed: int):
    """The backend's model for ``(arch, seed)``, loaded once per backend object. A backend that does not
    support ``arch`` says so by raising ``NotImplementedError`` from ``load_model``: :class:`Unsupported`."""
    key = (id(impl), arch, seed)
    if key not in _loaded:
        try:
            _loaded[key] = impl.load_model(str(model_dir(arch, seed)))
        except NotImplementedError as exc:
            raise Unsupported({arch: f"load_model raised NotImplementedError: {exc}" if str(exc) else
                                      "load_model raised NotImplementedError"}) from None
    return _loaded[key]


def supported(impl, archs=ARCHS) -> list[str]:
    """Those of ``archs`` the backend supports (:func:`load` of seed 0), for checks that loop over
    architectures; the others are noted in the report. None of them: the check is not applicable."""
    kept, left_out = [], {}
    for arch in archs:
        try:
            load(impl, arch, 0)
            kept.append(arch)
        except Unsupported as exc:
            left_out.update(exc.reasons)
    if not kept:
        raise Unsupported(left_out)
    if left_out:
        note(f"not run on {unsupported_models(left_out)}")
    return kept


def reference_logits(model, tokens) -> np.ndarray:
    """The NumPy reference's logits (float64, a row per token) for ``tokens`` fed whole from an empty state,
    on the weights of ``model`` (a model :func:`load` gave any backend): the outside truth that the model
    areas compare a backend's own logits with, and prove near-ties and sampling laws on."""
    import conformance.adapters.reference as reference

    key = next((k for k, m in _loaded.items() if m is model), None)
    if key is None:
        raise ValueError("reference_logits takes a model that conformance.models.load returned")
    ref = load(reference, key[1], key[2])
    return np.asarray(reference.forward(ref, list(tokens), reference.make_cache(ref)), dtype=np.float64)


models = st.tuples(st.sampled_from(ARCHS), st.sampled_from(SEEDS))


@st.composite
def prompts(draw, max_size: int = 24) -> list[int]:
    """A prompt that repeats itself (so the n-gram drafter finds drafts) or one that does not."""
    if draw(st.booleans()):
        period = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6))
        n = draw(st.integers(1, max_size))
        return [period[i % len(period)] for i in range(n)]
    return draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=max_size))


class ScriptedDrafter:
    """A :class:`reference.drafter.Drafter` (``reset``, ``extend``, ``draft``) that offers, step by step, what ``schedule`` says,
    knowing the true greedy continuation ``truth``: ``("true", k)`` the next k true tokens,
    ``("wrong", j)`` j true tokens then a wrong one, ``("empty",)`` nothing. After the schedule
    runs out it offers nothing. ``offered`` records ``(tokens generated so far, drafts)`` per call;
    ``wrong_input`` says how the first draft call was handed tokens other than the prompt followed by
    the tokens generated so far (``None``: every call was handed the right ones)."""

    def __init__(self, truth: list[int], schedule: list[tuple]):
        self.truth, self.schedule = list(truth), list(schedule)
        self.prompt_len = 0
        self.tokens: list[int] = []
        self.offered: list[list[int]] = []
        self.prompts: list[list[int]] = []
        self.wrong_input: str | None = None

    def reset(self, prompt) -> None:
        self.tokens = [int(t) for t in prompt]
        self.prompt_len = len(self.tokens)
        self.prompts.append(list(self.tokens))
        self.offered = []

    def extend(self, tokens) -> None:
        self.tokens += [int(t) for t in tokens]

    def draft(self, n_draft: int) -> list[int]:
        step = self.schedule[len(self.offered)] if len(self.offered) < len(self.schedule) else ("empty",)
        pos = len(self.tokens) - self.prompt_len  # generated so far
        if self.wrong_input is None and self.tokens[self.prompt_len:] != self.truth[:pos]:
            self.wrong_input = (f"draft call {len(self.offered) + 1} was handed the generated tokens "
                                f"{self.tokens[self.prompt_len:]} (reset() then extend()), the output so far is "
                                f"{self.truth[:pos]}")
        true = self.truth[pos:pos + 8]
        if step[0] == "true":
            d = true[:step[1]]
        elif step[0] == "wrong":
            right = true[:step[1]]
            wrong_at = pos + len(right)
            t = self.truth[wrong_at] if wrong_at < len(self.truth) else 0
            d = right + [(t + 1) % VOCAB]
        else:
            d = []
        d = d[:n_draft]
        self.offered.append((pos, d))
        return d
