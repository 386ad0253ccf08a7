"""Agents: an LLM with state (client + context strategy + parser + chat template), plus
tool-calling and ReAct variants."""

from ludic.agents.base_agent import Agent
from ludic.agents.react_agent import ReActAgent
from ludic.agents.tool_agent import ToolAgent
from ludic.agents.tools import Tool, tool_schema

__all__ = ["Agent", "ReActAgent", "Tool", "ToolAgent", "tool_schema"]
