"""Chats rendered with the tokenizer's own chat template, and which tokens the loss counts.

Only the assistant's tokens are learned; the system and user turns (and the template's
role headers) are context. Two ways to find them, the first where the template allows:

- **Generation markers.** A template that wraps assistant content in ``{% generation %}``
  ... ``{% endgeneration %}`` lets transformers' ``apply_chat_template`` return the mask
  itself (``return_assistant_tokens_mask=True``).
- **Prefixes.** Otherwise each assistant turn is located by rendering the chat up to it
  with the generation prompt (where the assistant starts to speak) and up to its end: the
  characters in between are the turn, and tokens starting there are masked in. A template
  whose renderings are not prefixes of one another cannot be read this way; that is an
  error naming the chat, with the fix (add generation markers).
"""

from __future__ import annotations

import re
from typing import Any

from .errors import DataError

__all__ = ["check_messages", "has_generation_markers", "render_chat"]

GENERATION = re.compile(r"{%-?\s*generation\s*-?%}")


def has_generation_markers(template: str | None) -> bool:
    return bool(template and GENERATION.search(template))


def check_messages(messages: Any, where: str) -> list[dict]:
    """``messages`` as a chat: a list of {role, content} with at least one assistant turn."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: 'messages' must be a non-empty list of "
                        f"{{role, content}} turns")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)):
            raise DataError(f"{where}: message {i + 1} is not a {{role, content}} pair of strings")
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: a chat without an assistant turn (the loss is taken on the "
                        f"assistant's tokens only; this chat would teach nothing)")
    return messages


def render_chat(tok: Any, messages: list[dict], where: str) -> tuple[list[int], list[bool]]:
    """(token ids, loss mask) of one chat; ``tok`` is a transformers tokenizer."""
    template = getattr(tok, "chat_template", None)
    if not template:
        raise DataError(f"{where}: the tokenizer has no chat template to render chats with "
                        f"(tokenizer_config.json 'chat_template' or chat_template.jinja)")
    try:
        if has_generation_markers(template):
            out = tok.apply_chat_template(messages, tokenize=True, return_dict=True,
                                          return_assistant_tokens_mask=True)
            ids, mask = list(out["input_ids"]), [bool(m) for m in out["assistant_masks"]]
        else:
            ids, mask = _by_prefixes(tok, messages, where)
    except DataError:
        raise
    except Exception as e:  # a template's own error (jinja raise_exception) about this chat
        raise DataError(f"{where}: the chat template rejects this chat: "
                        f"{str(e).splitlines()[0]}") from None
    if not any(mask):
        raise DataError(f"{where}: no assistant tokens after rendering with the chat template "
                        f"(empty assistant turns?)")
    return ids, mask


def _render(tok: Any, messages: list[dict], prompt: bool) -> str:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)


def _by_prefixes(tok: Any, messages: list[dict], where: str) -> tuple[list[int], list[bool]]:
    full = _render(tok, messages, False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before, through = _render(tok, messages[:i], True), _render(tok, messages[:i + 1], False)
        if not (through.startswith(before) and full.startswith(through)):
            raise DataError(f"{where}: the chat template renders this chat differently turn "
                            f"by turn, so its assistant tokens cannot be found; mark them in "
                            f"the template with {{% generation %}} ... {{% endgeneration %}}")
        spans.append((len(before), len(through)))
    enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
    mask = [any(lo <= start < hi for lo, hi in spans) for start, _ in enc["offset_mapping"]]
    return list(enc["input_ids"]), mask
