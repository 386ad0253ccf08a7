"""The loopback guard (``tests/loopback.py``) sees a child listening beyond loopback, and
only that."""

from __future__ import annotations

import subprocess
import sys

import pytest
from tests.loopback import listeners_beyond_loopback

LISTEN = (
    "import socket, sys; s = socket.socket(); s.bind((sys.argv[1], 0)); s.listen(); "
    "print(s.getsockname()[1], flush=True); sys.stdin.read()"
)


@pytest.mark.parametrize(("host", "seen"), [("0.0.0.0", True), ("127.0.0.1", False)])
def test_a_child_listening_beyond_loopback_is_seen(host: str, seen: bool) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", LISTEN, host], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        port = int(child.stdout.readline())
        found = [(f.pid, f.address, f.port) for f in listeners_beyond_loopback()]
        assert ((child.pid, host, port) in found) == seen, found
    finally:
        child.stdin.close()
        child.wait(timeout=10)
