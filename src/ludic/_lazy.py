"""Lazy package exports: names resolve to their defining module on first access, so
importing a light module (e.g. ``ludic.types``) never pulls in torch-heavy ones."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    package: str, namespace: dict[str, Any], exports: Mapping[str, str]
) -> tuple[Callable[[str], Any], list[str]]:
    """Return ``(__getattr__, __all__)`` for ``package`` exporting ``name -> module``."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    return __getattr__, sorted(exports)
