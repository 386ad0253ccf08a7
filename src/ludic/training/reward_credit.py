"""Credit from a learned reward model (docs/reward-models.md), in two parts.

:class:`RewardModelScorer`, a ``RolloutHook``, scores every rollout (or turn) of a batch in ONE
``RewardModelClient.score_batch`` call and writes the scores into ``rollout.meta``;
:class:`RewardModelCreditAssigner`, a synchronous ``CreditAssigner``, combines them with the env
rewards into per-turn weights. Keeping the async, remote scoring out of the assigner keeps that
contract synchronous and lets one hook serve any assigner. Meta: :data:`RM_SCORES_KEY` (a float
or ``None`` per turn of ``rollout.turns()``; turns without agent steps are never scored) and
:data:`RM_VERSION_KEY` (the reward model's version when scoring started, if the client has one).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

from ludic.inference.reward_client import RewardModelClient, format_reward_input
from ludic.rollouts.hooks import RM_SCORES_KEY
from ludic.training.credit_assignment import check_negative_group_coef, group_relative_advantages
from ludic.types import Rollout, Turn

"""Rollout meta key: per-turn reward-model scores (``float | None`` per turn)."""

RM_VERSION_KEY = "rm_model_version"
"""Rollout meta key: the reward model's version when the rollout was scored."""

RewardFormatFn = Callable[[Rollout, Turn], str]
"""``(rollout, turn) -> text`` the reward model scores for ``turn`` of ``rollout``."""

CombineMode = Literal["replace", "add", "multiply", "weighted"]
COMBINE_MODES: tuple[str, ...] = get_args(CombineMode)


def reward_text(rollout: Rollout, turn: Turn) -> str:
    """The default text a reward model scores for ``turn``:
    ``format_reward_input(prompt, completion)``, where ``completion`` is the turn's last
    agent step's completion and ``prompt`` the content of the last ``"user"`` message of
    that step's ``prompt_messages`` (the question the completion answers)."""
    where = f"rollout {rollout.id!r}, turn {turn.turn_id!r}"
    if not turn.agent_steps:
        raise ValueError(f"reward_text: {where} has no agent step to score")
    step = turn.agent_steps[-1]
    user = [m for m in step.prompt_messages if m.get("role") == "user"]
    if not user:
        raise ValueError(
            f"reward_text: {where}: the last agent step's prompt_messages have no 'user' "
            "message; pass RewardModelScorer(format_fn=...) to build the text another way"
        )
    content = user[-1].get("content")
    if not isinstance(content, str):
        raise ValueError(
            f"reward_text: {where}: the last user message's content is "
            f"{type(content).__name__}, not a string; pass RewardModelScorer(format_fn=...)"
        )
    return format_reward_input(content, step.completion)


class RewardModelScorer:
    """A rollout hook that scores rollouts with a reward model.

    For each rollout the scored turns are the last turn with agent steps
    (``per_turn=False``: an outcome reward model judging the final answer) or every turn
    with agent steps (``per_turn=True``: a process reward model). All texts of the batch
    (``format_fn(rollout, turn)``, default :func:`reward_text`) go to the reward model in
    ONE ``client.score_batch(texts, normalize=normalize)`` call; none is made when nothing
    is to be scored. Writes ``meta["rm_scores"]`` (one ``float | None`` per turn, ``None``
    for unscored turns) and ``meta["rm_model_version"]`` (see the module docstring).

    Args:
        client: a :class:`~ludic.inference.reward_client.RewardModelClient` (only
            ``score_batch`` is required; ``get_model_version`` is used when present).
        normalize: ask for ``sigmoid(logit)`` scores in (0, 1) instead of raw logits.
        format_fn: ``(rollout, turn) -> text`` to score.
        per_turn: score every turn instead of only the last one.
    """

    def __init__(
        self,
        client: RewardModelClient,
        *,
        normalize: bool = True,
        format_fn: RewardFormatFn = reward_text,
        per_turn: bool = False,
    ) -> None:
        if not callable(getattr(client, "score_batch", None)):
            raise TypeError(
                f"RewardModelScorer: client={client!r} has no score_batch(inputs, normalize=); "
                "pass a RewardModelClient (e.g. TransformersRewardClient, VLLMRewardClient)"
            )
        if not callable(format_fn):
            raise TypeError(
                f"RewardModelScorer: format_fn={format_fn!r} is not callable (rollout, turn) -> str"
            )
        self.client = client
        self.normalize = normalize
        self.format_fn = format_fn
        self.per_turn = per_turn

    def _scored_turns(self, turns: Sequence[Turn]) -> list[int]:
        with_agent = [j for j, t in enumerate(turns) if t.agent_steps]
        return with_agent if self.per_turn else with_agent[-1:]

    async def __call__(self, rollouts: list[Rollout]) -> None:
        texts: list[str] = []
        where: list[tuple[int, int]] = []  # (rollout index, turn index) of each text
        turns_of = [r.turns() for r in rollouts]
        for i, (rollout, turns) in enumerate(zip(rollouts, turns_of)):
            for j in self._scored_turns(turns):
                text = self.format_fn(rollout, turns[j])
                if not isinstance(text, str):
                    raise TypeError(
                        f"RewardModelScorer: format_fn returned {type(text).__name__} for "
                        f"rollout {rollout.id!r}, turn {turns[j].turn_id!r}; expected a string"
                    )
                texts.append(text)
                where.append((i, j))

        version: int | None = None
        get_version = getattr(self.client, "get_model_version", None)
        if texts and callable(get_version):
            version = int(await get_version())
        scores = await self.client.score_batch(texts, normalize=self.normalize) if texts else []
        if len(scores) != len(texts):
            raise RuntimeError(
                f"RewardModelScorer: the reward model returned {len(scores)} scores for "
                f"{len(texts)} inputs; a RewardModelClient must return one score per input"
            )

        per_rollout: list[list[float | None]] = [[None] * len(t) for t in turns_of]
        for (i, j), score in zip(where, scores):
            value = float(score)
            if not math.isfinite(value):
                raise ValueError(
                    f"RewardModelScorer: the reward model scored rollout {rollouts[i].id!r}, "
                    f"turn {turns_of[i][j].turn_id!r} as {value!r}; expected a finite score"
                )
            per_rollout[i][j] = value
        for rollout, rm_scores in zip(rollouts, per_rollout):
            rollout.meta[RM_SCORES_KEY] = rm_scores
            if version is not None:
                rollout.meta[RM_VERSION_KEY] = version


@dataclass(frozen=True)
class RewardModelCreditAssigner:
    """Per-turn weights from env rewards and reward-model scores.

    Per turn j, with env reward r_j = ``Turn.reward`` and RM score s_j from
    ``meta["rm_scores"]`` (attached by :class:`RewardModelScorer`), the combined reward is

        replace:  c_j = s_j
        add:      c_j = r_j + s_j
        multiply: c_j = r_j * s_j
        weighted: c_j = weight * r_j + (1 - weight) * s_j

    A turn the scorer did not score (``None``: with ``per_turn=False`` every turn but the
    last) combines with s_j = 0: replace -> 0, add -> r_j, weighted -> weight * r_j, so a
    rollout's combined return is exactly the rollout-level combination of its env return
    and its one score (R = s, R_env + s, weight * R_env + (1 - weight) * s). ``multiply``
    would gate such a turn's env reward to 0, so an unscored turn with r_j != 0 raises
    there (score every turn with ``per_turn=True``, or use ``add``/``weighted``).

    Without ``group_normalize`` each turn gets its return-to-go (REINFORCE, gamma = 1):

        w_j = G_j = sum_{k >= j} c_k

    For a single-turn rollout this is just c_0 = combine(r, s), the usual RLHF reward; an
    outcome score on the last turn thereby reaches every earlier turn.

    With ``group_normalize`` (GRPO, arXiv:2402.03300, sec. 4.1.2) every turn of rollout i
    gets the group-relative advantage of its combined return R_i = sum_j c_j:

        A_i = (R_i - mean_g(R)) / (std_g(R) + eps)

    grouped exactly as :class:`~ludic.training.credit_assignment.GroupNormalizedReturn`
    (``meta["group_id"]``, else the initial observation; population std; an equal-return
    group gets zeros, or with ``negative_group_coef`` c > 0 one below the batch mean gets
    c * (R_i - mean_B(R)); every group must hold ``group_size`` rollouts).

    Reads: ``Turn.reward``, ``meta["rm_scores"]``. Output: ``[len(rollouts)][num_turns_i]``.
    """

    mode: CombineMode = "replace"
    weight: float = 0.5
    group_normalize: bool = False
    group_size: int | None = None
    eps: float = 1e-6
    negative_group_coef: float = 0.0

    def __post_init__(self) -> None:
        name = "RewardModelCreditAssigner"
        check_negative_group_coef(name, self.negative_group_coef)
        if self.negative_group_coef and not self.group_normalize:
            raise ValueError(
                f"{name}: negative_group_coef={self.negative_group_coef!r} needs "
                "group_normalize=True (it acts on groups of rollouts of one prompt)"
            )
        if self.mode not in COMBINE_MODES:
            raise ValueError(f"{name}: mode={self.mode!r}; expected one of {COMBINE_MODES}")
        if isinstance(self.weight, bool) or not (
            isinstance(self.weight, int | float) and 0.0 <= self.weight <= 1.0
        ):
            raise ValueError(
                f"{name}: weight={self.weight!r}; expected 0 <= weight <= 1 (the env reward's "
                "share in mode='weighted')"
            )
        if self.group_normalize:
            gs = self.group_size
            if isinstance(gs, bool) or not isinstance(gs, int) or gs < 2:
                raise ValueError(
                    f"{name}: group_normalize=True needs group_size >= 2 (rollouts per prompt, "
                    f"as in GRPORequestStrategy), got group_size={gs!r}"
                )
        elif self.group_size is not None:
            raise ValueError(
                f"{name}: group_size={self.group_size!r} is only used with "
                "group_normalize=True; set group_normalize=True or drop group_size"
            )
        if not (isinstance(self.eps, int | float) and self.eps >= 0):
            raise ValueError(f"{name}: eps={self.eps!r}; expected eps >= 0")

    def combine(self, r: float, s: float) -> float:
        """c = combine(r, s) in this assigner's mode (see the class docstring)."""
        if self.mode == "replace":
            return s
        if self.mode == "add":
            return r + s
        if self.mode == "multiply":
            return r * s
        return self.weight * r + (1.0 - self.weight) * s

    def combined_rewards(self, rollout: Rollout) -> list[float]:
        """c_j for every turn of ``rollout`` (see the class docstring)."""
        turns = rollout.turns()
        scores = _rm_scores(rollout, len(turns))
        out: list[float] = []
        for turn, s in zip(turns, scores):
            r = turn.reward
            if s is None:
                if self.mode == "multiply" and r != 0.0:
                    raise ValueError(
                        f"RewardModelCreditAssigner: mode='multiply' but turn {turn.turn_id!r} "
                        f"of rollout {rollout.id!r} has env reward {r!r} and no reward-model "
                        "score, so it would be gated to 0; score every turn "
                        "(RewardModelScorer(per_turn=True)) or use mode='add'/'weighted'"
                    )
                s = 0.0
            out.append(self.combine(r, s))
        return out

    def compute(self, rollouts: Sequence[Rollout]) -> list[list[float]]:
        combined = [self.combined_rewards(r) for r in rollouts]
        if self.group_normalize:
            assert self.group_size is not None  # checked in __post_init__
            advantages = group_relative_advantages(
                rollouts,
                [sum(c) for c in combined],
                group_size=self.group_size,
                eps=self.eps,
                negative_group_coef=self.negative_group_coef,
                owner="RewardModelCreditAssigner",
            )
            return [[a] * len(c) for a, c in zip(advantages, combined)]
        out: list[list[float]] = []
        for c in combined:
            to_go = [0.0] * len(c)
            running = 0.0
            for j in range(len(c) - 1, -1, -1):
                running += c[j]
                to_go[j] = running
            out.append(to_go)
        return out


def _rm_scores(rollout: Rollout, num_turns: int) -> list[float | None]:
    """``meta["rm_scores"]`` of ``rollout``, checked against its ``num_turns`` turns."""
    if RM_SCORES_KEY not in rollout.meta:
        raise ValueError(
            f"RewardModelCreditAssigner: rollout {rollout.id!r} has no meta['{RM_SCORES_KEY}']; "
            "run the RewardModelScorer rollout hook before credit assignment "
            "(RolloutBatchSource(rollout_hooks=algorithm.rollout_hooks), as make_reward_rl sets up)"
        )
    scores = rollout.meta[RM_SCORES_KEY]
    if isinstance(scores, str) or not isinstance(scores, Sequence) or len(scores) != num_turns:
        raise ValueError(
            f"RewardModelCreditAssigner: rollout {rollout.id!r} meta['{RM_SCORES_KEY}']="
            f"{scores!r}; expected one score (or None) per turn, {num_turns} in all"
        )
    for j, s in enumerate(scores):
        if s is None:
            continue
        if isinstance(s, bool) or not isinstance(s, int | float) or not math.isfinite(s):
            raise ValueError(
                f"RewardModelCreditAssigner: rollout {rollout.id!r} meta['{RM_SCORES_KEY}'][{j}]"
                f"={s!r}; expected a finite float or None"
            )
    return list(scores)


__all__ = [
    "COMBINE_MODES",
    "RM_SCORES_KEY",
    "RM_VERSION_KEY",
    "RewardFormatFn",
    "RewardModelCreditAssigner",
    "RewardModelScorer",
    "reward_text",
]
