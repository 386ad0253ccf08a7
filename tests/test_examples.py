"""Every example runs end to end on a tiny budget (CleanRL-style smoke runs)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


def test_sft_then_grpo_arithmetic_smoke(capsys) -> None:
    example = _load("sft_then_grpo_arithmetic")
    example.main(
        example.Args(sft_steps=2, grpo_steps=2, num_problems=6, prompts_per_step=2, group_size=2)
    )
    out = capsys.readouterr().out
    assert "wrote 6 expert demonstrations" in out
    assert "greedy accuracy after GRPO" in out
