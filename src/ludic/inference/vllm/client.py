"""A ``ChatClient`` for ludic's vLLM server (``ludic.inference.vllm.server``).

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
``max_retries`` times (httpx transport retries, exponential backoff), nothing else
is retried. A dead server raises ``ConnectionError`` / ``TimeoutError``, never hangs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import httpx
import torch

from ludic.inference.request import CompletionRequest
from ludic.inference.sampling import to_openai_params
from ludic.inference.vllm.http import (  # noqa: F401 (re-exported)
    KEEPALIVE_EXPIRY_S,
    VERSION_HEADER,
    AsyncHTTP,
    VLLMControlPlane,
    VLLMServerError,
)
from ludic.inference.vllm.weight_sync import VLLMConnection
from ludic.types import FINISH_REASONS, ChatResponse, TokenTrace

FINISH_REASON_MAP: dict[str, str] = {
    "stop": "stop",
    "length": "length",
    "abort": "abort",
    "tool_calls": "tool_calls",
    "repetition": "abort",  # vLLM cut a degenerate repetition short: not a natural stop
}
"""vLLM finish reasons -> ludic's (``ludic.types.FINISH_REASONS``)."""


# ------------------------------------------------------------------------------ client
class VLLMChatClient:
    """``ChatClient`` over a ludic vLLM server.

    Args:
        base_url: e.g. ``"http://127.0.0.1:8000"`` (default: from ``host``/``port``).
        model: the served model name (default: the server's first ``/v1/models`` entry).
        api_key: sent as ``Authorization: Bearer`` (the server's ``--api-key``).
        timeout_s: bound on every HTTP call, on the weight-sync group's collectives and
            on waiting for a sync to be applied.
        max_retries: connection failures (the request never reached the server) are
            retried this many times, with httpx's exponential backoff.
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
        max_connections: int = 256,
    ) -> None:
        self.base_url = (base_url or f"http://{host}:{port}").rstrip("/")
        self.model = model
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.connection = VLLMConnection(
            self.base_url,
            api_key=api_key,
            timeout_s=timeout_s,
            max_retries=max_retries,
            max_connections=max_connections,
        )
        self.http = self.connection.http
        self.control = self.connection.control
        self.weight_sync = self.connection.weight_sync

    # ---- ChatClient: generation ----------------------------------------------------
    async def complete(self, request: CompletionRequest) -> ChatResponse:
        body: dict[str, Any] = {
            "model": self.model or await self._served_model(),
            "prompt": [int(t) for t in request.prompt_token_ids],
            **to_openai_params(request.inference),
        }
        response = await self.http.post("/v1/completions", body)
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
                    "be vLLM >= 0.10 (return_token_ids) - start it with ludic.inference.vllm.server"
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
        response = await self.http.get("/v1/models")
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
        """Form the weight-sync group with the server's workers (see
        :meth:`WeightSyncSession.init`: ``backend`` gloo/nccl, default nccl when CUDA is
        available; ``master_port`` default a free port)."""
        self.weight_sync.init(
            backend=backend,
            master_addr=master_addr,
            master_port=master_port,
            strategy=strategy,
            extractor=extractor,
        )

    @property
    def publisher(self) -> Any:
        """The ``BroadcastPolicyPublisher`` after ``init_weight_sync`` (its ``extractor``
        sets the chunking)."""
        return self.weight_sync.publisher

    @property
    def sender(self) -> Any:
        """The weight-transfer sender (rank 0 of the group) after ``init_weight_sync``."""
        return self.weight_sync.sender

    def sync_weights(self, params: Mapping[str, torch.Tensor], *, version: int) -> str:
        """Push ``params`` (HF names -> tensors; a subset is fine) as policy ``version``;
        returns once every worker has loaded them, raises otherwise."""
        self.weight_sync.publish(params, version=version)
        return f"synced {len(params)} tensors to {self.base_url} as version {version}"

    def get_policy_version(self) -> int:
        """The server's runtime version (bumped by every completed sync)."""
        return self.control.runtime_version()

    # ---- lifecycle -----------------------------------------------------------------
    def close(self) -> None:
        """Leave the weight-sync group and close the HTTP clients."""
        self.connection.close()

    async def aclose(self) -> None:
        await self.connection.aclose()

    def __enter__(self) -> VLLMChatClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _finish_reason(reason: str | None) -> str | None:
    if reason is None:
        return None
    mapped = FINISH_REASON_MAP.get(reason)
    if mapped is None or mapped not in FINISH_REASONS:
        raise VLLMServerError(
            f"vLLM returned finish_reason={reason!r}; ludic knows {sorted(FINISH_REASON_MAP)} "
            "(add it to ludic.inference.vllm.client.FINISH_REASON_MAP)"
        )
    return mapped
