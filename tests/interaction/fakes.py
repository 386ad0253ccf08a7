"""Hand-built agents and envs for protocol tests: every act and every step is scripted."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from ludic.envs.env import LudicEnv
from ludic.inference.request import InferenceSpec
from ludic.types import (
    AgentAct,
    AgentId,
    AgentStep,
    Info,
    Message,
    Observation,
    StepOutcome,
    TokenTrace,
    ToolCall,
)


@dataclass
class Reply:
    """One scripted ``act``: ``internal_calls`` internal tool calls, then a final call that
    is an env action, an external tool call, or a parse failure."""

    completion: str
    action: str | None = None
    external: list[ToolCall] = field(default_factory=list)
    feedback: str | None = None
    internal_calls: int = 0
    reward: float = 0.0


def answer(action: str, *, internal_calls: int = 0, reward: float = 0.0) -> Reply:
    return Reply(f"<a>{action}</a>", action=action, internal_calls=internal_calls, reward=reward)


def garbled(text: str = "???", *, feedback: str | None = "Use <a>...</a>.", reward: float = -1.0):
    return Reply(text, feedback=feedback, reward=reward)


def call_tool(name: str, call_id: str, **arguments: object) -> Reply:
    return Reply(f"<call {name}>", external=[ToolCall(call_id, name, dict(arguments))])


def trace_for(text: str) -> TokenTrace:
    ids = tuple(ord(c) for c in text) or (0,)
    return TokenTrace(
        prompt_token_ids=(1, 2, 3),
        completion_token_ids=ids,
        completion_logprobs=tuple(-0.1 * (i + 1) for i in range(len(ids))),
        finish_reason="stop",
    )


class ScriptedAgent:
    """An ``ActingAgent`` that plays ``replies`` in order and records every hook call.

    ``messages`` is a full-dialog context (what the agent has "seen"); ``events`` is the
    hook call log. ``gate``: an optional coroutine awaited at the start of each act.
    """

    def __init__(self, replies: list[Reply], *, gate=None) -> None:
        self.replies = list(replies)
        self.messages: list[Message] = []
        self.events: list[tuple] = []
        self.gate = gate

    def on_env_reset(self, obs: Observation, info: Info, *, system_prompt: str | None = None):
        self.events.append(("reset", obs, system_prompt))
        self.messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        self.messages.append({"role": "user", "content": obs})

    def on_after_step(self, obs: Observation, info: Info) -> None:
        self.events.append(("after_step", obs, dict(info)))
        self.messages.append({"role": "user", "content": obs})

    def on_tool_results(self, messages: list[Message]) -> None:
        self.events.append(("tool_results", list(messages)))
        self.messages.extend(messages)

    async def act(self, *, inference: InferenceSpec, turn_id: str) -> AgentAct:
        self.events.append(("act", turn_id))
        if self.gate is not None:
            await self.gate()
        assert self.replies, "ScriptedAgent: script exhausted (the protocol acted too often)"
        r = self.replies.pop(0)
        steps = []
        for i in range(r.internal_calls):
            text = f"<internal {i}>"
            steps.append(self._step(turn_id, text, action_target="internal"))
            self.messages.append({"role": "assistant", "content": text})
            self.messages.append({"role": "tool", "content": f"result {i}"})
        target = "external" if r.external else "env"
        parse_error = r.action is None and not r.external
        steps.append(
            self._step(
                turn_id,
                r.completion,
                action=r.action,
                action_target=target,
                reward=r.reward,
                parse_error=parse_error,
                tool_calls=list(r.external),
            )
        )
        self.messages.append({"role": "assistant", "content": r.completion})
        return AgentAct(
            steps=steps,
            action=r.action,
            action_target=target,
            parse_error=parse_error,
            feedback_obs=r.feedback if parse_error else None,
            tool_calls=list(r.external),
        )

    def _step(self, turn_id: str, completion: str, **kw) -> AgentStep:
        return AgentStep(
            index=-1,
            turn_id=turn_id,
            prompt_messages=list(self.messages),
            completion=completion,
            trace=trace_for(completion),
            **kw,
        )


class LineEnv(LudicEnv):
    """One agent walks a line: obs ``"pos=k"``, reward 1.0 per step, ``terminated`` on
    action ``"stop"``, env truncation after ``time_limit`` steps. Records every
    ``step`` call."""

    def __init__(self, *, agent_id: AgentId = "walker", time_limit: int | None = None):
        self.agent_id = agent_id
        self.time_limit = time_limit
        self.system_prompt = "Walk."
        self.calls: list[dict[AgentId, str]] = []
        self.pos = 0

    @property
    def agent_ids(self) -> list[AgentId]:
        return [self.agent_id]

    def reset(self, seed: int | None = None) -> dict[AgentId, tuple[Observation, Info]]:
        self.pos = 0 if seed is None else seed
        self.calls = []
        return {self.agent_id: (f"pos={self.pos}", {"seed": seed})}

    def step(self, actions: dict[AgentId, str]) -> dict[AgentId, StepOutcome]:
        self.calls.append(dict(actions))
        self.pos += 1
        truncated = self.time_limit is not None and len(self.calls) >= self.time_limit
        return {
            self.agent_id: StepOutcome(
                obs=f"pos={self.pos}",
                reward=1.0,
                terminated=actions[self.agent_id] == "stop",
                truncated=truncated,
                info={"pos": self.pos},
            )
        }


class CouncilEnv(LudicEnv):
    """Several agents act simultaneously each step; an agent is terminated when it says
    ``"done"``. Reward: 1.0 per acting agent. Only agents not done are active."""

    def __init__(self, agent_ids: list[AgentId]):
        self._ids = list(agent_ids)
        self.calls: list[dict[AgentId, str]] = []
        self.finished: set[AgentId] = set()

    @property
    def agent_ids(self) -> list[AgentId]:
        return list(self._ids)

    @property
    def active_agents(self) -> list[AgentId]:
        return [a for a in self._ids if a not in self.finished]

    def reset(self, seed: int | None = None) -> dict[AgentId, tuple[Observation, Info]]:
        self.calls, self.finished = [], set()
        return {a: (f"hello {a}", {}) for a in self._ids}

    def step(self, actions: dict[AgentId, str]) -> dict[AgentId, StepOutcome]:
        self.calls.append(dict(actions))
        out = {}
        for a, act in actions.items():
            if act == "done":
                self.finished.add(a)
            out[a] = StepOutcome(
                obs=f"{a} step {len(self.calls)}", reward=1.0, terminated=act == "done"
            )
        return out


def run(coro):
    """Run a protocol coroutine from a sync test (pytest-asyncio is not used)."""
    return asyncio.run(coro)
