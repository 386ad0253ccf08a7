"""``agent.kind`` / ``agent.tools`` / ``agent.protocol`` and ``sampling.structured_outputs``
from config: the right agent and protocol are built, tools load from a module or a file,
and combinations that cannot work are config errors naming the field, before the run.
(The same configs against a real vLLM server: tests/vllm/test_vllm_agents.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from ludic import jobs
from ludic.agents import ReActAgent, ToolAgent
from ludic.inference import HFChatTemplate, InferenceSpec
from ludic.interaction import MultiAgentProtocol
from ludic.run.builders import PROTOCOL_NAME, make_engine, sampling_spec
from ludic.run.errors import RunError
from ludic.run.loading import ConfigError, load_config
from ludic.run.preflight import check_config

DEMO = Path(jobs.__file__).parent / "configs" / "arithmetic_demo.yaml"


class _NoClient:
    async def complete(self, request):  # never called: only the parts are built here
        raise AssertionError("no model calls in these tests")


def _tools(tmp_path: Path) -> Path:
    path = tmp_path / "tools.py"
    path.write_text(
        'def add(a: int, b: int) -> int:\n    """Add."""\n    return a + b\n'
        "def untyped(*args):\n    return args\n"
    )
    return path


def _protocol(config, tiny_tokenizer):
    engine = make_engine(config, _NoClient(), HFChatTemplate(tiny_tokenizer))
    return engine.protocol_registry[PROTOCOL_NAME]()


def test_tool_and_react_agents_are_built_with_their_tools(tmp_path, tiny_tokenizer) -> None:
    tools = _tools(tmp_path)
    for kind, cls in (("tool", ToolAgent), ("react", ReActAgent)):
        config = load_config(
            DEMO, [f"agent.kind={kind}", f"agent.tools=['{tools}:add']", "agent.max_tool_calls=3"]
        )
        check_config(config)
        agent = _protocol(config, tiny_tokenizer).agent
        assert type(agent) is cls and agent.max_tool_calls == 3
        assert [t.name for t in agent.tools.values()] == ["add"]
    plain = _protocol(load_config(DEMO), tiny_tokenizer).agent
    assert not isinstance(plain, ToolAgent)


def test_bad_agent_configs_name_the_field(tmp_path) -> None:
    tools = _tools(tmp_path)
    with pytest.raises(ConfigError, match="agent.tools is set but agent.kind is 'plain'"):
        load_config(DEMO, [f"agent.tools=['{tools}:add']"])
    with pytest.raises(ConfigError, match="agent.kind='react' needs agent.tools"):
        load_config(DEMO, ["agent.kind=react"])
    with pytest.raises(RunError, match="agent.tools: .*has no attribute 'sub'"):
        check_config(load_config(DEMO, ["agent.kind=tool", f"agent.tools=['{tools}:sub']"]))
    with pytest.raises(ConfigError, match="structured_outputs needs inference.backend=vllm"):
        load_config(DEMO, ["sampling.structured_outputs={regex: '[0-9]'}"])


def test_the_protocol_must_fit_the_env(tiny_tokenizer) -> None:
    two_player = [
        "env.kind=tic_tac_toe_two_player",
        "env.kwargs={}",
        "agent.max_steps=9",
        "warm_start.steps=0",
    ]
    with pytest.raises(RunError, match=r"agent.protocol: env 'tic_tac_toe_two_player' has"):
        check_config(load_config(DEMO, two_player))
    with pytest.raises(RunError, match="agent.protocol: multi_agent needs an env with several"):
        check_config(load_config(DEMO, ["agent.protocol=multi_agent"]))
    config = load_config(DEMO, [*two_player, "agent.protocol=multi_agent", "eval.first_problem=0"])
    check_config(config)
    protocol = _protocol(config, tiny_tokenizer)
    assert isinstance(protocol, MultiAgentProtocol) and set(protocol.agents) == {"X", "O"}
    assert protocol.agents["X"] is not protocol.agents["O"]  # one agent object per player


def test_structured_outputs_reach_every_request() -> None:
    config = load_config(
        DEMO, ["inference.backend=vllm", "sampling.structured_outputs={regex: '[0-9]+'}"]
    )
    for spec in (sampling_spec(config), sampling_spec(config, greedy=True)):
        assert isinstance(spec, InferenceSpec)
        assert spec.extra == {"structured_outputs": {"regex": "[0-9]+"}}
    assert sampling_spec(load_config(DEMO)).extra == {}
