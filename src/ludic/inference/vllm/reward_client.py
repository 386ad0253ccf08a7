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
from typing import Any, Unpack

import torch

from ludic.distributed.reward_weights import HEAD_MODULES, reward_sync_params
from ludic.inference.reward_client import (
    RewardModelClient,
    RewardModelTrainingMode,
    ScoringRequest,
    ScoringResponse,
)
from ludic.inference.vllm.client import ConnectionOptions, VLLMConnection
from ludic.inference.vllm.http import VERSION_HEADER, VLLMServerError


class VLLMRewardClient(VLLMConnection, RewardModelClient):
    """``RewardModelClient`` over a ludic vLLM reward server.

    Args:
        model: the served model name sent with requests (default: none; the server
            scores with its one model).
        head_modules: module names of the classification head (for mode checks).
        check_server: ask ``/health`` at construction and refuse a server that is not a
            reward server (or a ``ludic serve router`` in front of reward servers).
        base_url, host, port, api_key, timeout_s, max_retries, max_connections,
            verify_sync: the connection's, as for the policy client
            (:class:`~ludic.inference.vllm.client.VLLMConnection`).
    """

    def __init__(
        self,
        base_url: str | None = None,
        *,
        port: int = 8001,
        model: str | None = None,
        max_connections: int = 64,
        head_modules: Sequence[str] = HEAD_MODULES,
        check_server: bool = True,
        **connection: Unpack[ConnectionOptions],
    ) -> None:
        super().__init__(base_url, port=port, max_connections=max_connections, **connection)
        self.model = model
        self.head_modules = tuple(head_modules)
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

    # ---- weights -------------------------------------------------------------------
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
        self.run_canary()
        return f"synced {len(clean)} reward-model tensors ({mode.value}) to {self.base_url}" + (
            "" if version is None else f" as version {version}"
        )

    async def get_model_version(self) -> int:
        """The served reward model's version (bumped by every completed sync)."""
        response = await self.http.get("/runtime_version")
        return int(response.json()["version"])
