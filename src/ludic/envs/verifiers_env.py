"""verifiers (v1) tasksets: ``env.kind: verifiers`` with ``agent.program: verifiers``
(docs/envs/verifiers.md).

:class:`VerifiersEnv` deals the taskset's tasks, one per episode; the ``verifiers`` agent
program (:func:`verifiers_program`) runs each through a verifiers ``Agent`` whose client is
ludic's agent endpoint, so every model call is recorded with its exact tokens. The reward
is the task's own score (``trace.reward``), each reward and metric kept as a metric. The
harness is ludic's in-process chat harness (one chat call); tasksets needing tools (MCP) or
a container are refused when the env is built. Needs the ``verifiers`` extra.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import json
import math
import os
import sys
import threading
import types
from collections.abc import Iterator, Mapping
from typing import Any, Literal

from ludic._imports import is_code_spec, load_object
from ludic.envs.single_agent_env import DEFAULT_AGENT_ID, SingleAgentEnv
from ludic.types import AgentId, Info, Observation, StepOutcome

Part = Literal["train", "heldout"]

HARNESS_ID = "ludic_chat_harness"
"""The verifiers harness id of ludic's in-process chat harness (registered on first use)."""

TASK_KEYS = ("verifiers_taskset", "verifiers_config", "verifiers_limit", "verifiers_task")
"""The reset info the ``verifiers`` program reads (all JSON values)."""


def _vf() -> Any:
    try:
        import verifiers.v1 as vf
    except ImportError as e:
        raise ImportError(
            "env.kind verifiers needs verifiers (v1): pip install 'ludic-rl[verifiers]'"
        ) from e
    return vf


class VerifiersEnv(SingleAgentEnv):
    """The tasks of a verifiers (v1) taskset, one per episode.

    Args:
        taskset: the ``vf.Taskset`` subclass, as ``package.module:Class`` or
            ``path/to/file.py:Class``, or the id of an installed verifiers taskset.
        config: the taskset's config (its ``TasksetConfig`` fields).
        size: how many tasks the ``train`` part takes (default: all of a bounded taskset).
        part: ``train`` (the first ``size`` tasks) or ``heldout`` (the ``heldout_size``
            tasks after them: never a trained task).
        heldout_size: the held-out part's size (default: the rest of a bounded taskset).

    ``reset(seed)`` shows task ``seed % len(tasks)`` (``seed=None``: task 0 onwards in
    turn); the observation is its prompt, the info names the task for the program.
    ``step`` refuses: the ``verifiers`` agent program plays the task and its rubric scores
    it.
    """

    def __init__(
        self,
        *,
        taskset: str,
        config: Mapping[str, Any] | None = None,
        size: int | None = None,
        part: Part = "train",
        heldout_size: int | None = None,
        agent_id: AgentId = DEFAULT_AGENT_ID,
    ) -> None:
        super().__init__(agent_id=agent_id)
        if part not in ("train", "heldout"):
            raise ValueError(f"part={part!r}; choose 'train' or 'heldout'")
        self.taskset = taskset
        self.config = dict(config or {})
        settings = json.dumps(self.config, sort_keys=True)
        self.limit = None if size is None or heldout_size is None else size + heldout_size
        tasks = _tasks(taskset, settings, self.limit)
        train = len(tasks) if size is None else size
        if train < 1 or train > len(tasks):
            raise ValueError(f"size={size}; the taskset {taskset!r} has {len(tasks)} tasks")
        rest = len(tasks) - train
        held = rest if heldout_size is None else heldout_size
        if part == "heldout" and not 1 <= held <= rest:
            raise ValueError(
                f"heldout_size={heldout_size}: the taskset {taskset!r} has {rest} tasks after "
                f"the {train} of the train part; lower size or heldout_size"
            )
        self.indices = range(train) if part == "train" else range(train, train + held)
        self.tasks = tasks
        self._index: int | None = None
        self._next = 0

    def env_reset(self, seed: int | None = None) -> tuple[Observation, Info]:
        if seed is None:
            seed, self._next = self._next, self._next + 1
        self._index = self.indices[seed % len(self.indices)]
        data = self.tasks[self._index].data
        info = {
            "verifiers_taskset": self.taskset,
            "verifiers_config": self.config,
            "verifiers_limit": self.limit,
            "verifiers_task": self._index,
        }
        return data.prompt_text, info

    def env_step(self, action: str) -> StepOutcome:
        raise RuntimeError(
            "env.kind verifiers is played by its agent program: set agent.kind: program and "
            "agent.program: verifiers (the taskset's rubric scores the episode)"
        )


@functools.lru_cache(maxsize=8)
def _tasks(taskset: str, settings: str, limit: int | None) -> tuple[Any, ...]:
    """The taskset's first ``limit`` tasks (all: None), checked for what ludic's harness
    can play (cached: a run builds an env per episode)."""
    vf = _vf()
    if is_code_spec(taskset):
        cls = load_object(taskset, field="env.kwargs.taskset")
    else:
        from verifiers.v1.utils.loaders import taskset_class

        cls = taskset_class(taskset)
    if not (isinstance(cls, type) and issubclass(cls, vf.Taskset)):
        raise ValueError(f"taskset={taskset!r} is {cls!r}, not a verifiers.v1 Taskset subclass")
    from verifiers.v1.utils.generic import concrete_type

    config_type = concrete_type(cls, vf.TasksetConfig, origin=vf.Taskset) or vf.TasksetConfig
    config = config_type(**json.loads(settings))
    instance = cls(config)
    if limit is None and not instance.bounded:
        raise ValueError(
            f"taskset={taskset!r} is unbounded; set size and heldout_size to take a finite part"
        )
    tasks = tuple(itertools.islice(instance, limit))
    if not tasks:
        raise ValueError(f"taskset={taskset!r} has no tasks")
    _check_playable(taskset, cls.toolsets(config), tasks)
    return tasks


def _check_playable(taskset: str, shared_tools: list[Any], tasks: tuple[Any, ...]) -> None:
    """ludic's harness makes chat calls in this process: no tools, no container."""
    if shared_tools:
        raise ValueError(
            f"taskset={taskset!r} serves tools to its tasks ({len(shared_tools)} tool "
            "server(s)); ludic's verifiers harness runs tasks without tools"
        )
    first_of_type = {}
    for task in tasks:
        first_of_type.setdefault(type(task), task)
    for task_type, task in first_of_type.items():
        if task_type.NEEDS_CONTAINER:
            raise ValueError(
                f"taskset={taskset!r}: {task_type.__name__} needs a container; ludic's "
                "verifiers harness runs tasks in this process"
            )
        if task_type.toolsets(task.config):
            raise ValueError(
                f"taskset={taskset!r}: {task_type.__name__} has tools (MCP servers); ludic's "
                "verifiers harness runs tasks without tools"
            )


async def verifiers_program(client: Any, task: dict[str, Any]) -> dict[str, Any]:
    """The ``verifiers`` agent program: play one task of a :class:`VerifiersEnv` with a
    verifiers ``Agent`` whose client is ``client``'s endpoint; the reward is the task's
    score (``trace.reward``), its rewards and metrics the episode's metrics. A trace that
    is not ``ok`` (a harness that failed, a reward that raised, a timeout) raises: loud,
    never a zero."""
    missing = [key for key in TASK_KEYS if key not in task]
    if missing:
        raise ValueError(
            f"agent.program verifiers plays env.kind verifiers; this env's task lacks {missing}"
        )
    vf = _vf()
    from verifiers.v1.runtimes import SubprocessConfig

    _register_harness()
    settings = json.dumps(task["verifiers_config"], sort_keys=True)
    tasks = _tasks(task["verifiers_taskset"], settings, task["verifiers_limit"])
    vf_task = tasks[task["verifiers_task"]]
    with _exported_key(str(client.api_key)) as key_var:
        config = vf.AgentConfig(
            model="ludic-policy",
            harness={"id": HARNESS_ID},
            runtime=SubprocessConfig(),
            client=vf.EvalClientConfig(
                base_url=str(client.base_url).rstrip("/"), api_key_var=key_var
            ),
        )
        async with vf.make_agent(config) as agent:
            trace = await agent.run(vf_task)
    if trace.errors or not trace.ok or trace.is_timeout:
        why = "; ".join(str(getattr(e, "message", e)) for e in trace.errors)
        raise RuntimeError(
            f"verifiers task {task['verifiers_task']} of {task['verifiers_taskset']!r}: "
            + (why or f"the trace is not ok (stop: {trace.stop_condition!r})")
        )
    metrics = {
        f"reward/{name}": float(reward.score)
        for name, reward in trace.rewards.items()
        if reward is not None
    }
    for name, value in (trace.metrics or {}).items():
        number = getattr(value, "score", getattr(value, "value", value))
        if isinstance(number, int | float) and math.isfinite(number):
            metrics[f"metric/{name}"] = float(number)
    return {"reward": float(trace.reward or 0.0), "metrics": metrics}


_key_lock = threading.Lock()
_key_users: dict[str, int] = {}


@contextlib.contextmanager
def _exported_key(api_key: str) -> Iterator[str]:
    """verifiers reads a client's key from an environment variable: the endpoint's key,
    under a name of its own, set while an episode of that endpoint runs and removed after
    the last (the name holds ``API_KEY``: verifiers' subprocess runtime keeps such
    variables from the programs it starts)."""
    name = "LUDIC_AGENT_ENDPOINT_API_KEY_" + hashlib.sha1(api_key.encode()).hexdigest()[:12]
    with _key_lock:
        _key_users[name] = _key_users.get(name, 0) + 1
        os.environ[name] = api_key
    try:
        yield name
    finally:
        with _key_lock:
            _key_users[name] -= 1
            if not _key_users[name]:
                del _key_users[name]
                os.environ.pop(name, None)


@functools.cache
def _register_harness() -> None:
    """Make ludic's chat harness importable under :data:`HARNESS_ID` (verifiers loads a
    harness by module name)."""
    from verifiers.v1.configs.harness import HarnessConfig
    from verifiers.v1.harness import Harness
    from verifiers.v1.runtimes import ProgramResult

    class LudicChatHarnessConfig(HarnessConfig):
        """No settings: ludic's sampling is the run's ``sampling`` section."""

    class LudicChatHarness(Harness[LudicChatHarnessConfig]):
        """One chat call on the task's system prompt and prompt, in process (no
        subprocess, no ``uv``): the call goes through verifiers' interception to ludic's
        endpoint; the reply is what the task scores."""

        APPENDS_SYSTEM_PROMPT = True
        SUPPORTS_RESUME = True
        NEEDS_CONTAINER = False
        EXECUTES_CODE = False

        async def setup(self, runtime: Any) -> None:
            return None

        async def launch(
            self,
            ctx: Any,
            trace: Any,
            runtime: Any,
            endpoint: str,
            secret: str,
            mcp_urls: dict[str, str],
            data: Any,
            **_: Any,
        ) -> Any:
            from openai import AsyncOpenAI

            system_prompt, prompt = self.resolve_prompt(data)
            messages: list[dict[str, Any]] = []
            if system_prompt:
                messages.append({"role": "system", "content": system_prompt})
            if isinstance(prompt, str):
                messages.append({"role": "user", "content": prompt})
            else:
                messages += [m if isinstance(m, dict) else m.model_dump() for m in prompt or ()]
            client = AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0)
            try:
                reply = await client.chat.completions.create(model=ctx.model, messages=messages)
            finally:
                await client.close()
            text = reply.choices[0].message.content or ""
            return ProgramResult(exit_code=0, stdout=text, stderr="")

    module = types.ModuleType(HARNESS_ID, LudicChatHarness.__doc__)
    module.LudicChatHarness = LudicChatHarness  # type: ignore[attr-defined]
    module.LudicChatHarnessConfig = LudicChatHarnessConfig  # type: ignore[attr-defined]
    module.__all__ = ["LudicChatHarness"]  # type: ignore[attr-defined]
    sys.modules.setdefault(HARNESS_ID, module)
