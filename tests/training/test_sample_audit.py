"""The bias audit: trained against dropped items, cumulative, reported when dropped
completions are much longer, kept across a checkpoint."""

from __future__ import annotations

import asyncio
import logging

from tests.training.test_trainer import ListSource, _algorithm

from ludic.training.checkpoint import CheckpointConfig
from ludic.training.config import TrainerConfig
from ludic.training.sample_audit import SampleAudit
from ludic.training.trainer import Trainer
from ludic.training.types import SAWBatch, SAWItem


def _item(prompt: int, completion: int, reward: float, version: int | None = None) -> SAWItem:
    ids = list(range(1, prompt + completion + 1))
    mask = [0] * prompt + [1] * completion
    meta = {"prompt_length": prompt, "reward": reward}
    return SAWItem(ids, mask, 1.0, policy_version=version, meta=meta)


def test_means_per_class_and_the_warning_threshold() -> None:
    audit = SampleAudit()
    audit.add([_item(4, 2, 1.0), _item(6, 4, 0.0)], dropped=False)
    audit.add([_item(5, 8, 0.0)] * 7, dropped=True)
    m = audit.metrics()
    assert (m["audit/trained_samples"], m["audit/trained_prompt_length"]) == (2, 5.0)
    assert (m["audit/trained_completion_length"], m["audit/trained_reward"]) == (3.0, 0.5)
    assert (m["audit/dropped_samples"], m["audit/dropped_completion_length"]) == (7, 8.0)
    assert audit.warning() is None  # 7 dropped: too few to say
    audit.add([_item(5, 8, 0.0)], dropped=True)
    assert audit.warning().startswith("dropped samples are 2.7x longer than trained ones")
    audit.add([_item(5, 40, 0.0)] * 8, dropped=False)  # now trained ones are long too
    assert audit.warning() is None
    assert SampleAudit.from_state(audit.state()) == audit


def test_the_trainer_audits_stale_drops_warns_once_and_keeps_the_audit_across_resume(
    tiny_model, tmp_path, caplog
) -> None:
    # every step: 2 fresh short items, 4 stale long ones (version -10: too old)
    batch = SAWBatch([_item(4, 2, 1.0)] * 2 + [_item(4, 12, 0.0, version=-10)] * 4)
    config = TrainerConfig(lr=1e-3, max_staleness=1)
    checkpoint = CheckpointConfig(tmp_path, every_n_steps=0)
    trainer = Trainer(tiny_model, _algorithm(), ListSource(batch), config, checkpoint=checkpoint)
    with caplog.at_level(logging.WARNING, logger="ludic.training.trainer"):
        history = trainer.train_sync(3)
    last = history[-1]
    assert (last["audit/trained_samples"], last["audit/dropped_samples"]) == (6, 12)
    assert (last["audit/trained_completion_length"], last["audit/dropped_completion_length"]) == (
        2.0,
        12.0,
    )
    warnings = [r.getMessage() for r in caplog.records if "longer than trained" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith("step 2: dropped samples are 6.0x")
    trainer.save_checkpoint()
    again = Trainer(tiny_model, _algorithm(), ListSource(batch), config, checkpoint=checkpoint)
    again.resume()
    assert again.audit == trainer.audit
    (metrics,) = asyncio.run(_one(again))
    assert metrics["audit/dropped_samples"] == 16


async def _one(trainer: Trainer) -> list[dict[str, float]]:
    return [await trainer.train_step()]
