"""Issue 9, finding 5 ("Errors that name the problem, early"), the parts users write:
a ``None`` or non-numeric reward and ``None`` from a parser or an env ended ``ludic train``
with a bare ``TypeError`` (exit 1), and a bad answer in a ``dataset_qa`` JSONL surfaced
mid-run without its line number. Each now exits 2 with one ``error:`` line naming the env
or parser and the value (``ludic.types.ContractError``), and the dataset is checked, line
by line, before the run starts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ludic.cli import main
from ludic.envs.single_agent_env import SingleAgentEnv
from ludic.parsers import ParseResult
from ludic.run.registries import ENVS, PARSERS
from ludic.types import StepOutcome

HERE = "tests.faults.test_contract_errors"
BASE = """\
name: contract
output_dir: {runs}
env: {{kind: {env}}}
agent: {{parser: {parser}}}
sampling: {{max_tokens: 2}}
warm_start: {{steps: 0}}
algorithm: {{group_size: 2}}
trainer: {{steps: 1, prompts_per_step: 1}}
eval: {{num_problems: 1}}
"""


class ScriptedRewardEnv(SingleAgentEnv):
    """One step; ``step`` does what ``mode`` says (``None``/text rewards, a ``None`` result)."""

    mode = "ok"

    def env_reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        return "2+2=", {}

    def env_step(self, action: str) -> StepOutcome:
        if self.mode == "none_reward":
            return StepOutcome(obs="done", reward=None, terminated=True)  # type: ignore[arg-type]
        if self.mode == "text_reward":
            return StepOutcome(obs="done", reward="1.0", terminated=True)  # type: ignore[arg-type]
        if self.mode == "none_result":
            return None  # type: ignore[return-value]
        return StepOutcome(obs="done", reward=1.0, terminated=True)


class NoneRewardEnv(ScriptedRewardEnv):
    mode = "none_reward"


class TextRewardEnv(ScriptedRewardEnv):
    mode = "text_reward"


class NoneResultEnv(ScriptedRewardEnv):
    mode = "none_result"


def none_parser(text: str) -> ParseResult:
    return None  # type: ignore[return-value]


def none_reward_parser(text: str) -> ParseResult:
    return ParseResult(action=text, reward=None)  # type: ignore[arg-type]


@pytest.fixture(autouse=True)
def _registered(monkeypatch):
    for name in ("NoneRewardEnv", "TextRewardEnv", "NoneResultEnv", "ScriptedRewardEnv"):
        monkeypatch.setitem(ENVS, name, f"{HERE}:{name}")
    for name in ("none_parser", "none_reward_parser"):
        monkeypatch.setitem(PARSERS, name, f"{HERE}:{name}")


def _train(tmp_path: Path, env: str, parser: str = "identity", *overrides: str) -> int:
    config = tmp_path / "run.yaml"
    config.write_text(BASE.format(runs=tmp_path / "runs", env=env, parser=parser))
    return main(["train", str(config), *overrides])


def _error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if line.startswith("error")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize(
    ("env", "parser", "names"),
    [
        ("NoneRewardEnv", "identity", ["NoneRewardEnv.step()", "StepOutcome.reward=None"]),
        ("TextRewardEnv", "identity", ["TextRewardEnv.step()", "StepOutcome.reward='1.0'"]),
        ("NoneResultEnv", "identity", ["NoneResultEnv.step(", "returned None", "StepOutcome"]),
        ("ScriptedRewardEnv", "none_parser", ["parser none_parser returned None", "ParseResult"]),
        ("ScriptedRewardEnv", "none_reward_parser", ["ParseResult.reward=None"]),
    ],
)
def test_broken_env_or_parser_exits_2_naming_it_and_the_value(
    tmp_path, capsys, env, parser, names
) -> None:
    assert _train(tmp_path, env, parser) == 2
    line = _error_line(capsys)
    for name in names:
        assert name in line, line


def test_a_working_scripted_env_trains(tmp_path, capsys) -> None:
    assert _train(tmp_path, "ScriptedRewardEnv") == 0


def test_bad_dataset_answer_names_file_and_line_before_the_run(tmp_path, capsys) -> None:
    data = tmp_path / "qa.jsonl"
    data.write_text(
        '{"question": "1+1=", "answer": "2"}\n'
        '{"question": "2+2=", "answer": "4"}\n'
        '{"question": "3+3=", "answer": "six"}\n'
    )
    argv = ["env.kind=dataset_qa", f"env.kwargs.path={data}"]
    assert _train(tmp_path, "arithmetic", "identity", *argv) == 2
    line = _error_line(capsys)
    assert f"{data}:3" in line and "'six'" in line and "verifier" in line
    assert not (tmp_path / "runs").exists()


def test_dataset_line_without_the_answer_key_names_the_line(tmp_path, capsys) -> None:
    data = tmp_path / "qa.jsonl"
    data.write_text('{"question": "1+1=", "answer": "2"}\n{"question": "2+2="}\n')
    assert _train(tmp_path, "dataset_qa", "identity", f"env.kwargs.path={data}") == 2
    line = _error_line(capsys)
    assert f"{data}:2" in line and "'answer'" in line
