"""Trainer on the tiny Qwen2 model: the loop, gradient accumulation, drops, errors, sync."""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from ludic.distributed.publisher import InMemoryPublisher
from ludic.models.tiny import build_tiny_causal_lm
from ludic.stats import Reducer
from ludic.training.checkpoint import CheckpointConfig
from ludic.training.collate import split_microbatches
from ludic.training.config import TrainerConfig
from ludic.training.filters import drop_truncated, drop_version_span
from ludic.training.loggers import JsonlLogger
from ludic.training.losses.base import LossInputs, LossOutput
from ludic.training.policy_update import StepTotals
from ludic.training.trainer import EmptyBatchError, NonFiniteError, Trainer
from ludic.training.types import DataExhausted, SAWBatch, SAWItem


@dataclass
class WeightedNLL:
    """Token-mean of -weight * logp over action tokens (REINFORCE / SFT when weight = 1)."""

    requires_old_logprobs: bool = False
    requires_ref_logprobs: bool = False
    requires_proximal_logprobs: bool = False
    requires_entropy: bool = False

    def __call__(self, inputs: LossInputs) -> LossOutput:
        per_token = -inputs.weights[:, None] * inputs.logprobs * inputs.action_mask
        loss = per_token.sum() / inputs.num_action_tokens
        return LossOutput(loss, {"logp_mean": float(-loss.detach())})


def _algorithm(loss=None, preprocess=None) -> SimpleNamespace:
    return SimpleNamespace(name="test", loss=loss or WeightedNLL(), preprocess=preprocess)


class ListSource:
    """Returns the given batches in order, then repeats the last one."""

    def __init__(self, *batches: SAWBatch) -> None:
        self.batches, self.calls = list(batches), 0

    async def next_batch(self) -> SAWBatch:
        batch = self.batches[min(self.calls, len(self.batches) - 1)]
        self.calls += 1
        return batch


def _items(n: int = 4, seed: int = 0, **item_kwargs) -> list[SAWItem]:
    """``n`` random sequences of 8..20 tokens, the last 3..8 of them actions."""
    g = torch.Generator().manual_seed(seed)
    items = []
    for i in range(n):
        prompt = int(torch.randint(5, 13, (1,), generator=g))
        completion = int(torch.randint(3, 9, (1,), generator=g))
        ids = torch.randint(0, 256, (prompt + completion,), generator=g).tolist()
        mask = [0] * prompt + [1] * completion
        meta = {"rollout_id": f"r{i}", "reward": float(i)}
        items.append(SAWItem(ids, mask, weight=1.0 + 0.5 * i, meta=meta, **item_kwargs))
    return items


def _config(**kwargs) -> TrainerConfig:
    return TrainerConfig(**{"lr": 1e-3, "max_grad_norm": None, **kwargs})


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _same_params(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[n], b[n]) or torch.allclose(a[n], b[n], equal_nan=True) for n in a)


def test_microbatched_gradients_equal_full_batch_gradients(tiny_tokenizer) -> None:
    items = _items(6)
    totals = StepTotals(len(items), sum(i.num_action_tokens for i in items))
    grads = []
    for budget in (10_000, 24):  # one micro-batch vs several
        model = build_tiny_causal_lm(tiny_tokenizer, seed=0)
        trainer = Trainer(model, _algorithm(), ListSource(), _config())
        microbatches = split_microbatches(items, budget)
        loss, _, _ = trainer.update.accumulate_gradients(microbatches, totals)
        grads.append(
            (len(microbatches), loss, {n: p.grad.clone() for n, p in model.named_parameters()})
        )

    (n_full, loss_full, g_full), (n_micro, loss_micro, g_micro) = grads
    assert n_full == 1 and n_micro > 2
    assert loss_micro == pytest.approx(loss_full, rel=1e-5)
    for name, grad in g_full.items():
        torch.testing.assert_close(g_micro[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_step_metrics_do_not_depend_on_the_microbatch_budget(tiny_tokenizer) -> None:
    metrics = []
    for budget in (10_000, 24):
        model = build_tiny_causal_lm(tiny_tokenizer, seed=0)
        source = ListSource(SAWBatch(_items(5)))
        trainer = Trainer(model, _algorithm(), source, _config(max_tokens_per_microbatch=budget))
        metrics.append(trainer.train_sync(1)[0])
    assert metrics[1]["num_microbatches"] > 1 == metrics[0]["num_microbatches"]
    assert metrics[1]["loss"] == pytest.approx(metrics[0]["loss"], rel=1e-5)
    assert metrics[1]["grad_norm"] == pytest.approx(metrics[0]["grad_norm"], rel=1e-4)


def test_step_metrics_report_the_policy_token_entropy(tiny_tokenizer) -> None:
    from ludic.training.losses.base import masked_token_entropy

    items = _items(5)
    got = []
    for budget in (10_000, 24):  # one micro-batch or several: the same token mean
        model = build_tiny_causal_lm(tiny_tokenizer, seed=0)
        source = ListSource(SAWBatch(items))
        trainer = Trainer(model, _algorithm(), source, _config(max_tokens_per_microbatch=budget))
        got.append(trainer.train_sync(1)[0]["entropy"])
    model = build_tiny_causal_lm(tiny_tokenizer, seed=0)
    entropies, mask = [], []
    with torch.no_grad():
        for item in items:
            logits = model(input_ids=torch.tensor([item.input_ids])).logits
            entropies += masked_token_entropy(logits)[0].tolist()
            mask += item.action_mask[1:]
    expected = sum(e * m for e, m in zip(entropies, mask)) / sum(mask)
    assert got == pytest.approx([expected, expected], rel=1e-4)
    assert 0 < expected <= math.log(model.config.vocab_size) + 1e-6


def test_sft_loss_goes_down_on_a_fixed_batch(tiny_model) -> None:
    trainer = Trainer(tiny_model, _algorithm(), ListSource(SAWBatch(_items(4))), _config())
    losses = [m["loss"] for m in trainer.train_sync(20)]
    assert trainer.step == 20
    assert losses[-1] < 0.5 * losses[0]


def test_step_metrics_report_loss_counts_rewards_and_policy_version(tiny_model) -> None:
    items = _items(3)
    batch = SAWBatch(items, meta={"rollouts": 3, "note": "text is skipped"})
    reducer = Reducer("reward_sum", "meta.reward", reduce="sum")
    trainer = Trainer(
        tiny_model, _algorithm(), ListSource(batch), _config(), metric_reducers=[reducer]
    )
    m = asyncio.run(trainer.train_step())

    assert m["policy_version"] == 1 == trainer.step
    assert m["num_items"] == 3
    assert m["num_tokens"] == sum(i.num_tokens for i in items)
    assert m["num_action_tokens"] == sum(i.num_action_tokens for i in items)
    assert m["reward/mean"] == 1.0 and m["reward/max"] == 2.0 and m["reward_sum"] == 3.0
    assert m["batch/rollouts"] == 3.0 and "batch/note" not in m
    assert m["loss/logp_mean"] == pytest.approx(-m["loss"])
    assert m["lr"] == 1e-3 and m["grad_norm"] > 0 and m["tokens_per_s"] > 0
    assert m["dropped/filter"] == 0 and m["dropped/stale"] == 0


def test_max_staleness_drops_items_older_than_step_minus_max_staleness(tiny_model) -> None:
    warmup = SAWBatch(_items(2))
    versioned = SAWBatch(
        [
            SAWItem(i.input_ids, i.action_mask, 1.0, policy_version=v)
            for i, v in zip(_items(5), [0, 1, 2, 3, None])
        ]
    )
    trainer = Trainer(
        tiny_model,
        _algorithm(),
        ListSource(warmup, warmup, warmup, versioned),
        _config(max_staleness=1),
    )
    trainer.train_sync(3)
    m = asyncio.run(trainer.train_step())  # current version 3: versions < 2 are stale
    assert m["dropped/stale"] == 2 and m["num_items"] == 3


def test_sample_filter_drops_are_counted(tiny_model) -> None:
    items = _items(4)
    items[0] = SAWItem(items[0].input_ids, items[0].action_mask, 1.0, meta={"truncated": True})
    trainer = Trainer(
        tiny_model,
        _algorithm(),
        ListSource(SAWBatch(items)),
        _config(),
        sample_filter=drop_truncated(),
    )
    m = asyncio.run(trainer.train_step())
    assert m["dropped/filter"] == 1 and m["num_items"] == 3


def test_the_version_span_validator_drops_items_sampled_across_updates(tiny_model) -> None:
    """trainer.max_version_span's filter: an item whose tokens (may) come from two policy
    versions is dropped and counted, whether the versions are known per token (a continued
    partial rollout) or only as a range (an update landed without a pause)."""
    one, two, three = (i.input_ids for i in _items(3))
    mask = lambda ids: (0,) * (len(ids) - 2) + (1, 1)  # noqa: E731
    items = [
        SAWItem(one, mask(one), 1.0, action_versions=(2, 2)),  # one version: kept
        SAWItem(two, mask(two), 1.0, action_versions=(1, 2)),  # continued across an update
        SAWItem(three, mask(three), 1.0, policy_version=1, version_end=2),  # no pause
    ]
    assert [i.version_span for i in items] == [0, 1, 1]
    trainer = Trainer(
        tiny_model,
        _algorithm(),
        ListSource(SAWBatch(items)),
        _config(),
        sample_filter=drop_version_span(0),
    )
    m = asyncio.run(trainer.train_step())
    assert m["dropped/filter"] == 2 and m["num_items"] == 1


def test_a_batch_emptied_by_filters_raises_naming_the_counts(tiny_model) -> None:
    items = [SAWItem(i.input_ids, i.action_mask, 1.0, meta={"truncated": True}) for i in _items(3)]
    before = _params(tiny_model)
    trainer = Trainer(
        tiny_model,
        _algorithm(),
        ListSource(SAWBatch(items)),
        _config(),
        sample_filter=drop_truncated(),
    )
    with pytest.raises(EmptyBatchError, match="3 items is empty after 3 dropped by sample_filter"):
        asyncio.run(trainer.train_step())
    assert trainer.step == 0 and _same_params(before, _params(tiny_model))


def test_preprocess_rewrites_the_batch_before_the_loss(tiny_model) -> None:
    seen: list[int] = []

    def keep_first_two(batch: SAWBatch) -> SAWBatch:
        seen.append(len(batch))
        return SAWBatch(batch.items[:2], batch.meta)

    trainer = Trainer(
        tiny_model,
        _algorithm(preprocess=keep_first_two),
        ListSource(SAWBatch(_items(4))),
        _config(),
    )
    assert asyncio.run(trainer.train_step())["num_items"] == 2 and seen == [4]


def test_nan_weight_in_the_model_raises_and_leaves_parameters_unchanged(tiny_model) -> None:
    with torch.no_grad():
        tiny_model.model.layers[0].mlp.up_proj.weight[0, 0] = math.nan
    before = _params(tiny_model)
    trainer = Trainer(tiny_model, _algorithm(), ListSource(SAWBatch(_items(2))), _config())
    with pytest.raises(NonFiniteError, match=r"step 1: loss is nan"):
        asyncio.run(trainer.train_step())
    assert trainer.step == 0 and _same_params(before, _params(tiny_model))
    assert all(p.grad is None for p in tiny_model.parameters())


@dataclass
class NaNGradLoss(WeightedNLL):
    """Finite loss value, NaN gradient: d/dx sqrt(x) at 0 is inf, times 0 is NaN."""

    def __call__(self, inputs: LossInputs) -> LossOutput:
        out = super().__call__(inputs)
        return LossOutput(out.loss + torch.sqrt(0.0 * inputs.logprobs.sum()), out.stats)


def test_nan_gradient_raises_and_skips_the_optimizer_step(tiny_model) -> None:
    before = _params(tiny_model)
    trainer = Trainer(
        tiny_model, _algorithm(NaNGradLoss()), ListSource(SAWBatch(_items(2))), _config()
    )
    with pytest.raises(NonFiniteError, match="step 1: gradient norm is nan"):
        asyncio.run(trainer.train_step())
    assert trainer.step == 0 and _same_params(before, _params(tiny_model))


def test_loss_needing_old_logprobs_names_return_spec_for_rl(tiny_model) -> None:
    loss = WeightedNLL(requires_old_logprobs=True)
    trainer = Trainer(tiny_model, _algorithm(loss), ListSource(SAWBatch(_items(2))), _config())
    with pytest.raises(ValueError, match=r"ReturnSpec\.for_rl\(\)"):
        asyncio.run(trainer.train_step())


def test_a_batch_the_loss_cannot_use_is_rejected_by_an_acknowledging_source(tiny_model) -> None:
    """A batch from another process (a Redis learner's) that lacks what the loss needs is
    set aside through the source, never crashing the step; the next batch is trained."""
    with_logprobs = [
        SAWItem(i.input_ids, i.action_mask, 1.0, old_logprobs=(0.0,) * i.num_tokens)
        for i in _items(2, seed=5)
    ]
    poison, good = SAWBatch(_items(2), {"n": "poison"}), SAWBatch(with_logprobs, {"n": "good"})
    source = AcknowledgingSource(poison, good)
    source.max_staleness = None
    loss = WeightedNLL(requires_old_logprobs=True)
    trainer = Trainer(tiny_model, _algorithm(loss), source, _config())
    (metrics,) = trainer.train_sync(1)
    assert metrics["num_items"] == 2 and trainer.step == 1
    [(batch, error)] = source.rejected
    assert batch.meta == {"n": "poison"} and "requires old_logprobs" in error
    assert [b.meta for b in source.acknowledged] == [{"n": "good"}]
    # a producer that only makes such batches fails the step, naming the problem
    flood = AcknowledgingSource(poison)
    flood.max_staleness = None
    trainer = Trainer(tiny_model, _algorithm(loss), flood, _config())
    with pytest.raises(EmptyBatchError, match="16 batches in a row rejected .*old_logprobs"):
        trainer.train_sync(1)
    assert len(flood.rejected) == 16 and trainer.step == 0


def test_old_logprobs_reach_the_loss_shifted_to_next_token_positions(tiny_model) -> None:
    seen: list[torch.Tensor] = []

    @dataclass
    class Spy(WeightedNLL):
        def __call__(self, inputs: LossInputs) -> LossOutput:
            seen.append(inputs.old_logprobs)
            return super().__call__(inputs)

    item = SAWItem((1, 2, 3, 4), (0, 0, 1, 1), 1.0, old_logprobs=(0.0, 0.0, -1.0, -2.0))
    trainer = Trainer(
        tiny_model,
        _algorithm(Spy(requires_old_logprobs=True)),
        ListSource(SAWBatch([item])),
        _config(),
    )
    asyncio.run(trainer.train_step())
    assert seen[0].tolist() == [[0.0, -1.0, -2.0]]


def test_each_tokens_policy_version_reaches_the_loss(tiny_model) -> None:
    """A completion continued across the update to version 4 carries (3, 3, 4) to the
    loss, token by token; an item with one known version has it on each action token."""
    seen: list[torch.Tensor | None] = []

    @dataclass
    class Spy(WeightedNLL):
        def __call__(self, inputs: LossInputs) -> LossOutput:
            seen.append(inputs.action_versions)
            return super().__call__(inputs)

    straddling = SAWItem((1, 2, 3, 4, 5), (0, 0, 1, 1, 1), 1.0, action_versions=(3, 3, 4))
    whole = SAWItem((6, 7, 8), (0, 1, 1), 1.0, policy_version=4)
    trainer = Trainer(
        tiny_model, _algorithm(Spy()), ListSource(SAWBatch([straddling, whole])), _config()
    )
    trainer.step = 4
    asyncio.run(trainer.train_step())
    rows = sorted(seen[0].tolist())  # micro-batches sort items by length
    assert rows == [[-1, 3, 3, 4], [4, 4, -1, -1]]


def test_loss_needing_ref_logprobs_without_reference_model_fails_at_construction(tiny_model):
    with pytest.raises(ValueError, match="reference_model"):
        Trainer(
            tiny_model, _algorithm(WeightedNLL(requires_ref_logprobs=True)), ListSource(), _config()
        )


def test_reference_model_supplies_ref_logprobs_equal_to_the_initial_policy(tiny_tokenizer):
    seen: list[LossInputs] = []

    @dataclass
    class Spy(WeightedNLL):
        def __call__(self, inputs: LossInputs) -> LossOutput:
            seen.append(inputs)
            return super().__call__(inputs)

    model = build_tiny_causal_lm(tiny_tokenizer, seed=0)
    reference = build_tiny_causal_lm(tiny_tokenizer, seed=0)
    loss = Spy(requires_ref_logprobs=True)
    trainer = Trainer(
        model,
        _algorithm(loss),
        ListSource(SAWBatch(_items(2))),
        _config(),
        reference_model=reference,
    )
    asyncio.run(trainer.train_step())
    first = seen[0]
    assert first.ref_logprobs is not None and not first.ref_logprobs.requires_grad
    torch.testing.assert_close(first.ref_logprobs, first.logprobs.detach())
    assert not any(p.requires_grad for p in reference.parameters())


def test_publishes_every_n_steps_with_version_equal_to_step(tiny_model) -> None:
    publisher = InMemoryPublisher()
    trainer = Trainer(
        tiny_model,
        _algorithm(),
        ListSource(SAWBatch(_items(2))),
        _config(publish_every=2),
        publisher=publisher,
    )
    trainer.train_sync(5)
    assert publisher.versions == [2, 4]
    trainer.train_sync(1)
    assert publisher.versions == [2, 4, 6]
    for name, tensor in tiny_model.state_dict().items():
        assert torch.equal(publisher.state_dict[name], tensor)


def test_resume_gives_the_same_next_loss_and_optimizer_state(tiny_tokenizer, tmp_path) -> None:
    batch = SAWBatch(_items(3))
    ckpt = CheckpointConfig(tmp_path, every_n_steps=2, keep_last=1)
    model = build_tiny_causal_lm(tiny_tokenizer, seed=0)
    uninterrupted = Trainer(model, _algorithm(), ListSource(batch), _config(), checkpoint=ckpt)
    expected = uninterrupted.train_sync(3)[-1]["loss"]

    other = build_tiny_causal_lm(tiny_tokenizer, seed=1)
    resumed = Trainer(other, _algorithm(), ListSource(batch), _config(), checkpoint=ckpt)
    assert resumed.resume() == 2
    assert resumed.train_sync(1)[-1]["loss"] == pytest.approx(expected, rel=1e-6)
    assert resumed.step == 3
    for a, b in zip(uninterrupted.optimizer.state.values(), resumed.optimizer.state.values()):
        torch.testing.assert_close(a["exp_avg"], b["exp_avg"])
        torch.testing.assert_close(a["exp_avg_sq"], b["exp_avg_sq"])
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(other.state_dict()[name], tensor)


def test_trainer_logs_one_jsonl_line_per_step(tiny_model, tmp_path) -> None:
    path = tmp_path / "metrics.jsonl"
    trainer = Trainer(
        tiny_model,
        _algorithm(),
        ListSource(SAWBatch(_items(2))),
        _config(),
        loggers=[JsonlLogger(path)],
    )
    trainer.train_sync(2)
    trainer.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
    assert all("loss" in line and "grad_norm" in line for line in lines)


def test_train_sync_inside_an_event_loop_points_to_await_train(tiny_model) -> None:
    trainer = Trainer(tiny_model, _algorithm(), ListSource(SAWBatch(_items(1))), _config())

    async def call_sync() -> None:
        trainer.train_sync(1)

    with pytest.raises(RuntimeError, match="await trainer.train"):
        asyncio.run(call_sync())


def test_algorithm_without_a_loss_is_rejected(tiny_model) -> None:
    with pytest.raises(TypeError, match="TrainingAlgorithm.*RLAlgorithm"):
        Trainer(tiny_model, object(), ListSource(), _config())


@dataclass
class LegacyLoss:
    """A loss written before requires_proximal_logprobs and requires_entropy existed."""

    requires_old_logprobs: bool = False
    requires_ref_logprobs: bool = False

    def __call__(self, inputs: LossInputs) -> LossOutput:
        return WeightedNLL()(inputs)


def test_a_loss_missing_a_flag_is_rejected_at_construction_naming_it(tiny_model) -> None:
    with pytest.raises(
        TypeError, match=r"lacks \['requires_proximal_logprobs', 'requires_entropy'\]"
    ):
        Trainer(tiny_model, _algorithm(LegacyLoss()), ListSource(), _config())


class HalfConcurrentSource(ListSource):
    """Hears policy versions but declares neither max_staleness nor aclose."""

    def on_policy_version(self, version: int) -> None:
        pass


class UncallableAckSource(ListSource):
    mark_trained = "yes"

    def reject(self, batch: SAWBatch, error: str) -> None: ...

    def on_checkpoint(self, step: int) -> None: ...


class MarkOnlySource(ListSource):
    def mark_trained(self, batch: SAWBatch) -> None: ...


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (object(), "has no async next_batch"),
        (HalfConcurrentSource(), r"has on_policy_version but lacks \['max_staleness', 'aclose'\]"),
        (UncallableAckSource(), r"has mark_trained but has non-callable \['mark_trained'\]"),
        (MarkOnlySource(), r"has mark_trained but lacks \['reject', 'on_checkpoint'\]"),
    ],
)
def test_a_batch_source_with_a_half_declared_capability_is_rejected(
    tiny_model, source, message
) -> None:
    with pytest.raises(TypeError, match=message):
        Trainer(tiny_model, _algorithm(), source, _config())


class AcknowledgingSource(ListSource):
    max_staleness = 0  # StalenessBoundedSource: only the current version is trained on

    def __init__(self, *batches: SAWBatch) -> None:
        super().__init__(*batches)
        self.acknowledged: list[SAWBatch] = []
        self.rejected: list[tuple[SAWBatch, str]] = []
        self.checkpoints: list[tuple[int, int]] = []

    def mark_trained(self, batch: SAWBatch) -> None:
        self.acknowledged.append(batch)

    def reject(self, batch: SAWBatch, error: str) -> None:
        self.rejected.append((batch, error))

    def on_checkpoint(self, step: int) -> None:
        self.checkpoints.append((step, len(self.acknowledged)))


def test_capabilities_are_used_through_their_protocols(tiny_model) -> None:
    fresh, stale = _items(2, seed=1), _items(2, seed=2, policy_version=-1)
    source = AcknowledgingSource(SAWBatch(fresh + stale, {"n": 1}))
    trainer = Trainer(tiny_model, _algorithm(), source, _config())
    assert trainer.max_staleness == 0  # from the source: TrainerConfig.max_staleness is None
    (metrics,) = trainer.train_sync(1)
    assert metrics["dropped/stale"] == 2 and metrics["num_items"] == 2
    assert [b.meta for b in source.acknowledged] == [{"n": 1}]  # after the step, once
    assert source.checkpoints == []  # no checkpoint written yet


def test_an_acknowledging_source_hears_of_each_checkpoint_after_its_batches(
    tiny_model, tmp_path
) -> None:
    source = AcknowledgingSource(SAWBatch(_items(2), {"n": 1}))
    source.max_staleness = None
    checkpoint = CheckpointConfig(tmp_path, every_n_steps=2)
    trainer = Trainer(tiny_model, _algorithm(), source, _config(), checkpoint=checkpoint)
    trainer.train_sync(3)
    trainer.save_checkpoint()  # as a job does at the end
    # (step, batches acknowledged by then): the step's batch is acknowledged first
    assert source.checkpoints == [(2, 2), (3, 3)]


def test_preprocess_sees_only_items_that_survive_the_filter(tiny_model) -> None:
    seen: list[int] = []

    def count(batch: SAWBatch) -> SAWBatch:
        seen.append(len(batch))
        return batch

    items = _items(4)
    items[0] = SAWItem(items[0].input_ids, items[0].action_mask, 1.0, meta={"truncated": True})
    trainer = Trainer(
        tiny_model,
        _algorithm(preprocess=count),
        ListSource(SAWBatch(items)),
        _config(),
        sample_filter=drop_truncated(),
    )
    asyncio.run(trainer.train_step())
    assert seen == [3]


class FiniteSource:
    def __init__(self, n: int) -> None:
        self.left = n

    async def next_batch(self) -> SAWBatch:
        if self.left == 0:
            raise DataExhausted("no more batches")
        self.left -= 1
        return SAWBatch(_items(2))


def test_train_stops_cleanly_when_the_source_is_exhausted(tiny_model) -> None:
    trainer = Trainer(tiny_model, _algorithm(), FiniteSource(2), _config())
    history = asyncio.run(trainer.train(5))
    assert len(history) == 2 and trainer.step == 2
