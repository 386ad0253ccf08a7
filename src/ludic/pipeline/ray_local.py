"""The local Ray of ``ludic launch`` (no ``--address``): on loopback, and gone with the launcher.

:data:`LOCAL_ONLY_ENV`, set before ``ray`` is imported (also to join a cluster at a loopback
address), makes Ray local-only: node address 127.0.0.1, all of it listening on loopback
(``ray.init(_node_ip_address=...)`` alone is not enough). Ray's dashboard and runtime-env
agents outlive a SIGKILLed launcher, so a reaper (``python -m ludic.pipeline.ray_local``, in
its own session) watches a pipe from the launcher; when it closes, the reaper SIGKILLs Ray's
processes (those holding a file in Ray's session directory) and SIGTERMs the run's (marked by
:data:`LAUNCH_ID_ENV`), SIGKILLing them after ``grace_s`` (``pipeline.stop_timeout_s``).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
from typing import Any

LOCAL_ONLY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
"""Ray's local-only switch (``ray_constants.ENABLE_RAY_CLUSTER``): its node address is
then the loopback address. Read once, when ``ray`` is imported."""

LAUNCH_ID_ENV = "LUDIC_LAUNCH_ID"
"""Marks every process of one local launch (for the reaper)."""

LOOPBACK = "127.0.0.1"

__all__ = ["LAUNCH_ID_ENV", "LOCAL_ONLY_ENV", "LOOPBACK", "is_loopback_address", "start_local_ray"]


def is_loopback_address(address: str) -> bool:
    """Whether a Ray address (``HOST:PORT``) names this machine's loopback."""
    host = address.rsplit(":", 1)[0].strip("[]")
    return host == "localhost" or host.startswith("127.") or host == "::1"


def start_local_ray(ray: Any, stack: contextlib.ExitStack, *, grace_s: float, **init: Any) -> None:
    """``ray.init(**init)`` on 127.0.0.1, with a reaper; ``stack`` shuts Ray down, then
    lets the reaper end what is left (waiting for it)."""
    launch_id = secrets.token_hex(8)
    os.environ[LAUNCH_ID_ENV] = launch_id  # inherited by Ray's processes from here on
    stack.callback(os.environ.pop, LAUNCH_ID_ENV, None)
    reaper = subprocess.Popen(
        [sys.executable, "-m", "ludic.pipeline.ray_local", launch_id, str(grace_s)],
        stdin=subprocess.PIPE,
        start_new_session=True,  # not in the launcher's process group: outlives a killpg
    )
    stack.callback(_wait, reaper, grace_s + 10.0)
    assert reaper.stdin is not None
    stack.callback(reaper.stdin.close)  # the reaper's cue (the kernel's, if we are killed)
    stack.callback(ray.shutdown)
    # address "local": a new Ray, not the one `ray start` (or a test's cluster) left in
    # /tmp/ray/ray_current_cluster, which ray.init() would join
    context = ray.init(address="local", _node_ip_address=LOOPBACK, **init)
    with contextlib.suppress(OSError):  # a reaper gone early: nothing to tell
        reaper.stdin.write(f"{context.address_info['session_dir']}\n".encode())
        reaper.stdin.flush()
    node_ip = ray.util.get_node_ip_address()
    if node_ip != LOOPBACK:
        from ludic.run.errors import RunError

        env = " ".join(f"{k}={v}" for k, v in LOCAL_ONLY_ENV.items())
        raise RunError(
            f"the local Ray's node address is {node_ip}, not {LOOPBACK}: ray was imported "
            f"before `ludic launch` could set {env}; set it before importing ray, or pass "
            "--address"
        )


def _wait(process: subprocess.Popen[bytes], timeout_s: float) -> None:
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=timeout_s)


# ------------------------------------------------------------------------------ reaper
def reap(launch_id: str, session_dir: str | None, grace_s: float, *, spare: Any = None) -> int:
    """End every process of the launch; returns how many there were. Ray's own (holding a
    file in ``session_dir``: its logs) get SIGKILL, as ``ray stop`` would; the run's
    (marked ``launch_id``: a learner checkpoints) SIGTERM, then SIGKILL after ``grace_s``.
    ``spare`` (a ``psutil.Process``: the launcher, a Ray driver) is left alone."""
    import psutil

    signalled: set[int] = set()
    deadline = time.monotonic() + grace_s
    while True:
        found = [f for f in _of_launch(psutil, launch_id, session_dir) if f[0] != spare]
        if not found:
            return len(signalled)
        late = time.monotonic() >= deadline
        for proc, rays in found:
            if late or rays or proc.pid not in signalled:
                with contextlib.suppress(psutil.Error):
                    proc.send_signal(signal.SIGKILL if late or rays else signal.SIGTERM)
                signalled.add(proc.pid)
        time.sleep(0.2)


def _of_launch(psutil: Any, launch_id: str, session_dir: str | None) -> list[tuple[Any, bool]]:
    """The launch's processes, each with whether it is Ray's."""
    inside = None if session_dir is None else session_dir.rstrip("/") + "/"
    uid = os.getuid()
    found = []
    for proc in psutil.process_iter():
        if proc.pid == os.getpid():
            continue
        with contextlib.suppress(psutil.Error):
            if proc.uids().real != uid or proc.status() == psutil.STATUS_ZOMBIE:
                continue
            if inside is not None and _holds_file_in(proc.pid, inside):
                found.append((proc, True))
            elif proc.environ().get(LAUNCH_ID_ENV) == launch_id:
                found.append((proc, False))
    return found


def _holds_file_in(pid: int, folder: str) -> bool:
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(folder):
                return True
    return False


def main(argv: list[str]) -> None:
    """The reaper: reads the session directory from stdin, reaps at its end."""
    launch_id, grace_s = argv[0], float(argv[1])
    import psutil

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher's Ctrl-C is not for us
    launcher = psutil.Process(os.getppid())  # same pid and start time: not a reused pid
    told = sys.stdin.buffer.read().decode().split()  # until the launcher closes it, or dies
    reap(launch_id, told[-1] if told else None, grace_s, spare=launcher)


if __name__ == "__main__":
    main(sys.argv[1:])
