"""Rollout requests: pure data that say which env, which protocol, which seed and how to
sample. The rollout engine turns them into rollouts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ludic.inference.request import InferenceSpec


@dataclass(frozen=True)
class EnvSpec:
    """Which environment to build: a registry name plus constructor kwargs."""

    kind: str
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ProtocolSpec:
    """Which interaction protocol to build: a registry name plus constructor kwargs."""

    kind: str
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RolloutRequest:
    """Pure data: run ``num_episodes`` episodes of ``env`` under ``protocol``.

    ``env_seed`` picks the problem; ``inference.sampling.seed`` the generation. ``meta``
    is copied into every produced rollout (e.g. ``group_id`` for GRPO).
    """

    env: EnvSpec
    protocol: ProtocolSpec
    env_seed: int | None = None
    inference: InferenceSpec = field(default_factory=InferenceSpec)
    num_episodes: int = 1
    max_steps: int = 8
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_episodes < 1:
            raise ValueError(f"RolloutRequest.num_episodes must be >= 1, got {self.num_episodes}")
        if self.max_steps < 1:
            raise ValueError(f"RolloutRequest.max_steps must be >= 1, got {self.max_steps}")


class DataExhausted(Exception):
    """Raised by a batch source (or a request function) that has no more data.

    ``Trainer.train`` treats it as the end of training, not as a failure.
    """
