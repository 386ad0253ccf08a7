"""A small real HTTP server for the router's tests (run as a subprocess by uvicorn):

    python tests/inference/router_backend.py PORT NAME [MODEL]

* ``GET /health``: 200, or 503 while ``POST /set_health?ok=0`` says so.
* ``GET /v1/models``: ``MODEL`` (default ``m``).
* ``POST /score``: ``{"sleep": s, "status": n}`` -> waits ``s`` seconds, answers status
  ``n`` (default 200) with ``{"backend": NAME, "echo": body}``; ``{"garbage": "text"}``
  (or ``"list"``) -> 200 with a body that is not JSON (or a JSON list).
* ``POST /v1/chat/completions``: answers ``{"backend": NAME, "model": body["model"]}``.
No ``/openapi.json``: the router assumes it serves every route.
"""

from __future__ import annotations

import asyncio
import json
import sys

import uvicorn

PORT, NAME = int(sys.argv[1]), sys.argv[2]
MODEL = sys.argv[3] if len(sys.argv) > 3 else "m"
state = {"healthy": True}
GARBAGE = {"text": b"<html>upstream oops</html>", "list": b"[1, 2]"}


async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    path = scope["path"]
    status, out = 200, {"backend": NAME}
    if path == "/health":
        status = 200 if state["healthy"] else 503
    elif path == "/set_health":
        state["healthy"] = scope["query_string"] == b"ok=1"
    elif path == "/v1/models":
        out = {"data": [{"id": MODEL}]}
    elif path == "/score":
        try:
            request = json.loads(body or b"{}")
        except ValueError:
            request = {"status": 400}
        await asyncio.sleep(request.get("sleep", 0))
        status = request.get("status", 200)
        auth = dict(scope["headers"]).get(b"authorization", b"").decode()
        out = {"backend": NAME, "echo": request, "auth": auth}
        out = GARBAGE.get(request.get("garbage"), out)
    elif path == "/v1/chat/completions":
        out = {"backend": NAME, "model": json.loads(body).get("model")}
    else:
        status = 404
    data = out if isinstance(out, bytes) else json.dumps(out).encode()
    headers = [(b"content-type", b"application/json"), (b"x-ludic-policy-version", b"7")]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=PORT, log_level="error")
