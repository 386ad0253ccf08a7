"""Pure data shared by every layer: messages, token traces, steps and rollouts.

Nothing here imports from the rest of ludic; value objects validate themselves in
``__post_init__``, so bad data fails where it is built. Three notions of "stopped" are kept
apart on purpose: ``terminated`` (the env reached a true terminal state), ``truncated``
(cut off: an env time limit or the protocol's ``max_steps``) and ``finish_reason`` (why the
*LLM* stopped one completion: ``"stop"``, ``"length"``, ...; says nothing of the episode).
"""

from __future__ import annotations

import math
import numbers
import os
import random
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias


class ContractError(TypeError, ValueError):
    """A user-supplied part (an env, a parser) returned something its contract forbids,
    e.g. a ``None`` reward; the message names the part, the value and what is expected.
    A ``TypeError`` and a ``ValueError``, so existing handlers of either still catch it."""


def check_reward(owner: str, reward: object) -> None:
    """``reward`` must be a finite real number; raise :class:`ContractError` naming
    ``owner`` (e.g. ``"StepOutcome.reward"``) otherwise."""
    if not isinstance(reward, numbers.Real):
        raise ContractError(
            f"{owner}={reward!r} ({type(reward).__name__}) is not a number; return a finite "
            "float reward"
        )
    if not math.isfinite(reward):
        raise ContractError(f"{owner}={reward!r}: a reward must be finite")


Message: TypeAlias = dict[str, Any]
"""An OpenAI-style chat message: ``{"role": ..., "content": ...}`` plus optional
``tool_calls`` / ``tool_call_id`` / ``name``."""

Observation: TypeAlias = str
Info: TypeAlias = dict[str, Any]
AgentId: TypeAlias = str

ActionTarget: TypeAlias = Literal["env", "internal", "external"]
"""Where an agent's output goes next: ``"env"`` (a final action for ``env.step``),
``"internal"`` (a tool the agent already ran itself) or ``"external"`` (a tool call
the interaction protocol must handle, e.g. delegation to a sub-agent)."""

FINISH_REASONS = ("stop", "length", "tool_calls", "abort")


GREEDY_BELOW = 1e-5
"""A sampling temperature below this is greedy decoding (vLLM's ``_SAMPLING_EPS``)."""


def logprob_temperature(sampling_temperature: float) -> float:
    """The temperature a sampled token's logprob is taken under: the sampling
    temperature, or 1.0 for greedy decoding (temperature below :data:`GREEDY_BELOW`), which
    takes the argmax of the raw logits (vLLM's ``processed_logprobs`` do the same)."""
    t = float(sampling_temperature)
    return t if t >= GREEDY_BELOW else 1.0


def check_logprob_temperature(owner: str, value: float) -> None:
    """``value`` must be a finite float > 0; raise ``ValueError`` naming ``owner``."""
    if not (isinstance(value, numbers.Real) and math.isfinite(value) and value > 0):
        raise ValueError(
            f"{owner}: logprob_temperature={value!r}; expected a finite temperature > 0 "
            "(1.0 for greedy decoding, see ludic.types.logprob_temperature)"
        )


_IDS = random.Random()  # seeded from os.urandom; private: random.seed() never repeats ids
if hasattr(os, "register_at_fork"):  # POSIX: a forked child draws its own
    os.register_at_fork(after_in_child=lambda: _IDS.seed())


def new_id() -> str:
    """A random 128-bit id as 32 hex digits (a name for rollouts, steps and sessions, without
    a system call each; Mersenne Twister output, so not a secret: never a key or token)."""
    return f"{_IDS.getrandbits(128):032x}"


@dataclass(frozen=True)
class TokenTrace:
    """The exact tokens of one model call, as the inference backend saw and produced them.

    ``completion_logprobs[i]`` is the behaviour policy's log-probability of
    ``completion_token_ids[i]`` (the chosen token), or ``None`` when the backend was not
    asked for logprobs.

    Policy versions (the weight version a token was sampled with), when the backend knows
    them: ``completion_versions[i]`` is the version of ``completion_token_ids[i]``; a
    completion continued after a weight update (partial rollouts) shows the switch, e.g.
    ``(3, 3, 3, 4, 4)``. ``policy_version`` is the oldest of them (the first token's);
    given alone, it stands for every token.

    ``version_end``: the newest version that may have sampled a token, when a weight
    update landed while the backend was generating without pausing it (vLLM's
    ``x-ludic-policy-version-end``): the tokens' versions then lie somewhere between the
    known ones and ``version_end``, token by token unknown. ``None``: the known versions
    are exact. :meth:`newest_version` is what a staleness span uses.

    ``logprob_temperature``: the softmax temperature ``T`` of the policy the tokens were
    drawn from, ``pi_T(y) = softmax(logits / T)[y]``: the request's temperature, or 1.0
    for a greedy request (temperature 0: the argmax of the raw logits), see
    :func:`logprob_temperature`. ``completion_logprobs`` are under ``pi_T`` (after the
    top-k / top-p masks the request set, if any), and the trainer scores these tokens
    under ``pi_T`` too, so the policy it trains is the one
    that sampled (the temperature-scaled one, as in TRL's and verl's GRPO).
    """

    prompt_token_ids: tuple[int, ...]
    completion_token_ids: tuple[int, ...]
    completion_logprobs: tuple[float, ...] | None = None
    finish_reason: str | None = None
    policy_version: int | None = None
    completion_versions: tuple[int, ...] | None = None
    version_end: int | None = None
    logprob_temperature: float = 1.0

    def __post_init__(self) -> None:
        check_logprob_temperature("TokenTrace", self.logprob_temperature)
        object.__setattr__(self, "logprob_temperature", float(self.logprob_temperature))
        object.__setattr__(self, "prompt_token_ids", tuple(self.prompt_token_ids))
        object.__setattr__(self, "completion_token_ids", tuple(self.completion_token_ids))
        if self.completion_versions is not None:
            versions = tuple(int(v) for v in self.completion_versions)
            object.__setattr__(self, "completion_versions", versions)
            if len(versions) != len(self.completion_token_ids):
                raise ValueError(
                    f"TokenTrace: {len(versions)} completion_versions for "
                    f"{len(self.completion_token_ids)} completion tokens; give one policy "
                    "version per completion token"
                )
            if any(b < a for a, b in zip(versions, versions[1:])):
                raise ValueError(
                    f"TokenTrace: completion_versions {versions} go backwards; a later token "
                    "cannot come from an older policy"
                )
            if versions:
                if self.policy_version is None:
                    object.__setattr__(self, "policy_version", versions[0])
                elif self.policy_version != versions[0]:
                    raise ValueError(
                        f"TokenTrace: policy_version={self.policy_version} but the first "
                        f"token's version is {versions[0]}; policy_version is the oldest"
                    )
        if self.version_end is not None:
            object.__setattr__(self, "version_end", int(self.version_end))
            known = self.token_versions()
            if not known or self.version_end < max(known):
                raise ValueError(
                    f"TokenTrace: version_end={self.version_end} needs known token versions "
                    f"no newer than it (got {known and max(known)}); version_end is the "
                    "newest version that may have sampled a token"
                )
        if self.completion_logprobs is not None:
            object.__setattr__(self, "completion_logprobs", tuple(self.completion_logprobs))
            if len(self.completion_logprobs) != len(self.completion_token_ids):
                raise ValueError(
                    f"TokenTrace: {len(self.completion_logprobs)} completion_logprobs for "
                    f"{len(self.completion_token_ids)} completion tokens; the backend must "
                    "return one chosen-token logprob per completion token"
                )
        if self.finish_reason is not None and self.finish_reason not in FINISH_REASONS:
            raise ValueError(
                f"TokenTrace: finish_reason={self.finish_reason!r}; expected one of "
                f"{FINISH_REASONS} or None"
            )

    @property
    def has_logprobs(self) -> bool:
        return self.completion_logprobs is not None

    def token_versions(self) -> tuple[int, ...] | None:
        """One policy version per completion token (``None`` when unknown)."""
        if self.completion_versions is not None:
            return self.completion_versions
        if self.policy_version is None:
            return None
        return (self.policy_version,) * len(self.completion_token_ids)

    def newest_version(self) -> int | None:
        """The newest version that may have sampled a token: ``version_end`` when set,
        else the last token's (``None`` when unknown)."""
        if self.version_end is not None:
            return self.version_end
        versions = self.token_versions()
        return versions[-1] if versions else self.policy_version

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_token_ids": list(self.prompt_token_ids),
            "completion_token_ids": list(self.completion_token_ids),
            "completion_logprobs": (
                None if self.completion_logprobs is None else list(self.completion_logprobs)
            ),
            "finish_reason": self.finish_reason,
            "policy_version": self.policy_version,
            "completion_versions": (
                None if self.completion_versions is None else list(self.completion_versions)
            ),
            "version_end": self.version_end,
            "logprob_temperature": self.logprob_temperature,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TokenTrace:
        return cls(
            prompt_token_ids=tuple(d["prompt_token_ids"]),
            completion_token_ids=tuple(d["completion_token_ids"]),
            completion_logprobs=(
                None if d.get("completion_logprobs") is None else tuple(d["completion_logprobs"])
            ),
            finish_reason=d.get("finish_reason"),
            policy_version=d.get("policy_version"),
            completion_versions=(
                None if d.get("completion_versions") is None else tuple(d["completion_versions"])
            ),
            version_end=d.get("version_end"),
            logprob_temperature=d.get("logprob_temperature", 1.0),
        )


@dataclass(frozen=True)
class ChatResponse:
    """What a ``ChatClient`` returns for one completion.

    ``trace`` carries the exact token ids (token-in / token-out); it is ``None`` only when
    the request's ``ReturnSpec`` did not ask for token ids (e.g. evaluation).
    """

    text: str
    finish_reason: str | None = None
    trace: TokenTrace | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.finish_reason is not None and self.finish_reason not in FINISH_REASONS:
            raise ValueError(
                f"ChatResponse: finish_reason={self.finish_reason!r}; expected one of "
                f"{FINISH_REASONS} or None"
            )
        if self.trace is not None and self.trace.finish_reason != self.finish_reason:
            raise ValueError(
                f"ChatResponse: finish_reason={self.finish_reason!r} but its trace says "
                f"{self.trace.finish_reason!r}"
            )

    @property
    def policy_version(self) -> int | None:
        return None if self.trace is None else self.trace.policy_version


@dataclass(frozen=True)
class StepOutcome:
    """What ``LudicEnv.step`` returns for one agent."""

    obs: Observation
    reward: float
    terminated: bool = False
    truncated: bool = False
    info: Info = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_reward("StepOutcome.reward", self.reward)
        if not isinstance(self.obs, str):
            raise ContractError(
                f"StepOutcome.obs={self.obs!r} ({type(self.obs).__name__}) is not a str; "
                "return the next observation as text"
            )


@dataclass(frozen=True)
class ToolCall:
    """One tool call requested by the model."""

    id: str
    name: str
    arguments: dict[str, Any]


@dataclass
class AgentStep:
    """One model call. Every call is recorded, including internal tool loops, because
    training needs the full reasoning trace, not only the final action.

    ``reward`` is the parser's reward for this call (a format bonus or penalty); the
    environment's reward lives on the ``EnvironmentStep``. ``tool_results`` are the tool
    messages answering this call's tool calls: internal tools (recorded by the agent) or
    external ones (recorded by the protocol); their tokens are masked out of training. ``turn_id`` groups all calls that led to one env step.
    """

    index: int
    turn_id: str
    prompt_messages: list[Message]
    completion: str
    trace: TokenTrace | None = None
    action: str | None = None
    action_target: ActionTarget = "env"
    reward: float = 0.0
    parse_error: bool = False
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_results: list[Message] = field(default_factory=list)
    info: Info = field(default_factory=dict)
    kind: Literal["agent"] = "agent"

    def __post_init__(self) -> None:
        if not math.isfinite(self.reward):
            raise ValueError(f"AgentStep: reward must be finite, got {self.reward!r}")

    @property
    def finish_reason(self) -> str | None:
        return None if self.trace is None else self.trace.finish_reason


@dataclass
class EnvironmentStep:
    """One state transition, triggered by the agent steps ``agent_step_indices``.

    A parse failure produces a *synthetic* environment step (``synthetic=True``): the
    protocol answered with the parser's feedback and ``env.step`` was not called.
    """

    index: int
    turn_id: str
    prev_obs: Observation
    action: str
    next_obs: Observation | None
    reward: float
    terminated: bool = False
    truncated: bool = False
    agent_step_indices: tuple[int, ...] = ()
    synthetic: bool = False
    info: Info = field(default_factory=dict)
    kind: Literal["env"] = "env"

    def __post_init__(self) -> None:
        if not math.isfinite(self.reward):
            raise ValueError(f"EnvironmentStep: reward must be finite, got {self.reward!r}")


Step: TypeAlias = AgentStep | EnvironmentStep


@dataclass(frozen=True)
class Turn:
    """A view over a rollout: the agent calls of one turn and the env step they caused.

    ``env_step`` is ``None`` for a turn cut off before it reached the environment (e.g.
    the protocol hit ``max_steps`` during internal tool calls). The turn's reward is the
    env reward plus every parser reward of its agent steps.
    """

    turn_id: str
    agent_steps: tuple[AgentStep, ...]
    env_step: EnvironmentStep | None

    @property
    def reward(self) -> float:
        env_reward = 0.0 if self.env_step is None else self.env_step.reward
        return env_reward + sum(s.reward for s in self.agent_steps)


@dataclass
class Rollout:
    """One agent's trajectory: a single timeline of agent and environment steps.

    ``meta`` carries request data (env/protocol names, seeds, ``group_id``,
    ``agent_id``, ...). ``terminated``/``truncated`` describe the episode end.
    """

    steps: list[Step] = field(default_factory=list)
    id: str = field(default_factory=new_id)
    meta: dict[str, Any] = field(default_factory=dict)
    terminated: bool = False
    truncated: bool = False

    @property
    def agent_steps(self) -> list[AgentStep]:
        return [s for s in self.steps if isinstance(s, AgentStep)]

    @property
    def env_steps(self) -> list[EnvironmentStep]:
        return [s for s in self.steps if isinstance(s, EnvironmentStep)]

    def turns(self) -> list[Turn]:
        """Group steps by ``turn_id`` in timeline order (kept until a step is added, removed
        or replaced: the trainer asks several times per rollout; a step's ``turn_id``
        changed in place is not seen)."""
        key = tuple(map(id, self.steps))
        kept = self.__dict__.get("_turns")
        if kept is not None and kept[0] == key:
            return list(kept[1])
        turns = self._group_turns()
        self.__dict__["_turns"] = (key, tuple(turns))
        return turns

    def _group_turns(self) -> list[Turn]:
        order: list[str] = []
        agent: dict[str, list[AgentStep]] = {}
        env: dict[str, EnvironmentStep] = {}
        for s in self.steps:
            if s.turn_id not in agent:
                order.append(s.turn_id)
                agent[s.turn_id] = []
            if isinstance(s, AgentStep):
                agent[s.turn_id].append(s)
            else:
                if s.turn_id in env:
                    raise ValueError(
                        f"Rollout {self.id}: turn {s.turn_id!r} has two environment steps"
                    )
                env[s.turn_id] = s
        return [Turn(t, tuple(agent[t]), env.get(t)) for t in order]

    @property
    def total_reward(self) -> float:
        return sum(t.reward for t in self.turns())

    @property
    def length(self) -> int:
        """Number of environment steps (synthetic ones included)."""
        return len(self.env_steps)

    @property
    def initial_obs(self) -> Observation | None:
        envs = self.env_steps
        return envs[0].prev_obs if envs else self.meta.get("initial_obs")

    def next_step_index(self) -> int:
        return len(self.steps)


def rollout_group_key(rollout: Rollout, *, owner: str = "GroupNormalizedReturn") -> Hashable:
    """The group of ``rollout`` for group-relative advantages: ``("group_id", id,
    agent_id)`` when ``meta["group_id"]`` is set, else ``("initial_obs", obs)``; delegated sub-agent
    rollouts get ``("delegated", group_id or obs)``. ``owner`` names the caller in errors."""
    if rollout.meta.get("delegated"):
        return ("delegated", rollout.meta.get("group_id", rollout.initial_obs))
    if "group_id" in rollout.meta:  # per player: self-play's X and O are different roles
        return ("group_id", rollout.meta["group_id"], rollout.meta.get("agent_id"))
    obs = rollout.initial_obs
    if obs is None:
        raise ValueError(
            f"{owner}: rollout {rollout.id!r} has no meta['group_id'] and no "
            "initial observation to group by; set RolloutRequest.meta['group_id'] "
            "(GRPORequestStrategy does this)"
        )
    return ("initial_obs", obs)


def rollout_to_dict(rollout: Rollout) -> dict[str, Any]:
    """A JSON-ready dict of a rollout (the JSONL log and offline-data format)."""

    def step_dict(s: Step) -> dict[str, Any]:
        if isinstance(s, AgentStep):
            return {
                "kind": "agent",
                "index": s.index,
                "turn_id": s.turn_id,
                "prompt_messages": s.prompt_messages,
                "completion": s.completion,
                "trace": None if s.trace is None else s.trace.to_dict(),
                "action": s.action,
                "action_target": s.action_target,
                "reward": s.reward,
                "parse_error": s.parse_error,
                "tool_calls": [
                    {"id": c.id, "name": c.name, "arguments": c.arguments} for c in s.tool_calls
                ],
                "tool_results": s.tool_results,
                "info": s.info,
            }
        return {
            "kind": "env",
            "index": s.index,
            "turn_id": s.turn_id,
            "prev_obs": s.prev_obs,
            "action": s.action,
            "next_obs": s.next_obs,
            "reward": s.reward,
            "terminated": s.terminated,
            "truncated": s.truncated,
            "agent_step_indices": list(s.agent_step_indices),
            "synthetic": s.synthetic,
            "info": s.info,
        }

    return {
        "id": rollout.id,
        "meta": rollout.meta,
        "terminated": rollout.terminated,
        "truncated": rollout.truncated,
        "total_reward": rollout.total_reward,
        "steps": [step_dict(s) for s in rollout.steps],
    }


def rollout_from_dict(d: Mapping[str, Any]) -> Rollout:
    """Inverse of :func:`rollout_to_dict`. Raises ``ValueError`` naming the bad field."""
    steps: list[Step] = []
    for i, s in enumerate(d.get("steps", [])):
        kind = s.get("kind")
        try:
            if kind == "agent":
                steps.append(
                    AgentStep(
                        index=s["index"],
                        turn_id=s["turn_id"],
                        prompt_messages=list(s["prompt_messages"]),
                        completion=s["completion"],
                        trace=None if s.get("trace") is None else TokenTrace.from_dict(s["trace"]),
                        action=s.get("action"),
                        action_target=s.get("action_target", "env"),
                        reward=float(s.get("reward", 0.0)),
                        parse_error=bool(s.get("parse_error", False)),
                        tool_calls=[ToolCall(**c) for c in s.get("tool_calls", [])],
                        tool_results=list(s.get("tool_results", [])),
                        info=dict(s.get("info", {})),
                    )
                )
            elif kind == "env":
                steps.append(
                    EnvironmentStep(
                        index=s["index"],
                        turn_id=s["turn_id"],
                        prev_obs=s["prev_obs"],
                        action=s["action"],
                        next_obs=s.get("next_obs"),
                        reward=float(s["reward"]),
                        terminated=bool(s.get("terminated", False)),
                        truncated=bool(s.get("truncated", False)),
                        agent_step_indices=tuple(s.get("agent_step_indices", ())),
                        synthetic=bool(s.get("synthetic", False)),
                        info=dict(s.get("info", {})),
                    )
                )
            else:
                raise ValueError(f"kind={kind!r}, expected 'agent' or 'env'")
        except KeyError as e:
            raise ValueError(f"rollout {d.get('id')!r} step {i}: missing field {e}") from None
    return Rollout(
        steps=steps,
        id=d.get("id") or new_id(),
        meta=dict(d.get("meta", {})),
        terminated=bool(d.get("terminated", False)),
        truncated=bool(d.get("truncated", False)),
    )


def as_tuple(xs: Sequence[int] | None) -> tuple[int, ...]:
    return () if xs is None else tuple(xs)


@dataclass
class AgentAct:
    """What one ``Agent.act`` call produced, for the interaction protocol.

    ``steps`` are every model call made during the act, in order (internal tool loops
    included); the protocol assigns their rollout ``index``. ``action_target`` says what
    happens next: ``"env"`` -> ``action`` goes to ``env.step``; ``"external"`` ->
    ``tool_calls`` are for the protocol's external tool handler. ``parse_error`` means the
    final completion did not parse: ``action`` is ``None`` and ``feedback_obs`` holds the
    parser's feedback for a synthetic step.
    """

    steps: list[AgentStep]
    action: str | None
    action_target: ActionTarget = "env"
    parse_error: bool = False
    feedback_obs: Observation | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
