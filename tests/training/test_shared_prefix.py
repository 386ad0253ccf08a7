"""The shared-prefix forward pass (``TrainerConfig.shared_prefix``): same logits and the
same updated weights as the plain forward pass, for fewer tokens through the model."""

from __future__ import annotations

import copy

import pytest
import torch

from ludic.models.tiny import build_tiny_causal_lm
from ludic.training.algorithm import make_grpo, make_sft
from ludic.training.collate import collate
from ludic.training.config import TrainerConfig
from ludic.training.shared_prefix import (
    plan_shared_prefixes,
    shared_prefix_logits,
    shared_prefix_outputs,
)
from ludic.training.trainer import Trainer, token_logprobs
from ludic.training.types import SAWBatch, SAWItem


class FixedSource:
    def __init__(self, batch: SAWBatch) -> None:
        self.batch = batch

    async def next_batch(self) -> SAWBatch:
        return self.batch


def grpo_like_items(model: torch.nn.Module | None = None) -> list[SAWItem]:
    """Two prompts of different lengths, three samples each with completions of different
    lengths; a multi-turn sample (an env turn between two actions) in the second group;
    one sample with a prompt of its own."""
    g = torch.Generator().manual_seed(3)

    def rand(n: int) -> list[int]:
        return torch.randint(3, 250, (n,), generator=g).tolist()

    prompts = [rand(9), rand(13)]
    rows: list[tuple[list[int], list[int]]] = []
    for p, prompt in enumerate(prompts):
        for k in range(3):
            completion = rand(2 + 3 * k + p)
            rows.append((prompt + completion, [0] * len(prompt) + [1] * len(completion)))
    turn = prompts[1] + rand(4) + rand(3) + rand(5)  # action, env reply, action
    rows.append((turn, [0] * 13 + [1] * 4 + [0] * 3 + [1] * 5))
    alone = rand(6) + rand(4)
    rows.append((alone, [0] * 6 + [1] * 4))
    items = []
    for k, (ids, mask) in enumerate(rows):
        old = None
        if model is not None:
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([ids])).logits
            lp = token_logprobs(logits, torch.tensor([ids]))[0].tolist()
            old = [0.0] + [x * m for x, m in zip(lp, mask[1:])]
        items.append(SAWItem(ids, mask, weight=(-1.0) ** k * (1 + k / 10), old_logprobs=old))
    return items


def test_the_plan_groups_rows_by_the_tokens_before_their_first_action() -> None:
    mb = collate(grpo_like_items(), pad_token_id=0, device=torch.device("cpu"))
    plan = plan_shared_prefixes(mb.input_ids, mb.attention_mask, mb.action_mask)
    assert plan is not None
    assert plan.group.tolist() == [0, 0, 0, 1, 1, 1, 1, 2]
    assert plan.prefix_lengths.tolist() == [9] * 3 + [13] * 4 + [6]
    assert plan.tokens_run == 9 + 13 + 6 + int(mb.attention_mask.sum()) - (9 * 3 + 13 * 4 + 6)
    # nothing shared, or a row without an action token: the plain forward
    distinct = collate(grpo_like_items()[-2:], 0, torch.device("cpu"))
    assert (
        plan_shared_prefixes(distinct.input_ids, distinct.attention_mask, distinct.action_mask)
        is None
    )
    no_action = mb.action_mask.clone()
    no_action[2] = 0
    assert plan_shared_prefixes(mb.input_ids, mb.attention_mask, no_action) is None


def test_logits_equal_the_plain_forward_in_float64(tiny_tokenizer) -> None:
    model = build_tiny_causal_lm(tiny_tokenizer, seed=5).double()
    mb = collate(grpo_like_items(), pad_token_id=0, device=torch.device("cpu"))
    plan = plan_shared_prefixes(mb.input_ids, mb.attention_mask, mb.action_mask)
    with torch.no_grad():
        plain = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
        shared = shared_prefix_logits(model, plan, mb.input_ids.shape[1])
    real = mb.attention_mask.bool()
    assert shared.shape == plain.shape
    torch.testing.assert_close(shared[real], plain[real], atol=1e-12, rtol=0)


@pytest.mark.parametrize("fuse", [True, False])
@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "llama", "mistral"])
def test_lean_hidden_states_and_gradients_equal_the_models_own_forward_in_float64(
    kind: str, fuse: bool, monkeypatch
) -> None:
    """The decoder's hidden states through LeanLayers (prefix and suffix tokens together)
    against its own forward run twice on a DynamicCache: values and every gradient."""
    from tests.llama_shaped import llama_shaped

    from ludic.models.lean_layers import LeanLayers, training_problem

    if not fuse:  # each projection called on its own, as for a large model
        monkeypatch.setattr("ludic.models.lean_layers.FUSE_BYTES", 0)
    model = llama_shaped(kind, vocab_size=256).double().train()
    decoder = model.get_decoder()
    assert training_problem(decoder) is None
    assert (LeanLayers(decoder, decoder.config).fused is not None) == fuse
    mb = collate(grpo_like_items(), pad_token_id=0, device=torch.device("cpu"))
    plan = plan_shared_prefixes(mb.input_ids, mb.attention_mask, mb.action_mask)
    b_idx, t_idx = mb.action_mask.nonzero(as_tuple=True)
    results = {}
    for lean in (True, False):
        if not lean:
            monkeypatch.setattr("ludic.training.shared_prefix.training_problem", lambda _: "forced")
        out = shared_prefix_outputs(decoder, plan, b_idx, t_idx, output="last_hidden_state")
        grads = torch.autograd.grad(out.pow(2).sum(), list(decoder.parameters()))
        results[lean] = (out.detach(), grads)
    torch.testing.assert_close(results[True][0], results[False][0], atol=1e-12, rtol=0)
    for mine, theirs in zip(results[True][1], results[False][1]):
        torch.testing.assert_close(mine, theirs, atol=1e-10, rtol=1e-10)


def test_rows_backward_adds_a_strided_gradient_like_index_select() -> None:
    from ludic.training.shared_prefix import _Rows

    x = torch.randn(3, 4, 5, dtype=torch.float64, requires_grad=True)
    index = torch.tensor([2, 0, 2, 1, 2])
    grad = torch.randn(5, 7, 4, dtype=torch.float64)[:, 1:6].transpose(1, 2)  # not contiguous
    (mine,) = torch.autograd.grad(_Rows.apply(x, index), x, grad)
    (torchs,) = torch.autograd.grad(x.index_select(0, index), x, grad)
    torch.testing.assert_close(mine, torchs, atol=1e-15, rtol=0)


def gradients_of_one_step(policy: torch.nn.Module, trainer: Trainer) -> tuple[dict, dict]:
    """The step's metrics, and the accumulated gradient of every parameter as the
    optimizer receives it."""
    grads: dict[str, torch.Tensor] = {}
    for name, param in policy.named_parameters():

        def keep(p: torch.Tensor, name: str = name) -> None:
            grads[name] = p.grad.detach().clone()

        param.register_post_accumulate_grad_hook(keep)
    (metrics,) = trainer.train_sync(1)
    return metrics, grads


@pytest.mark.parametrize("algorithm", ["grpo", "sft"])
def test_a_step_has_the_loss_and_gradients_of_the_plain_forward(tiny_tokenizer, algorithm) -> None:
    """float32: the loss, the entropy metric and every parameter's gradient to 1e-5."""
    model = build_tiny_causal_lm(tiny_tokenizer, seed=6)
    items = grpo_like_items(model)
    preset = make_grpo(group_size=2) if algorithm == "grpo" else make_sft()
    results = {}
    for shared in (True, False):
        policy = copy.deepcopy(model)
        config = TrainerConfig(lr=1e-2, shared_prefix=shared, pad_token_id=0)
        trainer = Trainer(policy, preset, FixedSource(SAWBatch(items)), config)
        results[shared] = gradients_of_one_step(policy, trainer)
    (m_shared, g_shared), (m_plain, g_plain) = results[True], results[False]
    assert m_shared["loss"] == pytest.approx(m_plain["loss"], rel=1e-5, abs=1e-6)
    assert m_shared["grad_norm"] == pytest.approx(m_plain["grad_norm"], rel=1e-5)
    assert m_shared["entropy"] == pytest.approx(m_plain["entropy"], rel=1e-5)
    assert set(g_shared) == set(g_plain) and len(g_plain) > 10
    for name, grad in g_plain.items():
        torch.testing.assert_close(g_shared[name], grad, atol=1e-5, rtol=1e-5)
    assert m_plain["grad_norm"] > 1e-3  # a real gradient: the comparison is not vacuous
