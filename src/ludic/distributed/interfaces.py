"""Contracts for pushing trainer weights to inference runtimes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch


@runtime_checkable
class PolicyPublisher(Protocol):
    """Publishes a state dict (HF parameter names -> tensors) as policy ``version``.

    Must raise if the update cannot complete; a silent partial update is a bug.
    """

    def publish(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None: ...
