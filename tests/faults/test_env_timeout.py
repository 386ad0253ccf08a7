"""Issue 9, finding 3 ("No orphans, no hangs"): ``RolloutEngine(timeout_s=1)`` with an env
whose step blocks for 5 s ran 40 s with no ``TimeoutError``, because env code ran on the
event loop where the timeout could not fire. With ``env_calls="thread"`` (config
``env.run_in_thread``) env ``reset``/``step`` run in a thread: the timeout fires on time,
names the env kind, seed and limit, and the abandoned call is not overlapped by
``close()``. Inline (the default, deterministic batching), a blocking call still ends in
``TimeoutError`` as soon as it returns. ``ludic train`` sets a default episode timeout."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from ludic.agents import Agent
from ludic.context.full_dialog import FullDialog
from ludic.inference.chat_template import HFChatTemplate
from ludic.inference.scripted_client import ScriptedChatClient
from ludic.interaction import MultiAgentProtocol, SingleAgentProtocol
from ludic.parsers import ParseResult
from ludic.rollouts import EnvSpec, ProtocolSpec, RolloutEngine, RolloutRequest
from ludic.run.loading import load_config
from ludic.types import StepOutcome


class BlockingEnv:
    """Two agents' worth of interface, one agent used; ``step`` blocks in ``time.sleep``
    (not an await) for ``block_s``. Records overlapping calls and when close ran."""

    def __init__(self, block_s: float = 5.0, agents: tuple[str, ...] = ("a",)) -> None:
        self.block_s = block_s
        self.agents = list(agents)
        self.busy = False
        self.overlapped = False
        self.step_returned = threading.Event()
        self.closed_after_step: bool | None = None

    agent_ids = property(lambda self: self.agents)
    active_agents = property(lambda self: self.agents)
    system_prompt = None

    def reset(self, seed: int | None = None) -> dict[str, tuple[str, dict[str, Any]]]:
        return {a: (f"problem {seed}", {}) for a in self.agents}

    def step(self, actions: dict[str, str]) -> dict[str, StepOutcome]:
        self.overlapped |= self.busy
        self.busy = True
        time.sleep(self.block_s)
        self.busy = False
        self.step_returned.set()
        return {a: StepOutcome(obs="done", reward=1.0, terminated=True) for a in actions}

    def close(self) -> None:
        self.overlapped |= self.busy
        self.closed_after_step = self.step_returned.is_set()


def _agent(tok) -> Agent:
    return Agent(
        client=ScriptedChatClient(tok, ["42"] * 4),
        context=FullDialog(),
        parser=lambda text: ParseResult(action=text.strip()),
        chat_template=HFChatTemplate(tok),
    )


def _engine(
    tok, env: BlockingEnv, *, multi: bool = False, env_calls: str = "thread"
) -> RolloutEngine:
    def protocol():
        if multi:
            return MultiAgentProtocol({a: _agent(tok) for a in env.agents})
        return SingleAgentProtocol(_agent(tok))

    return RolloutEngine(
        {"blocking": lambda: env}, {"p": protocol}, timeout_s=1.0, env_calls=env_calls
    )


def _request(seed: int = 7) -> RolloutRequest:
    return RolloutRequest(EnvSpec("blocking"), ProtocolSpec("p"), env_seed=seed, max_steps=1)


@pytest.mark.parametrize("multi", [False, True], ids=["single_agent", "multi_agent"])
def test_blocking_env_step_times_out_on_time_naming_env_seed_and_limit(
    tiny_tokenizer, multi
) -> None:
    # 5 s as the reproduction; the multi-agent case blocks less to keep the suite fast.
    env = BlockingEnv(block_s=2.5 if multi else 5.0, agents=("a", "b") if multi else ("a",))
    engine = _engine(tiny_tokenizer, env, multi=multi)
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"env='blocking'.*env_seed=7.*timeout_s=1\.0"):
        asyncio.run(engine.generate_rollouts([_request()]))
    elapsed = time.monotonic() - started
    assert elapsed < 1.5, f"the timeout fired after {elapsed:.2f}s"
    # The abandoned step finishes in its thread; close() waits for it, never overlaps it.
    assert env.step_returned.wait(timeout=10)
    deadline = time.monotonic() + 5
    while env.closed_after_step is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert env.closed_after_step is True and not env.overlapped


def test_inline_env_calls_still_time_out_once_the_blocking_call_returns(tiny_tokenizer) -> None:
    env = BlockingEnv(block_s=2.0)
    engine = _engine(tiny_tokenizer, env, env_calls="inline")
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"env='blocking'.*env_seed=7.*timeout_s=1\.0"):
        asyncio.run(engine.generate_rollouts([_request()]))
    elapsed = time.monotonic() - started
    assert 2.0 <= elapsed < 3.5, f"the timeout fired after {elapsed:.2f}s"
    assert env.closed_after_step is True and not env.overlapped


def test_an_unknown_env_calls_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="env_calls='process'"):
        RolloutEngine({}, {}, env_calls="process")  # type: ignore[arg-type]


@pytest.mark.parametrize("env_calls", ["inline", "thread"])
def test_fast_env_under_the_timeout_still_completes(tiny_tokenizer, env_calls) -> None:
    env = BlockingEnv(block_s=0.05)
    engine = _engine(tiny_tokenizer, env, env_calls=env_calls)
    (rollout,) = asyncio.run(engine.generate_rollouts([_request(3)]))
    assert rollout.steps[-1].reward == 1.0 and rollout.meta["env_seed"] == 3
    assert env.closed_after_step is True


def test_the_cli_config_sets_a_default_episode_timeout_used_by_the_engine() -> None:
    from ludic.run.builders import make_engine

    config = load_config(None)
    assert config.env.episode_timeout_s == 600.0
    engine = make_engine(config, client=None, template=None)  # type: ignore[arg-type]
    assert engine.timeout_s == 600.0
    assert engine.env_calls == "inline"
    off = load_config(None, ["env.episode_timeout_s=null", "env.run_in_thread=true"])
    engine = make_engine(off, client=None, template=None)  # type: ignore[arg-type]
    assert engine.timeout_s is None and engine.env_calls == "thread"
