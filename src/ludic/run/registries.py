"""What a config names: a built-in part by its name, or your own code by
``package.module:attr`` or ``path/to/file.py:attr`` -- one loader for every such field.

Each :class:`PartKind` pairs a registry of built-in names with what your target must be.
The config schema checks a value without importing it (:func:`check_choice`); the
preflight and builders load it (:func:`load_part`) and check the target, so a wrong file,
attribute or signature stops the run before it starts. Registry entries are
``"module:attribute"`` strings resolved on use, so validating a config never imports
torch. :func:`register` adds a name for your own part.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ludic._imports import SPEC_FORMS, absolute_spec, is_code_spec, load_object, split_spec
from ludic.run.errors import RunError

__all__ = [
    "ALGORITHM",
    "ALGORITHMS",
    "CREDIT_ASSIGNER",
    "CREDIT_ASSIGNERS",
    "ENV",
    "ENVS",
    "PARSER",
    "PARSERS",
    "PROGRAM",
    "PROGRAMS",
    "REWARD_FUNCTION",
    "REWARD_FUNCTIONS",
    "REWARD_MANAGER",
    "TOOL",
    "PartKind",
    "check_choice",
    "check_name",
    "load_part",
    "register",
    "resolve",
]

ENVS: dict[str, str] = {
    "arithmetic": "ludic.envs.arithmetic:ArithmeticQAEnv",
    "dataset_qa": "ludic.run.parts:dataset_qa_env_from_file",
    "reasoning_gym": "ludic.envs.reasoning_gym_env:ReasoningGymEnv",
    "textarena": "ludic.envs.textarena_env:TextArenaEnv",
    "tic_tac_toe": "ludic.envs.tic_tac_toe:TicTacToeEnv",
    "tic_tac_toe_two_player": "ludic.envs.tic_tac_toe:TicTacToeTwoPlayerEnv",
    "openenv": "ludic.envs.openenv_env:OpenEnvEnv",
    "verifiers": "ludic.envs.verifiers_env:VerifiersEnv",
}
"""Env kind -> factory(**env.kwargs) returning a ``LudicEnv``."""

PARSERS: dict[str, str] = {
    "answer": "ludic.run.parts:plain_answer_parser",
    "xml_answer": "ludic.run.parts:xml_answer_parser",
    "boxed": "ludic.run.parts:boxed_answer_parser",
    "think_then_answer": "ludic.run.parts:think_then_answer_parser",
    "identity": "ludic.run.parts:identity_parser",
}
"""Parser name -> a ``Parser`` (a callable text -> ParseResult)."""

ALGORITHMS: dict[str, str] = {
    "reinforce": "ludic.training.algorithm:make_reinforce",
    "reinforce_baseline": "ludic.training.algorithm:make_reinforce_baseline",
    "grpo": "ludic.training.algorithm:make_grpo",
    "dr_grpo": "ludic.training.algorithm:make_dr_grpo",
    "gspo": "ludic.training.algorithm:make_gspo",
    "cispo": "ludic.training.algorithm:make_cispo",
    "gmpo": "ludic.training.algorithm:make_gmpo",
    "decoupled_ppo": "ludic.training.algorithm:make_decoupled_ppo",
    "decoupled_grpo": "ludic.training.algorithm:make_decoupled_grpo",
    "reward_rl": "ludic.training.algorithm:make_reward_rl",
}
"""Algorithm name -> ``make_*`` preset (SFT is the warm-start phase, not an RL algorithm)."""

CREDIT_ASSIGNERS: dict[str, str] = {
    "monte_carlo": "ludic.training.credit_assignment:MonteCarloReturn",
    "group_normalized": "ludic.training.credit_assignment:GroupNormalizedReturn",
    "episodic": "ludic.training.credit_assignment:EpisodicReturn",
    "per_step": "ludic.training.credit_assignment:PerStepReward",
    "constant": "ludic.training.credit_assignment:ConstantCredit",
}
"""Credit assigner name -> class, built with ``algorithm.credit_assigner_kwargs``."""

REWARD_FUNCTIONS: dict[str, str] = {
    "rules": "ludic.rewards.rules:default_compute_score",
    "gsm8k": "ludic.rewards.rules:gsm8k_score",
    "math": "ludic.rewards.rules:math_score",
    "arithmetic": "ludic.rewards.rules:arithmetic_score",
    "format": "ludic.rewards.rules:format_score",
}
"""Reward function name -> a function (data_source, solution_str, ground_truth,
extra_info, **kwargs) (spec 5's signature)."""

TOOLS: dict[str, str] = {}
"""Tool name -> a typed Python function (none built in: tools are yours)."""


def _callable(target: Any) -> str | None:
    return None if callable(target) else f"it is a {type(target).__name__}, not callable"


def _takes_text(target: Any) -> str | None:
    """A parser is called with one argument, the completion text."""
    if not callable(target):
        return _callable(target)
    try:
        inspect.signature(target).bind("completion")
    except TypeError:
        return f"{_signature(target)} cannot be called with one argument (the completion text)"
    except ValueError:  # no signature (a builtin): the call will tell
        return None
    return None


def _takes_reward_arguments(target: Any) -> str | None:
    if not callable(target):
        return _callable(target)
    try:
        inspect.signature(target).bind("data_source", "solution_str", "ground_truth", None)
    except TypeError:
        return f"{_signature(target)} cannot take (data_source, solution_str, ground_truth, extra_info)"
    except ValueError:
        return None
    return None


def _reward_manager_class(target: Any) -> str | None:
    from ludic.rewards.managers import RewardManager

    if isinstance(target, type) and issubclass(target, RewardManager):
        return None
    what = f"class {target.__name__}" if isinstance(target, type) else type(target).__name__
    return f"it is a {what}, not a RewardManager subclass"


def _agent_program(target: Any) -> str | None:
    from ludic.interaction.program import check_program

    return check_program(target)


def _signature(target: Any) -> str:
    name = getattr(target, "__qualname__", type(target).__name__)
    try:
        return f"{name}{inspect.signature(target)}"
    except (TypeError, ValueError):
        return name


@dataclass(frozen=True)
class PartKind:
    """One kind of part a config names: the registry of its built-in names, what a target
    of yours must be (for messages) and the check of a loaded target."""

    noun: str
    registry: Mapping[str, str]
    wants: str
    check: Callable[[Any], str | None] = _callable
    """Why a loaded target cannot be this part, or None."""


ENV = PartKind(
    "env",
    ENVS,
    "a LudicEnv class (e.g. a ludic.envs.SingleAgentEnv subclass) or a function returning "
    "one, called with env.kwargs",
)
PARSER = PartKind("parser", PARSERS, "a function (text: str) -> ParseResult", _takes_text)
ALGORITHM = PartKind(
    "algorithm",
    ALGORITHMS,
    "a make_* function returning an RLAlgorithm (credit assigner + loss), called with "
    "algorithm.kwargs",
)
CREDIT_ASSIGNER = PartKind(
    "credit assigner",
    CREDIT_ASSIGNERS,
    "a class or function called with algorithm.credit_assigner_kwargs, returning an object "
    "with compute(rollouts) -> list[list[float]]",
)
REWARD_FUNCTION = PartKind(
    "reward function",
    REWARD_FUNCTIONS,
    "a function (data_source, solution_str, ground_truth, extra_info, **kwargs) -> float, "
    "sync or async",
    _takes_reward_arguments,
)
REWARD_MANAGER = PartKind(
    "reward manager",
    {},  # the built-in names are ludic.rewards.managers.REWARD_MANAGERS, filled by @register
    "a ludic.rewards.RewardManager subclass, built with the reward function and "
    "reward_loop.manager_kwargs",
    _reward_manager_class,
)
PROGRAMS: dict[str, str] = {
    "verifiers": "ludic.envs.verifiers_env:verifiers_program",
}
"""Built-in agent programs: ``verifiers`` plays ``env.kind: verifiers`` tasks."""

PROGRAM = PartKind(
    "agent program",
    PROGRAMS,
    "an async function (client: openai.AsyncOpenAI, task: dict) returning a reward, an "
    "answer or {'reward' | 'answer': ..., 'metrics': {...}}",
    _agent_program,
)
TOOL = PartKind(
    "tool", TOOLS, "a Python function with type hints (its docstring describes it to the model)"
)


def check_name(kind: str, name: str, registry: Mapping[str, str]) -> str:
    """Return ``name`` if registered, else raise naming the choices and close matches."""
    if name in registry:
        return name
    close = difflib.get_close_matches(name, list(registry), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    choices = f"choose one of {sorted(registry)}, or name your own" if registry else "name one"
    raise ValueError(f"unknown {kind} {name!r}{hint}; {choices} as {SPEC_FORMS}")


def check_choice(kind: PartKind, value: str) -> str:
    """The schema's check (nothing imported): a registered name, or a well-formed code
    reference, returned with a relative ``.py`` path made absolute."""
    if not is_code_spec(value):
        return check_name(kind.noun, value, kind.registry)
    split_spec(value, field=None)
    return absolute_spec(value)


def resolve(kind: str, name: str, registry: Mapping[str, str]) -> Callable[..., Any]:
    """The registered object for ``name``."""
    module, _, attr = registry[check_name(kind, name, registry)].partition(":")
    return getattr(importlib.import_module(module), attr)


def load_part(kind: PartKind, value: str, *, field: str) -> Any:
    """What ``value`` names: a registered part, or your code (imported and checked).
    Raises :class:`RunError` naming ``field``, the file and what is wrong."""
    if not is_code_spec(value):
        try:
            return resolve(kind.noun, value, kind.registry)
        except ValueError as e:
            raise RunError(f"{field}: {e}") from None
    try:
        target = load_object(value, field=field)
    except (ValueError, FileNotFoundError) as e:
        raise RunError(str(e)) from None
    problem = kind.check(target)
    if problem:
        raise RunError(f"{field}: {value!r}: {problem}; it must be {kind.wants}")
    return target


def register(registry: dict[str, str], name: str, target: str) -> None:
    """Add ``name -> "module:attribute"`` (e.g. your own env) to a registry. (A config can
    also name the target itself, without registering it.)"""
    if ":" not in target:
        raise ValueError(f"register: target {target!r} must look like 'package.module:attribute'")
    registry[name] = target
