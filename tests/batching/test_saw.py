"""Rollout -> SAWItem conversion (ludic.training.batching.saw)."""

from __future__ import annotations

import pytest

from ludic.inference.chat_template import HFChatTemplate
from ludic.training.batching.saw import (
    TokenAlignmentError,
    build_saw_batch,
    rollouts_to_saw_items,
    summarize_rollouts,
)
from ludic.types import Rollout


def test_single_step_turn_concatenates_prompt_and_completion(fakes):
    r = fakes.one_turn_rollout(1.0, rid="r0", meta={"group_id": "g1", "env_seed": 7})
    [item] = rollouts_to_saw_items([r], [[0.5]])
    assert item.input_ids == (1, 2, 3, 4, 5)
    assert item.action_mask == (0, 0, 0, 1, 1)
    assert item.old_logprobs == pytest.approx((0.0, 0.0, 0.0, -0.1, -0.2))
    assert item.weight == 0.5
    assert item.meta["rollout_id"] == "r0"
    assert item.meta["turn_index"] == 0
    assert item.meta["group_id"] == "g1"
    assert item.meta["env_seed"] == 7
    assert item.meta["reward"] == 1.0
    assert item.meta["total_reward"] == 1.0
    assert item.meta["terminated"] is True
    assert item.meta["truncated"] is False
    assert item.meta["finish_reason"] == "stop"
    assert item.meta["parse_error"] is False
    assert item.meta["prompt_length"] == 3
    assert item.meta["completion_length"] == 2


def test_multi_call_turn_masks_tool_tokens_between_completions(fakes):
    s0 = fakes.agent_step(
        0, "t0", [1, 2], [3, 4], logprobs=[-1.0, -2.0], finish_reason="tool_calls"
    )
    # second call's prompt = prompt + completion + tool output tokens (9, 9)
    s1 = fakes.agent_step(1, "t0", [1, 2, 3, 4, 9, 9], [5], logprobs=[-3.0], parse_error=True)
    r = Rollout(steps=[s0, s1, fakes.env_step(2, "t0", 1.0)])
    [item] = rollouts_to_saw_items([r], [[2.0]])
    assert item.input_ids == (1, 2, 3, 4, 9, 9, 5)
    assert item.action_mask == (0, 0, 1, 1, 0, 0, 1)
    assert item.old_logprobs == (0.0, 0.0, -1.0, -2.0, 0.0, 0.0, -3.0)
    assert item.meta["num_agent_steps"] == 2
    assert item.meta["finish_reason"] == "stop"  # the last call's
    assert item.meta["parse_error"] is True  # any call's


def test_the_item_is_scored_at_the_temperature_its_calls_sampled_at(fakes):
    s0 = fakes.agent_step(0, "t0", [1, 2], [3, 4], finish_reason="tool_calls", temperature=1.3)
    s1 = fakes.agent_step(1, "t0", [1, 2, 3, 4, 9], [5], temperature=1.3)
    [item] = rollouts_to_saw_items([Rollout(steps=[s0, s1, fakes.env_step(2, "t0", 1.0)])], [[1.0]])
    assert item.logprob_temperature == 1.3
    [plain] = rollouts_to_saw_items([fakes.one_turn_rollout(1.0)], [[1.0]])
    assert plain.logprob_temperature == 1.0
    s1 = fakes.agent_step(1, "t0", [1, 2, 3, 4, 9], [5], temperature=1.0)
    mixed = Rollout(steps=[s0, s1, fakes.env_step(2, "t0", 1.0)], id="rm")
    with pytest.raises(
        ValueError, match=r"turn 0 of rollout rm.*different temperatures \[1.0, 1.3\]"
    ):
        rollouts_to_saw_items([mixed], [[1.0]])


def test_prompt_that_does_not_extend_earlier_tokens_raises(fakes):
    s0 = fakes.agent_step(0, "t0", [1, 2], [3, 4])
    s1 = fakes.agent_step(1, "t0", [1, 2, 3, 7, 9], [5])  # 7 != completion token 4
    r = Rollout(steps=[s0, s1, fakes.env_step(2, "t0", 1.0)], id="rx")
    with pytest.raises(TokenAlignmentError, match=r"turn 0 of rollout rx.*agent step 1") as e:
        rollouts_to_saw_items([r], [[1.0]])
    assert "ChatTemplate.extend" in str(e.value)
    assert "retokenize=True" in str(e.value)
    assert "first mismatch at token 3" in str(e.value)


def test_missing_trace_in_token_mode_points_to_for_rl_and_retokenize(fakes):
    r = fakes.one_turn_rollout(trace=False)
    with pytest.raises(ValueError, match=r"ReturnSpec\.for_rl\(\).*retokenize=True"):
        rollouts_to_saw_items([r], [[1.0]])


def test_old_logprobs_are_none_when_any_call_lacks_logprobs(fakes):
    s0 = fakes.agent_step(0, "t0", [1, 2], [3])
    s1 = fakes.agent_step(1, "t0", [1, 2, 3, 8], [5], logprobs=None)
    r = Rollout(steps=[s0, s1, fakes.env_step(2, "t0", 0.0)])
    [item] = rollouts_to_saw_items([r], [[1.0]])
    assert item.old_logprobs is None


def test_policy_version_is_the_oldest_known_version_of_the_turn(fakes):
    s0 = fakes.agent_step(0, "t0", [1, 2], [3], version=3)
    s1 = fakes.agent_step(1, "t0", [1, 2, 3, 8], [5], version=2)
    s2 = fakes.agent_step(2, "t1", [6], [7])
    r = Rollout(steps=[s0, s1, fakes.env_step(3, "t0", 0.0), s2, fakes.env_step(4, "t1", 0.0)])
    first, second = rollouts_to_saw_items([r], [[1.0, 1.0]])
    assert first.policy_version == 2
    assert second.policy_version is None


def test_a_call_that_straddled_an_update_gives_the_item_its_end_version(fakes):
    # served while version 4 landed without a pause: its tokens are 3 or 4, which unknown
    straddled = fakes.agent_step(0, "t0", [1, 2], [3, 4], version=3, version_end=4)
    r = Rollout(steps=[straddled, fakes.env_step(1, "t0", 1.0)])
    [item] = rollouts_to_saw_items([r], [[1.0]])
    assert (item.policy_version, item.newest_version, item.version_end) == (3, 4, 4)
    assert item.version_span == 1
    # exact versions need no end: two calls at 3 and 5 in one turn span 2 updates
    s0 = fakes.agent_step(0, "t0", [1, 2], [3], version=3)
    s1 = fakes.agent_step(1, "t0", [1, 2, 3, 8], [5], version=5)
    r = Rollout(steps=[s0, s1, fakes.env_step(2, "t0", 0.0)])
    [item] = rollouts_to_saw_items([r], [[1.0]])
    assert item.action_versions == (3, 5) and item.version_end is None
    assert item.version_span == 2


def test_a_retokenized_turn_keeps_the_newest_version_of_its_calls(fakes, tiny_tokenizer):
    m0 = [{"role": "user", "content": "q"}]
    m1 = m0 + [{"role": "assistant", "content": "a"}, {"role": "tool", "content": "t"}]
    s0 = fakes.agent_step(0, "t0", [1, 2], [3], version=3, messages=m0, completion="a")
    s1 = fakes.agent_step(
        1, "t0", [1, 2, 3, 8], [5], version=4, version_end=6, messages=m1, completion="b"
    )
    r = Rollout(steps=[s0, s1, fakes.env_step(2, "t0", 0.0)])
    template = HFChatTemplate(tiny_tokenizer)
    [item] = rollouts_to_saw_items([r], [[1.0]], retokenize=True, chat_template=template)
    assert item.action_versions is None  # retokenized: no per-token versions
    assert (item.policy_version, item.version_end, item.version_span) == (3, 6, 3)


def test_weights_are_taken_per_turn_and_turns_without_agent_steps_are_skipped(fakes):
    steps = [
        fakes.agent_step(0, "t0", [1], [2]),
        fakes.env_step(1, "t0", 0.5),
        fakes.env_step(2, "env-only", 0.0),
        fakes.agent_step(3, "t2", [1, 2, 3], [4], reward=-0.25),
        fakes.env_step(4, "t2", 1.0),
    ]
    r = Rollout(steps=steps)
    items = rollouts_to_saw_items([r], [[0.1, 0.2, 0.3]])
    assert [it.weight for it in items] == [0.1, 0.3]
    assert [it.meta["turn_index"] for it in items] == [0, 2]
    assert [it.meta["reward"] for it in items] == [0.5, 0.75]


def test_turn_with_only_empty_completions_yields_no_item(fakes):
    r = Rollout(steps=[fakes.agent_step(0, "t0", [1, 2], []), fakes.env_step(1, "t0", 0.0)])
    assert rollouts_to_saw_items([r], [[1.0]]) == []


def test_weight_shape_mismatch_names_the_rollout_and_turn_count(fakes):
    r = fakes.one_turn_rollout(rid="r9")
    with pytest.raises(ValueError, match=r"weights for 0 rollouts but the batch has 1"):
        rollouts_to_saw_items([r], [])
    with pytest.raises(ValueError, match=r"2 weights for rollout r9 which has 1 turns"):
        rollouts_to_saw_items([r], [[1.0, 1.0]])


def test_token_mode_accepts_prompts_built_with_hf_chat_template_extend(fakes, tiny_tokenizer):
    tmpl = HFChatTemplate(tiny_tokenizer)
    eos = tiny_tokenizer.eos_token_id
    p0 = tmpl.render([{"role": "user", "content": "add 2 3"}])
    c0 = tiny_tokenizer.encode("call", add_special_tokens=False) + [eos]
    tool = [{"role": "tool", "content": "5"}]
    p1 = tmpl.extend(p0, c0, tool)
    c1 = tiny_tokenizer.encode("5", add_special_tokens=False) + [eos]
    r = Rollout(
        steps=[
            fakes.agent_step(0, "t0", p0, c0),
            fakes.agent_step(1, "t0", p1, c1),
            fakes.env_step(2, "t0", 1.0),
        ]
    )
    [item] = rollouts_to_saw_items([r], [[1.0]])
    assert list(item.input_ids) == p1 + c1
    masked_ext = [
        t for t, m in zip(item.input_ids[len(p0) :], item.action_mask[len(p0) :]) if not m
    ]
    assert tmpl.decode(masked_ext) == "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    assert item.num_action_tokens == len(c0) + len(c1)


def test_retokenize_rebuilds_tokens_from_messages_with_the_chat_template(fakes, tiny_tokenizer):
    tmpl = HFChatTemplate(tiny_tokenizer)
    user = [{"role": "user", "content": "hi"}]
    r = fakes.one_turn_rollout(trace=False, messages=user, completion="yo")
    [item] = rollouts_to_saw_items([r], [[1.0]], retokenize=True, chat_template=tmpl)
    prompt = tmpl.render(user)
    expected = tmpl.render(
        user + [{"role": "assistant", "content": "yo"}], add_generation_prompt=False
    )
    assert list(item.input_ids) == expected
    assert item.action_mask == (0,) * len(prompt) + (1,) * (len(expected) - len(prompt))
    assert tmpl.decode(list(item.input_ids[len(prompt) :])) == "yo<|im_end|>\n"
    assert item.old_logprobs is None


def test_retokenize_masks_tool_messages_between_calls_of_a_turn(fakes, tiny_tokenizer):
    tmpl = HFChatTemplate(tiny_tokenizer)
    m0 = [{"role": "user", "content": "add 2 3"}]
    m1 = m0 + [{"role": "assistant", "content": "call"}, {"role": "tool", "content": "5"}]
    r = Rollout(
        steps=[
            fakes.agent_step(0, "t0", [], [], trace=False, messages=m0, completion="call"),
            fakes.agent_step(1, "t0", [], [], trace=False, messages=m1, completion="5"),
            fakes.env_step(2, "t0", 1.0),
        ]
    )
    [item] = rollouts_to_saw_items([r], [[1.0]], retokenize=True, chat_template=tmpl)
    ids, mask = list(item.input_ids), list(item.action_mask)
    actions = tmpl.decode([t for t, m in zip(ids, mask) if m])
    assert actions == "call<|im_end|>\n5<|im_end|>\n"
    n0 = len(tmpl.render(m0))
    context_after_first = tmpl.decode([t for t, m in zip(ids[n0:], mask[n0:]) if not m])
    assert context_after_first == "<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"


def test_retokenize_without_chat_template_raises(fakes):
    with pytest.raises(ValueError, match="retokenize=True needs a chat_template"):
        rollouts_to_saw_items([fakes.one_turn_rollout()], [[1.0]], retokenize=True)


def test_summarize_rollouts_reports_reward_length_truncation_and_parse_errors(fakes):
    a = fakes.one_turn_rollout(1.0, parse_error=True)
    b = fakes.one_turn_rollout(-1.0)
    b.truncated, b.terminated = True, False
    stats = summarize_rollouts([a, b])
    assert stats["num_rollouts"] == 2
    assert stats["reward_mean"] == 0.0
    assert (stats["reward_min"], stats["reward_max"]) == (-1.0, 1.0)
    assert stats["total_rewards"] == [1.0, -1.0]
    assert stats["length_mean"] == 1.0
    assert stats["truncated_frac"] == 0.5
    assert stats["terminated_frac"] == 0.5
    assert stats["parse_error_rate"] == 0.5


def test_summarize_rollouts_reports_reward_model_scores_when_present(fakes):
    a, b, c = (fakes.one_turn_rollout(0.0) for _ in range(3))
    assert "rm_score_mean" not in summarize_rollouts([a, b, c])
    a.meta["rm_scores"], b.meta["rm_scores"] = [0.25], [0.75]
    c.meta["rm_scores"] = [None]  # a turn the reward model did not score
    assert summarize_rollouts([a, b, c])["rm_score_mean"] == 0.5


def test_build_saw_batch_applies_sample_filter_and_counts_dropped_items(fakes):
    rollouts = [fakes.one_turn_rollout(1.0), fakes.one_turn_rollout(0.0, parse_error=True)]
    batch = build_saw_batch(
        rollouts,
        credit_assigner=fakes.TurnRewardCredit(),
        sample_filter=lambda it: not it.meta["parse_error"],
    )
    assert len(batch) == 1
    assert batch.meta["num_items"] == 1
    assert batch.meta["num_items_filtered"] == 1
    assert batch.meta["num_action_tokens"] == 2
    assert batch.meta["total_rewards"] == [1.0, 0.0]


def test_summarize_rollouts_counts_the_groups_with_nothing_to_learn(fakes):
    def group(gid: str, *rewards: float) -> list:
        return [fakes.one_turn_rollout(r, meta={"group_id": gid}) for r in rewards]

    assert "zero_variance_group_frac" not in summarize_rollouts([fakes.one_turn_rollout(1.0)])
    rollouts = group("a", 1, 1, 1) + group("b", 0, 1, 0) + group("c", 0, 0, 0) + group("d", 1)
    # a and c agree on every sample (no GRPO signal), b does not; d is a group of one
    assert summarize_rollouts(rollouts)["zero_variance_group_frac"] == pytest.approx(2 / 3)
