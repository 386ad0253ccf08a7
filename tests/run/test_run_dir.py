"""A start that fails (the model does not load) removes the run directory it created,
unless the run already holds results; a resumed run's directory is always kept."""

from __future__ import annotations

import pytest

from ludic.run.run_dir import RunDirectory, removed_if_start_fails


def _failed_start(run: RunDirectory, *, created: bool) -> None:
    with pytest.raises(OSError), removed_if_start_fails(run, created=created):
        (run.path / "config.yaml").write_text("name: x\n")
        raise OSError("the model does not load")


def test_a_failed_start_removes_the_run_directory_it_created(tmp_path) -> None:
    run = RunDirectory.create(tmp_path, "run")
    _failed_start(run, created=True)
    assert not run.path.exists()


def test_a_run_directory_with_a_checkpoint_or_metrics_is_kept(tmp_path) -> None:
    with_checkpoint = RunDirectory.create(tmp_path, "a")
    (with_checkpoint.checkpoint_dir("rl") / "step_00000001").mkdir(parents=True)
    with_metrics = RunDirectory.create(tmp_path, "b")
    with_metrics.append_metrics({"phase": "rl", "step": 1})
    for run in (with_checkpoint, with_metrics):
        _failed_start(run, created=True)
        assert run.path.is_dir()


def test_a_resumed_run_directory_is_kept(tmp_path) -> None:
    run = RunDirectory.create(tmp_path, "run")
    _failed_start(run, created=False)
    assert run.path.is_dir()
