"""ScriptedChatClient: scripted text served through the real token-in ChatClient contract."""

from __future__ import annotations

import asyncio

import pytest
import torch

from ludic.inference.client import ChatClient
from ludic.inference.request import (
    CompletionRequest,
    InferenceSpec,
    ReturnSpec,
    SamplingSpec,
)
from ludic.inference.scripted_client import ScriptedChatClient, ScriptExhaustedError


def _request(tokenizer, prompt="hi", **sampling) -> CompletionRequest:
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    return CompletionRequest(ids, inference=InferenceSpec(sampling=SamplingSpec(**sampling)))


def _complete(client, request):
    return asyncio.run(client.complete(request))


def test_scripted_client_satisfies_chat_client_protocol(tiny_tokenizer) -> None:
    assert isinstance(ScriptedChatClient(tiny_tokenizer, ["a"]), ChatClient)


def test_completions_are_served_in_order_and_requests_recorded(tiny_tokenizer) -> None:
    client = ScriptedChatClient(tiny_tokenizer, ["one", "two"])
    r1, r2 = _request(tiny_tokenizer, "p1"), _request(tiny_tokenizer, "p2")
    assert _complete(client, r1).text == "one"
    assert _complete(client, r2).text == "two"
    assert client.requests == [r1, r2]
    assert client.prompts == ["p1", "p2"]
    assert client.remaining == 0


def test_exhausted_script_raises_naming_the_request_number(tiny_tokenizer) -> None:
    client = ScriptedChatClient(tiny_tokenizer, ["only"])
    _complete(client, _request(tiny_tokenizer))
    with pytest.raises(ScriptExhaustedError, match="request #2 but the script holds only 1"):
        _complete(client, _request(tiny_tokenizer))


def test_natural_stop_appends_eos_to_ids_but_not_to_text(tiny_tokenizer) -> None:
    response = _complete(ScriptedChatClient(tiny_tokenizer, ["ok"]), _request(tiny_tokenizer))
    eos = tiny_tokenizer.eos_token_id
    assert response.finish_reason == "stop"
    assert response.text == "ok"
    assert response.trace.completion_token_ids == (
        *tiny_tokenizer.encode("ok", add_special_tokens=False),
        eos,
    )
    assert response.trace.prompt_token_ids == tuple(
        tiny_tokenizer.encode("hi", add_special_tokens=False)
    )


def test_completion_longer_than_max_tokens_is_truncated_with_finish_length(tiny_tokenizer) -> None:
    client = ScriptedChatClient(tiny_tokenizer, ["abcdefgh"])
    response = _complete(client, _request(tiny_tokenizer, max_tokens=3))
    assert response.finish_reason == "length"
    assert response.text == "abc"
    assert len(response.trace.completion_token_ids) == 3
    assert tiny_tokenizer.eos_token_id not in response.trace.completion_token_ids


def test_completion_filling_max_tokens_without_room_for_eos_is_length(tiny_tokenizer) -> None:
    response = _complete(
        ScriptedChatClient(tiny_tokenizer, ["abc"]), _request(tiny_tokenizer, max_tokens=3)
    )
    assert response.finish_reason == "length" and response.text == "abc"


def test_stop_string_cuts_the_text_without_eos(tiny_tokenizer) -> None:
    client = ScriptedChatClient(tiny_tokenizer, ["answer: 4\n\nextra"])
    response = _complete(client, _request(tiny_tokenizer, stop=("\n\n",)))
    assert response.finish_reason == "stop"
    assert response.text == "answer: 4"
    assert tiny_tokenizer.eos_token_id not in response.trace.completion_token_ids


def test_logprobs_are_negative_aligned_and_deterministic(tiny_tokenizer) -> None:
    a = _complete(ScriptedChatClient(tiny_tokenizer, ["hello"]), _request(tiny_tokenizer))
    b = _complete(ScriptedChatClient(tiny_tokenizer, ["hello"]), _request(tiny_tokenizer))
    c = _complete(ScriptedChatClient(tiny_tokenizer, ["hello"], seed=1), _request(tiny_tokenizer))
    lp = a.trace.completion_logprobs
    assert len(lp) == len(a.trace.completion_token_ids)
    assert all(x < 0 for x in lp)
    assert lp == b.trace.completion_logprobs
    assert lp != c.trace.completion_logprobs


def test_return_spec_controls_trace_and_logprobs(tiny_tokenizer) -> None:
    ids = tiny_tokenizer.encode("hi", add_special_tokens=False)
    client = ScriptedChatClient(tiny_tokenizer, ["a", "b"])
    no_lp = ReturnSpec(return_token_ids=True, return_logprobs=False)
    response = _complete(client, CompletionRequest(ids, inference=InferenceSpec(returns=no_lp)))
    assert response.trace is not None and response.trace.completion_logprobs is None
    evaluated = InferenceSpec(returns=ReturnSpec.for_eval())
    assert _complete(client, CompletionRequest(ids, inference=evaluated)).trace is None


def test_sync_weights_sets_the_reported_policy_version(tiny_tokenizer) -> None:
    client = ScriptedChatClient(tiny_tokenizer, ["a", "b"])
    assert _complete(client, _request(tiny_tokenizer)).policy_version is None
    status = client.sync_weights({"w": torch.zeros(1)}, version=7)
    assert "7" in status
    assert _complete(client, _request(tiny_tokenizer)).trace.policy_version == 7


def test_callable_script_sees_the_request_and_decoded_prompt(tiny_tokenizer) -> None:
    seen = []

    def script(request, prompt_text):
        seen.append((request.sampling.max_tokens, prompt_text))
        return prompt_text.upper()

    client = ScriptedChatClient(tiny_tokenizer, script)
    assert _complete(client, _request(tiny_tokenizer, "abc", max_tokens=9)).text == "ABC"
    assert seen == [(9, "abc")]
    assert client.remaining is None


def test_a_single_string_script_is_rejected(tiny_tokenizer) -> None:
    with pytest.raises(TypeError, match="single string"):
        ScriptedChatClient(tiny_tokenizer, "oops")
