"""Small ASGI helpers shared by ludic's own HTTP apps (the reward router, the agent
endpoint): a size-bounded body read and JSON answers."""

from __future__ import annotations

import json
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
