"""Demonstration data: warm-start demonstrations and synthetic preference pairs.

``dataset_answers``: a QA env's own reference answers, played through the *same* agent,
protocol and chat template as RL uses (a scripted client answers each prompt with its
reference answer), so SFT trains on exactly the token layout RL samples in.

``synthetic_arithmetic_preferences``: preference pairs over arithmetic problems, for
reward-model training demos and tests.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ludic.envs import ReferenceAnswerEnv
from ludic.envs.arithmetic import make_arithmetic_samples
from ludic.inference import HFChatTemplate, InferenceSpec, ScriptedChatClient
from ludic.run.builders import RunError, make_context, make_engine, make_requests
from ludic.run.config import RunConfig
from ludic.run.registries import ENV, load_part
from ludic.training import write_rollouts_jsonl
from ludic.training.reward_model.preferences import PreferencePair, wrong_answer_preferences


def demonstrations_path(config: RunConfig, tokenizer: Any, out: Path) -> Path:
    """A JSONL of demonstration rollouts for the warm start: ``warm_start.demos`` itself
    when it is a file, else generated from the env's reference answers into ``out``."""
    demos = config.warm_start.demos
    if demos != "dataset_answers":
        path = Path(demos).expanduser()
        if not path.is_file():
            raise RunError(
                f"warm_start.demos: {demos!r} is neither 'dataset_answers' nor an existing "
                "JSONL file of rollouts"
            )
        return path
    if not out.is_file():
        rollouts = dataset_answer_rollouts(config, tokenizer)
        write_rollouts_jsonl(rollouts, out)
    return out


def dataset_answer_rollouts(config: RunConfig, tokenizer: Any) -> list:
    template = HFChatTemplate(tokenizer)
    answers = _reference_answers(config, template)

    def answer(request, prompt_text: str) -> str:
        return answers[tuple(request.prompt_token_ids)]

    engine = make_engine(config, ScriptedChatClient(tokenizer, answer), template)
    seeds = range(config.warm_start.num_demos)
    return asyncio.run(engine.generate_rollouts(make_requests(config, seeds, InferenceSpec())))


def _reference_answers(config: RunConfig, template: HFChatTemplate) -> dict[tuple[int, ...], str]:
    """Prompt token ids (as the agent renders them) -> the env's reference answer."""
    factory = load_part(ENV, config.env.kind, field="env.kind")
    answers: dict[tuple[int, ...], str] = {}
    for seed in range(config.warm_start.num_demos):
        env = factory(**config.env.kwargs)
        check_demonstrable(config, env)
        agent_id = env.agent_ids[0]
        obs, info = env.reset(seed)[agent_id]
        context = make_context(config)
        context.on_env_reset(obs, info, system_prompt=env.system_prompt)
        prompt = tuple(template.render(context.on_before_act()))
        answers[prompt] = env.reference_answer()
    return answers


def check_demonstrable(config: RunConfig, env: Any) -> None:
    """``dataset_answers`` can demonstrate ``env`` with ``config``'s agent: the env knows
    its answers (``ReferenceAnswerEnv``) and the agent is ludic's own (a program's prompts
    are its own). Raises :class:`RunError` naming the fix."""
    if config.agent.kind == "program":
        raise RunError(
            "warm_start.demos=dataset_answers cannot demonstrate an agent program (its "
            "prompts are the program's); set warm_start.steps: 0, or pass a JSONL of "
            "demonstration rollouts as warm_start.demos"
        )
    if not isinstance(env, ReferenceAnswerEnv):
        raise RunError(
            f"warm_start.demos=dataset_answers needs an env with reference answers (a "
            f"reference_answer() method); env.kind={config.env.kind!r} has none. Set "
            "warm_start.steps: 0 (no warm start), or pass a JSONL of demonstration rollouts "
            "as warm_start.demos"
        )


def synthetic_arithmetic_preferences(
    n: int,
    seed: int = 0,
    *,
    operators: Sequence[str] = ("+",),
    min_digits: int = 1,
    max_digits: int = 1,
    max_offset: int = 9,
    prompt_template: str = "{question}=",
) -> list[PreferencePair]:
    """``n`` pairs over arithmetic problems: the prompt is the problem as the arithmetic env
    shows it (``"3+4="``), ``chosen`` its answer, ``rejected`` a wrong answer.

    Problems come from :func:`ludic.envs.arithmetic.make_arithmetic_samples` (``n``,
    ``seed``, ``operators``, ``min_digits``, ``max_digits``); the wrong answers from
    :func:`~ludic.training.reward_model.preferences.wrong_answer_preferences` (``seed``,
    ``max_offset``), on a random stream separate from the problems'.
    """
    if max_offset < 1:
        raise ValueError(
            f"synthetic_arithmetic_preferences: max_offset={max_offset}; expected >= 1 (a "
            "wrong answer differs from the right one by 1..max_offset)"
        )
    samples = make_arithmetic_samples(
        n, seed, operators=operators, min_digits=min_digits, max_digits=max_digits
    )
    return wrong_answer_preferences(
        samples, seed, max_offset=max_offset, prompt_template=prompt_template, source="arithmetic"
    )
