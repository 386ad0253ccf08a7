"""Request strategies: how logical requests become executed requests within a batch.

GRPO (arXiv:2402.03300) is a sampling strategy here, not a trainer: each logical request
(one problem) runs ``group_size`` times with the same env seed and different sampling
seeds, and ``GroupNormalizedReturn`` compares rewards within the group.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Sequence
from dataclasses import replace
from typing import Protocol, runtime_checkable

from ludic.rollouts.requests import RolloutRequest

_SEED_SPACE = 2**31 - 1


@runtime_checkable
class RequestStrategy(Protocol):
    """Turns the logical requests of a batch into the requests the engine runs."""

    def expand(self, requests: Sequence[RolloutRequest]) -> list[RolloutRequest]: ...


class GRPORequestStrategy:
    """Expand each request into ``group_size`` single-episode requests of the same problem.

    Every member of a group gets:

    * the same ``env_seed``: the request's, or (if it is ``None``) one seed drawn once for
      the whole group, so all members see the same problem;
    * a distinct sampling seed ``base + e * group_size + g`` for member ``g`` of the
      request's episode ``e``, where ``base`` is the request's ``sampling.seed`` or, if
      unset, drawn from this strategy's RNG;
    * ``num_episodes=1`` and meta ``group_id`` (fresh per logical request and call),
      ``group_index`` (``g``) and ``group_size``.

    A request with ``num_episodes=n`` counts as ``n`` logical requests (``n`` groups).
    Seeds drawn here come from ``random.Random(seed)``, so a run is reproducible.
    """

    def __init__(self, group_size: int, *, seed: int = 0) -> None:
        if group_size < 1:
            raise ValueError(
                f"GRPORequestStrategy: group_size must be >= 1, got {group_size}; GRPO needs "
                "several rollouts per problem (e.g. group_size=8)"
            )
        self.group_size = group_size
        self._rng = random.Random(seed)

    def expand(self, requests: Sequence[RolloutRequest]) -> list[RolloutRequest]:
        out: list[RolloutRequest] = []
        for req in requests:
            base = req.inference.sampling.seed
            if base is None:
                base = self._rng.randrange(_SEED_SPACE)
            for e in range(req.num_episodes):
                out.extend(self._group(req, base + e * self.group_size))
        return out

    def _group(self, req: RolloutRequest, base: int) -> list[RolloutRequest]:
        env_seed = req.env_seed if req.env_seed is not None else self._rng.randrange(_SEED_SPACE)
        group_id = uuid.uuid4().hex
        return [
            replace(
                req,
                env_seed=env_seed,
                inference=req.inference.with_seed(base + g),
                num_episodes=1,
                meta={
                    **req.meta,
                    "group_id": group_id,
                    "group_index": g,
                    "group_size": self.group_size,
                },
            )
            for g in range(self.group_size)
        ]
