"""The multi-agent loop: every active agent acts each step, one rollout per agent."""

from __future__ import annotations

from collections.abc import Mapping

from ludic._async import gather_or_cancel
from ludic.envs.env import LudicEnv
from ludic.interaction.base import ActingAgent, Episode, ExternalToolHandler
from ludic.interaction.env_calls import reset_env, step_env
from ludic.interaction.info import PROTOCOL_META_KEYS, merge_step_info
from ludic.interaction.step_collector import (
    DEFAULT_MAX_TOOL_ROUNDS,
    AgentLoopProtocol,
    TraceCollector,
    exclusive_agents,
)
from ludic.types import AgentId, Observation, Rollout, StepOutcome


class MultiAgentProtocol(AgentLoopProtocol):
    """Run one episode of a multi-agent ``LudicEnv``, one ``ActingAgent`` per env agent id.

    Each protocol step:

    1. Every agent in ``env.active_agents`` takes a turn, concurrently
       (``asyncio.gather``; acts start in ``active_agents`` order). External tool calls
       are handled within the turn as in ``SingleAgentProtocol``.
    2. An agent whose act failed to parse gets a synthetic step in its own rollout (same
       fields as the single-agent case), sees the feedback via ``on_after_step`` and
       takes no part in this ``env.step``. If *no* active agent has a valid action,
       ``env.step`` is not called at all this step (the step still counts toward
       ``max_steps``).
    3. ``env.step`` gets the valid actions. Each acting agent's outcome becomes an
       EnvironmentStep in its rollout (``agent_step_indices`` = that turn's agent steps).
       The env may also return outcomes for agents that did not act (e.g. the waiting
       player in a turn-based game): such a *passive* outcome updates that agent's
       observation (``on_after_step``) and is folded into its latest env step: reward
       added, ``next_obs`` replaced, ``terminated``/``truncated`` OR-ed, info merged.
       A passive outcome with a non-zero reward for an agent that has not acted yet
       raises (there is no action to credit).

    An agent is done once its outcome is ``terminated`` or ``truncated`` (or its turn hit
    ``max_tool_rounds``); the episode ends when every agent is done. After ``max_steps``
    protocol steps every agent not done is truncated with ``truncation_reason=
    "max_steps"``. Rollouts come back in ``env.agent_ids`` order, then delegated ones.

    Errors: env agent ids with no agent, agents with no env id, unknown ids in
    ``active_agents`` or in ``env.step``'s outcomes, a done agent listed as active, no
    active agent while some are not done, a missing outcome for an acting agent, and
    one agent object registered under two ids (agents hold per-episode state).
    """

    def __init__(
        self,
        agents: Mapping[AgentId, ActingAgent],
        *,
        external_tool_handler: ExternalToolHandler | None = None,
        max_tool_rounds: int = DEFAULT_MAX_TOOL_ROUNDS,
        system_prompt: str | None = None,
    ) -> None:
        if not agents:
            raise ValueError("MultiAgentProtocol: agents is empty; map each env agent id")
        seen: dict[int, AgentId] = {}
        for aid, agent in agents.items():
            if id(agent) in seen:
                raise ValueError(
                    f"MultiAgentProtocol: agent ids {seen[id(agent)]!r} and {aid!r} share one "
                    "agent object; agents hold per-episode state, so build one per id"
                )
            seen[id(agent)] = aid
        super().__init__(external_tool_handler, max_tool_rounds, system_prompt)
        self.agents = dict(agents)

    def _check_ids(self, env: LudicEnv) -> list[AgentId]:
        env_ids = list(env.agent_ids)
        missing = [a for a in env_ids if a not in self.agents]
        extra = [a for a in self.agents if a not in env_ids]
        if missing or extra:
            raise ValueError(
                f"MultiAgentProtocol: {type(env).__name__}.agent_ids={env_ids} but agents "
                f"are given for {list(self.agents)} (no agent for {missing}, unknown to the "
                f"env: {extra}); pass exactly one agent per env agent id"
            )
        return env_ids

    async def _play(self, episode: Episode) -> list[Rollout]:
        """Run one episode; returns ``[*per_agent_rollouts, *delegated_rollouts]``."""
        env = episode.env
        env_ids = self._check_ids(env)
        with exclusive_agents(type(self).__name__, self.agents):
            collector, obs = await self._reset(episode, env_ids)
            done: set[AgentId] = set()
            for _ in range(episode.max_steps):
                active = self._active(env, done)
                turns = await gather_or_cancel(
                    *(self._turn(self.agents[a], a, collector, episode.inference) for a in active)
                )
                actions: dict[AgentId, str] = {}
                turn_of = dict(zip(active, turns))
                for aid, turn in turn_of.items():
                    if collector.collect_turn(aid, turn):
                        done.add(aid)
                    elif turn.act.parse_error:
                        step = collector.record_parse_failure(aid, turn, prev_obs=obs[aid])
                        obs[aid] = step.next_obs or ""
                        self.agents[aid].on_after_step(obs[aid], step.info)
                    else:
                        assert turn.act.action is not None  # checked by run_agent_turn
                        actions[aid] = turn.act.action
                if actions:
                    outcomes = await step_env(env, actions)
                    self._check_outcomes(type(env).__name__, env_ids, actions, outcomes, done)
                    for aid in [a for a in env_ids if a in outcomes]:
                        outcome = outcomes[aid]
                        info = outcome.info
                        if aid in actions:
                            info = collector.record_outcome(
                                aid,
                                turn_of[aid],
                                prev_obs=obs[aid],
                                action=actions[aid],
                                outcome=outcome,
                            ).info
                        else:
                            _apply_passive_outcome(collector, aid, outcome)
                        obs[aid] = outcome.obs
                        self.agents[aid].on_after_step(outcome.obs, info)
                        if outcome.terminated or outcome.truncated:
                            done.add(aid)
                if len(done) == len(env_ids):
                    break
            else:
                for aid in env_ids:
                    if aid not in done:
                        collector.truncate_at_max_steps(aid)
            return collector.all_rollouts()

    async def _reset(
        self, episode: Episode, env_ids: list[AgentId]
    ) -> tuple[TraceCollector, dict[AgentId, Observation]]:
        """Reset the env, then every agent; each rollout records its ``initial_obs``."""
        env = episode.env
        resets = await reset_env(env, episode.env_seed)
        if missing := [a for a in env_ids if a not in resets]:
            raise ValueError(
                f"{type(env).__name__}.reset() returned no observation for agents {missing}"
            )
        meta = merge_step_info(
            episode.meta, {"env_seed": episode.env_seed}, reserved=PROTOCOL_META_KEYS
        )
        collector = TraceCollector(env_ids, meta=meta)
        obs: dict[AgentId, Observation] = {}
        system_prompt = self.system_prompt or env.system_prompt
        for aid in env_ids:
            obs[aid], info = resets[aid]
            rollout = collector.rollout(aid)
            rollout.meta = merge_step_info(
                rollout.meta, {"initial_obs": obs[aid]}, reserved=PROTOCOL_META_KEYS
            )
            rollout.meta["truncation_reason"] = None
            self.agents[aid].on_env_reset(obs[aid], info, system_prompt=system_prompt)
        return collector, obs

    def _active(self, env: LudicEnv, done: set[AgentId]) -> list[AgentId]:
        active = list(env.active_agents)
        name = type(env).__name__
        if unknown := [a for a in active if a not in self.agents]:
            raise ValueError(
                f"{name}.active_agents lists unknown agent ids {unknown}; known: "
                f"{list(self.agents)}"
            )
        if finished := [a for a in active if a in done]:
            raise RuntimeError(
                f"{name}.active_agents lists {finished}, which already terminated or were "
                "truncated; an env must not ask a finished agent to act"
            )
        if not active:
            waiting = [a for a in self.agents if a not in done]
            raise RuntimeError(
                f"{name}.active_agents is empty but agents {waiting} are not done; end "
                "their episodes with terminated/truncated outcomes or keep one active"
            )
        return active

    @staticmethod
    def _check_outcomes(
        env_name: str,
        env_ids: list[AgentId],
        actions: dict[AgentId, str],
        outcomes: Mapping[AgentId, StepOutcome],
        done: set[AgentId],
    ) -> None:
        if missing := [a for a in actions if a not in outcomes]:
            raise ValueError(
                f"{env_name}.step() returned no outcome for acting agents {missing}; step "
                "must return a StepOutcome for every agent in its actions"
            )
        if unknown := [a for a in outcomes if a not in env_ids]:
            raise ValueError(
                f"{env_name}.step() returned outcomes for unknown agent ids {unknown}; "
                f"known: {env_ids}"
            )
        if finished := [a for a in outcomes if a in done and a not in actions]:
            raise RuntimeError(
                f"{env_name}.step() returned outcomes for {finished}, which already "
                "terminated or were truncated"
            )


def _apply_passive_outcome(
    collector: TraceCollector, agent_id: AgentId, outcome: StepOutcome
) -> None:
    """Fold an outcome for an agent that did not act into its latest env step (see
    ``MultiAgentProtocol``)."""
    env_steps = collector.rollout(agent_id).env_steps
    collector.finish_if_ended(agent_id, outcome)
    if not env_steps:
        if outcome.reward != 0.0:
            raise ValueError(
                f"env.step() gave agent {agent_id!r} reward {outcome.reward} before its "
                "first action; there is no action to credit. Give the reward once the agent "
                "has acted"
            )
        return
    last = env_steps[-1]
    last.reward += outcome.reward
    last.next_obs = outcome.obs
    last.terminated = last.terminated or outcome.terminated
    last.truncated = last.truncated or outcome.truncated
    protocol_info = {"truncation_reason": "env"} if outcome.truncated else {}
    last.info = merge_step_info(last.info, protocol_info, outcome.info)
