"""``ludic train`` with an agent program (docs/envs/programs.md's config and program) in
sync and async mode on the in-process backend; pipeline mode: tests/pipeline."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytest.importorskip("openai", reason="the openai SDK is not installed")

from tests.tiny_run import TINY_RUN  # noqa: E402

from ludic import jobs  # noqa: E402
from ludic.run.loading import load_config  # noqa: E402

PAGE = Path(__file__).resolve().parents[2] / "docs" / "envs" / "programs.md"


def program_config(folder: Path, *extra: str):
    """The page's config, with the page's program as my_agent.py in ``folder``."""
    text = PAGE.read_text()
    (folder / "my_agent.py").write_text(re.search(r"```python\n(.*?)```", text, re.S).group(1))
    config = folder / "run.yaml"
    config.write_text(re.search(r"```yaml\n(.*?)```", text, re.S).group(1))
    return load_config(config, [f"output_dir={folder}", *TINY_RUN, *extra])


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_programs_page_trains(tmp_path, monkeypatch, mode) -> None:
    monkeypatch.chdir(tmp_path)
    run_dir = jobs.train(program_config(tmp_path, f"trainer.mode={mode}"))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in records if r["phase"] == "rl"]
    assert [r["step"] for r in rl] == [1, 2]
    assert all(r["policy_version"] == r["step"] for r in rl)
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    calls = [s for r in samples for s in r["steps"] if s["kind"] == "agent"]
    assert calls and all(c["trace"]["completion_token_ids"] for c in calls)
    assert all(c["info"]["route"] == "chat/completions" for c in calls)
