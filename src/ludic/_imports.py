"""Loading user code named in a config: ``package.module:attr`` or ``path/to/file.py:attr``.

:func:`load_object` is the one loader behind every config field that names code (env
kinds, parsers, algorithms, credit assigners, reward functions and managers, tools); the
registries of built-in names sit on top of it in :mod:`ludic.run.registries`. Errors are
``ValueError`` (``FileNotFoundError`` for a missing file) whose message starts with the
field and the value, then says what is wrong.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
import traceback
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

SPEC_FORMS = "package.module:attr or path/to/file.py:attr"


def is_code_spec(value: str) -> bool:
    """Whether a config value names code (``target:attr``) rather than a built-in name."""
    return ":" in value


def split_spec(spec: str, *, field: str | None) -> tuple[str, str]:
    """``"a/b.py:fn"`` -> ``("a/b.py", "fn")``; a malformed value raises naming ``field``
    (None: the caller names it, as pydantic does)."""
    where = f"{field}: " if field else ""
    target, sep, attr = spec.rpartition(":")
    if not sep or not target.strip() or not attr.isidentifier():
        raise ValueError(f"{where}{spec!r} must look like {SPEC_FORMS}")
    if not target.endswith(".py") and not all(p.isidentifier() for p in target.split(".")):
        raise ValueError(
            f"{where}{spec!r}: {target!r} is neither a module path (package.module) nor a "
            f".py file; use {SPEC_FORMS}"
        )
    return target, attr


def absolute_spec(spec: str) -> str:
    """``spec`` with a relative ``.py`` file made absolute (from the current directory),
    so that a run directory's saved config names the same file from any directory."""
    target, sep, attr = spec.rpartition(":")
    return f"{absolute_target(target)}:{attr}" if sep else spec


def absolute_target(target: str) -> str:
    """A relative ``path/to/file.py`` made absolute; a module path unchanged."""
    if target.endswith(".py") and not Path(target).expanduser().is_absolute():
        return str(Path(target).expanduser().resolve())
    return target


def load_object(spec: str, *, field: str) -> Any:
    """The attribute ``spec`` names: ``package.module:attr`` (imported) or
    ``path/to/file.py:attr`` (the file run as a module once, its folder importable for
    its own sibling modules). Errors name ``field``, the file and what is wrong."""
    target, attr = split_spec(spec, field=field)
    module = import_module(target, field=field, spec=spec)
    if not hasattr(module, attr):
        raise ValueError(
            f"{field}: {spec!r}: {target} has no attribute {attr!r} (it defines {_defined(module)})"
        )
    return getattr(module, attr)


def load_function(spec: str, *, field: str) -> Callable[..., Any]:
    """The callable ``spec`` names (see :func:`load_object`)."""
    fn = load_object(spec, field=field)
    if not callable(fn):
        target, attr = split_spec(spec, field=field)
        shown = repr(fn) if len(repr(fn)) <= 60 else repr(fn)[:57] + "..."
        raise ValueError(
            f"{field}: {spec!r}: {attr} in {target} is not callable (a {type(fn).__name__}: "
            f"{shown}); name a function or a class"
        )
    return fn


def import_module(target: str, *, field: str, spec: str | None = None) -> Any:
    """The module ``target`` names: ``package.module`` (imported) or ``path/to/file.py``
    (run as a module once). Errors name ``field`` (and ``spec``, the config value); an
    exception raised while the file runs is reported with its line."""
    spec = spec or target
    if target.endswith(".py"):
        return _import_file(Path(target).expanduser(), field=field, spec=spec)
    try:
        return importlib.import_module(target)
    except ImportError as e:
        raise ValueError(f"{field}: {spec!r}: cannot import {target!r} ({e})") from None


def _import_file(path: Path, *, field: str, spec: str) -> Any:
    if not path.is_file():
        raise FileNotFoundError(f"{field}: {spec!r}: no file {str(path)!r}")
    path = path.resolve()
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:12]  # the same in every process
    module_name = f"ludic_user_{path.stem}_{digest}"
    module = sys.modules.get(module_name)
    if module is not None:
        return module
    loader_spec = importlib.util.spec_from_file_location(module_name, path)
    assert loader_spec is not None and loader_spec.loader is not None
    module = importlib.util.module_from_spec(loader_spec)
    if str(path.parent) not in sys.path:  # `import helpers` beside the file works
        sys.path.append(str(path.parent))
    sys.modules[module_name] = module
    try:
        loader_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[module_name]
        raise ValueError(f"{field}: {spec!r}: running {path.name} failed: {_where(e, path)}") from e
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


def _defined(module: Any, most: int = 12) -> list[str]:
    """The public names ``module`` defines itself (not those it imports)."""
    names = [
        name
        for name, value in vars(module).items()
        if not name.startswith("_")
        and not isinstance(value, types.ModuleType)
        and getattr(value, "__module__", module.__name__) == module.__name__
    ]
    return sorted(names)[:most]


def _where(error: Exception, path: Path) -> str:
    """``NameError: name 'x' is not defined (my_env.py, line 7)``."""
    if isinstance(error, SyntaxError) and error.lineno is not None:
        return f"SyntaxError: {error.msg} ({path.name}, line {error.lineno})"
    frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename == str(path)]
    line = f" ({path.name}, line {frames[-1].lineno})" if frames else ""
    return f"{type(error).__name__}: {error}{line}"
