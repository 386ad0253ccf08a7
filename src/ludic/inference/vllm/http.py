"""HTTP plumbing shared by ludic's vLLM clients (policy and reward): one retry and error
policy, the synchronous control plane (weight-sync routes), and a per-event-loop async
client for the data routes.

Every call is bounded by ``timeout_s``. A connection failure is retried ``max_retries`` times
(httpx transport retries, exponential backoff), and so is a control-plane read (``GET`` routes,
the status poll) whose connection the server dropped unanswered; nothing else is, since a
request that reached the server may have had an effect. A dead server raises
``ConnectionError`` / ``TimeoutError``, never hangs.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ssl
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from ludic.distributed.weight_transfer.base import (
    WeightSyncInfo,
    WeightUpdateRequest,
)

VERSION_HEADER = "x-ludic-policy-version"
"""Response header set by ludic's servers (policy and reward alike): the runtime version at
which the engine admitted the request (see ``ludic.inference.vllm.admission``)."""
VERSION_END_HEADER = "x-ludic-policy-version-end"
"""Response header: the runtime version when the response started. Greater than
:data:`VERSION_HEADER` when a weight sync landed while the request was being served
without a pause (its tokens may then straddle the two versions)."""


class VLLMServerError(RuntimeError):
    """The server answered with an error status (``status_code``) or reported a failed
    background task."""

    def __init__(
        self, message: str, status_code: int | None = None, server_error: str | None = None
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.server_error = server_error


# ------------------------------------------------------------------------------ HTTP
class _ErrorPolicy:
    """Shared error policy of the sync and async HTTP paths: httpx errors and error
    statuses become ``ConnectionError`` / ``TimeoutError`` / :class:`VLLMServerError`
    naming the server, the route and the fix."""

    def __init__(self, base_url: str, timeout_s: float, max_retries: int, api_key: str | None):
        if timeout_s <= 0 or max_retries < 0:
            raise ValueError(
                f"timeout_s={timeout_s}, max_retries={max_retries}; need timeout_s > 0 and "
                "max_retries >= 0"
            )
        self.base_url = base_url
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def attempts(self, read: bool) -> list[bool]:
        """One entry per time a request may be sent when the server drops its connection
        before answering (a read ``1 + max_retries`` times, anything else once), True for
        the last: a drop there, or any other error, is raised."""
        n = self.max_retries + 1 if read else 1
        return [i == n - 1 for i in range(n)]

    def limits(self, max_connections: int | None = None) -> httpx.Limits:
        return httpx.Limits(
            max_connections=max_connections,
            max_keepalive_connections=max_connections,
            keepalive_expiry=KEEPALIVE_EXPIRY_S,
        )

    def translate(self, path: str, err: httpx.HTTPError) -> Exception:
        if isinstance(err, _NEVER_REACHED):
            return ConnectionError(
                f"vLLM server at {self.base_url} unreachable ({path}, "
                f"{self.max_retries + 1} attempt(s)): {type(err).__name__}: {err}. Is it "
                "running? (start it with ludic.inference.vllm.process.start_vllm_server)"
            )
        if isinstance(err, httpx.TimeoutException):
            return TimeoutError(
                f"vLLM server at {self.base_url} did not answer {path} within "
                f"{self.timeout_s:.0f}s ({type(err).__name__}); raise timeout_s for long calls"
            )
        return ConnectionError(
            f"connection to vLLM server at {self.base_url} failed during {path}: "
            f"{type(err).__name__}: {err}"
        )

    def check(self, path: str, response: httpx.Response) -> httpx.Response:
        if response.status_code < 400:
            return response
        try:
            body: Any = response.json()
        except ValueError:
            body = response.text
        if isinstance(body, dict):
            body = body.get("detail") or body.get("error") or body
        hint = (
            " (pass the client api_key=... matching the server's --api-key)"
            if response.status_code == 401
            else ""
        )
        raise VLLMServerError(
            f"vLLM server {path} -> HTTP {response.status_code}: {body}{hint}", response.status_code
        )


@dataclass
class _Pool:
    client: httpx.AsyncClient
    in_flight: int = 0


_NEVER_REACHED = (httpx.ConnectError, httpx.ConnectTimeout)
"""What httpx's transport retries: the request never reached the server."""

_DROPPED = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)
"""The server closed the connection before its answer arrived: what a read (a request
without an effect) is sent again after, on a new connection."""

KEEPALIVE_EXPIRY_S = 2.0
"""Pooled connections idle longer than this are not reused. It must stay below the
server's keep-alive timeout (uvicorn's, ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``, 5 s by default):
otherwise a request sent after a training step longer than that can go out on a
connection the server is closing, and fail with a ReadError."""


class VLLMControlPlane:
    """Synchronous control-plane calls; implements the weight-transfer ``ControlPlane``
    protocol (:meth:`announce`, :meth:`wait_until_applied`)."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 60.0,
        max_retries: int = 3,
        poll_s: float = 0.05,
    ) -> None:
        self.policy = _ErrorPolicy(base_url, timeout_s, max_retries, api_key)
        self.http = httpx.Client(
            base_url=base_url,
            headers=self.policy.headers,
            timeout=timeout_s,
            transport=httpx.HTTPTransport(retries=max_retries, limits=self.policy.limits()),
        )
        self.poll_s = poll_s
        self._errors_before: int | None = None  # server error_count when this sync began
        self.record = True  # the workers record the next sync's checksums (verification)
        self.sync_bytes = 0  # bytes of the next sync: the server's deadlines grow with them
        self.last_report: dict[str, Any] | None = None  # fetched with the last applied poll

    # ---- ControlPlane -------------------------------------------------------------
    def announce(self, request: WeightUpdateRequest) -> None:
        """POST the chunk's metadata; the server's workers start receiving it."""
        first = self._errors_before is None  # the first chunk of a sync
        path = "/update_param_batch"
        if first:
            path += f"?first=true&bytes={int(self.sync_bytes)}"
            path += "" if self.record else "&record=false"
        reply = self.post(path, request.to_dict())
        if first:
            self._errors_before = int(reply["error_count"])

    def wait_until_applied(self, timeout_s: float) -> None:
        """Poll until the server has no background task left; raise the error it recorded
        during this sync (since the first :meth:`announce` / :meth:`init_communicator`)."""
        deadline = time.monotonic() + timeout_s
        before, self._errors_before = self._errors_before, None
        path = "/get_num_background_tasks" + ("?report=true" if self.record else "")
        self.last_report = None
        while True:
            status = self.post(path, read=True)
            if int(status["num_background_tasks"]) == 0:
                self.last_report = status.get("report")
                break
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"vLLM server at {self.policy.base_url} still has "
                    f"{status['num_background_tasks']} weight-sync task(s) after {timeout_s:.0f}s"
                )
            time.sleep(self.poll_s)
        if before is not None and int(status["error_count"]) > before:
            raise VLLMServerError(
                f"weight sync failed on the vLLM server at {self.policy.base_url}: "
                f"{status['last_error']} (see the server log; it keeps serving version "
                f"{status['version']})",
                server_error=status["last_error"],
            )

    def begin_sync(self) -> None:
        """Forget errors of earlier syncs; the next announce sets the baseline."""
        self._errors_before = None

    def settle(self, timeout_s: float) -> str | None:
        """After a failed sync: wait (best effort) for the server's background tasks and
        return the error it recorded during the sync, if any."""
        try:
            self.wait_until_applied(timeout_s)
        except VLLMServerError as e:
            return e.server_error or str(e)
        except (ConnectionError, TimeoutError) as e:
            return f"no status: the server did not answer ({type(e).__name__})"
        return None

    # ---- other control calls -----------------------------------------------------
    def init_communicator(self, info: WeightSyncInfo, strategy: str = "broadcast") -> None:
        """Ask the workers to join the group of ``info`` (``broadcast``), or to build the
        receiver of a CUDA IPC ``strategy`` (``info`` empty: no group)."""
        body = info.to_dict() if strategy == "broadcast" else {"strategy": strategy}
        reply = self.post("/init_communicator", body)
        self._errors_before = int(reply["error_count"])

    def close_communicator(self) -> None:
        self.post("/close_communicator")

    def load_weights_from_disk(self, path: str, version: int | None, timeout_s: float) -> None:
        """Have the server load the policy folder at ``path`` (a path on its machine) and
        wait until it has (at most ``timeout_s``), raising the error it recorded; its
        report is kept for :meth:`weight_report`."""
        reply = self.post("/load_weights_from_disk", {"path": path, "version": version})
        self._errors_before, self.record = int(reply["error_count"]), True
        self.wait_until_applied(timeout_s)

    def world_size(self) -> int:
        return int(self.get("/get_world_size")["world_size"])

    def runtime_version(self) -> int:
        return int(self.get("/runtime_version")["version"])

    def health(self) -> dict[str, Any]:
        return self.get("/health")

    def weight_report(self) -> dict[str, Any]:
        """``{"version", "boot_id", "dtype", "workers": [each worker's report of the last
        sync]}``: the one fetched with the last poll of :meth:`wait_until_applied`, if any
        (taken: it is returned once), else asked for."""
        report, self.last_report = self.last_report, None
        return report if report is not None else self.get("/weight_report")

    def pause(self, mode: str = "abort") -> None:
        self.post(f"/pause?mode={mode}")

    def resume(self) -> None:
        self.post("/resume")

    def reset_prefix_cache(self) -> None:
        self.post("/reset_prefix_cache")

    def sleep(self, level: int = 1) -> None:
        self.post(f"/sleep?level={int(level)}")

    def wake_up(self, tags: Sequence[str] = ()) -> None:
        query = "&".join(f"tags={tag}" for tag in tags)
        self.post("/wake_up" + (f"?{query}" if query else ""))

    def is_sleeping(self) -> bool:
        return bool(self.get("/is_sleeping")["is_sleeping"])

    def get(self, path: str) -> dict[str, Any]:
        """``GET path`` (a read: sent again if the server drops the connection)."""
        return self._call(path, lambda: self.http.get(path), read=True)

    def post(
        self, path: str, body: Mapping[str, Any] | None = None, *, read: bool = False
    ) -> dict[str, Any]:
        """``POST path``; ``read=True`` for a route without an effect on the server, which
        is then sent again if the server drops the connection before answering."""
        return self._call(path, lambda: self.http.post(path, json=dict(body or {})), read=read)

    def close(self) -> None:
        self.http.close()

    def _call(self, path: str, send: Callable[[], httpx.Response], read: bool) -> dict[str, Any]:
        for last in self.policy.attempts(read):
            try:
                return self.policy.check(path, send()).json()
            except httpx.HTTPError as e:
                if last or not isinstance(e, _DROPPED):
                    raise self.policy.translate(path, e) from e
        raise AssertionError("unreachable")  # the last attempt returns or raises


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    """httpx's default verifying context (``SSL_CERT_FILE`` / ``SSL_CERT_DIR`` honoured),
    built once: each transport would otherwise load the CA bundle again (~15 ms of CPU
    per pool, per event loop)."""
    return httpx.create_ssl_context()


POOL_SHARD_CONNECTIONS = 16
"""Connections per httpx pool of :class:`AsyncHTTP`. httpcore's pool does O(connections x
queued requests) work, with a syscall per idle connection, on every request start and end
(encode/httpcore#1035): with hundreds of requests in flight (async RL) that bookkeeping
took half of the rollout loop's CPU. Several small pools, each request sent through the
least busy, keep it linear."""


class AsyncHTTP:
    """Async ``POST``/``GET`` to one server with the shared retry policy; keeps its httpx
    pools per event loop (an httpx pool cannot cross loops): ``max_connections`` split
    into pools of :data:`POOL_SHARD_CONNECTIONS`, each request sent through the pool with
    the fewest requests in flight."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 60.0,
        max_retries: int = 3,
        max_connections: int = 256,
    ) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections={max_connections}; need >= 1")
        self.base_url = base_url
        self.max_connections = max_connections
        self.policy = _ErrorPolicy(base_url, timeout_s, max_retries, api_key)
        self._async: tuple[asyncio.AbstractEventLoop, list[_Pool]] | None = None

    async def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        with self._pool() as client:
            return await self._call(path, lambda: client.post(path, json=body))

    async def get(self, path: str) -> httpx.Response:
        """``GET path`` (a read: sent again if the server drops the connection)."""
        with self._pool() as client:
            return await self._call(path, lambda: client.get(path), read=True)

    def close(self) -> None:
        """Close the pools if their loop is idle (from synchronous code)."""
        if self._async is not None:
            loop, pools = self._async
            self._async = None
            if not loop.is_closed() and not loop.is_running():
                for pool in pools:
                    loop.run_until_complete(pool.client.aclose())

    async def aclose(self) -> None:
        if self._async is not None:
            _, pools = self._async
            self._async = None
            for pool in pools:
                await pool.client.aclose()

    @contextlib.contextmanager
    def _pool(self) -> Iterator[httpx.AsyncClient]:
        pool = min(self._pools(), key=lambda p: p.in_flight)
        pool.in_flight += 1
        try:
            yield pool.client
        finally:
            pool.in_flight -= 1

    def _pools(self) -> list[_Pool]:
        loop = asyncio.get_running_loop()
        if self._async is None or self._async[0] is not loop:
            shards = -(-self.max_connections // POOL_SHARD_CONNECTIONS)  # ceil
            sizes = [
                self.max_connections // shards + (i < self.max_connections % shards)
                for i in range(shards)
            ]
            pools = []
            for size in sizes:
                transport = httpx.AsyncHTTPTransport(
                    verify=_ssl_context(),
                    retries=self.policy.max_retries,
                    limits=self.policy.limits(size),
                )
                client = httpx.AsyncClient(
                    base_url=self.base_url,
                    headers=self.policy.headers,
                    timeout=self.policy.timeout_s,
                    transport=transport,
                )
                pools.append(_Pool(client))
            self._async = (loop, pools)
        return self._async[1]

    async def _call(
        self, path: str, send: Callable[[], Awaitable[httpx.Response]], read: bool = False
    ) -> httpx.Response:
        for last in self.policy.attempts(read):
            try:
                return self.policy.check(path, await send())
            except httpx.HTTPError as e:
                if last or not isinstance(e, _DROPPED):
                    raise self.policy.translate(path, e) from e
        raise AssertionError("unreachable")  # the last attempt returns or raises
