"""Context strategies: how an agent turns its history into the next prompt.

The strategy keeps the full history (``messages``) and decides what the model sees
(``on_before_act``). Hooks are called by the agent in this order each turn:
``on_env_reset`` (once) -> [``on_before_act`` -> ``on_after_act`` ->
(``on_tool_results``)]* -> ``on_after_step``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from ludic.types import Info, Message, Observation


class ContextStrategy(ABC):
    def __init__(self, system_prompt: str | None = None) -> None:
        self.system_prompt = system_prompt
        self._messages: list[Message] = []

    @property
    def messages(self) -> list[Message]:
        """The full history, system prompt included (a copy)."""
        return [dict(m) for m in self._messages]

    def reset(self, system_prompt: str | None = None) -> None:
        """Start a new, empty history. ``system_prompt`` is a suggestion (e.g. the env's)
        used for this episode only when the strategy has no system prompt of its own."""
        self._messages = []
        prompt = self.system_prompt if self.system_prompt is not None else system_prompt
        if prompt:
            self._messages.append({"role": "system", "content": prompt})

    def on_env_reset(
        self, obs: Observation, info: Info, *, system_prompt: str | None = None
    ) -> None:
        self.reset(system_prompt)
        self._messages.append({"role": "user", "content": obs})

    def on_after_act(self, assistant_message: Message) -> None:
        self._messages.append(dict(assistant_message))

    def on_tool_results(self, tool_messages: list[Message]) -> None:
        self._messages.extend(dict(m) for m in tool_messages)

    def on_after_step(self, obs: Observation, info: Info) -> None:
        self._messages.append({"role": "user", "content": obs})

    @abstractmethod
    def on_before_act(self) -> list[Message]:
        """The messages to render into the next prompt."""
        ...
