"""Tools the policy may call during a rollout: loading them, describing them, parsing calls, running them.

A tool is a plain Python function with type hints and a Google-style docstring (``Args:``), as
``transformers`` expects for ``apply_chat_template(tools=...)``: :func:`tool_schema` turns it into
the JSON schema the chat template shows the model. ``model.tools`` names them as rewards are named
(``package.module:function`` or ``path/to/file.py:function``); an environment's public methods are
tools too (:mod:`lit_grpo.rollout.tools.environments`).

The model's tool calls are read from the tokens of its turn by :func:`parse_tool_calls` (special
tokens included, so formats whose call markers are special tokens are read too): with the
tokenizer's own response parser where the tokenizer defines one (``tokenizer.parse_response``), else
with the format its chat template writes (:func:`default_parser`), named as vLLM names its tool
parsers:

* ``hermes`` (Qwen2.5, Qwen3, Hermes and many others)::

    <tool_call>
    {"name": "add", "arguments": {"a": 1, "b": 2}}
    </tool_call>

* ``llama3_json`` (Llama 3.1-3.3): the turn is ``{"name": "add", "parameters": {"a": 1, "b": 2}}``,
  after an optional ``<|python_tag|>``, several calls separated by ``;``;
* ``mistral``: ``[TOOL_CALLS] [{"name": "add", "arguments": {...}}, ...]`` (v0.3 tokenizers) or
  ``[TOOL_CALLS]add[ARGS]{...}`` (later ones).

``model.tool_call_parser`` replaces it with one of these names or any function
``parser(text) -> list[{"name", "arguments"}]``.

:func:`run_tool_calls` runs the calls of a turn concurrently, each in a daemon thread of its own
and bounded by a timeout; an unknown tool, bad arguments, an exception or a timeout becomes the
tool's message (``error: ...``) for the model to read, never an exception in the trainer. A call
past its timeout is abandoned: a thread cannot be killed, but it holds no worker another call
needs, and as a daemon it does not keep the process alive when training ends.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import json
import re
import threading
import time
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from lit_grpo.errors import ConfigError

__all__ = [
    "TOOL_CALL_PARSERS",
    "ParsedTurn",
    "Tool",
    "ToolCall",
    "ToolResult",
    "default_parser",
    "make_tool",
    "parse_hermes",
    "parse_llama3_json",
    "parse_mistral",
    "parse_tool_calls",
    "run_tool_calls",
    "tool_schema",
]

# tool calls running at once, each in a thread of its own (thousands of rows' calls would exhaust the
# threads a process may start); the others wait their turn, in order
MAX_CONCURRENT_TOOL_CALLS = 64
HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
# timed-out calls whose threads still run (a thread cannot be stopped); warned about past this many
_ABANDONED: weakref.WeakSet = weakref.WeakSet()
ABANDONED_WARNING = 32


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
    id: str = "call00000"  # the tool message answering it names it (9 alphanumerics: Mistral's templates check)

    def as_message_call(self) -> dict:
        """The call as an assistant message's ``tool_calls`` entry (the transformers convention)."""
        return {"type": "function", "id": self.id, "function": {"name": self.name or "", "arguments": self.arguments}}


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


def parse_llama3_json(text: str) -> ParsedTurn:
    """Llama 3.1-3.3's JSON calls: the whole turn is ``{"name": ..., "parameters": {...}}`` (after an
    optional ``<|python_tag|>``), several separated by ``;``. A turn that does not start with ``{`` is
    an answer; one that does, but is not a call, is an answer too unless it names a function."""
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return ParsedTurn(text.strip(), [])
    calls = []
    for part in (piece.strip() for piece in body.split(";")):
        if not part:
            continue
        try:
            calls.append(_call_from_dict(json.loads(part)))
        except json.JSONDecodeError as error:
            if '"name"' not in part:
                return ParsedTurn(text.strip(), [])  # JSON-looking prose, not a call
            calls.append(ToolCall(None, error=f"the tool call is not JSON ({error}): {part[:200]}"))
    return ParsedTurn("", calls)


MISTRAL_CALLS = "[TOOL_CALLS]"
MISTRAL_NAMED_CALL = re.compile(r"\s*([\w.-]+)\[ARGS\]")


def parse_mistral(text: str) -> ParsedTurn:
    """Mistral's ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`` (v0.3 tokenizers) or
    ``[TOOL_CALLS]name[ARGS]{...}`` (one block per call, later tokenizers)."""
    content, marker, rest = text.partition(MISTRAL_CALLS)
    if not marker:
        return ParsedTurn(text.strip(), [])
    calls = []
    for block in rest.split(MISTRAL_CALLS):
        named = MISTRAL_NAMED_CALL.match(block)
        try:
            if named:
                arguments, _ = json.JSONDecoder().raw_decode(block[named.end():].lstrip())
                calls.append(_call_from_dict({"name": named.group(1), "arguments": arguments}))
            else:
                raw, _ = json.JSONDecoder().raw_decode(block.lstrip())
                calls += [_call_from_dict(item) for item in (raw if isinstance(raw, list) else [raw])]
        except json.JSONDecodeError as error:
            calls.append(ToolCall(None, error=f"the tool call is not JSON ({error}): {block.strip()[:200]}"))
    return ParsedTurn(content.strip(), calls)


# model.tool_call_parser names that need no import (vLLM's names for the same formats)
TOOL_CALL_PARSERS: dict[str, Callable[[str], ParsedTurn]] = {
    "hermes": parse_hermes,
    "llama3_json": parse_llama3_json,
    "mistral": parse_mistral,
}


def default_parser(chat_template: str | None) -> str:
    """The call format a chat template writes (its assistant turns with ``tool_calls``): ``mistral``
    for ``[TOOL_CALLS]``, ``hermes`` for ``<tool_call>``, ``llama3_json`` for Llama 3.1's
    ``"parameters"`` objects, else ``hermes``."""
    template = chat_template or ""
    if MISTRAL_CALLS in template:
        return "mistral"
    if "<tool_call>" in template:
        return "hermes"
    if '"parameters": ' in template and "ipython" in template:
        return "llama3_json"
    return "hermes"


def special_token_texts(tokenizer) -> list[str]:
    """The texts of the tokenizer's special tokens, longest first."""
    texts = set(getattr(tokenizer, "all_special_tokens", []) or [])
    texts |= {token.content for token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values() if token.special}
    return sorted((text for text in texts if text), key=len, reverse=True)


def _without_special_tokens(text: str, specials: Sequence[str]) -> str:
    for special in specials:
        text = text.replace(special, "")
    return text.strip()


def parse_tool_calls(token_ids: Sequence[int], tokenizer, parser: Callable[[str], Any] | None = None,
                     tools: Sequence[dict] | None = None, prefix_ids: Sequence[int] | None = None,
                     stop_token_ids: Sequence[int] = ()) -> ParsedTurn:
    """The content and tool calls of one finished assistant turn, from its tokens (``token_ids``, up
    to the stop token it ended with; ``prefix_ids``: the context it continued).

    Calls are read from the text *with* special tokens (the stop token at the end left out), so
    formats whose markers are special tokens are found: ``parser`` (``model.tool_call_parser``)
    wins; else the tokenizer's response parser where it has one; else the format of its chat
    template (:func:`default_parser`). A call that cannot be read comes back with ``error`` set. The
    content has the special tokens removed, as rewards read it.
    """
    ids = list(token_ids)
    body = ids[:-1] if ids and ids[-1] in set(stop_token_ids) else ids
    text = tokenizer.decode(body, skip_special_tokens=False)
    specials = special_token_texts(tokenizer)
    plain = tokenizer.decode(body, skip_special_tokens=True).strip()
    if parser is None and getattr(tokenizer, "response_template", None) is not None:
        return _parse_with_response_template(tokenizer, ids, prefix_ids or [], tools, plain, specials)
    if parser is None and getattr(tokenizer, "response_schema", None) is not None:  # transformers < 5.13
        parser = lambda turn: tokenizer.parse_response(turn)  # noqa: E731
    if parser is None:
        parser = TOOL_CALL_PARSERS[default_parser(tokenizer.chat_template)]
    try:
        parsed = parser(text)
    except Exception as error:  # noqa: BLE001 - told to the model, as a failed call
        return ParsedTurn(plain, [ToolCall(None, error=f"the tool call could not be parsed: {error}")])
    if isinstance(parsed, dict):  # a response parser's message
        parsed = ParsedTurn(parsed.get("content") or "", [_call_from_dict(call) for call in parsed.get("tool_calls") or []])
    elif not isinstance(parsed, ParsedTurn):  # a configured parser's list of calls
        parsed = ParsedTurn(text, [_call_from_dict(raw) for raw in parsed or []])
    if not parsed.tool_calls:
        return ParsedTurn(plain, [])
    return ParsedTurn(_without_special_tokens(parsed.content, specials), parsed.tool_calls)


def _parse_with_response_template(tokenizer, ids: list[int], prefix_ids: Sequence[int], tools, plain: str,
                                  specials: Sequence[str]) -> ParsedTurn:
    """``tokenizer.parse_response`` with the tokenizer's ``response_template`` (transformers >= 5.13)."""
    try:
        message = tokenizer.parse_response(ids, prefix=list(prefix_ids), tools=list(tools) if tools else None)
    except Exception as error:  # noqa: BLE001 - told to the model, as a failed call
        return ParsedTurn(plain, [ToolCall(None, error=f"the tool call could not be parsed: {error}")])
    calls = [_call_from_dict(call) for call in (message or {}).get("tool_calls") or []]
    if not calls:
        return ParsedTurn(plain, [])
    return ParsedTurn(_without_special_tokens((message or {}).get("content") or "", specials), calls)


# ----------------------------------------------------------------------------------------------
# Running them
# ----------------------------------------------------------------------------------------------


def _call(function: Callable, arguments: dict, timeout: float | None) -> Any:
    if inspect.iscoroutinefunction(function):
        return asyncio.run(asyncio.wait_for(function(**arguments), timeout))
    return function(**arguments)


def _start(name: str, function: Callable, arguments: dict, timeout: float | None) -> tuple[concurrent.futures.Future, threading.Thread]:
    """Run one call in a daemon thread of its own: a call that never returns holds no shared
    worker, and does not keep the interpreter from exiting."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(_call(function, arguments, timeout))
        except Exception as error:  # noqa: BLE001 - the model reads what went wrong
            future.set_exception(error)
        except BaseException as error:  # noqa: BLE001 - a tool's sys.exit() must not end the training run
            future.set_exception(_Escaped(error))

    thread = threading.Thread(target=run, name=f"lit-grpo-tool-{name}", daemon=True)
    thread.start()
    return future, thread


class _Escaped(Exception):
    """A ``SystemExit`` or other ``BaseException`` a tool raised, carried to the trainer as a failure."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


def _abandon(thread: threading.Thread, name: str, timeout: float) -> None:
    _ABANDONED.add(thread)
    running = sum(1 for abandoned in list(_ABANDONED) if abandoned.is_alive())
    if running >= ABANDONED_WARNING and not getattr(_abandon, "warned", False):
        _abandon.warned = True
        warnings.warn(
            f"{running} tool calls that passed model.tool_timeout ({timeout:g} s) are still running in background "
            f"threads (the last: {name!r}); a thread cannot be stopped, so a tool that hangs keeps what it holds. "
            "Make the tool return, or give it a timeout of its own",
            stacklevel=3,
        )


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


def _call_problem(call: ToolCall, tools: dict[str, Tool]) -> str | None:
    """Why ``call`` cannot run (unparsed, an unknown tool, arguments its signature refuses), or None."""
    if call.error is not None:
        return call.error
    if call.name not in tools:
        return f"no tool named {call.name!r}; the tools are: {', '.join(sorted(tools)) or 'none'}"
    problem = _argument_problem(tools[call.name].function, call.arguments)
    return None if problem is None else f"{call.name}: {problem}"


def _finished(name: str, future: concurrent.futures.Future, seconds: float, timeout: float | None) -> ToolResult:
    try:
        return ToolResult(name, _as_text(future.result()), False, seconds)
    except (concurrent.futures.TimeoutError, asyncio.TimeoutError):  # a coroutine's own wait_for
        return ToolResult(name, f"error: {name} timed out after {timeout:g} s", True, seconds)
    except Exception as error:  # noqa: BLE001 - the model reads what went wrong
        kind = type(error.error if isinstance(error, _Escaped) else error).__name__
        return ToolResult(name, f"error: {kind}: {error}", True, seconds)


def run_tool_calls(calls: Sequence[tuple[ToolCall, dict[str, Tool]]], timeout: float | None) -> list[ToolResult]:
    """Run each ``(call, tools by name)`` concurrently, at most :data:`MAX_CONCURRENT_TOOL_CALLS` at a
    time in the order given (each call's timeout counted from its own start; a call past it is abandoned
    and frees its place); one :class:`ToolResult` per call, in order."""
    results: list[ToolResult | None] = [None] * len(calls)
    waiting: deque[int] = deque()
    for index, (call, tools) in enumerate(calls):
        problem = _call_problem(call, tools)
        if problem is None:
            waiting.append(index)
        else:
            results[index] = ToolResult(call.name or "unknown", f"error: {problem}", True, 0.0)
    running: dict[concurrent.futures.Future, tuple[int, threading.Thread, float]] = {}  # future -> (index, thread, start)
    while waiting or running:
        while waiting and len(running) < MAX_CONCURRENT_TOOL_CALLS:
            index = waiting.popleft()
            call, tools = calls[index]
            future, thread = _start(call.name, tools[call.name].function, call.arguments, timeout)
            running[future] = (index, thread, time.perf_counter())
        first_deadline = None if timeout is None else min(start for _, _, start in running.values()) + timeout
        concurrent.futures.wait(running, timeout=None if first_deadline is None else max(0.0, first_deadline - time.perf_counter()),
                                return_when=concurrent.futures.FIRST_COMPLETED)
        now = time.perf_counter()
        for future, (index, thread, start) in list(running.items()):
            name = calls[index][0].name
            if future.done():
                results[index] = _finished(name, future, now - start, timeout)
            elif timeout is not None and now - start >= timeout:
                _abandon(thread, name, timeout)
                results[index] = ToolResult(name, f"error: {name} timed out after {timeout:g} s", True, now - start)
            else:
                continue
            del running[future]
    return results
