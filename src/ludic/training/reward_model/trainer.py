"""Reward-model training on preference pairs (docs/reward-models.md).

A reward model is a sequence classifier with one label (an LLM backbone plus a linear ``score``
head read at the last non-pad token), trained in a ``RewardModelTrainingMode``: ``HEAD_ONLY``,
``LORA`` (peft adapters on the attention projections plus the head) or ``FULL``.
:func:`prepare_reward_model` sets a model up for a mode, :class:`PreferenceTrainer` optimises the
Bradley-Terry loss and publishes ``reward_model_state_dict(model, mode)``, and
:func:`save_reward_model` writes a plain HF folder (LoRA merged) that a vLLM reward server loads.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from ludic.distributed.reward_publisher import reward_model_state_dict
from ludic.distributed.weights import policy_state_dict
from ludic.inference.reward_client import RewardModelTrainingMode
from ludic.training.checkpoint import CheckpointConfig, CheckpointError
from ludic.training.core import HasTrainingCore, TrainingCore
from ludic.training.loggers import TrainingLogger
from ludic.training.losses.base import LossOutput
from ludic.training.losses.bradley_terry import BradleyTerryLoss
from ludic.training.reward_model.config import PreferenceTrainerConfig
from ludic.training.reward_model.preferences import PreferencePair
from ludic.training.reward_model.setup import (  # noqa: F401 (re-exported)
    LoraSettings,
    _chosen,
    _rejected,
    check_prepared,
    encode_texts,
    evaluate_preferences,
    head_module_names,
    prepare_reward_model,
    reward_scores,
)


# ---------------------------------------------------------------------------- trainer
class RewardPublisher(Protocol):
    """What :class:`PreferenceTrainer` publishes through, e.g.
    :class:`ludic.distributed.reward_publisher.RewardModelPublisher`."""

    def publish(
        self,
        state_dict: Mapping[str, torch.Tensor],
        version: int,
        *,
        training_mode: RewardModelTrainingMode | str | None = None,
    ) -> None: ...


class PreferenceTrainer(HasTrainingCore):
    """Trains a prepared reward model on preference pairs. Each :meth:`train_step`::

        pairs   = the next batch_size pairs of a seeded shuffle (new order every epoch;
                  a function of the step, so a resumed run sees the same batches)
        r       = model([format_reward_input(prompt, chosen_i)] + [... rejected_i])  [2B]
                  one right-padded forward, pooled at each text's last non-pad token
        loss    = BradleyTerryLoss(r[:B], r[B:], margin)
        backward -> check finite -> clip -> AdamW -> schedule -> step += 1 -> log
        publish reward_model_state_dict(model, mode) every publish_every steps
        (version = step) -> checkpoint

    ``model`` must come from :func:`prepare_reward_model` with the same ``training_mode``
    and pool with the tokenizer's pad token (``model.config.pad_token_id``).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        pairs: Sequence[PreferencePair],
        config: PreferenceTrainerConfig,
        *,
        training_mode: RewardModelTrainingMode | str,
        publisher: RewardPublisher | None = None,
        checkpoint: CheckpointConfig | None = None,
        loggers: Iterable[TrainingLogger] = (),
    ) -> None:
        self.mode = check_prepared(model, training_mode)
        if not pairs:
            raise ValueError("PreferenceTrainer: no preference pairs to train on")
        if config.batch_size > len(pairs):
            raise ValueError(
                f"PreferenceTrainerConfig.batch_size={config.batch_size} exceeds the "
                f"{len(pairs)} training pairs; lower batch_size or add pairs"
            )
        if config.publish_every > 0 and publisher is None:
            raise ValueError(
                f"PreferenceTrainerConfig.publish_every={config.publish_every} but no "
                "publisher; pass publisher= or set publish_every=0"
            )
        _check_model_config(model, tokenizer)
        torch.manual_seed(config.seed)
        self.config = config
        self.device = torch.device(config.device)
        self.model = model.to(self.device)
        self.tokenizer = tokenizer
        self.pairs = list(pairs)
        self.loss = BradleyTerryLoss()
        self.publisher = publisher
        self.core = TrainingCore(
            self.model,
            config.optimizer_config(),
            owner="reward-model step",
            fix_hint="Lower PreferenceTrainerConfig.lr or set max_grad_norm",
            checkpoint=checkpoint,
            loggers=loggers,
        )
        self._order: tuple[int, torch.Tensor] | None = None  # (epoch, permutation)

    # ---------------------------------------------------------------- the loop
    def train_step(self) -> dict[str, float]:
        """One optimizer step; returns (and logs) its metrics."""
        started = time.perf_counter()
        batch = self._batch(self.step)
        self.model.train()
        out, num_tokens = self._loss(batch)
        if not math.isfinite(out.stats["loss"]):
            self.core.abort_step(f"loss is {out.stats['loss']}")
        out.loss.backward()
        lr = self.core.lr
        grad_norm = self.core.optimizer_step()
        seconds = time.perf_counter() - started
        self.step += 1
        metrics = {
            **out.stats,
            "grad_norm": grad_norm,
            "lr": lr,
            "epoch": self.step * self.config.batch_size / len(self.pairs),
            "num_tokens": float(num_tokens),
            "tokens_per_s": num_tokens / max(seconds, 1e-9),
            "time/step_s": seconds,
        }
        self.logger.log(self.step, metrics)  # the step is done even if a publish fails
        if self.core.is_due(self.config.publish_every):
            self.publish()
        self.core.maybe_checkpoint(self._checkpoint_extra)
        return metrics

    def train(self, num_steps: int) -> list[dict[str, float]]:
        """Run ``num_steps`` optimizer steps; returns each step's metrics."""
        return [self.train_step() for _ in range(num_steps)]

    def evaluate(
        self, pairs: Sequence[PreferencePair], batch_size: int | None = None
    ) -> dict[str, float]:
        """:func:`evaluate_preferences` of the current model (``batch_size`` defaults to
        the training batch size)."""
        return evaluate_preferences(
            self.model, self.tokenizer, pairs, batch_size=batch_size or self.config.batch_size
        )

    # ---------------------------------------------------------------- stages
    def _batch(self, step: int) -> list[PreferencePair]:
        """Pairs ``step * B .. step * B + B - 1`` of the epoch-by-epoch shuffled order."""
        n, size = len(self.pairs), self.config.batch_size
        batch = []
        for position in range(step * size, (step + 1) * size):
            epoch, offset = divmod(position, n)
            batch.append(self.pairs[int(self._permutation(epoch)[offset])])
        return batch

    def _permutation(self, epoch: int) -> torch.Tensor:
        if self._order is None or self._order[0] != epoch:
            generator = torch.Generator().manual_seed(self.config.seed * 1_000_003 + epoch)
            self._order = (epoch, torch.randperm(len(self.pairs), generator=generator))
        return self._order[1]

    def _rewards(self, pairs: Sequence[PreferencePair]) -> tuple[torch.Tensor, int]:
        """Rewards [2B] (the chosen responses first, then the rejected ones) from one
        forward pass, and the number of non-pad tokens it read."""
        texts = [_chosen(p) for p in pairs] + [_rejected(p) for p in pairs]
        enc = encode_texts(self.tokenizer, texts, self.device)
        rewards = self.model(**enc, use_cache=False).logits[:, 0].float()  # [2B, 1] -> [2B]
        return rewards, int(enc["attention_mask"].sum())

    def _loss(self, pairs: Sequence[PreferencePair]) -> tuple[LossOutput, int]:
        rewards, num_tokens = self._rewards(pairs)
        margin = torch.tensor([p.margin for p in pairs], device=self.device)
        b = len(pairs)
        return self.loss(rewards[:b], rewards[b:], margin=margin), num_tokens

    # ---------------------------------------------------------------- publish, save
    def publish(self) -> None:
        """Publish the current weights as version ``step``."""
        if self.publisher is None:
            raise ValueError("PreferenceTrainer has no publisher; pass publisher=...")
        state = reward_model_state_dict(self.model, self.mode)
        self.publisher.publish(state, self.step, training_mode=self.mode)

    def save_checkpoint(self) -> Path:
        return self.core.save_checkpoint(self._checkpoint_extra())

    def _checkpoint_extra(self) -> dict[str, Any]:
        return {"training_mode": self.mode.value, "num_pairs": len(self.pairs)}

    def resume(self, path: str | Path | None = None) -> int:
        """Restore model, optimizer, schedule, RNGs and ``step`` from ``path`` (default:
        the latest checkpoint); returns the step. A checkpoint of another training mode
        is refused."""
        loaded = self.core.resume(path)
        if loaded.extra.get("training_mode") != self.mode.value:
            raise CheckpointError(
                f"checkpoint {str(loaded.path)!r} was trained with training_mode="
                f"{loaded.extra.get('training_mode')!r}, not {self.mode.value!r}"
            )
        return self.step


# ---------------------------------------------------------------------------- saving
def save_reward_model(model: torch.nn.Module, tokenizer: Any, path: str | Path) -> Path:
    """Write ``model`` (LoRA merged, out of place) and ``tokenizer`` to ``path`` as a plain
    HF folder under the base model's names; returns ``path``.

    A peft model is saved through an empty copy of its base model built on the meta device
    that takes the merged weights (``policy_state_dict``): the training model is left as
    it is, and only the LoRA-adapted matrices are copied.
    """
    path = Path(path)
    if hasattr(model, "peft_config"):
        base = model.get_base_model()
        with torch.device("meta"):
            plain = type(base)(copy.deepcopy(base.config))
        plain.load_state_dict(policy_state_dict(model), strict=True, assign=True)
        plain.save_pretrained(path)
    else:
        model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _check_model_config(model: torch.nn.Module, tokenizer: Any) -> None:
    pad = getattr(tokenizer, "pad_token_id", None)
    model_pad = getattr(model.config, "pad_token_id", None)
    if pad is None:
        raise ValueError(
            "the tokenizer has no pad token; set tokenizer.pad_token (and "
            "model.config.pad_token_id to its id)"
        )
    if model_pad != pad:
        raise ValueError(
            f"model.config.pad_token_id={model_pad} but tokenizer.pad_token_id={pad}; the "
            "model pools at the last token that is not its pad token, so set "
            "model.config.pad_token_id = tokenizer.pad_token_id"
        )
    labels = getattr(model.config, "num_labels", None)
    if labels != 1:
        raise ValueError(
            f"model.config.num_labels={labels}; a reward model has one label (load it with "
            "num_labels=1)"
        )
