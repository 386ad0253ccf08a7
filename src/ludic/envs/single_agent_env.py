"""``SingleAgentEnv``: the Gym-like convenience layer over the multi-agent kernel.

Subclasses write ``env_reset(seed) -> (obs, info)`` and ``env_step(action) ->
StepOutcome`` for their one agent; this class adapts them to the ``LudicEnv`` dict form,
checks the agent ids, tracks the episode step count and applies the env's own time limit.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import replace

from ludic.envs.env import LudicEnv
from ludic.types import AgentId, ContractError, Info, Observation, StepOutcome

DEFAULT_AGENT_ID: AgentId = "agent_0"


class SingleAgentEnv(LudicEnv):
    """An environment with exactly one agent, written Gym-style.

    ``max_episode_steps`` is an *env-initiated* time limit: the step that reaches it is
    returned with ``truncated=True`` (unless it already terminated) and
    ``info["truncation"] = "max_episode_steps"``. This is separate from the protocol's
    ``max_steps`` cut-off. After a terminated or truncated step the episode is over:
    ``active_agents`` is empty and ``step`` raises until the next ``reset``.
    """

    def __init__(
        self,
        *,
        agent_id: AgentId = DEFAULT_AGENT_ID,
        max_episode_steps: int | None = None,
        system_prompt: str | None = None,
    ) -> None:
        if not isinstance(agent_id, str) or not agent_id:
            raise ValueError(f"agent_id={agent_id!r}; pass a non-empty string like 'agent_0'")
        if max_episode_steps is not None and max_episode_steps < 1:
            raise ValueError(
                f"max_episode_steps={max_episode_steps}; pass a positive int or None for no "
                "env time limit"
            )
        self.agent_id: AgentId = agent_id
        self.max_episode_steps = max_episode_steps
        if system_prompt is not None:
            self.system_prompt = system_prompt
        self._started = False
        self._done = False
        self._num_steps = 0

    # -- what subclasses implement -------------------------------------------------
    @abstractmethod
    def env_reset(self, seed: int | None = None) -> tuple[Observation, Info]:
        """Start a new episode; return the agent's first observation and info."""

    @abstractmethod
    def env_step(self, action: str) -> StepOutcome:
        """Apply one (already parsed) action and return its outcome."""

    # -- LudicEnv ------------------------------------------------------------------
    @property
    def agent_ids(self) -> list[AgentId]:
        return [self.agent_id]

    @property
    def active_agents(self) -> list[AgentId]:
        return [] if self._done else [self.agent_id]

    @property
    def num_steps(self) -> int:
        """Steps taken in the current episode."""
        return self._num_steps

    @property
    def done(self) -> bool:
        """Whether the current episode has terminated or been truncated."""
        return self._done

    def reset(self, seed: int | None = None) -> dict[AgentId, tuple[Observation, Info]]:
        reset = self.env_reset(seed)
        if not (isinstance(reset, tuple) and len(reset) == 2 and isinstance(reset[0], str)):
            raise ContractError(
                f"{type(self).__name__}.env_reset(seed={seed}) returned {reset!r}; return "
                "(observation str, info dict)"
            )
        obs, info = reset
        self._started = True
        self._done = False
        self._num_steps = 0
        return {self.agent_id: (obs, info)}

    def step(self, actions: dict[AgentId, str]) -> dict[AgentId, StepOutcome]:
        if set(actions) != {self.agent_id}:
            raise ValueError(
                f"{type(self).__name__}.step got actions for {sorted(actions)}; expected "
                f"exactly one action for agent id {self.agent_id!r}"
            )
        if not self._started:
            raise RuntimeError(f"{type(self).__name__}.step called before reset(); call reset()")
        if self._done:
            raise RuntimeError(
                f"{type(self).__name__}.step called after the episode ended (step "
                f"{self._num_steps}); call reset() to start a new episode"
            )
        outcome = self.env_step(actions[self.agent_id])
        if not isinstance(outcome, StepOutcome):
            raise ContractError(
                f"{type(self).__name__}.env_step returned {outcome!r}; return a "
                "StepOutcome(obs, reward, terminated=..., truncated=...)"
            )
        self._num_steps += 1
        if (
            self.max_episode_steps is not None
            and self._num_steps >= self.max_episode_steps
            and not outcome.terminated
            and not outcome.truncated
        ):
            outcome = replace(
                outcome, truncated=True, info={**outcome.info, "truncation": "max_episode_steps"}
            )
        self._done = outcome.terminated or outcome.truncated
        return {self.agent_id: outcome}
