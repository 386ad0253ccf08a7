"""Real `ludic train` processes for the fault tests: launch, watch the run directory, signal."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from ludic import jobs
from ludic.inference.vllm.process import die_with_parent_preexec
from ludic.run.loading import load_config

DEMO = Path(jobs.__file__).parent / "configs" / "arithmetic_demo.yaml"
TINY = [
    "warm_start.steps=2",
    "warm_start.num_demos=8",
    "warm_start.batch_size=8",
    "trainer.steps=4",
    "trainer.prompts_per_step=2",
    "trainer.checkpoint_every=2",
    "algorithm.group_size=2",
    "eval.num_problems=4",
    "logging.console_every=1",
    "logging.num_sample_rollouts=1",
    "env.kwargs.num_problems=8",
]


def config(out: Path, *extra: str):
    return load_config(DEMO, [f"output_dir={out}", *TINY, *extra])


def launch(
    out: Path, *extra: str, resume: Path | None = None, sigint_ignored: bool = False
) -> subprocess.Popen:
    """``python -m ludic train`` on the tiny demo config; output goes to files in ``out``.
    ``sigint_ignored``: started as ``cmd &`` in a script starts it, SIGINT ignored."""
    out.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "ludic", "train", str(DEMO), f"output_dir={out}", *TINY, *extra]
    if resume is not None:
        argv += ["--resume", str(resume)]
    n = len(list(out.glob("stderr*.txt")))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    die_with_us = die_with_parent_preexec(os.getpid())  # a killed pytest leaves no run

    def preexec() -> None:
        die_with_us()
        if sigint_ignored:
            signal.signal(signal.SIGINT, signal.SIG_IGN)

    return subprocess.Popen(
        argv,
        stdout=(out / f"stdout{n}.txt").open("w"),
        stderr=(out / f"stderr{n}.txt").open("w"),
        env=env,
        start_new_session=True,  # a signal to the test's group never reaches it by accident
        preexec_fn=preexec,
    )


def wait_for(what: str, check: Callable[[], object], proc: subprocess.Popen, timeout: float):
    """Poll ``check`` until truthy (returns its value); fail if ``proc`` exits or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        if proc.poll() is not None:
            raise AssertionError(f"the run exited ({proc.returncode}) before {what}")
        time.sleep(0.005)
    proc.kill()
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def run_dir(out: Path) -> Path | None:
    found = [p for p in out.glob("arithmetic-demo-*") if p.is_dir()]
    return found[0] if found else None


def records(run: Path, phase: str | None = None) -> list[dict]:
    """Complete lines of metrics.jsonl (a last line without its newline is still being written)."""
    path = run / "metrics.jsonl"
    if not path.is_file():
        return []
    lines = path.read_text().split("\n")[:-1]
    return [r for r in map(json.loads, lines) if phase is None or r["phase"] == phase]


def steps(run: Path, phase: str) -> list[int]:
    return [r["step"] for r in records(run, phase)]


def checkpoint_steps(run: Path, phase: str) -> list[int]:
    folder = run / "checkpoints" / phase
    if not folder.is_dir():
        return []
    return sorted(int(p.name[5:]) for p in folder.glob("step_*"))
