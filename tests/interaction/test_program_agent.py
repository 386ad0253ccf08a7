"""Agent programs written against the OpenAI API (the official ``openai`` SDK), on ludic's
endpoint over the in-process backend: a multi-turn tool-calling program whose every call is
recorded with the tokens the backend sampled, and the endpoint's rules (API key, sizes,
budgets). The same program against a real vLLM server: tests/vllm/test_program_agent_vllm.py."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import torch

pytest.importorskip("openai", reason="the openai SDK is not installed")

from ludic.envs import DatasetQAEnv  # noqa: E402
from ludic.inference import HFChatTemplate, TransformersChatClient  # noqa: E402
from ludic.inference.agent_endpoint import MAX_BODY_BYTES, AgentEndpoint  # noqa: E402
from ludic.inference.request import InferenceSpec, SamplingSpec  # noqa: E402
from ludic.interaction.program import ProgramProtocol  # noqa: E402
from ludic.training.batching.saw import rollouts_to_saw_items  # noqa: E402

QUESTION = "What is 1 + 2? Use the add tool."
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]
TOOL_CALL = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'


async def calculator_program(client, task):
    """A plain tool-calling loop, as any OpenAI-API agent writes it."""
    messages = [{"role": "user", "content": task["prompt"]}]
    for _ in range(4):
        response = await client.chat.completions.create(
            model="any", messages=messages, tools=TOOLS, max_tokens=64
        )
        message = response.choices[0].message
        if not message.tool_calls:
            return message.content  # the answer: the env scores it
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            args = json.loads(call.function.arguments)
            messages.append(
                {"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])}
            )
    return 0.0


class Spy:
    """The backend, passing through, keeping what it sampled."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.traces = []

    async def complete(self, request):
        response = await self.inner.complete(request)
        self.traces.append(response.trace)
        return response

    def sync_weights(self, params, *, version):
        return self.inner.sync_weights(params, version=version)


def _taught_model(tiny_model, tiny_tokenizer, template):
    """The tiny model, taught two completions (a tool call, then the sum) for this
    conversation, so that greedy decoding makes the program's tool round trip."""
    first = [{"role": "user", "content": QUESTION}]
    second = [*first, {"role": "assistant", "content": TOOL_CALL}, {"role": "tool", "content": "3"}]
    end = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    rows = []
    for messages, answer in ((first, TOOL_CALL), (second, "3")):
        prompt = template.render(messages, tools=TOOLS)
        completion = list(tiny_tokenizer.encode(answer, add_special_tokens=False)) + [end]
        rows.append((prompt, completion))
    optimizer = torch.optim.AdamW(tiny_model.parameters(), lr=3e-3)
    tiny_model.train()
    for _ in range(120):
        loss = 0.0
        for prompt, completion in rows:
            ids = torch.tensor([prompt + completion])
            logits = tiny_model(ids).logits[0, len(prompt) - 1 : -1]
            loss = loss + torch.nn.functional.cross_entropy(logits, torch.tensor(completion))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if loss.item() < 0.01:
            break
    return tiny_model.eval()


def test_a_tool_calling_program_trains_on_the_tokens_the_backend_sampled(
    tiny_model, tiny_tokenizer
) -> None:
    template = HFChatTemplate(tiny_tokenizer)
    model = _taught_model(tiny_model, tiny_tokenizer, template)
    spy = Spy(TransformersChatClient(model, tiny_tokenizer))
    endpoint = AgentEndpoint(spy, template)
    env = DatasetQAEnv([{"question": QUESTION, "answer": "3"}])
    protocol = ProgramProtocol(calculator_program, endpoint)
    greedy = InferenceSpec(SamplingSpec(temperature=0.0, max_tokens=64))
    try:
        (rollout,) = asyncio.run(protocol.run(env=env, max_steps=4, env_seed=0, inference=greedy))
    finally:
        endpoint.close()

    calls = rollout.agent_steps
    assert len(calls) == 2  # the tool call, then the answer
    assert calls[0].tool_calls[0].name == "add" and calls[0].tool_calls[0].arguments == {
        "a": 1,
        "b": 2,
    }
    assert calls[1].completion == "3" and rollout.total_reward == 1.0  # the env scored it
    # recorded = sampled: the very token ids and logprobs the backend returned
    assert [s.trace for s in calls] == spy.traces
    first, second = (s.trace for s in calls)
    # the program sent the tool call back; it was rendered as the policy wrote it, so the
    # second prompt continues the first call's exact tokens
    head = list(first.prompt_token_ids) + list(first.completion_token_ids)
    assert list(second.prompt_token_ids[: len(head)]) == head
    assert second.prompt_token_ids == tuple(template.render(calls[1].prompt_messages, tools=TOOLS))
    # one training item per call, on exactly those tokens
    items = rollouts_to_saw_items([rollout], [[1.0, 1.0]])
    for item, trace in zip(items, (first, second)):
        n = len(trace.completion_token_ids)
        assert list(item.input_ids) == [*trace.prompt_token_ids, *trace.completion_token_ids]
        assert sum(item.action_mask) == n
        assert list(item.old_logprobs[-n:]) == list(trace.completion_logprobs)


def test_the_endpoint_keeps_the_servers_rules(tiny_model, tiny_tokenizer) -> None:
    endpoint = AgentEndpoint(
        TransformersChatClient(tiny_model, tiny_tokenizer), HFChatTemplate(tiny_tokenizer)
    )
    spec = InferenceSpec(SamplingSpec(temperature=1.0, max_tokens=4))

    async def scenario():
        base = endpoint.open_episode(spec, max_calls=1)
        chat = f"{base}/chat/completions"
        body = {"messages": [{"role": "user", "content": "hi"}]}
        key = {"Authorization": f"Bearer {endpoint.api_key}"}
        async with httpx.AsyncClient(timeout=30) as http:
            assert (await http.get(f"{endpoint.url}/health")).status_code == 200
            assert (await http.post(chat, json=body)).status_code == 401
            assert (
                await http.post(chat, json=body, headers={"Authorization": "Bearer no"})
            ).status_code == 401
            assert (
                await http.post(chat, json={**body, "stream": True}, headers=key)
            ).status_code == 400
            assert (await http.post(chat, json={**body, "n": 2}, headers=key)).status_code == 400
            so = {**body, "structured_outputs": {"regex": "[0-9]"}}
            refused = await http.post(chat, json=so, headers=key)
            assert refused.status_code == 400 and "inference.backend: vllm" in refused.text
            big = b'{"messages": "' + b"x" * MAX_BODY_BYTES + b'"}'
            assert (await http.post(chat, content=big, headers=key)).status_code == 413
            ok = await http.post(chat, json={**body, "max_tokens": 100}, headers=key)
            assert ok.status_code == 200, ok.text
            assert ok.json()["usage"]["completion_tokens"] <= 4  # the run's budget caps it
            assert (await http.post(chat, json=body, headers=key)).status_code == 429  # max_calls
            models = await http.get(f"{base}/models", headers=key)
            assert models.json()["data"][0]["id"] == "ludic-policy"
            calls, refused_calls = endpoint.close_episode(base)
            assert len(calls) == 1 and refused_calls == 1
            assert calls[0].requested == {"max_tokens": 100}
            assert (await http.post(chat, json=body, headers=key)).status_code == 404  # closed

    try:
        asyncio.run(scenario())
    finally:
        endpoint.close()


async def _over_budget(client, task):
    for _ in range(5):  # more calls than max_steps: the endpoint refuses the third
        await client.completions.create(model="m", prompt=task["prompt"], max_tokens=2)
    return 1.0


async def _raises(client, task):
    raise KeyError("no such tool")


def test_a_program_over_budget_is_truncated_and_one_that_raises_fails(
    tiny_model, tiny_tokenizer
) -> None:
    endpoint = AgentEndpoint(
        TransformersChatClient(tiny_model, tiny_tokenizer), HFChatTemplate(tiny_tokenizer)
    )
    env = DatasetQAEnv([{"question": "q", "answer": "a"}])
    spec = InferenceSpec(SamplingSpec(max_tokens=2))
    try:
        (rollout,) = asyncio.run(
            ProgramProtocol(_over_budget, endpoint).run(env=env, max_steps=2, inference=spec)
        )
        assert len(rollout.agent_steps) == 2 and rollout.truncated
        assert rollout.meta["truncation_reason"] == "max_steps" and rollout.total_reward == 0.0
        assert rollout.agent_steps[0].info["route"] == "completions"
        with pytest.raises(RuntimeError, match="agent program '_raises' raised .*KeyError"):
            asyncio.run(
                ProgramProtocol(_raises, endpoint).run(env=env, max_steps=2, inference=spec)
            )
    finally:
        endpoint.close()
    with pytest.raises(TypeError, match="not an async function"):
        ProgramProtocol(lambda client, task: 1.0, endpoint)
