"""A generative reward model against the session's real vLLM CPU server: the tiny random
model will not write "Score: 7" by itself, so structured outputs (a regex) force the
judgement's format; the generation, the chat-completions call and the parsing are real."""

from __future__ import annotations

import asyncio
import re

import pytest
from tests.vllm.helpers import API_KEY

from ludic.rewards import (
    GenRMJudge,
    RewardSample,
    chat_complete,
    make_reward_manager,
    parse_judgement,
)

pytestmark = pytest.mark.vllm

JUDGEMENT = "Score: [0-9]"


def test_chat_complete_with_a_forced_judgement_parses(served) -> None:
    reply = asyncio.run(
        chat_complete(
            served.server.url,
            {
                "messages": [{"role": "user", "content": "Rate 2+2=4."}],
                "temperature": 1.0,
                "max_tokens": 12,
                "seed": 3,
                "structured_outputs": {"regex": JUDGEMENT},
            },
            api_key=API_KEY,
        )
    )
    text = reply["choices"][0]["message"]["content"]
    assert re.fullmatch(JUDGEMENT, text), text
    assert parse_judgement(text) == int(text[-1]) / 10


def test_a_genrm_judge_scores_samples_in_a_reward_loop(served) -> None:
    judge = GenRMJudge(
        served.server.url,
        api_key=API_KEY,
        sampling={"temperature": 1.0, "max_tokens": 12, "structured_outputs": {"regex": JUDGEMENT}},
    )
    manager = make_reward_manager("naive", compute_score=judge, timeout_s=60)
    samples = [
        RewardSample("arith", f"{i + i}", str(2 * i), {"question": f"{i}+{i}="}, sample_id=str(i))
        for i in range(6)
    ]

    async def score_all():
        return await asyncio.gather(*(manager.run_single(s) for s in samples))

    results = asyncio.run(score_all())
    assert all(r.ok for r in results), [r.error for r in results]
    assert all(r.score in {d / 10 for d in range(10)} for r in results)


def test_an_unreadable_judgement_is_a_recorded_failure(served) -> None:
    judge = GenRMJudge(
        served.server.url,
        api_key=API_KEY,
        sampling={"max_tokens": 4, "structured_outputs": {"regex": "[a-z]{4}"}},
    )
    manager = make_reward_manager("naive", compute_score=judge, on_error=-1.0)
    result = asyncio.run(manager.run_single(RewardSample("x", "4", "4", {"question": "2+2"})))
    assert result.score == -1.0 and "no judgement matching" in result.error
