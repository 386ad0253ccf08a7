"""``RewardLoop`` on a real rollout engine (scripted model): in standalone mode a sample is
scored as soon as its episode ends, while other episodes still run; in colocate mode only
after the whole batch; at most ``num_workers`` at once; results and failures land in
``rollout.meta["reward_loop"]`` and the batch metrics."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import pytest

from ludic.agents import Agent
from ludic.context import FullDialog
from ludic.envs import DatasetQAEnv
from ludic.inference import HFChatTemplate
from ludic.inference.scripted_client import ScriptedChatClient
from ludic.interaction import SingleAgentProtocol
from ludic.parsers import ParseResult
from ludic.rewards import (
    REWARD_KEY,
    RewardLoop,
    RewardLoopError,
    make_reward_manager,
    reward_loop_metrics,
)
from ludic.training import EnvSpec, ProtocolSpec, RolloutEngine, RolloutRequest

SAMPLES = [{"question": f"{i}+{i}=", "answer": str(2 * i)} for i in range(6)]


class GatedClient:
    """The scripted model, except that the answer to question 1 waits for ``gate`` (at
    most ``patience`` seconds): episode 1 ends only once something opens it."""

    def __init__(self, tokenizer, gate: asyncio.Event, patience: float) -> None:
        self.inner = ScriptedChatClient(
            tokenizer, lambda req, prompt: "2" if "1+1" in prompt else "0"
        )
        self.gate, self.patience = gate, patience

    async def complete(self, request):
        response = await self.inner.complete(request)
        if "1+1" in self.inner.prompts[-1]:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.gate.wait(), self.patience)
        return response


def _engine(client, tokenizer, loop: RewardLoop) -> RolloutEngine:
    def protocol() -> SingleAgentProtocol:
        agent = Agent(
            client=client,
            context=FullDialog(),
            parser=lambda text: ParseResult(action=text.strip()),
            chat_template=HFChatTemplate(tokenizer),
        )
        return SingleAgentProtocol(agent)

    return RolloutEngine(
        {"qa": lambda: DatasetQAEnv(SAMPLES)}, {"single": protocol}, on_episode=[loop.on_episode]
    )


def _requests(n: int) -> list[RolloutRequest]:
    return [RolloutRequest(EnvSpec("qa"), ProtocolSpec("single"), env_seed=i) for i in range(n)]


def _run(mode: str, tiny_tokenizer, *, num_workers: int = 4, patience: float = 5.0):
    events: list[str] = []
    in_flight, most = [0], [0]

    async def scorer(data_source, solution_str, ground_truth, extra_info):
        question = extra_info["question"]
        events.append(f"score {question}")
        gate.set()  # scoring has started: question 1's model call may return now
        in_flight[0] += 1
        most[0] = max(most[0], in_flight[0])
        await asyncio.sleep(0.01)
        in_flight[0] -= 1
        if question.startswith("3+3"):
            raise RuntimeError("judge unavailable")
        return {"score": float(solution_str.strip() == ground_truth), "judged": 1}

    loop = RewardLoop(
        make_reward_manager("naive", compute_score=scorer), mode=mode, num_workers=num_workers
    )
    gate = asyncio.Event()

    async def main():
        nonlocal gate
        gate = asyncio.Event()
        engine = _engine(GatedClient(tiny_tokenizer, gate, patience), tiny_tokenizer, loop)
        engine.on_episode = (
            lambda rs: events.extend(f"end {r.initial_obs}" for r in rs),
            *engine.on_episode,
        )
        rollouts = await engine.generate_rollouts(_requests(6))
        await loop(rollouts)
        return rollouts

    return asyncio.run(main()), events, most[0]


def test_standalone_scores_each_sample_while_other_episodes_run(tiny_tokenizer) -> None:
    rollouts, events, _ = _run("standalone", tiny_tokenizer)
    # episode 1 could only end after some sample's scoring had started
    first_score = next(i for i, e in enumerate(events) if e.startswith("score"))
    assert first_score < events.index("end 1+1=")
    results = {r.initial_obs: r.meta[REWARD_KEY] for r in rollouts}
    assert results["1+1="] == {"score": 1.0, "metrics": {"judged": 1.0}, "error": None}
    assert results["2+2="]["score"] == 0.0
    assert results["3+3="]["score"] is None and "judge unavailable" in results["3+3="]["error"]
    metrics = reward_loop_metrics(rollouts)
    assert metrics["reward_loop/errors"] == 1 and metrics["reward_loop/dropped"] == 1
    assert metrics["reward_loop/score_mean"] == pytest.approx(2 / 5)  # "0+0=" and "1+1="
    assert metrics["reward_loop/judged"] == 1.0


def test_colocate_scores_only_after_the_batch(tiny_tokenizer) -> None:
    rollouts, events, _ = _run("colocate", tiny_tokenizer, patience=0.3)
    ends = [i for i, e in enumerate(events) if e.startswith("end")]
    scores = [i for i, e in enumerate(events) if e.startswith("score")]
    assert len(ends) == len(scores) == 6 and max(ends) < min(scores)
    assert all(REWARD_KEY in r.meta for r in rollouts)


@pytest.mark.parametrize("mode", ["standalone", "colocate"])
def test_at_most_num_workers_score_at_once(tiny_tokenizer, mode) -> None:
    _, _, most = _run(mode, tiny_tokenizer, num_workers=2, patience=0.3)
    assert most == 2


def test_bad_settings_are_refused() -> None:
    manager = make_reward_manager("naive")
    with pytest.raises(ValueError, match="mode='async'"):
        RewardLoop(manager, mode="async")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_workers=0"):
        RewardLoop(manager, num_workers=0)
    with pytest.raises(ValueError, match="max_failure_fraction=1.5"):
        RewardLoop(manager, max_failure_fraction=1.5)


def _score_batches(tiny_tokenizer, scorer, batches: int = 1, **loop_kwargs) -> RewardLoop:
    """``batches`` batches of the 6 questions (the scripted model answers "0"), each scored
    by ``scorer`` through a colocate loop; returns the loop."""
    loop = RewardLoop(
        make_reward_manager("naive", compute_score=scorer), mode="colocate", **loop_kwargs
    )
    client = ScriptedChatClient(tiny_tokenizer, lambda req, prompt: "0")

    async def main() -> None:
        engine = _engine(client, tiny_tokenizer, loop)
        for _ in range(batches):
            await loop(await engine.generate_rollouts(_requests(6)))

    asyncio.run(main())
    return loop


def test_a_batch_mostly_failing_to_score_stops_with_the_first_error_and_its_sample(
    tiny_tokenizer,
) -> None:
    def nan_for_most(data_source, solution_str, ground_truth, extra_info):
        return float("nan") if int(ground_truth) >= 4 else 1.0  # questions 2+2 .. 5+5

    with pytest.raises(RewardLoopError) as err:
        _score_batches(tiny_tokenizer, nan_for_most)
    text = str(err.value)
    assert "4 of 6 samples of a batch failed to score" in text
    assert "more than max_failure_fraction=0.5 allows" in text
    assert "nan" in text.lower() and "ground_truth='4'" in text and "solution_str='0'" in text


def test_a_few_failures_are_printed_once_per_kind_and_counted(tiny_tokenizer, caplog) -> None:
    def fails_on_zero(data_source, solution_str, ground_truth, extra_info):
        if ground_truth == "0":
            raise RuntimeError("judge unavailable")
        return 0.0

    with caplog.at_level(logging.WARNING, logger="ludic.rewards.loop"):
        loop = _score_batches(tiny_tokenizer, fails_on_zero, batches=3)
    assert loop.failures == 3  # one sample of each of the three batches
    warnings = [r.getMessage() for r in caplog.records if "failed to score" in r.getMessage()]
    assert len(warnings) == 1 and "1 of 6 samples" in warnings[0], warnings
    assert "judge unavailable" in warnings[0]
    # with max_failure_fraction=0, any failure stops the run
    with pytest.raises(RewardLoopError, match="1 of 6 samples"):
        _score_batches(tiny_tokenizer, fails_on_zero, max_failure_fraction=0.0)


class RecordingServers:
    """A fake ``ScoringServers`` (the real ones need vLLM's sleep mode, CUDA only): records
    when the loop wakes and puts them to sleep, next to the scorer's calls."""

    def __init__(self, events: list[str]) -> None:
        self.events = events

    async def wake(self) -> None:
        self.events.append("wake")

    async def sleep(self) -> None:
        self.events.append("sleep")


def test_colocate_wakes_its_servers_for_each_batchs_scoring_only(tiny_tokenizer) -> None:
    events: list[str] = []

    async def scorer(data_source, solution_str, ground_truth, extra_info):
        events.append("score")
        return 0.0

    _score_batches(tiny_tokenizer, scorer, batches=2, servers=RecordingServers(events))
    assert events == ["wake", *["score"] * 6, "sleep"] * 2

    class BrokenManager:  # the scoring itself breaks (not a sample's failure)
        async def run_single(self, sample):
            events.append("score")
            raise RuntimeError("the reward manager broke")

    events.clear()
    loop = RewardLoop(BrokenManager(), mode="colocate", servers=RecordingServers(events))
    client = ScriptedChatClient(tiny_tokenizer, lambda req, prompt: "0")

    async def main() -> None:
        rollouts = await _engine(client, tiny_tokenizer, loop).generate_rollouts(_requests(2))
        await loop(rollouts)

    with pytest.raises(RuntimeError, match="the reward manager broke"):
        asyncio.run(main())
    assert events[0] == "wake" and events[-1] == "sleep"  # asleep again all the same
    with pytest.raises(ValueError, match="servers that sleep between batches need mode='colo"):
        RewardLoop(make_reward_manager("naive"), servers=RecordingServers(events))
