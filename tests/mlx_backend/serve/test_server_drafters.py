"""``ngram-spec serve`` with each drafter (``--drafter``, the per-request ``"drafter"`` field) and the suffix
history across requests, with the real ``openai`` client against servers on free local ports.

Every drafter's greedy answer is plain greedy decoding's; an unknown drafter is a 400 naming the choices;
a second request whose answer repeats the first one's drafts it from the history (more accepted drafts
than with ``--history-max-tokens 0``), and with ``--dynamic-scope user`` only the same user's history
is used. A tiny qwen3_5 (its random answers do not repeat themselves, so drafting from its own text
alone rarely hits) and a fixed ``--draft-max`` (the cost-aware policy would depend on timing).
"""
from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("mlx_lm")

from mlx_backend.cli import main  # noqa: E402
from test_server import Server  # noqa: E402  (tests/mlx_backend/serve/test_server.py)

N = 24
# a conversation no other test of this module sends, so the history holds it only once it was answered
REPEATED = [{"role": "user", "content": "write it down: zq xv zq xv"}]


def ask(server, messages, **body):
    """Non-streamed greedy chat: (token ids, timings, response)."""
    r = server.client.chat.completions.create(model="default_model", messages=messages, max_tokens=N,
                                              logprobs=True, temperature=0.0, extra_body=body or None)
    ids = [c.model_extra["id"] for c in r.choices[0].logprobs.content]
    return ids, r.model_extra["timings"], r


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    path = tmp_path_factory.mktemp("drafter-models") / "qwen3_5"
    assert main(["tiny-model", "--arch", "qwen3_5", "--seed", "2", "--out", str(path)]) == 0
    return path


@pytest.fixture(scope="module")
def per_user(qwen):
    """Default drafter (auto), suffix history on, scoped per user."""
    server = Server("--model", str(qwen), "--draft-max", "4", "--dynamic-scope", "user")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def no_history(qwen):
    """--drafter suffix with the history off."""
    server = Server("--model", str(qwen), "--draft-max", "4", "--drafter", "suffix", "--history-max-tokens", "0")
    yield server
    server.stop()


def test_every_drafter_answers_plain_greedy_and_is_named_in_the_metrics(per_user):
    messages = [{"role": "user", "content": "abc abc abc def def def abc abc abc"}]
    plain, timings, _ = ask(per_user, messages, speculative=False)
    assert timings["drafter"] == "none" and timings["draft_n"] == 0
    ids, timings, r = ask(per_user, messages)                  # the server's default: auto
    assert ids == plain and timings["drafter"] == "auto"
    drafted = 0
    for name in ("lookup", "suffix", "auto"):
        ids, timings, r = ask(per_user, messages, drafter=name, user="carol")
        assert ids == plain, name
        assert timings["drafter"] == name, (name, timings)
        drafted += timings["draft_n"]
        details = r.usage.completion_tokens_details
        assert timings["draft_n_accepted"] == details.accepted_prediction_tokens
    streamed = per_user.client.chat.completions.create(model="default_model", messages=messages, max_tokens=N,
                                                       temperature=0.0, stream=True, extra_body={"drafter": "suffix"})
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == r.choices[0].message.content and drafted > 0
    stats = per_user.stats()
    assert stats["drafter"] == "auto" and stats["history_max_tokens"] > 0
    assert stats["drafters"]["lookup"] >= 1 and stats["drafters"]["suffix"] >= 2 and stats["drafters"]["auto"] >= 2


@pytest.mark.parametrize("value", ["sufix", 3, ["suffix"], ""])
def test_an_unknown_drafter_is_a_400_naming_the_choices(per_user, value):
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "drafter": value})
    status, payload = per_user.post_raw("/v1/chat/completions", body.encode())
    assert status == 400, payload
    error = payload["error"]
    assert error["type"] == "invalid_request_error"
    assert "drafter must be one of lookup, suffix, auto" in error["message"], error
    assert ask(per_user, [{"role": "user", "content": "hi"}], drafter=None)[0]   # null: the default; still serving


def test_a_repeated_answer_is_drafted_from_the_history_of_the_same_user_only(per_user, no_history):
    """The same question twice: the second answer repeats the first, which the history holds (prompt then
    answer): with the history, the suffix drafter copies it; without (--history-max-tokens 0, or another
    user's history under --dynamic-scope user) it has only the request's own text."""
    first, t_first, _ = ask(no_history, REPEATED)
    again, t_without, _ = ask(no_history, REPEATED)
    assert again == first and t_without["drafter"] == "suffix"
    assert no_history.stats()["suffix_histories"] == {}

    alice1, t_alice1, _ = ask(per_user, REPEATED, user="alice", drafter="suffix")
    bob, t_bob, _ = ask(per_user, REPEATED, user="bob", drafter="suffix")          # alice's history is not bob's
    anonymous, t_anon, _ = ask(per_user, REPEATED, drafter="suffix")              # no user: no history
    alice2, t_alice2, _ = ask(per_user, REPEATED, user="alice", drafter="suffix")
    auto2, t_auto2, _ = ask(per_user, REPEATED, user="alice")                     # auto: suffix where L is long
    assert alice1 == bob == anonymous == alice2 == auto2 == first
    with_history = t_alice2["draft_n_accepted"]
    assert with_history > t_without["draft_n_accepted"], (t_alice2, t_without)
    assert with_history > t_bob["draft_n_accepted"] and with_history > t_anon["draft_n_accepted"]
    assert t_bob["draft_n_accepted"] == t_alice1["draft_n_accepted"] == t_without["draft_n_accepted"]
    assert t_auto2["draft_n_accepted"] > t_without["draft_n_accepted"]
    histories = per_user.stats()["suffix_histories"]
    assert histories and all(name.startswith("user ") for name in histories)
    assert all("alice" not in name and "bob" not in name for name in histories)


def test_eos_cut_drafter_passes_the_match_length_and_tokens_through():
    from mlx_backend.serve.server import _EosCutDrafter
    from reference.ngram.drafter import NgramDrafter
    from reference.suffix.auto import AutoDrafter
    from reference.suffix.drafter import SuffixDrafter

    inner = SuffixDrafter()
    wrapped = _EosCutDrafter(inner, [5, 1, 2, 3], eos={9})
    wrapped.reset([4, 9, 1, 2])
    assert wrapped.draft(8) == [3, 4, 9]              # cut after the EOS
    assert wrapped.match_length == inner.match_length == 2
    wrapped.extend([3])
    assert wrapped.tokens == [5, 1, 2, 3, 4, 9, 1, 2, 3]
    auto = _EosCutDrafter(AutoDrafter(SuffixDrafter(), NgramDrafter(), min_match=3), [], eos=set())
    auto.reset([1, 2, 3, 4, 1, 2, 3])
    assert auto.draft(2) == [4, 1] and auto.match_length == 3 and auto.tokens == [1, 2, 3, 4, 1, 2, 3]
    assert _EosCutDrafter(NgramDrafter(), [], eos=set()).match_length == 0    # a drafter without one


def test_history_is_bounded_and_scoped_like_the_dynamic_cache():
    from mlx_backend.serve.server import NgramSpeculator, RequestSpec

    server = NgramSpeculator(history_max_tokens=10)
    server.finish(RequestSpec(True, 4, "alice"), list(range(8)), 4, completed=True)
    server.finish(RequestSpec(True, 4, "bob"), list(range(20, 26)), 3, completed=True)
    server.finish(RequestSpec(True, 4, None), [7, 7], 1, completed=False)           # cancelled: not kept
    history = server.history_for(None)
    assert history is server.history_for("bob") and history.n_tokens <= 10
    assert history.sequences[-1] == list(range(20, 26))
    per_user = NgramSpeculator(scope="user")
    per_user.finish(RequestSpec(True, 4, "alice"), [1, 2, 3], 2, completed=True)
    per_user.finish(RequestSpec(True, 4, None), [4, 5, 6], 2, completed=True)        # no user: no history
    assert per_user.history_for("alice").sequences == [[1, 2, 3]]
    assert per_user.history_for("bob").sequences == [] and per_user.history_for(None) is None
    assert NgramSpeculator(history_max_tokens=0).history_for(None) is None
    with pytest.raises(ValueError, match="drafter must be one of lookup, suffix, auto"):
        NgramSpeculator(drafter="nope")
