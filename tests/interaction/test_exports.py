"""The interaction package exports its public names and the protocols satisfy the contract."""

from __future__ import annotations

from tests.interaction.fakes import ScriptedAgent

import ludic.interaction as interaction
from ludic.interaction import InteractionProtocol, MultiAgentProtocol, SingleAgentProtocol


def test_public_names_are_exported() -> None:
    for name in [
        "InteractionProtocol",
        "ActingAgent",
        "ExternalToolResult",
        "SingleAgentProtocol",
        "MultiAgentProtocol",
        "TraceCollector",
        "merge_step_info",
        "make_delegation_handler",
    ]:
        assert name in interaction.__all__ and hasattr(interaction, name)


def test_protocols_and_fake_agent_satisfy_the_runtime_protocols() -> None:
    agent = ScriptedAgent([])
    assert isinstance(agent, interaction.ActingAgent)
    assert isinstance(SingleAgentProtocol(agent), InteractionProtocol)
    assert isinstance(MultiAgentProtocol({"a": agent}), InteractionProtocol)
