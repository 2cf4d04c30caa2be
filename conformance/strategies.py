"""Hypothesis strategies: the token streams, caches and draft schedules the property checks draw.

* :func:`tiny_vocab_streams`: 2 to 4 distinct tokens, so counts tie and sit on the thresholds;
* :func:`periodic_streams`: a repeated period with random substitutions (what drafting is for);
* :func:`zipf_streams`: a few frequent tokens and a long tail, like text;
* :func:`schedules`: what a scripted drafter offers at each step of a generation (see
  :class:`conformance.models.ScriptedDrafter`): the true continuation, a wrong token after ``j`` right ones, or nothing.

Token ids are offset by a drawn base so that backends cannot rely on small ids.
"""
from __future__ import annotations

from hypothesis import strategies as st


@st.composite
def tiny_vocab_streams(draw, min_size: int = 2, max_size: int = 80) -> list[int]:
    vocab = draw(st.integers(2, 4))
    base = draw(st.sampled_from([0, 1, 1000]))
    return [base + t for t in draw(st.lists(st.integers(0, vocab - 1), min_size=min_size, max_size=max_size))]


@st.composite
def periodic_streams(draw, min_size: int = 2, max_size: int = 160) -> list[int]:
    period = draw(st.lists(st.integers(0, 40), min_size=1, max_size=12))
    size = draw(st.integers(min_size, max_size))
    stream = [period[i % len(period)] for i in range(size)]
    for _ in range(draw(st.integers(0, max(1, size // 8)))):  # noise: substitutions
        stream[draw(st.integers(0, size - 1))] = draw(st.integers(0, 40))
    return stream


# Token t appears ~ 1/(t+1) as often as token 0: a Zipf-like choice that hypothesis can shrink.
_ZIPF = [t for t in range(24) for _ in range(24 // (t + 1))]


def zipf_streams(min_size: int = 2, max_size: int = 160):
    return st.lists(st.sampled_from(_ZIPF), min_size=min_size, max_size=max_size)


def streams(min_size: int = 2, max_size: int = 160):
    """Any of the three kinds of stream."""
    return st.one_of(tiny_vocab_streams(min_size, min(max_size, 80)), periodic_streams(min_size, max_size),
                     zipf_streams(min_size, max_size))


# One step of a scripted drafter: ("true", k) offers the next k true tokens, ("wrong", j) offers j
# true tokens then a wrong one, ("empty",) offers nothing.
step = st.one_of(st.tuples(st.just("true"), st.integers(1, 8)), st.tuples(st.just("wrong"), st.integers(0, 7)),
                 st.tuples(st.just("empty")))


def schedules(max_steps: int = 12):
    return st.lists(step, min_size=1, max_size=max_steps)


@st.composite
def related_streams(draw, stream: list[int]) -> list[int] | None:
    """A stream sharing n-grams with ``stream`` (a noisy, rotated copy), an unrelated one, or None."""
    kind = draw(st.sampled_from(["copy", "other", "none"]))
    if kind == "none" or not stream:
        return None
    if kind == "other":
        return draw(streams())
    shift = draw(st.integers(0, len(stream) - 1))
    out = stream[shift:] + stream[:shift]
    for _ in range(draw(st.integers(0, max(1, len(out) // 4)))):
        out[draw(st.integers(0, len(out) - 1))] = draw(st.sampled_from(stream))
    return out


@st.composite
def streams_with_caches(draw, make_streams=streams):
    """``(stream, static_source, dynamic_source)``: the sources build the static and dynamic caches."""
    stream = draw(make_streams())
    return stream, draw(related_streams(stream)), draw(related_streams(stream))


# -- suffix drafting ---------------------------------------------------------------------------------

@st.composite
def copies(draw, stream: list[int]) -> list[int]:
    """A noisy, rotated copy of ``stream`` (non-empty), as :func:`related_streams` makes them."""
    shift = draw(st.integers(0, len(stream) - 1))
    out = stream[shift:] + stream[:shift]
    for _ in range(draw(st.integers(0, max(1, len(out) // 4)))):
        out[draw(st.integers(0, len(out) - 1))] = draw(st.sampled_from(stream))
    return out


# Factors that are exact binary fractions: floor(factor * L) is then the same in any arithmetic (a factor
# such as 0.7 makes 0.7 * 10 either 7 or 6.99...: the rule does not say which).
SUFFIX_FACTORS = (0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0)


@st.composite
def suffix_sessions(draw):
    """What a suffix drafter is driven through (:func:`conformance.checks.suffix.drive`): ``settings``
    (``max_tokens`` of the history, ``factor``, ``max_match``), the ``history`` it starts with (oldest
    first), and ``requests``: ``(stream, prompt_len, ks, add)``, one generation each, whose output is
    ``stream``, drafting ``ks[i % len(ks)]`` tokens at its i-th draft, its whole stream added to the
    history after it when ``add``. Later requests and the history are mostly noisy copies of the first
    stream, so matches in the history, ties with it and eviction happen."""
    first = draw(streams(max_size=120))
    requests = [first]
    for _ in range(draw(st.integers(0, 2))):
        requests.append(draw(related_streams(first)) or draw(streams(max_size=60)))
    bound = draw(st.sampled_from(["none", "small", "tight"]))
    # per history sequence: a copy of the first stream? "tight": an old copy, then one or two sequences, and a
    # bound just below the total: the old copy is dropped at once (an evicted match)
    copy = draw(st.lists(st.booleans(), min_size=1 if bound == "tight" else 0, max_size=2 if bound == "tight" else 3))
    if bound == "tight":
        copy = [True] + sorted(copy, reverse=True)
    history = [draw(copies(first)) if c else draw(streams(max_size=60)) for c in copy]
    total = sum(map(len, history))
    settings = dict(
        max_tokens=(1 << 20 if bound == "none" else draw(st.integers(0, 150)) if bound == "small"
                    else max(0, total - draw(st.integers(1, 40)))),
        factor=draw(st.sampled_from(SUFFIX_FACTORS)),
        max_match=draw(st.one_of(st.just(64), st.integers(1, 12))),
    )
    plans = [(stream, draw(st.integers(0, 40)), draw(st.lists(st.integers(0, 12), min_size=1, max_size=6)),
              draw(st.booleans())) for stream in requests]
    return settings, history, plans
