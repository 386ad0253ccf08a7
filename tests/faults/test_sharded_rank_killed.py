"""Issue 14, FSDP2 trainer: a trainer rank killed with SIGKILL mid-run. Nothing hangs: the
other rank and torchrun stop within seconds, ``ludic train`` exits 1 naming the failure;
the run resumes (here at the other world size) from its last sharded checkpoint and every
record agrees."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
from tests.faults.helpers import checkpoint_steps, config, launch, run_dir, steps, wait_for

from ludic import jobs

LONG = [
    "trainer.world_size=2",
    "trainer.steps=100000",
    "trainer.checkpoint_every=2",
    "eval.every=0",
]


def trainer_rank(proc: subprocess.Popen, rank: int) -> psutil.Process | None:
    """The ``ludic train`` process torchrun started as ``rank``."""
    for child in psutil.Process(proc.pid).children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank) and "ludic" in child.cmdline():
                return child
        except psutil.Error:
            continue
    return None


def test_a_killed_rank_stops_the_run_and_it_resumes_from_the_last_checkpoint(tmp_path: Path):
    proc = launch(tmp_path, *LONG)
    try:
        run = wait_for("a run directory", lambda: run_dir(tmp_path), proc, 120)
        wait_for("RL checkpoint 4", lambda: 4 in checkpoint_steps(run, "rl"), proc, 180)
        victim = wait_for("rank 1", lambda: trainer_rank(proc, 1), proc, 10)
        survivors = [p for p in psutil.Process(proc.pid).children(recursive=True)]
        victim.send_signal(signal.SIGKILL)
        started = time.monotonic()
        code = proc.wait(timeout=120)
        stopped_in = time.monotonic() - started
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert code == 1, code
    assert stopped_in < 60, f"the run took {stopped_in:.0f} s to stop after a rank died"
    stderr = (tmp_path / "stderr0.txt").read_text()
    assert "a trainer rank failed" in stderr
    _, alive = psutil.wait_procs(survivors, timeout=10)
    assert not alive, f"processes left after the run stopped: {alive}"

    done = steps(run, "rl")
    last = max(checkpoint_steps(run, "rl"))
    assert last >= 4 and done[:last] == list(range(1, last + 1))
    # Resume in one process: the metrics past the checkpoint are dropped and redone.
    jobs.train(
        config(tmp_path, *LONG[2:], "trainer.world_size=1", f"trainer.steps={last + 2}"),
        resume=run,
    )
    assert steps(run, "rl") == list(range(1, last + 3))
