"""BackgroundDrafter: drafts nothing while the drafter loads, then exactly what a drafter handed the same
tokens from the start drafts; an error while loading is raised by the next call."""
from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings, strategies as st

from mlx_backend.background_drafter import BackgroundDrafter
from reference.drafter import NgramDrafter


class Gate:
    """A factory whose drafter is made only once ``open`` is set."""

    def __init__(self, make=NgramDrafter):
        self.open, self.make = threading.Event(), make

    def __call__(self):
        self.open.wait()
        return self.make()


@settings(max_examples=40, deadline=None)
@given(prompt=st.lists(st.integers(0, 5), min_size=1, max_size=30),
       steps=st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=4), max_size=12),
       ready_at=st.integers(0, 12), n_draft=st.integers(0, 6))
def test_drafts_as_a_drafter_there_from_the_start(prompt, steps, ready_at, n_draft):
    gate = Gate()
    background, plain = BackgroundDrafter(gate), NgramDrafter()
    background.reset(prompt)
    plain.reset(prompt)
    for i, tokens in enumerate([[]] + steps):
        if i == ready_at:
            gate.open.set()
            background._ready.wait()
        background.extend(tokens)
        plain.extend(tokens)
        want = plain.draft(n_draft)
        assert background.draft(n_draft) == (want if i >= ready_at else [])
    gate.open.set()
    assert background.c_ctx.counts == plain.c_ctx.counts


def test_a_loading_error_is_raised_by_the_next_call():
    def broken():
        raise OSError("no such cache")

    drafter = BackgroundDrafter(broken)
    drafter._ready.wait()
    with pytest.raises(OSError, match="no such cache"):
        drafter.reset([1, 2])
    with pytest.raises(ValueError, match="n_draft"):
        BackgroundDrafter(NgramDrafter).draft(-1)
