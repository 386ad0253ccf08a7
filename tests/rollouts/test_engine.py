"""RolloutEngine: concurrency, ordering, meta, errors, JSONL log."""

from __future__ import annotations

import asyncio

import pytest

from ludic.inference.request import InferenceSpec, SamplingSpec
from ludic.rollouts.engine import RolloutEngine, UnknownKindError
from ludic.rollouts.requests import EnvSpec, ProtocolSpec, RolloutRequest
from ludic.training.batching.offline import read_rollouts_jsonl
from ludic.types import rollout_to_dict


def make_engine(fakes, tracker=None, **kw):
    tracker = tracker or fakes.Tracker()
    return RolloutEngine(
        {"fake": fakes.FakeEnv},
        {"fake": lambda **k: fakes.FakeProtocol(tracker=tracker, **k)},
        **kw,
    )


def request(*, delay=0.0, env_seed=None, seed=None, n=1, meta=None, **protocol_kwargs):
    return RolloutRequest(
        env=EnvSpec("fake"),
        protocol=ProtocolSpec("fake", {"delay": delay, **protocol_kwargs}),
        env_seed=env_seed,
        inference=InferenceSpec(sampling=SamplingSpec(seed=seed)),
        num_episodes=n,
        meta=meta or {},
    )


def test_episodes_run_concurrently_up_to_max_concurrency(fakes):
    tracker = fakes.Tracker()
    engine = make_engine(fakes, tracker, max_concurrency=3)
    rollouts = asyncio.run(engine.generate_rollouts([request(delay=0.02, n=8)]))
    assert len(rollouts) == 8
    assert tracker.max_running == 3


def test_rollouts_come_back_in_request_then_episode_order(fakes):
    engine = make_engine(fakes)
    # later requests finish first
    reqs = [request(delay=0.03, env_seed=0, n=2), request(delay=0.0, env_seed=1, n=2)]
    rollouts = asyncio.run(engine.generate_rollouts(reqs))
    assert [(r.meta["request_index"], r.meta["episode_index"]) for r in rollouts] == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
    ]
    assert [r.initial_obs for r in rollouts] == ["problem 0"] * 2 + ["problem 1"] * 2


def test_request_meta_kinds_and_seeds_are_copied_into_rollouts(fakes):
    engine = make_engine(fakes)
    reqs = [request(env_seed=5, seed=10, n=3, meta={"group_id": "g", "tag": "x"})]
    rollouts = asyncio.run(engine.generate_rollouts(reqs))
    for e, r in enumerate(rollouts):
        assert r.meta["group_id"] == "g"
        assert r.meta["tag"] == "x"
        assert r.meta["env_kind"] == "fake"
        assert r.meta["protocol_kind"] == "fake"
        assert r.meta["env_seed"] == 5
        assert r.meta["sampling_seed"] == 10 + e
        assert r.meta["seen_sampling_seed"] == 10 + e  # what the protocol received
        assert r.meta["episode_index"] == e
    assert fakes.FakeEnv.closed == [5, 5, 5]


def test_unseeded_request_passes_no_sampling_seed(fakes):
    rollouts = asyncio.run(make_engine(fakes).generate_rollouts([request(n=2)]))
    assert [r.meta["sampling_seed"] for r in rollouts] == [None, None]
    assert [r.meta["seen_sampling_seed"] for r in rollouts] == [None, None]


def test_unknown_kind_lists_registered_names_before_running_anything(fakes):
    tracker = fakes.Tracker()
    engine = make_engine(fakes, tracker)
    bad = RolloutRequest(env=EnvSpec("nope"), protocol=ProtocolSpec("fake"))
    with pytest.raises(UnknownKindError, match=r"unknown env kind 'nope'; registered: \['fake'\]"):
        asyncio.run(engine.generate_rollouts([request(), bad]))
    assert tracker.started == 0
    bad_protocol = RolloutRequest(env=EnvSpec("fake"), protocol=ProtocolSpec("nah"))
    with pytest.raises(KeyError, match="unknown protocol kind 'nah'"):
        asyncio.run(engine.generate_rollouts([bad_protocol]))


def test_slow_episode_raises_timeout_naming_the_request(fakes):
    engine = make_engine(fakes, timeout_s=0.05)
    reqs = [request(), request(delay=10.0, env_seed=3)]
    with pytest.raises(TimeoutError, match=r"episode 0 of request 1 .*env_seed=3.*timeout_s=0.05"):
        asyncio.run(asyncio.wait_for(engine.generate_rollouts(reqs), 5.0))
    assert 3 in fakes.FakeEnv.closed


def test_protocol_own_timeout_error_is_not_relabelled(fakes):
    engine = make_engine(fakes, timeout_s=5.0)
    with pytest.raises(TimeoutError, match="backend timed out"):
        asyncio.run(engine.generate_rollouts([request(error=TimeoutError("backend timed out"))]))


def test_failing_episode_cancels_the_others_and_raises(fakes):
    tracker = fakes.Tracker()
    engine = make_engine(fakes, tracker)
    reqs = [request(delay=10.0), request(error=RuntimeError("boom"))]
    with pytest.raises(RuntimeError, match="boom"):
        asyncio.run(asyncio.wait_for(engine.generate_rollouts(reqs), 5.0))
    assert tracker.running == 0


def test_jsonl_log_writes_one_line_per_rollout_that_roundtrips(fakes, tmp_path):
    path = tmp_path / "logs" / "rollouts.jsonl"
    engine = make_engine(fakes, jsonl_path=path)
    rollouts = asyncio.run(engine.generate_rollouts([request(env_seed=1, n=3)]))
    assert len(path.read_text().splitlines()) == 3
    loaded = read_rollouts_jsonl(path)
    by_id = {r.id: r for r in loaded}
    assert {r.id for r in rollouts} == set(by_id)
    for r in rollouts:
        assert rollout_to_dict(by_id[r.id]) == rollout_to_dict(r)
        assert by_id[r.id].agent_steps[0].trace == r.agent_steps[0].trace


def test_constructor_rejects_nonpositive_concurrency_and_timeout(fakes):
    with pytest.raises(ValueError, match="max_concurrency must be >= 1, got 0"):
        RolloutEngine({}, {}, max_concurrency=0)
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        RolloutEngine({}, {}, timeout_s=0)
