"""Reward-model publishing: name normalization, per-mode checks, LoRA merging, and what
actually travels over a real gloo group (the pytest process is the trainer, two spawned
processes are workers; the control plane is the queue fake of the broadcast tests)."""

from __future__ import annotations

import copy

import pytest
import torch
from tests.distributed.test_weight_transfer_broadcast import (  # noqa: F401 (fixture)
    QueueControlPlane,
    assert_received_exactly,
    pool,
)

from ludic.distributed.broadcast_publisher import BroadcastPolicyPublisher
from ludic.distributed.reward_publisher import (
    RewardModelPublisher,
    create_reward_publisher,
    is_head,
    normalize_name,
    reward_model_state_dict,
    reward_sync_params,
)
from ludic.distributed.weight_transfer import BroadcastTransferSender
from ludic.inference.reward_client import RewardModelTrainingMode
from ludic.models.tiny import build_tiny_reward_model, build_tiny_tokenizer

peft = pytest.importorskip("peft", reason="LoRA tests need peft (pip install ludic-rl[peft])")


@pytest.fixture(scope="module")
def reward_model() -> torch.nn.Module:
    return build_tiny_reward_model(build_tiny_tokenizer(), seed=0, num_layers=1)


def lora_model(model: torch.nn.Module) -> torch.nn.Module:
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], modules_to_save=["score"]
    )
    wrapped = peft.get_peft_model(copy.deepcopy(model), config)
    with torch.no_grad():  # a non-zero delta, so merged != base
        for name, p in wrapped.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
            if "modules_to_save" in name:
                p.add_(1.0)
    return wrapped


# ------------------------------------------------------------------------------ names
@pytest.mark.parametrize(
    ("raw", "clean"),
    [
        ("score.weight", "score.weight"),
        ("base_model.model.score.weight", "score.weight"),
        ("base_model.model.model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.weight"),
        ("model.model.norm.weight", "model.norm.weight"),
        ("layers.3.self_attn.q_proj.weight", "model.layers.3.self_attn.q_proj.weight"),
        (
            "base_model.model.base_model.model.model.embed_tokens.weight",
            "model.embed_tokens.weight",
        ),
    ],
)
def test_normalize_name(raw: str, clean: str) -> None:
    assert normalize_name(raw) == clean


def test_head_is_a_module_named_score_or_classifier() -> None:
    assert is_head("score.weight") and is_head("classifier.bias") and is_head("model.score.weight")
    assert not is_head("model.layers.0.mlp.up_proj.weight")
    assert not is_head("model.scorer.weight")


# ------------------------------------------------------------------------------ modes
def test_each_mode_accepts_what_it_carries(reward_model) -> None:
    full = reward_model.state_dict()
    head = reward_sync_params({"score.weight": full["score.weight"]}, "head_only")
    assert list(head) == ["score.weight"]
    assert list(reward_sync_params(full, RewardModelTrainingMode.FULL)) == list(full)
    assert list(reward_sync_params(full, "LORA")) == list(full)  # merged weights look like FULL


def test_head_only_refuses_backbone_tensors(reward_model) -> None:
    with pytest.raises(ValueError, match=r"HEAD_ONLY carries only head weights.*backbone"):
        reward_sync_params(reward_model.state_dict(), "head_only")


@pytest.mark.parametrize("mode", ["head_only", "lora", "full"])
def test_every_mode_needs_the_head(reward_model, mode: str) -> None:
    backbone = {n: t for n, t in reward_model.state_dict().items() if not n.startswith("score")}
    with pytest.raises(ValueError, match=r"no head tensor.*'score.weight'"):
        reward_sync_params(backbone, mode)


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_lora_and_full_need_the_backbone(reward_model, mode: str) -> None:
    head = {"score.weight": reward_model.score.weight}
    with pytest.raises(ValueError, match=r"carries the backbone too.*use HEAD_ONLY"):
        reward_sync_params(head, mode)


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_raw_peft_tensors_are_refused(reward_model, mode: str) -> None:
    raw = lora_model(reward_model).state_dict()
    with pytest.raises(ValueError, match=r"raw peft tensor.*merged weights"):
        reward_sync_params(raw, mode)


def test_other_bad_inputs(reward_model) -> None:
    with pytest.raises(ValueError, match="unknown reward-model training mode 'partial'"):
        reward_sync_params(reward_model.state_dict(), "partial")
    with pytest.raises(ValueError, match="no tensors to publish"):
        reward_sync_params({}, "full")
    w = reward_model.score.weight
    with pytest.raises(ValueError, match="both map to 'score.weight'"):
        reward_sync_params({"score.weight": w, "base_model.model.score.weight": w}, "head_only")


# ------------------------------------------------------------------------------ state dicts
def test_head_only_state_dict_is_the_head(reward_model) -> None:
    state = reward_model_state_dict(reward_model, "head_only")
    assert list(state) == ["score.weight"]
    assert torch.equal(state["score.weight"], reward_model.score.weight)


def test_lora_state_dict_is_merged_out_of_place(reward_model) -> None:
    wrapped = lora_model(reward_model)
    before = {n: t.clone() for n, t in wrapped.state_dict().items()}
    state = reward_model_state_dict(wrapped, "lora")

    merged = copy.deepcopy(wrapped).merge_and_unload().state_dict()
    assert list(reward_sync_params(state, "lora")) == list(merged)
    for name, tensor in merged.items():
        torch.testing.assert_close(state[name], tensor, rtol=0, atol=1e-6, msg=name)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.allclose(state[q], reward_model.state_dict()[q])  # the delta is in
    assert not torch.equal(state["score.weight"], reward_model.score.weight)  # trained head copy
    after = wrapped.state_dict()  # the training model is untouched
    assert list(after) == list(before)
    assert all(torch.equal(after[n], before[n]) for n in before)


# ------------------------------------------------------------------------------ on the wire
def test_head_only_moves_exactly_the_head_over_gloo(pool, reward_model) -> None:  # noqa: F811
    control = QueueControlPlane(pool)
    inner = BroadcastPolicyPublisher(BroadcastTransferSender(pool.pg), control)
    publisher = RewardModelPublisher(inner, training_mode="head_only")
    publisher.publish(reward_model_state_dict(reward_model, "head_only"), version=3)
    assert [a["names"] for a in control.announced] == [["score.weight"]]
    assert_received_exactly(control.replies(), {"score.weight": reward_model.score.weight})


def test_full_moves_every_tensor_over_gloo(pool, reward_model) -> None:  # noqa: F811
    control = QueueControlPlane(pool)
    inner = BroadcastPolicyPublisher(BroadcastTransferSender(pool.pg), control)
    publisher = RewardModelPublisher(inner)
    state = reward_model.state_dict()
    publisher.publish(state, version=4, training_mode="full")
    announced = [name for a in control.announced for name in a["names"]]
    assert announced == list(state)
    assert_received_exactly(control.replies(), state)


def test_a_sync_that_does_not_fit_its_mode_announces_nothing(pool, reward_model) -> None:  # noqa: F811
    control = QueueControlPlane(pool)
    inner = BroadcastPolicyPublisher(BroadcastTransferSender(pool.pg), control)
    publisher = RewardModelPublisher(inner, training_mode="head_only")
    with pytest.raises(ValueError, match="HEAD_ONLY carries only head weights"):
        publisher.publish(reward_model.state_dict(), version=5)
    assert control.announced == []
    # The group is untouched: a valid sync goes through.
    publisher.publish(reward_model_state_dict(reward_model, "head_only"), version=5)
    assert_received_exactly(control.replies(), {"score.weight": reward_model.score.weight})


def test_create_reward_publisher_needs_a_sync_group() -> None:
    class NoGroup:
        publisher = None

    with pytest.raises(RuntimeError, match=r"init_weight_sync\(\) first"):
        create_reward_publisher(NoGroup())
