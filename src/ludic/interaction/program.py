"""The program loop: an OpenAI-API agent program plays one episode (docs/envs/programs.md).

``async def program(client: openai.AsyncOpenAI, task: dict)`` is any code.
:class:`ProgramProtocol` resets the env, opens an episode of an ``AgentEndpoint`` and awaits
the program with a client pointed at it; the episode becomes one rollout with one trainable
step per call (its own turn, exact tokens), the reward on the last. ``task``: ``{"prompt",
"seed", **the reset info}`` less a QA env's ``target``; the result: a reward, an answer for
``env.step`` to score, or ``{reward | answer, metrics}``. A raising program fails the run;
past ``max_steps`` calls the endpoint answers HTTP 429 and the episode ends truncated.
"""

from __future__ import annotations

import inspect
import json
import math
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from ludic.inference.agent_endpoint import AgentEndpoint, RecordedCall
from ludic.interaction.base import Episode, EpisodeProtocol
from ludic.interaction.env_calls import reset_env, step_env
from ludic.interaction.info import PROTOCOL_META_KEYS, merge_step_info
from ludic.types import AgentStep, EnvironmentStep, Rollout, new_id

Program = Callable[[Any, dict[str, Any]], Awaitable[Any]]
"""``async def program(client, task) -> number | str | mapping``."""


def check_program(program: Any) -> str | None:
    """Why ``program`` cannot be an agent program, or None."""
    if not inspect.iscoroutinefunction(program):
        return "it is not an async function (async def program(client, task))"
    try:
        inspect.signature(program).bind("client", {})
    except TypeError:
        return f"{program.__name__}{inspect.signature(program)} cannot take (client, task)"
    return None


class ProgramProtocol(EpisodeProtocol):
    """Runs ``program`` for one episode of a single-agent env (see the module docstring).

    Args:
        program: the agent program.
        endpoint: the endpoint its client calls (started on first use).
        agent_id: the env agent id; default: the env's only one.
        timeout_s: the client's per-call timeout.
    """

    def __init__(
        self,
        program: Program,
        endpoint: AgentEndpoint,
        *,
        agent_id: str | None = None,
        timeout_s: float = 600.0,
    ) -> None:
        problem = check_program(program)
        if problem:
            raise TypeError(f"ProgramProtocol: {problem}")
        self.program = program
        self.endpoint = endpoint
        self.agent_id = agent_id
        self.timeout_s = timeout_s

    async def _play(self, episode: Episode) -> list[Rollout]:
        env, env_seed = episode.env, episode.env_seed
        agent_id = self.agent_id or _only_agent(env)
        obs, info = (await reset_env(env, env_seed))[agent_id]
        task = {"prompt": obs, "seed": env_seed, **_json_values(info)}
        task.pop("target", None)  # the env keeps the answer: the program returns one
        base_url = self.endpoint.open_episode(episode.inference, max_calls=episode.max_steps)
        client: Any = None
        error: BaseException | None = None
        try:
            client = self.endpoint.openai_client(base_url, timeout_s=self.timeout_s)
            result = await self.program(client, task)
        except Exception as e:  # judged below, once the calls are known
            result, error = None, e
        finally:
            calls, refused = self.endpoint.close_episode(base_url)
            if client is not None:
                await client.close()
        truncated = refused > 0
        if error is not None and not truncated:
            raise RuntimeError(
                f"the agent program {getattr(self.program, '__name__', self.program)!r} "
                f"raised in episode seed={env_seed}: {type(error).__name__}: {error}"
            ) from error
        rollout = Rollout(
            meta=merge_step_info(
                episode.meta,
                {
                    "agent_id": agent_id,
                    "env_seed": env_seed,
                    "initial_obs": obs,
                    "truncation_reason": "max_steps" if truncated else None,
                    "program_calls": len(calls),
                },
                reserved=PROTOCOL_META_KEYS,
            )
        )
        turn_ids = [new_id() for _ in calls] or [new_id()]
        for call, turn_id in zip(calls, turn_ids):
            rollout.steps.append(_agent_step(len(rollout.steps), turn_id, call))
        env_step = await self._final_step(env, agent_id, obs, result, truncated, turn_ids[-1])
        env_step.index = len(rollout.steps)
        if calls:
            env_step.agent_step_indices = (len(rollout.steps) - 1,)
        rollout.steps.append(env_step)
        rollout.terminated, rollout.truncated = env_step.terminated, env_step.truncated
        return [rollout]

    async def _final_step(
        self, env: Any, agent_id: str, obs: str, result: Any, truncated: bool, turn_id: str
    ) -> EnvironmentStep:
        """The episode's end: the program's reward, or the env's for its answer."""
        reward, answer, metrics = _result(result, truncated)
        step = EnvironmentStep(
            index=0,
            turn_id=turn_id,
            prev_obs=obs,
            action="" if answer is None else answer,
            next_obs=None,
            reward=0.0 if reward is None else reward,
            terminated=not truncated,
            truncated=truncated,
            info=dict(metrics),
        )
        if answer is not None:
            outcome = (await step_env(env, {agent_id: answer}))[agent_id]
            step.reward, step.next_obs = outcome.reward, outcome.obs
            step.info = {**outcome.info, **metrics}
            step.terminated = not truncated
        return step


def _agent_step(index: int, turn_id: str, call: RecordedCall) -> AgentStep:
    return AgentStep(
        index=index,
        turn_id=turn_id,
        prompt_messages=call.messages,
        completion=call.text,
        trace=call.trace,
        action=call.text,
        tool_calls=list(call.tool_calls),
        info={
            "route": call.route,
            "call": call.index,
            **({"requested": call.requested} if call.requested else {}),
        },
    )


def _result(result: Any, truncated: bool) -> tuple[float | None, str | None, dict[str, float]]:
    """(reward, answer, metrics) of a program's result (see the module docstring)."""
    if result is None and truncated:
        return None, None, {}
    metrics: dict[str, float] = {}
    if isinstance(result, Mapping):
        metrics = {str(k): float(v) for k, v in dict(result.get("metrics") or {}).items()}
        if "answer" in result:
            result = result["answer"]
        elif "reward" in result:
            result = result["reward"]
        else:
            raise ValueError(
                f"the agent program returned a mapping without 'reward' or 'answer': {result!r}"
            )
    if isinstance(result, str):
        return None, result, metrics
    if isinstance(result, int | float) and not isinstance(result, bool) and math.isfinite(result):
        return float(result), None, metrics
    raise ValueError(
        f"the agent program returned {result!r}; return a reward (a finite number), an answer "
        "(a string) or {'reward' | 'answer': ..., 'metrics': {...}}"
    )


def _only_agent(env: Any) -> str:
    ids = list(env.agent_ids)
    if len(ids) != 1:
        raise ValueError(
            f"ProgramProtocol: {type(env).__name__} has agents {ids}; an agent program plays "
            "a single-agent env (or pass agent_id=)"
        )
    return ids[0]


def _json_values(info: Mapping[str, Any]) -> dict[str, Any]:
    """The reset info's entries that are JSON values (the program's task is data)."""
    out = {}
    for key, value in info.items():
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            continue
        out[key] = value
    return out
