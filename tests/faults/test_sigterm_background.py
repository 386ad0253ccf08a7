"""SIGTERM to a run started in the background by a script (``ludic train ... &``), where
SIGINT is ignored and asyncio installs no Ctrl-C handler. Finding: the SIGTERM then raised
``KeyboardInterrupt`` wherever the main thread was, e.g. while a trainer step waited on the
compute thread, so the step's update happened without its metrics line and the run saved
no checkpoint (a CI run started with ``&`` failed this way). Now the loop's main task is
cancelled at its next await, as asyncio does for Ctrl-C: a step in progress finishes."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import asyncio, signal, sys
    from ludic.run.signals import Terminated, run_interruptible, terminate_as_interrupt

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # what `cmd &` in a script does
    steps = []

    async def step():
        await asyncio.sleep(0.6)  # e.g. waiting on the compute thread
        steps.append(1)

    async def main():
        print("ready", flush=True)
        while True:
            current = asyncio.ensure_future(step())
            try:
                await asyncio.shield(current)  # as Trainer.train_step does
            except asyncio.CancelledError:
                await current
                raise

    try:
        with terminate_as_interrupt():
            run_interruptible(main())
    except Terminated:
        print("terminated after", len(steps), "steps", flush=True)
        sys.exit(143)
    """
)


def test_sigterm_with_sigint_ignored_cancels_at_the_next_await() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)  # mid-way through the first step
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 143
    assert out.strip() == "terminated after 1 steps"  # the step in progress finished
