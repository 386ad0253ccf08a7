"""Interaction protocols: own the agent <-> environment loop and produce rollouts."""

from ludic.interaction.base import (
    ActingAgent,
    ExternalToolHandler,
    ExternalToolResult,
    InteractionProtocol,
)
from ludic.interaction.delegation import TaskEnv, final_answer, make_delegation_handler
from ludic.interaction.info import PROTOCOL_META_KEYS, RESERVED_STEP_INFO_KEYS, merge_step_info
from ludic.interaction.multi_agent import MultiAgentProtocol
from ludic.interaction.single_agent import SingleAgentProtocol
from ludic.interaction.step_collector import TraceCollector

__all__ = [
    "PROTOCOL_META_KEYS",
    "RESERVED_STEP_INFO_KEYS",
    "ActingAgent",
    "ExternalToolHandler",
    "ExternalToolResult",
    "InteractionProtocol",
    "MultiAgentProtocol",
    "SingleAgentProtocol",
    "TaskEnv",
    "TraceCollector",
    "final_answer",
    "make_delegation_handler",
    "merge_step_info",
]
