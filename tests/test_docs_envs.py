"""The shortest configs of docs/envs/*.md: each builds every part it names, as ``ludic
train`` checks before a run (the README tour's ``GuessParity`` as my_env.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from tests.envs.pages import write_page_files

from ludic.run.loading import validate_config
from ludic.run.preflight import check_config

DOCS = Path(__file__).resolve().parents[1] / "docs" / "envs"
README = Path(__file__).resolve().parents[1] / "README.md"


def _configs() -> list[tuple[str, str]]:
    found = []
    for page in sorted(DOCS.glob("*.md")):
        for block in re.findall(r"```yaml\n(.*?)```", page.read_text(), flags=re.S):
            if "env:" in block or "agent:" in block:
                found.append((page.name, block))
    return found


NEEDS = {
    "reasoning-gym.md": "reasoning_gym",
    "textarena.md": "textarena",
    "programs.md": "openai",
    "verifiers.md": "verifiers.v1",
    "openenv.md": "openenv.core",
}
"""The package each page's config needs (its extra)."""


@pytest.mark.parametrize(("page", "block"), _configs(), ids=[p for p, _ in _configs()])
def test_a_shortest_config_builds(page, block, tmp_path, monkeypatch) -> None:
    if page in NEEDS:
        pytest.importorskip(NEEDS[page], reason=f"{page}'s extra is not installed")
    tour = re.search(
        r"```python\n(from ludic.envs import SingleAgentEnv.*?)```", README.read_text(), re.S
    )
    (tmp_path / "my_env.py").write_text(tour.group(1))
    program = re.search(
        r"```python\n(async def solve.*?)```", (DOCS / "programs.md").read_text(), re.S
    )
    (tmp_path / "my_agent.py").write_text(program.group(1))
    write_page_files(DOCS / page, tmp_path)  # the page's own files (# NAME.py blocks)
    monkeypatch.chdir(tmp_path)
    data = yaml.safe_load(block)
    if "my_algo.py" in block:
        pytest.skip("names a file the page only describes")
    check_config(validate_config(data))
