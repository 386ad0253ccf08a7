"""tool_schema (signature + hints + docstring -> JSON schema) and call_tool error handling."""

from __future__ import annotations

import asyncio
import enum
import functools
from typing import Literal

import pytest

from ludic.agents.tools import Tool, as_tool, call_tool, tool_schema
from ludic.types import ToolCall


class Unit(enum.Enum):
    C = "celsius"
    F = "fahrenheit"


def weather(
    city: str,
    days: int = 1,
    unit: Unit = Unit.C,
    detail: Literal["low", "high"] = "low",
    tags: list[str] | None = None,
) -> str:
    """Get the forecast for a city.

    Args:
        city: the city name.
        days: how many days
            to forecast.
        unit: temperature unit.
        detail: level of detail.
        tags: optional labels.

    Returns:
        The forecast.
    """
    return f"{city}:{days}"


def test_tool_schema_maps_signature_hints_and_google_docstring() -> None:
    schema = tool_schema(weather)
    fn = schema["function"]
    assert schema["type"] == "function"
    assert fn["name"] == "weather"
    assert fn["description"] == "Get the forecast for a city."
    params = fn["parameters"]
    assert params["required"] == ["city"]
    assert params["properties"]["city"] == {"type": "string", "description": "the city name."}
    assert params["properties"]["days"] == {
        "type": "integer",
        "description": "how many days to forecast.",
        "default": 1,
    }
    assert params["properties"]["unit"]["enum"] == ["celsius", "fahrenheit"]
    assert params["properties"]["detail"]["enum"] == ["low", "high"]
    assert params["properties"]["tags"]["type"] == "array"
    assert params["properties"]["tags"]["items"] == {"type": "string"}


def test_tool_schema_reads_sphinx_params_and_untyped_parameters() -> None:
    def scale(x: float, factor):
        """Scale a number.

        :param x: the number.
        :param factor: the multiplier.
        """
        return x * factor

    props = tool_schema(scale)["function"]["parameters"]["properties"]
    assert props["x"] == {"type": "number", "description": "the number."}
    assert props["factor"] == {"description": "the multiplier."}


def test_tool_schema_rejects_var_args_and_unmappable_types() -> None:
    def varargs(*xs: int) -> int:
        return sum(xs)

    def odd(x: complex) -> None:
        return None

    with pytest.raises(ValueError, match=r"takes \*xs"):
        tool_schema(varargs)
    with pytest.raises(TypeError, match=r"odd\(x\) is annotated"):
        tool_schema(odd)


def test_as_tool_requires_a_function_for_internal_tools() -> None:
    assert as_tool("delegate", internal=False).name == "delegate"
    with pytest.raises(ValueError, match="list it under external_tools"):
        as_tool("delegate", internal=True)
    schema = {"type": "function", "function": {"name": "search", "parameters": {}}}
    assert as_tool(schema, internal=False) == Tool(name="search", schema=schema)


def test_as_tool_on_an_unnamed_callable_names_the_tool_wrapper_fix() -> None:
    def scale(x: float, factor: float) -> float:
        return x * factor

    double = functools.partial(scale, factor=2.0)
    with pytest.raises(ValueError, match=r"no usable name.*Tool\(name=\.\.\., schema=tool_schema"):
        as_tool(double, internal=True)
    wrapped = Tool(name="double", schema=tool_schema(double, name="double"), fn=double)
    assert as_tool(wrapped, internal=True).name == "double"
    assert wrapped.schema["function"]["parameters"]["required"] == ["x"]
    assert _call(wrapped, "double", x=3.0).message["content"] == "6.0"


def _call(tool, name: str, **arguments):
    return asyncio.run(call_tool(tool, ToolCall("call_0", name, arguments), ["weather"]))


def test_call_tool_returns_a_tool_message_with_the_result() -> None:
    outcome = _call(as_tool(weather, internal=True), "weather", city="Oslo", days=2)
    assert outcome.error is None
    assert outcome.message == {
        "role": "tool",
        "tool_call_id": "call_0",
        "name": "weather",
        "content": "Oslo:2",
    }


def test_call_tool_turns_unknown_names_bad_arguments_and_exceptions_into_errors() -> None:
    def boom(x: int) -> int:
        raise ZeroDivisionError("no")

    unknown = _call(None, "nope")
    assert "unknown tool 'nope'; available tools: weather" in unknown.error
    assert unknown.message["content"].startswith("Error: unknown tool")
    assert "bad arguments for weather" in _call(as_tool(weather, internal=True), "weather").error
    assert (
        _call(as_tool(boom, internal=True), "boom", x=1).error
        == "boom raised ZeroDivisionError: no"
    )


def test_call_tool_awaits_async_tools_and_json_encodes_results() -> None:
    async def lookup(key: str) -> dict:
        return {"key": key, "n": 1}

    outcome = _call(as_tool(lookup, internal=True), "lookup", key="a")
    assert outcome.message["content"] == '{"key": "a", "n": 1}'
