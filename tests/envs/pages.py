"""The docs/envs pages' examples as files: each ```python block whose first line is
``# NAME.py`` is written to NAME.py, and the page's first ```yaml block is its config."""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs" / "envs"


def write_page_files(page: str | Path, folder: Path) -> Path:
    """Write ``page``'s named python blocks into ``folder``; return its config's path."""
    text = (DOCS / page).read_text() if isinstance(page, str) else page.read_text()
    for block in re.findall(r"```python\n(.*?)```", text, flags=re.S):
        name = re.match(r"# (\w+\.py)\n", block)
        if name:
            (folder / name.group(1)).write_text(block)
    config = folder / "run.yaml"
    config.write_text(re.search(r"```yaml\n(.*?)```", text, re.S).group(1))
    return config
