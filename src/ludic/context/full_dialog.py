"""``FullDialog``: the prompt is the whole history."""

from __future__ import annotations

from ludic.context.base import ContextStrategy
from ludic.types import Message


class FullDialog(ContextStrategy):
    """Shows the model every message so far: system prompt, observations, its own
    replies and tool results, unchanged. The simplest strategy and the default."""

    def on_before_act(self) -> list[Message]:
        return self.messages
