"""The README's Python snippets run, in order, as one program, and its config for your own
task loads and builds with the tour's env and parser saved as ``my_env.py``."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from ludic.run.loading import load_config
from ludic.run.preflight import check_config

README = Path(__file__).resolve().parents[1] / "README.md"


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_tour_runs_and_publishes_each_step() -> None:
    blocks = _blocks("python")
    assert len(blocks) >= 4, "the README tour lost its code blocks"
    namespace: dict = {"__name__": "readme_tour"}
    exec(compile("\n".join(blocks), str(README), "exec"), namespace)
    assert len(namespace["metrics"]) == 2
    # The async snippet's new trainer counts from 0 again: versions 1, 2, 3.
    assert [m["policy_version"] for m in namespace["history"]] == [1, 2, 3]
    assert namespace["client"].policy_version == 3


def test_readme_config_for_your_own_task_builds(tmp_path: Path, monkeypatch) -> None:
    env_block, parser_block = _blocks("python")[:2]
    (tmp_path / "my_env.py").write_text(env_block + "\n" + parser_block)
    (config_text,) = _blocks("yaml")
    (tmp_path / "run.yaml").write_text(config_text)
    assert {"env", "agent", "algorithm"} <= set(yaml.safe_load(config_text))
    monkeypatch.chdir(tmp_path)
    config = load_config(tmp_path / "run.yaml")
    assert config.env.kind == f"{tmp_path}/my_env.py:GuessParity"
    check_config(config)  # every part builds: the env, the parser, the algorithm
