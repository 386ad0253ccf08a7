"""SingleAgentEnv: dict adaptation, agent-id checks, episode end and env time limits."""

from __future__ import annotations

import pytest

from ludic.envs import SingleAgentEnv
from ludic.types import Info, Observation, StepOutcome


class CountdownEnv(SingleAgentEnv):
    """Terminates after ``length`` steps; reward = the step number."""

    def __init__(self, length: int = 3, **kwargs) -> None:
        super().__init__(**kwargs)
        self.length = length
        self.t = 0
        self.actions: list[str] = []

    def env_reset(self, seed: int | None = None) -> tuple[Observation, Info]:
        self.t = 0
        return f"start {seed}", {"seed": seed}

    def env_step(self, action: str) -> StepOutcome:
        self.t += 1
        self.actions.append(action)
        return StepOutcome(
            obs=f"t={self.t}", reward=float(self.t), terminated=self.t >= self.length, info={"k": 1}
        )


def test_reset_and_step_use_the_kernel_dict_form() -> None:
    env = CountdownEnv()
    assert env.agent_ids == ["agent_0"]
    assert env.reset(seed=7) == {"agent_0": ("start 7", {"seed": 7})}
    out = env.step({"agent_0": "go"})
    assert out == {"agent_0": StepOutcome(obs="t=1", reward=1.0, info={"k": 1})}
    assert env.actions == ["go"]


def test_agent_id_is_configurable() -> None:
    env = CountdownEnv(agent_id="player")
    assert env.agent_ids == env.active_agents == ["player"]
    assert set(env.reset()) == {"player"}
    assert set(env.step({"player": "a"})) == {"player"}


def test_step_with_wrong_agent_id_names_both_ids() -> None:
    env = CountdownEnv()
    env.reset()
    with pytest.raises(ValueError, match=r"\['bob'\].*'agent_0'"):
        env.step({"bob": "a"})


def test_step_with_extra_agent_id_raises() -> None:
    env = CountdownEnv()
    env.reset()
    with pytest.raises(ValueError, match=r"\['agent_0', 'extra'\]"):
        env.step({"agent_0": "a", "extra": "b"})


def test_step_with_no_actions_raises() -> None:
    env = CountdownEnv()
    env.reset()
    with pytest.raises(ValueError, match=r"got actions for \[\]"):
        env.step({})


def test_step_before_reset_raises() -> None:
    with pytest.raises(RuntimeError, match="before reset"):
        CountdownEnv().step({"agent_0": "a"})


def test_step_after_termination_raises_until_reset() -> None:
    env = CountdownEnv(length=1)
    env.reset()
    assert env.step({"agent_0": "a"})["agent_0"].terminated
    assert env.done and env.active_agents == []
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step({"agent_0": "b"})
    env.reset()
    assert env.active_agents == ["agent_0"] and env.num_steps == 0
    env.step({"agent_0": "c"})


def test_max_episode_steps_truncates_on_the_limit_step() -> None:
    env = CountdownEnv(length=10, max_episode_steps=2)
    env.reset()
    first = env.step({"agent_0": "a"})["agent_0"]
    assert not first.truncated and "truncation" not in first.info
    second = env.step({"agent_0": "b"})["agent_0"]
    assert second.truncated and not second.terminated
    assert second.info == {"k": 1, "truncation": "max_episode_steps"}
    assert second.reward == 2.0
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step({"agent_0": "c"})


def test_termination_on_the_limit_step_is_not_reported_as_truncation() -> None:
    env = CountdownEnv(length=2, max_episode_steps=2)
    env.reset()
    env.step({"agent_0": "a"})
    last = env.step({"agent_0": "b"})["agent_0"]
    assert last.terminated and not last.truncated
    assert "truncation" not in last.info


def test_reset_restarts_the_step_count_for_the_time_limit() -> None:
    env = CountdownEnv(length=10, max_episode_steps=2)
    env.reset()
    env.step({"agent_0": "a"})
    env.reset()
    assert not env.step({"agent_0": "b"})["agent_0"].truncated


def test_rejects_non_positive_max_episode_steps() -> None:
    with pytest.raises(ValueError, match="max_episode_steps=0"):
        CountdownEnv(max_episode_steps=0)


def test_system_prompt_is_set_on_the_instance() -> None:
    assert CountdownEnv(system_prompt="be brief").system_prompt == "be brief"
    assert CountdownEnv().system_prompt is None
