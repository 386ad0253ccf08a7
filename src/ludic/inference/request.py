"""Pure-data inference requests: what to sample, what to return, and the token-in request.

``InferenceSpec`` is what a rollout request carries; ``CompletionRequest`` is what an
agent sends to a ``ChatClient`` after it has rendered its prompt to token ids.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any


@dataclass(frozen=True)
class SamplingSpec:
    """Sampling parameters for one completion. ``seed=None`` means unseeded."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", tuple(self.stop))
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"SamplingSpec.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingSpec.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"SamplingSpec.top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"SamplingSpec.max_tokens must be >= 1, got {self.max_tokens}")

    def with_seed(self, seed: int | None) -> SamplingSpec:
        return replace(self, seed=seed)


@dataclass(frozen=True)
class ReturnSpec:
    """What the backend must return besides text.

    RL needs the exact completion token ids (drift-free training) and the chosen tokens'
    logprobs (behaviour policy, for ratio-based losses): use :meth:`for_rl`.
    """

    return_token_ids: bool = True
    return_logprobs: bool = True

    def __post_init__(self) -> None:
        if self.return_logprobs and not self.return_token_ids:
            raise ValueError(
                "ReturnSpec: return_logprobs=True needs return_token_ids=True "
                "(logprobs are aligned to completion token ids)"
            )

    @classmethod
    def for_rl(cls) -> ReturnSpec:
        return cls(return_token_ids=True, return_logprobs=True)

    @classmethod
    def for_eval(cls) -> ReturnSpec:
        return cls(return_token_ids=False, return_logprobs=False)


@dataclass(frozen=True)
class InferenceSpec:
    """Sampling + return options + backend extras for every model call of a rollout.

    ``max_think``: if set, a backend that supports it forces ``</think>`` after this many
    thinking tokens.
    """

    sampling: SamplingSpec = field(default_factory=SamplingSpec)
    returns: ReturnSpec = field(default_factory=ReturnSpec.for_rl)
    max_think: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def with_seed(self, seed: int | None) -> InferenceSpec:
        return replace(self, sampling=self.sampling.with_seed(seed))


@dataclass(frozen=True)
class CompletionRequest:
    """A token-in completion request: the rendered prompt's token ids plus options.

    ``session_id``: requests of one session (an agent's episode) go to the same server of
    a pool (``ludic.inference.vllm.pool``), whose prefix cache holds the earlier turns.
    """

    prompt_token_ids: tuple[int, ...]
    inference: InferenceSpec = field(default_factory=InferenceSpec)
    request_id: str | None = None
    session_id: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_token_ids", tuple(self.prompt_token_ids))
        if not self.prompt_token_ids:
            raise ValueError("CompletionRequest: prompt_token_ids is empty")

    @property
    def sampling(self) -> SamplingSpec:
        return self.inference.sampling

    @property
    def returns(self) -> ReturnSpec:
        return self.inference.returns
