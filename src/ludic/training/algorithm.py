"""Algorithms as data: ``RLAlgorithm`` = credit assigner + loss (+ a batch preprocess,
+ rollout hooks).

Each ``make_*`` preset is a few lines that pick the parts; copy one to make a new
algorithm. A batch is built as: ``rollout_hooks`` (in the batch source, e.g. reward-model
scoring) -> ``credit_assigner.compute(rollouts)`` -> ``SAWItem`` weights; the trainer then
runs ``preprocess(batch)`` (if any) -> ``loss`` per micro-batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from ludic.inference.reward_client import RewardModelClient
from ludic.rollouts.strategies import GRPORequestStrategy, RequestStrategy
from ludic.training.credit_assignment import (
    ConstantCredit,
    GroupNormalizedReturn,
    GroupStd,
    MonteCarloReturn,
    check_group_std,
    check_negative_group_coef,
)
from ludic.training.losses import (
    CISPOLoss,
    ClippedSurrogateLoss,
    DecoupledClippedSurrogateLoss,
    GMPOLoss,
    Loss,
    MaskedCausalLMCrossEntropyLoss,
    ReinforceLoss,
    TokenAggregation,
    TokenClippedSurrogateLoss,
)
from ludic.training.losses.base import check_loss
from ludic.training.losses.decoupled import BehaviourWeightMode
from ludic.training.reward_credit import (
    CombineMode,
    RewardFormatFn,
    RewardModelCreditAssigner,
    RewardModelScorer,
    reward_text,
)
from ludic.training.types import CreditAssigner, RolloutHook, SAWBatch


@dataclass(frozen=True)
class RLAlgorithm:
    """A named pair of parts: ``credit_assigner`` makes per-turn weights, ``loss`` turns
    weights and tokens into a scalar; ``preprocess`` (optional) rewrites the optimizer-step
    batch in between (e.g. ``BatchMeanBaseline``). ``rollout_hooks`` (optional) must run on
    the rollouts before ``credit_assigner`` (e.g. ``RewardModelScorer``, whose scores
    ``RewardModelCreditAssigner`` reads): hand them to the batch source,
    ``RolloutBatchSource(..., algorithm.credit_assigner, rollout_hooks=algorithm.rollout_hooks)``,
    or the whole algorithm in one piece with ``RolloutBatchSource.from_algorithm``
    (credit assigner, rollout hooks and ``request_strategy``).
    """

    name: str
    credit_assigner: CreditAssigner
    loss: Loss
    preprocess: Callable[[SAWBatch], SAWBatch] | None = None
    rollout_hooks: tuple[RolloutHook, ...] = ()
    request_strategy: RequestStrategy | None = None
    """How a batch's problems become the requests the engine runs: the group presets
    sample each problem ``group_size`` times (``GRPORequestStrategy``), which their credit
    assigner's groups expect; ``None`` runs each request as it is."""

    def __post_init__(self) -> None:
        if not isinstance(self.credit_assigner, CreditAssigner):
            raise TypeError(
                f"RLAlgorithm({self.name!r}): credit_assigner={self.credit_assigner!r} has no "
                "compute(rollouts) -> list[list[float]]"
            )
        check_loss(self.loss, f"RLAlgorithm({self.name!r})")
        if self.preprocess is not None and not callable(self.preprocess):
            raise TypeError(
                f"RLAlgorithm({self.name!r}): preprocess={self.preprocess!r} is not callable"
            )
        if not isinstance(self.rollout_hooks, tuple | list):
            raise TypeError(
                f"RLAlgorithm({self.name!r}): rollout_hooks={self.rollout_hooks!r}; expected a "
                "tuple of async callables (rollouts) -> None"
            )
        if self.request_strategy is not None and not isinstance(
            self.request_strategy, RequestStrategy
        ):
            raise TypeError(
                f"RLAlgorithm({self.name!r}): request_strategy={self.request_strategy!r} has no "
                "expand(requests) -> list[RolloutRequest]"
            )
        object.__setattr__(self, "rollout_hooks", tuple(self.rollout_hooks))
        for i, hook in enumerate(self.rollout_hooks):
            if not callable(hook):
                raise TypeError(
                    f"RLAlgorithm({self.name!r}): rollout_hooks[{i}]={hook!r} is not callable; "
                    "a rollout hook is an async callable (rollouts) -> None"
                )


@dataclass(frozen=True)
class BatchMeanBaseline:
    """Batch-mean baseline for REINFORCE (Williams 1992, the "reinforcement baseline").

    w_i' = w_i - mean_j(w_j)                         over every item of the step's batch,
    w_i' = (w_i - mean_j(w_j)) / (std_j(w_j) + eps)   if ``normalize_std`` (population std).
    A batch whose weights are all equal gets all-zero weights. Returns a new ``SAWBatch``
    of new ``SAWItem``s (``dataclasses.replace``); the input batch is left untouched.
    """

    normalize_std: bool = False
    eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.eps < 0:
            raise ValueError(f"BatchMeanBaseline: eps={self.eps!r}; expected eps >= 0")

    def __call__(self, batch: SAWBatch) -> SAWBatch:
        weights = [item.weight for item in batch.items]
        if not weights or all(w == weights[0] for w in weights):
            new = [0.0] * len(weights)
        else:
            mean = sum(weights) / len(weights)
            std = math.sqrt(sum((w - mean) ** 2 for w in weights) / len(weights))
            scale = std + self.eps if self.normalize_std else 1.0
            new = [(w - mean) / scale for w in weights]
        items = [replace(item, weight=w) for item, w in zip(batch.items, new)]
        return SAWBatch(items=items, meta=dict(batch.meta))


def _samples_per_problem(preset: str, group_size: int) -> GRPORequestStrategy:
    """Each problem sampled ``group_size`` times (seeds and group ids as in GRPO)."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"{preset}: group_size={group_size!r}; expected an int >= 1")
    return GRPORequestStrategy(group_size=group_size)


def _grouped(group_size: int) -> GRPORequestStrategy:
    """The request strategy of a group preset (its credit has validated ``group_size``)."""
    return GRPORequestStrategy(group_size=group_size)


def _group_credit(
    preset: str,
    group_size: int,
    normalize_std: bool,
    std: GroupStd = "population",
    negative_group_coef: float = 0.0,
) -> GroupNormalizedReturn:
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2:
        raise ValueError(
            f"{preset}: group_size={group_size!r}; group-relative advantages need an int "
            "group_size >= 2 rollouts per prompt (and GRPORequestStrategy with the same value)"
        )
    check_group_std(preset, std)
    check_negative_group_coef(preset, negative_group_coef)
    return GroupNormalizedReturn(
        group_size=group_size,
        normalize_std=normalize_std,
        std=std,
        negative_group_coef=negative_group_coef,
    )


def make_reinforce(gamma: float = 1.0, group_size: int = 1) -> RLAlgorithm:
    """REINFORCE: credit ``MonteCarloReturn(gamma)``; loss ``ReinforceLoss``
    (-A * logp); aggregation TOKEN_MEAN. No baseline (see ``make_reinforce_baseline``).
    Each problem is sampled ``group_size`` times (the credit ignores the groups)."""
    return RLAlgorithm(
        "reinforce",
        MonteCarloReturn(gamma=gamma),
        ReinforceLoss(),
        request_strategy=_samples_per_problem("make_reinforce", group_size),
    )


def make_reinforce_baseline(
    gamma: float = 1.0, normalize_std: bool = False, group_size: int = 1
) -> RLAlgorithm:
    """REINFORCE with a batch-mean baseline: credit ``MonteCarloReturn(gamma)``; preprocess
    ``BatchMeanBaseline(normalize_std)``; loss ``ReinforceLoss``; aggregation TOKEN_MEAN.
    Each problem is sampled ``group_size`` times (the baseline is over the whole batch)."""
    return _batch_baselined("reinforce_baseline", ReinforceLoss(), gamma, normalize_std, group_size)


def _batch_baselined(
    name: str, loss: Loss, gamma: float, normalize_std: bool, group_size: int
) -> RLAlgorithm:
    """Credit ``MonteCarloReturn(gamma)``, preprocess ``BatchMeanBaseline(normalize_std)``,
    each problem sampled ``group_size`` times (validated as by ``make_<name>``)."""
    return RLAlgorithm(
        name,
        MonteCarloReturn(gamma=gamma),
        loss,
        preprocess=BatchMeanBaseline(normalize_std=normalize_std),
        request_strategy=_samples_per_problem(f"make_{name}", group_size),
    )


def make_grpo(
    group_size: int,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2,
    normalize_std: bool = True,
    group_std: GroupStd = "population",
    dual_clip_c: float | None = None,
    truncated_is_cap: float | None = None,
    negative_group_coef: float = 0.0,
) -> RLAlgorithm:
    """GRPO (arXiv:2402.03300): credit ``GroupNormalizedReturn(group_size, normalize_std,
    std=group_std, negative_group_coef)`` (``group_std``: "population" divides the std by
    G, "sample" by G - 1 as verl and TRL do; ``negative_group_coef`` > 0 gives a group whose
    samples all fail c * (R - batch mean) instead of 0, see ``GroupNormalizedReturn``);
    loss ``TokenClippedSurrogateLoss(clip_eps_low, clip_eps_high, dual_clip_c)``;
    aggregation SEQ_MEAN_TOKEN_MEAN. No KL term (add ``KLPenalty`` with ``CompositeLoss``).

    ``truncated_is_cap`` = C corrects the train/inference log-prob mismatch (Yao et al.
    2025, truncated importance sampling): the loss becomes
    ``DecoupledClippedSurrogateLoss(behaviour_weight_cap=C, behaviour_weight_mode=
    "truncate")``, which clips r = pi_theta / pi_prox (the trainer's own logprobs at the
    start of the step, which it then recomputes) and weights each token by
    min(pi_prox / pi_behav, C), pi_behav being the inference server's logprobs.
    """
    credit = _group_credit("make_grpo", group_size, normalize_std, group_std, negative_group_coef)
    aggregation = TokenAggregation.SEQ_MEAN_TOKEN_MEAN
    if truncated_is_cap is None:
        loss: Loss = TokenClippedSurrogateLoss(
            clip_eps_low=clip_eps_low,
            clip_eps_high=clip_eps_high,
            aggregation=aggregation,
            dual_clip_c=dual_clip_c,
        )
    else:
        if isinstance(truncated_is_cap, bool) or not (1 <= truncated_is_cap < math.inf):
            raise ValueError(
                f"make_grpo: truncated_is_cap={truncated_is_cap!r}; expected a finite value "
                ">= 1 (e.g. 2.0), or None for no importance-sampling correction"
            )
        loss = _decoupled_loss(
            clip_eps_low, clip_eps_high, dual_clip_c, truncated_is_cap, "truncate", aggregation
        )
    return RLAlgorithm("grpo", credit, loss, request_strategy=_grouped(group_size))


def make_dr_grpo(
    group_size: int,
    max_tokens: int,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2,
    dual_clip_c: float | None = None,
) -> RLAlgorithm:
    """Dr. GRPO (arXiv:2503.20783): credit ``GroupNormalizedReturn(group_size,
    normalize_std=False)`` (no std division); loss ``TokenClippedSurrogateLoss``;
    aggregation CONSTANT with constant_normalizer=max_tokens (the generation budget)."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(
            f"make_dr_grpo: max_tokens={max_tokens!r}; pass the generation budget "
            "(SamplingSpec.max_tokens), an int >= 1"
        )
    credit = _group_credit("make_dr_grpo", group_size, normalize_std=False)
    loss = TokenClippedSurrogateLoss(
        clip_eps_low=clip_eps_low,
        clip_eps_high=clip_eps_high,
        aggregation=TokenAggregation.CONSTANT,
        constant_normalizer=max_tokens,
        dual_clip_c=dual_clip_c,
    )
    return RLAlgorithm("dr_grpo", credit, loss, request_strategy=_grouped(group_size))


def make_gspo(
    group_size: int,
    clip_eps_low: float = 3e-4,
    clip_eps_high: float = 4e-4,
    normalize_std: bool = True,
    group_std: GroupStd = "population",
) -> RLAlgorithm:
    """GSPO (arXiv:2507.18071): credit ``GroupNormalizedReturn(group_size, normalize_std)``;
    loss ``ClippedSurrogateLoss`` (sequence-level ratio, clip 1-3e-4 .. 1+4e-4); aggregation
    mean over sequences."""
    credit = _group_credit("make_gspo", group_size, normalize_std, group_std)
    loss = ClippedSurrogateLoss(clip_eps_low=clip_eps_low, clip_eps_high=clip_eps_high)
    return RLAlgorithm("gspo", credit, loss, request_strategy=_grouped(group_size))


def make_cispo(
    group_size: int,
    clip_eps_low: float | None = None,
    clip_eps_high: float = 0.28,
    normalize_std: bool = True,
    group_std: GroupStd = "population",
) -> RLAlgorithm:
    """CISPO (arXiv:2506.13585): credit ``GroupNormalizedReturn(group_size, normalize_std)``;
    loss ``CISPOLoss`` (stop-gradient truncated IS weight, no lower bound by default);
    aggregation TOKEN_MEAN."""
    credit = _group_credit("make_cispo", group_size, normalize_std, group_std)
    loss = CISPOLoss(clip_eps_low=clip_eps_low, clip_eps_high=clip_eps_high)
    return RLAlgorithm("cispo", credit, loss, request_strategy=_grouped(group_size))


def make_gmpo(
    group_size: int = 4,
    clip_eps_low: float = 0.4,
    clip_eps_high: float = 0.4,
    normalize_std: bool = True,
    group_std: GroupStd = "population",
) -> RLAlgorithm:
    """GMPO (arXiv:2507.20673): credit ``GroupNormalizedReturn(group_size, normalize_std)``;
    loss ``GMPOLoss`` (geometric mean of clipped token ratios, range e^-0.4 .. e^0.4);
    aggregation mean over sequences of the per-sequence objective."""
    credit = _group_credit("make_gmpo", group_size, normalize_std, group_std)
    loss = GMPOLoss(clip_eps_low=clip_eps_low, clip_eps_high=clip_eps_high)
    return RLAlgorithm("gmpo", credit, loss, request_strategy=_grouped(group_size))


def make_decoupled_ppo(
    gamma: float = 1.0,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2,
    dual_clip_c: float | None = None,
    behaviour_weight_cap: float | None = 5.0,
    behaviour_weight_mode: BehaviourWeightMode = "mask",
    normalize_std: bool = True,
    group_size: int = 1,
) -> RLAlgorithm:
    """Decoupled PPO (AReaL, arXiv:2505.24298) for stale (asynchronous) data: loss
    ``DecoupledClippedSurrogateLoss`` (ratio to the step-start policy pi_prox, clipped;
    weight pi_prox / pi_behav capped at ``behaviour_weight_cap``, tokens over it masked by
    default as AReaL); aggregation TOKEN_MEAN. Needs proximal logprobs (the trainer
    recomputes them at the start of each step).

    Credit: ``MonteCarloReturn(gamma)`` then the ``BatchMeanBaseline(normalize_std)``
    preprocess, A = (G - mean_batch G) / std_batch G. Ludic has no critic, so PPO's GAE
    is not available; a baseline-free return is all-positive under 0/1 rewards, so the
    clip would only ever act on one side (and dual clip never). The batch-normalized
    return needs no groups; with several samples per prompt prefer
    ``make_decoupled_grpo``, whose group baseline has lower variance. Each problem is
    sampled ``group_size`` times.
    """
    loss = _decoupled_loss(
        clip_eps_low, clip_eps_high, dual_clip_c, behaviour_weight_cap, behaviour_weight_mode
    )
    return _batch_baselined("decoupled_ppo", loss, gamma, normalize_std, group_size)


def make_decoupled_grpo(
    group_size: int,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2,
    dual_clip_c: float | None = None,
    behaviour_weight_cap: float | None = 5.0,
    behaviour_weight_mode: BehaviourWeightMode = "mask",
    normalize_std: bool = True,
    group_std: GroupStd = "population",
) -> RLAlgorithm:
    """Decoupled PPO with group-relative advantages (AReaL's GRPO-style recipe,
    arXiv:2505.24298): credit ``GroupNormalizedReturn(group_size, normalize_std)`` as
    ``make_grpo``; loss ``DecoupledClippedSurrogateLoss`` as ``make_decoupled_ppo``;
    aggregation TOKEN_MEAN. Needs proximal logprobs."""
    credit = _group_credit("make_decoupled_grpo", group_size, normalize_std, group_std)
    loss = _decoupled_loss(
        clip_eps_low, clip_eps_high, dual_clip_c, behaviour_weight_cap, behaviour_weight_mode
    )
    return RLAlgorithm("decoupled_grpo", credit, loss, request_strategy=_grouped(group_size))


def _decoupled_loss(
    clip_eps_low: float,
    clip_eps_high: float,
    dual_clip_c: float | None,
    behaviour_weight_cap: float | None,
    behaviour_weight_mode: BehaviourWeightMode,
    aggregation: TokenAggregation = TokenAggregation.TOKEN_MEAN,
) -> DecoupledClippedSurrogateLoss:
    return DecoupledClippedSurrogateLoss(
        clip_eps_low=clip_eps_low,
        clip_eps_high=clip_eps_high,
        behaviour_weight_cap=behaviour_weight_cap,
        behaviour_weight_mode=behaviour_weight_mode,
        dual_clip_c=dual_clip_c,
        aggregation=aggregation,
    )


def make_reward_rl(
    reward_client: RewardModelClient | None,
    *,
    mode: CombineMode = "replace",
    weight: float = 0.5,
    normalize: bool = True,
    group_size: int | None = None,
    per_turn: bool = False,
    format_fn: RewardFormatFn = reward_text,
    loss: Loss | None = None,
) -> RLAlgorithm:
    """RL from a learned reward model (RLHF-style; docs/design.md, "Reward models").

    Rollout hook ``RewardModelScorer(reward_client, normalize, format_fn, per_turn)``
    scores each rollout's last turn (every turn if ``per_turn``): s = sigmoid(logit) if
    ``normalize`` else the raw logit. Credit ``RewardModelCreditAssigner(mode, weight)``
    combines s with the env reward r per turn (replace: s; add: r + s; multiply: r * s;
    weighted: weight * r + (1 - weight) * s) into c_j (an unscored earlier turn combines
    with s = 0; see ``RewardModelCreditAssigner``), then:

    * ``group_size=None``: w_j = sum_{k >= j} c_k (return-to-go; c for a single turn);
      loss ``ReinforceLoss`` (-w * logp), aggregation TOKEN_MEAN.
    * ``group_size=G``: A_i = (R_i - mean_g R) / (std_g R + eps), R_i = sum_j c_j, over
      groups of G rollouts per prompt (GRPO, arXiv:2402.03300; use
      ``GRPORequestStrategy(group_size=G)``); loss ``TokenClippedSurrogateLoss`` (clip 0.2,
      SEQ_MEAN_TOKEN_MEAN, as ``make_grpo``), which needs behaviour logprobs.

    ``loss`` replaces the default loss. The batch source must run the hooks:
    ``RolloutBatchSource.from_algorithm(engine, requests_fn, algo)``. ``reward_client=None``
    leaves the hook out, for a trainer whose rollouts are scored elsewhere (a pipeline's
    actors); its credit assigner refuses rollouts without scores.
    """
    group_normalize = group_size is not None
    if group_normalize:
        _group_credit("make_reward_rl", group_size, normalize_std=True)  # validates group_size
    credit = RewardModelCreditAssigner(
        mode=mode, weight=weight, group_normalize=group_normalize, group_size=group_size
    )
    hooks = (
        ()
        if reward_client is None
        else (
            RewardModelScorer(
                reward_client, normalize=normalize, format_fn=format_fn, per_turn=per_turn
            ),
        )
    )
    if loss is None:
        loss = (
            TokenClippedSurrogateLoss(aggregation=TokenAggregation.SEQ_MEAN_TOKEN_MEAN)
            if group_normalize
            else ReinforceLoss()
        )
    return RLAlgorithm(
        "reward_rl",
        credit,
        loss,
        rollout_hooks=hooks,
        request_strategy=None if group_size is None else _grouped(group_size),
    )


def make_sft() -> RLAlgorithm:
    """SFT as offline RL with weight 1: credit ``ConstantCredit(1.0)``; loss
    ``MaskedCausalLMCrossEntropyLoss`` (NLL of action tokens); aggregation TOKEN_MEAN.
    Equal to ``ReinforceLoss`` with every weight 1.0."""
    return RLAlgorithm("sft", ConstantCredit(1.0), MaskedCausalLMCrossEntropyLoss())


__all__ = [
    "BatchMeanBaseline",
    "RLAlgorithm",
    "make_cispo",
    "make_decoupled_grpo",
    "make_decoupled_ppo",
    "make_dr_grpo",
    "make_gmpo",
    "make_grpo",
    "make_gspo",
    "make_reinforce",
    "make_reinforce_baseline",
    "make_reward_rl",
    "make_sft",
]
