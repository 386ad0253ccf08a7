"""The router's backends: which may take a request, least-in-flight choice, leases that
cannot leak, and health checks (pure asyncio + httpx; the HTTP side is ``app``'s).

A :class:`Backend` is one server (base URL, API key) with its live state: requests in flight,
health, and the paths and models it serves (from its ``/openapi.json`` and ``/v1/models``;
unknown: everything). :class:`BackendPool` picks the healthy backend serving the path (and
model) with the fewest in flight, ties rotating; :meth:`BackendPool.lease` counts a request for
exactly its ``with`` block; :meth:`BackendPool.check` (``GET /health``) takes a failing backend
out until a later check answers 200.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

logger = logging.getLogger("ludic.inference.router")

KEEPALIVE_EXPIRY_S = 2.0
"""Idle pooled connections to a backend are not reused after this long: it must stay
below the backend's keep-alive timeout (uvicorn: 5 s), or a request can go out on a
connection the backend is closing."""


class NoBackendError(Exception):
    """No backend can take the request; ``status`` is the HTTP status to answer."""

    def __init__(self, message: str, status: int = 503) -> None:
        super().__init__(message)
        self.status = status


@dataclass(eq=False)
class Backend:
    """One server behind the router and its live state."""

    url: str
    api_key: str | None = field(default=None, repr=False)
    healthy: bool = False
    """Taking requests: set by health checks, cleared by a failed check or a broken
    connection."""
    in_flight: int = 0
    served: int = 0
    """Requests answered (any status the router passes on)."""
    failures: int = 0
    """Requests that failed here (connection, timeout, 502/503/504, a success whose body
    is not a JSON object) and went elsewhere."""
    paths: frozenset[str] | None = None
    """Routes it serves (``/openapi.json``); ``None``: unknown, assumed all."""
    models: frozenset[str] | None = None
    """Model names it serves (``/v1/models``); ``None``: unknown, assumed any."""
    last_error: str | None = None
    index: int = 0

    def __post_init__(self) -> None:
        self.url = backend_url(self.url)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def serves(self, path: str, model: str | None) -> bool:
        if self.paths is not None and not _path_matches(path, self.paths):
            return False
        return model is None or self.models is None or model in self.models

    def status(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "healthy": self.healthy,
            "in_flight": self.in_flight,
            "served": self.served,
            "failures": self.failures,
            "models": None if self.models is None else sorted(self.models),
            "last_error": self.last_error,
        }


def backend_url(url: str) -> str:
    """``url`` without a trailing ``/``; ``ValueError`` unless it is http(s)://host:port
    (a path after it is kept)."""
    stripped = url.rstrip("/")
    if not re.fullmatch(r"https?://[^/\s]+(/[^\s]*)?", stripped):
        raise ValueError(f"backend url {url!r}: expected http(s)://host:port")
    return stripped


def _path_matches(path: str, paths: frozenset[str]) -> bool:
    if path in paths:
        return True
    for template in paths:  # OpenAPI templates: /v1/models/{model}
        if "{" in template:
            pattern = re.sub(r"\\\{[^/]+?\\\}", "[^/]+", re.escape(template))
            if re.fullmatch(pattern, path):
                return True
    return False


class BackendPool:
    """Backends with least-in-flight choice and health checks (see the module docstring).

    Args:
        backends: the servers.
        request_timeout_s: most seconds one forwarded request may take on one backend.
        health_timeout_s: most seconds a health check may take.
        max_connections: connections per backend.
    """

    def __init__(
        self,
        backends: Sequence[Backend],
        *,
        request_timeout_s: float = 300.0,
        health_timeout_s: float = 5.0,
        max_connections: int = 256,
    ) -> None:
        if not backends:
            raise ValueError("BackendPool: give at least one backend")
        urls = [b.url for b in backends]
        if len(set(urls)) != len(urls):
            raise ValueError(f"BackendPool: a backend is listed twice: {urls}")
        if request_timeout_s <= 0 or health_timeout_s <= 0:
            raise ValueError("BackendPool: timeouts must be > 0")
        self.backends = list(backends)
        for i, backend in enumerate(self.backends):
            backend.index = i
        self.request_timeout_s = request_timeout_s
        self.health_timeout_s = health_timeout_s
        self.max_connections = max_connections
        self._next = 0  # rotation among equally busy backends
        self._clients: dict[int, httpx.AsyncClient] = {}

    # ---- choice -------------------------------------------------------------------
    def pick(
        self, path: str, model: str | None = None, *, exclude: Sequence[Backend] = ()
    ) -> Backend:
        """The healthy backend serving ``path`` (and ``model``) with the fewest requests
        in flight, skipping ``exclude``. Raises :class:`NoBackendError`: 404 when no
        backend serves it at all, 503 when those that do are down or excluded."""
        serving = [b for b in self.backends if b.serves(path, model)]
        if not serving:
            served = sorted({m for b in self.backends for m in (b.models or ())})
            what = f"model {model!r} on {path}" if model else path
            hint = f"; served models: {served}" if model and served else ""
            raise NoBackendError(f"no backend serves {what}{hint}", status=404)
        ready = [b for b in serving if b.healthy and b not in exclude]
        if not ready:
            states = ", ".join(
                f"{b.url} ({'tried' if b in exclude else 'down: ' + str(b.last_error)})"
                for b in serving
            )
            raise NoBackendError(f"no backend available for {path}: {states}", status=503)
        n = len(self.backends)
        chosen = min(ready, key=lambda b: (b.in_flight, (b.index - self._next) % n))
        self._next = (chosen.index + 1) % n
        return chosen

    @contextlib.contextmanager
    def lease(self, backend: Backend) -> Iterator[httpx.AsyncClient]:
        """Count one request in flight on ``backend`` for the block's duration."""
        backend.in_flight += 1
        try:
            yield self.client(backend)
        finally:
            backend.in_flight -= 1

    def mark_down(self, backend: Backend, error: str) -> None:
        if backend.healthy:
            logger.warning("router: backend %s down: %s", backend.url, error)
        backend.healthy = False
        backend.last_error = error

    # ---- HTTP -----------------------------------------------------------------------
    def client(self, backend: Backend) -> httpx.AsyncClient:
        client = self._clients.get(backend.index)
        if client is None:
            limits = httpx.Limits(
                max_connections=self.max_connections,
                max_keepalive_connections=self.max_connections,
                keepalive_expiry=KEEPALIVE_EXPIRY_S,
            )
            client = self._clients[backend.index] = httpx.AsyncClient(
                base_url=backend.url,
                headers=backend.headers,
                timeout=self.request_timeout_s,
                limits=limits,
            )
        return client

    async def aclose(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            await client.aclose()

    # ---- health -----------------------------------------------------------------
    async def check(self, backend: Backend) -> bool:
        """``GET /health`` on ``backend``; on 200 it takes requests (and what it serves
        is learned the first time); otherwise it takes none."""
        try:
            r = await self.client(backend).get("/health", timeout=self.health_timeout_s)
        except httpx.HTTPError as e:
            self.mark_down(backend, f"health check: {type(e).__name__}: {e}")
            return False
        if r.status_code != 200:
            self.mark_down(backend, f"health check: HTTP {r.status_code}")
            return False
        if backend.paths is None and backend.models is None:
            await self._discover(backend)
        if not backend.healthy:
            logger.info("router: backend %s healthy", backend.url)
        backend.healthy = True
        backend.last_error = None
        return True

    async def check_all(self) -> int:
        """Check every backend at once; the number healthy."""
        results = await asyncio.gather(*(self.check(b) for b in self.backends))
        return sum(results)

    async def health_loop(self, interval_s: float) -> None:
        """Check every ``interval_s`` seconds, forever (run it as a task)."""
        while True:
            started = time.monotonic()
            await self.check_all()
            await asyncio.sleep(max(0.0, interval_s - (time.monotonic() - started)))

    async def _discover(self, backend: Backend) -> None:
        client = self.client(backend)
        timeout = self.health_timeout_s
        with contextlib.suppress(httpx.HTTPError, ValueError, TypeError, AttributeError):
            r = await client.get("/openapi.json", timeout=timeout)
            if r.status_code == 200:
                backend.paths = frozenset(r.json()["paths"])
        with contextlib.suppress(httpx.HTTPError, ValueError, TypeError, KeyError):
            r = await client.get("/v1/models", timeout=timeout)
            if r.status_code == 200:
                backend.models = frozenset(str(m["id"]) for m in r.json()["data"])

    def status(self) -> list[dict[str, Any]]:
        return [b.status() for b in self.backends]
