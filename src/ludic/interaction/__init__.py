"""Interaction protocols: own the agent <-> environment loop and produce rollouts."""

from __future__ import annotations

from ludic._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "ActingAgent": "ludic.interaction.base",
    "ExternalToolHandler": "ludic.interaction.base",
    "ExternalToolResult": "ludic.interaction.base",
    "InteractionProtocol": "ludic.interaction.base",
    "TaskEnv": "ludic.interaction.delegation",
    "final_answer": "ludic.interaction.delegation",
    "make_delegation_handler": "ludic.interaction.delegation",
    "PROTOCOL_META_KEYS": "ludic.interaction.info",
    "RESERVED_STEP_INFO_KEYS": "ludic.interaction.info",
    "merge_step_info": "ludic.interaction.info",
    "MultiAgentProtocol": "ludic.interaction.multi_agent",
    "SingleAgentProtocol": "ludic.interaction.single_agent",
    "TraceCollector": "ludic.interaction.step_collector",
}

__getattr__, __all__ = lazy_exports(__name__, globals(), _EXPORTS)
