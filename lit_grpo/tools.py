"""Tools the policy may call during a rollout: loading them, describing them, parsing calls, running them.

A tool is a plain Python function with type hints and a Google-style docstring (``Args:``), as
``transformers`` expects for ``apply_chat_template(tools=...)``: :func:`tool_schema` turns it into
the JSON schema the chat template shows the model. ``model.tools`` names them as rewards are named
(``package.module:function`` or ``path/to/file.py:function``); an environment's public methods are
tools too (:mod:`lit_grpo.environments`).

The model's tool calls are read from its text by :func:`parse_tool_calls`: with the tokenizer's own
response parser where the tokenizer defines one (``tokenizer.parse_response``), else with the
``hermes`` format that Qwen2.5, Qwen3, Hermes and many others are trained on::

    <tool_call>
    {"name": "add", "arguments": {"a": 1, "b": 2}}
    </tool_call>

``model.tool_call_parser`` replaces it with any function ``parser(text) -> list[{"name", "arguments"}]``.

:func:`run_tool_calls` runs the calls of a turn concurrently in threads, each bounded by a
timeout; an unknown tool, bad arguments, an exception or a timeout becomes the tool's message
(``error: ...``) for the model to read, never an exception in the trainer.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import json
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from lit_grpo.errors import ConfigError

__all__ = [
    "ParsedTurn",
    "Tool",
    "ToolCall",
    "ToolResult",
    "make_tool",
    "parse_hermes",
    "parse_tool_calls",
    "run_tool_calls",
    "tool_schema",
]

HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_EXECUTOR = concurrent.futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="lit-grpo-tool")


@dataclass
class Tool:
    name: str
    function: Callable[..., Any]
    schema: dict  # {"type": "function", "function": {"name", "description", "parameters"}}


@dataclass
class ToolCall:
    name: str | None
    arguments: dict = field(default_factory=dict)
    error: str | None = None  # set when the call could not be read (then it is not run)

    def as_message_call(self) -> dict:
        """The call as an assistant message's ``tool_calls`` entry (the transformers convention)."""
        return {"type": "function", "function": {"name": self.name or "", "arguments": self.arguments}}


@dataclass
class ParsedTurn:
    content: str  # the text without the tool calls
    tool_calls: list[ToolCall]


@dataclass
class ToolResult:
    name: str
    content: str
    failed: bool
    seconds: float


def tool_schema(function: Callable, where: str) -> dict:
    """The JSON schema ``apply_chat_template(tools=...)`` renders, from type hints and docstring."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(function)
    except Exception as error:  # transformers' DocstringParsingException / TypeHintParsingException
        raise ConfigError(
            f"{where}: {getattr(function, '__name__', function)!r} cannot be shown to the model as a tool: {error} "
            "(a tool needs a type hint on every argument and a docstring with an 'Args:' section describing each)"
        ) from None


def make_tool(function: Callable, where: str, name: str | None = None) -> Tool:
    if not callable(function):
        raise ConfigError(f"{where}: {function!r} is not a function")
    schema = tool_schema(function, where)
    name = name or schema["function"]["name"]
    schema["function"]["name"] = name
    return Tool(name=name, function=function, schema=schema)


# ----------------------------------------------------------------------------------------------
# Parsing the model's calls
# ----------------------------------------------------------------------------------------------


def _call_from_dict(raw: Any) -> ToolCall:
    if isinstance(raw, dict) and "function" in raw and isinstance(raw["function"], dict):
        raw = raw["function"]  # {"type": "function", "function": {...}}
    if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
        return ToolCall(None, error=f"a tool call needs a JSON object with a 'name' string, got {json.dumps(raw)[:200]}")
    arguments = raw.get("arguments", raw.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as error:
            return ToolCall(raw["name"], error=f"the arguments of {raw['name']!r} are not JSON: {error}")
    if not isinstance(arguments, dict):
        return ToolCall(raw["name"], error=f"the arguments of {raw['name']!r} must be a JSON object, got {json.dumps(arguments)[:200]}")
    return ToolCall(raw["name"], arguments)


def parse_hermes(text: str) -> ParsedTurn:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Qwen2.5, Qwen3, Hermes)."""
    calls = []
    for match in HERMES_CALL.finditer(text):
        body = match.group(1)
        if not match.group(0).rstrip().endswith("</tool_call>"):
            calls.append(ToolCall(None, error="a <tool_call> without its closing </tool_call>"))
            continue
        try:
            calls.append(_call_from_dict(json.loads(body)))
        except json.JSONDecodeError as error:
            calls.append(ToolCall(None, error=f"the tool call is not JSON ({error}): {body[:200]}"))
    content = HERMES_CALL.sub("", text).strip()
    return ParsedTurn(content, calls)


def parse_tool_calls(text: str, tokenizer=None, parser: Callable[[str], list] | None = None,
                     tools: Sequence[dict] | None = None) -> ParsedTurn:
    """The content and tool calls of one assistant turn (special tokens already removed from ``text``).

    ``parser`` (``model.tool_call_parser``) wins; else the tokenizer's response parser where it has
    one; else :func:`parse_hermes`. A call that cannot be read comes back with ``error`` set.
    """
    if parser is not None:
        try:
            raw_calls = parser(text)
        except Exception as error:  # noqa: BLE001 - told to the model, as a failed call
            return ParsedTurn(text, [ToolCall(None, error=f"the tool call could not be parsed: {error}")])
        if isinstance(raw_calls, ParsedTurn):
            return raw_calls
        return ParsedTurn(text, [_call_from_dict(raw) for raw in raw_calls or []])
    has_response_parser = tokenizer is not None and (
        getattr(tokenizer, "response_template", None) or getattr(tokenizer, "response_schema", None)
    )
    if has_response_parser:
        try:
            message = tokenizer.parse_response(text, tools=list(tools) if tools else None)
        except Exception as error:  # noqa: BLE001
            return ParsedTurn(text, [ToolCall(None, error=f"the tool call could not be parsed: {error}")])
        return ParsedTurn(message.get("content") or "", [_call_from_dict(call) for call in message.get("tool_calls") or []])
    return parse_hermes(text)


# ----------------------------------------------------------------------------------------------
# Running them
# ----------------------------------------------------------------------------------------------


def _call(function: Callable, arguments: dict, timeout: float | None) -> Any:
    if inspect.iscoroutinefunction(function):
        return asyncio.run(asyncio.wait_for(function(**arguments), timeout))
    return function(**arguments)


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, default=str)
    except (TypeError, ValueError):
        return str(value)


def _argument_problem(function: Callable, arguments: dict) -> str | None:
    try:
        inspect.signature(function).bind(**arguments)
    except TypeError as error:
        return str(error)
    except ValueError:  # no signature (a builtin): let the call decide
        return None
    return None


def run_tool_calls(calls: Sequence[tuple[ToolCall, dict[str, Tool]]], timeout: float | None) -> list[ToolResult]:
    """Run each ``(call, tools by name)`` concurrently; one :class:`ToolResult` per call, in order."""
    started: list[tuple[ToolCall, concurrent.futures.Future | None, str | None, float]] = []
    for call, tools in calls:
        problem = call.error
        if problem is None and call.name not in tools:
            problem = f"no tool named {call.name!r}; the tools are: {', '.join(sorted(tools)) or 'none'}"
        if problem is None:
            problem = _argument_problem(tools[call.name].function, call.arguments)
            if problem is not None:
                problem = f"{call.name}: {problem}"
        future = None if problem else _EXECUTOR.submit(_call, tools[call.name].function, call.arguments, timeout)
        started.append((call, future, problem, time.perf_counter()))
    results = []
    for call, future, problem, start in started:
        name = call.name or "unknown"
        if future is None:
            results.append(ToolResult(name, f"error: {problem}", True, 0.0))
            continue
        remaining = None if timeout is None else max(0.0, timeout - (time.perf_counter() - start))
        try:
            value = future.result(timeout=remaining)
            results.append(ToolResult(name, _as_text(value), False, time.perf_counter() - start))
        except (concurrent.futures.TimeoutError, asyncio.TimeoutError):
            future.cancel()  # a running thread cannot be stopped; its result is ignored
            results.append(ToolResult(name, f"error: {name} timed out after {timeout:g} s", True, time.perf_counter() - start))
        except Exception as error:  # noqa: BLE001 - the model reads what went wrong
            results.append(ToolResult(name, f"error: {type(error).__name__}: {error}", True, time.perf_counter() - start))
    return results
