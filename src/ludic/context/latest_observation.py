"""``LatestObservation``: the prompt is the system prompt and the newest observation on."""

from __future__ import annotations

from ludic.context.base import ContextStrategy
from ludic.types import Info, Message, Observation


class LatestObservation(ContextStrategy):
    """Shows the model the system prompt and the messages from the newest env observation
    on (the observation, then this turn's own replies, tool results and a parse failure's
    feedback): for envs whose observation already holds the whole state or history, such
    as TextArena's games, where ``FullDialog`` would repeat it every turn. A parse
    failure's feedback (``info["parse_error"]``) follows the observation it answers
    rather than replacing it, so a retry still sees the state."""

    def reset(self, system_prompt: str | None = None) -> None:
        super().reset(system_prompt)
        self._start = len(self._messages)

    def on_env_reset(
        self, obs: Observation, info: Info, *, system_prompt: str | None = None
    ) -> None:
        super().on_env_reset(obs, info, system_prompt=system_prompt)
        self._start = len(self._messages) - 1

    def on_after_step(self, obs: Observation, info: Info) -> None:
        super().on_after_step(obs, info)
        if not info.get("parse_error"):
            self._start = len(self._messages) - 1

    def on_before_act(self) -> list[Message]:
        messages = self.messages
        system = 1 if messages and messages[0]["role"] == "system" else 0
        return messages[:system] + messages[max(self._start, system) :]
