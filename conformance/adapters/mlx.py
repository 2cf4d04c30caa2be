"""``--backend mlx``: the MLX backend (``mlx_backend.ngram.api`` for n-grams, ``mlx_backend.decode.generate`` for
speculative generation of mlx-lm models, ``mlx_backend.suffix.drafter`` for suffix drafting) through the
conformance protocol. Plain decoding is mlx-lm's own ``generate_step``, so greedy equivalence is checked
against mlx-lm itself."""
from __future__ import annotations

import functools
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step as mlx_lm_generate_step
from mlx_lm.generate import stream_generate as mlx_lm_stream_generate
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import load_model as mlx_lm_load_model
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

from mlx_backend.decode.generate import SpecStats, ngram_speculative_generate_step, vocab_size
from mlx_backend.decode.generate import stream_generate as spec_stream_generate
from mlx_backend.decode.rollback import VerifyCache
from mlx_backend.decode.sampling import Sampler

from mlx_backend.ngram.api import (  # noqa: F401  (protocol members)
    NgramDrafter,
    build_static,
    cache_entries,
    context_counts,
    load_cache,
    merge_caches,
    replay,
    save_cache,
)

from conformance.adapters.suffix import optional_suffix_adapter

# None (the suffix area not applicable) only while mlx_backend/suffix/drafter.py does not exist
suffix_drafter = optional_suffix_adapter("mlx_backend.suffix.drafter")


def load_model(model_dir):
    model, _ = mlx_lm_load_model(Path(model_dir))
    return model


COUNTS = ("steps", "n_drafted", "n_accept", "accept", "draft_lengths", "t_draft", "t_total")


def _steps(model, prompt, max_tokens, drafter, draft_max, sampler, stats=None):
    if drafter is None:
        for token, _ in mlx_lm_generate_step(mx.array(list(prompt), mx.uint32), model, max_tokens=max_tokens,
                                             sampler=sampler):
            yield int(token), False
    else:  # the ids as given: the generator checks them (an mx.uint32 array cannot hold -1)
        for token, _, from_draft in ngram_speculative_generate_step(
                list(prompt), model, max_tokens=max_tokens, sampler=sampler, drafter=drafter, draft_max=draft_max,
                stats=stats):
            yield int(token), bool(from_draft)


def generate_step(model, prompt, max_tokens, drafter=None, draft_max=4, eos=(), stats=None):
    """Greedy generation (mlx-lm's own when no drafter is given), stopping after an EOS token; with a
    drafter, ``stats`` (a dict) receives the generator's counts (:class:`SpecStats`) when it ends."""
    counts = SpecStats() if drafter is not None else None
    for token, from_draft in _steps(model, prompt, max_tokens, drafter, draft_max, None, counts):
        yield token, from_draft
        if token in eos:
            break
    if stats is not None and counts is not None:
        stats.update({k: v for k, v in counts.as_dict().items() if k in COUNTS})


@functools.lru_cache(maxsize=None)
def _tokenizer(n_vocab: int, eos: tuple[int, ...]) -> TokenizerWrapper:
    """A real Hugging Face tokenizer with one word per id of the model and EOS ``eos``: what mlx-lm's
    ``stream_generate`` needs to run on the suite's tiny models (their text is not checked)."""
    words = Tokenizer(WordLevel({f"t{i}": i for i in range(n_vocab)}, unk_token="t0"))
    return TokenizerWrapper(PreTrainedTokenizerFast(tokenizer_object=words), eos_token_ids=list(eos))


def stream_generate(model, prompt, max_tokens=None, drafter=None, draft_max=4, eos=()):
    """mlx-lm's ``stream_generate`` API: ``mlx_backend.decode.generate.stream_generate`` with a drafter, else
    mlx-lm's own; ``max_tokens`` None leaves the function's default."""
    tokenizer = _tokenizer(vocab_size(model), tuple(eos))
    limit = {} if max_tokens is None else {"max_tokens": max_tokens}
    if drafter is None:
        yield from mlx_lm_stream_generate(model, tokenizer, mx.array(list(prompt), mx.uint32), **limit)
    else:
        yield from spec_stream_generate(model, tokenizer, list(prompt), drafter=drafter, draft_max=draft_max, **limit)


def sample_step(model, prompt, max_tokens, temperature, seed, drafter=None, draft_max=4):
    """Sampling at ``temperature`` from ``mx.random.seed(seed)`` (mlx-lm's sampler when no drafter)."""
    mx.random.seed(seed)
    sampler = make_sampler(temp=temperature) if drafter is None else Sampler(temp=temperature)
    for token, _ in _steps(model, prompt, max_tokens, drafter, draft_max, sampler):
        yield token


def make_cache(model):
    return VerifyCache(model, make_prompt_cache(model))


def forward(model, tokens, cache) -> np.ndarray:
    return np.array(cache.forward(list(tokens)).astype(mx.float32))


def keep(cache, m: int) -> None:
    cache.keep(m)
