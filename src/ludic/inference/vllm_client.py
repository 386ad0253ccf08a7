"""A ``ChatClient`` for ludic's vLLM server (``ludic.inference.vllm_server``).

* Generation: token-in ``POST /v1/completions`` (``prompt`` = the rendered token ids) with
  ``return_token_ids`` and ``logprobs=0``; the reply becomes a ``ChatResponse`` whose
  ``TokenTrace`` holds the exact completion ids, the chosen tokens' logprobs, the finish
  reason and the policy version that served the request.
* Weight sync: :meth:`VLLMChatClient.init_weight_sync` joins the server's workers in a
  process group as rank 0; :meth:`VLLMChatClient.sync_weights` then pushes a state dict
  chunk by chunk (HTTP announces each chunk, the group moves the bytes) and waits until
  every worker has loaded it.

    client = VLLMChatClient("http://127.0.0.1:8000")
    client.init_weight_sync()                      # gloo on CPU, nccl on GPU
    response = await client.complete(CompletionRequest(prompt_token_ids=ids))
    client.sync_weights(model.state_dict(), version=1)

Every HTTP call is bounded by ``timeout_s``; connection failures are retried
``max_retries`` times with exponential backoff (``backoff_s * 2**attempt``), nothing else
is retried. A dead server raises ``ConnectionError`` / ``TimeoutError``, never hangs.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import httpx
import torch

from ludic.distributed.weight_transfer.base import (
    TorchDistributedWeightSyncInfo,
    WeightUpdateRequest,
)
from ludic.inference.request import CompletionRequest
from ludic.inference.sampling import to_openai_params
from ludic.types import FINISH_REASONS, ChatResponse, TokenTrace

VERSION_HEADER = "x-ludic-policy-version"  # set by ludic.inference.vllm_server

FINISH_REASON_MAP: dict[str, str] = {
    "stop": "stop",
    "length": "length",
    "abort": "abort",
    "tool_calls": "tool_calls",
    "repetition": "abort",  # vLLM cut a degenerate repetition short: not a natural stop
}
"""vLLM finish reasons -> ludic's (``ludic.types.FINISH_REASONS``)."""


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
class _Retrying:
    """Shared retry / error policy of the sync and async HTTP paths."""

    def __init__(self, base_url: str, timeout_s: float, max_retries: int, backoff_s: float):
        if timeout_s <= 0 or max_retries < 0 or backoff_s < 0:
            raise ValueError(
                f"timeout_s={timeout_s}, max_retries={max_retries}, backoff_s={backoff_s}; "
                "need timeout_s > 0, max_retries >= 0, backoff_s >= 0"
            )
        self.base_url = base_url
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s

    def retry_delay(self, attempt: int, deadline: float) -> float | None:
        """Seconds to sleep before retrying failed attempt ``attempt`` (0-based), or
        ``None`` when the retries or the time (``deadline``) are used up."""
        delay = self.backoff_s * 2**attempt
        if attempt >= self.max_retries or time.monotonic() + delay >= deadline:
            return None
        return delay

    def unreachable(self, path: str, attempts: int, err: Exception) -> ConnectionError:
        return ConnectionError(
            f"vLLM server at {self.base_url} unreachable ({path}, {attempts} attempt(s)): "
            f"{type(err).__name__}: {err}. Is it running? (start it with "
            "ludic.inference.vllm_utils.start_vllm_server)"
        )

    def translate(self, path: str, err: httpx.HTTPError) -> Exception:
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
            " (pass VLLMChatClient(api_key=...) matching the server's --api-key)"
            if response.status_code == 401
            else ""
        )
        raise VLLMServerError(
            f"vLLM server {path} -> HTTP {response.status_code}: {body}{hint}", response.status_code
        )


_RETRYABLE = (httpx.ConnectError, httpx.ConnectTimeout)  # the request never reached the server

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
        backoff_s: float = 0.5,
        poll_s: float = 0.05,
    ) -> None:
        self.policy = _Retrying(base_url, timeout_s, max_retries, backoff_s)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(
            base_url=base_url,
            headers=headers,
            timeout=timeout_s,
            limits=httpx.Limits(keepalive_expiry=KEEPALIVE_EXPIRY_S),
        )
        self.poll_s = poll_s
        self._errors_before: int | None = None  # server error_count when this sync began

    # ---- ControlPlane -------------------------------------------------------------
    def announce(self, request: WeightUpdateRequest) -> None:
        """POST the chunk's metadata; the server's workers start receiving it."""
        first = self._errors_before is None  # the first chunk of a sync
        path = "/update_param_batch?first=true" if first else "/update_param_batch"
        reply = self.post(path, request.to_dict())
        if first:
            self._errors_before = int(reply["error_count"])

    def wait_until_applied(self, timeout_s: float) -> None:
        """Poll until the server has no background task left; raise the error it recorded
        during this sync (since the first :meth:`announce` / :meth:`init_communicator`)."""
        deadline = time.monotonic() + timeout_s
        before, self._errors_before = self._errors_before, None
        while True:
            status = self.post("/get_num_background_tasks")
            if int(status["num_background_tasks"]) == 0:
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
    def init_communicator(self, info: TorchDistributedWeightSyncInfo) -> None:
        reply = self.post("/init_communicator", info.to_dict())
        self._errors_before = int(reply["error_count"])

    def close_communicator(self) -> None:
        self.post("/close_communicator")

    def world_size(self) -> int:
        return int(self.get("/get_world_size")["world_size"])

    def runtime_version(self) -> int:
        return int(self.get("/runtime_version")["version"])

    def health(self) -> dict[str, Any]:
        return self.get("/health")

    def pause(self, mode: str = "abort") -> None:
        self.post(f"/pause?mode={mode}")

    def resume(self) -> None:
        self.post("/resume")

    def reset_prefix_cache(self) -> None:
        self.post("/reset_prefix_cache")

    def get(self, path: str) -> dict[str, Any]:
        return self._call(path, lambda: self.http.get(path))

    def post(self, path: str, body: Mapping[str, Any] | None = None) -> dict[str, Any]:
        return self._call(path, lambda: self.http.post(path, json=dict(body or {})))

    def close(self) -> None:
        self.http.close()

    def _call(self, path: str, send: Callable[[], httpx.Response]) -> dict[str, Any]:
        deadline = time.monotonic() + self.policy.timeout_s
        for attempt in itertools.count():
            try:
                return self.policy.check(path, send()).json()
            except _RETRYABLE as e:
                delay = self.policy.retry_delay(attempt, deadline)
                if delay is None:
                    raise self.policy.unreachable(path, attempt + 1, e) from e
                time.sleep(delay)
            except httpx.HTTPError as e:
                raise self.policy.translate(path, e) from e
        raise AssertionError("itertools.count() does not end")


# ------------------------------------------------------------------------------ client
class VLLMChatClient:
    """``ChatClient`` over a ludic vLLM server.

    Args:
        base_url: e.g. ``"http://127.0.0.1:8000"`` (default: from ``host``/``port``).
        model: the served model name (default: the server's first ``/v1/models`` entry).
        api_key: sent as ``Authorization: Bearer`` (the server's ``--api-key``).
        timeout_s: bound on every HTTP call, on the weight-sync group's collectives and
            on waiting for a sync to be applied.
        max_retries, backoff_s: connection failures are retried after
            ``backoff_s * 2**attempt`` seconds.
        max_connections: concurrent completion requests kept open.

    ``TokenTrace.policy_version`` is the server's runtime version when it received the
    request (the ``x-ludic-policy-version`` header); a sync that lands while a request is
    being generated is not reflected in it.
    """

    def __init__(
        self,
        base_url: str | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 8000,
        model: str | None = None,
        api_key: str | None = None,
        timeout_s: float = 60.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        max_connections: int = 256,
    ) -> None:
        self.base_url = (base_url or f"http://{host}:{port}").rstrip("/")
        self.model = model
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.max_connections = max_connections
        self.policy = _Retrying(self.base_url, timeout_s, max_retries, backoff_s)
        self.control = VLLMControlPlane(
            self.base_url,
            api_key=api_key,
            timeout_s=timeout_s,
            max_retries=max_retries,
            backoff_s=backoff_s,
        )
        self._async: tuple[asyncio.AbstractEventLoop, httpx.AsyncClient] | None = None
        self._publisher: Any = None  # BroadcastPolicyPublisher after init_weight_sync
        self._sender: Any = None

    # ---- ChatClient: generation ----------------------------------------------------
    async def complete(self, request: CompletionRequest) -> ChatResponse:
        body: dict[str, Any] = {
            "model": self.model or await self._served_model(),
            "prompt": [int(t) for t in request.prompt_token_ids],
            **to_openai_params(request.inference),
        }
        response = await self._apost("/v1/completions", body)
        return self._to_chat_response(request, response)

    def _to_chat_response(
        self, request: CompletionRequest, response: httpx.Response
    ) -> ChatResponse:
        data = response.json()
        choice = data["choices"][0]
        finish = _finish_reason(choice.get("finish_reason"))
        version_header = response.headers.get(VERSION_HEADER)
        version = int(version_header) if version_header is not None else None
        trace = None
        if request.returns.return_token_ids:
            token_ids = choice.get("token_ids")
            if token_ids is None:
                raise VLLMServerError(
                    f"{self.base_url}/v1/completions returned no token_ids; the server must "
                    "be vLLM >= 0.10 (return_token_ids) - start it with ludic.inference.vllm_server"
                )
            logprobs = None
            if request.returns.return_logprobs:
                logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
                if logprobs is None or any(lp is None for lp in logprobs):
                    raise VLLMServerError(
                        f"{self.base_url}/v1/completions returned no chosen-token logprobs "
                        f"(got {logprobs!r}) although logprobs=0 was requested"
                    )
            trace = TokenTrace(
                prompt_token_ids=request.prompt_token_ids,
                completion_token_ids=tuple(int(t) for t in token_ids),
                completion_logprobs=None if logprobs is None else tuple(map(float, logprobs)),
                finish_reason=finish,
                policy_version=version,
            )
        meta = {"id": data.get("id"), "policy_version": version}
        return ChatResponse(
            text=choice.get("text") or "", finish_reason=finish, trace=trace, meta=meta
        )

    async def _served_model(self) -> str:
        response = await self._aget("/v1/models")
        models = response.json().get("data") or []
        if not models:
            raise VLLMServerError(f"{self.base_url}/v1/models lists no model; pass model=")
        self.model = str(models[0]["id"])
        return self.model

    # ---- ChatClient: weights -----------------------------------------------------
    def init_weight_sync(
        self,
        *,
        backend: str | None = None,
        master_addr: str = "127.0.0.1",
        master_port: int | None = None,
        strategy: Any = None,
        extractor: Any = None,
    ) -> None:
        """Form the weight-sync group: ask the server for its worker count, let its workers
        join (ranks 1..W, in the background) and join as rank 0 (hosting the rendezvous at
        ``master_addr:master_port``, default a free port).

        ``backend``: ``"gloo"`` (CPU tensors) or ``"nccl"`` (default: nccl when CUDA is
        available). ``strategy`` / ``extractor`` default to ``BroadcastTransferStrategy``
        and ``ModelWeightExtractor()``.
        """
        from ludic.distributed.broadcast_publisher import BroadcastPolicyPublisher
        from ludic.distributed.weight_transfer import (
            BroadcastTransferStrategy,
            ModelWeightExtractor,
            free_port,
        )

        if self._sender is not None:
            raise RuntimeError("init_weight_sync was already called; call close() first")
        if strategy is None:
            if backend is None:
                backend = "nccl" if torch.cuda.is_available() else "gloo"
            strategy = BroadcastTransferStrategy(backend=backend, timeout_s=self.timeout_s)
        info = strategy.create_sync_info(
            master_addr=master_addr,
            master_port=master_port or free_port(master_addr),
            world_size=self.control.world_size() + 1,
        )
        self.control.init_communicator(info)  # the workers join in the background
        try:
            sender = strategy.create_sender(info)  # blocks until every rank has joined
        except Exception as e:
            server_error = self.control.settle(self.timeout_s)
            if server_error:
                e.add_note(f"vLLM server at {self.base_url} reported: {server_error}")
            raise
        try:
            self.control.wait_until_applied(self.timeout_s)  # raises if a worker failed
        except BaseException:
            _close_quietly(sender)
            raise
        self._sender = sender
        self._publisher = BroadcastPolicyPublisher(
            sender,
            self.control,
            extractor or ModelWeightExtractor(),
            apply_timeout_s=self.timeout_s,
        )

    @property
    def publisher(self) -> Any:
        """The ``BroadcastPolicyPublisher`` after ``init_weight_sync`` (its ``extractor``
        sets the chunking)."""
        return self._publisher

    @property
    def sender(self) -> Any:
        """The weight-transfer sender (rank 0 of the group) after ``init_weight_sync``."""
        return self._sender

    def sync_weights(self, params: Mapping[str, torch.Tensor], *, version: int) -> str:
        """Push ``params`` (HF names -> tensors; a subset is fine) as policy ``version``;
        returns once every worker has loaded them, raises otherwise."""
        if self._publisher is None:
            raise RuntimeError(
                "VLLMChatClient.sync_weights needs a weight-sync group: call "
                "client.init_weight_sync() once before the first sync"
            )
        self.control.begin_sync()
        try:
            self._publisher.publish(params, version)
        except Exception as e:
            # Let the server settle the chunks it was given and report its side.
            server_error = self.control.settle(self.timeout_s)
            if server_error:
                e.add_note(f"vLLM server at {self.base_url} reported: {server_error}")
            raise
        return f"synced {len(params)} tensors to {self.base_url} as version {version}"

    def get_policy_version(self) -> int:
        """The server's runtime version (bumped by every completed sync)."""
        return self.control.runtime_version()

    # ---- lifecycle -----------------------------------------------------------------
    def close(self) -> None:
        """Leave the weight-sync group (telling the server, if it still answers) and close
        the HTTP clients."""
        sender, self._sender, self._publisher = self._sender, None, None
        if sender is not None:
            # the server may be gone or broken; release our side regardless
            with contextlib.suppress(ConnectionError, TimeoutError, VLLMServerError):
                self.control.close_communicator()
            _close_quietly(sender)
        self.control.close()
        if self._async is not None:
            loop, client = self._async
            self._async = None
            if not loop.is_closed() and not loop.is_running():
                loop.run_until_complete(client.aclose())

    async def aclose(self) -> None:
        if self._async is not None:
            _, client = self._async
            self._async = None
            await client.aclose()
        self.close()

    def __enter__(self) -> VLLMChatClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- async HTTP --------------------------------------------------------------
    def _client(self) -> httpx.AsyncClient:
        """One ``AsyncClient`` per event loop (an httpx pool cannot cross loops)."""
        loop = asyncio.get_running_loop()
        if self._async is None or self._async[0] is not loop:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            limits = httpx.Limits(
                max_connections=self.max_connections,
                max_keepalive_connections=self.max_connections,
                keepalive_expiry=KEEPALIVE_EXPIRY_S,
            )
            client = httpx.AsyncClient(
                base_url=self.base_url, headers=headers, timeout=self.timeout_s, limits=limits
            )
            self._async = (loop, client)
        return self._async[1]

    async def _apost(self, path: str, body: dict[str, Any]) -> httpx.Response:
        return await self._acall(path, lambda: self._client().post(path, json=body))

    async def _aget(self, path: str) -> httpx.Response:
        return await self._acall(path, lambda: self._client().get(path))

    async def _acall(
        self, path: str, send: Callable[[], Awaitable[httpx.Response]]
    ) -> httpx.Response:
        deadline = time.monotonic() + self.policy.timeout_s
        for attempt in itertools.count():
            try:
                return self.policy.check(path, await send())
            except _RETRYABLE as e:
                delay = self.policy.retry_delay(attempt, deadline)
                if delay is None:
                    raise self.policy.unreachable(path, attempt + 1, e) from e
                await asyncio.sleep(delay)
            except httpx.HTTPError as e:
                raise self.policy.translate(path, e) from e
        raise AssertionError("itertools.count() does not end")


def _finish_reason(reason: str | None) -> str | None:
    if reason is None:
        return None
    mapped = FINISH_REASON_MAP.get(reason)
    if mapped is None or mapped not in FINISH_REASONS:
        raise VLLMServerError(
            f"vLLM returned finish_reason={reason!r}; ludic knows {sorted(FINISH_REASON_MAP)} "
            "(add it to ludic.inference.vllm_client.FINISH_REASON_MAP)"
        )
    return mapped


def _close_quietly(sender: Any) -> None:
    close = getattr(sender, "close", None) or getattr(getattr(sender, "pg", None), "shutdown", None)
    if close is not None:
        with contextlib.suppress(Exception):  # a broken group may refuse to shut down
            close()
