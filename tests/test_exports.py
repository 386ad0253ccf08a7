"""Every name a package exports resolves, and ``import ludic`` stays light."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

PACKAGES = [
    "ludic",
    "ludic.envs",
    "ludic.agents",
    "ludic.context",
    "ludic.interaction",
    "ludic.inference",
    "ludic.inference.vllm",
    "ludic.rollouts",
    "ludic.rewards",
    "ludic.training",
    "ludic.training.reward_model",
    "ludic.training.losses",
    "ludic.training.batching",
    "ludic.distributed",
    "ludic.distributed.weight_transfer",
    "ludic.eval",
    "ludic.pipeline",
]


@pytest.mark.parametrize("package", PACKAGES)
def test_every_exported_name_resolves(package: str) -> None:
    module = importlib.import_module(package)
    missing = [name for name in module.__all__ if getattr(module, name, None) is None]
    assert not missing, f"{package} exports names that do not resolve: {missing}"


def test_unknown_name_raises_attribute_error() -> None:
    import ludic

    with pytest.raises(AttributeError, match="no attribute 'make_ppo'"):
        ludic.make_ppo  # noqa: B018


def test_importing_ludic_does_not_import_torch() -> None:
    code = "import sys, ludic, ludic.types; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
