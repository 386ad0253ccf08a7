"""Issue 9, part 3 ("No orphans, no hangs"): ``kill -9`` on the trainer left the vLLM
server serving. A real "trainer" subprocess starts a real server with
``start_vllm_server`` and is SIGKILLed; the server and every process it spawned (engine
core, CPU worker) must be gone within 30 s: by the kernel's parent-death signal when
started from the main thread, by the server's own parent watchdog otherwise."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed")

import psutil  # noqa: E402
from tests.vllm.helpers import assert_all_gone  # noqa: E402

pytestmark = pytest.mark.vllm

TRAINER = """
import sys, threading, time
from ludic.inference.vllm.process import start_vllm_server

def start():
    server = start_vllm_server(sys.argv[1], log_path=sys.argv[2])
    print("READY", server.pid, flush=True)

if sys.argv[3] == "thread":  # no PR_SET_PDEATHSIG: only the watchdog can end the server
    worker = threading.Thread(target=start)
    worker.start()
    worker.join()
else:
    start()
time.sleep(600)
"""


def _read_ready(process: subprocess.Popen[str], timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    assert process.stdout is not None
    while time.monotonic() < deadline:
        ready, _, _ = select.select([process.stdout], [], [], 1.0)
        if ready:
            line = process.stdout.readline()
            if line.startswith("READY"):
                return int(line.split()[1])
            if not line and process.poll() is not None:
                break
    raise AssertionError(f"the trainer did not start a server within {timeout_s:.0f}s")


def test_servers_and_their_workers_die_with_a_sigkilled_trainer(tmp_path):
    """Two trainers at once (one start-up's time): one starts its server from the main
    thread (the kernel's parent-death signal ends it), one from another thread (only the
    server's watchdog can)."""
    from ludic.models.tiny import save_tiny_model

    model_dir = save_tiny_model(tmp_path / "model")
    trainers = {
        started_from: subprocess.Popen(
            [
                sys.executable,
                "-c",
                TRAINER,
                str(model_dir),
                str(tmp_path / f"{started_from}.log"),
                started_from,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )  # fmt: skip
        for started_from in ("main", "thread")
    }
    servers: dict[str, int] = {}
    try:
        for started_from, trainer in trainers.items():
            servers[started_from] = _read_ready(trainer, 300)
        trees = {
            name: [pid, *(p.pid for p in psutil.Process(pid).children(recursive=True))]
            for name, pid in servers.items()
        }
        assert all(len(pids) >= 3 for pids in trees.values())  # API, engine core, worker(s)
        for trainer in trainers.values():
            os.kill(trainer.pid, signal.SIGKILL)
            trainer.wait(timeout=10)
        started = time.monotonic()
        for name, pids in trees.items():
            assert_all_gone(pids, timeout_s=30)
            print(f"{name}: server tree of {len(pids)} processes gone "
                  f"{time.monotonic() - started:.1f}s")  # fmt: skip
    finally:
        for trainer in trainers.values():
            if trainer.poll() is None:
                trainer.kill()
                trainer.wait(timeout=10)
        for server_pid in servers.values():  # never leave a server behind, even when failing
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server_pid, signal.SIGKILL)
