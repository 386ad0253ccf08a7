"""Building rollouts step by step: one ``Rollout`` per agent, plus the per-turn act loop.

``TraceCollector`` owns the rollouts of one episode and is the only place that assigns
step indices, so ``step.index == position in rollout.steps`` always holds.
``run_agent_turn`` runs one agent's turn: ``act`` -> (external tools -> ``act``)* until
the agent produces an env action or a parse failure. ``exclusive_agents`` keeps one agent
from playing two episodes at once. ``AgentLoopProtocol``: what both agent protocols share.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ludic._async import gather_or_cancel
from ludic.inference.request import InferenceSpec
from ludic.interaction.base import (
    ActingAgent,
    EpisodeProtocol,
    ExternalToolHandler,
    ExternalToolResult,
)
from ludic.interaction.info import PROTOCOL_META_KEYS, merge_step_info
from ludic.types import (
    AgentAct,
    AgentId,
    AgentStep,
    EnvironmentStep,
    Info,
    Message,
    Observation,
    Rollout,
    StepOutcome,
    ToolCall,
    new_id,
)

DEFAULT_PARSE_FEEDBACK = "Your last reply could not be parsed into an action. Try again."
"""``next_obs`` of a synthetic step when the agent's ``AgentAct.feedback_obs`` is None."""

DEFAULT_MAX_TOOL_ROUNDS = 8
"""Default cap on external-tool rounds (handler calls) within one turn."""


_IN_USE: dict[int, str] = {}
"""``id`` of every agent (and context strategy) playing an episode right now -> its role."""


@contextlib.contextmanager
def exclusive_agents(owner: str, agents: Mapping[AgentId, ActingAgent]) -> Iterator[None]:
    """Hold ``agents`` and their ``context`` strategies (if they have one) for one episode.

    Agents keep per-episode state (conversation, in-turn tokens), so one agent object in
    two concurrent episodes would interleave both histories silently; this raises
    instead. Reusing an agent for a later episode is fine (``on_env_reset`` resets it).
    """
    claims: dict[int, str] = {}
    for aid, agent in agents.items():
        parts = [(agent, f"agent {aid!r} ({type(agent).__name__})")]
        context = getattr(agent, "context", None)
        if context is not None:
            parts.append((context, f"the context strategy of agent {aid!r}"))
        for obj, role in parts:
            if id(obj) in _IN_USE or id(obj) in claims:
                raise RuntimeError(
                    f"{owner}: {role} is already in use by an episode that is still running; "
                    "agents and context strategies hold per-episode state, so build fresh "
                    "ones per episode (e.g. a protocol factory `lambda: "
                    "SingleAgentProtocol(Agent(context=FullDialog(), ...))`)"
                )
            claims[id(obj)] = role
    _IN_USE.update(claims)
    try:
        yield
    finally:
        for key in claims:
            _IN_USE.pop(key, None)


class TraceCollector:
    """One ``Rollout`` per agent id; assigns every step its index in its rollout.

    ``meta`` is copied into every rollout's meta, with ``agent_id`` added (a ``meta``
    that already holds a different ``agent_id`` raises).
    """

    def __init__(self, agent_ids: Sequence[AgentId], *, meta: Mapping[str, Any] | None = None):
        if not agent_ids:
            raise ValueError("TraceCollector: agent_ids is empty; pass at least one agent id")
        if len(set(agent_ids)) != len(agent_ids):
            raise ValueError(f"TraceCollector: duplicate agent ids in {list(agent_ids)}")
        self._rollouts: dict[AgentId, Rollout] = {
            aid: Rollout(meta=merge_step_info(meta, {"agent_id": aid}, reserved=PROTOCOL_META_KEYS))
            for aid in agent_ids
        }
        self._delegated: list[Rollout] = []

    @property
    def agent_ids(self) -> list[AgentId]:
        return list(self._rollouts)

    def rollout(self, agent_id: AgentId) -> Rollout:
        try:
            return self._rollouts[agent_id]
        except KeyError:
            raise KeyError(
                f"TraceCollector: unknown agent id {agent_id!r}; known ids: {self.agent_ids}"
            ) from None

    def rollouts(self) -> list[Rollout]:
        """All rollouts, in the order of ``agent_ids``."""
        return list(self._rollouts.values())

    def all_rollouts(self) -> list[Rollout]:
        """What a protocol returns: :meth:`rollouts`, then the delegated ones (in the order
        their turns were collected)."""
        return [*self.rollouts(), *self._delegated]

    def collect_turn(self, agent_id: AgentId, turn: TurnResult) -> bool:
        """Keep the turn's delegated rollouts (stamped with ``parent_rollout_id`` /
        ``parent_turn_id``, see :func:`link_to_parent`). If the turn hit the tool-round cap,
        end the rollout truncated (``truncation_reason="max_tool_rounds"``) and return True.
        """
        link_to_parent(turn.delegated, self.rollout(agent_id), turn.turn_id)
        self._delegated.extend(turn.delegated)
        if turn.tool_rounds_exceeded:
            self.finish(agent_id, terminated=False, truncated=True, reason="max_tool_rounds")
        return turn.tool_rounds_exceeded

    def add_agent_steps(
        self, agent_id: AgentId, turn_id: str, steps: Sequence[AgentStep]
    ) -> tuple[int, ...]:
        """Append ``steps`` (all of ``turn_id``), set their indices and return them."""
        rollout = self.rollout(agent_id)
        indices: list[int] = []
        for step in steps:
            if not isinstance(step, AgentStep):
                raise TypeError(
                    f"agent {agent_id!r}: AgentAct.steps must hold AgentStep objects, got "
                    f"{type(step).__name__}"
                )
            if step.turn_id != turn_id:
                raise ValueError(
                    f"agent {agent_id!r}: AgentStep.turn_id={step.turn_id!r} but the protocol "
                    f"asked for turn_id={turn_id!r}; Agent.act must stamp every step with the "
                    "turn_id it was given"
                )
            step.index = rollout.next_step_index()
            rollout.steps.append(step)
            indices.append(step.index)
        return tuple(indices)

    def add_env_step(
        self,
        agent_id: AgentId,
        *,
        turn_id: str,
        prev_obs: Observation,
        action: str,
        next_obs: Observation | None,
        reward: float,
        agent_step_indices: tuple[int, ...],
        terminated: bool = False,
        truncated: bool = False,
        synthetic: bool = False,
        info: Info | None = None,
    ) -> EnvironmentStep:
        rollout = self.rollout(agent_id)
        step = EnvironmentStep(
            index=rollout.next_step_index(),
            turn_id=turn_id,
            prev_obs=prev_obs,
            action=action,
            next_obs=next_obs,
            reward=reward,
            terminated=terminated,
            truncated=truncated,
            agent_step_indices=agent_step_indices,
            synthetic=synthetic,
            info=dict(info or {}),
        )
        rollout.steps.append(step)
        return step

    def record_outcome(
        self,
        agent_id: AgentId,
        turn: TurnResult,
        *,
        prev_obs: Observation,
        action: str,
        outcome: StepOutcome,
    ) -> EnvironmentStep:
        """Record a real ``env.step`` outcome of ``turn``; an env truncation gets
        ``info["truncation_reason"] = "env"`` and ends the rollout."""
        protocol_info = {"truncation_reason": "env"} if outcome.truncated else {}
        step = self.add_env_step(
            agent_id,
            turn_id=turn.turn_id,
            prev_obs=prev_obs,
            action=action,
            next_obs=outcome.obs,
            reward=outcome.reward,
            agent_step_indices=turn.agent_step_indices,
            terminated=outcome.terminated,
            truncated=outcome.truncated,
            info=merge_step_info(protocol_info, outcome.info),
        )
        self.finish_if_ended(agent_id, outcome)
        return step

    def record_parse_failure(
        self, agent_id: AgentId, turn: TurnResult, *, prev_obs: Observation
    ) -> EnvironmentStep:
        """Record the synthetic step of ``turn``'s parse failure: no ``env.step``, reward 0.0
        (the penalty is on the AgentStep), ``next_obs`` = the parser's feedback, ``action`` =
        the raw completion."""
        act = turn.act
        return self.add_env_step(
            agent_id,
            turn_id=turn.turn_id,
            prev_obs=prev_obs,
            action=act.steps[-1].completion if act.steps else "",
            next_obs=act.feedback_obs if act.feedback_obs is not None else DEFAULT_PARSE_FEEDBACK,
            reward=0.0,
            agent_step_indices=turn.agent_step_indices,
            synthetic=True,
            info={"parse_error": True},
        )

    def finish(
        self, agent_id: AgentId, *, terminated: bool, truncated: bool, reason: str | None
    ) -> None:
        """Set the rollout's end flags and ``meta["truncation_reason"]``."""
        rollout = self.rollout(agent_id)
        rollout.terminated = terminated
        rollout.truncated = truncated
        rollout.meta["truncation_reason"] = reason

    def finish_if_ended(self, agent_id: AgentId, outcome: StepOutcome) -> bool:
        """:meth:`finish` the rollout if ``outcome`` ended it (an env truncation gets
        ``truncation_reason="env"``); returns whether it did."""
        ended = outcome.terminated or outcome.truncated
        if ended:
            self.finish(
                agent_id,
                terminated=outcome.terminated,
                truncated=outcome.truncated,
                reason="env" if outcome.truncated else None,
            )
        return ended

    def truncate_at_max_steps(self, agent_id: AgentId) -> None:
        """Protocol truncation: mark the last env step (if any) and the rollout truncated
        with ``truncation_reason="max_steps"``."""
        env_steps = self.rollout(agent_id).env_steps
        if env_steps:
            last = env_steps[-1]
            last.truncated = True
            last.info = merge_step_info({"truncation_reason": "max_steps"}, last.info)
        self.finish(agent_id, terminated=False, truncated=True, reason="max_steps")


@dataclass
class TurnResult:
    """One agent's turn: the final act, the indices of all its agent steps, the rollouts
    produced by external tool handlers, and whether the tool-round cap cut it off
    (then ``act`` is the act that asked for one round too many)."""

    turn_id: str
    act: AgentAct
    agent_step_indices: tuple[int, ...]
    delegated: list[Rollout] = field(default_factory=list)
    tool_rounds_exceeded: bool = False


async def run_agent_turn(
    agent: ActingAgent,
    *,
    agent_id: AgentId,
    collector: TraceCollector,
    turn_id: str,
    inference: InferenceSpec,
    external_tool_handler: ExternalToolHandler | None,
    max_tool_rounds: int,
) -> TurnResult:
    """``act`` until the agent targets the env (or fails to parse), handling external tool
    calls in between within the same turn.

    Each external round runs the act's tool calls concurrently through
    ``external_tool_handler``, feeds the ``tool`` messages to ``agent.on_tool_results``,
    records them on the calling AgentStep's ``tool_results`` (unless the agent already
    did) and acts again. After ``max_tool_rounds`` rounds a further
    external act ends the turn with ``tool_rounds_exceeded=True``.
    """
    indices: list[int] = []
    delegated: list[Rollout] = []
    rounds = 0
    while True:
        act = await agent.act(inference=inference, turn_id=turn_id)
        if not isinstance(act, AgentAct):
            raise TypeError(
                f"agent {agent_id!r}: act() returned {type(act).__name__}, expected AgentAct"
            )
        indices.extend(collector.add_agent_steps(agent_id, turn_id, act.steps))
        if act.parse_error or act.action_target == "env":
            if not act.parse_error and act.action is None:
                raise ValueError(
                    f"agent {agent_id!r}: AgentAct has action_target='env' and "
                    "parse_error=False but action=None; set parse_error=True (with "
                    "feedback_obs) when the completion did not parse"
                )
            return TurnResult(turn_id, act, tuple(indices), delegated)
        if act.action_target != "external":
            raise ValueError(
                f"agent {agent_id!r}: AgentAct.action_target={act.action_target!r}; act() must "
                "return 'env' or 'external' (internal tool loops run inside act())"
            )
        if rounds >= max_tool_rounds:
            return TurnResult(turn_id, act, tuple(indices), delegated, tool_rounds_exceeded=True)
        rounds += 1
        messages, rollouts = await _handle_external_calls(
            agent_id, act.tool_calls, external_tool_handler
        )
        delegated.extend(rollouts)
        agent.on_tool_results(messages)
        if act.steps:
            _record_tool_results(act.steps[-1], messages)


async def _handle_external_calls(
    agent_id: AgentId, calls: Sequence[ToolCall], handler: ExternalToolHandler | None
) -> tuple[list[Message], list[Rollout]]:
    if handler is None:
        names = sorted({c.name for c in calls})
        raise ValueError(
            f"agent {agent_id!r} called external tool(s) {names} but the protocol has no "
            "external_tool_handler; pass external_tool_handler= to the protocol (e.g. "
            "make_delegation_handler(...)) or declare the tool as internal on the agent"
        )
    if not calls:
        raise ValueError(
            f"agent {agent_id!r}: AgentAct.action_target='external' but tool_calls is empty; "
            "an external act must carry the ToolCalls for the protocol to handle"
        )
    results = await gather_or_cancel(*(handler(call) for call in calls))
    messages: list[Message] = []
    rollouts: list[Rollout] = []
    for call, result in zip(calls, results):
        if not isinstance(result, ExternalToolResult):
            raise TypeError(
                f"external_tool_handler returned {type(result).__name__} for tool "
                f"{call.name!r}; it must return ExternalToolResult(content=..., rollouts=...)"
            )
        messages.append(
            {"role": "tool", "tool_call_id": call.id, "name": call.name, "content": result.content}
        )
        rollouts.extend(result.rollouts)
    return messages, rollouts


def _record_tool_results(step: AgentStep, messages: list[Message]) -> None:
    """Append ``messages`` to ``step.tool_results``, skipping tool_call_ids already there."""
    seen = {m.get("tool_call_id") for m in step.tool_results}
    step.tool_results.extend(m for m in messages if m["tool_call_id"] not in seen)


def link_to_parent(rollouts: Sequence[Rollout], parent: Rollout, turn_id: str) -> None:
    """Stamp rollouts produced by external tools during ``turn_id`` of ``parent`` with
    ``meta["parent_rollout_id"]`` and ``meta["parent_turn_id"]`` (kept if already set, so
    nested delegation keeps pointing at the direct parent)."""
    for r in rollouts:
        r.meta.setdefault("parent_rollout_id", parent.id)
        r.meta.setdefault("parent_turn_id", turn_id)


class AgentLoopProtocol(EpisodeProtocol):
    """What ``SingleAgentProtocol`` and ``MultiAgentProtocol`` share: the external tool
    handler, the cap on its rounds per turn, the system prompt, and :meth:`_turn`."""

    def __init__(
        self,
        external_tool_handler: ExternalToolHandler | None,
        max_tool_rounds: int,
        system_prompt: str | None,
    ) -> None:
        if max_tool_rounds < 0:
            raise ValueError(
                f"{type(self).__name__}: max_tool_rounds={max_tool_rounds}; expected >= 0"
            )
        self.external_tool_handler = external_tool_handler
        self.max_tool_rounds = max_tool_rounds
        self.system_prompt = system_prompt

    async def _turn(
        self,
        agent: ActingAgent,
        agent_id: AgentId,
        collector: TraceCollector,
        inference: InferenceSpec,
    ) -> TurnResult:
        """One turn of ``agent`` under a fresh ``turn_id`` (:func:`run_agent_turn`)."""
        return await run_agent_turn(
            agent,
            agent_id=agent_id,
            collector=collector,
            turn_id=new_id(),
            inference=inference,
            external_tool_handler=self.external_tool_handler,
            max_tool_rounds=self.max_tool_rounds,
        )
