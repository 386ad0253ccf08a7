"""GRPORequestStrategy: group expansion of logical requests."""

from __future__ import annotations

import pytest

from ludic.inference.request import InferenceSpec, SamplingSpec
from ludic.rollouts.requests import EnvSpec, ProtocolSpec, RolloutRequest
from ludic.rollouts.strategies import GRPORequestStrategy, RequestStrategy


def req(env_seed=None, seed=None, n=1, meta=None):
    return RolloutRequest(
        env=EnvSpec("e"),
        protocol=ProtocolSpec("p"),
        env_seed=env_seed,
        inference=InferenceSpec(sampling=SamplingSpec(seed=seed, temperature=0.7)),
        num_episodes=n,
        meta=meta or {},
    )


def groups(expanded):
    out = {}
    for r in expanded:
        out.setdefault(r.meta["group_id"], []).append(r)
    return list(out.values())


def test_each_request_becomes_a_group_with_one_env_seed_and_distinct_sampling_seeds():
    expanded = GRPORequestStrategy(4).expand([req(env_seed=11, seed=100), req(env_seed=12)])
    assert len(expanded) == 8
    gs = groups(expanded)
    assert len(gs) == 2
    for g, env_seed in zip(gs, (11, 12)):
        assert [r.env_seed for r in g] == [env_seed] * 4
        seeds = [r.inference.sampling.seed for r in g]
        assert len(set(seeds)) == 4 and None not in seeds
        assert [r.meta["group_index"] for r in g] == [0, 1, 2, 3]
        assert all(r.meta["group_size"] == 4 and r.num_episodes == 1 for r in g)
        assert all(r.inference.sampling.temperature == 0.7 for r in g)
    assert [r.inference.sampling.seed for r in gs[0]] == [100, 101, 102, 103]


def test_unseeded_request_draws_one_env_seed_shared_by_the_whole_group():
    expanded = GRPORequestStrategy(3).expand([req(), req()])
    a, b = groups(expanded)
    assert len({r.env_seed for r in a}) == 1 and a[0].env_seed is not None
    assert len({r.env_seed for r in b}) == 1 and b[0].env_seed is not None


def test_drawn_seeds_are_reproducible_for_the_same_strategy_seed():
    def seeds(strategy):
        return [(r.env_seed, r.inference.sampling.seed) for r in strategy.expand([req(), req()])]

    assert seeds(GRPORequestStrategy(2, seed=7)) == seeds(GRPORequestStrategy(2, seed=7))
    assert seeds(GRPORequestStrategy(2, seed=7)) != seeds(GRPORequestStrategy(2, seed=8))


def test_num_episodes_makes_separate_groups_with_disjoint_sampling_seeds():
    expanded = GRPORequestStrategy(2).expand([req(env_seed=1, seed=0, n=3)])
    gs = groups(expanded)
    assert len(gs) == 3
    seeds = [r.inference.sampling.seed for r in expanded]
    assert seeds == [0, 1, 2, 3, 4, 5]


def test_request_meta_is_kept_and_group_ids_are_fresh_per_call():
    s = GRPORequestStrategy(2)
    first = s.expand([req(env_seed=1, meta={"task": "add"})])
    second = s.expand([req(env_seed=1, meta={"task": "add"})])
    assert all(r.meta["task"] == "add" for r in first + second)
    assert first[0].meta["group_id"] != second[0].meta["group_id"]


def test_group_size_below_one_is_rejected():
    with pytest.raises(ValueError, match="group_size must be >= 1, got 0"):
        GRPORequestStrategy(0)


def test_strategy_satisfies_request_strategy_protocol():
    assert isinstance(GRPORequestStrategy(2), RequestStrategy)
