"""Name -> part registries for what a config picks by name: envs, parsers, algorithms.

Entries are ``"module:attribute"`` strings resolved on use, so validating a config (and
``ludic --help``) never imports torch. Add your own with :func:`register`.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable, Mapping
from typing import Any

from ludic._imports import load_function

__all__ = ["ALGORITHMS", "ENVS", "PARSERS", "check_name", "load_function", "register", "resolve"]

ENVS: dict[str, str] = {
    "arithmetic": "ludic.envs.arithmetic:ArithmeticQAEnv",
    "dataset_qa": "ludic.run.parts:dataset_qa_env_from_file",
    "tic_tac_toe": "ludic.envs.tic_tac_toe:TicTacToeEnv",
    "tic_tac_toe_two_player": "ludic.envs.tic_tac_toe:TicTacToeTwoPlayerEnv",
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


def check_name(kind: str, name: str, registry: Mapping[str, str]) -> str:
    """Return ``name`` if registered, else raise naming the choices and close matches."""
    if name in registry:
        return name
    close = difflib.get_close_matches(name, list(registry), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ValueError(f"unknown {kind} {name!r}{hint}; choose one of {sorted(registry)}")


def resolve(kind: str, name: str, registry: Mapping[str, str]) -> Callable[..., Any]:
    """The registered object for ``name``."""
    module, _, attr = registry[check_name(kind, name, registry)].partition(":")
    return getattr(importlib.import_module(module), attr)


def register(registry: dict[str, str], name: str, target: str) -> None:
    """Add ``name -> "module:attribute"`` (e.g. your own env) to a registry."""
    if ":" not in target:
        raise ValueError(f"register: target {target!r} must look like 'package.module:attribute'")
    registry[name] = target
