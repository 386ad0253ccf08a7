"""Policy servers that join a running run: ``ludic serve policy --join RUN_DIR``.

A joining server starts on the run's model and server settings and, once it answers
``/health``, writes ``RUN_DIR/servers/<host>-<port>.json`` (``{"url": ...}``, removed when it
exits). The run's pool reads the folder before each publish
(:meth:`~ludic.inference.vllm.pool.VLLMClientPool.accept_joins`) and adds a new server as
stale: it serves once a publish has synced and verified it. The API key is the run's
(``$LUDIC_API_KEY`` or ``--api-key``; never written to the run directory); a join file whose
server refuses it is reported once and left out.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

JOIN_FOLDER = "servers"
"""The folder of a run's directory where joining servers announce themselves."""


def join_folder(run_dir: str | Path) -> Path:
    return Path(run_dir) / JOIN_FOLDER


def write_join_file(folder: Path, url: str) -> Path:
    """Announce the server at ``url`` to the run (atomically: the pool never reads half a
    file); returns the file."""
    folder.mkdir(parents=True, exist_ok=True)
    name = url.split("://", 1)[-1].replace(":", "-").replace("/", "").replace("[", "")
    path = folder / f"{name.replace(']', '')}.json"
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"url": url, "pid": os.getpid(), "joined_at": time.time()}))
    os.replace(tmp, path)
    return path


def read_join_files(folder: Path) -> dict[str, str]:
    """``{url: file name}`` of every join file in ``folder`` (none if it does not exist);
    a file that is not a join file is skipped."""
    found: dict[str, str] = {}
    if not folder.is_dir():
        return found
    for path in sorted(folder.glob("*.json")):
        try:
            url = json.loads(path.read_text())["url"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if isinstance(url, str) and url.startswith(("http://", "https://")):
            found[url.rstrip("/")] = path.name
    return found


def serving_url(server_args: list[str]) -> str:
    """The URL a server started with ``server_args`` serves at (``--host``, ``--port``;
    ludic's defaults: 127.0.0.1, vLLM's port 8000)."""

    def value(flag: str, default: str) -> str:
        for i, arg in enumerate(server_args):
            if arg == flag and i + 1 < len(server_args):
                return server_args[i + 1]
            if arg.startswith(flag + "="):
                return arg.split("=", 1)[1]
        return default

    host = value("--host", "127.0.0.1")
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{value('--port', '8000')}"


def announce_when_healthy(folder: Path, url: str, timeout_s: float = 900.0) -> Any:
    """Start a daemon thread that writes the join file once ``url`` answers ``/health``
    (and removes it when this process exits); returns the thread."""
    import atexit
    import threading

    import httpx

    def run() -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        else:
            return
        path = write_join_file(folder, url)
        atexit.register(lambda: path.unlink(missing_ok=True))
        print(f"joined the run: {path}", flush=True)

    thread = threading.Thread(target=run, name="ludic-join", daemon=True)
    thread.start()
    return thread
