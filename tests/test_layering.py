"""Layer-0/1 modules (pure data and contracts) must not import anything above them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

ALLOWED = {
    "ludic.types": set(),
    "ludic.parsers": set(),
    "ludic.inference.request": set(),
    "ludic.training.types": {"ludic.types", "ludic.inference.request"},
    "ludic.inference.client": {"ludic.types", "ludic.inference.request"},
    "ludic.inference.chat_template": {"ludic.types"},
    "ludic.envs.env": {"ludic.types"},
    "ludic.context.base": {"ludic.types"},
    "ludic.interaction.base": {"ludic.types", "ludic.envs.env", "ludic.inference.request"},
    "ludic.training.losses.base": set(),
    "ludic.distributed.interfaces": set(),
    "ludic.inference.reward_client": set(),
}


def _ludic_imports(module: str) -> set[str]:
    path = SRC / (module.replace(".", "/") + ".py")
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ludic"):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("ludic"))
    return found


@pytest.mark.parametrize("module", sorted(ALLOWED))
def test_contract_module_imports_only_lower_layers(module: str) -> None:
    extra = _ludic_imports(module) - ALLOWED[module]
    assert not extra, f"{module} imports {sorted(extra)}; contracts must only import lower layers"
