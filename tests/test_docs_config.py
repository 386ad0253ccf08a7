"""docs/config.md's tables list exactly the fields of the config classes they name, with
their defaults: the reference cannot drift from the schema."""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

import pytest
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

PAGE = Path(__file__).resolve().parents[1] / "docs" / "config.md"
CLASS_LINE = re.compile(r"^`(\w+)` in `src/ludic/run/(config\w*)\.py`")


def _tables() -> dict[str, tuple[str, dict[str, str]]]:
    """Class name -> (module, {field: default cell}) for each table under a class line."""
    tables: dict[str, tuple[str, dict[str, str]]] = {}
    current = None
    for line in PAGE.read_text().splitlines():
        match = CLASS_LINE.match(line)
        if match:
            current = match.group(1)
            tables[current] = (f"ludic.run.{match.group(2)}", {})
        elif current and line.startswith("| `"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            tables[current][1][cells[0].strip("`")] = cells[2]
        elif current and tables[current][1] and not line.startswith("|"):
            current = None
    return tables


def _documented_fields(cls: type[BaseModel], documented: set[str]) -> set[str]:
    """``cls``'s fields, less those it inherits from another class the page documents."""
    inherited: set[str] = set()
    for base in cls.__mro__[1:]:
        if isinstance(base, type) and base.__name__ in documented:
            inherited |= set(base.model_fields)
    return set(cls.model_fields) - inherited


def _cell(default: object) -> str:
    if isinstance(default, str):
        return f'"{default}"'
    if isinstance(default, tuple):
        default = list(default)
    return f"{json.dumps(default)}"


TABLES = _tables()


def test_the_page_documents_the_config_classes() -> None:
    assert {"RunConfig", "TrainerSection", "RewardModelSection", "VLLMConfig"} <= set(TABLES)


@pytest.mark.parametrize("name", sorted(TABLES))
def test_a_table_lists_its_class_fields_with_their_defaults(name: str) -> None:
    module, rows = TABLES[name]
    cls = getattr(importlib.import_module(module), name)
    assert set(rows) == _documented_fields(cls, set(TABLES)), f"docs/config.md, {name}"
    for field, cell in rows.items():
        default = cls.model_fields[field].default
        if default is PydanticUndefined:  # required, or a default_factory
            continue
        if isinstance(default, BaseModel) or "[" in cell or default is None and cell != "`null`":
            continue  # a nested section (linked), or a null explained in prose
        shown = cell.strip("`")
        if isinstance(default, float | int) and not isinstance(default, bool):
            assert float(shown) == pytest.approx(default), f"{name}.{field}: {cell}"
        else:
            assert shown == _cell(default), f"{name}.{field}: {cell} != {_cell(default)}"
