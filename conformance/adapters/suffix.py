"""The protocol's ``suffix_drafter`` made from a backend's suffix drafter and history classes (the
reference's and the MLX backend's have the same API: ``SuffixHistory(max_tokens)`` with ``add(tokens)``,
``SuffixDrafter(history, *, factor, max_match)`` with ``reset``, ``extend``, ``draft`` and ``match_length``)."""
from __future__ import annotations


class SuffixSession:
    """A suffix drafter and the history it reads, as the protocol presents them: ``add_history(tokens)``
    adds a finished sequence to the history (as ``ngram-spec serve`` does after each request)."""

    def __init__(self, drafter, history):
        self.drafter, self.history = drafter, history

    def reset(self, prompt):
        self.drafter.reset(prompt)

    def extend(self, tokens):
        self.drafter.extend(tokens)

    def draft(self, k):
        return self.drafter.draft(k)

    @property
    def match_length(self):
        return self.drafter.match_length

    def add_history(self, tokens):
        self.history.add(tokens)


def suffix_adapter(drafter_class, history_class):
    """``suffix_drafter(history, max_tokens, factor, max_match)`` for these classes: a setting left None is
    left to the classes' defaults, and the ladder always is (the suite holds both to the rule's)."""

    def suffix_drafter(history=(), max_tokens=None, factor=None, max_match=None):
        bounded = history_class() if max_tokens is None else history_class(max_tokens)
        for tokens in history:
            bounded.add(tokens)
        settings = {k: v for k, v in (("factor", factor), ("max_match", max_match)) if v is not None}
        return SuffixSession(drafter_class(bounded, **settings), bounded)

    return suffix_drafter


def optional_suffix_adapter(module_name: str):
    """:func:`suffix_adapter` of the ``SuffixDrafter`` and ``SuffixHistory`` of ``module_name``, or None (the
    suffix area is then not applicable) when that module, or its package, does not exist. A module that
    exists but cannot be imported, or lacks either class, gives a ``suffix_drafter`` that raises the error:
    the suffix checks then fail, never pass or get skipped."""
    import importlib

    try:
        module = importlib.import_module(module_name)
        return suffix_adapter(module.SuffixDrafter, module.SuffixHistory)
    except ModuleNotFoundError as exc:
        parents = {module_name.rsplit(".", i)[0] for i in range(module_name.count(".") + 1)}
        if exc.name in parents - {module_name.split(".")[0]}:
            return None
        error: Exception = exc
    except Exception as exc:  # noqa: BLE001 - reported by every suffix check
        error = exc

    def suffix_drafter(*args, **kwargs):
        raise ImportError(f"{module_name} is unusable: {type(error).__name__}: {error}") from error

    return suffix_drafter
