"""Reward-model inference contracts (docs/design.md, "Reward models"): scoring requests and
responses, the ``RewardModelClient`` protocol and the three training modes of a reward model.

A reward model here is a one-label sequence classifier (an LLM backbone plus a linear ``score``
head read at the last token): its raw output is a logit ``s``, ``sigmoid(s)`` with ``normalize``.
Implementations: :class:`ludic.inference.vllm.reward_client.VLLMRewardClient` (a vLLM reward
server, ``ludic serve reward``) and
:class:`ludic.inference.transformers_reward_client.TransformersRewardClient` (in process).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from ludic.distributed.reward_weights import RewardModelTrainingMode

POOLING_TYPES = ("last", "mean", "cls", "step")
"""Pooling names as in vLLM's pooler config (lower case). A server pools one way, set
when it starts; a request naming another is refused."""


def format_reward_input(prompt: str, response: str) -> str:
    """The text a reward model scores for ``response`` to ``prompt``: ``prompt``, a
    newline, ``response``. Preference training and RL scoring both use it by default, so
    the model is scored on the same layout it was trained on."""
    return f"{prompt}\n{response}"


@dataclass(frozen=True)
class ScoringRequest:
    """Texts (or token ids) to score.

    Args:
        inputs: one entry per sequence: a string (the server tokenizes it) or a list of
            token ids (scored exactly as given).
        model: the served model name (``None``: the client's default).
        normalize: apply the head's activation (sigmoid for one label); ``False`` returns
            the raw logit.
        pooling_type: must equal the server's pooling (``"last"`` for ludic's reward
            models); checked, never silently ignored.
        return_hidden_states: not supported by ludic's servers; ``True`` is refused.
    """

    inputs: Sequence[str | Sequence[int]]
    model: str | None = None
    normalize: bool = True
    pooling_type: str = "last"
    return_hidden_states: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.inputs, str):
            raise ValueError("ScoringRequest.inputs: expected a list of texts, got one string")
        if len(self.inputs) == 0:
            raise ValueError("ScoringRequest.inputs: nothing to score (empty list)")
        for i, x in enumerate(self.inputs):
            if isinstance(x, str):
                continue
            if not isinstance(x, Sequence) or not all(isinstance(t, int) for t in x) or not x:
                raise ValueError(
                    f"ScoringRequest.inputs[{i}]: expected a string or a non-empty list of "
                    f"token ids, got {type(x).__name__}"
                )
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(
                f"ScoringRequest.pooling_type={self.pooling_type!r}; expected one of "
                f"{POOLING_TYPES}"
            )
        if self.return_hidden_states:
            raise ValueError(
                "ScoringRequest.return_hidden_states=True is not supported: ludic's reward "
                "servers return scores only"
            )


@dataclass(frozen=True)
class ScoringResponse:
    """One score per input, in input order. ``model_version`` is the reward model's
    runtime version when the server received the request (``None`` if unknown)."""

    scores: list[float]
    model_version: int | None = None
    hidden_states: list[torch.Tensor] | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class RewardModelClient(Protocol):
    """A reward-model inference backend."""

    async def score(self, request: ScoringRequest) -> tuple[ScoringResponse, dict[str, Any]]:
        """Score a batch; returns the scores and transport details (``info``)."""
        ...

    async def score_batch(
        self, inputs: Sequence[str | Sequence[int]], *, normalize: bool = True
    ) -> list[float]:
        """Scores of ``inputs``, in order (one :meth:`score` request; inherited by a client
        that subclasses this protocol)."""
        response, _ = await self.score(ScoringRequest(inputs=list(inputs), normalize=normalize))
        return response.scores

    def sync_weights(
        self,
        params: Mapping[str, torch.Tensor],
        *,
        version: int | None = None,
        training_mode: RewardModelTrainingMode | str = RewardModelTrainingMode.FULL,
        timeout_s: float | None = None,
    ) -> str:
        """Push reward-model weights whose content matches ``training_mode`` (see
        :class:`RewardModelTrainingMode`); returns once the model serves them, raises
        otherwise (nothing is sent if ``params`` do not fit the mode)."""
        ...

    async def get_model_version(self) -> int:
        """The served reward model's version (bumped by every completed sync)."""
        ...
