"""Rollouts -> ``SAWItem``s: one training sequence per turn that has agent steps.

Token mode (the default) is drift-free: it concatenates the exact token ids the inference
backend saw and produced, ``input_ids = p1 + c1 + ext2 + c2 + ...`` with ``action_mask`` 1 on
the completions ``c_k`` only (``ext_k``: what the k-th prompt adds, as ``ChatTemplate.extend``
guarantees). ``retokenize=True`` rebuilds the tokens from the recorded messages with a
``ChatTemplate`` (offline data, another tokenizer): no ``old_logprobs``, and a completion cut by
``max_tokens`` is not reproduced (its meta keeps ``finish_reason="length"`` for a filter).
Entry points: :func:`rollouts_to_saw_items`, :func:`build_saw_batch`. Meta keys: docs/design.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ludic.inference.chat_template import ChatTemplate
from ludic.rollouts.summary import summarize_rollouts
from ludic.training.filters import SampleFilter
from ludic.training.ledger import ABORTED, DROPPED_FILTER, GENERATED
from ludic.training.types import CreditAssigner, SAWBatch, SAWItem
from ludic.types import AgentStep, Message, Rollout, Turn

ROLLOUT_META_KEYS = (
    "group_id",
    "group_index",
    "agent_id",
    "env_kind",
    "protocol_kind",
    "env_seed",
    "sampling_seed",
    "episode_index",
    "reward_dropped",
)
"""Rollout meta keys copied into every item's meta (when present)."""


class TokenAlignmentError(ValueError):
    """A turn's token ids cannot be concatenated into one training sequence."""


def check_retokenize_args(owner: str, retokenize: bool, chat_template: ChatTemplate | None) -> None:
    """Raise naming ``owner`` when ``retokenize=True`` comes without a chat template."""
    if retokenize and chat_template is None:
        raise ValueError(
            f"{owner}: retokenize=True needs a chat_template (e.g. HFChatTemplate(tokenizer)) "
            "to rebuild token ids from the recorded messages"
        )


def rollouts_to_saw_items(
    rollouts: Sequence[Rollout],
    weights: Sequence[Sequence[float]],
    *,
    retokenize: bool = False,
    chat_template: ChatTemplate | None = None,
) -> list[SAWItem]:
    """One ``SAWItem`` per turn with agent steps; ``weights[i][j]`` is turn ``j`` of
    ``rollouts[i].turns()`` (what ``CreditAssigner.compute`` returns).

    Turns whose completions are all empty (no generated token) are skipped: there is
    nothing to train on.
    """
    check_retokenize_args("rollouts_to_saw_items", retokenize, chat_template)
    if len(weights) != len(rollouts):
        raise ValueError(
            f"credit assigner returned weights for {len(weights)} rollouts but the batch has "
            f"{len(rollouts)}; CreditAssigner.compute must return one list per rollout"
        )
    items: list[SAWItem] = []
    for i, rollout in enumerate(rollouts):
        turns = rollout.turns()
        if len(weights[i]) != len(turns):
            raise ValueError(
                f"credit assigner returned {len(weights[i])} weights for rollout {rollout.id} "
                f"which has {len(turns)} turns; it must return one weight per turn of "
                "Rollout.turns()"
            )
        for j, turn in enumerate(turns):
            if not turn.agent_steps:
                continue
            if retokenize:
                assert chat_template is not None
                seq = _retokenized_turn(rollout, j, turn, chat_template)
            else:
                seq = _token_turn(rollout, j, turn)
            if not any(seq.action_mask):
                continue
            oldest = _policy_version(turn) if seq.versions is None else min(seq.versions)
            known_newest = oldest if seq.versions is None else max(seq.versions)
            items.append(
                SAWItem(
                    input_ids=seq.input_ids,
                    action_mask=seq.action_mask,
                    weight=float(weights[i][j]),
                    old_logprobs=seq.logprobs,
                    policy_version=oldest if seq.versions is None else None,
                    meta=_item_meta(rollout, j, turn, seq),
                    action_versions=seq.versions,
                    version_end=_version_end(turn, known_newest),
                    logprob_temperature=_logprob_temperature(rollout, j, turn),
                )
            )
    return items


class _Sequence:
    """A growing training sequence: ids, action mask and (optional) old logprobs and
    per-action policy versions."""

    def __init__(self) -> None:
        self.input_ids: list[int] = []
        self.action_mask: list[int] = []
        self._logprobs: list[float] | None = []
        self._versions: list[int] | None = []
        self.prompt_length = 0

    def add_context(self, ids: Sequence[int]) -> None:
        self.input_ids.extend(ids)
        self.action_mask.extend([0] * len(ids))
        if self._logprobs is not None:
            self._logprobs.extend([0.0] * len(ids))

    def add_action(
        self,
        ids: Sequence[int],
        logprobs: Sequence[float] | None,
        versions: Sequence[int] | None = None,
    ) -> None:
        self.input_ids.extend(ids)
        self.action_mask.extend([1] * len(ids))
        if logprobs is None:
            self._logprobs = None
        elif self._logprobs is not None:
            self._logprobs.extend(float(x) for x in logprobs)
        if versions is None:
            self._versions = None
        elif self._versions is not None:
            self._versions.extend(versions)

    @property
    def logprobs(self) -> list[float] | None:
        return self._logprobs

    @property
    def versions(self) -> list[int] | None:
        """Per-action versions when every call of the turn reported them."""
        return self._versions if self._versions else None

    @property
    def completion_length(self) -> int:
        return sum(self.action_mask)


def _token_turn(rollout: Rollout, turn_index: int, turn: Turn) -> _Sequence:
    seq = _Sequence()
    for k, step in enumerate(turn.agent_steps):
        trace = step.trace
        if trace is None:
            raise ValueError(
                f"turn {turn_index} of rollout {rollout.id}: agent step {k} (rollout index "
                f"{step.index}) has no token trace; request token ids with "
                "InferenceSpec(returns=ReturnSpec.for_rl()), or pass retokenize=True with a "
                "chat_template"
            )
        prompt = trace.prompt_token_ids
        if k == 0:
            seq.add_context(prompt)
            seq.prompt_length = len(prompt)
        else:
            n = len(seq.input_ids)
            if tuple(prompt[:n]) != tuple(seq.input_ids):
                raise TokenAlignmentError(
                    f"turn {turn_index} of rollout {rollout.id}: the prompt of agent step {k} "
                    f"(rollout index {step.index}) does not extend the earlier tokens (earlier "
                    f"prompt + completion, {n} tokens; first mismatch at token "
                    f"{_first_mismatch(prompt, seq.input_ids)}); build in-turn prompts with "
                    "ChatTemplate.extend, or use retokenize=True"
                )
            seq.add_context(prompt[n:])
        seq.add_action(
            trace.completion_token_ids, trace.completion_logprobs, trace.token_versions()
        )
    return seq


def _retokenized_turn(
    rollout: Rollout, turn_index: int, turn: Turn, chat_template: ChatTemplate
) -> _Sequence:
    seq = _Sequence()
    for k, step in enumerate(turn.agent_steps):
        tools = step.info.get("tools")
        prompt = list(
            chat_template.render(step.prompt_messages, tools=tools, add_generation_prompt=True)
        )
        # The assistant message exactly as the agent keeps it in its history (and as the
        # next call's prompt_messages hold it): the raw completion, tool-call text included.
        assistant: Message = {"role": "assistant", "content": step.completion}
        full = list(
            chat_template.render(
                [*step.prompt_messages, assistant], tools=tools, add_generation_prompt=False
            )
        )
        if full[: len(prompt)] != prompt:
            raise TokenAlignmentError(
                f"turn {turn_index} of rollout {rollout.id}: agent step {k} (rollout index "
                f"{step.index}): the chat template renders the prompt differently when the "
                "assistant reply is appended, so the completion tokens cannot be located; use "
                "token mode (retokenize=False) with traces from ReturnSpec.for_rl()"
            )
        if k == 0:
            seq.add_context(prompt)
            seq.prompt_length = len(prompt)
        else:
            n = len(seq.input_ids)
            if prompt[:n] != seq.input_ids:
                raise TokenAlignmentError(
                    f"turn {turn_index} of rollout {rollout.id}: the re-rendered prompt of agent "
                    f"step {k} (rollout index {step.index}) does not extend the earlier messages "
                    f"(first mismatch at token {_first_mismatch(prompt, seq.input_ids)}); its "
                    "prompt_messages must start with the earlier prompt plus the assistant reply"
                )
            seq.add_context(prompt[n:])
        seq.add_action(full[len(prompt) :], None, None)
    return seq


def _first_mismatch(a: Sequence[int], b: Sequence[int]) -> int:
    for t, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return t
    return min(len(a), len(b))


def _policy_version(turn: Turn) -> int | None:
    """The oldest known weight version among the turn's calls (``None`` if none is known)."""
    versions = [
        s.trace.policy_version
        for s in turn.agent_steps
        if s.trace is not None and s.trace.policy_version is not None
    ]
    return min(versions) if versions else None


def _logprob_temperature(rollout: Rollout, turn_index: int, turn: Turn) -> float:
    """The temperature the turn's calls sampled under (``TokenTrace.logprob_temperature``;
    1.0 for calls without a trace). One item is scored under one temperature, so the
    calls of a turn must agree."""
    found = {s.trace.logprob_temperature for s in turn.agent_steps if s.trace is not None}
    if len(found) > 1:
        raise ValueError(
            f"turn {turn_index} of rollout {rollout.id}: its agent steps sampled under "
            f"different temperatures {sorted(found)}; one training sequence is scored under "
            "one temperature, so sample a turn's calls with one temperature (or end the turn "
            "where the temperature changes)"
        )
    return found.pop() if found else 1.0


def _version_end(turn: Turn, known_newest: int | None) -> int | None:
    """The newest version any of the turn's calls may have sampled with, when it is newer
    than the item's known token versions (a call that straddled an update without a
    pause, or a retokenized turn whose calls had different versions); else ``None``."""
    newest = [
        v
        for s in turn.agent_steps
        if s.trace is not None and (v := s.trace.newest_version()) is not None
    ]
    if not newest or known_newest is None or max(newest) <= known_newest:
        return None
    return max(newest)


def _finish_reason(step: AgentStep) -> str | None:
    """The trace's finish reason, else the one the agent recorded in ``info`` (a step
    without a trace, e.g. sampled with ``ReturnSpec.for_eval()``)."""
    if step.finish_reason is not None:
        return step.finish_reason
    reason = step.info.get("finish_reason")
    return reason if isinstance(reason, str) else None


def _item_meta(rollout: Rollout, turn_index: int, turn: Turn, seq: _Sequence) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "rollout_id": rollout.id,
        "turn_index": turn_index,
        "turn_id": turn.turn_id,
        "group_id": rollout.meta.get("group_id"),
        "reward": turn.reward,
        "total_reward": rollout.total_reward,
        "terminated": rollout.terminated,
        "truncated": rollout.truncated,
        "finish_reason": _finish_reason(turn.agent_steps[-1]),
        "parse_error": any(s.parse_error for s in turn.agent_steps),
        "num_agent_steps": len(turn.agent_steps),
        "prompt_length": seq.prompt_length,
        "completion_length": seq.completion_length,
    }
    for key in ROLLOUT_META_KEYS:
        if key in rollout.meta and key not in meta:
            meta[key] = rollout.meta[key]
    return meta


def build_saw_batch(
    rollouts: Sequence[Rollout],
    *,
    credit_assigner: CreditAssigner,
    retokenize: bool = False,
    chat_template: ChatTemplate | None = None,
    sample_filter: SampleFilter | None = None,
) -> SAWBatch:
    """Credit-assign ``rollouts``, convert them to items, filter, and attach statistics.

    ``batch.meta`` holds :func:`summarize_rollouts` plus ``num_items``,
    ``num_items_filtered`` (dropped by ``sample_filter``) and ``num_action_tokens``.
    """
    weights = credit_assigner.compute(rollouts)
    items = rollouts_to_saw_items(
        rollouts, weights, retokenize=retokenize, chat_template=chat_template
    )
    kept = items if sample_filter is None else [it for it in items if sample_filter(it)]
    meta = summarize_rollouts(rollouts)
    kept_tokens = sum(it.num_action_tokens for it in kept)
    filtered = sum(it.num_action_tokens for it in items) - kept_tokens
    aborted = sum(
        int(step.info.get("discarded_tokens", 0)) for r in rollouts for step in r.agent_steps
    )
    meta.update(
        num_items=len(kept),
        num_items_filtered=len(items) - len(kept),
        num_action_tokens=kept_tokens,
        # the token ledger (ludic.training.ledger), counted in the items' action tokens
        **{GENERATED: aborted + filtered + kept_tokens, ABORTED: aborted, DROPPED_FILTER: filtered},
    )
    return SAWBatch(items=kept, meta=meta)
