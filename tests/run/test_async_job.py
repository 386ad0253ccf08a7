"""``ludic train`` with ``trainer.mode: async``: staleness bounded at every step, on-policy
when max_staleness is 0, and config combinations that cannot work fail naming the fields."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tests.run.test_job import _config, _records

from ludic import jobs
from ludic.run.builders import rl_sample_filter, rl_trainer_config
from ludic.run.loading import ConfigError
from ludic.run.phases import LEDGER_PHASE
from ludic.training.types import SAWItem


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
    # the ledger settled at the end: what was made ahead and discarded is aborted, and
    # summary.json has the settled figures
    (settled,) = _records(run_dir, LEDGER_PHASE)
    ledger = json.loads((run_dir / "summary.json").read_text())["token_ledger"]
    assert ledger == {k[len("tokens/") :]: v for k, v in settled.items() if "/" in k}
    assert ledger["in_flight"] == 0 and ledger["aborted"] >= rl[-1]["tokens/in_flight"]
    assert ledger["generated"] == sum(v for k, v in ledger.items() if k != "generated")


def test_async_with_zero_staleness_is_the_sync_run(tmp_path: Path) -> None:
    sync = _records(jobs.train(_config(tmp_path / "sync")), "rl")
    on_policy = _records(
        jobs.train(_config(tmp_path / "async", "trainer.mode=async", "trainer.max_staleness=0")),
        "rl",
    )
    assert [r["staleness/max"] for r in on_policy] == [0, 0, 0, 0]
    assert [r["reward_mean"] for r in on_policy] == pytest.approx([r["reward_mean"] for r in sync])
    assert [r["loss"] for r in on_policy] == pytest.approx([r["loss"] for r in sync], abs=1e-5)


def test_max_staleness_bounds_the_trainer_in_sync_mode_too(tmp_path: Path) -> None:
    config = _config(tmp_path, "trainer.max_staleness=1")
    assert rl_trainer_config(config, pad_token_id=0).max_staleness == 1


@pytest.mark.parametrize(
    ("override", "names"),
    [
        ("trainer.max_lag=1", "max_lag was removed; use trainer.max_staleness"),
        ("trainer.version_span=correct", "version_span was removed; trainer.max_version_span"),
    ],
)
def test_old_staleness_names_are_refused_naming_the_new_ones(
    tmp_path: Path, override: str, names: str
) -> None:
    with pytest.raises(ConfigError, match=names):
        _config(tmp_path, override)


def test_a_config_saved_with_the_old_names_off_still_loads(tmp_path: Path) -> None:
    config = _config(tmp_path, "trainer.max_lag=null", "trainer.version_span=drop")
    assert config.trainer.max_staleness is None and config.trainer.max_version_span is None


def test_staleness_below_the_publish_interval_is_refused(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError, match=r"max_staleness=0 is invalid; expected >= publish_every - 1 = 1"
    ):
        _config(
            tmp_path, "trainer.mode=async", "trainer.max_staleness=0", "trainer.publish_every=2"
        )


def test_decoupled_grpo_runs_async_with_several_updates_per_batch(tmp_path: Path) -> None:
    config = _config(
        tmp_path,
        "algorithm.name=decoupled_grpo",
        "trainer.mode=async",
        "trainer.max_staleness=1",
        "trainer.ppo_epochs=2",
        "trainer.num_minibatches=2",  # max_version_span null: items kept and corrected
    )
    rl = _records(jobs.train(config), "rl")
    assert [r["num_updates"] for r in rl] == [4, 4, 4, 4]
    assert all(0 < r["loss/behaviour_weight_mean"] < 5 for r in rl)


def test_the_span_limit_applies_with_a_correcting_algorithm_too(tmp_path: Path) -> None:
    """max_version_span drops items straddling more updates, whatever the algorithm: a
    decoupled loss corrects the items it keeps, it does not override the limit."""
    config = _config(tmp_path, "algorithm.name=decoupled_grpo", "trainer.max_version_span=0")
    keep = rl_sample_filter(config)
    assert keep is not None
    one = SAWItem((1, 2, 3), (0, 1, 1), 1.0, action_versions=(4, 4))
    straddling = SAWItem((1, 2, 3), (0, 1, 1), 1.0, action_versions=(4, 5))
    no_pause = SAWItem((1, 2, 3), (0, 1, 1), 1.0, policy_version=4, version_end=5)
    assert [keep(one), keep(straddling), keep(no_pause)] == [True, False, False]
    assert rl_sample_filter(_config(tmp_path, "algorithm.name=decoupled_grpo")) is None
