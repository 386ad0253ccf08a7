"""``PolicyPublisher`` implementations.

* :class:`ClientPolicyPublisher` pushes weights through any ChatClient-like object with
  ``sync_weights(params, version=)`` (e.g. a vLLM client).
* :class:`InMemoryPublisher` keeps the published weights in process (tests, and in-process
  inference backends that read them back).

Both refuse to publish NaN/inf weights, naming the offending tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ludic.distributed.weights import check_finite


class ClientPolicyPublisher:
    """Adapts ``client.sync_weights(params, *, version=)`` to ``PolicyPublisher``."""

    def __init__(self, client: Any) -> None:
        if not callable(getattr(client, "sync_weights", None)):
            raise TypeError(
                f"ClientPolicyPublisher needs a client with sync_weights(params, *, version=), "
                f"got {type(client).__name__}; pass a ChatClient whose backend supports "
                "weight updates"
            )
        self.client = client
        self.last_status: str | None = None
        self.last_version: int | None = None

    def publish(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        check_finite(state_dict)
        self.last_status = self.client.sync_weights(state_dict, version=version)
        self.last_version = version


class InMemoryPublisher:
    """Records every publish: ``versions`` in order and a detached copy of the latest
    weights in ``state_dict``. ``on_publish(state_dict, version)``, if given, is called
    after recording (e.g. to load the weights into an in-process inference model).
    """

    def __init__(
        self, on_publish: Callable[[Mapping[str, torch.Tensor], int], None] | None = None
    ) -> None:
        self.on_publish = on_publish
        self.versions: list[int] = []
        self.state_dict: dict[str, torch.Tensor] = {}

    @property
    def latest_version(self) -> int | None:
        return self.versions[-1] if self.versions else None

    def publish(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        check_finite(state_dict)
        # Copy: the trainer keeps updating its tensors in place after publishing.
        self.state_dict = {name: t.detach().clone() for name, t in state_dict.items()}
        self.versions.append(version)
        if self.on_publish is not None:
            self.on_publish(self.state_dict, version)
