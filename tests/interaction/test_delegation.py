"""Delegation: an external tool call runs a sub-agent episode; both rollouts come back."""

from __future__ import annotations

import pytest
from tests.interaction.fakes import (
    LineEnv,
    Reply,
    ScriptedAgent,
    answer,
    call_tool,
    garbled,
    run,
    trace_for,
)

from ludic.interaction import SingleAgentProtocol, TaskEnv, make_delegation_handler
from ludic.types import ToolCall


def score_if_42(task: str, action: str) -> float:
    return 1.0 if action == "42" else 0.0


def delegate_handler(sub_scripts: list[list[Reply]], **kw):
    """A handler whose sub-agents play ``sub_scripts`` in order, one per call."""
    subs = [ScriptedAgent(s) for s in sub_scripts]
    made: list[ScriptedAgent] = []

    def factory() -> ScriptedAgent:
        made.append(subs[len(made)])
        return made[-1]

    kw.setdefault("env_factory", lambda args: TaskEnv(args["task"], scorer=score_if_42))
    kw.setdefault("max_steps", 3)
    handler = make_delegation_handler(tool_name="delegate", sub_agent_factory=factory, **kw)
    return handler, made


def test_delegation_returns_parent_and_sub_rollouts_linked_together() -> None:
    handler, subs = delegate_handler([[answer("42")]])
    parent_agent = ScriptedAgent([call_tool("delegate", "call-1", task="6*7?"), answer("stop")])
    protocol = SingleAgentProtocol(parent_agent, external_tool_handler=handler)
    parent, sub = run(protocol.run(env=LineEnv(), max_steps=5, meta={"group_id": "g"}))
    assert parent.meta["group_id"] == "g" and "group_id" not in sub.meta
    assert sub.meta["delegated"] is True and sub.meta["role"] == "sub_agent"
    assert sub.meta["tool_call_id"] == "call-1" and sub.meta["tool_name"] == "delegate"
    assert sub.meta["tool_arguments"] == {"task": "6*7?"}
    assert sub.meta["parent_rollout_id"] == parent.id
    assert sub.meta["parent_turn_id"] == parent.turns()[0].turn_id
    assert subs[0].events[0] == ("reset", "6*7?", None)  # the sub-env's obs is the task


def test_parent_sees_the_sub_agents_final_action_as_the_tool_result() -> None:
    handler, _ = delegate_handler([[answer("42")]])
    parent_agent = ScriptedAgent([call_tool("delegate", "c", task="6*7?"), answer("stop")])
    run(
        SingleAgentProtocol(parent_agent, external_tool_handler=handler).run(
            env=LineEnv(), max_steps=5
        )
    )
    [(_, msgs)] = [e for e in parent_agent.events if e[0] == "tool_results"]
    assert msgs == [{"role": "tool", "tool_call_id": "c", "name": "delegate", "content": "42"}]


def test_sub_rollout_keeps_its_training_data_intact() -> None:
    handler, _ = delegate_handler([[garbled("hmm", reward=-0.5), answer("42", internal_calls=1)]])
    parent_agent = ScriptedAgent([call_tool("delegate", "c", task="6*7?"), answer("stop")])
    _, sub = run(
        SingleAgentProtocol(parent_agent, external_tool_handler=handler).run(
            env=LineEnv(), max_steps=5
        )
    )
    assert sub.terminated and not sub.truncated
    assert [s.index for s in sub.steps] == list(range(len(sub.steps)))
    assert [s.kind for s in sub.steps] == ["agent", "env", "agent", "agent", "env"]
    for step in sub.agent_steps:
        assert step.trace == trace_for(step.completion)  # exact tokens and logprobs kept
    turns = sub.turns()
    assert [t.reward for t in turns] == [-0.5, 1.0]  # parser penalty, then scorer reward
    assert turns[1].env_step is not None and turns[1].env_step.agent_step_indices == (2, 3)


def test_two_delegations_in_one_act_give_two_sub_rollouts() -> None:
    handler, subs = delegate_handler([[answer("42")], [answer("7")]])
    calls = [ToolCall("c1", "delegate", {"task": "a"}), ToolCall("c2", "delegate", {"task": "b"})]
    parent_agent = ScriptedAgent([Reply("<two>", external=calls), answer("stop")])
    parent, *subs_out = run(
        SingleAgentProtocol(parent_agent, external_tool_handler=handler).run(
            env=LineEnv(), max_steps=5
        )
    )
    assert [r.meta["tool_call_id"] for r in subs_out] == ["c1", "c2"]
    assert [r.total_reward for r in subs_out] == [1.0, 0.0]
    assert all(r.meta["parent_rollout_id"] == parent.id for r in subs_out)


def test_nested_delegation_links_each_rollout_to_its_direct_parent() -> None:
    inner, _ = delegate_handler([[answer("42")]])
    middle, _ = delegate_handler(
        [[call_tool("delegate", "c-inner", task="deep"), answer("done")]],
        external_tool_handler=inner,
    )
    parent_agent = ScriptedAgent([call_tool("delegate", "c-mid", task="top"), answer("stop")])
    parent, mid, leaf = run(
        SingleAgentProtocol(parent_agent, external_tool_handler=middle).run(
            env=LineEnv(), max_steps=5
        )
    )
    assert mid.meta["parent_rollout_id"] == parent.id
    assert leaf.meta["parent_rollout_id"] == mid.id


def test_sub_agent_without_a_valid_answer_reports_it() -> None:
    handler, _ = delegate_handler([[garbled(), garbled()]], max_steps=2)
    result = run(handler(ToolCall("c", "delegate", {"task": "t"})))
    assert "no valid answer" in result.content and "max_steps" in result.content
    [sub] = result.rollouts
    assert sub.truncated


def test_result_fn_chooses_the_tool_message() -> None:
    handler, _ = delegate_handler([[answer("42")]], result_fn=lambda r: f"R={r.total_reward}")
    result = run(handler(ToolCall("c", "delegate", {"task": "t"})))
    assert result.content == "R=1.0"


def test_wrong_tool_name_raises() -> None:
    handler, _ = delegate_handler([[answer("42")]])
    with pytest.raises(ValueError, match="'delegate' got a call to 'search'"):
        run(handler(ToolCall("c", "search", {"task": "t"})))


def test_arguments_the_env_factory_cannot_use_raise_naming_them() -> None:
    handler, _ = delegate_handler([[answer("42")]])
    with pytest.raises(ValueError, match=r"env_factory failed.*\{'question': 'q'\}"):
        run(handler(ToolCall("c", "delegate", {"question": "q"})))


def test_task_env_shows_the_task_and_ends_after_one_scored_action() -> None:
    env = TaskEnv("6*7?", scorer=score_if_42, agent_id="solver")
    assert env.reset() == {"solver": ("6*7?", {})}
    [(aid, outcome)] = env.step({"solver": "42"}).items()
    assert aid == "solver" and outcome.terminated and outcome.reward == 1.0
    with pytest.raises(RuntimeError, match="reset"):
        env.step({"solver": "again"})
    env.reset()
    with pytest.raises(ValueError, match="'solver'"):
        env.step({"other": "42"})
    assert TaskEnv("t").reset() and TaskEnv("t").agent_ids == ["agent"]
