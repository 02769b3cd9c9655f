"""Where things are in the ``--config`` files of a command line, so that messages name ``file:line``.

- :func:`config_files`: the files that ``--config FILE`` (``-c``, ``--config=FILE``) name, in order;
- :func:`find_key`: ``file:line`` of a dotted key (``model.num_generation``), or of a key inside
  its value (``wieght`` in ``model.rewards``: ``model.rewards[0].wieght``);
- :func:`find_syntax_error`: the first file that is not valid YAML, with the line of the mistake and
  the last key read before it;
- :func:`value_origin`: where the value of a key that counts was given, ``file:line`` or the command line;
- :func:`find_duplicate_key`: a key written twice in one mapping (YAML would keep the last silently).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import yaml

__all__ = ["COMMAND_LINE", "Located", "config_files", "find_duplicate_key", "find_key", "find_syntax_error", "value_origin"]

COMMAND_LINE = "command line"


@dataclass
class Located:
    """A key found in a config file: its full dotted path (list entries as ``[i]``) and ``file:line``."""

    key: str
    where: str


def config_files(args: list[str]) -> list[str]:
    """The config files of a command line, in the order given (a later one overrides an earlier)."""
    files = [args[i + 1] for i, word in enumerate(args[:-1]) if word in ("--config", "-c")]
    return files + [word.split("=", 1)[1] for word in args if word.startswith("--config=")]


def _compose(file: str) -> yaml.Node | None:
    try:
        return yaml.compose(Path(file).read_text())
    except (OSError, yaml.YAMLError):
        return None


def _entry(node: yaml.Node, name: str) -> tuple[yaml.Node, yaml.Node] | None:
    """``(key node, value node)`` of ``name`` in a mapping node."""
    entries = node.value if isinstance(node, yaml.MappingNode) else []
    return next(((k, v) for k, v in entries if getattr(k, "value", None) == name), None)


def _nodes_inside(node: yaml.Node, path: str) -> Iterator[tuple[str, yaml.Node]]:
    """``node`` and every node inside it, depth first, each with its dotted path (``model.rewards[0]``)."""
    yield path, node
    if isinstance(node, yaml.MappingNode):
        children = [(f"{path}.{k.value}", v) for k, v in node.value]
    elif isinstance(node, yaml.SequenceNode):
        children = [(f"{path}[{i}]", item) for i, item in enumerate(node.value)]
    else:
        children = []
    for child_path, child in children:
        yield from _nodes_inside(child, child_path)


def _find_inside(node: yaml.Node, name: str, path: str, value: str | None) -> tuple[str, int] | None:
    """The first key ``name`` anywhere inside ``node`` (whose value is ``value``, when given), depth
    first: its dotted path and line."""
    for mapping_path, mapping in _nodes_inside(node, path):
        if not isinstance(mapping, yaml.MappingNode):
            continue
        found = _entry(mapping, name)
        if found is not None and (value is None or getattr(found[1], "value", None) == value):
            return f"{mapping_path}.{name}", found[0].start_mark.line + 1
    return None


def find_key(files: list[str], key: str, inside: str | None = None, value: str | None = None) -> Located | None:
    """The dotted ``key`` in the last of ``files`` that sets it (the one that counts); with
    ``inside``, the first key of that name within ``key``'s value, whose value is ``value`` when
    given. None where no file has it (it came from the command line)."""
    for file in reversed(files):
        node = _compose(file)
        line = None
        for part in key.split("."):
            found = _entry(node, part)
            if found is None:
                break
            line, node = found[0].start_mark.line + 1, found[1]
        else:
            if inside is None:
                return Located(key, f"{file}:{line}")
            found = _find_inside(node, inside, key, value)
            if found is not None:
                return Located(found[0], f"{file}:{found[1]}")
    return None


def value_origin(args: list[str], key: str) -> str | None:
    """Where the value of the dotted ``key`` that counts comes from: the last of the command line's
    ``--config`` files and ``--key value`` / ``--key=value`` options (``--optimizer.lr`` for
    ``optimizer.init_args.lr``) that sets it, as ``file:line`` or :data:`COMMAND_LINE`; None if none does."""
    options = {f"--{key}", f"--{key.replace('.init_args.', '.')}"}
    origin = None
    for index, word in enumerate(args):
        if word.split("=", 1)[0] in options:
            origin = COMMAND_LINE
        elif word in ("--config", "-c") and index + 1 < len(args) or word.startswith("--config="):
            file = word.split("=", 1)[1] if word.startswith("--config=") else args[index + 1]
            found = find_key([file], key)
            origin = found.where if found else origin
    return origin


def find_duplicate_key(files: list[str]) -> str | None:
    """``"key model.beta is written twice ... (file:3 and file:7)"`` for the first of ``files`` in
    which one mapping has a key twice; None if none has."""
    for file in files:
        node = _compose(file)
        found = _duplicate_inside(node, "") if node is not None else None
        if found is not None:
            key, first, second = found
            return (f"key {key} is written twice in one mapping, at lines {first} and {second} ({file}:{first} and "
                    f"{file}:{second}); YAML would keep the second silently: remove one of them")
    return None


def _duplicate_inside(node: yaml.Node, path: str) -> tuple[str, int, int] | None:
    """The first key written twice in a mapping inside ``node``: its dotted path and both lines."""
    for mapping_path, mapping in _nodes_inside(node, path):
        if not isinstance(mapping, yaml.MappingNode):
            continue
        lines: dict[str, int] = {}
        for key, _ in mapping.value:
            name, line = getattr(key, "value", None), key.start_mark.line + 1
            if isinstance(name, str) and name != "<<":  # a merge key (<<: *base) may repeat
                if name in lines:
                    return f"{mapping_path}.{name}".lstrip("."), lines[name], line
                lines[name] = line
    return None


def find_syntax_error(files: list[str]) -> str | None:
    """``"<problem>, after key model.beta (file:line)"`` for the first of ``files`` that is not
    valid YAML; None if all are."""
    for file in files:
        try:
            text = Path(file).read_text()
            yaml.safe_load(text)
        except OSError:
            continue
        except yaml.MarkedYAMLError as error:
            mark = error.problem_mark or error.context_mark
            if mark is None:
                return f"invalid YAML: {' '.join(str(error).split())} ({file})"
            problem = f"{error.problem} at column {mark.column + 1}"
            if error.context and error.context_mark is not None:  # "while parsing a flow sequence"
                problem += f" ({error.context} that starts at line {error.context_mark.line + 1})"
            after = _last_key_before_error(text)
            return f"invalid YAML: {problem}" + (f", after key {after}" if after else "") + f" ({file}:{mark.line + 1})"
    return None


def _last_key_before_error(text: str) -> str:
    """The dotted path (``model.rewards[0].weight``) of the last key the YAML parser read in
    ``text`` before its syntax error, from the parser's events."""
    stack: list[list] = []  # one [kind, key or index, expects a key] per open mapping or sequence
    last = ""

    def value_read() -> None:  # a scalar, alias or whole collection was the current value
        if stack and stack[-1][0] == "map":
            stack[-1][2] = True

    def path() -> str:
        parts = [f".{k}" if kind == "map" else f"[{k}]" for kind, k, _ in stack if k is not None]
        return "".join(parts).lstrip(".")

    try:
        for event in yaml.parse(text):
            if stack and stack[-1][0] == "seq" and isinstance(event, yaml.NodeEvent):
                stack[-1][1] += 1  # the next item of a sequence
            if isinstance(event, yaml.ScalarEvent) and stack and stack[-1][0] == "map" and stack[-1][2]:
                stack[-1][1], stack[-1][2] = event.value, False
                last = path()
            elif isinstance(event, yaml.MappingStartEvent):
                stack.append(["map", None, True])
            elif isinstance(event, yaml.SequenceStartEvent):
                stack.append(["seq", -1, False])
            elif isinstance(event, yaml.CollectionEndEvent):
                stack.pop()
                value_read()
            elif isinstance(event, (yaml.ScalarEvent, yaml.AliasEvent)):
                value_read()
    except yaml.YAMLError:
        pass
    return last
