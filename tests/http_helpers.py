"""Waiting for a test's HTTP server to come up."""

from __future__ import annotations

import subprocess
import time

import httpx


def wait_healthy(url: str, process: subprocess.Popen | None = None, timeout_s: float = 60) -> None:
    """Until ``url``/health answers 200; fails if ``process`` exits or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert process is None or process.poll() is None, f"the server for {url} exited"
        assert time.monotonic() < deadline, f"{url} did not start within {timeout_s} s"
        time.sleep(0.1)
