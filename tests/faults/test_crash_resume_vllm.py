"""Issue 9, "3. No orphans, no hangs": SIGTERM on `ludic train` with the vLLM backend killed
the trainer at once, saved no checkpoint and left four vLLM processes running. Now it
stops like Ctrl-C: the step's checkpoint, exit 143, and the server it started is gone."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from tests.faults.helpers import checkpoint_steps, launch, run_dir, steps, wait_for
from tests.vllm.helpers import assert_all_gone

pytestmark = pytest.mark.vllm


def test_sigterm_with_the_vllm_backend_checkpoints_and_leaves_no_vllm_process(
    tmp_path: Path,
) -> None:
    psutil = pytest.importorskip("psutil")
    pytest.importorskip("vllm", reason="vLLM is not installed")
    proc = launch(
        tmp_path,
        "inference.backend=vllm",
        "trainer.steps=100000",
        "trainer.checkpoint_every=1000",
        "eval.every=0",
    )
    try:
        run = wait_for("a run directory", lambda: run_dir(tmp_path), proc, 60)
        wait_for("RL step 2", lambda: len(steps(run, "rl")) >= 2, proc, 300)
        server = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        assert server, "the run started no server process"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 143
    finally:
        if proc.poll() is None:
            proc.kill()
    assert_all_gone(server, timeout_s=30)
    done = steps(run, "rl")
    assert done == list(range(1, len(done) + 1))
    assert checkpoint_steps(run, "rl") == [done[-1]]
