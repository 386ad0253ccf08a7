"""Mixed rewards: a discriminative reward model as a reward function, and a weighted sum
of reward functions (rule + DisRM + GenRM)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from ludic.inference.reward_client import RewardModelClient, format_reward_input
from ludic.rewards.functions import RewardFunction, call_reward_function
from ludic.rewards.sample import RewardSample


class DisRMScore:
    """A reward function scoring ``format_reward_input(question, solution)`` with a
    discriminative reward model (``RewardModelClient``: the vLLM reward server's client,
    or the in-process one); ``question`` is ``extra_info["question"]``."""

    __name__ = "DisRMScore"

    def __init__(self, client: RewardModelClient, *, normalize: bool = False) -> None:
        self.client = client
        self.normalize = normalize

    async def __call__(
        self, data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None
    ) -> float:
        question = str((extra_info or {}).get("question", ""))
        text = format_reward_input(question, solution_str)
        (score,) = await self.client.score_batch([text], normalize=self.normalize)
        return float(score)


class WeightedReward:
    """``score = sum_i weight_i * score_i`` over named reward functions, called
    concurrently; each component's score is logged as metric ``<name>`` (and its own
    metrics as ``<name>/<metric>``). A component that fails fails the whole score (the
    manager records it), since the weighted sum without it would be a different reward.
    Extra keyword arguments (e.g. ``reward_router_address``) reach the components that
    take them."""

    __name__ = "WeightedReward"

    def __init__(self, components: Mapping[str, tuple[RewardFunction, float]]) -> None:
        if not components:
            raise ValueError("WeightedReward: no components; give {name: (function, weight)}")
        for name, (fn, weight) in components.items():
            if not callable(fn) or not isinstance(weight, int | float):
                raise ValueError(
                    f"WeightedReward: component {name!r} must be (function, weight), got "
                    f"{(fn, weight)!r}"
                )
        self.components = dict(components)

    async def __call__(
        self,
        data_source: str,
        solution_str: str,
        ground_truth: Any,
        extra_info: Any = None,
        **kwargs: Any,
    ) -> dict[str, float]:
        sample = RewardSample(data_source, solution_str, ground_truth, dict(extra_info or {}))
        names = list(self.components)
        results = await asyncio.gather(
            *(call_reward_function(self.components[n][0], sample, **kwargs) for n in names)
        )
        out: dict[str, float] = {"score": 0.0}
        for name, result in zip(names, results):
            assert result.score is not None  # a failed component raised above
            out["score"] += self.components[name][1] * result.score
            out[name] = result.score
            out.update({f"{name}/{k}": v for k, v in result.metrics.items()})
        return out
