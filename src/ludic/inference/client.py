"""The ``ChatClient`` contract every inference backend implements.

Token-in / token-out: the agent renders its prompt to token ids with a chat template and
the backend returns the completion's exact token ids and the chosen tokens' logprobs, so
training never re-tokenizes (no drift between what was sampled and what is trained).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from ludic.inference.request import CompletionRequest
from ludic.types import ChatResponse

if TYPE_CHECKING:
    import torch


@runtime_checkable
class ChatClient(Protocol):
    async def complete(self, request: CompletionRequest) -> ChatResponse:
        """One completion for ``request.prompt_token_ids``.

        Must return ``ChatResponse.trace`` with completion token ids when
        ``request.returns.return_token_ids`` and chosen-token logprobs when
        ``request.returns.return_logprobs``.
        """
        ...

    def sync_weights(self, params: Mapping[str, torch.Tensor], *, version: int) -> str:
        """Load ``params`` (HF parameter names -> tensors) into the serving model and
        tag it ``version``. Returns a short status string. Must raise on failure."""
        ...
