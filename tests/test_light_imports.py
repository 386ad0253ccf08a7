"""Pure-data modules and the config stay light: importing them (or reporting a config typo)
must not load torch, transformers or vLLM. The package layering itself is enforced by
import-linter (``lint-imports``, contracts in pyproject.toml, run by ``make lint``)."""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "vllm")

LIGHT_MODULES = [
    "ludic",
    "ludic.types",
    "ludic.parsers",
    "ludic.stats",
    "ludic.inference.request",
    "ludic.rollouts.requests",
    "ludic.rewards.sample",
    "ludic.rewards.managers",  # reward functions run without torch
    "ludic.training.types",
    "ludic.run.config",
    "ludic.run.loading",
    "ludic.cli",
]


def _heavy_modules_after(code: str) -> list[str]:
    probe = (
        f"{code}\nimport sys\nprint('HEAVY=' + ','.join(m for m in {HEAVY!r} if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    line = out.stdout.strip().splitlines()[-1]
    return [m for m in line.removeprefix("HEAVY=").split(",") if m]


@pytest.mark.parametrize("module", LIGHT_MODULES)
def test_importing_a_light_module_loads_no_heavy_dependency(module: str) -> None:
    assert _heavy_modules_after(f"import {module}") == []


def test_a_config_typo_is_reported_before_torch_is_imported(tmp_path) -> None:
    code = (
        "from ludic import cli\n"
        "try:\n"
        "    assert cli.main(['demo', 'trainer.lrr=1']) == 2\n"
        "except SystemExit as e:\n"
        "    assert e.code == 2\n"
    )
    assert _heavy_modules_after(code) == []
