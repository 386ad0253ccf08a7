"""SingleAgentProtocol: turns, step indices, parse failures, truncation, external tools."""

from __future__ import annotations

import asyncio

import pytest
from tests.interaction.fakes import (
    LineEnv,
    Reply,
    ScriptedAgent,
    answer,
    call_tool,
    garbled,
    run,
)

from ludic.interaction import ExternalToolResult, SingleAgentProtocol
from ludic.types import AgentStep, EnvironmentStep, Rollout, StepOutcome, ToolCall


def play(agent, env, max_steps=10, **kw):
    return run(
        SingleAgentProtocol(agent, **kw.pop("protocol", {})).run(env=env, max_steps=max_steps, **kw)
    )


def test_env_termination_ends_the_episode_terminated_not_truncated() -> None:
    env = LineEnv()
    agent = ScriptedAgent([answer("go"), answer("stop")])
    [rollout] = play(agent, env)
    assert env.calls == [{"walker": "go"}, {"walker": "stop"}]
    assert rollout.terminated and not rollout.truncated
    assert rollout.meta["truncation_reason"] is None
    assert [s.terminated for s in rollout.env_steps] == [False, True]
    assert [s.action for s in rollout.env_steps] == ["go", "stop"]
    assert [s.next_obs for s in rollout.env_steps] == ["pos=1", "pos=2"]


def test_step_indices_equal_positions_and_env_steps_point_at_their_turns_agent_steps() -> None:
    agent = ScriptedAgent([answer("go", internal_calls=2), answer("stop", internal_calls=1)])
    [rollout] = play(agent, LineEnv())
    assert [s.index for s in rollout.steps] == list(range(len(rollout.steps)))
    kinds = [s.kind for s in rollout.steps]
    assert kinds == ["agent", "agent", "agent", "env", "agent", "agent", "env"]
    first, second = rollout.env_steps
    assert first.agent_step_indices == (0, 1, 2)
    assert second.agent_step_indices == (4, 5)
    for env_step in rollout.env_steps:
        for i in env_step.agent_step_indices:
            assert rollout.steps[i].turn_id == env_step.turn_id


def test_turns_group_each_turns_agent_steps_with_its_env_step() -> None:
    agent = ScriptedAgent([answer("go", internal_calls=1, reward=0.5), answer("stop")])
    [rollout] = play(agent, LineEnv())
    turns = rollout.turns()
    assert len(turns) == 2
    assert len({t.turn_id for t in turns}) == 2
    assert [len(t.agent_steps) for t in turns] == [2, 1]
    for turn in turns:
        assert turn.env_step is not None
        assert tuple(s.index for s in turn.agent_steps) == turn.env_step.agent_step_indices
    assert turns[0].reward == pytest.approx(1.5)  # env 1.0 + parser bonus 0.5
    assert rollout.total_reward == pytest.approx(2.5)


def test_parse_failure_records_a_synthetic_step_and_does_not_call_env_step() -> None:
    env = LineEnv()
    agent = ScriptedAgent([garbled("blah", feedback="Use tags."), answer("stop")])
    [rollout] = play(agent, env)
    assert env.calls == [{"walker": "stop"}]
    synthetic, real = rollout.env_steps
    assert synthetic.synthetic and not real.synthetic
    assert synthetic.reward == 0.0
    assert synthetic.action == "blah"
    assert synthetic.next_obs == "Use tags."
    assert synthetic.info == {"parse_error": True}
    assert not synthetic.terminated and not synthetic.truncated
    assert real.prev_obs == "Use tags."  # the agent acted on the feedback
    # the penalty lives on the AgentStep, so the turn still carries it
    assert rollout.turns()[0].reward == pytest.approx(-1.0)
    assert rollout.agent_steps[0].parse_error


def test_parse_failure_feedback_is_shown_to_the_agent_before_it_acts_again() -> None:
    agent = ScriptedAgent([garbled(feedback="Use tags."), answer("stop")])
    play(agent, LineEnv())
    kinds = [e[0] for e in agent.events]
    assert kinds == ["reset", "act", "after_step", "act", "after_step"]
    assert agent.events[2][1:] == ("Use tags.", {"parse_error": True})
    contents = [m["content"] for m in agent.messages]
    assert contents.index("Use tags.") < contents.index("<a>stop</a>")


def test_parse_failure_without_feedback_uses_the_default_message() -> None:
    agent = ScriptedAgent([garbled(feedback=None), answer("stop")])
    [rollout] = play(agent, LineEnv())
    assert rollout.env_steps[0].next_obs
    assert "parsed" in rollout.env_steps[0].next_obs


def test_env_truncation_sets_truncation_reason_env() -> None:
    [rollout] = play(ScriptedAgent([answer("go")] * 3), LineEnv(time_limit=2))
    assert rollout.length == 2
    assert rollout.truncated and not rollout.terminated
    assert rollout.meta["truncation_reason"] == "env"
    assert rollout.env_steps[-1].truncated
    assert rollout.env_steps[-1].info["truncation_reason"] == "env"


def test_max_steps_truncation_is_marked_as_protocol_truncation() -> None:
    env = LineEnv(time_limit=100)
    [rollout] = play(ScriptedAgent([answer("go")] * 5), env, max_steps=3)
    assert len(env.calls) == 3
    assert rollout.truncated and not rollout.terminated
    assert rollout.meta["truncation_reason"] == "max_steps"
    last = rollout.env_steps[-1]
    assert last.truncated and last.info["truncation_reason"] == "max_steps"
    assert not any(s.truncated for s in rollout.env_steps[:-1])
    assert last.info["pos"] == 3  # env info kept


def test_synthetic_steps_count_toward_max_steps() -> None:
    env = LineEnv()
    [rollout] = play(ScriptedAgent([garbled(), garbled(), answer("go")]), env, max_steps=2)
    assert env.calls == []
    assert rollout.length == 2
    assert rollout.truncated and rollout.meta["truncation_reason"] == "max_steps"
    assert rollout.env_steps[-1].info == {"parse_error": True, "truncation_reason": "max_steps"}


def test_env_info_may_not_overwrite_a_reserved_key() -> None:
    class Liar(LineEnv):
        def step(self, actions):
            out = super().step(actions)["walker"]
            return {
                "walker": StepOutcome(
                    out.obs, 1.0, truncated=True, info={"truncation_reason": "timeout"}
                )
            }

    with pytest.raises(ValueError, match="truncation_reason"):
        play(ScriptedAgent([answer("go")]), Liar())


def test_meta_holds_caller_meta_agent_id_seed_and_initial_obs() -> None:
    [rollout] = play(
        ScriptedAgent([answer("stop")]), LineEnv(), env_seed=7, meta={"group_id": "g1"}
    )
    assert rollout.meta == {
        "group_id": "g1",
        "agent_id": "walker",
        "env_seed": 7,
        "initial_obs": "pos=7",
        "truncation_reason": None,
        "reset_info": {"seed": 7},  # what the env's reset returned as info
    }
    assert rollout.initial_obs == "pos=7"


def test_caller_meta_contradicting_protocol_meta_raises() -> None:
    with pytest.raises(ValueError, match="'agent_id'"):
        play(ScriptedAgent([answer("stop")]), LineEnv(), meta={"agent_id": "someone_else"})


def test_system_prompt_comes_from_the_env_unless_overridden() -> None:
    agent = ScriptedAgent([answer("stop")])
    play(agent, LineEnv())
    assert agent.events[0] == ("reset", "pos=0", "Walk.")
    agent = ScriptedAgent([answer("stop")])
    play(agent, LineEnv(), protocol={"system_prompt": "Run."})
    assert agent.events[0] == ("reset", "pos=0", "Run.")


def test_agent_id_must_be_given_for_a_multi_agent_env_and_must_exist() -> None:
    class TwoSeats(LineEnv):
        @property
        def agent_ids(self):
            return ["walker", "other"]

    with pytest.raises(ValueError, match="pass agent_id="):
        play(ScriptedAgent([answer("stop")]), TwoSeats())
    with pytest.raises(ValueError, match="'nobody'.*agent_ids="):
        play(ScriptedAgent([answer("stop")]), LineEnv(), protocol={"agent_id": "nobody"})
    [rollout] = play(ScriptedAgent([answer("stop")]), TwoSeats(), protocol={"agent_id": "walker"})
    assert rollout.meta["agent_id"] == "walker"


def test_agent_step_with_a_foreign_turn_id_raises() -> None:
    class Sloppy(ScriptedAgent):
        async def act(self, *, inference, turn_id):
            return await super().act(inference=inference, turn_id="fixed")

    with pytest.raises(ValueError, match="turn_id"):
        play(Sloppy([answer("stop")]), LineEnv())


def test_env_action_with_no_action_and_no_parse_error_raises() -> None:
    class Broken(ScriptedAgent):
        async def act(self, *, inference, turn_id):
            act = await super().act(inference=inference, turn_id=turn_id)
            act.action = None
            return act

    with pytest.raises(ValueError, match="parse_error=True"):
        play(Broken([answer("stop")]), LineEnv())


# --- external tools -------------------------------------------------------------------


def recording_handler(seen: list[ToolCall], content=lambda c: f"answer to {c.arguments}"):
    async def handler(call: ToolCall) -> ExternalToolResult:
        seen.append(call)
        return ExternalToolResult(content=content(call))

    return handler


def test_external_tool_results_are_fed_back_within_the_same_turn() -> None:
    seen: list[ToolCall] = []
    agent = ScriptedAgent([call_tool("lookup", "c1", q="x"), answer("stop")])
    [rollout] = play(agent, LineEnv(), protocol={"external_tool_handler": recording_handler(seen)})
    assert [c.id for c in seen] == ["c1"]
    tool_msg = {
        "role": "tool",
        "tool_call_id": "c1",
        "name": "lookup",
        "content": "answer to {'q': 'x'}",
    }
    assert ("tool_results", [tool_msg]) in agent.events
    kinds = [e[0] for e in agent.events]
    assert kinds == ["reset", "act", "tool_results", "act", "after_step"]
    # one turn: both agent calls share the turn id and feed one env step
    [turn] = rollout.turns()
    assert len(turn.agent_steps) == 2 and turn.env_step is not None
    assert turn.env_step.agent_step_indices == (0, 1)
    assert turn.agent_steps[0].action_target == "external"
    assert turn.agent_steps[0].tool_results == [tool_msg]
    assert rollout.length == 1


def test_all_tool_calls_of_one_act_are_answered_in_order() -> None:
    seen: list[ToolCall] = []
    calls = [ToolCall("a", "t", {"n": 1}), ToolCall("b", "t", {"n": 2})]
    agent = ScriptedAgent([Reply("<two calls>", external=calls), answer("stop")])
    play(agent, LineEnv(), protocol={"external_tool_handler": recording_handler(seen)})
    [(_, msgs)] = [e for e in agent.events if e[0] == "tool_results"]
    assert [m["tool_call_id"] for m in msgs] == ["a", "b"]


def test_external_tool_call_without_a_handler_raises_naming_the_fix() -> None:
    agent = ScriptedAgent([call_tool("delegate", "c1", task="t")])
    with pytest.raises(ValueError, match=r"\['delegate'\].*external_tool_handler="):
        play(agent, LineEnv())


def test_tool_round_cap_truncates_the_episode_without_an_env_step() -> None:
    seen: list[ToolCall] = []
    agent = ScriptedAgent([call_tool("t", f"c{i}") for i in range(5)])
    env = LineEnv()
    [rollout] = play(
        agent,
        env,
        protocol={"external_tool_handler": recording_handler(seen), "max_tool_rounds": 2},
    )
    assert len(seen) == 2  # the third external act is not handled
    assert env.calls == []
    assert rollout.truncated and not rollout.terminated
    assert rollout.meta["truncation_reason"] == "max_tool_rounds"
    [turn] = rollout.turns()
    assert turn.env_step is None and len(turn.agent_steps) == 3


def test_handler_returning_the_wrong_type_raises() -> None:
    async def bad(call):
        return "just a string"

    with pytest.raises(TypeError, match="ExternalToolResult"):
        play(
            ScriptedAgent([call_tool("t", "c")]), LineEnv(), protocol={"external_tool_handler": bad}
        )


def test_rollouts_returned_by_the_handler_follow_the_parent_and_link_to_it() -> None:
    child = Rollout(meta={"role": "sub_agent"})

    async def handler(call):
        return ExternalToolResult(content="ok", rollouts=[child])

    agent = ScriptedAgent([call_tool("t", "c"), answer("stop")])
    parent, got = play(agent, LineEnv(), protocol={"external_tool_handler": handler})
    assert got is child
    assert child.meta["parent_rollout_id"] == parent.id
    assert child.meta["parent_turn_id"] == parent.turns()[0].turn_id


def test_only_agent_and_env_steps_are_in_the_timeline() -> None:
    [rollout] = play(ScriptedAgent([answer("stop", internal_calls=1)]), LineEnv())
    assert all(isinstance(s, AgentStep | EnvironmentStep) for s in rollout.steps)
    assert rollout.agent_steps[0].trace is not None


def test_a_failing_external_handler_cancels_its_sibling_calls() -> None:
    finished: list[str] = []

    async def handler(call):
        if call.id == "bad":
            raise RuntimeError("tool backend down")
        await asyncio.sleep(0.05)
        finished.append(call.id)
        return ExternalToolResult(content="late")

    calls = [ToolCall("slow", "t", {}), ToolCall("bad", "t", {})]
    agent = ScriptedAgent([Reply("<two calls>", external=calls)])

    async def main() -> None:
        protocol = SingleAgentProtocol(agent, external_tool_handler=handler)
        with pytest.raises(RuntimeError, match="tool backend down"):
            await protocol.run(env=LineEnv(), max_steps=2)
        await asyncio.sleep(0.1)  # a leaked sibling would finish here

    run(main())
    assert finished == []


def test_one_agent_in_two_concurrent_episodes_raises_naming_the_fix() -> None:
    async def pause() -> None:
        await asyncio.sleep(0.01)

    agent = ScriptedAgent([answer("stop"), answer("stop")], gate=pause)

    async def two_at_once() -> None:
        await asyncio.gather(
            SingleAgentProtocol(agent).run(env=LineEnv(), max_steps=2),
            SingleAgentProtocol(agent).run(env=LineEnv(), max_steps=2),
        )

    with pytest.raises(RuntimeError, match=r"already in use.*build fresh ones per episode"):
        run(two_at_once())


def test_an_agent_may_play_consecutive_episodes() -> None:
    agent = ScriptedAgent([answer("stop"), answer("stop")])
    for _ in range(2):
        [rollout] = play(agent, LineEnv())
        assert rollout.terminated
