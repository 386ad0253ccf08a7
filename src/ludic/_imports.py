"""Loading user code named in a config: ``package.module:function`` or
``path/to/file.py:function``."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def load_function(spec: str, *, field: str) -> Callable[..., Any]:
    """The callable ``spec`` names: ``package.module:function`` (imported) or
    ``path/to/file.py:function`` (the file run as a module). Errors name ``field``."""
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise ValueError(
            f"{field}: {spec!r} must look like package.module:function or path/to/file.py:function"
        )
    module = import_module(target, field=field, spec=spec)
    if not hasattr(module, attr):
        raise ValueError(f"{field}: {spec!r}: {target} has no function {attr!r}")
    fn = getattr(module, attr)
    if not callable(fn):
        shown = repr(fn) if len(repr(fn)) <= 60 else repr(fn)[:57] + "..."
        raise ValueError(
            f"{field}: {spec!r}: {attr} in {target} is not callable (a {type(fn).__name__}: "
            f"{shown}); name a function"
        )
    return fn


def import_module(target: str, *, field: str, spec: str | None = None) -> Any:
    """The module ``target`` names: ``package.module`` (imported) or ``path/to/file.py``
    (run as a module once). Errors name ``field`` (and ``spec``, the config value)."""
    spec = spec or target
    if target.endswith(".py"):
        path = Path(target).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"{field}: {spec!r}: no file {str(path)!r}")
        module_name = f"ludic_user_{path.stem}_{abs(hash(str(path.resolve())))}"
        module = sys.modules.get(module_name)
        if module is None:
            loader_spec = importlib.util.spec_from_file_location(module_name, path)
            assert loader_spec is not None and loader_spec.loader is not None
            module = importlib.util.module_from_spec(loader_spec)
            sys.modules[module_name] = module
            try:
                loader_spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[module_name]
                raise
        return module
    try:
        return importlib.import_module(target)
    except ImportError as e:
        raise ValueError(f"{field}: {spec!r}: cannot import {target!r} ({e})") from None
