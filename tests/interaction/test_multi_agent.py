"""MultiAgentProtocol: per-agent rollouts, concurrency, parse failures, passive outcomes."""

from __future__ import annotations

import asyncio

import pytest
from tests.interaction.fakes import CouncilEnv, ScriptedAgent, answer, call_tool, garbled, run

from ludic.envs.tic_tac_toe import TicTacToeTwoPlayerEnv
from ludic.interaction import ExternalToolResult, MultiAgentProtocol, TraceCollector
from ludic.types import StepOutcome


def play(agents, env, max_steps=10, **kw):
    return run(MultiAgentProtocol(agents, **kw).run(env=env, max_steps=max_steps, env_seed=3))


def test_each_agent_gets_its_own_rollout_in_env_agent_order() -> None:
    env = CouncilEnv(["a", "b"])
    agents = {
        "b": ScriptedAgent([answer("x"), answer("done")]),
        "a": ScriptedAgent([answer("done")]),
    }
    ra, rb = play(agents, env)
    assert (ra.meta["agent_id"], rb.meta["agent_id"]) == ("a", "b")
    assert env.calls == [{"a": "done", "b": "x"}, {"b": "done"}]
    assert [s.action for s in ra.env_steps] == ["done"]
    assert [s.action for s in rb.env_steps] == ["x", "done"]
    assert ra.meta["initial_obs"] == "hello a" and rb.meta["env_seed"] == 3
    for r in (ra, rb):
        assert r.terminated and not r.truncated
        assert [s.index for s in r.steps] == list(range(len(r.steps)))
        for turn in r.turns():
            assert turn.env_step is not None
            assert turn.env_step.agent_step_indices == tuple(s.index for s in turn.agent_steps)
    # turn ids never leak between agents
    assert not {t.turn_id for t in ra.turns()} & {t.turn_id for t in rb.turns()}


def test_acts_start_in_active_agents_order_and_run_concurrently() -> None:
    order: list[str] = []
    arrived: list[str] = []

    def gate_for(name: str):
        async def gate() -> None:
            order.append(name)
            arrived.append(name)
            for _ in range(50):
                if len(arrived) == 3:
                    return
                await asyncio.sleep(0)
            raise AssertionError("acts ran one after another, not concurrently")

        return gate

    env = CouncilEnv(["p1", "p2", "p3"])
    agents = {a: ScriptedAgent([answer("done")], gate=gate_for(a)) for a in ["p3", "p1", "p2"]}
    play(agents, env)
    assert order == ["p1", "p2", "p3"]


def test_parse_failure_leaves_that_agent_out_of_env_step() -> None:
    env = CouncilEnv(["a", "b"])
    agents = {
        "a": ScriptedAgent([garbled(feedback="fix it"), answer("done")]),
        "b": ScriptedAgent([answer("done")]),
    }
    ra, rb = play(agents, env)
    assert env.calls == [{"b": "done"}, {"a": "done"}]
    synthetic, real = ra.env_steps
    assert synthetic.synthetic and synthetic.next_obs == "fix it" and synthetic.reward == 0.0
    assert real.prev_obs == "fix it"
    assert ("after_step", "fix it", {"parse_error": True}) in agents["a"].events
    assert rb.length == 1


def test_when_no_agent_has_a_valid_action_env_step_is_skipped_but_the_step_counts() -> None:
    env = CouncilEnv(["a", "b"])
    agents = {"a": ScriptedAgent([garbled()] * 2), "b": ScriptedAgent([garbled()] * 2)}
    ra, rb = play(agents, env, max_steps=2)
    assert env.calls == []
    for r in (ra, rb):
        assert r.length == 2 and all(s.synthetic for s in r.env_steps)
        assert r.truncated and r.meta["truncation_reason"] == "max_steps"
        assert r.env_steps[-1].info["truncation_reason"] == "max_steps"


def test_max_steps_truncates_only_agents_not_done() -> None:
    env = CouncilEnv(["a", "b"])
    agents = {"a": ScriptedAgent([answer("done")]), "b": ScriptedAgent([answer("x")] * 3)}
    ra, rb = play(agents, env, max_steps=3)
    assert ra.terminated and not ra.truncated and ra.meta["truncation_reason"] is None
    assert rb.truncated and not rb.terminated and rb.meta["truncation_reason"] == "max_steps"
    assert rb.length == 3 and rb.env_steps[-1].truncated


def test_two_player_game_credits_the_loser_through_a_passive_outcome() -> None:
    # X: 1, O: 4, X: 2, O: 5, X: 3 -> X completes the top row and wins.
    x = ScriptedAgent([answer("1"), answer("2"), answer("3")])
    o = ScriptedAgent([answer("4"), answer("5")])
    rx, ro = play({"X": x, "O": o}, TicTacToeTwoPlayerEnv())
    assert rx.terminated and ro.terminated
    assert [s.reward for s in rx.env_steps] == [0.0, 0.0, 1.0]
    assert [s.reward for s in ro.env_steps] == [0.0, -1.0]
    assert ro.env_steps[-1].terminated and ro.env_steps[-1].info["result"] == "loss"
    assert "You lose." in (ro.env_steps[-1].next_obs or "")
    # O acted on the board after X's move, which it saw through a passive outcome
    assert ro.env_steps[0].prev_obs.startswith("X played 1.")
    assert ro.env_steps[1].prev_obs.startswith("X played 2.")
    assert [s.index for s in ro.steps] == list(range(len(ro.steps)))


def test_waiting_agent_can_end_before_acting_with_zero_reward() -> None:
    x = ScriptedAgent([answer("banana")])  # illegal -> game over, O gets 0.0
    o = ScriptedAgent([])
    rx, ro = play({"X": x, "O": o}, TicTacToeTwoPlayerEnv())
    assert rx.terminated and rx.env_steps[-1].reward == -1.0
    assert ro.terminated and ro.steps == []
    assert o.events[-1][0] == "after_step"


def test_reward_before_an_agents_first_action_raises() -> None:
    class EagerEnv(CouncilEnv):
        @property
        def active_agents(self):
            return ["a"]

        def step(self, actions):
            return {"a": StepOutcome("ok", 0.0), "b": StepOutcome("bonus", 1.0)}

    with pytest.raises(ValueError, match="'b' reward 1.0 before its first action"):
        play({"a": ScriptedAgent([answer("x")]), "b": ScriptedAgent([])}, EagerEnv(["a", "b"]))


def test_missing_or_unknown_agents_raise_listing_both_sides() -> None:
    with pytest.raises(ValueError, match=r"no agent for \['b'\].*unknown to the env: \['z'\]"):
        play({"a": ScriptedAgent([]), "z": ScriptedAgent([])}, CouncilEnv(["a", "b"]))


def test_unknown_active_agent_raises() -> None:
    class Stray(CouncilEnv):
        @property
        def active_agents(self):
            return ["a", "ghost"]

    with pytest.raises(ValueError, match=r"unknown agent ids \['ghost'\]"):
        play({"a": ScriptedAgent([])}, Stray(["a"]))


def test_missing_outcome_for_an_acting_agent_raises() -> None:
    class Forgetful(CouncilEnv):
        def step(self, actions):
            return {}

    with pytest.raises(ValueError, match=r"no outcome for acting agents \['a'\]"):
        play({"a": ScriptedAgent([answer("x")])}, Forgetful(["a"]))


def test_no_active_agent_while_some_are_not_done_raises() -> None:
    class Stalled(CouncilEnv):
        @property
        def active_agents(self):
            return []

    with pytest.raises(RuntimeError, match="active_agents is empty"):
        play({"a": ScriptedAgent([])}, Stalled(["a"]))


def test_one_agent_object_for_two_ids_is_rejected() -> None:
    shared = ScriptedAgent([])
    with pytest.raises(ValueError, match="share one agent object"):
        MultiAgentProtocol({"a": shared, "b": shared})


def test_two_agents_sharing_one_context_strategy_are_rejected_at_run() -> None:
    shared_context = object()
    a, b = ScriptedAgent([answer("done")]), ScriptedAgent([answer("done")])
    a.context = b.context = shared_context  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match=r"context strategy of agent 'b' is already in use"):
        play({"a": a, "b": b}, CouncilEnv(["a", "b"]))


def test_external_tools_and_their_rollouts_are_handled_per_agent() -> None:
    async def handler(call):
        return ExternalToolResult(content=f"re {call.id}")

    env = CouncilEnv(["a", "b"])
    agents = {
        "a": ScriptedAgent([call_tool("t", "ca"), answer("done")]),
        "b": ScriptedAgent([answer("done")]),
    }
    ra, rb = play(agents, env, external_tool_handler=handler)
    assert env.calls == [{"a": "done", "b": "done"}]
    [turn] = ra.turns()
    assert len(turn.agent_steps) == 2 and turn.agent_steps[0].tool_results[0]["content"] == "re ca"


def test_trace_collector_keeps_one_rollout_per_agent_and_rejects_unknown_ids() -> None:
    collector = TraceCollector(["a", "b"], meta={"group_id": "g"})
    assert [r.meta for r in collector.rollouts()] == [
        {"group_id": "g", "agent_id": "a"},
        {"group_id": "g", "agent_id": "b"},
    ]
    with pytest.raises(KeyError, match=r"'c'.*\['a', 'b'\]"):
        collector.rollout("c")
    with pytest.raises(ValueError, match="duplicate"):
        TraceCollector(["a", "a"])
