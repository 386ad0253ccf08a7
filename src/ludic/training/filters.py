"""Sample filters: ``Callable[[SAWItem], bool]`` that return True to *keep* an item.

They read the ``SAWItem.meta`` keys written by batching: ``"truncated"`` (the episode was
cut off), ``"finish_reason"`` (why the LLM stopped; ``"length"`` = hit the token limit) and
``"parse_error"`` (the parser rejected the action). Pass one to ``Trainer(sample_filter=)``;
the trainer logs how many items each step dropped.
"""

from __future__ import annotations

from collections.abc import Callable

from ludic.training.types import SAWItem

SampleFilter = Callable[[SAWItem], bool]


def drop_truncated() -> SampleFilter:
    """Drop items from episodes cut off by a time limit or ``max_steps``."""

    def keep(item: SAWItem) -> bool:
        return not item.meta.get("truncated", False)

    return keep


def drop_incomplete_completions() -> SampleFilter:
    """Drop items whose completion stopped at the token limit (``finish_reason == "length"``)."""

    def keep(item: SAWItem) -> bool:
        return item.meta.get("finish_reason") != "length"

    return keep


def drop_parse_errors() -> SampleFilter:
    """Drop items whose action the parser rejected (``meta["parse_error"]`` truthy)."""

    def keep(item: SAWItem) -> bool:
        return not item.meta.get("parse_error", False)

    return keep


def drop_version_span(max_span: int) -> SampleFilter:
    """Staleness validator: drop items whose tokens straddle more than ``max_span`` weight
    updates (``SAWItem.version_span``: a completion continued across updates, see partial
    rollouts). ``max_span=0`` keeps only items sampled entirely by one policy version, as
    the spec 4 validator does. Items without versions are kept. To keep such items and
    correct them instead, train with a loss that reweights per token with proximal
    logprobs (``make_decoupled_ppo`` / ``make_decoupled_grpo``) and no filter."""
    if not isinstance(max_span, int) or max_span < 0:
        raise ValueError(f"drop_version_span: max_span={max_span!r}; expected an int >= 0")

    def keep(item: SAWItem) -> bool:
        return item.version_span <= max_span

    return keep


def combine(*filters: SampleFilter) -> SampleFilter:
    """Keep an item only if every filter keeps it (no filters keeps everything)."""

    def keep(item: SAWItem) -> bool:
        return all(f(item) for f in filters)

    return keep
