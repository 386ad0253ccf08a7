"""An agent program (the official ``openai`` SDK) against ludic's endpoint over a real vLLM
server on CPU: a tool call (forced with vLLM's structured outputs through the SDK's
``extra_body``) and its round trip, every call recorded with the tokens the server sampled,
and the unconstrained call's logprobs equal to the served weights' own."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed")
pytest.importorskip("openai", reason="the openai SDK is not installed")

from tests.interaction.test_program_agent import TOOLS, Spy  # noqa: E402

from ludic.envs import DatasetQAEnv  # noqa: E402
from ludic.inference import HFChatTemplate  # noqa: E402
from ludic.inference.agent_endpoint import AgentEndpoint  # noqa: E402
from ludic.inference.request import InferenceSpec, SamplingSpec  # noqa: E402
from ludic.interaction.program import ProgramProtocol  # noqa: E402

FORCED_CALL = r'<tool_call>\{"name": "add", "arguments": \{"a": [0-9], "b": [0-9]\}\}</tool_call>'


async def program(client, task):
    messages = [{"role": "user", "content": task["prompt"]}]
    first = await client.chat.completions.create(
        model="any",
        messages=messages,
        tools=TOOLS,
        extra_body={"structured_outputs": {"regex": FORCED_CALL}},
    )
    message = first.choices[0].message
    (call,) = message.tool_calls
    args = json.loads(call.function.arguments)
    messages.append(message.model_dump(exclude_none=True))
    messages.append(
        {"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])}
    )
    second = await client.chat.completions.create(model="any", messages=messages, tools=TOOLS)
    return {
        "answer": second.choices[0].message.content or "",
        "metrics": {"sum": args["a"] + args["b"]},
    }


def test_a_tool_calling_program_on_vllm_records_what_the_server_sampled(served) -> None:
    template = HFChatTemplate(served.tokenizer)
    spy = Spy(served.client)
    endpoint = AgentEndpoint(spy, template, structured_outputs=True)
    env = DatasetQAEnv([{"question": "Add 2 and 3 with the tool.", "answer": "5"}])
    greedy = InferenceSpec(SamplingSpec(temperature=0.0, max_tokens=96))  # bytes: ~70 a call
    try:
        (rollout,) = asyncio.run(
            ProgramProtocol(program, endpoint).run(
                env=env, max_steps=4, env_seed=0, inference=greedy
            )
        )
    finally:
        endpoint.close()
    first, second = rollout.agent_steps
    assert first.tool_calls[0].name == "add" and first.info["requested"]["structured_outputs"]
    assert [first.trace, second.trace] == spy.traces  # recorded = what the server returned
    args = first.tool_calls[0].arguments
    assert rollout.env_steps[-1].info["sum"] == args["a"] + args["b"]  # the program's metric
    # the tool call went back as sampled: the second prompt continues the first call
    head = [*first.trace.prompt_token_ids, *first.trace.completion_token_ids]
    assert list(second.trace.prompt_token_ids[: len(head)]) == head
    # the unconstrained greedy call: tokens and logprobs are the served weights' own
    trace = second.trace
    greedy_ids, logprobs = served.reference(trace.prompt_token_ids, trace.completion_token_ids)
    assert list(trace.completion_token_ids) == greedy_ids
    diff = max(abs(a - b) for a, b in zip(trace.completion_logprobs, logprobs))
    assert diff <= served.logprob_tol, diff
    assert trace.policy_version == served.client.get_policy_version()
