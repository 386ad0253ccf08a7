"""``TruncatedThinkingContext``: hide old reasoning from the prompt, keep it in history."""

from __future__ import annotations

import re

from ludic.context.base import ContextStrategy
from ludic.types import Message

_THINK = re.compile(r"<think>.*?</think>", re.DOTALL)


def truncate_thinking(text: str, placeholder: str = "...") -> str:
    """Replace the content of every closed ``<think>...</think>`` block in ``text`` with
    ``placeholder``. An unclosed ``<think>`` is left as is."""
    replacement = f"<think>{placeholder}</think>"
    return _THINK.sub(lambda _: replacement, text)


class TruncatedThinkingContext(ContextStrategy):
    """Keeps the full history but shows earlier reasoning as ``<think>{placeholder}</think>``.

    Which assistant messages are truncated in the prompt:

    * Those from earlier turns, i.e. before the last ``user`` message.
    * Never those after the last ``user`` message (the current turn's internal tool
      loop): within a turn the next prompt must extend the previous prompt + completion
      token for token, so their reasoning stays intact.
    * With ``keep_last_assistant=True`` the most recent assistant message of the earlier
      turns is kept intact too (only older ones are truncated).

    ``messages`` (the stored history) is never modified; only ``on_before_act``'s
    returned copies are. Only string ``content`` is rewritten.
    """

    def __init__(
        self,
        system_prompt: str | None = None,
        *,
        placeholder: str = "...",
        keep_last_assistant: bool = False,
    ) -> None:
        super().__init__(system_prompt)
        if "</think>" in placeholder:
            raise ValueError(
                f"placeholder={placeholder!r} contains '</think>'; pass short text such as '...'"
            )
        self.placeholder = placeholder
        self.keep_last_assistant = keep_last_assistant

    def on_before_act(self) -> list[Message]:
        prompt = self.messages
        user_idx = [i for i, m in enumerate(prompt) if m.get("role") == "user"]
        cutoff = user_idx[-1] if user_idx else 0
        earlier = [i for i in range(cutoff) if prompt[i].get("role") == "assistant"]
        if self.keep_last_assistant and earlier:
            earlier = earlier[:-1]
        for i in earlier:
            content = prompt[i].get("content")
            if isinstance(content, str):
                prompt[i]["content"] = truncate_thinking(content, self.placeholder)
        return prompt
