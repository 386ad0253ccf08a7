"""What keeps a ludic vLLM server (policy or reward) safe to run.

* :class:`ApiKeyMiddleware`: the only key check; with a key, every HTTP/websocket route but
  ``/health`` needs ``Authorization: Bearer KEY`` or ``x-api-key: KEY`` (constant-time).
* :func:`check_bind`: a non-loopback ``--host`` without a key needs ``--allow-insecure``.
* :func:`check_sync_address` / :func:`capped_timeout`: ``/init_communicator``'s ``master_addr``
  is loopback or in ``--weight-sync-hosts``; its timeout capped (``--weight-sync-timeout-cap``).
* :func:`start_parent_watchdog`: with ``LUDIC_PARENT_PID`` set, ends the server's process
  group (engine core, workers) once the parent is gone.
"""

from __future__ import annotations

import contextlib
import hmac
import ipaddress
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger("ludic.inference.vllm.security")

API_KEY_ENV = "LUDIC_API_KEY"
"""Environment variable holding the server's API key (read by the servers and by
``ludic train``'s clients; ``start_vllm_server`` passes the key this way, not on argv)."""
PARENT_PID_ENV = "LUDIC_PARENT_PID"
"""Environment variable naming the pid whose death ends the server (see the watchdog)."""
OPEN_PATHS = frozenset({"/health"})
"""Routes that answer without the API key (liveness probes)."""
DEFAULT_SYNC_TIMEOUT_CAP_S = 60.0


# ------------------------------------------------------------------------------ API key
class ApiKeyMiddleware:
    """ASGI middleware: 401 unless the request carries the key (see the module doc)."""

    def __init__(self, app: Any, api_key: str) -> None:
        if not api_key:
            raise ValueError("ApiKeyMiddleware needs a non-empty api_key")
        self.app = app
        self.api_key = api_key.encode()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket") or scope.get("path") in OPEN_PATHS:
            return await self.app(scope, receive, send)
        if self._authorized(scope):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return None
        body = json.dumps(
            {"error": "missing or wrong API key: send Authorization: Bearer KEY"}
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
        return None

    def _authorized(self, scope: dict[str, Any]) -> bool:
        ok = False
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() == b"bearer":
                    ok |= hmac.compare_digest(token.strip(), self.api_key)
            elif name == b"x-api-key":
                ok |= hmac.compare_digest(value.strip(), self.api_key)
        return ok


# ------------------------------------------------------------------------------ binding
def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback IP literals (127.0.0.0/8, ::1)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, api_key: str | None, allow_insecure: bool) -> None:
    """Refuse (``SystemExit``) to listen on a non-loopback ``host`` without an API key,
    unless ``allow_insecure``; then warn loudly."""
    if api_key or is_loopback(host):
        return
    if not allow_insecure:
        raise SystemExit(
            f"--host {host} exposes the server beyond this machine without an API key: "
            f"anyone who can reach it can generate and overwrite the weights. Set --api-key "
            f"(or {API_KEY_ENV}), bind --host 127.0.0.1, or pass --allow-insecure"
        )
    logger.warning(
        "!!! INSECURE: serving on --host %s WITHOUT an API key (--allow-insecure): anyone "
        "who can reach this port can generate and replace the model weights !!!",
        host,
    )


# ------------------------------------------------------------------------------ weight sync
def check_sync_address(master_addr: str, allowed_hosts: Sequence[str]) -> None:
    """Raise ``ValueError`` naming ``master_addr`` unless it is loopback or listed in
    ``allowed_hosts`` (the server's ``--weight-sync-hosts``)."""
    if is_loopback(master_addr) or master_addr in allowed_hosts:
        return
    listed = f" (allowed: {list(allowed_hosts)})" if allowed_hosts else ""
    raise ValueError(
        f"master_addr={master_addr!r} is not a loopback address{listed}: the workers join "
        "only the trainer's group on this machine unless the server is started with "
        f"--weight-sync-hosts {master_addr}"
    )


class LoadPathRefused(PermissionError):
    """``/load_weights_from_disk`` named a folder outside ``--weight-load-roots``."""


def check_load_path(path: str, roots: Sequence[str]) -> Path:
    """The folder ``path`` resolved (symlinks followed, so a link cannot lead out), if it
    lies under one of ``roots`` (the server's ``--weight-load-roots``); else
    :class:`LoadPathRefused`. The route reads any file it is pointed at: without roots the
    server loads nothing from disk."""
    if not roots:
        raise LoadPathRefused(
            "this server loads no weights from disk: start it with --weight-load-roots DIR "
            "(the folders under DIR may be loaded)"
        )
    folder = Path(path).resolve()
    for root in roots:
        if folder.is_relative_to(Path(root).resolve()):
            return folder
    raise LoadPathRefused(
        f"path {path!r} is not under --weight-load-roots ({', '.join(roots)}); this server "
        "loads folders under those only"
    )


def capped_timeout(timeout_s: float, cap_s: float) -> float:
    """``timeout_s`` bounded by ``cap_s`` (a logged note when it is cut)."""
    if timeout_s > cap_s:
        logger.warning(
            "weight-sync timeout_s=%.0f capped at %.0f s (--weight-sync-timeout-cap)",
            timeout_s,
            cap_s,
        )
        return cap_s
    return timeout_s


# ------------------------------------------------------------------------------ watchdog
def start_parent_watchdog(
    parent_pid: int | None = None, *, poll_s: float = 0.5, grace_s: float = 5.0
) -> threading.Thread | None:
    """End this server when ``parent_pid`` (default: ``$LUDIC_PARENT_PID``) dies.

    A daemon thread polls ``os.getppid()``; once the parent is gone it SIGTERMs every
    process of this server's process group but itself (engine core, workers), SIGKILLs
    what is left after ``grace_s`` and finally SIGKILLs the group, this process included.
    Returns the thread, or ``None`` when no parent is named."""
    if parent_pid is None:
        raw = os.environ.pop(PARENT_PID_ENV, None)  # not inherited by what we spawn
        if not raw:
            return None
        parent_pid = int(raw)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        logger.warning("parent process %d is gone: shutting the server down", parent_pid)
        end_process_group(grace_s)

    thread = threading.Thread(target=watch, name="ludic-parent-watchdog", daemon=True)
    thread.start()
    return thread


def end_process_group(grace_s: float) -> None:
    """SIGTERM this process's descendants and group, SIGKILL them after ``grace_s``, then
    SIGKILL the group (this process last)."""
    import psutil

    me = psutil.Process()
    children = me.children(recursive=True)
    for child in children:
        _signal(child, signal.SIGTERM)
    _gone, alive = psutil.wait_procs(children, timeout=grace_s)
    for child in alive:
        _signal(child, signal.SIGKILL)
    psutil.wait_procs(alive, timeout=2.0)
    if os.getpgrp() == os.getpid():  # our own group (start_vllm_server's session)
        os.killpg(os.getpgrp(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def _signal(proc: Any, sig: signal.Signals) -> None:
    import psutil

    with contextlib.suppress(psutil.Error):
        proc.send_signal(sig)
