"""The sampling parameters and the values that have a meaning, as mlx-lm's ``make_sampler`` takes
them (``mlx_lm/sample_utils.py``): temperature, top-p, min-p, top-k, min-tokens-to-keep."""
from __future__ import annotations

from reference.ngram.tokens import is_whole


def check_sampling(temp: float, top_p: float = 1.0, min_p: float = 0.0, top_k: int = 0,
                   min_tokens_to_keep: int = 1, cli: bool = False) -> None:
    """Refuse sampling arguments with no meaning (ValueError naming the argument, its value and its range):
    ``temp >= 0``, ``0 < top_p <= 1`` (1 = off), ``0 <= min_p <= 1``, whole ``top_k >= 0``, whole
    ``min_tokens_to_keep >= 1``.
    Used by ``generate`` (``cli``: names as flags) and by ``mlx_backend.decode.sampling.Sampler``."""
    rules = (("temp", temp, 0 <= temp < float("inf"), "a number >= 0 (0 = greedy)"),
             ("top_p", top_p, 0 < top_p <= 1, "in (0, 1] (1 = off)"),
             ("min_p", min_p, 0 <= min_p <= 1, "in [0, 1] (0 = off)"),
             ("top_k", top_k, is_whole(top_k) and top_k >= 0, "a whole number >= 0 (0 = off)"),
             ("min_tokens_to_keep", min_tokens_to_keep, is_whole(min_tokens_to_keep) and min_tokens_to_keep >= 1,
              "a whole number >= 1"))
    for name, value, ok, rule in rules:
        if not ok:
            raise ValueError(f"{'--' + name.replace('_', '-') if cli else name} must be {rule}, got {value}")
