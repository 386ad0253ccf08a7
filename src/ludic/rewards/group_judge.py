"""A group-relative judge (in the manner of ART's RULER): the G completions of one prompt go
to an LLM judge together, and its scores or its ranking become one reward each.

One chat-completions call judges a whole group (same judge, version and context for all).
With a vLLM judge the reply is forced into compact JSON of G entries (a regex); a reply
that still does not parse is an error for every member, never a silent score.
``scores``: ``{"scores": [s_1, ..., s_G]}``, integers 0..10, reward s_i / 10. ``ranking``:
``{"ranking": [a_1, ..., a_G]}``, the answer numbers best first (a permutation of 1..G);
position p (0-based) gets 1 - p / (G - 1).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from ludic.envs.templates import fill_template
from ludic.rewards.genrm import chat_complete
from ludic.rewards.sample import RewardResult, RewardSample

GroupMode = Literal["scores", "ranking"]

GROUP_TEMPLATE = (
    "Here are {n} answers to one question. Judge them against each other.\n"
    "Question: {question}\nReference answer: {ground_truth}\n\n{answers}\n\n{instruction}"
)
"""The judge's prompt: ``{n}``, ``{question}``, ``{ground_truth}``, ``{answers}`` (numbered,
one per line) and ``{instruction}`` (the reply format of the mode). A ranking cannot tie:
G equal answers still get 1, ..., 0 (the judge's order of them); use ``scores`` where ties
are common."""

INSTRUCTIONS: Mapping[str, str] = {
    "scores": 'Reply with JSON {"scores": [...]}: one integer from 0 to 10 per answer, in order.',
    "ranking": 'Reply with JSON {"ranking": [...]}: the answer numbers, best first.',
}


MAX_ENUMERATED_RANKING = 5
"""Up to this many answers a ranking's regex lists every order (5! = 120), so the judge
cannot name an answer twice; past it, a repeat is caught when the reply is parsed."""


def group_pattern(n: int, mode: GroupMode) -> str:
    """The regex of a judgement of ``n`` answers: compact JSON, exactly ``n`` integers in
    range (0..10 for scores; for a ranking, an order of 1..n, or up past
    :data:`MAX_ENUMERATED_RANKING` answers integers 1..n). A regex, not a JSON schema: a
    schema lets a weak judge spend its tokens on whitespace."""
    if mode == "ranking" and n <= MAX_ENUMERATED_RANKING:
        orders = itertools.permutations(range(1, n + 1))
        items = "(?:" + "|".join(",".join(map(str, order)) for order in orders) + ")"
    else:
        numbers = range(11) if mode == "scores" else range(1, n + 1)
        number = "(?:" + "|".join(str(x) for x in sorted(numbers, reverse=True)) + ")"
        items = number + f"(?:,{number}){{{n - 1}}}" if n > 1 else number
    return r'\{"' + mode + r'":\[' + items + r"\]\}"


def parse_group_judgement(text: str, n: int, mode: GroupMode) -> list[float]:
    """The rewards of ``n`` answers from the judge's reply (see the module docstring);
    anything else raises ``ValueError`` naming what is wrong."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"the judge's reply is not JSON ({e.msg}): {text[-200:]!r}") from None
    items = value.get(mode) if isinstance(value, dict) else None
    if not isinstance(items, list) or len(items) != n:
        raise ValueError(f'the judge\'s reply has no "{mode}" list of {n} entries: {text[-200:]!r}')
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in items):
        raise ValueError(f"the judge's {mode} are not all integers: {items}")
    if mode == "scores":
        if not all(0 <= x <= 10 for x in items):
            raise ValueError(f"the judge's scores {items} leave 0..10")
        return [x / 10 for x in items]
    if sorted(items) != list(range(1, n + 1)):
        raise ValueError(f"the judge's ranking {items} is not an order of the answers 1..{n}")
    position = {answer: p for p, answer in enumerate(items)}
    return [1.0 - position[i + 1] / max(n - 1, 1) for i in range(n)]


class GroupJudge:
    """Scores a group of samples (one prompt's G completions) in one judge call.

    ``address``: the judge server or the reward router (``None``: the reward loop's
    ``reward_router_address``). ``mode``: ``scores`` or ``ranking``. ``template``: see
    :data:`GROUP_TEMPLATE`. ``sampling``: chat-completion parameters (default greedy, with
    ``max_tokens`` enough for G numbers); ``structured_outputs`` is set to the group's
    :func:`group_pattern` unless given. ``on_error``: the score of every member of a group whose
    judgement failed, or ``"drop"`` (``None``: the group trains on nothing).
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        mode: GroupMode = "scores",
        template: str = GROUP_TEMPLATE,
        sampling: Mapping[str, Any] | None = None,
        api_key: str | None = None,
        timeout_s: float = 120.0,
        model: str | None = None,
        on_error: float | Literal["drop"] = "drop",
    ) -> None:
        if mode not in INSTRUCTIONS:
            raise ValueError(f"GroupJudge: mode={mode!r}; choose 'scores' or 'ranking'")
        self.address = address
        self.mode = mode
        self.template = template
        self.sampling = dict(sampling or {"temperature": 0.0})
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.model = model
        self.on_error = on_error
        self.render([RewardSample("probe", "a", "b")] * 2)  # a bad template fails now

    def render(self, samples: Sequence[RewardSample]) -> str:
        """The judge's prompt for ``samples`` (one prompt's completions)."""
        first = samples[0]
        answers = "\n".join(
            f"Answer {i + 1}: {s.solution_str.strip()}" for i, s in enumerate(samples)
        )
        fields = {
            **first.extra_info,
            "n": len(samples),
            "question": first.extra_info.get("question", ""),
            "ground_truth": first.ground_truth,
            "answers": answers,
            "instruction": INSTRUCTIONS[self.mode],
        }
        return fill_template("GroupJudge: template", self.template, fields, "a group's request")

    def request(self, samples: Sequence[RewardSample]) -> dict[str, Any]:
        """The chat-completions request judging ``samples``."""
        n = len(samples)
        request: dict[str, Any] = {
            "messages": [{"role": "user", "content": self.render(samples)}],
            "max_tokens": 16 + 4 * n,
            **self.sampling,
        }
        request.setdefault("structured_outputs", {"regex": group_pattern(n, self.mode)})
        if self.model is not None:
            request["model"] = self.model
        return request

    async def score_group(
        self,
        samples: Sequence[RewardSample],
        *,
        reward_router_address: str | None = None,
        reward_router_api_key: str | None = None,
    ) -> list[RewardResult]:
        """One result per sample, in order; a failed judgement is every member's error."""
        address = self.address or reward_router_address
        try:
            if address is None:
                raise ValueError(
                    "GroupJudge: no judge address (pass address= or run it in a reward loop with a router)"
                )
            reply = await chat_complete(
                address,
                self.request(samples),
                api_key=self.api_key or reward_router_api_key,
                timeout_s=self.timeout_s,
            )
            text = reply["choices"][0]["message"]["content"] or ""
            rewards = parse_group_judgement(text, len(samples), self.mode)
        except Exception as e:  # every member fails alike: recorded, never a silent score
            error = f"group judge ({len(samples)} answers): {type(e).__name__}: {e}"
            fallback = None if self.on_error == "drop" else float(self.on_error)
            return [RewardResult(fallback, error=error) for _ in samples]
        return [RewardResult(r) for r in rewards]
