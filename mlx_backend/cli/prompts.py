"""Prompts as mlx_lm.generate makes them: the chat messages (a system message first, if any) and
the token ids, through the tokenizer's chat template when it has one."""
from __future__ import annotations

import sys


def read_stdin_prompt(args) -> None:
    """``--prompt -``: the prompt is standard input, read whole (mlx_lm.generate's convention)."""
    if args.prompt == "-":
        args.prompt = sys.stdin.read()
    if args.prompt is not None:
        check_unicode(args.prompt, "--prompt")


def check_unicode(text: str, what: str) -> None:
    """Refuse text no tokenizer can take: a lone surrogate, which is how Python hands over bytes that are
    not UTF-8 (a command-line argument or standard input, ``surrogateescape``) or a JSON ``\\ud800`` escape."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start]
        byte = f"byte {ord(bad) - 0xDC00:#04x}" if 0xDC80 <= ord(bad) <= 0xDCFF else f"lone surrogate U+{ord(bad):04X}"
        raise ValueError(f"{what} is not valid UTF-8 text ({byte} at character {exc.start}); give UTF-8 text, "
                         "or token ids") from None


def chat_messages(prompt: str, system_prompt: str | None = None) -> list[dict]:
    """The chat of mlx_lm.generate: an optional system message, then the user's prompt."""
    system = [] if system_prompt is None else [{"role": "system", "content": system_prompt}]
    return [*system, {"role": "user", "content": prompt}]


def prompt_tokens(tokenizer, text: str, chat_template: bool = True, system_prompt: str | None = None) -> list[int]:
    """``text`` as token ids, wrapped in the chat template when the tokenizer has one, after the system
    message if any (mlx_lm.generate's rule)."""
    if chat_template and getattr(tokenizer, "has_chat_template", False):
        return list(tokenizer.apply_chat_template(chat_messages(text, system_prompt), add_generation_prompt=True))
    return list(tokenizer.encode(text))
