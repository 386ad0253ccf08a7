"""Interaction protocols own the agent <-> environment loop and produce rollouts.

Neither the env nor the agent owns rollout generation; swapping the protocol changes
the loop (single-agent, multi-agent, tool-augmented, delegation) without touching them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeAlias, runtime_checkable

from ludic.envs.env import LudicEnv
from ludic.inference.request import InferenceSpec
from ludic.types import AgentAct, Info, Message, Observation, Rollout, ToolCall


@runtime_checkable
class ActingAgent(Protocol):
    """What a protocol needs from an agent (``ludic.agents.Agent`` implements it).

    Call order per episode: ``on_env_reset`` -> [``act`` -> (``on_tool_results`` ->
    ``act``)* -> ``on_after_step``]*. ``act`` calls after ``on_tool_results`` continue the
    same turn: their prompts extend the earlier prompt + completion tokens.
    """

    def on_env_reset(
        self, obs: Observation, info: Info, *, system_prompt: str | None = None
    ) -> None: ...

    def on_after_step(self, obs: Observation, info: Info) -> None: ...

    def on_tool_results(self, messages: list[Message]) -> None: ...

    async def act(self, *, inference: InferenceSpec, turn_id: str) -> AgentAct: ...


@dataclass
class ExternalToolResult:
    """The protocol-side answer to an external tool call.

    ``content`` goes back to the calling agent as a ``tool`` message. ``rollouts`` are any
    rollouts produced while handling the call (e.g. a delegated sub-agent's episode); the
    protocol returns them alongside the parent's so they are trained on too.
    """

    content: str
    rollouts: list[Rollout] = field(default_factory=list)


ExternalToolHandler: TypeAlias = Callable[[ToolCall], Awaitable[ExternalToolResult]]


@runtime_checkable
class InteractionProtocol(Protocol):
    async def run(
        self,
        *,
        env: LudicEnv,
        max_steps: int,
        env_seed: int | None = None,
        inference: InferenceSpec | None = None,
        meta: dict[str, Any] | None = None,
    ) -> list[Rollout]:
        """Run one episode. Returns every rollout it produced (one per agent, plus any
        delegated sub-agent rollouts). ``meta`` is copied into each rollout's ``meta``."""
        ...


@dataclass(frozen=True)
class Episode:
    """The arguments of one ``run`` call, checked (``inference`` defaulted)."""

    env: LudicEnv
    max_steps: int
    env_seed: int | None
    inference: InferenceSpec
    meta: dict[str, Any] | None


class EpisodeProtocol:
    """Base of the built-in protocols: ``run`` checks its arguments and calls ``_play``."""

    async def run(
        self,
        *,
        env: LudicEnv,
        max_steps: int,
        env_seed: int | None = None,
        inference: InferenceSpec | None = None,
        meta: dict[str, Any] | None = None,
    ) -> list[Rollout]:
        """Run one episode (see ``InteractionProtocol.run``)."""
        if max_steps < 1:
            raise ValueError(f"{type(self).__name__}.run: max_steps={max_steps}; expected >= 1")
        inference = inference or InferenceSpec()
        return await self._play(Episode(env, max_steps, env_seed, inference, meta))

    async def _play(self, episode: Episode) -> list[Rollout]:
        raise NotImplementedError
