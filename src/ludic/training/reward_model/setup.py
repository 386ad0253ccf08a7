"""A reward model's set-up per training mode and its scoring (docs/design.md, "Reward models").

A reward model is a sequence classifier with one label (an LLM backbone plus a linear
``score`` head read at the last non-pad token). :func:`prepare_reward_model` sets it up for
a :class:`~ludic.inference.reward_client.RewardModelTrainingMode`;
:func:`reward_scores` / :func:`evaluate_preferences` score texts and preference pairs the
way :class:`~ludic.training.reward_model.trainer.PreferenceTrainer` trains them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ludic.distributed.reward_publisher import HEAD_MODULES, is_head
from ludic.inference.reward_client import RewardModelTrainingMode, format_reward_input
from ludic.training.losses.bradley_terry import BradleyTerryLoss
from ludic.training.reward_model.preferences import PreferencePair


# ---------------------------------------------------------------------------- modes
@dataclass(frozen=True)
class LoraSettings:
    """peft LoRA adapters for ``LORA`` mode (W + (alpha / r) B A on each target)."""

    r: int = 8
    alpha: int = 16
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    """Module names to adapt; the default is every attention projection of Qwen2/Llama."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_modules", tuple(self.target_modules))
        if self.r < 1 or self.alpha < 1:
            raise ValueError(f"LoraSettings: r={self.r}, alpha={self.alpha}; both must be >= 1")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoraSettings.dropout={self.dropout}; expected a value in [0, 1)")
        if not self.target_modules:
            raise ValueError("LoraSettings.target_modules is empty; name modules to adapt")


def head_module_names(model: torch.nn.Module) -> list[str]:
    """Names of the modules holding the classification head's parameters (``["score"]``
    for HF decoder classifiers)."""
    names: list[str] = []
    for name, _ in model.named_parameters():
        if is_head(name):
            parts = name.split(".")[:-1]
            cut = max(i for i, part in enumerate(parts) if part in HEAD_MODULES)
            module = ".".join(parts[: cut + 1])
            if module not in names:
                names.append(module)
    return names


def prepare_reward_model(
    model: torch.nn.Module,
    training_mode: RewardModelTrainingMode | str,
    *,
    lora: LoraSettings | None = None,
) -> torch.nn.Module:
    """``model`` set up to train in ``training_mode``; returns the model to train.

    * ``HEAD_ONLY``: every parameter frozen except the head's (same object returned).
    * ``LORA``: a peft model with ``lora`` adapters (default :class:`LoraSettings`) and the
      head in ``modules_to_save``, so the head trains too; base weights stay frozen.
    * ``FULL``: every parameter trainable (same object returned).

    Raises ``ValueError`` for a model without a classification head (a module named
    ``score`` or ``classifier``), a model already wrapped by peft, ``lora`` given for
    another mode, or an unknown mode (the message lists the valid ones).
    """
    mode = RewardModelTrainingMode.parse(training_mode)
    name = type(model).__name__
    if hasattr(model, "peft_config"):
        raise ValueError(
            f"prepare_reward_model: {name} is already a peft model; pass the plain "
            "sequence-classification model (LORA mode adds the adapters itself)"
        )
    heads = head_module_names(model)
    if not heads:
        raise ValueError(
            f"prepare_reward_model: {name} has no classification head (a module named one "
            f"of {HEAD_MODULES}); load it with AutoModelForSequenceClassification."
            "from_pretrained(path, num_labels=1), or build one with build_tiny_reward_model"
        )
    if lora is not None and mode is not RewardModelTrainingMode.LORA:
        raise ValueError(
            f"prepare_reward_model: lora settings given for training_mode={mode.value!r}; "
            "they apply to 'lora' only (drop lora= or use training_mode='lora')"
        )
    if mode is RewardModelTrainingMode.FULL:
        model.requires_grad_(True)
        return model
    if mode is RewardModelTrainingMode.HEAD_ONLY:
        for param_name, param in model.named_parameters():
            param.requires_grad_(is_head(param_name))
        return model
    return _with_lora(model, lora or LoraSettings(), heads)


def _with_lora(model: torch.nn.Module, lora: LoraSettings, heads: Sequence[str]) -> torch.nn.Module:
    try:
        import peft
    except ImportError:
        raise ImportError("LORA reward-model training needs peft: pip install peft") from None
    config = peft.LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        modules_to_save=list(heads),
        task_type="SEQ_CLS",
    )
    try:
        return peft.get_peft_model(model, config)
    except ValueError as e:
        raise ValueError(f"prepare_reward_model: lora.target_modules: {e}") from None


def check_prepared(
    model: torch.nn.Module, training_mode: RewardModelTrainingMode | str
) -> RewardModelTrainingMode:
    """Raise unless ``model`` trains exactly what ``training_mode`` says (as
    :func:`prepare_reward_model` leaves it); returns the parsed mode."""
    mode = RewardModelTrainingMode.parse(training_mode)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    is_peft = hasattr(model, "peft_config")
    backbone = [n for n in trainable if not is_head(n)]
    problem = None
    if not any(is_head(n) for n in trainable):
        problem = "its classification head is frozen or missing"
    elif mode is RewardModelTrainingMode.LORA and not is_peft:
        problem = "it has no LoRA adapters"
    elif mode is not RewardModelTrainingMode.LORA and is_peft:
        problem = "it is a peft model"
    elif mode is RewardModelTrainingMode.HEAD_ONLY and backbone:
        problem = f"backbone parameter {backbone[0]!r} is trainable"
    elif mode is RewardModelTrainingMode.FULL and len(trainable) < sum(
        1 for _ in model.parameters()
    ):
        problem = "some parameters are frozen"
    if problem is not None:
        raise ValueError(
            f"model is not prepared for training_mode={mode.value!r}: {problem}; call "
            f"prepare_reward_model(model, {mode.value!r}) first"
        )
    return mode


# ---------------------------------------------------------------------------- scoring
def encode_texts(
    tokenizer: Any, texts: Sequence[str], device: torch.device | str
) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids`` / ``attention_mask`` [N, T] for ``texts``; raises if a
    text contains the pad token (the model pools at the last non-pad token, so it would
    read the wrong position)."""
    enc = tokenizer(list(texts), padding="longest", padding_side="right", return_tensors="pt")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    inside = (ids == tokenizer.pad_token_id) & mask.bool()
    if bool(inside.any()):
        row = int(inside.any(dim=1).nonzero()[0])
        raise ValueError(
            f"text {texts[row][:80]!r} contains the pad token {tokenizer.pad_token!r}; the "
            "reward model reads the last non-pad token, so remove it from the text"
        )
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}


def reward_scores(model: torch.nn.Module, tokenizer: Any, texts: Sequence[str]) -> torch.Tensor:
    """Raw rewards [N] (the head's logit at each text's last token), differentiable; the
    inputs go to the device of the model's parameters."""
    enc = encode_texts(tokenizer, texts, next(model.parameters()).device)
    logits = model(**enc, use_cache=False).logits  # [N, 1]
    return logits[:, 0].float()


@torch.no_grad()
def evaluate_preferences(
    model: torch.nn.Module,
    tokenizer: Any,
    pairs: Sequence[PreferencePair],
    *,
    batch_size: int = 32,
) -> dict[str, float]:
    """Bradley-Terry ``loss``, pairwise ``accuracy`` (fraction with r_chosen > r_rejected),
    ``margin_mean`` (mean r_chosen - r_rejected) and ``num_pairs`` over ``pairs``, with
    the model in eval mode (its mode is restored afterwards)."""
    if not pairs:
        raise ValueError("evaluate_preferences: no pairs to evaluate")
    was_training = model.training
    model.eval()
    chosen, rejected = [], []
    try:
        for start in range(0, len(pairs), batch_size):
            part = pairs[start : start + batch_size]
            chosen.append(reward_scores(model, tokenizer, [_chosen(p) for p in part]))
            rejected.append(reward_scores(model, tokenizer, [_rejected(p) for p in part]))
    finally:
        model.train(was_training)
    margin = torch.tensor([p.margin for p in pairs], device=chosen[0].device)
    out = BradleyTerryLoss()(torch.cat(chosen), torch.cat(rejected), margin=margin)
    stats = {k: out.stats[k] for k in ("loss", "accuracy", "margin_mean")}
    return {**stats, "num_pairs": float(len(pairs))}


def _chosen(pair: PreferencePair) -> str:
    return format_reward_input(pair.prompt, pair.chosen)


def _rejected(pair: PreferencePair) -> str:
    return format_reward_input(pair.prompt, pair.rejected)
