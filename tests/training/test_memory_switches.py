"""The training step's memory switches: packing equals padding (float32, mixed lengths),
gradient checkpointing equals storing activations, bf16 autocast trains end to end,
reference logprobs once per step on their own device; and the settings that cannot go
together are refused by name."""

from __future__ import annotations

import copy

import pytest
import torch
from tests.training.test_shared_prefix import FixedSource, gradients_of_one_step

from ludic.models.tiny import build_tiny_causal_lm
from ludic.training.algorithm import make_grpo, make_reinforce
from ludic.training.collate import collate
from ludic.training.config import TrainerConfig
from ludic.training.losses import CompositeLoss, KLPenalty
from ludic.training.token_scores import ScoringOptions, score_tokens
from ludic.training.trainer import Trainer
from ludic.training.types import SAWBatch, SAWItem

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def mixed_length_items(n: int = 10, seed: int = 4) -> list[SAWItem]:
    """Prompts of 3-12 tokens, completions of 2-60: the padded batch is mostly padding."""
    g = torch.Generator().manual_seed(seed)
    items = []
    for k in range(n):
        p = int(torch.randint(3, 13, (1,), generator=g))
        c = int(torch.randint(2, 61, (1,), generator=g))
        ids = torch.randint(3, 250, (p + c,), generator=g).tolist()
        items.append(SAWItem(ids, [0] * p + [1] * c, weight=(-1.0) ** k * (0.5 + k / 7)))
    return items


def step(model, items, algorithm=None, **config) -> tuple[dict, dict]:
    policy = copy.deepcopy(model)
    config = TrainerConfig(lr=1e-2, pad_token_id=0, **config)
    trainer = Trainer(policy, algorithm or make_reinforce(), FixedSource(SAWBatch(items)), config)
    return gradients_of_one_step(policy, trainer)


def assert_same_step(a: tuple[dict, dict], b: tuple[dict, dict], tol: float = 1e-5) -> None:
    (m_a, g_a), (m_b, g_b) = a, b
    assert m_a["loss"] == pytest.approx(m_b["loss"], rel=tol, abs=tol)
    assert m_a["entropy"] == pytest.approx(m_b["entropy"], rel=tol)
    assert m_b["grad_norm"] > 1e-3  # a real gradient: the comparison is not vacuous
    assert set(g_a) == set(g_b)
    for name, grad in g_b.items():
        torch.testing.assert_close(g_a[name], grad, atol=tol, rtol=tol)


def test_a_packed_step_equals_a_padded_one_on_mixed_lengths(tiny_tokenizer) -> None:
    model = build_tiny_causal_lm(tiny_tokenizer, seed=8)
    items = mixed_length_items()
    for budget in (10_000, 256):  # one micro-batch, several
        packed = step(
            model, items, packing=True, shared_prefix=False, max_tokens_per_microbatch=budget
        )
        padded = step(
            model, items, packing=False, shared_prefix=False, max_tokens_per_microbatch=budget
        )
        assert_same_step(packed, padded)
        assert packed[0]["num_tokens_run"] >= packed[0]["num_tokens"]
    # one micro-batch: the packed rows ran far fewer positions than the padded batch
    packed = step(model, items, packing=True, shared_prefix=False, max_tokens_per_microbatch=10_000)
    padded = step(
        model, items, packing=False, shared_prefix=False, max_tokens_per_microbatch=10_000
    )
    assert packed[0]["num_tokens_run"] < 0.75 * padded[0]["num_tokens_run"]


def test_the_full_vocabulary_mode_equals_the_chunked_one(tiny_tokenizer) -> None:
    model = build_tiny_causal_lm(tiny_tokenizer, seed=8)
    items = mixed_length_items()
    chunked = step(model, items, logprobs="chunked", logprob_chunk_tokens=7)
    full = step(model, items, logprobs="full")
    assert_same_step(chunked, full)


def test_gradient_checkpointing_gives_the_same_step(tiny_tokenizer) -> None:
    model = build_tiny_causal_lm(tiny_tokenizer, seed=8)
    items = mixed_length_items()
    checkpointed = step(model, items, gradient_checkpointing=True, shared_prefix=False)
    stored = step(model, items, shared_prefix=False)
    assert_same_step(checkpointed, stored)


def saved_bytes(model, mb) -> int:
    """Bytes autograd keeps for the backward pass of one training forward."""
    total = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        scores = score_tokens(model, mb, ScoringOptions(shared_prefix=False), with_entropy=True)
    scores.logprobs.sum().backward()
    return total[0]


def test_gradient_checkpointing_keeps_less_for_the_backward_pass(tiny_tokenizer) -> None:
    model = build_tiny_causal_lm(tiny_tokenizer, seed=8, num_layers=4)
    items = mixed_length_items(6)
    config = TrainerConfig(pad_token_id=0, gradient_checkpointing=True, shared_prefix=False)
    trainer = Trainer(model, make_reinforce(), FixedSource(SAWBatch(items)), config)
    assert trainer.model.is_gradient_checkpointing
    mb = collate(items, pad_token_id=0, device=torch.device("cpu"))
    model.train()
    checkpointed = saved_bytes(model, mb)
    model.gradient_checkpointing_disable()
    stored = saved_bytes(model, mb)
    assert checkpointed < 0.5 * stored


def test_settings_that_cannot_go_together_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="gradient_checkpointing=True.*shared_prefix=False"):
        TrainerConfig(gradient_checkpointing=True)
    with pytest.raises(ValueError, match="TrainerConfig.logprobs='dense'"):
        TrainerConfig(logprobs="dense")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="TrainerConfig.logprob_chunk_tokens=0"):
        TrainerConfig(logprob_chunk_tokens=0)


def test_a_model_whose_head_cannot_be_split_fails_at_construction(tiny_tokenizer) -> None:
    model = build_tiny_causal_lm(tiny_tokenizer, seed=8)
    model.config.final_logit_softcapping = 30.0
    source = FixedSource(SAWBatch(mixed_length_items(2)))
    with pytest.raises(ValueError, match="logit_softcapping.*logprobs='full'"):
        Trainer(model, make_reinforce(), source, TrainerConfig())
    Trainer(model, make_reinforce(), source, TrainerConfig(logprobs="full"))  # the way out


def test_bf16_autocast_trains_end_to_end(tiny_tokenizer) -> None:
    """On CPU autocast: the bf16 step's logprobs are close to float32's, chunked and full
    agree under bf16, and three steps move the weights with finite losses."""
    model = build_tiny_causal_lm(tiny_tokenizer, seed=8)
    mb = collate(mixed_length_items(6), pad_token_id=0, device=torch.device("cpu"))
    with torch.no_grad():
        f32 = score_tokens(model, mb, ScoringOptions()).logprobs
        bf16 = score_tokens(model, mb, ScoringOptions(dtype="bfloat16")).logprobs
        bf16_full = score_tokens(model, mb, ScoringOptions(dtype="bfloat16", logprobs="full"))
    assert bf16.dtype == torch.float32  # the softmax is float32 whatever the compute dtype
    mask = mb.action_mask.bool()
    assert (bf16 - f32)[mask].abs().max() < 0.1
    assert (bf16 - f32)[mask].abs().max() > 0  # bf16 really ran
    torch.testing.assert_close(bf16_full.logprobs, bf16, atol=2e-2, rtol=0)

    policy = copy.deepcopy(model)
    before = [p.detach().clone() for p in policy.parameters()]
    config = TrainerConfig(lr=1e-3, dtype="bfloat16", pad_token_id=0)
    trainer = Trainer(policy, make_reinforce(), FixedSource(SAWBatch(mixed_length_items())), config)
    history = trainer.train_sync(3)
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in history)
    assert all(p.dtype == torch.float32 for p in policy.parameters())  # weights stay float32
    assert any(not torch.equal(a, b) for a, b in zip(before, policy.parameters()))


def _kl_grpo():
    grpo = make_grpo(group_size=2)
    loss = CompositeLoss([("policy", 1.0, grpo.loss), ("kl", 1.0, KLPenalty(beta=0.5))])
    return type(grpo)("grpo_kl", grpo.credit_assigner, loss, grpo.preprocess)


def test_reference_logprobs_are_computed_once_per_step(tiny_tokenizer) -> None:
    model = build_tiny_causal_lm(tiny_tokenizer, seed=8)
    reference = build_tiny_causal_lm(tiny_tokenizer, seed=9)
    calls = [0]
    reference.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    reference.model.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    items = [
        SAWItem(i.input_ids, i.action_mask, i.weight, old_logprobs=[0.0] * i.num_tokens)
        for i in mixed_length_items(8)
    ]
    config = TrainerConfig(
        pad_token_id=0, ppo_epochs=2, num_minibatches=2, max_tokens_per_microbatch=10_000
    )
    trainer = Trainer(
        model, _kl_grpo(), FixedSource(SAWBatch(items)), config, reference_model=reference
    )
    (metrics,) = trainer.train_sync(1)
    assert metrics["num_updates"] == 4
    assert calls[0] == 1  # one micro-batch, once for the four updates
    assert metrics["loss/kl/kl"] > 0


@needs_cuda
def test_the_reference_model_lives_on_its_own_device(tiny_tokenizer) -> None:
    model = build_tiny_causal_lm(tiny_tokenizer, seed=8)
    reference = build_tiny_causal_lm(tiny_tokenizer, seed=9)
    items = [
        SAWItem(i.input_ids, i.action_mask, i.weight, old_logprobs=[0.0] * i.num_tokens)
        for i in mixed_length_items(4)
    ]
    config = TrainerConfig(pad_token_id=0, device="cpu", reference_device="cuda")
    trainer = Trainer(
        model, _kl_grpo(), FixedSource(SAWBatch(items)), config, reference_model=reference
    )
    assert next(trainer.reference_model.parameters()).device.type == "cuda"
    (metrics,) = trainer.train_sync(1)
    assert metrics["loss/kl/kl"] > 0
