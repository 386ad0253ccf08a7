"""The loss contract (``Loss``, ``LossInputs``, ``LossOutput``) and token aggregation.

Shapes: ``B`` sequences of ``T`` tokens; losses work on the ``T-1`` next-token positions
(position ``t`` scores ``input_ids[:, t+1]``). Normalizers (``num_sequences``,
``num_action_tokens``) count every micro-batch of the optimizer step, so summed micro-batch
losses give exactly the full-batch loss and gradient. Every exponentiated log-ratio goes through
:func:`clamped_exp`, clamped to +-``log_ratio_clamp`` (default :data:`LOG_RATIO_CLAMP` = 20, as
verl), so a token past ~88 (common on stale data) cannot overflow float32; a token beyond the
clamp gets e^+-20 and no gradient through the ratio.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch


@dataclass
class LossInputs:
    """Tensors for one micro-batch.

    * ``logprobs``: [B, T-1] log pi_theta(x_{t+1} | x_<=t), differentiable; the Trainer
      scores action tokens only, so it is 0.0 off ``action_mask``.
    * ``action_mask``: [B, T-1] float, 1.0 where x_{t+1} is a trainable action token.
    * ``weights``: [B] credit-assignment weight (advantage) per sequence.
    * ``old_logprobs``: [B, T-1] behaviour-policy logprobs (0 off-mask) or ``None``.
    * ``ref_logprobs``: [B, T-1] reference-model logprobs or ``None``.
    * ``proximal_logprobs``: [B, T-1] proximal-policy logprobs (0 off-mask) or ``None``:
      log pi_prox of the same tokens under the weights at the start of the optimizer step,
      computed without gradient (decoupled PPO, arXiv:2505.24298).
    * ``num_sequences`` / ``num_action_tokens``: counts over the whole optimizer step.
    * ``entropy``: [B, T-1] next-token entropy, differentiable, or ``None``: the Trainer
      fills it for a loss with ``requires_entropy`` (``EntropyBonus``).
    * ``logits``: [B, T, V] model outputs, or ``None``. The Trainer never materializes
      them (see :mod:`ludic.training.token_scores`); read ``entropy`` instead.
    * ``action_versions``: [B, T-1] long, the policy version that sampled each action
      token (-1 off-mask), or ``None`` when a backend gave no versions: a completion
      continued across a weight update has both versions here (``old_logprobs`` are each
      token's own behaviour logprobs either way).
    """

    logprobs: torch.Tensor
    action_mask: torch.Tensor
    weights: torch.Tensor
    num_sequences: int
    num_action_tokens: int
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    proximal_logprobs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    action_versions: torch.Tensor | None = None


@dataclass
class LossOutput:
    """``loss``: this micro-batch's share of the step loss (micro-batch losses sum to the
    step loss). ``stats``: micro-batch means (ratio means, clip fractions, ...); the
    trainer averages them over micro-batches weighted by action tokens."""

    loss: torch.Tensor
    stats: dict[str, float] = field(default_factory=dict)


@runtime_checkable
class Loss(Protocol):
    """A policy loss and what it reads beyond ``logprobs``, ``action_mask`` and
    ``weights``; the Trainer fills each input a flag asks for, and fails before the first
    forward pass when the data cannot:

    * ``requires_old_logprobs``: the behaviour policy's logprobs (``old_logprobs``), from
      the items' sampled logprobs;
    * ``requires_ref_logprobs``: a frozen reference model's (``ref_logprobs``;
      ``Trainer(reference_model=...)``);
    * ``requires_proximal_logprobs``: the logprobs of the weights at the start of the
      optimizer step (``proximal_logprobs``; ``DecoupledClippedSurrogateLoss``);
    * ``requires_entropy``: the next-token entropy, with gradient (``entropy``;
      ``EntropyBonus``).
    """

    requires_old_logprobs: bool
    requires_ref_logprobs: bool
    requires_proximal_logprobs: bool
    requires_entropy: bool

    def __call__(self, inputs: LossInputs) -> LossOutput: ...


class LossFlags:
    """The :class:`Loss` flags, all False: a loss sets those of the inputs it reads."""

    requires_old_logprobs: ClassVar[bool] = False
    requires_ref_logprobs: ClassVar[bool] = False
    requires_proximal_logprobs: ClassVar[bool] = False
    requires_entropy: ClassVar[bool] = False


class TokenAggregated(LossFlags):
    """A (frozen dataclass) loss that reduces per-token values with its ``aggregation``
    (None: TOKEN_MEAN) and ``constant_normalizer`` fields."""

    aggregation: TokenAggregation | None
    constant_normalizer: int | None

    def _check_aggregation(self, owner: str) -> None:
        """Validate both fields at construction; ``aggregation`` becomes the enum."""
        mode = check_aggregation(owner, self.aggregation, self.constant_normalizer)
        object.__setattr__(self, "aggregation", mode)

    def _aggregate(self, values: torch.Tensor, inputs: LossInputs) -> torch.Tensor:
        mode = TokenAggregation.TOKEN_MEAN if self.aggregation is None else self.aggregation
        return aggregate_tokens(values, inputs, mode, constant_normalizer=self.constant_normalizer)


def loss_output(loss: torch.Tensor, **stats: float) -> LossOutput:
    """``LossOutput`` of ``loss``, its stats ``loss`` (the detached value) then ``stats``."""
    return LossOutput(loss=loss, stats={"loss": float(loss.detach()), **stats})


class TokenAggregation(StrEnum):
    """How per-token losses become one scalar (each preset names the one it uses).

    * ``TOKEN_MEAN``: sum over all action tokens / number of action tokens in the step
      (DAPO, arXiv:2503.14476, eq. 8).
    * ``SEQ_MEAN_TOKEN_MEAN``: mean over each sequence's action tokens, then mean over
      sequences (the original GRPO objective, arXiv:2402.03300, eq. 3).
    * ``CONSTANT``: sum over action tokens / (num_sequences * max_tokens), a constant
      normalizer that removes the length bias (Dr. GRPO, arXiv:2503.20783, sec. 3.1).
    """

    TOKEN_MEAN = "token_mean"
    SEQ_MEAN_TOKEN_MEAN = "seq_mean_token_mean"
    CONSTANT = "constant"


def aggregate_tokens(
    values: torch.Tensor,
    inputs: LossInputs,
    mode: TokenAggregation,
    *,
    constant_normalizer: int | None = None,
) -> torch.Tensor:
    """Reduce per-token ``values`` [B, T-1] to a scalar over ``inputs.action_mask``."""
    mask = inputs.action_mask
    if mode == TokenAggregation.TOKEN_MEAN:
        return (values * mask).sum() / max(inputs.num_action_tokens, 1)
    if mode == TokenAggregation.SEQ_MEAN_TOKEN_MEAN:
        per_seq = (values * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1.0)
        return per_seq.sum() / max(inputs.num_sequences, 1)
    if mode == TokenAggregation.CONSTANT:
        if constant_normalizer is None or constant_normalizer < 1:
            raise ValueError(
                "TokenAggregation.CONSTANT needs constant_normalizer >= 1 "
                "(Dr. GRPO uses the generation budget, e.g. SamplingSpec.max_tokens)"
            )
        return (values * mask).sum() / (max(inputs.num_sequences, 1) * constant_normalizer)
    raise ValueError(f"unknown TokenAggregation {mode!r}; expected one of {list(TokenAggregation)}")


def aggregate_sequences(values: torch.Tensor, inputs: LossInputs) -> torch.Tensor:
    """Mean of per-sequence ``values`` [B] over the step's sequences."""
    return values.sum() / max(inputs.num_sequences, 1)


def token_entropy(inputs: LossInputs, owner: str) -> torch.Tensor:
    """``inputs.entropy`` [B, T-1], else the entropy of ``inputs.logits``; a
    ``ValueError`` naming ``owner`` and the fix when neither is there."""
    if inputs.entropy is not None:
        return inputs.entropy
    if inputs.logits is not None:
        return masked_token_entropy(inputs.logits)
    raise ValueError(
        f"{owner} needs the token entropy but LossInputs has neither entropy nor logits; the "
        "Trainer fills entropy for a loss whose requires_entropy is True (check that a "
        "wrapping loss forwards that flag)"
    )


def masked_token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy [B, T-1] of the next-token distribution at each scored position."""
    logp = torch.log_softmax(
        logits[:, :-1].to(torch.promote_types(logits.dtype, torch.float32)), dim=-1
    )
    return -(logp.exp() * logp).sum(dim=-1)


_MISSING_PER_TOKEN = {
    "old_logprobs": "needs behaviour logprobs but the batch has none; request them with "
    "InferenceSpec(returns=ReturnSpec.for_rl())",
    "ref_logprobs": "needs reference-model logprobs but the batch has none; give the trainer "
    "a reference model, or use the behaviour policy as reference (reference='old')",
    "proximal_logprobs": "needs proximal logprobs (the policy at the start of the optimizer "
    "step) but LossInputs.proximal_logprobs is None; the Trainer computes them for a loss "
    "whose requires_proximal_logprobs is True (check that a wrapping loss forwards that "
    "flag), or compute them yourself with the step-start weights under torch.no_grad()",
}


def require_old_logprobs(inputs: LossInputs, owner: str) -> torch.Tensor:
    """``inputs.old_logprobs`` [B, T-1], or a ``ValueError`` naming ``owner`` and the fix."""
    return _require_per_token(inputs, owner, "old_logprobs")


def require_ref_logprobs(inputs: LossInputs, owner: str) -> torch.Tensor:
    """``inputs.ref_logprobs`` [B, T-1], or a ``ValueError`` naming ``owner`` and the fix."""
    return _require_per_token(inputs, owner, "ref_logprobs")


def require_proximal_logprobs(inputs: LossInputs, owner: str) -> torch.Tensor:
    """``inputs.proximal_logprobs`` [B, T-1], or a ``ValueError`` naming ``owner`` and the
    fix."""
    return _require_per_token(inputs, owner, "proximal_logprobs")


def _require_per_token(inputs: LossInputs, owner: str, field_name: str) -> torch.Tensor:
    values: torch.Tensor | None = getattr(inputs, field_name)
    if values is None:
        raise ValueError(f"{owner} {_MISSING_PER_TOKEN[field_name]}")
    if values.shape != inputs.logprobs.shape:
        raise ValueError(
            f"{owner}: {field_name} has shape {tuple(values.shape)} but logprobs has "
            f"{tuple(inputs.logprobs.shape)}; both must be next-token positions [B, T-1]"
        )
    return values


def old_log_ratio(inputs: LossInputs, owner: str) -> torch.Tensor:
    """log(pi_theta / pi_old) [B, T-1] on action tokens, 0.0 elsewhere."""
    return (inputs.logprobs - require_old_logprobs(inputs, owner)) * inputs.action_mask


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean of ``values`` where ``mask`` is 1, over this micro-batch only (for stats)."""
    with torch.no_grad():
        v = values.detach().to(torch.promote_types(values.dtype, torch.float32))
        return float(((v * mask).sum() / mask.sum().clamp(min=1.0)).item())


def check_aggregation(
    owner: str, aggregation: TokenAggregation | str, constant_normalizer: int | None
) -> TokenAggregation:
    """Validate a loss's ``aggregation`` / ``constant_normalizer`` pair at construction."""
    try:
        mode = TokenAggregation(aggregation)
    except ValueError:
        raise ValueError(
            f"{owner}: aggregation={aggregation!r}; expected one of "
            f"{[m.value for m in TokenAggregation]}"
        ) from None
    if mode == TokenAggregation.CONSTANT and (
        constant_normalizer is None or constant_normalizer < 1
    ):
        raise ValueError(
            f"{owner}: aggregation='constant' needs constant_normalizer >= 1, got "
            f"{constant_normalizer!r}; pass the generation budget (SamplingSpec.max_tokens)"
        )
    return mode


def check_ratio_loss(loss: Any, owner: str, *, nullable: tuple[str, ...] = ()) -> None:
    """Validate a ratio loss's ``clip_eps_low`` / ``clip_eps_high`` (``nullable``: those
    that may be None), its ``dual_clip_c`` when it has one, and ``log_ratio_clamp``."""
    low, high = loss.clip_eps_low, loss.clip_eps_high
    check_clip_eps(owner, nullable=nullable, clip_eps_low=low, clip_eps_high=high)
    check_dual_clip_c(owner, getattr(loss, "dual_clip_c", None))
    check_log_ratio_clamp(owner, loss.log_ratio_clamp)


def check_clip_eps(owner: str, *, nullable: tuple[str, ...] = (), **eps: float | None) -> None:
    """Raise naming the argument when a clip epsilon is negative, not finite, or None
    (None is allowed only for the names in ``nullable``: no bound on that side)."""
    for name, value in eps.items():
        if value is None:
            if name in nullable:
                continue
            raise ValueError(f"{owner}: {name}=None; expected a finite value >= 0")
        if isinstance(value, bool) or not (value >= 0 and value < float("inf")):
            raise ValueError(f"{owner}: {name}={value!r}; expected a finite value >= 0")


LOG_RATIO_CLAMP = 20.0
"""Default bound on a log-ratio before ``exp`` (as verl): e^20 ~ 4.9e8, far beyond any clip
range, and far below float32's overflow at e^88."""


def clamped_exp(log_ratio: torch.Tensor, log_ratio_clamp: float) -> torch.Tensor:
    """exp(clamp(log_ratio, -log_ratio_clamp, log_ratio_clamp)): an importance ratio that
    cannot overflow. Equal to ``exp(log_ratio)`` inside the bound; outside it the ratio is
    e^+-bound and carries no gradient."""
    return torch.exp(log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp))


def check_log_ratio_clamp(owner: str, log_ratio_clamp: float) -> None:
    """Raise naming ``log_ratio_clamp`` unless it is a finite value > 0 (<= 80 keeps
    float32's exp finite)."""
    if isinstance(log_ratio_clamp, bool) or not (0 < log_ratio_clamp <= 80):
        raise ValueError(
            f"{owner}: log_ratio_clamp={log_ratio_clamp!r}; expected 0 < log_ratio_clamp <= 80 "
            f"(exp overflows float32 past ~88; the default is {LOG_RATIO_CLAMP})"
        )


def check_dual_clip_c(owner: str, dual_clip_c: float | None) -> None:
    """Raise naming ``dual_clip_c`` unless it is None or a finite value > 1."""
    if dual_clip_c is None:
        return
    if isinstance(dual_clip_c, bool) or not (1 < dual_clip_c < float("inf")):
        raise ValueError(
            f"{owner}: dual_clip_c={dual_clip_c!r}; expected a finite value > 1 (the dual-clip "
            "bound on -A * ratio for negative advantages, verl uses 3.0) or None"
        )


LOSS_FLAGS = (
    "requires_old_logprobs",
    "requires_ref_logprobs",
    "requires_proximal_logprobs",
    "requires_entropy",
)
"""The flags every :class:`Loss` declares (each a bool)."""


def missing_loss_members(loss: object) -> list[str]:
    """The :class:`Loss` members ``loss`` lacks: flags absent or not bools, ``__call__``."""
    missing = [flag for flag in LOSS_FLAGS if not isinstance(getattr(loss, flag, None), bool)]
    return missing + ([] if callable(loss) else ["__call__"])


def check_loss(loss: object, owner: str) -> None:
    """Raise ``TypeError`` naming what ``loss`` lacks to be a :class:`Loss`."""
    missing = missing_loss_members(loss)
    if missing:
        raise TypeError(
            f"{owner}: loss={type(loss).__name__} is not a Loss: it lacks {missing}. A loss "
            f"declares {list(LOSS_FLAGS)} (bools: which inputs beyond logprobs, action_mask "
            "and weights it reads) and __call__(inputs: LossInputs) -> LossOutput"
        )
