"""Load a run config from YAML or TOML, apply ``dotted.key=value`` overrides, validate.

Every failure raises :class:`ConfigError` whose message is one line naming the field and
the problem, e.g. ``trainer.lrr: unknown field (did you mean 'lr'?)``.
"""

from __future__ import annotations

import difflib
import re
import tomllib
from collections.abc import Hashable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from ludic.run.config import PRESET_FIELDS, RunConfig


class ConfigError(ValueError):
    """A config that cannot be used; the message names the field and the fix."""


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> RunConfig:
    """Read ``path`` (``.yaml``/``.yml``/``.toml``; ``None`` = all defaults), apply
    ``overrides`` in order, and validate."""
    data = read_config_file(path) if path is not None else {}
    for override in overrides:
        apply_override(data, override)
    return validate_config(data)


def read_config_file(path: str | Path) -> dict[str, Any]:
    file = Path(path)
    if file.is_dir():
        raise ConfigError(
            f"config file {str(file)!r} is a directory; give the path of a .yaml, .yml or "
            ".toml file"
        )
    if not file.is_file():
        raise ConfigError(f"config file {str(file)!r} does not exist")
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"config file {file.name!r} is not UTF-8 text (byte {e.object[e.start]:#04x} at "
            f"offset {e.start}); save it as UTF-8"
        ) from None
    try:
        if file.suffix == ".toml":
            data = tomllib.loads(text)
        elif file.suffix in (".yaml", ".yml"):
            data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
        else:
            raise ConfigError(f"config file {file.name!r}: use a .yaml, .yml or .toml file")
    except (yaml.YAMLError, tomllib.TOMLDecodeError) as e:
        first_line = str(e).strip().splitlines()[0]
        raise ConfigError(f"config file {file.name!r} is not valid: {first_line}") from None
    if data is None or data == {}:
        raise ConfigError(
            f"config file {str(file)!r} is empty; use `ludic demo` for the default run, or "
            "write at least one section (e.g. env:, trainer:)"
        )
    if not isinstance(data, dict):
        raise ConfigError(f"config file {file.name!r}: expected a mapping at the top level")
    return data


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a mapping with the same key twice (plain YAML
    keeps the last value silently, so a typo'd duplicate would hide a setting)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, Hashable):
                continue  # SafeLoader reports unhashable keys itself
            line = key_node.start_mark.line + 1
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"duplicate key {key!r} on line {line} (first on line {seen[key]}); "
                    "keep one of them",
                    key_node.start_mark,
                )
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def parse_value(text: str) -> Any:
    """Override values: numbers (``1e-5`` included), booleans, null, lists and mappings
    in YAML flow style; anything else is a string."""
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_override(data: dict[str, Any], override: str) -> None:
    """Set ``a.b.c=value`` in the nested dict ``data`` (creating mappings on the way)."""
    key, sep, value = override.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {override!r}: expected dotted.key=value, e.g. trainer.lr=1e-5")
    parts = key.strip().split(".")
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            where = ".".join(parts[: i + 1])
            raise ConfigError(f"override {override!r}: {where} is a value, not a section")
        node = child
    node[parts[-1]] = parse_value(value)


def validate_config(data: Mapping[str, Any]) -> RunConfig:
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError("; ".join(_describe(err) for err in e.errors())) from None


def _describe(err: Mapping[str, Any]) -> str:
    loc = [str(p) for p in err["loc"]]
    where = ".".join(loc) or "config"
    if err["type"] == "extra_forbidden":
        hint = _close_field(loc)
        return f"{where}: unknown field{hint}"
    message = err["msg"].removeprefix("Value error, ")
    field = re.match(r"(\w+)=\S+ is invalid", message)
    if field and field.group(1) in _section_fields(
        loc
    ):  # "trainer: lr=-1 ..." -> "trainer.lr=-1 ..."
        return f"{where}.{message}"
    if err["type"] in ("missing",):
        return f"{where}: required"
    got = err.get("input")
    shown = "" if isinstance(got, dict | list) or got is None else f" (got {got!r})"
    return f"{where}: {message}{shown}"


def _section_fields(loc: list[str]) -> list[str]:
    """The field names of the section at ``loc`` ([] when ``loc`` is not a section)."""
    model: type[BaseModel] = RunConfig
    for part in loc:
        field = model.model_fields.get(part)
        annotation = getattr(field, "annotation", None)
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return list(model.model_fields)


def _close_field(loc: list[str]) -> str:
    """' (did you mean ...?)' for an unknown field, from the schema's field names."""
    fields = _section_fields(loc[:-1])
    if not fields:
        return ""
    close = difflib.get_close_matches(loc[-1], fields, n=1)
    return f" (did you mean {close[0]!r}?)" if close else f"; fields: {sorted(fields)}"


def dump_config(config: RunConfig) -> str:
    """The resolved config as YAML (what the run directory stores). Loading it gives the
    same config back: the algorithm fields that go to the preset only when written
    (``PRESET_FIELDS``) are left out unless they were written, so the saved file can be
    given as CONFIG (``ludic train``'s pipeline mode starts its processes that way)."""
    data = config.model_dump(mode="json")
    unset = set(PRESET_FIELDS) - config.algorithm.model_fields_set
    data["algorithm"] = {k: v for k, v in data["algorithm"].items() if k not in unset}
    return yaml.safe_dump(data, sort_keys=False)
