"""The README's Python snippets run, in order, as one program."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_tour_runs_and_publishes_each_step() -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) >= 4, "the README tour lost its code blocks"
    namespace: dict = {"__name__": "readme_tour"}
    exec(compile("\n".join(blocks), str(README), "exec"), namespace)
    assert len(namespace["metrics"]) == 2
    # The async snippet's new trainer counts from 0 again: versions 1, 2, 3.
    assert [m["policy_version"] for m in namespace["history"]] == [1, 2, 3]
    assert namespace["client"].policy_version == 3
