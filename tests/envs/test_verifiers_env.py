"""verifiers (v1) tasksets: ``ludic train`` with docs/envs/verifiers.md's config and
taskset on the in-process backend, every call through a verifiers ``Agent`` (its
interception server) to ludic's agent endpoint; the reward is the taskset's own."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("verifiers.v1", reason="verifiers (v1) is not installed")

from tests.envs.pages import write_page_files  # noqa: E402
from tests.tiny_run import TINY_RUN  # noqa: E402

from ludic import jobs  # noqa: E402
from ludic.envs.verifiers_env import VerifiersEnv  # noqa: E402
from ludic.run.errors import RunError  # noqa: E402
from ludic.run.loading import load_config  # noqa: E402
from ludic.run.preflight import check_config  # noqa: E402

# The reply's length as the reward (the tiny untrained model never sums right), and a
# metric: both must reach the episode as the taskset computed them.
LENGTH_TASKS = """
import verifiers.v1 as vf


class Data(vf.TaskData):
    answer: str


class LengthTask(vf.Task[Data]):
    @vf.reward
    async def length(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply))

    @vf.metric
    async def starts_right(self, trace: vf.Trace) -> float:
        return float(trace.last_reply.startswith(self.data.answer))


class LengthTaskset(vf.Taskset[LengthTask, vf.TasksetConfig]):
    def load(self):
        return [LengthTask(Data(prompt=f"{i}+1=", answer=str(i + 1))) for i in range(6)]


class Broken(vf.Task[Data]):
    @vf.reward
    async def broken(self, trace: vf.Trace) -> float:
        raise KeyError("no such field")


class BrokenTaskset(vf.Taskset[Broken, vf.TasksetConfig]):
    def load(self):
        return [Broken(Data(prompt="1+1=", answer="2"))]


class WithTools(LengthTask):
    @classmethod
    def toolsets(cls, config):
        return [object()]  # a tool server (its kind does not matter to the check)


class ToolTaskset(vf.Taskset[WithTools, vf.TasksetConfig]):
    def load(self):
        return [WithTools(Data(prompt="1+1=", answer="2"))]


class Boxed(LengthTask):
    NEEDS_CONTAINER = True


class BoxedTaskset(vf.Taskset[Boxed, vf.TasksetConfig]):
    def load(self):
        return [Boxed(Data(prompt="1+1=", answer="2"))]


class Endless(vf.Taskset[LengthTask, vf.TasksetConfig]):
    INFINITE = True

    def load(self):
        i = 0
        while True:
            yield LengthTask(Data(prompt=f"{i}+1=", answer=str(i + 1)))
            i += 1
"""


def end_answer(rollout: dict) -> str:
    """The answer of the rollout's task (its prompt is ``i+1=``)."""
    return str(int(rollout["meta"]["initial_obs"].split("+")[0]) + 1)


def _records(run_dir: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (run_dir / name).read_text().splitlines()]


def test_the_verifiers_page_trains_on_the_tasksets_reward(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    config = write_page_files("verifiers.md", tmp_path)
    (tmp_path / "length_tasks.py").write_text(LENGTH_TASKS)
    run_dir = jobs.train(
        load_config(
            config,
            [
                f"output_dir={tmp_path}",
                *TINY_RUN,
                "env.kwargs.taskset=length_tasks.py:LengthTaskset",
                "env.kwargs.size=4",
                "env.eval_kwargs={part: heldout}",
                "trainer.mode=async",
            ],
        )
    )
    rl = [r for r in _records(run_dir, "metrics.jsonl") if r["phase"] == "rl"]
    assert [r["step"] for r in rl] == [1, 2]
    samples = _records(run_dir, "samples.jsonl")
    assert len(samples) == 8
    for rollout in samples:
        (call,) = [s for s in rollout["steps"] if s["kind"] == "agent"]
        (end,) = [s for s in rollout["steps"] if s["kind"] == "env"]
        assert call["trace"]["completion_token_ids"] and call["info"]["route"] == "chat/completions"
        # the taskset scored the reply the endpoint sampled and recorded (verifiers strips it)
        reply = call["completion"].strip()
        assert rollout["total_reward"] == end["reward"] == len(reply)
        assert end["info"]["reward/length"] == len(reply)
        assert end["info"]["metric/starts_right"] == float(reply.startswith(end_answer(rollout)))
        assert rollout["meta"]["initial_obs"] in {f"{i}+1=" for i in range(4)}  # train part
    assert len({r["total_reward"] for r in samples}) > 1  # a signal GRPO can use
    # the endpoint's key was in the environment only while episodes ran
    assert not [name for name in os.environ if name.startswith("LUDIC_AGENT_ENDPOINT_API_KEY")]


def test_parts_and_errors(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    config = write_page_files("verifiers.md", tmp_path)
    (tmp_path / "length_tasks.py").write_text(LENGTH_TASKS)
    train = VerifiersEnv(taskset="my_tasks.py:SumTaskset", size=80)
    heldout = VerifiersEnv(taskset="my_tasks.py:SumTaskset", size=80, part="heldout")
    shown = {train.reset(seed=s)["agent_0"][0] for s in range(80)}
    held = {heldout.reset(seed=s)["agent_0"][0] for s in range(20)}
    assert len(shown) == 80 and len(held) == 20 and not shown & held
    with pytest.raises(ValueError, match="size=101; the taskset"):
        VerifiersEnv(taskset="my_tasks.py:SumTaskset", size=101)
    with pytest.raises(ValueError, match="heldout_size=None.*0 tasks after"):
        VerifiersEnv(taskset="my_tasks.py:SumTaskset", part="heldout")
    with pytest.raises(ValueError, match="not a verifiers.v1 Taskset"):
        VerifiersEnv(taskset="my_tasks.py:SumData")
    with pytest.raises(RuntimeError, match="played by its agent program"):
        train.step({"agent_0": "3"})
    # what ludic's in-process harness cannot play is refused when the env is built
    with pytest.raises(ValueError, match="WithTools has tools"):
        VerifiersEnv(taskset="length_tasks.py:ToolTaskset")
    with pytest.raises(ValueError, match="Boxed needs a container"):
        VerifiersEnv(taskset="length_tasks.py:BoxedTaskset")
    with pytest.raises(ValueError, match="unbounded; set size and heldout_size"):
        VerifiersEnv(taskset="length_tasks.py:Endless", size=3)
    endless = VerifiersEnv(taskset="length_tasks.py:Endless", size=3, heldout_size=2)
    assert endless.reset(seed=4)["agent_0"][0] == "1+1="  # the train part: tasks 0-2
    # an installed taskset (a package exporting its Taskset in __all__) by its id
    package = tmp_path / "site" / "sum_taskset"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(
        "from my_tasks import SumData, SumTask, SumTaskset\n__all__ = ['SumTaskset']\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.syspath_prepend(str(tmp_path))
    installed = VerifiersEnv(taskset="sum_taskset", size=3)
    assert installed.reset(seed=2)["agent_0"][0] == "0+2="

    base = [f"output_dir={tmp_path}", *TINY_RUN]
    with pytest.raises(RunError, match="agent.program: verifiers"):
        check_config(load_config(config, [*base, "agent.kind=plain", "agent.program=null"]))
    with pytest.raises(RunError, match="plays env.kind verifiers, not 'arithmetic'"):
        check_config(load_config(config, [*base, "env={kind: arithmetic}"]))
    # a reward that raises fails the run, naming the task: never a silent zero
    broken = load_config(
        config, [*base, "env.kwargs.taskset=length_tasks.py:BrokenTaskset", "eval.every=0"]
    )
    with pytest.raises(RuntimeError, match="verifiers task 0 .*KeyError: 'no such field'"):
        jobs.train(broken)
