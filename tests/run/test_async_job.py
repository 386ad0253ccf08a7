"""``ludic train`` with ``trainer.mode: async``: staleness bounded at every step, on-policy
when max_staleness is 0, and config combinations that cannot work fail naming the fields."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.run.test_job import _config, _records

from ludic import jobs
from ludic.run.builders import RunError
from ludic.run.loading import ConfigError


def test_async_run_trains_every_step_within_max_staleness(tmp_path: Path) -> None:
    run_dir = jobs.train(
        _config(tmp_path, "trainer.mode=async", "trainer.max_staleness=2", "trainer.steps=6")
    )
    rl = _records(run_dir, "rl")
    assert [r["step"] for r in rl] == [1, 2, 3, 4, 5, 6]
    for r in rl:
        assert 0 <= r["staleness/max"] <= 2 and r["dropped/stale"] == 0
        assert r["policy_version"] == r["step"]
    assert max(r["staleness/max"] for r in rl) >= 1  # generation did run ahead
    assert (run_dir / "checkpoints" / "rl" / "step_00000006").is_dir()


def test_async_with_zero_staleness_is_the_sync_run(tmp_path: Path) -> None:
    sync = _records(jobs.train(_config(tmp_path / "sync")), "rl")
    on_policy = _records(
        jobs.train(_config(tmp_path / "async", "trainer.mode=async", "trainer.max_staleness=0")),
        "rl",
    )
    assert [r["staleness/max"] for r in on_policy] == [0, 0, 0, 0]
    assert [r["reward_mean"] for r in on_policy] == pytest.approx([r["reward_mean"] for r in sync])
    assert [r["loss"] for r in on_policy] == pytest.approx([r["loss"] for r in sync], abs=1e-5)


def test_max_staleness_without_async_mode_names_both_fields(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"max_staleness=1 is for mode: async"):
        _config(tmp_path, "trainer.max_staleness=1")


def test_staleness_below_the_publish_interval_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"max_staleness=0 < publish_every - 1 = 1"):
        _config(
            tmp_path, "trainer.mode=async", "trainer.max_staleness=0", "trainer.publish_every=2"
        )


def test_keeping_multi_version_items_needs_a_correcting_loss(tmp_path: Path) -> None:
    config = _config(tmp_path, "trainer.max_version_span=0", "trainer.version_span=correct")
    with pytest.raises(RunError, match=r"trainer.version_span=correct .* algorithm.name='grpo'"):
        jobs.train(config)


def test_decoupled_grpo_runs_async_with_several_updates_per_batch(tmp_path: Path) -> None:
    config = _config(
        tmp_path,
        "algorithm.name=decoupled_grpo",
        "trainer.mode=async",
        "trainer.max_staleness=1",
        "trainer.ppo_epochs=2",
        "trainer.num_minibatches=2",
        "trainer.max_version_span=0",
        "trainer.version_span=correct",
    )
    rl = _records(jobs.train(config), "rl")
    assert [r["num_updates"] for r in rl] == [4, 4, 4, 4]
    assert all(0 < r["loss/behaviour_weight_mean"] < 5 for r in rl)
