"""Context strategies: how an agent's history becomes its next prompt."""

from __future__ import annotations

from ludic._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "ContextStrategy": "ludic.context.base",
    "FullDialog": "ludic.context.full_dialog",
    "LatestObservation": "ludic.context.latest_observation",
    "TruncatedThinkingContext": "ludic.context.truncated_thinking",
    "truncate_thinking": "ludic.context.truncated_thinking",
}

__getattr__, __all__ = lazy_exports(__name__, globals(), _EXPORTS)
