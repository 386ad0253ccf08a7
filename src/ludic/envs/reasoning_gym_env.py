"""``ReasoningGymEnv``: reasoning-gym's procedural tasks (about 100), one problem per episode,
scored by the task's own ``score_answer`` (docs/envs/reasoning-gym.md).

``task`` names a dataset and ``config`` its settings; nothing is downloaded. The ``train``
part is the ``size`` problems of seed ``seed``; the ``heldout`` part the ``heldout_size``
problems of ``heldout_seed`` (default ``seed + size``, the first seed whose problems the
train part does not draw), each question once, less every question the train part has.
Needs the ``envs`` extra.
"""

from __future__ import annotations

import difflib
import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from ludic.envs.single_agent_env import DEFAULT_AGENT_ID, SingleAgentEnv
from ludic.envs.templates import fill_template
from ludic.types import AgentId, Info, Observation, StepOutcome

Part = Literal["train", "heldout"]


class ReasoningGymEnv(SingleAgentEnv):
    """One reasoning-gym problem per episode.

    * ``reset(seed)`` shows problem ``seed % len(problems)`` of the part (``seed=None``:
      problem 0 onwards in turn); the observation is the problem's question, or
      ``prompt_template.format(question=..., **metadata)``.
    * ``step(answer)`` returns ``reward = dataset.score_answer(answer, entry)`` (the task's
      scorer: 1.0 for a right answer, partial credit where the task gives some),
      ``terminated=True``, info ``target``, ``score``, ``correct`` (score == 1) and
      ``problem``.
    """

    def __init__(
        self,
        *,
        task: str,
        config: Mapping[str, Any] | None = None,
        seed: int = 0,
        size: int = 500,
        part: Part = "train",
        heldout_seed: int | None = None,
        heldout_size: int | None = None,
        prompt_template: str | None = None,
        system_prompt: str | None = None,
        agent_id: AgentId = DEFAULT_AGENT_ID,
    ) -> None:
        super().__init__(agent_id=agent_id, system_prompt=system_prompt)
        if part not in ("train", "heldout"):
            raise ValueError(f"part={part!r}; choose 'train' or 'heldout'")
        if size < 1:
            raise ValueError(f"size={size}; expected >= 1 problems")
        settings = json.dumps(dict(config or {}), sort_keys=True)
        train = _problems(task, settings, seed, size)
        if part == "train":
            self.dataset, self.problems = train
        else:
            other = seed + size if heldout_seed is None else heldout_seed
            drawn = size if heldout_size is None else heldout_size
            if drawn < 1:
                raise ValueError(f"heldout_size={drawn}; expected >= 1 problems")
            self.dataset, candidates = _problems(task, settings, other, drawn)
            seen = {entry["question"] for entry in train[1]}
            kept: dict[str, dict] = {}  # each held-out question once
            for entry in candidates:
                if entry["question"] not in seen:
                    kept.setdefault(entry["question"], entry)
            self.problems = tuple(kept.values())
            if not self.problems:
                raise ValueError(
                    f"task {task!r}: all {drawn} problems of seed {other} are train problems "
                    "too; the task has too few distinct problems for a held-out part (lower "
                    "size, or raise heldout_size)"
                )
        self.task = task
        self.part = part
        self.prompt_template = prompt_template
        self._index: int | None = None
        self._next = 0
        self.render_prompt(self.problems[0])  # a bad template fails now

    @property
    def current(self) -> Mapping[str, Any]:
        """The current episode's reasoning-gym entry (question, answer, metadata)."""
        if self._index is None:
            raise RuntimeError("ReasoningGymEnv: no current problem; call reset() first")
        return self.problems[self._index]

    def reference_answer(self) -> str:
        """The current problem's answer (``ReferenceAnswerEnv``)."""
        return str(self.current["answer"])

    def render_prompt(self, entry: Mapping[str, Any]) -> str:
        if self.prompt_template is None:
            return str(entry["question"])
        fields = {**entry.get("metadata", {}), "question": entry["question"]}
        return fill_template(
            "prompt_template", self.prompt_template, fields, f"a {self.task!r} problem"
        )

    def env_reset(self, seed: int | None = None) -> tuple[Observation, Info]:
        if seed is None:
            seed, self._next = self._next, self._next + 1
        self._index = seed % len(self.problems)
        entry = self.problems[self._index]
        return self.render_prompt(entry), {"problem": self._index, "target": str(entry["answer"])}

    def env_step(self, action: str) -> StepOutcome:
        entry = self.current
        score = float(self.dataset.score_answer(action, entry))
        return StepOutcome(
            obs="Correct." if score == 1.0 else "Incorrect.",
            reward=score,
            terminated=True,
            info={
                "target": str(entry["answer"]),
                "score": score,
                "correct": score == 1.0,
                "problem": self._index,
            },
        )


@functools.lru_cache(maxsize=16)
def _problems(task: str, settings: str, seed: int, size: int) -> tuple[Any, tuple[dict, ...]]:
    """The dataset and its ``size`` entries (cached: a run builds an env per episode)."""
    rg = _reasoning_gym()
    names = sorted(rg.factory.DATASETS)
    if task not in names:
        close = difflib.get_close_matches(task, names, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"task={task!r} is not a reasoning-gym dataset{hint}; one of {names}")
    config = json.loads(settings)
    for reserved in ("seed", "size"):
        if reserved in config:
            raise ValueError(f"config.{reserved}: set env.kwargs.{reserved}, not config.{reserved}")
    try:
        dataset = rg.create_dataset(task, seed=seed, size=size, **config)
    except (TypeError, AssertionError, ValueError) as e:
        raise ValueError(f"config for reasoning-gym task {task!r}: {e}") from None
    return dataset, tuple(_entries(dataset))


def _entries(dataset: Sequence[Any]) -> list[dict]:
    return [dict(entry) for entry in dataset]


def _reasoning_gym() -> Any:
    try:
        import reasoning_gym
    except ImportError:
        raise ValueError(
            "env.kind reasoning_gym needs the reasoning-gym package: pip install 'ludic-rl[envs]'"
        ) from None
    return reasoning_gym
