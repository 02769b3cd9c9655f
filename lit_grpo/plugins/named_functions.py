"""Functions named by where they are, TRL users' habit for rewards and tools: ``package.module:function``
(imported) or ``path/to/file.py:function`` (loaded from that file, relative to the working directory).

- :func:`load_object`: the callable such a name points at; a mistake in the name (no such file, a
  module that cannot be imported, no such function) is an error that says what was meant: the file
  of a near-miss name, ``file.py:function`` for a module that is a file of the working directory;
- :func:`defining_files`: the ``.py`` files of the working directory that define a function, so that
  an unknown reward ``reward_len`` can be answered with ``my_rewards.py:reward_len``.

No heavy import here: the plugin registry loads this module.
"""

from __future__ import annotations

import ast
import difflib
import importlib
import os
import re
import sys
from importlib import util as importlib_util
from pathlib import Path
from typing import Any

from lit_grpo.errors import UserError

__all__ = ["FILE_FORM", "defining_files", "load_object"]

FILE_FORM = "a function of your own is named 'path/to/file.py:function'"


def load_object(name: str, what: str, error: type[Exception] = UserError) -> tuple[Any, str]:
    """The callable ``name`` points at, ``package.module:function`` (imported) or
    ``path/to/file.py:function`` (loaded from that file, relative to the working directory), and
    the module or file it came from. ``what`` (reward, tool, ...) names it in ``error``'s message."""
    where, _, function = name.rpartition(":")
    if not where or not function.isidentifier():
        raise error(
            f"{what} {name!r} names a function as 'package.module:function' or 'path/to/file.py:function'; "
            f"{function!r} is not a function name"
        )
    is_file = where.endswith(".py") or os.sep in where or "/" in where
    if is_file:
        path = os.path.abspath(os.path.expanduser(where))
        if not os.path.isfile(path):
            raise error(f"{what} {name!r}: no file {where!r} (looked for {path}){_closest_file(where)}")
        module_name = "lit_grpo_reward_file_" + re.sub(r"\W", "_", path)
        module = sys.modules.get(module_name)
        if module is None:
            spec = importlib_util.spec_from_file_location(module_name, path)
            module = importlib_util.module_from_spec(spec)
            sys.modules[module_name] = module  # so its functions pickle by reference in this process
            try:
                spec.loader.exec_module(module)
            except Exception as exc:
                del sys.modules[module_name]
                raise error(f"{what} {name!r}: running {path} raised {type(exc).__name__}: {exc}") from exc
        package = path
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as exc:
            raise error(f"{what} {name!r}: cannot import module {where!r} ({exc}){_module_is_a_file(where, function)}") from None
        package = where
    obj = getattr(module, function, None)
    if obj is None or not callable(obj):
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_") and getattr(v, "__module__", None) == module.__name__)
        close = difflib.get_close_matches(function, public, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        kind = "no function" if obj is None else "an attribute that is not callable:"
        raise error(f"{what} {name!r}: {where} has {kind} {function!r}; {hint}its functions: {', '.join(public) or 'none'}")
    return obj, package


def _closest_file(where: str) -> str:
    """``"; did you mean 'my_rewards.py'?"`` for the ``.py`` file beside the missing ``where`` whose name is closest."""
    folder = Path(where).expanduser().parent
    names = sorted(path.name for path in folder.glob("*.py")) if folder.is_dir() else []
    close = difflib.get_close_matches(Path(where).name, names, n=1)
    return f"; did you mean {str(folder / close[0]) if str(folder) != '.' else close[0]!r}?" if close else ""


def _module_is_a_file(module: str, function: str) -> str:
    """For a module ``a.b`` that could not be imported while ``a/b.py`` is in the working directory:
    the hint to name the function by its file."""
    file = Path(*module.split(".")).with_suffix(".py")
    if not file.is_file():
        return ""
    return (f"; {file} is in the working directory, which is not where modules are imported from (installed "
            f"packages, PYTHONPATH): name it '{file}:{function}'")


def defining_files(function: str, folder: Path | None = None, limit_bytes: int = 1 << 20) -> list[Path]:
    """The ``.py`` files of ``folder`` (the working directory) that define ``function`` (or a class of that
    name) at their top level, read without running them; files over ``limit_bytes`` are skipped."""
    folder = folder or Path.cwd()
    found = []
    for path in sorted(folder.glob("*.py")):
        try:
            if path.stat().st_size > limit_bytes:
                continue
            tree = ast.parse(path.read_bytes())
        except (OSError, SyntaxError, ValueError):
            continue
        defined = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
        if any(isinstance(node, defined) and node.name == function for node in tree.body):
            found.append(path.relative_to(folder))
    return found
