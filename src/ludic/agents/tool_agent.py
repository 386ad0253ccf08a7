"""``ToolAgent``: an ``Agent`` that calls tools; a completion without tool calls is the answer.

``tools`` (internal) are functions the agent runs itself: each model call is its own
``AgentStep`` (``action_target="internal"``), the results go in as ``tool`` messages and the
next call, in the same ``act`` and turn, extends the previous tokens. ``external_tools``
(delegation, sub-agents) are returned to the protocol (``action_target="external"``), which
answers through ``on_tool_results`` and calls ``act`` again with the same ``turn_id``. Tool
mistakes never raise: a bad name or arguments, or a raising tool, give an ``"Error: ..."``
result; a malformed ``<tool_call>`` or over ``max_tool_calls`` in one ``act`` fails to parse.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ludic.agents.base_agent import Agent
from ludic.agents.tools import Tool, as_tool, call_tool
from ludic.inference.request import InferenceSpec
from ludic.inference.tool_parser import ToolCallParser, XMLJsonToolCallParser
from ludic.types import AgentAct, AgentStep, ToolCall

ToolSpec = Tool | Callable[..., Any] | Mapping[str, Any] | str
"""A function, a ``Tool``, an OpenAI function schema dict, or (external only) a name."""


class ToolAgent(Agent):
    """An agent with internal and external tools (see the module docstring).

    Args:
        tools: internal tools (functions, or ``Tool`` with ``fn``); schemas come from
            ``tool_schema``.
        external_tools: tools the protocol handles (names, schemas, ``Tool`` or functions
            used only for their schema).
        tool_call_parser: completion text -> tool calls (default
            ``XMLJsonToolCallParser``: ``<tool_call>{json}</tool_call>``).
        max_tool_calls: most internal tool calls one ``act`` may run; a completion that
            would exceed it ends the act as a parse failure.
        tool_error_penalty: reward of that failure, and of a malformed tool call.
        **agent_kwargs: every ``Agent`` argument (``client``, ``context``, ``parser``,
            ``chat_template``, ``incomplete_completion_penalty``).
    """

    def __init__(
        self,
        *,
        tools: Sequence[ToolSpec] = (),
        external_tools: Sequence[ToolSpec] = (),
        tool_call_parser: ToolCallParser | None = None,
        max_tool_calls: int = 8,
        tool_error_penalty: float = 0.0,
        **agent_kwargs: Any,
    ) -> None:
        super().__init__(**agent_kwargs)
        if max_tool_calls < 0:
            raise ValueError(f"ToolAgent: max_tool_calls must be >= 0, got {max_tool_calls}")
        self.tools = _by_name([as_tool(t, internal=True) for t in tools], "tools")
        self.external_tools = _by_name(
            [as_tool(t, internal=False) for t in external_tools], "external_tools"
        )
        both = sorted(set(self.tools) & set(self.external_tools))
        if both:
            raise ValueError(
                f"ToolAgent: {both} listed both in tools and external_tools; each tool is "
                "either run by the agent (tools) or by the protocol (external_tools)"
            )
        self.tool_call_parser = tool_call_parser or XMLJsonToolCallParser()
        self.max_tool_calls = max_tool_calls
        self.tool_error_penalty = tool_error_penalty

    def tool_schemas(self) -> list[dict[str, Any]] | None:
        schemas = [t.schema for t in (*self.tools.values(), *self.external_tools.values())]
        return schemas or None

    async def act(self, *, inference: InferenceSpec, turn_id: str) -> AgentAct:
        steps: list[AgentStep] = []
        executed = 0
        while True:
            forced = self._before_model_call(turn_id)
            step = await self._call_model(inference, turn_id)
            steps.append(step)
            if forced:
                step.info["forced_final_answer"] = True
                return self._finish_with_parse(steps)
            if self._is_penalised_truncation(step):
                return self._finish_with_parse(steps)

            parsed = self.tool_call_parser(step.completion)
            if not parsed.ok:
                return self._fail(
                    steps, self.tool_error_penalty, f"Malformed tool call: {parsed.error}"
                )
            if not parsed.calls:
                return self._finish_with_parse(steps)

            step.tool_calls = list(parsed.calls)
            external = [c for c in parsed.calls if c.name in self.external_tools]
            internal = [c for c in parsed.calls if c.name not in self.external_tools]
            if executed + len(internal) > self.max_tool_calls:
                return self._fail(
                    steps,
                    self.tool_error_penalty,
                    f"Tool call limit reached: {executed} tool calls already ran and this "
                    f"reply asks for {len(internal)} more (max_tool_calls="
                    f"{self.max_tool_calls}). Give your final answer without calling tools.",
                )
            await self._run_internal(step, internal)
            executed += len(internal)
            if external:
                step.action_target = "external"
                return AgentAct(
                    steps=steps, action=None, action_target="external", tool_calls=external
                )
            step.action_target = "internal"

    # ---- hooks and helpers ------------------------------------------------------------
    def _before_model_call(self, turn_id: str) -> bool:
        """Called before each model call of ``act``. Returns True when this call must be
        the final answer (its tool calls are not run). ``ToolAgent`` never forces one."""
        return False

    def _is_penalised_truncation(self, step: AgentStep) -> bool:
        return (
            self.incomplete_completion_penalty is not None
            and step.info.get("finish_reason") == "length"
        )

    async def _run_internal(self, step: AgentStep, calls: list[ToolCall]) -> None:
        """Run ``calls`` in order; record results on ``step`` and add them to the turn."""
        available = sorted(self.tools)
        errors: list[dict[str, str]] = []
        for call in calls:
            outcome = await call_tool(self.tools.get(call.name), call, available)
            step.tool_results.append(outcome.message)
            if outcome.error is not None:
                errors.append({"id": call.id, "name": call.name, "error": outcome.error})
        if errors:
            step.info["tool_errors"] = errors
        if step.tool_results:
            self.on_tool_results(step.tool_results)


def _by_name(tools: list[Tool], field: str) -> dict[str, Tool]:
    out: dict[str, Tool] = {}
    for t in tools:
        if t.name in out:
            raise ValueError(
                f"ToolAgent: two {field} are named {t.name!r}; tool names must be unique"
            )
        out[t.name] = t
    return out
