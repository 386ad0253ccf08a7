"""Weights through Redis (pipeline actors on the transformers backend): the learner's
publisher and an actor's subscriber against a real redis-server and real tiny models."""

from __future__ import annotations

import struct

import pytest
import torch
from tests.pipeline.helpers import new_queue

from ludic.distributed import policy_state_dict
from ludic.inference import TransformersChatClient
from ludic.models.tiny import build_tiny_causal_lm
from ludic.pipeline.redis_weights import (
    RedisWeightPublisher,
    RedisWeightSubscriber,
    WeightsFormatError,
    decode_weights,
    encode_weights,
)

pytestmark = pytest.mark.redis


def _assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    theirs = b.state_dict()
    for name, tensor in a.state_dict().items():
        assert torch.equal(tensor, theirs[name]), name


def test_an_actor_loads_each_published_version_exactly_once(redis_server, tiny_tokenizer) -> None:
    learner_model = build_tiny_causal_lm(tiny_tokenizer, seed=1)
    actor_model = build_tiny_causal_lm(tiny_tokenizer, seed=2)
    q = new_queue(redis_server)
    publisher = RedisWeightPublisher(q)
    client = TransformersChatClient(actor_model, tiny_tokenizer)
    subscriber = RedisWeightSubscriber(q, client)
    assert subscriber.refresh() is None  # nothing published yet

    publisher.publish(policy_state_dict(learner_model), version=0)
    assert subscriber.refresh() == 0 and client.policy_version == 0
    _assert_same_weights(learner_model, actor_model)

    with torch.no_grad():
        for p in learner_model.parameters():
            p.add_(0.01)
    assert subscriber.refresh() == 0  # same version: nothing reloaded
    assert not torch.equal(learner_model.lm_head.weight, actor_model.lm_head.weight)
    publisher.publish(policy_state_dict(learner_model), version=1)
    assert subscriber.published_version() == 1
    assert subscriber.refresh() == 1 and client.policy_version == 1
    _assert_same_weights(learner_model, actor_model)


def test_the_payload_is_safetensors_with_the_version_and_no_pickle(tiny_tokenizer) -> None:
    model = build_tiny_causal_lm(tiny_tokenizer, seed=0)
    data = encode_weights(policy_state_dict(model), version=7)
    (head_len,) = struct.unpack_from("<Q", data)
    assert b'"version":"7"' in data[8 : 8 + head_len]
    tensors, version = decode_weights(data)
    assert version == 7 and set(tensors) == set(model.state_dict())


def test_bad_weight_payloads_are_refused_with_the_reason(redis_server, tiny_tokenizer) -> None:
    with pytest.raises(WeightsFormatError, match="truncated"):
        decode_weights(b"\x01")
    with pytest.raises(WeightsFormatError, match="exceeds"):
        decode_weights(struct.pack("<Q", 1000) + b"{}")
    from safetensors.torch import save

    foreign = save({"w": torch.zeros(2)}, metadata={"format": "something else"})
    with pytest.raises(WeightsFormatError, match="not written by RedisWeightPublisher"):
        decode_weights(foreign)

    q = new_queue(redis_server)
    data = encode_weights({"w": torch.zeros(2)}, version=3)
    q.client.set(q.keys.weights, data)
    q.client.set(q.keys.weights_version, 4)
    subscriber = RedisWeightSubscriber(
        q, TransformersChatClient(build_tiny_causal_lm(tiny_tokenizer), tiny_tokenizer)
    )
    with pytest.raises(WeightsFormatError, match="holds version 3 but .* says 4"):
        subscriber.refresh()


def test_non_finite_weights_are_never_published(redis_server, tiny_tokenizer) -> None:
    q = new_queue(redis_server)
    state = policy_state_dict(build_tiny_causal_lm(tiny_tokenizer))
    name = next(iter(state))
    state[name] = torch.full_like(state[name], float("nan"))
    with pytest.raises(ValueError, match="NaN/inf"):
        RedisWeightPublisher(q).publish(state, version=1)
    assert q.client.get(q.keys.weights_version) is None
