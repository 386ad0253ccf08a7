"""The router's HTTP side: one address over N servers (an ASGI app, served by uvicorn).

The data routes (:data:`DATA_ROUTES`: completions, chat completions, ``/score``, ...) go as they
are to the least busy healthy backend serving the path (and the body's ``model``); its answer
comes back unchanged, plus ``x-ludic-backend``. A request that got no answer (connection error,
timeout, 502/503/504, a 2xx body that is not a JSON object) is retried on another backend;
other statuses pass through. Also ``/health``, ``/router/backends`` and ``/v1/models``. Not
forwarded: control routes (404: weight sync and pause are per server) and streaming (400).
The routes and retry rules for users: docs/reward-loop.md, "The router".
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import httpx

from ludic.inference.asgi import read_body, send_bytes, send_error, send_json
from ludic.inference.router.pool import Backend, BackendPool, NoBackendError

DATA_ROUTES: frozenset[str] = frozenset(
    {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/embeddings",
        "/score",
        "/classify",
        "/pooling",
        "/tokenize",
        "/detokenize",
    }
)
"""Routes forwarded to a backend; every other path but the router's own is a 404."""

RETRY_STATUSES = frozenset({502, 503, 504})
"""Backend answers that send the request to another backend."""

MAX_BODY_BYTES = 64 * 2**20
"""Larger request bodies are refused with 413."""

_HOP_HEADERS = frozenset(
    {
        b"host",
        b"connection",
        b"keep-alive",
        b"content-length",
        b"transfer-encoding",
        b"authorization",
        b"x-api-key",
        b"te",
        b"upgrade",
        b"proxy-authorization",
        b"accept-encoding",
    }
)
"""Request headers not passed to a backend (the router sends its own key and length)."""
_RESPONSE_DROP = frozenset({"connection", "keep-alive", "content-length", "transfer-encoding"})


class RouterApp:
    """ASGI app over a :class:`~ludic.inference.router.pool.BackendPool` (see the module
    docstring). ``health_interval_s``: seconds between health checks (the first runs at
    start-up, before the router answers)."""

    def __init__(
        self,
        pool: BackendPool,
        *,
        health_interval_s: float = 2.0,
        routes: Iterable[str] = DATA_ROUTES,
    ) -> None:
        if health_interval_s <= 0:
            raise ValueError(f"health_interval_s={health_interval_s}; expected > 0")
        self.pool = pool
        self.health_interval_s = health_interval_s
        self.routes = frozenset(routes)
        self._health_task: Any = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            return await self._lifespan(receive, send)
        if scope["type"] != "http":
            return None
        path, method = scope["path"], scope["method"]
        if path == "/health":
            healthy = sum(b.healthy for b in self.pool.backends)
            body = {
                "status": "ok" if healthy else "no_healthy_backend",
                "type": "router",
                "healthy": healthy,
                "backends": len(self.pool.backends),
            }
            return await send_json(send, 200 if healthy else 503, body)
        if path == "/router/backends" and method == "GET":
            return await send_json(send, 200, {"backends": self.pool.status()})
        if path == "/v1/models" and method == "GET":
            return await send_json(send, 200, self._models())
        if path not in self.routes:
            return await send_error(
                send,
                404,
                f"the router does not forward {path}; it forwards {sorted(self.routes)} "
                "(call a server's control routes on that server)",
            )
        body = await read_body(receive, MAX_BODY_BYTES)
        if body is None:
            return await send_error(send, 413, f"request body over {MAX_BODY_BYTES} bytes")
        fields = _json_fields(body)
        if fields.get("stream") is True:
            return await send_error(
                send, 400, "the router does not stream: send stream=false (or omit it)"
            )
        model = fields.get("model") if isinstance(fields.get("model"), str) else None
        return await self._forward(scope, send, body, model)

    async def _forward(self, scope: dict[str, Any], send: Any, body: bytes, model: str | None):
        path = scope["path"]
        query = scope.get("query_string", b"").decode("latin-1")
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in _HOP_HEADERS]
        tried: list[Backend] = []
        errors: list[str] = []
        while True:
            try:
                backend = self.pool.pick(path, model, exclude=tried)
            except NoBackendError as e:
                if errors:
                    return await send_error(
                        send, 502, f"every backend failed {path}: " + "; ".join(errors)
                    )
                return await send_error(send, e.status, str(e))
            tried.append(backend)
            with self.pool.lease(backend) as client:
                try:
                    response = await client.request(
                        scope["method"],
                        httpx.URL(path=path, query=query.encode("latin-1")),
                        content=body,
                        headers=[(k.decode("latin-1"), v.decode("latin-1")) for k, v in headers],
                    )
                except httpx.HTTPError as e:
                    reason = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
                    backend.failures += 1
                    self.pool.mark_down(backend, reason)
                    errors.append(f"{backend.url}: {reason}")
                    continue
            problem = _answer_problem(response)
            if problem is not None:
                backend.failures += 1
                backend.last_error = problem
                errors.append(f"{backend.url}: {problem}")
                continue
            backend.served += 1
            out = [
                (k.encode("latin-1"), v.encode("latin-1"))
                for k, v in response.headers.multi_items()
                if k.lower() not in _RESPONSE_DROP and k.lower() != "content-encoding"
            ]
            out.append((b"x-ludic-backend", backend.url.encode()))
            return await send_bytes(send, response.status_code, response.content, out)

    def _models(self) -> dict[str, Any]:
        seen: dict[str, dict[str, Any]] = {}
        for backend in self.pool.backends:
            for name in sorted(backend.models or ()):
                seen.setdefault(name, {"id": name, "object": "model", "owned_by": "ludic"})
        return {"object": "list", "data": list(seen.values())}

    async def _lifespan(self, receive: Any, send: Any) -> None:
        import asyncio

        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await self.pool.check_all()
                self._health_task = asyncio.create_task(
                    self.pool.health_loop(self.health_interval_s)
                )
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self._health_task is not None:
                    self._health_task.cancel()
                await self.pool.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return


def _answer_problem(response: httpx.Response) -> str | None:
    """Why ``response`` is not an answer to pass on (a 502/503/504, or a 2xx whose body
    is not a JSON object), or ``None``."""
    status = response.status_code
    if status in RETRY_STATUSES:
        return f"HTTP {status}"
    if not 200 <= status < 300:
        return None  # the backend's verdict (a 400, a 404): passed on as it is
    try:
        if isinstance(json.loads(response.content), dict):
            return None
    except (ValueError, UnicodeDecodeError):
        pass
    start = response.content[:40]
    more = "..." if len(response.content) > 40 else ""
    return f"HTTP {status} with a body that is not a JSON object ({start!r}{more})"


# ------------------------------------------------------------------------------ ASGI helpers
def _json_fields(body: bytes) -> dict[str, Any]:
    """The body's top-level JSON object (empty when it is not one: the backend judges)."""
    try:
        value = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return {}
    return value if isinstance(value, dict) else {}
