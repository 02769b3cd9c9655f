"""Which tests the judge runs apart: a test that may run the program's text as code (it names ``eval``,
``exec``, ``pickle``, ``getattr``, a module beyond the plain ones...) runs in a child process of the
judge that can decide its own verdict only (see :func:`judged_apart`)."""

import builtins
import sys

from .judge_imports import import_for_the_tests, may_import
from .judge_protocol import SAFE_DUNDERS
from .judge_values import PLAIN_OPERATIONS, REFLECTIVE_BUILTINS

#: module (a site-package's, ``os``, ``sys``, ``pickle``, ``importlib``...) is judged apart.
PLAIN_MODULES = frozenset({
    "__future__", "abc", "array", "ast", "base64", "binascii", "bisect", "calendar", "cmath", "collections",
    "collections.abc", "colorsys", "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal", "difflib",
    "enum", "errno", "fnmatch", "fractions", "functools", "graphlib", "hashlib", "heapq", "hmac", "html",
    "ipaddress", "itertools", "json", "keyword", "math", "numbers", "operator", "pprint", "queue", "random", "re",
    "reprlib", "secrets", "statistics", "string", "struct", "textwrap", "time", "typing", "unicodedata", "uuid",
    "zlib",
})
#: Functions of those modules that evaluate a text as code (string annotations).
_EVALUATING_MODULE_FUNCTIONS = frozenset({"get_type_hints", "ForwardRef"})
#: Builtins that compute on the values they are given (the exceptions besides); the others reach
#: attributes, namespaces or code by a name or a text (``getattr``, ``vars``, ``globals``, ``eval``,
#: ``__import__``), or files and descriptors (``open``).
SAFE_BUILTINS = frozenset({
    "abs", "all", "any", "ascii", "bin", "bool", "bytearray", "bytes", "callable", "chr", "classmethod",
    "complex", "dict", "dir", "divmod", "enumerate", "filter", "float", "format", "frozenset", "hasattr", "hash",
    "hex", "id", "int", "isinstance", "issubclass", "iter", "len", "list", "map", "max", "memoryview", "min",
    "next", "object", "oct", "ord", "pow", "print", "property", "range", "repr", "reversed", "round", "set",
    "slice", "sorted", "staticmethod", "str", "sum", "super", "tuple", "type", "zip", "True", "False", "None",
    "Ellipsis", "NotImplemented", "aiter", "anext",
}) | frozenset(name for name, value in vars(builtins).items()
                if isinstance(value, type) and issubclass(value, BaseException))
#: Dunder names and attributes a plain test may use (``if __name__ == "__main__":``,
#: ``super().__init__()``, ``type(x).__name__``, the program's task handed over by name).
_PLAIN_DUNDERS = SAFE_DUNDERS | {"__init__", "__class__", "__program_global__"}
#: Methods that evaluate a text or bytes as code, reached through an object rather than a module a
#: test names (a program's global or return value may be the judge's ``sympy`` or ``pandas``).
EVALUATING_METHODS = frozenset({
    "eval", "exec", "query", "sympify", "parse_expr", "lambdify", "simplify", "load", "loads", "read_pickle",
    "compile", "attrgetter", "methodcaller", "import_module", "system", "popen", "runsource", "runcode",
})
_TRUSTING = "trusting"  # a binding through which a test may run the program's text


def _syntax():
    """The ``_ast`` module: the node classes of ``ast`` without importing ``ast`` (with ``enum`` and
    ``contextlib``, ~5 ms of a fresh judge's start-up; ``_ast`` ~1 ms, and only for tests read)."""
    import _ast

    return _ast


def _walk(node, local=frozenset()):
    """``node`` and every node under it (``ast.walk``, in another order), each with the names local
    to the functions and lambdas it is in (their parameters and what they bind)."""
    ast = _syntax()
    todo = [(node, local)]
    while todo:
        node, local = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            arguments = node.args
            local = local | {a.arg for a in arguments.posonlyargs + arguments.args + arguments.kwonlyargs
                             + [arguments.vararg, arguments.kwarg] if a is not None}
            local = local | _names_bound(node.body if isinstance(node.body, list) else [node.body])
        yield node, local
        for field in node._fields:
            value = getattr(node, field, None)
            if isinstance(value, list):
                todo.extend((item, local) for item in value if isinstance(item, ast.AST))
            elif isinstance(value, ast.AST):
                todo.append((value, local))


def _names_bound(statements):
    """The names ``statements`` bind in their own scope (not inside the functions they define)."""
    ast = _syntax()
    bound = set()
    todo = list(statements)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            bound.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((alias.asname or alias.name).partition(".")[0] for alias in node.names)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue  # its body is its own scope (its decorators and defaults are not: rarely binding)
        for field in node._fields:
            value = getattr(node, field, None)
            if isinstance(value, list):
                todo.extend(item for item in value if isinstance(item, ast.AST))
            elif isinstance(value, ast.AST):
                todo.append(value)
    return bound


def _is_dunder(name):
    return name.startswith("__") and name.endswith("__")


def _plain_module_attribute(module_name, attribute):
    """Whether ``module_name.attribute`` (a plain module's) is plain: public, no text evaluator, and
    not itself a module off the list (``typing.sys``, ``json.codecs``) or a reflective builtin."""
    if attribute.startswith("_") or attribute in _EVALUATING_MODULE_FUNCTIONS:
        return False
    if module_name == "operator":
        return attribute in PLAIN_OPERATIONS
    try:
        value = getattr(import_for_the_tests(module_name), attribute, None)
    except Exception:  # noqa: BLE001 - not importable here: the test fails without running anything
        return True
    if isinstance(value, type(sys)):
        return getattr(value, "__name__", None) in PLAIN_MODULES
    return not any(value is reflective for reflective in REFLECTIVE_BUILTINS)


class _PlainTestReader:
    """Reads a test's syntax tree for what may run the program's text (see :func:`judged_apart`).

    ``bindings`` maps the tests' top-level names to what they hold: a plain module's name
    (``("module", "json")``), :data:`_TRUSTING`, or the names its value reads (a function's free
    names: ``check`` is as trusting as what its body calls, whenever it is called).
    """

    def __init__(self, bindings, stored):
        self.bindings = bindings
        self.stored = stored  # the names the test binds at its top level: its own

    def name_is_trusting(self, name, seen=()):
        """Whether ``name``, read at the test's top level, may hold what runs the program's text."""
        entry = self.bindings.get(name)
        if entry is _TRUSTING or self.bindings.get("*") is _TRUSTING:
            return True
        if type(entry) is tuple:
            return False
        if type(entry) is frozenset:
            seen = set(seen) | {name}
            return any(self.name_is_trusting(read, seen) for read in entry if read not in seen)
        if name in self.stored or name in _PLAIN_DUNDERS:
            return False
        if _is_dunder(name):  # __builtins__, __import__, __loader__...
            return True
        if hasattr(builtins, name):
            return name not in SAFE_BUILTINS
        # a free name: the program's global, or the judge's module of that name in its place
        return name not in PLAIN_MODULES and may_import(name, site_packages=True)

    def module_named(self, node, local):
        """The plain module that ``node`` (a name or an attribute chain) is, or None."""
        ast = _syntax()
        if isinstance(node, ast.Name):
            if node.id in local:  # a function's own import of a plain module (one of another is judged apart)
                return node.id if node.id in PLAIN_MODULES else None
            entry = self.bindings.get(node.id)
            if type(entry) is tuple:
                return entry[1]
            if entry is None and node.id not in self.stored and node.id in PLAIN_MODULES:
                return node.id
            return None
        if isinstance(node, ast.Attribute):
            base = self.module_named(node.value, local)
            if base is not None and "%s.%s" % (base, node.attr) in PLAIN_MODULES:
                return "%s.%s" % (base, node.attr)
        return None

    def is_trusting(self, nodes):
        """Whether any of ``nodes`` (and what they contain) may run the program's text."""
        ast = _syntax()
        for root in nodes:
            for node, local in _walk(root):
                if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
                    if node.id not in local and self.name_is_trusting(node.id):
                        return True
                elif isinstance(node, ast.Attribute):
                    if _is_dunder(node.attr) and node.attr not in _PLAIN_DUNDERS:
                        return True
                    module = self.module_named(node.value, local)
                    if module is not None:
                        if not _plain_module_attribute(module, node.attr):
                            return True
                    elif node.attr in EVALUATING_METHODS:
                        return True
                elif isinstance(node, (ast.Import, ast.ImportFrom)):
                    if any(binding is _TRUSTING for _, binding in self.imported(node)):
                        return True
        return False

    def imported(self, statement):
        """(name, binding) for each name an import statement binds."""
        ast = _syntax()
        if isinstance(statement, ast.Import):
            for alias in statement.names:
                plain = alias.name in PLAIN_MODULES
                if alias.asname:
                    yield alias.asname, ("module", alias.name) if plain else _TRUSTING
                else:  # import collections.abc binds collections
                    top = alias.name.partition(".")[0]
                    yield top, ("module", top) if plain and top in PLAIN_MODULES else _TRUSTING
            return
        module = statement.module or ""
        plain = statement.level == 0 and module in PLAIN_MODULES
        for alias in statement.names:
            name = alias.asname or alias.name
            if alias.name == "*":  # a plain module's names stay plain; any other's make every name trusting
                if not plain:
                    yield "*", _TRUSTING
            elif not plain or not _plain_module_attribute(module, alias.name):
                yield name, _TRUSTING
            elif "%s.%s" % (module, alias.name) in PLAIN_MODULES:
                yield name, ("module", "%s.%s" % (module, alias.name))
            else:
                yield name, frozenset()

    @staticmethod
    def names_read(node):
        """The names ``node`` reads outside its functions' locals: the top-level and free ones, which
        may hold something else by the time it runs (``check`` calls ``helper``, bound later)."""
        ast = _syntax()
        return frozenset(n.id for n, local in _walk(node)
                         if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id not in local)


def _run_at_definition(definition):
    """What of a ``def`` or ``class`` statement runs when it runs: decorators, defaults, annotations,
    bases, and a class's body but its methods' bodies."""
    ast = _syntax()
    parts = list(definition.decorator_list)
    if isinstance(definition, ast.ClassDef):
        parts += definition.bases + [argument.value for argument in definition.keywords]
        for statement in definition.body:
            if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                parts += _run_at_definition(statement)
            else:
                parts.append(statement)
        return parts
    arguments = definition.args
    parts += [d for d in arguments.defaults + arguments.kw_defaults if d is not None]
    parts += [a.annotation for a in arguments.posonlyargs + arguments.args + arguments.kwonlyargs
              + [arguments.vararg, arguments.kwarg] if a is not None and a.annotation is not None]
    if definition.returns is not None:
        parts.append(definition.returns)
    return parts


def judged_apart(test, bindings):
    """Whether ``test`` may run a text or bytes of the program's as code in the judge, read from its
    syntax tree (comments and strings say nothing): it reads a builtin off :data:`SAFE_BUILTINS`
    (``eval``, ``getattr``, ``vars``, ``open``...), a dunder name or attribute (``__builtins__``,
    ``__globals__``), a module off :data:`PLAIN_MODULES` (any site-package's: ``sympy.sympify``,
    ``pandas.DataFrame.query``; ``operator``, ``pickle``, ``importlib``, ``os``, ``sys``...), a
    private or module attribute of a plain module (``typing.sys``), a method named like a text
    evaluator (:data:`EVALUATING_METHODS`), or a name an earlier test bound to any of these
    (``check``, whose body calls ``sympy.sympify``). What only runs later (a function's body) and
    imports are allowed in a test judged in the judge itself: ``import numpy as np`` or ``def
    check(...)`` using it is judged there, and the test that calls ``check`` or reads ``np`` apart.

    ``bindings`` (the tests' top-level names so far, see :class:`_PlainTestReader`) is updated with
    what ``test`` binds when it is judged in the judge (False is returned).
    """
    ast = _syntax()
    try:
        tree = compile(test, "<test>", "exec", ast.PyCF_ONLY_AST)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return False  # it will not run
    updated = dict(bindings)
    reader = _PlainTestReader(updated, _names_bound(tree.body))
    for statement in tree.body:
        if isinstance(statement, (ast.Import, ast.ImportFrom)):
            for name, binding in reader.imported(statement):
                updated[name] = binding
        elif isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if reader.is_trusting(_run_at_definition(statement)):
                return True
            updated[statement.name] = _TRUSTING if reader.is_trusting([statement]) else reader.names_read(statement)
        else:
            if reader.is_trusting([statement]):
                return True
            read = reader.names_read(statement)
            for name in _names_bound([statement]):
                updated[name] = read
    bindings.clear()
    bindings.update(updated)
    return False
