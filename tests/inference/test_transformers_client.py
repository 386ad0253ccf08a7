"""The in-process transformers backend: real sampling from a tiny model."""

from __future__ import annotations

import asyncio

import pytest
import torch

from ludic.inference.client import ChatClient
from ludic.inference.request import CompletionRequest, InferenceSpec, ReturnSpec, SamplingSpec
from ludic.inference.transformers_client import TransformersChatClient
from ludic.models.tiny import build_tiny_causal_lm


def _request(prompt, **sampling) -> CompletionRequest:
    return CompletionRequest(tuple(prompt), InferenceSpec(sampling=SamplingSpec(**sampling)))


def _forward_logprobs(model, prompt, completion, temperature: float = 1.0) -> torch.Tensor:
    ids = torch.tensor([list(prompt) + list(completion)])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, :-1].float() / temperature, dim=-1)
    idx = torch.arange(len(prompt) - 1, ids.shape[1] - 1)
    return logp[idx, ids[0, idx + 1]]


def test_client_satisfies_the_chat_client_protocol(tiny_model, tiny_tokenizer) -> None:
    assert isinstance(TransformersChatClient(tiny_model, tiny_tokenizer), ChatClient)


def test_logprobs_equal_a_plain_forward_of_the_same_tokens(tiny_model, tiny_tokenizer) -> None:
    client = TransformersChatClient(tiny_model, tiny_tokenizer)
    prompt = tiny_tokenizer.encode("2+3=", add_special_tokens=False)
    resp = asyncio.run(client.complete(_request(prompt, temperature=1.0, max_tokens=12, seed=3)))
    trace = resp.trace
    assert trace is not None and len(trace.completion_token_ids) >= 1
    expected = _forward_logprobs(tiny_model, prompt, trace.completion_token_ids)
    torch.testing.assert_close(torch.tensor(trace.completion_logprobs), expected, atol=1e-4, rtol=0)


def test_logprobs_are_under_the_temperature_the_tokens_were_sampled_at(
    tiny_model, tiny_tokenizer
) -> None:
    """The behaviour policy at temperature T is softmax(logits / T): its logprobs, and
    the trace says T so the trainer scores the same policy; greedy: the raw logits."""
    client = TransformersChatClient(tiny_model, tiny_tokenizer)
    prompt = tiny_tokenizer.encode("2+3=", add_special_tokens=False)
    hot = asyncio.run(client.complete(_request(prompt, temperature=1.3, max_tokens=12, seed=3)))
    trace = hot.trace
    assert trace is not None and trace.logprob_temperature == 1.3
    expected = _forward_logprobs(tiny_model, prompt, trace.completion_token_ids, 1.3)
    torch.testing.assert_close(torch.tensor(trace.completion_logprobs), expected, atol=1e-4, rtol=0)
    raw = _forward_logprobs(tiny_model, prompt, trace.completion_token_ids)
    assert (expected - raw).abs().max() > 1e-2  # the temperature shows
    greedy = asyncio.run(client.complete(_request(prompt, temperature=0.0, max_tokens=6)))
    assert greedy.trace is not None and greedy.trace.logprob_temperature == 1.0
    expected = _forward_logprobs(tiny_model, prompt, greedy.trace.completion_token_ids)
    torch.testing.assert_close(
        torch.tensor(greedy.trace.completion_logprobs), expected, atol=1e-4, rtol=0
    )


def test_sampling_runs_without_dropout_and_restores_train_mode(tiny_tokenizer) -> None:
    """A policy shared with the Trainer sits in train mode; behaviour logprobs must still
    be the deterministic (eval-mode) ones."""
    model = build_tiny_causal_lm(tiny_tokenizer, seed=0)
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.5
    model.train()
    client = TransformersChatClient(model, tiny_tokenizer)
    prompt = tiny_tokenizer.encode("2+3=", add_special_tokens=False)
    resp = asyncio.run(client.complete(_request(prompt, max_tokens=6, seed=1)))
    assert model.training
    model.eval()
    assert resp.trace is not None
    expected = _forward_logprobs(model, prompt, resp.trace.completion_token_ids)
    torch.testing.assert_close(
        torch.tensor(resp.trace.completion_logprobs), expected, atol=1e-4, rtol=0
    )


def test_batched_requests_match_one_at_a_time(tiny_model, tiny_tokenizer) -> None:
    client = TransformersChatClient(tiny_model, tiny_tokenizer)
    prompts = [tiny_tokenizer.encode(t, add_special_tokens=False) for t in ["1+1=", "12*34=", "x"]]
    reqs = [_request(p, temperature=0.0, max_tokens=8) for p in prompts]

    async def together():
        return await asyncio.gather(*(client.complete(r) for r in reqs))

    batched = asyncio.run(together())
    single = [asyncio.run(client.complete(r)) for r in reqs]
    for b, s in zip(batched, single):
        assert b.trace.completion_token_ids == s.trace.completion_token_ids
        torch.testing.assert_close(
            torch.tensor(b.trace.completion_logprobs),
            torch.tensor(s.trace.completion_logprobs),
            atol=1e-4,
            rtol=0,
        )


def test_same_seed_same_sample_different_seed_differs(tiny_model, tiny_tokenizer) -> None:
    client = TransformersChatClient(tiny_model, tiny_tokenizer)
    prompt = tiny_tokenizer.encode("hello", add_special_tokens=False)
    a = asyncio.run(client.complete(_request(prompt, max_tokens=16, seed=1)))
    b = asyncio.run(client.complete(_request(prompt, max_tokens=16, seed=1)))
    c = asyncio.run(client.complete(_request(prompt, max_tokens=16, seed=2)))
    assert a.trace.completion_token_ids == b.trace.completion_token_ids
    assert a.trace.completion_token_ids != c.trace.completion_token_ids


def test_max_tokens_gives_finish_reason_length(tiny_model, tiny_tokenizer) -> None:
    # Forbid EOS so the completion must run to the budget.
    client = TransformersChatClient(tiny_model, tiny_tokenizer, eos_token_ids=[10_000])
    resp = asyncio.run(client.complete(_request([1, 2, 3], max_tokens=5, seed=0)))
    assert resp.finish_reason == "length"
    assert len(resp.trace.completion_token_ids) == 5


def test_eval_requests_can_skip_token_ids(tiny_model, tiny_tokenizer) -> None:
    client = TransformersChatClient(tiny_model, tiny_tokenizer)
    req = CompletionRequest(
        (1, 2), InferenceSpec(SamplingSpec(max_tokens=3), ReturnSpec.for_eval())
    )
    assert asyncio.run(client.complete(req)).trace is None


def test_sync_weights_changes_outputs_and_version(tiny_model, tiny_tokenizer) -> None:
    client = TransformersChatClient(tiny_model, tiny_tokenizer)
    other = build_tiny_causal_lm(tiny_tokenizer, seed=1)
    prompt = [5, 6, 7, 8]
    before = asyncio.run(client.complete(_request(prompt, temperature=0.0, max_tokens=4)))
    status = client.sync_weights(dict(other.named_parameters()), version=3)
    after = asyncio.run(client.complete(_request(prompt, temperature=0.0, max_tokens=4)))
    assert "version 3" in status and after.trace.policy_version == 3
    expected = _forward_logprobs(other, prompt, after.trace.completion_token_ids)
    torch.testing.assert_close(
        torch.tensor(after.trace.completion_logprobs), expected, atol=1e-4, rtol=0
    )
    assert before.trace.completion_logprobs != after.trace.completion_logprobs


def test_sync_weights_rejects_unknown_names_and_wrong_shapes(tiny_model, tiny_tokenizer) -> None:
    client = TransformersChatClient(tiny_model, tiny_tokenizer)
    with pytest.raises(KeyError, match="unknown parameter names"):
        client.sync_weights({"nope.weight": torch.zeros(1)}, version=1)
    name, p = next(iter(tiny_model.named_parameters()))
    with pytest.raises(ValueError, match=name):
        client.sync_weights({name: torch.zeros(p.shape[0] + 1)}, version=1)
    assert client.policy_version == 0


def test_sync_weights_accepts_a_full_state_dict_with_tied_aliases(
    tiny_model, tiny_tokenizer
) -> None:
    client = TransformersChatClient(tiny_model, tiny_tokenizer)
    other = build_tiny_causal_lm(tiny_tokenizer, seed=1)
    state = other.state_dict()
    assert "lm_head.weight" in state  # tied to the embedding, absent from named_parameters
    client.sync_weights(state, version=2)
    torch.testing.assert_close(tiny_model.lm_head.weight, other.lm_head.weight)
