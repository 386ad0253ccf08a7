"""Filling a user's ``str.format`` template (a prompt, an observation, a judge's request)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def fill_template(name: str, template: str, fields: Mapping[str, Any], source: str) -> str:
    """``template.format(**fields)``; a placeholder ``fields`` lack raises ``ValueError``
    naming ``name`` (the setting), the placeholder, ``source`` (what the fields come from)
    and the fields there are."""
    try:
        return template.format(**fields)
    except (KeyError, IndexError) as e:
        raise ValueError(
            f"{name} {template!r} uses placeholder {e}, which {source} lacks (fields: "
            f"{sorted(fields)})"
        ) from None
