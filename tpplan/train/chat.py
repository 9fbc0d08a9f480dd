"""Chats rendered with the tokenizer's chat template: moved to :mod:`tpplan.data.chat`
(``tpplan data prepare`` renders them too); kept here under its old name."""

from ..data.chat import GENERATION, check_messages, has_generation_markers, render_chat

__all__ = ["GENERATION", "check_messages", "has_generation_markers", "render_chat"]
