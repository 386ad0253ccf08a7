"""Delegation: a parent agent's external tool call runs a whole sub-agent episode.

:func:`make_delegation_handler` builds a protocol's external tool handler: a call to
``tool_name`` builds an env from the call's arguments, plays it with a fresh sub-agent and
answers with the sub-agent's final action. The sub-rollout is returned too, so the parent's
protocol hands both to training (docs/pieces.md has an example). Its ``meta``:
``delegated=True``, ``role="sub_agent"``, ``tool_call_id``, ``tool_name``,
``tool_arguments`` (+ the handler's ``meta``), and ``parent_rollout_id`` /
``parent_turn_id``, which the parent's protocol adds once it knows them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ludic.envs.env import LudicEnv
from ludic.inference.request import InferenceSpec
from ludic.interaction.base import ActingAgent, ExternalToolHandler, ExternalToolResult
from ludic.interaction.single_agent import SingleAgentProtocol
from ludic.types import AgentId, Info, Observation, Rollout, StepOutcome, ToolCall


def final_answer(rollout: Rollout) -> str:
    """The action of the last real (non-synthetic) env step, or a note saying there is
    none (every act failed to parse, or the episode was truncated before acting)."""
    for step in reversed(rollout.env_steps):
        if not step.synthetic:
            return step.action
    reason = rollout.meta.get("truncation_reason")
    return f"[sub-agent gave no valid answer; truncation_reason={reason!r}]"


def make_delegation_handler(
    *,
    tool_name: str,
    sub_agent_factory: Callable[[], ActingAgent],
    env_factory: Callable[[dict[str, Any]], LudicEnv],
    max_steps: int,
    inference: InferenceSpec | None = None,
    result_fn: Callable[[Rollout], str] | None = None,
    external_tool_handler: ExternalToolHandler | None = None,
    meta: Mapping[str, Any] | None = None,
) -> ExternalToolHandler:
    """Build an ``ExternalToolHandler`` that answers ``tool_name`` calls by running a
    sub-agent episode.

    Args:
        tool_name: the only tool name this handler accepts.
        sub_agent_factory: a fresh sub-agent per call (agents hold episode state).
        env_factory: builds the sub-env from the call's ``arguments`` dict.
        max_steps: ``max_steps`` of the sub-episode.
        inference: sampling for the sub-agent; default ``InferenceSpec()``.
        result_fn: sub-rollout -> tool-message content; default :func:`final_answer`.
        external_tool_handler: the sub-agent's own external tool handler (nesting).
        meta: extra ``meta`` for every sub-rollout.

    Returns ``ExternalToolResult(content, rollouts=[sub_rollout, *its_delegated])``.
    """
    if max_steps < 1:
        raise ValueError(f"make_delegation_handler: max_steps={max_steps}; expected >= 1")
    to_content = result_fn or final_answer

    async def handle(call: ToolCall) -> ExternalToolResult:
        env = _sub_env(tool_name, env_factory, call)
        protocol = SingleAgentProtocol(
            sub_agent_factory(), external_tool_handler=external_tool_handler
        )
        sub_meta = {
            **(meta or {}),
            "delegated": True,
            "role": "sub_agent",
            "tool_call_id": call.id,
            "tool_name": call.name,
            "tool_arguments": dict(call.arguments),
        }
        rollouts = await protocol.run(
            env=env, max_steps=max_steps, inference=inference, meta=sub_meta
        )
        return ExternalToolResult(content=to_content(rollouts[0]), rollouts=rollouts)

    return handle


def _sub_env(
    tool_name: str, env_factory: Callable[[dict[str, Any]], LudicEnv], call: ToolCall
) -> LudicEnv:
    """The sub-episode's env, built from a ``tool_name`` call's arguments."""
    if call.name != tool_name:
        raise ValueError(
            f"delegation handler for tool {tool_name!r} got a call to {call.name!r} "
            f"(id {call.id!r}); route {call.name!r} to its own handler, e.g. with a "
            "dispatch on ToolCall.name"
        )
    try:
        return env_factory(dict(call.arguments))
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(
            f"delegation tool {tool_name!r}: env_factory failed for call {call.id!r} "
            f"with arguments {call.arguments!r}: {e!r}; check the tool's argument schema "
            "matches what env_factory reads"
        ) from e


class TaskEnv(LudicEnv):
    """A one-shot env for delegated tasks: the observation is the task, the first action
    ends the episode (``terminated=True``) with reward ``scorer(task, action)`` (0.0
    without a scorer)."""

    def __init__(
        self,
        task: str,
        *,
        scorer: Callable[[str, str], float] | None = None,
        agent_id: AgentId = "agent",
        system_prompt: str | None = None,
    ) -> None:
        self.task = task
        self.scorer = scorer
        self._agent_id = agent_id
        self.system_prompt = system_prompt
        self._done = True

    @property
    def agent_ids(self) -> list[AgentId]:
        return [self._agent_id]

    def reset(self, seed: int | None = None) -> dict[AgentId, tuple[Observation, Info]]:
        self._done = False
        return {self._agent_id: (self.task, {})}

    def step(self, actions: dict[AgentId, str]) -> dict[AgentId, StepOutcome]:
        if self._done:
            raise RuntimeError("TaskEnv.step() called before reset() or after the answer")
        if set(actions) != {self._agent_id}:
            raise ValueError(
                f"TaskEnv.step(): expected an action for exactly {self._agent_id!r}, got "
                f"{sorted(actions)}"
            )
        action = actions[self._agent_id]
        reward = 0.0 if self.scorer is None else float(self.scorer(self.task, action))
        self._done = True
        return {self._agent_id: StepOutcome(obs="", reward=reward, terminated=True)}
