"""Merging step ``info`` dicts without letting anyone clobber the protocol's own keys.

A step's ``info`` is assembled from several sources: what the protocol itself writes
(``parse_error``, ``truncation_reason``, ...), what the environment returned in
``StepOutcome.info``, and what an agent or user adds. Training metadata (batching,
filters, credit assignment) reads the protocol's keys, so an env that happens to write
``"truncation_reason"`` must fail loudly instead of silently changing training data.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

RESERVED_STEP_INFO_KEYS: frozenset[str] = frozenset(
    {
        "parse_error",  # synthetic step after a parse failure (True)
        "synthetic",  # mirrors EnvironmentStep.synthetic in exported metadata
        "truncation_reason",  # "env" | "max_steps" on a truncated env step
        "agent_id",  # which agent a step or rollout belongs to
        "tool_calls",  # tool calls live on AgentStep.tool_calls, not in info
    }
)
"""``info`` keys the interaction protocols write or that carry protocol meaning.

Environments and agents must not set these to a different value; use another name
(e.g. ``"env_truncation_reason"``) for env-specific data."""

PROTOCOL_META_KEYS: frozenset[str] = frozenset(
    {"agent_id", "env_seed", "initial_obs", "truncation_reason"}
)
"""``Rollout.meta`` keys the protocols write themselves; a caller's ``meta`` may repeat
them only with the same value."""


def merge_step_info(
    *infos: Mapping[str, Any] | None,
    reserved: Iterable[str] = RESERVED_STEP_INFO_KEYS,
) -> dict[str, Any]:
    """Merge ``infos`` left to right into a new dict.

    * Non-reserved keys: a later dict overwrites an earlier one (last writer wins), so
      pass the most specific source last.
    * Reserved keys: a later dict may repeat a reserved key only with an equal value;
      a different value raises ``ValueError`` naming the key, both values and the
      position of the offending dict. Convention: the protocol passes its own dict
      first, so env/agent info cannot overwrite it.

    ``None`` entries are skipped. The inputs are not modified.
    """
    reserved_keys = frozenset(reserved)
    merged: dict[str, Any] = {}
    owner: dict[str, int] = {}
    for position, info in enumerate(infos):
        if info is None:
            continue
        for key, value in info.items():
            if key in reserved_keys and key in merged and merged[key] != value:
                raise ValueError(
                    f"merge_step_info: info dict #{position} sets reserved key {key!r} to "
                    f"{value!r}, but info dict #{owner[key]} already set it to "
                    f"{merged[key]!r}. Reserved keys ({sorted(reserved_keys)}) belong to "
                    f"the interaction protocol; rename the key in your env/agent info "
                    f"(e.g. 'env_{key}')"
                )
            merged[key] = value
            owner.setdefault(key, position)
    return merged
