"""Tools for agents: JSON schemas from Python functions, and running one tool call.

A tool is a plain function with type hints and a docstring (its text, and an ``Args:``
section for the parameters): ``tool_schema(fn)`` gives the OpenAI function schema that chat
templates accept as ``tools``. ``call_tool`` runs a ``ToolCall`` and never raises for the
model's mistakes: an unknown name, bad arguments or an exception inside the tool become an
error message that goes back to the model as the tool's result.
"""

from __future__ import annotations

import enum
import functools
import inspect
import json
import re
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from ludic.types import Message, ToolCall

_SECTION = re.compile(r"^(Args|Arguments|Parameters|Returns?|Yields?|Raises|Examples?|Notes?):\s*$")
_ARG_LINE = re.compile(r"^(\*{0,2}\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")
_SPHINX_PARAM = re.compile(r"^:param\s+(?:\S+\s+)?(\w+)\s*:\s*(.*)$")


@dataclass(frozen=True)
class Tool:
    """A named tool: its JSON schema and, for internal tools, the function that runs it.

    ``fn is None`` marks a schema-only tool (an external tool the protocol handles).
    """

    name: str
    schema: dict[str, Any]
    fn: Callable[..., Any] | None = None


def tool_schema(
    fn: Callable[..., Any], *, name: str | None = None, description: str | None = None
) -> dict[str, Any]:
    """The OpenAI function schema of ``fn``: ``{"type": "function", "function": {...}}``.

    Parameter types come from type hints (``str``, ``int``, ``float``, ``bool``, ``None``,
    ``list[...]``/``tuple[...]``/``set[...]``, ``dict[...]``, ``Literal[...]``, ``Enum``
    subclasses, unions / ``Optional``; no hint means any type). Descriptions come from the
    docstring: its text before the first section is the tool's description, and a
    Google-style ``Args:`` section (or Sphinx ``:param x:`` lines) describes parameters.
    Parameters without a default are ``required``.
    """
    tool_name = name or getattr(fn, "__name__", None)
    if not tool_name or tool_name == "<lambda>":
        raise ValueError(f"tool_schema: {fn!r} has no usable name; pass name=... explicitly")
    sig = inspect.signature(fn)
    hints = typing.get_type_hints(_annotated_function(fn))
    summary, param_docs = _parse_docstring(inspect.getdoc(fn) or "")
    properties: dict[str, Any] = {}
    required: list[str] = []
    for p in sig.parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise ValueError(
                f"tool_schema: {tool_name}(...) takes *{p.name}; tools need named parameters "
                "so the model can be told their names and types"
            )
        prop = _json_schema(hints.get(p.name, Any), f"{tool_name}({p.name})")
        if p.name in param_docs:
            prop["description"] = param_docs[p.name]
        if p.default is p.empty:
            required.append(p.name)
        elif _is_json_value(p.default):
            prop["default"] = p.default
        properties[p.name] = prop
    return {
        "type": "function",
        "function": {
            "name": tool_name,
            "description": description if description is not None else summary,
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


def as_tool(spec: Tool | Callable[..., Any] | Mapping[str, Any] | str, *, internal: bool) -> Tool:
    """Normalise a tool spec: a ``Tool``, a function, an OpenAI schema dict or (external
    tools only) a bare name. Internal tools must be runnable (a function)."""
    if isinstance(spec, Tool):
        tool = spec
    elif isinstance(spec, str):
        schema = {
            "type": "function",
            "function": {
                "name": spec,
                "description": "",
                "parameters": {"type": "object", "properties": {}, "required": []},
            },
        }
        tool = Tool(name=spec, schema=schema)
    elif isinstance(spec, Mapping):
        fn_schema = spec.get("function", spec)
        if not isinstance(fn_schema, Mapping) or not isinstance(fn_schema.get("name"), str):
            raise ValueError(
                f"tool schema {dict(spec)!r} has no function name; expected "
                '{"type": "function", "function": {"name": ..., "parameters": {...}}}'
            )
        schema = dict(spec) if "function" in spec else {"type": "function", "function": dict(spec)}
        tool = Tool(name=fn_schema["name"], schema=schema)
    elif callable(spec):
        name = getattr(spec, "__name__", None)
        if not name or name == "<lambda>":
            raise ValueError(
                f"tool {spec!r} has no usable name (a lambda, functools.partial or callable "
                "object); wrap it as Tool(name=..., schema=tool_schema(fn, name=...), fn=fn)"
            )
        tool = Tool(name=name, schema=tool_schema(spec), fn=spec)
    else:
        raise TypeError(
            f"tool spec {spec!r} is a {type(spec).__name__}; expected a function, a Tool, "
            "an OpenAI function schema dict or (external tools) a name"
        )
    if internal and tool.fn is None:
        raise ValueError(
            f"internal tool {tool.name!r} has no function to run; pass the Python function "
            "(or a Tool with fn=...), or list it under external_tools"
        )
    return tool


@dataclass(frozen=True)
class ToolOutcome:
    """The ``tool`` message for one call, and the error text if the call failed."""

    message: Message
    error: str | None = None


async def call_tool(tool: Tool | None, call: ToolCall, available: list[str]) -> ToolOutcome:
    """Run ``call`` with ``tool`` (``None``: the name is unknown). Errors become the result.

    The message is ``{"role": "tool", "tool_call_id": call.id, "name": call.name,
    "content": ...}``; a non-string result is JSON-encoded. Coroutine functions are awaited.
    """
    error: str | None = None
    if tool is None or tool.fn is None:
        error = f"unknown tool {call.name!r}; available tools: {', '.join(available) or 'none'}"
    else:
        try:
            bound = inspect.signature(tool.fn).bind(**call.arguments)
        except TypeError as e:
            error = f"bad arguments for {call.name}: {e}; see the tool's parameters"
        else:
            try:
                result = tool.fn(*bound.args, **bound.kwargs)
                if inspect.isawaitable(result):
                    result = await result
            except Exception as e:  # the tool's failure is the model's observation
                error = f"{call.name} raised {type(e).__name__}: {e}"
    content = f"Error: {error}" if error is not None else _to_content(result)
    message = {"role": "tool", "tool_call_id": call.id, "name": call.name, "content": content}
    return ToolOutcome(message=message, error=error)


# ---- helpers --------------------------------------------------------------------------
def _annotated_function(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The function whose annotations describe ``fn``: the wrapped function of a
    ``functools.partial``, ``__call__`` of a callable object, else ``fn`` itself."""
    if isinstance(fn, functools.partial):
        return _annotated_function(fn.func)
    if inspect.isroutine(fn) or inspect.isclass(fn):
        return fn
    return type(fn).__call__


def _to_content(result: Any) -> str:
    if isinstance(result, str):
        return result
    try:
        return json.dumps(result)
    except (TypeError, ValueError):
        return str(result)


def _is_json_value(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def _json_schema(tp: Any, where: str) -> dict[str, Any]:
    if tp is Any:
        return {}
    if tp is None or tp is type(None):
        return {"type": "null"}
    simple = {str: "string", bool: "boolean", int: "integer", float: "number"}
    if tp in simple:
        return {"type": simple[tp]}
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return {"enum": [m.value for m in tp]}
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return {"enum": list(args)}
    if origin in (typing.Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:
            return _json_schema(options[0], where)
        return {"anyOf": [_json_schema(a, where) for a in args]}
    if tp in (list, tuple, set, frozenset) or origin in (list, tuple, set, frozenset):
        schema: dict[str, Any] = {"type": "array"}
        item_types = {a for a in args if a is not Ellipsis}
        if len(item_types) == 1:  # list[int], tuple[int, ...]; mixed tuples stay untyped
            schema["items"] = _json_schema(item_types.pop(), where)
        return schema
    if tp is dict or origin is dict:
        return {"type": "object"}
    raise TypeError(
        f"tool_schema: {where} is annotated {tp!r}, which has no JSON schema mapping; use "
        "str/int/float/bool/list/dict/Literal/Enum, or pass the schema dict yourself"
    )


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """``(description, {param: text})`` from a Google- or Sphinx-style docstring."""
    summary: list[str] = []
    params: dict[str, str] = {}
    section: str | None = None
    current: str | None = None
    arg_indent: int | None = None  # indent of "name: text" lines in the Args section
    for raw in doc.splitlines():
        line = raw.strip()
        if m := _SPHINX_PARAM.match(line):
            section, current = "sphinx", m.group(1)
            params[current] = m.group(2).strip()
        elif m := _SECTION.match(line):
            section, current = m.group(1), None
        elif section is None:
            summary.append(line)
        elif section in ("Args", "Arguments", "Parameters") and line:
            indent = len(raw) - len(raw.lstrip())
            arg = _ARG_LINE.match(line)
            if arg and (arg_indent is None or indent <= arg_indent):
                current = arg.group(1).lstrip("*")
                params[current] = arg.group(2).strip()
                arg_indent = indent
            elif current is not None:
                params[current] = f"{params[current]} {line}".strip()
        elif section == "sphinx" and line and current is not None and not line.startswith(":"):
            params[current] = f"{params[current]} {line}".strip()
    return " ".join(" ".join(summary).split()), params
