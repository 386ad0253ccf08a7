"""Chat templates: messages -> prompt token ids, and in-turn prompt extension.

``extend`` is what keeps a multi-call turn drift-free: the next prompt within a turn is
the previous prompt + the exact completion tokens + the tokens of the new messages, so
all calls of a turn concatenate into one training sequence.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from ludic.types import Message


@runtime_checkable
class ChatTemplate(Protocol):
    def render(
        self,
        messages: list[Message],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """Token ids of ``messages`` rendered as a prompt."""
        ...

    def extend(
        self,
        prompt_ids: list[int],
        completion_ids: list[int],
        new_messages: list[Message],
        *,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """The next prompt of the same turn. Must start with ``prompt_ids + completion_ids``."""
        ...

    def decode(self, token_ids: list[int]) -> str: ...
