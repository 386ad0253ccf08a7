"""``LatestObservation``: the prompt is the system prompt and the newest observation."""

from __future__ import annotations

from ludic.context.base import ContextStrategy
from ludic.types import Message


class LatestObservation(ContextStrategy):
    """Shows the model the system prompt and the messages from the newest observation on
    (the observation, then this turn's own replies and tool results): for envs whose
    observation already holds the whole state or history, such as TextArena's games, where
    ``FullDialog`` would repeat it every turn."""

    def on_before_act(self) -> list[Message]:
        messages = self.messages
        start = 1 if messages and messages[0]["role"] == "system" else 0
        last = max(
            (i for i, m in enumerate(messages) if m["role"] == "user"), default=len(messages)
        )
        return messages[:start] + messages[max(last, start) :]
