"""The trainer's side of live weight sync with a ludic vLLM server (policy or reward):
form the process group with the server's workers, publish state dicts through it, leave.

Both :class:`~ludic.inference.vllm.client.VLLMChatClient` and
:class:`~ludic.inference.vllm.reward_client.VLLMRewardClient` hold one
:class:`WeightSyncSession`; the group, the transfer strategy and the publisher are the
weight-transfer layer's (``ludic.distributed.weight_transfer``), shared, not copied.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch

from ludic.inference.vllm.http import AsyncHTTP, VLLMControlPlane, VLLMServerError


class WeightSyncSession:
    """Rank 0 of one server's weight-sync group.

    Args:
        control: the server's control plane.
        timeout_s: bound on joining, on each collective and on waiting for a sync to be
            applied.
    """

    def __init__(self, control: VLLMControlPlane, *, timeout_s: float) -> None:
        self.control = control
        self.timeout_s = timeout_s
        self.sender: Any = None  # the weight-transfer sender after init
        self.publisher: Any = None  # BroadcastPolicyPublisher after init

    @property
    def base_url(self) -> str:
        return self.control.policy.base_url

    def init(
        self,
        *,
        backend: str | None = None,
        master_addr: str = "127.0.0.1",
        master_port: int | None = None,
        strategy: Any = None,
        extractor: Any = None,
    ) -> None:
        """Form the group: ask the server for its worker count, let its workers join
        (ranks 1..W, in the background) and join as rank 0 (hosting the rendezvous at
        ``master_addr:master_port``, default a free port). A busy ``master_port`` raises
        ``GroupPortBusyError`` naming it before the server is asked to do anything.

        ``backend``: ``"gloo"`` (CPU tensors) or ``"nccl"`` (default: nccl when CUDA is
        available). ``strategy`` / ``extractor`` default to ``BroadcastTransferStrategy``
        and ``ModelWeightExtractor()``.
        """
        from ludic.distributed.broadcast_publisher import BroadcastPolicyPublisher
        from ludic.distributed.weight_transfer import (
            BroadcastTransferStrategy,
            ModelWeightExtractor,
            check_port_free,
            free_port,
        )

        if self.sender is not None:
            raise RuntimeError("init_weight_sync was already called; call close() first")
        if master_port is None:
            master_port = free_port(master_addr)
        else:  # fail now, naming the port, not when every rank's join times out
            check_port_free(master_addr, master_port)
        if strategy is None:
            if backend is None:
                backend = "nccl" if torch.cuda.is_available() else "gloo"
            strategy = BroadcastTransferStrategy(backend=backend, timeout_s=self.timeout_s)
        info = strategy.create_sync_info(
            master_addr=master_addr,
            master_port=master_port,
            world_size=self.control.world_size() + 1,
        )
        self.control.init_communicator(info)  # the workers join in the background
        try:
            sender = strategy.create_sender(info)  # blocks until every rank has joined
        except Exception as e:
            self._note_server_error(e)
            raise
        try:
            self.control.wait_until_applied(self.timeout_s)  # raises if a worker failed
        except BaseException:
            close_quietly(sender)
            raise
        self.sender = sender
        self.publisher = BroadcastPolicyPublisher(
            sender,
            self.control,
            extractor or ModelWeightExtractor(),
            apply_timeout_s=self.timeout_s,
        )

    def publish(self, params: Mapping[str, torch.Tensor], *, version: int | None) -> None:
        """Push ``params`` (served names -> tensors; a subset is fine); returns once every
        worker has loaded them, raises otherwise (with the server's own error attached)."""
        if self.publisher is None:
            raise RuntimeError(
                f"weight sync with {self.base_url} needs a group: call "
                "client.init_weight_sync() once before the first sync"
            )
        self.control.begin_sync()
        try:
            self.publisher.publish(params, version)
        except Exception as e:
            self._note_server_error(e)
            raise

    def close(self) -> None:
        """Leave the group (telling the server, if it still answers)."""
        sender, self.sender, self.publisher = self.sender, None, None
        if sender is not None:
            # the server may be gone or broken; release our side regardless
            with contextlib.suppress(ConnectionError, TimeoutError, VLLMServerError):
                self.control.close_communicator()
            close_quietly(sender)

    def _note_server_error(self, error: Exception) -> None:
        """Let the server settle what it was given and attach its side of the failure."""
        server_error = self.control.settle(self.timeout_s)
        if server_error:
            error.add_note(f"vLLM server at {self.base_url} reported: {server_error}")


def close_quietly(sender: Any) -> None:
    close = getattr(sender, "close", None) or getattr(getattr(sender, "pg", None), "shutdown", None)
    if close is not None:
        with contextlib.suppress(Exception):  # a broken group may refuse to shut down
            close()


class VLLMConnection:
    """What a ludic client keeps open to one server: the async data routes (``http``), the
    synchronous control plane (``control``) and the weight-sync session (``weight_sync``),
    with one retry policy and one timeout."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 60.0,
        max_retries: int = 3,
        max_connections: int = 256,
    ) -> None:
        self.http = AsyncHTTP(
            base_url,
            api_key=api_key,
            timeout_s=timeout_s,
            max_retries=max_retries,
            max_connections=max_connections,
        )
        self.control = VLLMControlPlane(
            base_url,
            api_key=api_key,
            timeout_s=timeout_s,
            max_retries=max_retries,
        )
        self.weight_sync = WeightSyncSession(self.control, timeout_s=timeout_s)

    def close(self) -> None:
        """Leave the weight-sync group (telling the server, if it still answers) and close
        the HTTP clients."""
        self.weight_sync.close()
        self.control.close()
        self.http.close()

    async def aclose(self) -> None:
        await self.http.aclose()
        self.close()
