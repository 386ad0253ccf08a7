"""Parsers: turn raw completion text into an action, plus an intrinsic format reward.

A parser is any callable ``(text: str) -> ParseResult``. ``action=None`` means failure;
``obs`` then carries feedback the protocol shows the agent instead of calling
``env.step``, and ``reward`` is typically a penalty.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeAlias


@dataclass(frozen=True)
class ParseResult:
    action: str | None
    reward: float = 0.0
    obs: str | None = None

    def __post_init__(self) -> None:
        if not math.isfinite(self.reward):
            raise ValueError(f"ParseResult: reward must be finite, got {self.reward!r}")

    @property
    def ok(self) -> bool:
        return self.action is not None


Parser: TypeAlias = Callable[[str], ParseResult]
