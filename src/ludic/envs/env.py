"""The environment kernel: multi-agent by default.

An environment is a state-transition function with an optional scalar reward. It knows
nothing about prompts, parsing or LLMs: it receives already-parsed action strings.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol, runtime_checkable

from ludic.types import AgentId, Info, Observation, StepOutcome


class LudicEnv(ABC):
    """Multi-agent environment contract.

    * ``reset(seed) -> {agent_id: (obs, info)}`` for every agent.
    * ``step({agent_id: action}) -> {agent_id: StepOutcome}`` for at least the agents
      that acted (``active_agents`` before the call); it may also include waiting agents
      whose observation or reward changed (e.g. the other player of a board game).
    * ``active_agents``: who must act on the next ``step``.
    * ``system_prompt``: an optional suggestion for agents' context strategies.

    ``reset(seed)`` with a seed must be deterministic; ``seed=None`` draws from the env's
    own RNG.
    """

    system_prompt: str | None = None

    @property
    @abstractmethod
    def agent_ids(self) -> list[AgentId]: ...

    @property
    def active_agents(self) -> list[AgentId]:
        return list(self.agent_ids)

    @abstractmethod
    def reset(self, seed: int | None = None) -> dict[AgentId, tuple[Observation, Info]]: ...

    @abstractmethod
    def step(self, actions: dict[AgentId, str]) -> dict[AgentId, StepOutcome]: ...


@runtime_checkable
class ReferenceAnswerEnv(Protocol):
    """An env that knows the answer to its current problem (after ``reset``): the warm
    start's ``dataset_answers`` demonstrates it (``DatasetQAEnv``, ``ReasoningGymEnv``)."""

    def reference_answer(self) -> str:
        """The reference answer of the current episode's problem."""
        ...
