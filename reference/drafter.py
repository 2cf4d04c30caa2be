"""The drafter protocol: what the speculative loop asks of whatever proposes the draft tokens.

One sequence at a time::

    drafter.reset(prompt)      a new sequence starts: the prompt's tokens are all it has seen
    drafter.draft(k)           up to k tokens predicted to follow what it has seen (fewer, or none, is fine)
    drafter.extend(tokens)     the tokens the model emitted in the last step, in order (accepted drafts
                               and the bonus token alike, even past an EOS: a step is learned whole)

The loop never tells a drafter which of its drafts were accepted: it sees the tokens emitted and
nothing else, so every drafter computes from the sequence alone, and the output of greedy
speculative decoding does not depend on the drafter (only the number of forward passes does).

Between requests a drafter may keep what it learned from earlier sequences (llama.cpp's dynamic
cache ``c_dyn``, corpora it was built with such as the static cache ``c_st``): ``reset`` forgets the
sequence, not that. What is kept across users is the caller's choice (``ngram-spec serve`` scopes it
per user or for all). A drafter is not shared between sequences generated at the same time.

Implementations: :class:`reference.ngram.drafter.NgramDrafter` (llama.cpp's lookup, the
specification) and ``mlx_backend.ngram.drafter.NgramDrafter`` (the same rules on array tables).

>>> from reference.ngram.drafter import NgramDrafter
>>> isinstance(NgramDrafter(), Drafter)
True
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable


@runtime_checkable
class Drafter(Protocol):
    """Proposes draft tokens for the sequence it has seen (the module docstring states the contract)."""

    def reset(self, prompt: Sequence[int]) -> None:
        """Start a new sequence whose tokens so far are ``prompt``."""

    def draft(self, k: int) -> list[int]:
        """Up to ``k`` tokens predicted to follow the sequence so far."""

    def extend(self, tokens: Iterable[int]) -> None:
        """Append the tokens the model emitted, in order."""
