"""The single-agent loop: one agent, one env agent id, one rollout (plus delegated ones)."""

from __future__ import annotations

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
from ludic.types import AgentId, Observation, Rollout


class SingleAgentProtocol(AgentLoopProtocol):
    """Run one episode of ``agent`` on a (single-agent) ``LudicEnv``.

    Per turn (fresh ``turn_id``):

    1. ``act = await agent.act(...)``; its steps are appended to the rollout.
    2. ``action_target == "external"``: every tool call goes through
       ``external_tool_handler``; the ``tool`` messages go back via
       ``agent.on_tool_results`` and the agent acts again in the same turn. Rollouts the
       handler returns (delegated sub-agents) are collected. More than
       ``max_tool_rounds`` rounds in one turn ends the episode: the turn has no env step,
       the rollout is ``truncated`` with ``meta["truncation_reason"] = "max_tool_rounds"``.
    3. ``act.parse_error``: ``env.step`` is *not* called. A synthetic EnvironmentStep
       (``synthetic=True``, reward 0.0, ``next_obs`` = ``act.feedback_obs``, ``action`` =
       the raw completion, ``info["parse_error"] = True``) is recorded and the feedback is
       shown via ``agent.on_after_step``. The next turn's ``prev_obs`` is that feedback.
    4. Otherwise ``env.step({agent_id: act.action})`` and ``agent.on_after_step(obs,
       info)`` (also after the final step).

    Every EnvironmentStep's ``agent_step_indices`` are the indices of its turn's agent
    steps. The episode ends on env ``terminated``/``truncated`` (env truncation:
    ``truncation_reason="env"``) or after ``max_steps`` env steps, synthetic steps
    included: then the last env step and the rollout are marked ``truncated`` with
    ``truncation_reason="max_steps"`` (protocol truncation).

    ``Rollout.meta`` = the caller's ``meta`` + ``agent_id``, ``env_seed``,
    ``initial_obs`` and ``truncation_reason`` (None, "env", "max_steps" or
    "max_tool_rounds"). Delegated rollouts get ``parent_rollout_id``/``parent_turn_id``.

    Args:
        agent: the acting agent (fresh per episode: it holds conversation state).
        external_tool_handler: answers ``action_target="external"`` tool calls.
        agent_id: the env agent id to play; default: the env's only agent id.
        max_tool_rounds: external-tool rounds allowed per turn.
        system_prompt: overrides ``env.system_prompt`` in ``agent.on_env_reset``.
    """

    def __init__(
        self,
        agent: ActingAgent,
        *,
        external_tool_handler: ExternalToolHandler | None = None,
        agent_id: AgentId | None = None,
        max_tool_rounds: int = DEFAULT_MAX_TOOL_ROUNDS,
        system_prompt: str | None = None,
    ) -> None:
        super().__init__(external_tool_handler, max_tool_rounds, system_prompt)
        self.agent = agent
        self.agent_id = agent_id

    def _resolve_agent_id(self, env: LudicEnv) -> AgentId:
        ids = list(env.agent_ids)
        if self.agent_id is not None:
            if self.agent_id not in ids:
                raise ValueError(
                    f"SingleAgentProtocol: agent_id={self.agent_id!r} is not an agent of "
                    f"{type(env).__name__} (agent_ids={ids}); pass one of those"
                )
            return self.agent_id
        if len(ids) != 1:
            raise ValueError(
                f"SingleAgentProtocol: {type(env).__name__} has agent_ids={ids}; pass "
                "agent_id= to pick the agent to play, or use MultiAgentProtocol"
            )
        return ids[0]

    async def _play(self, episode: Episode) -> list[Rollout]:
        """Run one episode; returns ``[rollout, *delegated_rollouts]``."""
        env = episode.env
        agent_id = self._resolve_agent_id(env)
        with exclusive_agents(type(self).__name__, {agent_id: self.agent}):
            collector, obs = await self._reset(episode, agent_id)
            rollout = collector.rollout(agent_id)
            ended = False
            while rollout.length < episode.max_steps and not ended:
                active = env.active_agents
                if agent_id not in active:
                    raise RuntimeError(
                        f"{type(env).__name__}.active_agents={active} does not include "
                        f"{agent_id!r} although the episode has not ended; SingleAgentProtocol "
                        "needs its agent to act every step (use MultiAgentProtocol)"
                    )
                turn = await self._turn(self.agent, agent_id, collector, episode.inference)
                if collector.collect_turn(agent_id, turn):
                    break
                act = turn.act
                if act.parse_error:
                    step = collector.record_parse_failure(agent_id, turn, prev_obs=obs)
                else:
                    assert act.action is not None  # checked by run_agent_turn
                    outcomes = await step_env(env, {agent_id: act.action})
                    if agent_id not in outcomes:
                        raise ValueError(
                            f"{type(env).__name__}.step() returned outcomes for {sorted(outcomes)} "
                            f"but not for the acting agent {agent_id!r}"
                        )
                    step = collector.record_outcome(
                        agent_id, turn, prev_obs=obs, action=act.action, outcome=outcomes[agent_id]
                    )
                    ended = step.terminated or step.truncated
                assert step.next_obs is not None
                obs = step.next_obs
                self.agent.on_after_step(obs, step.info)
            if not ended and rollout.meta["truncation_reason"] is None:
                collector.truncate_at_max_steps(agent_id)
            return collector.all_rollouts()

    async def _reset(
        self, episode: Episode, agent_id: AgentId
    ) -> tuple[TraceCollector, Observation]:
        """Reset the env and the agent; the collector's rollout records the reset."""
        env, env_seed = episode.env, episode.env_seed
        resets = await reset_env(env, env_seed)
        if agent_id not in resets:
            raise ValueError(
                f"{type(env).__name__}.reset() returned observations for {sorted(resets)} "
                f"but not for agent {agent_id!r}; reset must return every agent id"
            )
        obs, info = resets[agent_id]
        meta = merge_step_info(
            episode.meta, {"env_seed": env_seed, "initial_obs": obs}, reserved=PROTOCOL_META_KEYS
        )
        collector = TraceCollector([agent_id], meta=meta)
        rollout = collector.rollout(agent_id)
        rollout.meta["truncation_reason"] = None
        if info:  # e.g. a QA env's target: what a reward function may need after a parse failure
            rollout.meta["reset_info"] = dict(info)
        self.agent.on_env_reset(obs, info, system_prompt=self.system_prompt or env.system_prompt)
        return collector, obs
