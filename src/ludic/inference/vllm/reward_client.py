"""A ``RewardModelClient`` for ludic's vLLM reward server (``ludic serve reward``).

Scoring: ``POST /score`` with every input of a request in one call (texts or token ids);
``normalize=True`` returns the sigmoid, ``False`` the raw logit. Weight sync: the policy
client's group, transfer layer and control plane (``WeightSyncSession``); ``sync_weights``
first checks the tensors against the training mode (``reward_sync_params``), so a sync that
does not fit is refused before anything is announced. Policy and reward servers run side by
side, each client with its own group. Usage: docs/reward-models.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ludic.distributed.reward_weights import HEAD_MODULES, reward_sync_params
from ludic.inference.reward_client import (
    RewardModelTrainingMode,
    ScoringRequest,
    ScoringResponse,
)
from ludic.inference.vllm.canary import Canary
from ludic.inference.vllm.http import VERSION_HEADER, VLLMServerError
from ludic.inference.vllm.weight_sync import VerifySync, VLLMConnection


class VLLMRewardClient:
    """``RewardModelClient`` over a ludic vLLM reward server.

    Args:
        base_url: e.g. ``"http://127.0.0.1:8001"`` (default: from ``host``/``port``).
        model: the served model name sent with requests (default: none; the server
            scores with its one model).
        api_key: sent as ``Authorization: Bearer`` (the server's ``--api-key``).
        timeout_s: bound on every HTTP call, on the weight-sync collectives and on waiting
            for a sync to be applied.
        max_retries: connection failures (the request never reached the server) are
            retried this many times, with httpx's exponential backoff.
        head_modules: module names of the classification head (for mode checks).
        check_server: ask ``/health`` at construction and refuse a server that is not a
            reward server (or a ``ludic serve router`` in front of reward servers).
        verify_sync: which syncs are verified (``"every"``, ``"first"``, ``"off"``), as
            for :class:`~ludic.inference.vllm.client.VLLMChatClient`.
    """

    def __init__(
        self,
        base_url: str | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 8001,
        model: str | None = None,
        api_key: str | None = None,
        timeout_s: float = 60.0,
        max_retries: int = 3,
        max_connections: int = 64,
        head_modules: Sequence[str] = HEAD_MODULES,
        check_server: bool = True,
        verify_sync: VerifySync = "every",
    ) -> None:
        self.base_url = (base_url or f"http://{host}:{port}").rstrip("/")
        self.model = model
        self.timeout_s = timeout_s
        self.head_modules = tuple(head_modules)
        self.connection = VLLMConnection(
            self.base_url,
            api_key=api_key,
            timeout_s=timeout_s,
            max_retries=max_retries,
            max_connections=max_connections,
            verify_sync=verify_sync,
        )
        self.http = self.connection.http
        self.control = self.connection.control
        self.weight_sync = self.connection.weight_sync
        if check_server:
            kind = self.control.health().get("type")
            if kind not in ("reward_model", "router"):  # a router: over reward servers
                self.control.close()
                raise ValueError(
                    f"{self.base_url} is a {kind!r} server, not a reward model server; start "
                    "one with `ludic serve reward --model DIR` (or pass the right port)"
                )

    # ---- scoring -------------------------------------------------------------------
    async def score(self, request: ScoringRequest) -> tuple[ScoringResponse, dict[str, Any]]:
        """Score every input of ``request`` in one ``/score`` call."""
        body: dict[str, Any] = {
            "input": [x if isinstance(x, str) else [int(t) for t in x] for x in request.inputs],
            "normalize": request.normalize,
            "pooling_type": request.pooling_type,
        }
        model = request.model or self.model
        if model is not None:
            body["model"] = model
        response = await self.http.post("/score", body)
        data = response.json()
        items = data.get("data")
        if not isinstance(items, list) or len(items) != len(request.inputs):
            raise VLLMServerError(
                f"{self.base_url}/score returned {len(items) if isinstance(items, list) else 0} "
                f"score(s) for {len(request.inputs)} input(s)"
            )
        scores = [0.0] * len(items)
        for item in items:
            scores[int(item["index"])] = float(item["score"])
        header = response.headers.get(VERSION_HEADER)
        version = int(header) if header is not None else None
        result = ScoringResponse(
            scores=scores,
            model_version=version,
            metadata={"model": data.get("model"), "usage": data.get("usage")},
        )
        return result, {"request": body, "status_code": response.status_code}

    async def score_batch(
        self, inputs: Sequence[str | Sequence[int]], *, normalize: bool = True
    ) -> list[float]:
        """Scores of ``inputs``, in order."""
        response, _ = await self.score(ScoringRequest(inputs=list(inputs), normalize=normalize))
        return response.scores

    # ---- weights -------------------------------------------------------------------
    def init_weight_sync(
        self,
        *,
        backend: str | None = None,
        master_addr: str = "127.0.0.1",
        master_port: int | None = None,
        strategy: Any = None,
        extractor: Any = None,
    ) -> None:
        """Form the weight-sync group with the reward server's workers (as the policy
        client does; a free rendezvous port by default, so it never collides with the
        policy server's group)."""
        self.weight_sync.init(
            backend=backend,
            master_addr=master_addr,
            master_port=master_port,
            strategy=strategy,
            extractor=extractor,
        )

    @property
    def publisher(self) -> Any:
        """The underlying ``BroadcastPolicyPublisher`` after ``init_weight_sync`` (wrap it
        with ``create_reward_publisher(client)`` to get mode checks in a Trainer)."""
        return self.weight_sync.publisher

    def sync_weights(
        self,
        params: Mapping[str, torch.Tensor],
        *,
        version: int | None = None,
        training_mode: RewardModelTrainingMode | str = RewardModelTrainingMode.FULL,
        timeout_s: float | None = None,
    ) -> str:
        """Push reward-model weights; ``params`` must fit ``training_mode`` (HEAD_ONLY: head
        tensors only; LORA: merged weights; FULL: everything). Raises before anything is
        sent if they do not; raises if the server does not load them. ``version``
        (default: the server's version + 1) becomes the served model version.
        ``timeout_s`` overrides the client's timeout for waiting on this sync."""
        mode = RewardModelTrainingMode.parse(training_mode)
        clean = reward_sync_params(params, mode, head_modules=self.head_modules)
        publisher = self.weight_sync.publisher
        if timeout_s is None or publisher is None:
            self.weight_sync.publish(clean, version=version)
        else:
            usual, publisher.apply_timeout_s = publisher.apply_timeout_s, timeout_s
            try:
                self.weight_sync.publish(clean, version=version)
            finally:
                publisher.apply_timeout_s = usual
        with self.weight_sync.stage("canary"):
            self.weight_sync.run_canary()
        return f"synced {len(clean)} reward-model tensors ({mode.value}) to {self.base_url}" + (
            "" if version is None else f" as version {version}"
        )

    def set_canary(self, canary: Canary | None, *, every: int = 10) -> None:
        """Check the server's raw score of ``canary``'s fixed tokens against the trainer's
        (``canary``: a ``RewardCanary`` of the reward model being trained) after the first
        verified sync and every ``every`` syncs (``ludic.inference.vllm.canary``)."""
        self.weight_sync.canary, self.weight_sync.canary_every = canary, every

    async def get_model_version(self) -> int:
        """The served reward model's version (bumped by every completed sync)."""
        response = await self.http.get("/runtime_version")
        return int(response.json()["version"])

    # ---- lifecycle -----------------------------------------------------------------
    def close(self) -> None:
        """Leave the weight-sync group and close the HTTP clients."""
        self.connection.close()

    async def aclose(self) -> None:
        await self.connection.aclose()

    def __enter__(self) -> VLLMRewardClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
