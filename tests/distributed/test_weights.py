"""policy_state_dict: plain weights, and LoRA weights merged out of place under base names."""

from __future__ import annotations

import copy

import pytest
import torch

from ludic.distributed.weights import check_finite, policy_state_dict
from ludic.models.tiny import build_tiny_causal_lm

peft = pytest.importorskip("peft")


def _lora_model(tokenizer):
    """A tiny Qwen2 with LoRA on q_proj/v_proj and random (non-zero) B matrices."""
    config = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj"],
        lora_dropout=0.0,
        init_lora_weights=False,
    )
    return peft.get_peft_model(build_tiny_causal_lm(tokenizer, seed=0), config)


def test_plain_model_publishes_its_detached_state_dict(tiny_model) -> None:
    published = policy_state_dict(tiny_model)
    assert list(published) == list(tiny_model.state_dict())
    for name, tensor in tiny_model.state_dict().items():
        assert torch.equal(published[name], tensor)
    assert not any(t.requires_grad for t in published.values())


def test_lora_model_publishes_merged_weights_equal_to_merge_and_unload(tiny_tokenizer) -> None:
    model = _lora_model(tiny_tokenizer)
    expected = copy.deepcopy(model).merge_and_unload().state_dict()

    published = policy_state_dict(model)

    base_names = list(build_tiny_causal_lm(tiny_tokenizer, seed=0).state_dict())
    assert sorted(published) == sorted(base_names)
    for name in base_names:
        torch.testing.assert_close(published[name], expected[name], msg=name)
    q = "model.layers.0.self_attn.q_proj.weight"
    base_q = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight
    assert not torch.allclose(published[q], base_q)  # the delta really was added


def test_publishing_a_lora_model_does_not_modify_it(tiny_tokenizer) -> None:
    model = _lora_model(tiny_tokenizer)
    before = {n: t.clone() for n, t in model.state_dict().items()}
    policy_state_dict(model)
    after = model.state_dict()
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert not any(getattr(m, "merged", False) for m in model.modules())


def test_check_finite_names_the_first_bad_tensor() -> None:
    state = {"ok": torch.ones(2), "layer.weight": torch.tensor([1.0, float("inf")])}
    with pytest.raises(ValueError, match="'layer.weight'"):
        check_finite(state)
    check_finite({"ids": torch.arange(3), "w": torch.zeros(2)})


def test_check_finite_passes_finite_tensors_whose_norm_overflows_and_mixed_dtypes() -> None:
    huge = torch.full((4,), 3e38)  # finite, but its squared sum overflows float32
    check_finite(
        {"huge": huge, "half": torch.ones(3, dtype=torch.bfloat16), "ids": torch.arange(2)}
    )
    with pytest.raises(ValueError, match="'nan'"):
        check_finite({"huge": huge, "nan": torch.tensor([float("nan")], dtype=torch.bfloat16)})
