"""Pins ``ludic.inference.transformers_reward_client``: in-process reward-model scoring and
weight syncs on a tiny Qwen2 sequence classifier."""

from __future__ import annotations

import asyncio

import pytest
import torch

from ludic.inference.reward_client import (
    RewardModelClient,
    RewardModelTrainingMode,
    ScoringRequest,
)
from ludic.inference.transformers_reward_client import TransformersRewardClient
from ludic.models.tiny import build_tiny_reward_model

TEXTS = ["2+3=\n5", "a much longer prompt about arithmetic\nthe answer is 7", "x", "hi\nyo"]


@pytest.fixture
def reward_model(tiny_tokenizer):
    return build_tiny_reward_model(tiny_tokenizer, seed=0)


@pytest.fixture
def other_model(tiny_tokenizer):
    """A second reward model with different weights (the one a sync installs)."""
    return build_tiny_reward_model(tiny_tokenizer, seed=1)


def direct_scores(model, tokenizer, texts) -> list[float]:
    """Raw logits from one unpadded forward per text: the reference."""
    out = []
    model.eval()
    with torch.no_grad():
        for text in texts:
            ids = torch.tensor([tokenizer(text)["input_ids"]])
            out.append(float(model(input_ids=ids).logits[0, 0]))
    return out


def raw(client, inputs) -> list[float]:
    return asyncio.run(client.score_batch(inputs, normalize=False))


def test_client_satisfies_the_reward_model_client_protocol(reward_model, tiny_tokenizer):
    assert isinstance(TransformersRewardClient(reward_model, tiny_tokenizer), RewardModelClient)


def test_raw_scores_equal_a_direct_forward(reward_model, tiny_tokenizer):
    client = TransformersRewardClient(reward_model, tiny_tokenizer)
    expected = direct_scores(reward_model, tiny_tokenizer, TEXTS)
    assert raw(client, TEXTS) == pytest.approx(expected, abs=1e-5)
    assert len(set(expected)) == len(expected)  # the texts really score differently


def test_token_id_inputs_are_scored_as_given(reward_model, tiny_tokenizer):
    client = TransformersRewardClient(reward_model, tiny_tokenizer)
    ids = [tiny_tokenizer(t)["input_ids"] for t in TEXTS]
    assert raw(client, ids) == pytest.approx(raw(client, TEXTS), abs=1e-6)
    # Scored exactly as given: appending a token changes the score.
    assert raw(client, [ids[0] + [65]])[0] != pytest.approx(raw(client, [ids[0]])[0], abs=1e-4)


def test_padding_does_not_change_scores(reward_model, tiny_tokenizer):
    one_by_one = TransformersRewardClient(reward_model, tiny_tokenizer, max_batch_size=1)
    batched = TransformersRewardClient(reward_model, tiny_tokenizer, max_batch_size=32)
    chunked = TransformersRewardClient(reward_model, tiny_tokenizer, max_batch_size=3)
    singles = raw(one_by_one, TEXTS)
    assert raw(batched, TEXTS) == pytest.approx(singles, abs=1e-5)
    assert raw(chunked, TEXTS) == pytest.approx(singles, abs=1e-5)
    response, info = asyncio.run(chunked.score(ScoringRequest(TEXTS, normalize=False)))
    assert info == {"num_batches": 2}
    assert response.scores == pytest.approx(singles, abs=1e-5)


def test_normalize_returns_the_sigmoid_of_the_raw_score(reward_model, tiny_tokenizer):
    client = TransformersRewardClient(reward_model, tiny_tokenizer)
    scores = asyncio.run(client.score_batch(TEXTS))  # normalize=True is the default
    expected = torch.sigmoid(torch.tensor(raw(client, TEXTS), dtype=torch.float64)).tolist()
    assert scores == pytest.approx(expected, abs=1e-7)
    assert all(0.0 < s < 1.0 for s in scores)


def test_scores_run_in_eval_mode_and_restore_train_mode(tiny_tokenizer):
    model = build_tiny_reward_model(tiny_tokenizer, seed=0)
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.5
    model.train()
    client = TransformersRewardClient(model, tiny_tokenizer)
    scores = raw(client, TEXTS)
    assert model.training
    assert scores == pytest.approx(direct_scores(model, tiny_tokenizer, TEXTS), abs=1e-5)


def test_concurrent_requests_get_the_same_scores_as_sequential_ones(reward_model, tiny_tokenizer):
    client = TransformersRewardClient(reward_model, tiny_tokenizer, max_batch_size=2)
    sequential = [raw(client, [t]) for t in TEXTS]

    async def together():
        return await asyncio.gather(*(client.score_batch([t], normalize=False) for t in TEXTS))

    assert asyncio.run(together()) == sequential  # each request is its own forward


@pytest.mark.parametrize("mode", ["full", "lora", RewardModelTrainingMode.FULL])
def test_full_and_lora_syncs_install_the_new_model(reward_model, other_model, tiny_tokenizer, mode):
    client = TransformersRewardClient(reward_model, tiny_tokenizer)
    before = raw(client, TEXTS)
    params = other_model.state_dict()
    if mode == "lora":  # merged weights under peft names: normalized to the served names
        params = {f"base_model.model.{n}": t for n, t in params.items()}
    msg = client.sync_weights(params, training_mode=mode)

    expected = direct_scores(other_model, tiny_tokenizer, TEXTS)
    assert raw(client, TEXTS) == pytest.approx(expected, abs=1e-5)
    assert raw(client, TEXTS) != pytest.approx(before, abs=1e-3)
    assert asyncio.run(client.get_model_version()) == 1
    assert msg.startswith(f"synced {len(params)} tensors")


def test_head_only_sync_replaces_only_the_head(reward_model, other_model, tiny_tokenizer):
    client = TransformersRewardClient(reward_model, tiny_tokenizer)
    head = {"score.weight": other_model.score.weight.detach().clone()}
    reference = build_tiny_reward_model(tiny_tokenizer, seed=0)  # backbone of model 0
    with torch.no_grad():
        reference.score.weight.copy_(head["score.weight"])

    client.sync_weights(head, training_mode=RewardModelTrainingMode.HEAD_ONLY, version=7)

    expected = direct_scores(reference, tiny_tokenizer, TEXTS)
    assert raw(client, TEXTS) == pytest.approx(expected, abs=1e-5)
    assert asyncio.run(client.get_model_version()) == 7


def test_version_is_bumped_when_not_given(reward_model, tiny_tokenizer):
    client = TransformersRewardClient(reward_model, tiny_tokenizer, model_version=3)
    head = {"score.weight": torch.zeros_like(reward_model.score.weight)}
    client.sync_weights(head, training_mode="head_only")
    client.sync_weights(head, training_mode="head_only")
    assert asyncio.run(client.get_model_version()) == 5
    response, _ = asyncio.run(client.score(ScoringRequest(["a"], normalize=False)))
    assert response.model_version == 5
    assert response.scores == [0.0]  # a zero head scores everything 0


def _snapshot(model) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


def _assert_unchanged(client, model, snapshot, scores_before) -> None:
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, snapshot[name]), name
    assert raw(client, TEXTS) == scores_before
    assert asyncio.run(client.get_model_version()) == 0


def test_unknown_names_raise_and_change_nothing(reward_model, other_model, tiny_tokenizer):
    client = TransformersRewardClient(reward_model, tiny_tokenizer)
    snapshot, before = _snapshot(reward_model), raw(client, TEXTS)
    params = dict(other_model.state_dict())
    params["model.layers.9.mlp.up_proj.weight"] = torch.zeros(256, 128)
    with pytest.raises(KeyError, match=r"model\.layers\.9\.mlp\.up_proj\.weight"):
        client.sync_weights(params)
    _assert_unchanged(client, reward_model, snapshot, before)


def test_wrong_shapes_raise_and_change_nothing(reward_model, other_model, tiny_tokenizer):
    client = TransformersRewardClient(reward_model, tiny_tokenizer)
    snapshot, before = _snapshot(reward_model), raw(client, TEXTS)
    params = dict(other_model.state_dict())  # valid tensors first, the bad one last
    params["score.weight"] = torch.zeros(2, 128)
    with pytest.raises(ValueError, match=r"score\.weight has shape \(2, 128\).*\(1, 128\)"):
        client.sync_weights(params)
    _assert_unchanged(client, reward_model, snapshot, before)


def test_head_only_sync_with_backbone_tensors_raises(reward_model, other_model, tiny_tokenizer):
    client = TransformersRewardClient(reward_model, tiny_tokenizer)
    snapshot, before = _snapshot(reward_model), raw(client, TEXTS)
    with pytest.raises(ValueError, match=r"HEAD_ONLY carries only head weights"):
        client.sync_weights(other_model.state_dict(), training_mode="head_only")
    _assert_unchanged(client, reward_model, snapshot, before)


def test_sync_times_out_while_the_model_is_busy(reward_model, tiny_tokenizer):
    client = TransformersRewardClient(reward_model, tiny_tokenizer)
    head = {"score.weight": torch.zeros_like(reward_model.score.weight)}
    # client._lock held here stands for a forward in flight.
    with client._lock, pytest.raises(TimeoutError, match="nothing was changed"):
        client.sync_weights(head, training_mode="head_only", timeout_s=0.01)
    assert asyncio.run(client.get_model_version()) == 0


def test_requests_the_model_cannot_serve_are_refused(reward_model, tiny_tokenizer):
    client = TransformersRewardClient(reward_model, tiny_tokenizer, model_name="rm")
    pad = tiny_tokenizer.pad_token_id
    cases = [
        (ScoringRequest(["a"], pooling_type="mean"), r"pooling_type='mean'"),
        (ScoringRequest(["a"], model="other"), r"model='other'.*model_name='rm'"),
        (ScoringRequest([[1, 2, 10**6]]), r"input 0: token id 1000000 is outside"),
        (ScoringRequest(["ok", [1, pad]]), r"input 1 ends with the pad token id"),
        (ScoringRequest([""]), r"input 0 tokenizes to no tokens"),
    ]
    for request, match in cases:
        with pytest.raises(ValueError, match=match):
            asyncio.run(client.score(request))
    response, _ = asyncio.run(client.score(ScoringRequest(["a"], model="rm")))
    assert len(response.scores) == 1


def test_models_that_are_not_one_label_classifiers_are_rejected(tiny_tokenizer, tiny_model):
    with pytest.raises(ValueError, match=r"num_labels=None"):
        TransformersRewardClient(torch.nn.Linear(2, 2), tiny_tokenizer)
    two = build_tiny_reward_model(tiny_tokenizer)
    two.config.num_labels = 2
    with pytest.raises(ValueError, match=r"num_labels=2"):
        TransformersRewardClient(two, tiny_tokenizer)
    no_pad = build_tiny_reward_model(tiny_tokenizer)
    no_pad.config.pad_token_id = None
    with pytest.raises(ValueError, match=r"pad_token_id is None"):
        TransformersRewardClient(no_pad, tiny_tokenizer)
    with pytest.raises(ValueError, match="max_batch_size"):
        TransformersRewardClient(
            build_tiny_reward_model(tiny_tokenizer), tiny_tokenizer, max_batch_size=0
        )
