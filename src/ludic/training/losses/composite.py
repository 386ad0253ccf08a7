"""A weighted sum of losses, e.g. a policy loss plus a KL penalty and an entropy bonus."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence

import torch

from ludic.training.losses.base import Loss, LossInputs, LossOutput, missing_loss_members

CompositeTerm = tuple[float, Loss] | tuple[str, float, Loss]


def _default_name(loss: object) -> str:
    """``TokenClippedSurrogateLoss`` -> ``token_clipped_surrogate``, ``KLPenalty`` -> ``kl_penalty``."""
    name = type(loss).__name__
    snake = re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name).lower()
    return snake.removesuffix("_loss") or snake


def _any_term(flag: str) -> property:
    """A :class:`Loss` flag of ``CompositeLoss``: true when any term's is."""
    return property(lambda self: any(getattr(loss, flag) for _, _, loss in self.terms))


class CompositeLoss:
    """Weighted sum of losses evaluated on the same micro-batch.

    L = sum_k w_k * L_k(inputs)
    ``terms``: ``(weight, loss)`` or ``(name, weight, loss)`` tuples. Unnamed terms are
    named after their class (``KLPenalty`` -> ``kl_penalty``; repeats get ``_1``, ``_2``).
    ``requires_old_logprobs`` / ``requires_ref_logprobs`` / ``requires_proximal_logprobs``
    are true when any term needs them. A regularizer whose ``aggregation`` is None
    (``KLPenalty``, ``EntropyBonus`` by default) gets the aggregation and constant
    normalizer of the first term that has one, the policy loss (GRPO eq. 3 averages its
    KL per sequence like the surrogate).
    Reads: whatever the terms read. Stats: ``loss`` (total) and every term's stats as
    ``"<name>/<key>"``.
    """

    def __init__(self, terms: Sequence[CompositeTerm]) -> None:
        if not terms:
            raise ValueError("CompositeLoss: terms is empty; pass [(weight, loss), ...]")
        named: list[tuple[str, float, Loss]] = []
        for k, term in enumerate(terms):
            if len(term) == 3:
                name, weight, loss = term  # type: ignore[misc]
            elif len(term) == 2:
                weight, loss = term  # type: ignore[misc]
                base, n = _default_name(loss), 0
                name = base
                while any(name == other for other, _, _ in named):
                    n += 1
                    name = f"{base}_{n}"
            else:
                raise ValueError(
                    f"CompositeLoss: term {k} is {term!r}; expected (weight, loss) or "
                    "(name, weight, loss)"
                )
            if not isinstance(loss, Loss):
                raise TypeError(
                    f"CompositeLoss: term {k} ({loss!r}) is not a Loss; it needs "
                    f"{missing_loss_members(loss)} and __call__(inputs: LossInputs) -> "
                    "LossOutput"
                )
            if isinstance(weight, bool) or not isinstance(weight, int | float):
                raise TypeError(f"CompositeLoss: term {k} weight={weight!r}; expected a float")
            if not math.isfinite(weight):
                raise ValueError(f"CompositeLoss: term {k} weight={weight!r}; expected finite")
            if any(name == n for n, _, _ in named):
                raise ValueError(
                    f"CompositeLoss: two terms are named {name!r}; give them distinct names "
                    "with (name, weight, loss)"
                )
            named.append((name, float(weight), loss))
        self.terms: tuple[tuple[str, float, Loss], ...] = tuple(_follow_policy_aggregation(named))

    requires_old_logprobs = _any_term("requires_old_logprobs")
    requires_ref_logprobs = _any_term("requires_ref_logprobs")
    requires_proximal_logprobs = _any_term("requires_proximal_logprobs")
    requires_entropy = _any_term("requires_entropy")

    def __call__(self, inputs: LossInputs) -> LossOutput:
        total: torch.Tensor | None = None
        stats: dict[str, float] = {}
        for name, weight, loss in self.terms:
            out = loss(inputs)
            weighted = weight * out.loss
            total = weighted if total is None else total + weighted
            for key, value in out.stats.items():
                stats[f"{name}/{key}"] = value
        assert total is not None  # terms is non-empty
        stats["loss"] = float(total.detach())
        return LossOutput(loss=total, stats=stats)

    def __repr__(self) -> str:
        inner = ", ".join(f"({n!r}, {w}, {loss!r})" for n, w, loss in self.terms)
        return f"CompositeLoss([{inner}])"


def _follow_policy_aggregation(
    terms: list[tuple[str, float, Loss]],
) -> list[tuple[str, float, Loss]]:
    """Give terms with ``aggregation=None`` the first other term's aggregation."""
    leader = next(
        (loss for _, _, loss in terms if getattr(loss, "aggregation", None) is not None), None
    )
    if leader is None:
        return terms
    out = []
    for name, weight, loss in terms:
        if (
            dataclasses.is_dataclass(loss)
            and hasattr(loss, "aggregation")
            and loss.aggregation is None
        ):
            loss = dataclasses.replace(
                loss,
                aggregation=leader.aggregation,
                constant_normalizer=getattr(leader, "constant_normalizer", None),
            )
        out.append((name, weight, loss))
    return out
