"""Tool-call parsing: completion text -> the ``ToolCall``s the model asked for.

A ``ToolCallParser`` is any callable ``(text) -> ToolCallParse``. The default,
:class:`XMLJsonToolCallParser`, reads the Hermes / Qwen convention
``<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>``.
Malformed blocks are a *parse failure*, not an exception: no calls and an ``error`` message
meant for the model (the agent turns it into feedback), so a policy that writes broken JSON
is told so and penalised instead of crashing the rollout.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from ludic.types import ToolCall


@dataclass(frozen=True)
class ToolCallParse:
    """What a tool-call parser found in one completion.

    ``calls`` are the tool calls in order of appearance; ``content`` is the text outside
    the tool-call blocks (stripped); ``error`` is ``None`` on success, else a message that
    says which block is malformed and how to fix it (``calls`` is then empty: a completion
    with one broken block runs no tools at all).
    """

    calls: tuple[ToolCall, ...] = ()
    content: str = ""
    error: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "calls", tuple(self.calls))
        if self.error is not None and self.calls:
            raise ValueError("ToolCallParse: a failed parse (error set) must carry no calls")

    @property
    def ok(self) -> bool:
        return self.error is None


@runtime_checkable
class ToolCallParser(Protocol):
    def __call__(self, text: str) -> ToolCallParse:
        """Extract tool calls from ``text``; never raises on malformed model output."""
        ...


class XMLJsonToolCallParser:
    """Parses ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks.

    ``arguments`` may be a JSON object or a string holding one (OpenAI style); a missing
    ``arguments`` means ``{}``. Call ids are ``f"{id_prefix}{i}"`` for the i-th block of the
    completion (``call_0``, ``call_1``, ...), so parsing is deterministic.

    A parse failure (``ToolCallParse.error``) is returned for: invalid JSON, a JSON value
    that is not an object, a missing or non-string ``name``, ``arguments`` that is not an
    object, or an unclosed ``<tool_call>``.
    """

    def __init__(
        self,
        *,
        open_tag: str = "<tool_call>",
        close_tag: str = "</tool_call>",
        id_prefix: str = "call_",
    ) -> None:
        self.open_tag = open_tag
        self.close_tag = close_tag
        self.id_prefix = id_prefix
        self._block = re.compile(re.escape(open_tag) + r"(.*?)" + re.escape(close_tag), re.DOTALL)

    def __call__(self, text: str) -> ToolCallParse:
        calls: list[ToolCall] = []
        for i, match in enumerate(self._block.finditer(text)):
            call_or_error = self._parse_block(match.group(1), i)
            if isinstance(call_or_error, str):
                return ToolCallParse(content=self._outside(text), error=call_or_error)
            calls.append(call_or_error)
        outside = self._outside(text)
        if self.open_tag in outside:
            return ToolCallParse(
                content=outside,
                error=f"unclosed {self.open_tag}: close every tool call with {self.close_tag}",
            )
        return ToolCallParse(calls=tuple(calls), content=outside)

    def _outside(self, text: str) -> str:
        return self._block.sub("", text).strip()

    def _parse_block(self, body: str, index: int) -> ToolCall | str:
        where = f"tool call #{index + 1}"
        expected = (
            f'expected {self.open_tag}{{"name": "...", "arguments": {{...}}}}{self.close_tag}'
        )
        try:
            payload = json.loads(body)
        except json.JSONDecodeError as e:
            return (
                f"{where} is not valid JSON ({e.msg} at char {e.pos}): {body.strip()!r}; {expected}"
            )
        if not isinstance(payload, dict):
            return f"{where} is a JSON {type(payload).__name__}, not an object; {expected}"
        name = payload.get("name")
        if not isinstance(name, str) or not name:
            return f"{where} has no string 'name' field; {expected}"
        arguments = payload.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError:
                return f"{where} ({name}): 'arguments' string is not valid JSON; {expected}"
        if not isinstance(arguments, dict):
            return (
                f"{where} ({name}): 'arguments' is a {type(arguments).__name__}, "
                f"not an object; {expected}"
            )
        return ToolCall(id=f"{self.id_prefix}{index}", name=name, arguments=arguments)
