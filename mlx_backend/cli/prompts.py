"""Prompts as mlx_lm.generate makes them: the chat messages (a system message first, if any) and
the token ids, through the tokenizer's chat template when it has one."""
from __future__ import annotations


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
