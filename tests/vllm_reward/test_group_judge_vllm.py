"""The group-relative judge against a real vLLM judge on CPU (the session's tiny policy
server): one structured-output call per group, a valid judgement of every member, the same
judgement twice at temperature 0; and a run whose rewards all come from it, in async mode."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed")

from tests.vllm.helpers import API_KEY  # noqa: E402

from ludic import jobs  # noqa: E402
from ludic.rewards import (
    GroupJudge,  # noqa: E402
    group_judge,  # noqa: E402
)
from ludic.rewards.sample import RewardSample  # noqa: E402
from ludic.run.loading import load_config  # noqa: E402

GROUP = [
    RewardSample("arithmetic", answer, "7", extra_info={"question": "3+4="})
    for answer in ("7", "8", "seven", "")
]


@pytest.mark.parametrize("mode", ["scores", "ranking"])
def test_one_call_judges_the_whole_group_in_the_schema(served, monkeypatch, mode) -> None:
    calls = []
    real = group_judge.chat_complete

    async def counted(address, request, **kwargs):
        calls.append(request)
        return await real(address, request, **kwargs)

    monkeypatch.setattr(group_judge, "chat_complete", counted)
    judge = GroupJudge(served.server.url, mode=mode, api_key=API_KEY)
    first = asyncio.run(judge.score_group(GROUP))
    again = asyncio.run(judge.score_group(GROUP))
    assert len(calls) == 2  # one call per group, never one per answer
    assert all(r.error is None for r in first), [r.error for r in first]
    rewards = [r.score for r in first]
    assert rewards == [r.score for r in again]  # temperature 0: the same judgement
    if mode == "ranking":
        assert sorted(rewards) == pytest.approx([0.0, 1 / 3, 2 / 3, 1.0])
    else:
        assert all(r in [i / 10 for i in range(11)] for r in rewards)


def test_a_run_trains_on_the_group_judges_scores_in_async_mode(served, tmp_path: Path) -> None:
    config = load_config(
        None,
        [
            f"output_dir={tmp_path}",
            "model.tiny={hidden_size: 64, num_layers: 1, num_heads: 1, seed: 0}",
            "warm_start.steps=0",
            "trainer.mode=async",
            "trainer.steps=2",
            "trainer.prompts_per_step=2",
            "algorithm.group_size=2",
            "eval.num_problems=2",
            "logging.console_every=1",
            "reward_loop.group_judge={mode: ranking}",
            f"reward_loop.router.address={served.server.url}",
            f"reward_loop.router.api_key={API_KEY}",
        ],
    )
    run_dir = jobs.train(config)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in records if r["phase"] == "rl"]
    assert [r["step"] for r in rl] == [1, 2]
    for record in rl:
        assert record["batch/reward_loop/errors"] == 0
        # a ranking of two gives 1 and 0: every group's mean is 0.5
        assert record["batch/reward_loop/score_mean"] == pytest.approx(0.5)
