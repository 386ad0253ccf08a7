"""Pure-data types: validation, turn grouping, reward accounting, JSON round-trip."""

from __future__ import annotations

import json
import math

import pytest

from ludic.inference.request import CompletionRequest, InferenceSpec, ReturnSpec, SamplingSpec
from ludic.training.types import EnvSpec, ProtocolSpec, RolloutRequest, SAWItem
from ludic.types import (
    AgentStep,
    ChatResponse,
    EnvironmentStep,
    Rollout,
    StepOutcome,
    TokenTrace,
    ToolCall,
    logprob_temperature,
    rollout_from_dict,
    rollout_to_dict,
)


def test_token_trace_rejects_logprobs_misaligned_with_tokens() -> None:
    with pytest.raises(ValueError, match="2 completion_logprobs for 3 completion tokens"):
        TokenTrace((1,), (2, 3, 4), (-0.1, -0.2))


def test_token_trace_rejects_unknown_finish_reason() -> None:
    with pytest.raises(ValueError, match="finish_reason='eos'"):
        TokenTrace((1,), (2,), finish_reason="eos")


@pytest.mark.parametrize("temperature", [0.0, -0.5, math.nan, math.inf])
def test_logprob_temperatures_must_be_positive_and_finite(temperature) -> None:
    with pytest.raises(ValueError, match="TokenTrace: logprob_temperature="):
        TokenTrace((1,), (2,), logprob_temperature=temperature)
    with pytest.raises(ValueError, match="SAWItem: logprob_temperature="):
        SAWItem((1, 2), (0, 1), weight=1.0, logprob_temperature=temperature)


def test_a_trace_keeps_its_logprob_temperature_through_a_dict() -> None:
    trace = TokenTrace((1,), (2,), (-0.5,), logprob_temperature=1.3)
    assert TokenTrace.from_dict(json.loads(json.dumps(trace.to_dict()))) == trace
    assert logprob_temperature(0.0) == 1.0  # greedy: the raw logits
    assert logprob_temperature(0.7) == 0.7


def test_chat_response_finish_reason_must_match_its_trace() -> None:
    trace = TokenTrace((1,), (2,), finish_reason="length")
    with pytest.raises(ValueError, match="trace says 'length'"):
        ChatResponse(text="x", finish_reason="stop", trace=trace)
    assert ChatResponse(text="x", finish_reason="length", trace=trace).finish_reason == "length"


def test_non_finite_rewards_are_rejected_where_built() -> None:
    with pytest.raises(ValueError, match="finite"):
        StepOutcome(obs="o", reward=math.nan)
    with pytest.raises(ValueError, match="finite"):
        AgentStep(index=0, turn_id="t", prompt_messages=[], completion="", reward=math.inf)


def _two_turn_rollout() -> Rollout:
    steps = [
        AgentStep(0, "t0", [{"role": "user", "content": "q"}], "a", reward=-0.5, parse_error=True),
        EnvironmentStep(
            1, "t0", "q", "", "fix your format", 0.0, agent_step_indices=(0,), synthetic=True
        ),
        AgentStep(
            2,
            "t1",
            [{"role": "user", "content": "q"}],
            "<tool_call>",
            action_target="internal",
            tool_calls=[ToolCall("c0", "add", {"a": 1})],
            tool_results=[{"role": "tool", "content": "2"}],
        ),
        AgentStep(
            3,
            "t1",
            [{"role": "user", "content": "q"}],
            "b",
            action="b",
            reward=0.25,
            trace=TokenTrace((1, 2), (3,), (-0.1,), "stop", policy_version=4),
        ),
        EnvironmentStep(4, "t1", "q", "b", None, 1.0, terminated=True, agent_step_indices=(2, 3)),
    ]
    return Rollout(steps=steps, meta={"group_id": "g"}, terminated=True)


def test_turns_group_agent_calls_with_the_env_step_they_caused() -> None:
    turns = _two_turn_rollout().turns()
    assert [t.turn_id for t in turns] == ["t0", "t1"]
    assert [len(t.agent_steps) for t in turns] == [1, 2]
    assert turns[0].env_step is not None and turns[0].env_step.synthetic
    # Turn reward = env reward + every parser reward of its agent steps.
    assert turns[0].reward == -0.5
    assert turns[1].reward == 1.25


def test_turns_follow_changes_to_the_steps() -> None:
    r = _two_turn_rollout()
    assert len(r.turns()) == 2 and r.turns() is not r.turns()  # callers get their own list
    extra = AgentStep(5, "t2", [{"role": "user", "content": "q"}], "c", reward=2.0)
    r.steps.append(extra)
    assert [t.turn_id for t in r.turns()] == ["t0", "t1", "t2"]
    r.steps[5] = AgentStep(5, "t3", [{"role": "user", "content": "q"}], "d")  # replaced
    assert [t.turn_id for t in r.turns()] == ["t0", "t1", "t3"]
    r.steps = r.steps[:2]
    assert [t.turn_id for t in r.turns()] == ["t0"]


def test_ids_are_distinct_in_a_forked_child() -> None:
    import os

    from ludic.types import new_id

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its first id
        os.write(write, new_id().encode())
        os._exit(0)
    os.close(write)
    child = os.read(read, 64).decode()
    os.waitpid(pid, 0)
    mine = new_id()
    assert len(mine) == len(child) == 32 and mine != child
    assert len({new_id() for _ in range(1000)}) == 1000


def test_total_reward_and_length_count_every_turn() -> None:
    r = _two_turn_rollout()
    assert r.total_reward == pytest.approx(0.75)
    assert r.length == 2
    assert r.initial_obs == "q"


def test_a_turn_with_two_env_steps_is_an_error() -> None:
    r = Rollout(
        steps=[
            EnvironmentStep(0, "t", "a", "x", "b", 0.0),
            EnvironmentStep(1, "t", "b", "y", "c", 0.0),
        ]
    )
    with pytest.raises(ValueError, match="two environment steps"):
        r.turns()


def test_rollout_round_trips_through_json() -> None:
    r = _two_turn_rollout()
    d = json.loads(json.dumps(rollout_to_dict(r)))
    back = rollout_from_dict(d)
    assert rollout_to_dict(back) == rollout_to_dict(r)
    assert back.steps[3].trace == r.steps[3].trace


def test_rollout_from_dict_names_the_missing_field() -> None:
    d = rollout_to_dict(_two_turn_rollout())
    del d["steps"][1]["prev_obs"]
    with pytest.raises(ValueError, match="step 1: missing field 'prev_obs'"):
        rollout_from_dict(d)


def test_sampling_spec_validates_each_field_by_name() -> None:
    with pytest.raises(ValueError, match="top_p"):
        SamplingSpec(top_p=0.0)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingSpec(max_tokens=0)
    with pytest.raises(ValueError, match="top_k"):
        SamplingSpec(top_k=0)
    assert InferenceSpec().with_seed(7).sampling.seed == 7


def test_return_spec_logprobs_need_token_ids() -> None:
    with pytest.raises(ValueError, match="return_token_ids"):
        ReturnSpec(return_token_ids=False, return_logprobs=True)
    assert ReturnSpec.for_rl().return_logprobs and not ReturnSpec.for_eval().return_token_ids


def test_completion_request_needs_a_prompt() -> None:
    with pytest.raises(ValueError, match="empty"):
        CompletionRequest(prompt_token_ids=())


def test_rollout_request_validates_counts() -> None:
    with pytest.raises(ValueError, match="num_episodes"):
        RolloutRequest(EnvSpec("e"), ProtocolSpec("p"), num_episodes=0)


def test_saw_item_rejects_bad_shapes_and_weights() -> None:
    with pytest.raises(ValueError, match="action_mask has 2 entries for 3 tokens"):
        SAWItem((1, 2, 3), (0, 1), 1.0)
    with pytest.raises(ValueError, match="weight is nan"):
        SAWItem((1, 2), (0, 1), math.nan, meta={"rollout_id": "r"})
    with pytest.raises(ValueError, match="first token cannot be an action"):
        SAWItem((1, 2), (1, 1), 1.0)
    with pytest.raises(ValueError, match="no action tokens"):
        SAWItem((1, 2), (0, 0), 1.0)
    with pytest.raises(ValueError, match="old_logprobs has 1 entries"):
        SAWItem((1, 2), (0, 1), 1.0, old_logprobs=(0.0,))
    item = SAWItem([1, 2, 3], [0, 1, 1], 0.5)
    assert item.num_tokens == 3 and item.num_action_tokens == 2
