"""Issue 9, "4. Nothing lost on a crash" and the SIGTERM finding of "3. No orphans, no
hangs": real `ludic train` processes stopped with real SIGTERM / SIGKILL at chosen moments,
then resumed; every record and checkpoint must agree afterwards."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from tests.faults.helpers import (
    checkpoint_steps,
    config,
    launch,
    records,
    run_dir,
    steps,
    wait_for,
)

from ludic import jobs

LONG_RL = ["trainer.steps=100000", "trainer.checkpoint_every=1000", "eval.every=0"]


def _finish(proc: subprocess.Popen, timeout: float = 60) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise


@pytest.mark.parametrize("background", [False, True], ids=["foreground", "sigint-ignored"])
def test_sigterm_in_rl_checkpoints_the_last_step_exits_143_and_resume_finishes(
    tmp_path: Path, background: bool
) -> None:
    """Finding: SIGTERM killed the trainer at once and saved no checkpoint. Now it stops
    at a step boundary like Ctrl-C: checkpoint, exit 143, the --resume hint. Also for a
    run started in the background by a script, whose SIGINT is ignored (see
    test_sigterm_background.py)."""
    proc = launch(tmp_path, *LONG_RL, sigint_ignored=background)
    run = wait_for("a run directory", lambda: run_dir(tmp_path), proc, 60)
    wait_for("RL step 3", lambda: len(steps(run, "rl")) >= 3, proc, 60)
    proc.send_signal(signal.SIGTERM)
    assert _finish(proc) == 143
    stderr = (tmp_path / "stderr0.txt").read_text()
    assert "interrupted; continue from the last checkpoint with:" in stderr
    assert "--resume" in stderr
    done = steps(run, "rl")
    assert done == list(range(1, len(done) + 1))
    assert checkpoint_steps(run, "rl") == [done[-1]]  # the step the metrics end at

    jobs.train(config(tmp_path, *LONG_RL[1:], f"trainer.steps={done[-1] + 2}"), resume=run)
    assert steps(run, "rl") == list(range(1, done[-1] + 3))
    assert steps(run, "eval") == [0, done[-1] + 2]


def test_sigterm_during_the_warm_start_stops_at_a_step_boundary(tmp_path: Path) -> None:
    """SFT batches never suspend the event loop, so a cancel (Ctrl-C or SIGTERM) used to
    wait for the whole phase to end; now each step boundary is a cancellation point."""
    proc = launch(tmp_path, "warm_start.steps=100000", "trainer.checkpoint_every=1000")
    run = wait_for("a run directory", lambda: run_dir(tmp_path), proc, 60)
    wait_for("warm-start step 2", lambda: len(steps(run, "warm_start")) >= 2, proc, 60)
    proc.send_signal(signal.SIGTERM)
    assert _finish(proc, timeout=30) == 143
    done = steps(run, "warm_start")
    assert checkpoint_steps(run, "warm_start") == [done[-1]]
    assert steps(run, "rl") == []


def test_kill_9_right_after_a_checkpoint_keeps_that_steps_metrics_line(tmp_path: Path) -> None:
    """Finding: the checkpoint was written before the step's metrics line, so a kill in
    between lost the line for good. Now the line is fsynced first; resume trims the rest."""
    proc = launch(tmp_path, "trainer.steps=100000", "trainer.checkpoint_every=1", "eval.every=0")
    run = wait_for("a run directory", lambda: run_dir(tmp_path), proc, 60)
    folder = run / "checkpoints" / "rl" / "step_00000003"
    wait_for("RL checkpoint 3", folder.is_dir, proc, 60)
    proc.kill()  # SIGKILL, the moment the checkpoint is renamed into place
    proc.wait(timeout=10)
    assert 3 in steps(run, "rl")
    saved = checkpoint_steps(run, "rl")[-1]
    assert steps(run, "rl")[:saved] == list(range(1, saved + 1))

    jobs.train(config(tmp_path, "trainer.checkpoint_every=1", f"trainer.steps={saved + 2}"),
              resume=run)  # fmt: skip
    assert steps(run, "rl") == list(range(1, saved + 3))
    sampled = [json.loads(line)["step"] for line in (run / "samples.jsonl").open()]
    assert sampled == list(range(1, saved + 3))  # samples of redone steps were trimmed too


def test_kill_9_before_the_first_rl_checkpoint_resumes_without_duplicates(tmp_path: Path) -> None:
    """Finding: a kill before a phase's first checkpoint duplicated its metric lines (and
    the step-0 evaluation, and samples) on resume."""
    proc = launch(tmp_path, *LONG_RL)
    run = wait_for("a run directory", lambda: run_dir(tmp_path), proc, 60)
    wait_for("RL step 3", lambda: len(steps(run, "rl")) >= 3, proc, 60)
    proc.kill()
    proc.wait(timeout=10)
    assert checkpoint_steps(run, "rl") == []

    jobs.train(config(tmp_path, *LONG_RL[1:], "trainer.steps=3"), resume=run)
    assert steps(run, "warm_start") == [1, 2]
    assert steps(run, "rl") == [1, 2, 3]
    assert steps(run, "eval") == [0, 3]
    sampled = [json.loads(line)["step"] for line in (run / "samples.jsonl").open()]
    assert sampled == [1, 2, 3]


def test_resuming_a_finished_run_adds_no_records(tmp_path: Path) -> None:
    """Finding: resuming a finished run appended a duplicate final evaluation."""
    run = jobs.train(config(tmp_path))
    before = (run / "metrics.jsonl").read_text()
    jobs.train(config(tmp_path), resume=run)
    assert (run / "metrics.jsonl").read_text() == before
    assert steps(run, "eval") == [0, 4]


def test_a_torn_last_metrics_line_is_dropped_with_a_warning_naming_the_file(
    tmp_path: Path,
) -> None:
    """Finding: one torn last line (a crash mid-append) blocked --resume with a bare
    JSONDecodeError."""
    run = jobs.train(config(tmp_path, "trainer.steps=2"))
    metrics = run / "metrics.jsonl"
    with metrics.open("a") as f:
        f.write('{"phase": "rl", "step": 3, "reward_m')  # cut off mid-write
    with pytest.warns(UserWarning, match=rf"{metrics}:\d+: dropped a torn last line"):
        jobs.train(config(tmp_path, "trainer.steps=3"), resume=run)
    assert steps(run, "rl") == [1, 2, 3]


def test_a_torn_line_in_the_middle_of_metrics_is_an_error_naming_file_and_line(
    tmp_path: Path,
) -> None:
    run = jobs.train(config(tmp_path, "trainer.steps=2"))
    metrics = run / "metrics.jsonl"
    lines = metrics.read_text().splitlines(keepends=True)
    lines[2] = lines[2][:10] + "\n"
    metrics.write_text("".join(lines))
    with pytest.raises(ValueError, match=rf"{metrics}:3: not valid JSON .* fix or delete"):
        jobs.train(config(tmp_path, "trainer.steps=3"), resume=run)


def test_ctrl_c_in_the_warm_start_resumes_with_the_same_data_as_an_uninterrupted_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Finding: resuming during the warm start restarted the SFT order at epoch 0, so the
    resumed losses differed from an uninterrupted run's."""
    sft = ["warm_start.steps=6", "warm_start.num_demos=16", "warm_start.batch_size=4",
           "trainer.steps=1", "trainer.checkpoint_every=100"]  # fmt: skip
    reference = jobs.train(config(tmp_path / "a", *sft))

    from ludic.training.trainer import Trainer

    real_step = Trainer.train_step

    async def interrupted_before_sft_step_4(self):
        if "warm_start" in str(self.checkpoints.config.dir) and self.step == 3:
            raise KeyboardInterrupt
        return await real_step(self)

    monkeypatch.setattr(Trainer, "train_step", interrupted_before_sft_step_4)
    with pytest.raises(KeyboardInterrupt):
        jobs.train(config(tmp_path / "b", *sft))
    run = run_dir(tmp_path / "b")
    assert checkpoint_steps(run, "warm_start") == [3]
    monkeypatch.setattr(Trainer, "train_step", real_step)
    jobs.train(config(tmp_path / "b", *sft), resume=run)
    got, want = records(run, "warm_start"), records(reference, "warm_start")
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], abs=1e-6)


def test_any_failure_saves_the_last_completed_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Finding: a failure other than Ctrl-C saved nothing since the last periodic
    checkpoint. Now any exception saves the last completed step while weights are finite."""
    from ludic.training.trainer import Trainer

    real_step = Trainer.train_step

    async def failing_before_rl_step_3(self):
        if "rl" in str(self.checkpoints.config.dir) and self.step == 2:
            raise ConnectionError("inference server went away")
        return await real_step(self)

    monkeypatch.setattr(Trainer, "train_step", failing_before_rl_step_3)
    with pytest.raises(ConnectionError):
        jobs.train(config(tmp_path, "trainer.checkpoint_every=100"))
    run = run_dir(tmp_path)
    assert checkpoint_steps(run, "rl") == [2]
    monkeypatch.setattr(Trainer, "train_step", real_step)
    jobs.train(config(tmp_path, "trainer.checkpoint_every=100"), resume=run)
    assert steps(run, "rl") == [1, 2, 3, 4]


def test_exploding_weights_stop_with_a_clear_error_and_are_never_checkpointed(
    tmp_path: Path,
) -> None:
    """Finding: `trainer.lr=1e30` checkpointed exploded weights, then failed inside
    sampling with torch's "probability tensor contains inf/nan"."""
    with pytest.raises(
        FloatingPointError, match=r"optimizer step 1 .*exploded.*lower .*trainer\.lr"
    ):
        jobs.train(config(tmp_path, "trainer.lr=1e30", "trainer.checkpoint_every=1"))
    assert checkpoint_steps(run_dir(tmp_path), "rl") == []
    assert steps(run_dir(tmp_path), "rl") == []


def test_sigterm_on_a_reward_model_run_checkpoints_a_whole_step_and_exits_143(
    tmp_path: Path,
) -> None:
    """The reward-model loop is synchronous: SIGTERM is held until the step ends, so the
    checkpoint holds exactly the steps metrics.jsonl records."""
    example = Path(__file__).resolve().parents[2] / "examples/configs/reward_model_tiny.yaml"
    argv = [sys.executable, "-m", "ludic", "train", str(example), f"output_dir={tmp_path}",
            "reward_model.steps=100000", "reward_model.batch_size=4",
            "reward_model.checkpoint_every=1000", "reward_model.eval_every=0",
            "reward_model.data.synthetic.num_pairs=40", "reward_model.data.eval_size=8"]  # fmt: skip
    with (tmp_path / "stderr.txt").open("w") as err:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err)
    run = wait_for("a run directory", lambda: run_dir_of(tmp_path), proc, 60)
    wait_for("step 3", lambda: len(steps(run, "reward_model")) >= 3, proc, 60)
    proc.send_signal(signal.SIGTERM)
    assert _finish(proc) == 143
    done = steps(run, "reward_model")
    assert done == list(range(1, len(done) + 1))
    saved = sorted((run / "checkpoints").rglob("step_*"))
    assert [int(p.name[5:]) for p in saved] == [done[-1]]
    assert "--resume" in (tmp_path / "stderr.txt").read_text()


def run_dir_of(out: Path) -> Path | None:
    found = [p for p in out.iterdir() if p.is_dir()]
    return found[0] if found else None
