"""The group-relative judge's parts without a server: the schema, the parser of its reply,
and the reward loop's group scoring (tested with a scripted scorer in place of the judge;
the real judge: tests/vllm_reward/test_group_judge_vllm.py)."""

from __future__ import annotations

import asyncio
import re

import pytest

from ludic.rewards import GroupJudge, RewardLoop, group_pattern, parse_group_judgement
from ludic.rewards.loop import REWARD_KEY, RewardLoopError
from ludic.rewards.sample import RewardResult, RewardSample
from ludic.types import AgentStep, Rollout, TokenTrace


def test_scores_and_rankings_become_rewards_and_anything_else_is_an_error() -> None:
    assert parse_group_judgement('{"scores": [10, 0, 5]}', 3, "scores") == [1.0, 0.0, 0.5]
    # answers 2, 3, 1 best first: answer 1 last (0), 2 first (1), 3 in the middle (0.5)
    assert parse_group_judgement('{"ranking": [2, 3, 1]}', 3, "ranking") == [0.0, 1.0, 0.5]
    for text, mode, problem in [
        ("Score: 7", "scores", "not JSON"),
        ('{"scores": [1, 2]}', "scores", 'no "scores" list of 3'),
        ('{"scores": [1, 2, 11]}', "scores", "leave 0..10"),
        ('{"scores": [1, 2, 1.5]}', "scores", "not all integers"),
        ('{"ranking": [1, 1, 2]}', "ranking", "not an order of the answers"),
    ]:
        with pytest.raises(ValueError, match=problem):
            parse_group_judgement(text, 3, mode)
    ranking = group_pattern(4, "ranking")
    assert re.fullmatch(ranking, '{"ranking":[2,4,1,3]}')
    assert not re.fullmatch(ranking, '{"ranking":[2,5,1,3]}')  # no answer 5
    assert not re.fullmatch(ranking, '{"ranking":[2,2,1,3]}')  # each answer once
    assert not re.fullmatch(ranking, '{"ranking": [2,4,1,3]}')  # no free whitespace
    assert not re.fullmatch(group_pattern(3, "scores"), '{"scores":[10,0,11]}')


def test_the_request_numbers_the_answers_and_forces_the_schema() -> None:
    judge = GroupJudge("http://127.0.0.1:1", mode="scores")
    samples = [
        RewardSample("d", f" answer {i} ", "7", extra_info={"question": "3+4?"}) for i in range(3)
    ]
    request = judge.request(samples)
    prompt = request["messages"][0]["content"]
    assert "Question: 3+4?" in prompt and "Reference answer: 7" in prompt
    assert 'Reply with JSON {"scores": [...]}' in prompt  # single braces: what to write
    assert "Answer 1: answer 0\nAnswer 2: answer 1\nAnswer 3: answer 2" in prompt
    assert request["structured_outputs"] == {"regex": group_pattern(3, "scores")}
    assert request["temperature"] == 0.0 and request["max_tokens"] == 28
    with pytest.raises(ValueError, match="placeholder 'nope'"):
        GroupJudge(template="{nope}")


def test_a_dead_judge_fails_every_member_of_the_group_loudly() -> None:
    judge = GroupJudge("http://127.0.0.1:9", timeout_s=2.0)  # nothing listens on port 9
    results = asyncio.run(judge.score_group([RewardSample("d", "a", "b")] * 2))
    assert [r.score for r in results] == [None, None]
    assert all("group judge (2 answers)" in r.error for r in results)


class _Scripted:
    """Scores a group by answer length, counting calls (the judge's stand-in)."""

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[list[str]] = []
        self.fail = fail

    async def score_group(self, samples):
        self.calls.append([s.solution_str for s in samples])
        if self.fail:
            return [RewardResult(None, error="judge down") for _ in samples]
        return [RewardResult(float(len(s.solution_str))) for s in samples]


def _rollout(group: str, text: str, agent: str | None = None) -> Rollout:
    step = AgentStep(
        index=0,
        turn_id="t",
        prompt_messages=[],
        completion=text,
        trace=TokenTrace((1,), (2,) * len(text)),
    )
    meta = {"group_id": group, "env_kind": "qa", "initial_obs": "q"}
    if agent:
        meta["agent_id"] = agent
    return Rollout(steps=[step], meta=meta)


def test_standalone_scores_a_group_once_when_it_is_complete() -> None:
    scorer = _Scripted()
    loop = RewardLoop(group_scorer=scorer, group_size=2)
    rollouts = [
        _rollout("g1", "a"),
        _rollout("g2", "bbb"),
        _rollout("g1", "cc"),
        _rollout("g2", "d"),
    ]

    async def run():
        for r in rollouts:  # episodes end one by one, the groups interleaved
            loop.on_episode([r])
            await asyncio.sleep(0)
        assert len(scorer.calls) == 2  # each group started as its second member arrived
        await loop(rollouts)

    asyncio.run(run())
    assert scorer.calls == [["a", "cc"], ["bbb", "d"]]
    assert [r.meta[REWARD_KEY]["score"] for r in rollouts] == [1.0, 3.0, 2.0, 1.0]


def test_colocate_scores_each_group_with_the_batch_and_players_apart() -> None:
    scorer = _Scripted()
    loop = RewardLoop(group_scorer=scorer, group_size=2, mode="colocate")
    rollouts = [_rollout("g", "x", "p0"), _rollout("g", "yy", "p1"), _rollout("g", "zzz", "p0")]
    rollouts.append(_rollout("g", "w", "p1"))
    loop.on_episode(rollouts)  # colocate: nothing starts here
    assert scorer.calls == []
    asyncio.run(loop(rollouts))
    assert sorted(scorer.calls) == [["x", "zzz"], ["yy", "w"]]  # one group per player


def test_failed_groups_count_as_failed_samples_and_stop_a_bad_batch() -> None:
    loop = RewardLoop(group_scorer=_Scripted(fail=True), group_size=2, mode="colocate")
    rollouts = [_rollout("g", "a"), _rollout("g", "b")]
    with pytest.raises(RewardLoopError, match="2 of 2 samples of a batch failed.*judge down"):
        asyncio.run(loop(rollouts))
    with pytest.raises(
        ValueError, match="RewardLoop: rollout .* has no meta\\[.group_id.\\] and no initial"
    ):
        asyncio.run(RewardLoop(group_scorer=_Scripted(), group_size=2)([Rollout()]))
    with pytest.raises(ValueError, match="a manager .* or a group_scorer, not both"):
        RewardLoop()


def test_a_group_split_from_what_arrived_is_scored_as_the_batch_has_it() -> None:
    """A group started on its arrivals but reaching the hook in part (or with others) is
    scored again as the batch has it: the started judgement is dropped, not mixed in."""
    scorer = _Scripted()
    loop = RewardLoop(group_scorer=scorer, group_size=2)
    a, b = _rollout("g", "a"), _rollout("g", "bb")

    async def run():
        loop.on_episode([a, b])  # complete: its scoring starts
        await asyncio.sleep(0)
        await loop([a])  # only one of them reaches the hook

    asyncio.run(run())
    assert scorer.calls[-1] == ["a"] and a.meta[REWARD_KEY]["score"] == 1.0
