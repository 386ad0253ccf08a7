"""Agents and protocols from config, against the session's real vLLM CPU server.

A tiny random model does not write tool calls or board moves by itself, so vLLM's
structured outputs (``sampling.structured_outputs``, a regex) force the format: the
generation, the tool-call parsing, the tool runs and the game are real.

* ``agent.kind: tool``: every call is forced to be a tool call; the first runs (its result
  is in the next prompt), the second exceeds ``max_tool_calls: 1`` and ends the turn as a
  parse failure with ``tool_error_penalty``.
* ``agent.kind: react``: with ``max_react_steps: 1`` the tool call runs, then the final
  answer is forced (``forced_final_answer``).
* ``agent.protocol: multi_agent`` on ``tic_tac_toe_two_player``: the policy plays both X
  and O (moves forced to a digit); every game gives one rollout per player, and GRPO
  groups each player's rollouts apart.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from ludic import jobs
from ludic.inference import HFChatTemplate
from ludic.rollouts.strategies import GRPORequestStrategy
from ludic.run.builders import batch_requests, make_algorithm, make_engine
from ludic.run.loading import load_config

pytestmark = pytest.mark.vllm

DEMO = Path(jobs.__file__).parent / "configs" / "arithmetic_demo.yaml"
TOOLS = '''
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first addend.
        b: the second addend.
    """
    return a + b + 1000  # a value the model cannot have guessed
'''
TOOL_CALL = r'<tool_call>\{"name": "add", "arguments": \{"a": [1-9], "b": [1-9]\}\}</tool_call>'
CALL_TEXT = re.compile(r'"a": (\d), "b": (\d)')


def _config(tmp_path: Path, **sections: dict[str, Any]):
    data = yaml.safe_load(DEMO.read_text())
    data.update(output_dir=str(tmp_path), warm_start={"steps": 0})
    data["inference"] = {"backend": "vllm"}
    data["trainer"].update(prompts_per_step=2)
    data["algorithm"].update(group_size=2)
    for name, values in sections.items():
        data[name] = {**data.get(name, {}), **values}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_config(path)


def _rollouts(config, served) -> list[Any]:
    engine = make_engine(config, served.client, HFChatTemplate(served.tokenizer))
    requests = GRPORequestStrategy(group_size=config.algorithm.group_size).expand(
        batch_requests(config, 0)
    )
    return asyncio.run(engine.generate_rollouts(requests))


def _tool_file(tmp_path: Path) -> str:
    path = tmp_path / "my_tools.py"
    path.write_text(TOOLS)
    return f"{path}:add"


def _check_tool_ran(served, first, first_text: str, second) -> None:
    """The first call's text is a tool call; the second prompt holds add()'s result."""
    a, b = map(int, CALL_TEXT.search(first_text).groups())
    second_prompt = served.tokenizer.decode(second.trace.prompt_token_ids)
    assert str(a + b + 1000) in second_prompt
    assert first.tool_calls and first.tool_calls[0].name == "add"


def _agent_steps(served, rollout) -> list[tuple[Any, str]]:
    """``(step, completion text)`` of every model call, each with real sampled tokens and
    the server's logprobs."""
    steps = []
    for step in rollout.agent_steps:
        trace = step.trace
        assert trace.completion_token_ids
        assert len(trace.completion_logprobs) == len(trace.completion_token_ids)
        text = served.tokenizer.decode(trace.completion_token_ids, skip_special_tokens=True)
        steps.append((step, text))
    return steps


def test_a_tool_agent_from_config_calls_its_tool(tmp_path, served) -> None:
    config = _config(
        tmp_path,
        agent={
            "kind": "tool",
            "tools": [_tool_file(tmp_path)],
            "max_tool_calls": 1,
            "tool_error_penalty": -0.5,
        },
        sampling={"structured_outputs": {"regex": TOOL_CALL}, "max_tokens": 64},
    )
    rollouts = _rollouts(config, served)
    assert len(rollouts) == 4
    for rollout in rollouts:
        (first, text), (second, _) = _agent_steps(served, rollout)
        assert re.fullmatch(TOOL_CALL, text)
        assert first.action_target == "internal" and first.tool_results
        _check_tool_ran(served, first, text, second)
        assert second.parse_error and rollout.total_reward == -0.5  # a second call: too many


def test_a_react_agent_from_config_is_forced_to_answer(tmp_path, served) -> None:
    config = _config(
        tmp_path,
        agent={"kind": "react", "tools": [_tool_file(tmp_path)], "max_react_steps": 1},
        sampling={"structured_outputs": {"regex": TOOL_CALL}, "max_tokens": 64},
    )
    rollouts = _rollouts(config, served)
    for rollout in rollouts:
        (first, text), (second, _) = _agent_steps(served, rollout)
        _check_tool_ran(served, first, text, second)
        assert second.info.get("forced_final_answer") is True
        assert "You must answer now" in served.tokenizer.decode(second.trace.prompt_token_ids)


def test_tic_tac_toe_self_play_from_config(tmp_path, served) -> None:
    config = _config(
        tmp_path,
        env={"kind": "tic_tac_toe_two_player", "kwargs": {}, "eval_kwargs": {}},
        agent={"protocol": "multi_agent", "parser": "identity", "max_steps": 9},
        sampling={"structured_outputs": {"regex": "[1-9]"}, "max_tokens": 2},
        eval={"first_problem": 0, "num_problems": 2},
    )
    rollouts = _rollouts(config, served)
    assert len(rollouts) == 8  # 2 problems x 2 games x 2 players
    games: dict[tuple[str, int], dict[str, Any]] = {}
    for r in rollouts:
        games.setdefault((r.meta["group_id"], r.meta["sampling_seed"]), {})[r.meta["agent_id"]] = r
    assert len(games) == 4 and all(set(g) == {"X", "O"} for g in games.values())
    for game in games.values():
        x, o = game["X"], game["O"]
        moves = len(_agent_steps(served, x)) + len(_agent_steps(served, o))
        assert 1 <= moves <= 9
        assert len(x.agent_steps) - len(o.agent_steps) in (0, 1)  # X moves first
        final = x.env_steps[-1].info.get("result")
        assert final is not None, json.dumps(x.env_steps[-1].info)
    # GRPO: each player's rollouts form their own groups (no group-size error)
    algorithm = make_algorithm(config)
    advantages = algorithm.credit_assigner.compute(rollouts)
    assert len(advantages) == 8
