"""Small ASGI helpers shared by ludic's own HTTP apps (the reward router, the agent
endpoint, a served OpenEnv environment): a size-bounded body read, JSON answers, and
serving an app from a daemon thread."""

from __future__ import annotations

import json
import threading
import time
from typing import Any


async def read_body(receive: Any, max_bytes: int) -> bytes | None:
    """The request body, or ``None`` when it exceeds ``max_bytes``."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b"".join(chunks)
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > max_bytes:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def send_bytes(
    send_: Any, status: int, body: bytes, headers: list[tuple[bytes, bytes]]
) -> None:
    headers = [*headers, (b"content-length", str(len(body)).encode())]
    await send_({"type": "http.response.start", "status": status, "headers": headers})
    await send_({"type": "http.response.body", "body": body})


async def send_json(send_: Any, status: int, value: Any) -> None:
    body = json.dumps(value).encode()
    await send_bytes(send_, status, body, [(b"content-type", b"application/json")])


async def send_error(send_: Any, status: int, message: str) -> None:
    await send_json(send_, status, {"error": message})


def serve_in_thread(
    app: Any, *, host: str, port: int, name: str, timeout_s: float = 30.0
) -> tuple[Any, threading.Thread, int]:
    """Serve ``app`` with uvicorn in a daemon thread; returns ``(server, thread, port)``
    once it accepts connections (``port=0``: a free port, returned). Stop it with
    ``server.should_exit = True`` and ``thread.join()``."""
    import uvicorn

    config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name=name, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"{name}: the server on {host}:{port} did not start")
        time.sleep(0.01)
    return server, thread, server.servers[0].sockets[0].getsockname()[1]
