"""Agents: an LLM with state (client + context strategy + parser + chat template), plus
tool-calling and ReAct variants."""

from __future__ import annotations

from ludic._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "Agent": "ludic.agents.base_agent",
    "ReActAgent": "ludic.agents.react_agent",
    "ToolAgent": "ludic.agents.tool_agent",
    "Tool": "ludic.agents.tools",
    "tool_schema": "ludic.agents.tools",
}

__getattr__, __all__ = lazy_exports(__name__, globals(), _EXPORTS)
