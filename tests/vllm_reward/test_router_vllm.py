"""The reward router over real vLLM CPU servers: two reward servers (the session's and
one more, synced to its weights) behind one address both take work and score like a
server asked directly; one killed with SIGKILL mid-run
loses no sample; DisRM scoring and a GenRM judge (the session's policy server) behind one
router address, routed by path."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest
from tests.vllm.helpers import API_KEY  # the session policy server's key: one for all

pytest.importorskip("vllm", reason="vLLM is not installed")

from ludic.inference.reward_client import format_reward_input  # noqa: E402
from ludic.inference.router import start_router  # noqa: E402
from ludic.inference.vllm.process import start_vllm_server  # noqa: E402
from ludic.inference.vllm.reward_client import VLLMRewardClient  # noqa: E402
from ludic.rewards import (  # noqa: E402
    DisRMScore,
    GenRMJudge,
    RewardSample,
    WeightedReward,
    make_reward_manager,
)

AUTH = {"Authorization": f"Bearer {API_KEY}"}
TEXTS = [f"Question: {i}+{i % 7}=\nAnswer: {2 * i}" for i in range(40)]


@pytest.fixture(scope="module")
def two_reward_servers(tmp_path_factory: pytest.TempPathFactory, served_reward):
    """The session's reward server (a) and one more (b, this module's: the one killed),
    b synced to a's weights (``served_reward.mirror``), so both score alike."""
    from ludic.models.tiny import save_tiny_reward_model

    root = tmp_path_factory.mktemp("router_vllm")
    model_dir = save_tiny_reward_model(root / "model")
    b = start_vllm_server(model_dir, kind="reward", api_key=API_KEY, log_path=root / "b.log")
    try:
        with VLLMRewardClient(b.url, api_key=API_KEY, timeout_s=60) as client:
            client.init_weight_sync(master_port=b.group_port)
            client.sync_weights(served_reward.mirror.state_dict(), training_mode="full")
        yield [served_reward.server, b]
    finally:
        b.stop()


def direct_scores(url: str, texts: list[str]) -> list[float]:
    reply = httpx.post(
        f"{url}/score", json={"input": texts, "normalize": False}, headers=AUTH, timeout=120
    )
    assert reply.status_code == 200, reply.text
    return [d["score"] for d in reply.json()["data"]]


def backends(router_url: str) -> dict[str, dict]:
    reply = httpx.get(f"{router_url}/router/backends", headers=AUTH, timeout=10).json()
    return {b["url"]: b for b in reply["backends"]}


async def score_each(manager, texts: list[str]) -> list:
    samples = [
        RewardSample("x", text, None, {"question": ""}, sample_id=str(i))
        for i, text in enumerate(texts)
    ]
    return await asyncio.gather(*(manager.run_single(s) for s in samples))


def test_both_reward_servers_take_work_and_score_as_asked_directly(two_reward_servers) -> None:
    a, b = two_reward_servers
    expected = direct_scores(a.url, TEXTS)
    with start_router([a.url, b.url], api_key=API_KEY) as router:
        client = VLLMRewardClient(router.url, api_key=API_KEY, timeout_s=120)

        async def run() -> list[float]:
            parts = await asyncio.gather(*(client.score_batch([t], normalize=False) for t in TEXTS))
            await client.aclose()
            return [p[0] for p in parts]

        scores = asyncio.run(run())
        assert scores == pytest.approx(expected, abs=1e-4)
        state = backends(router.url)
        assert state[a.url]["served"] > 5 and state[b.url]["served"] > 5
        assert state[a.url]["served"] + state[b.url]["served"] == len(TEXTS)
        assert all(s["in_flight"] == 0 for s in state.values())


def wait_all_healthy(router_url: str, timeout_s: float = 60) -> dict[str, dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        state = backends(router_url)
        if all(s["healthy"] for s in state.values()) or time.monotonic() > deadline:
            return state
        time.sleep(0.1)


async def score_and_kill_mid_run(manager, router_url: str, victim) -> tuple[list, dict]:
    """Score every text; SIGKILL ``victim`` the moment the router has a request in flight
    on it, once some sample is scored, so the kill lands mid-run, with work on the victim,
    whatever the machine's pace (one server can be much faster than the other: prefix
    caching, CPU contention).
    Returns the results and the router's view of the victim at the kill (None: never)."""
    scoring = asyncio.ensure_future(score_each(manager, TEXTS))
    at_kill = None
    async with httpx.AsyncClient(headers=AUTH, timeout=10) as http:
        while not scoring.done():
            reply = await http.get(f"{router_url}/router/backends")
            states = {b["url"]: b for b in reply.json()["backends"]}
            state = states[victim.url]
            if state["in_flight"] >= 1 and sum(s["served"] for s in states.values()) >= 2:
                os.killpg(victim.pid, signal.SIGKILL)
                at_kill = state
                break
            await asyncio.sleep(0.01)
    return await scoring, at_kill


def test_a_reward_server_killed_mid_run_loses_no_sample(two_reward_servers) -> None:
    a, b = two_reward_servers
    expected = direct_scores(a.url, [format_reward_input("", t) for t in TEXTS])
    with start_router([a.url, b.url], api_key=API_KEY, health_interval_s=0.5) as router:
        before = wait_all_healthy(router.url)
        assert all(s["healthy"] for s in before.values()), before
        client = VLLMRewardClient(router.url, api_key=API_KEY, timeout_s=120)
        manager = make_reward_manager(
            "rate_limited", compute_score=DisRMScore(client), max_concurrency=4
        )
        started = time.monotonic()
        results, at_kill = asyncio.run(score_and_kill_mid_run(manager, router.url, b))
        elapsed = time.monotonic() - started
        state = backends(router.url)
        assert at_kill is not None, f"the run ended before b took work: {state}"
        assert b.process.wait(10) is not None
        assert [r.error for r in results] == [None] * len(TEXTS)
        assert [r.score for r in results] == pytest.approx(expected, abs=1e-4)
        assert elapsed < 90, f"scoring took {elapsed:.0f}s after a kill"
        assert not state[b.url]["healthy"]
        assert state[a.url]["served"] + state[b.url]["served"] == len(TEXTS)
        assert state[b.url]["served"] < len(TEXTS)
        assert all(s["in_flight"] == 0 for s in state.values())


def test_disrm_and_genrm_behind_one_router_address(two_reward_servers, served) -> None:
    a, _ = two_reward_servers
    policy = served.server
    with start_router([a.url, policy.url], api_key=API_KEY) as router:
        judge = GenRMJudge(
            api_key=API_KEY,
            sampling={
                "temperature": 1.0,
                "max_tokens": 12,
                "structured_outputs": {"regex": "Score: [0-9]"},
            },
        )
        disrm = DisRMScore(VLLMRewardClient(router.url, api_key=API_KEY, timeout_s=120))
        hybrid = WeightedReward(
            {"rule": (lambda *args: 1.0, 0.5), "disrm": (disrm, 0.3), "genrm": (judge, 0.2)}
        )
        manager = make_reward_manager(
            "naive", compute_score=hybrid, function_kwargs={"reward_router_address": router.url}
        )
        results = asyncio.run(score_each(manager, TEXTS[:6]))
        for result in results:
            assert result.error is None, result.error
            m = result.metrics
            assert 0.0 <= m["genrm"] <= 0.9 and m["rule"] == 1.0
            assert result.score == pytest.approx(0.5 + 0.3 * m["disrm"] + 0.2 * m["genrm"])
        state = backends(router.url)
        assert state[a.url]["served"] == 6 and state[policy.url]["served"] >= 6
