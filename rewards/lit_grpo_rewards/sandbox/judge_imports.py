"""What the judge imports on a program's behalf: a short list of modules, imported with nothing of
the program's around (argv, working directory, HOME, ``sys.path``), and stand-ins for the others."""

import os
import sys

#: The standard-library modules the judge imports on a program's behalf: a module the program hands
#: over (a value it returns, whatever its ``__name__``) or a program global named like one through
#: which a test reads an attribute. Modules a test plausibly uses; never a command-line tool, a
#: ``__main__``, a package's ``__init__`` that starts something, or anything found on a path the
#: program can write.
JUDGE_IMPORTS = frozenset({
    "abc", "array", "base64", "binascii", "bisect", "calendar", "cmath", "collections", "collections.abc",
    "colorsys", "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "enum", "errno",
    "fnmatch", "fractions", "functools", "graphlib", "hashlib", "heapq", "hmac", "html", "io", "ipaddress",
    "itertools", "json", "keyword", "math", "numbers", "operator", "os", "os.path", "pprint", "queue",
    "random", "re", "reprlib", "secrets", "statistics", "string", "struct", "sys", "textwrap", "time",
    "types", "typing", "unicodedata", "uuid", "weakref", "zlib",
})
#: With ``site_packages``, these packages and their submodules (dunder-named parts, ``__main__``
#: among them, excepted).
SITE_PACKAGES_IMPORTS = frozenset({
    "numpy", "scipy", "pandas", "sympy", "networkx", "sortedcontainers", "mpmath", "more_itertools", "regex",
    "torch", "sklearn",
})


def may_import(name, site_packages=False):
    """Whether the judge imports module ``name`` for the tests (see ``JUDGE_IMPORTS``)."""
    if type(name) is not str:
        return False
    if name in JUDGE_IMPORTS:
        return True
    parts = name.split(".")
    return bool(site_packages) and parts[0] in SITE_PACKAGES_IMPORTS and all(
        part.isidentifier() and not part.startswith("__") for part in parts)


def import_for_the_tests(name):
    """The judge's own import of module ``name`` (already checked by :func:`may_import`), made with a
    neutral argv, working directory and HOME, and ``sys.path`` as it was afterwards: a module that
    reads its command line, the working directory or the home directory at import time reads
    nothing of the program's."""
    module = sys.modules.get(name)
    if module is not None:
        return module
    path, saved_path, saved_argv = sys.path, list(sys.path), sys.argv
    saved_home = os.environ.get("HOME")
    try:
        cwd = os.open(".", os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        cwd = None
    try:
        sys.argv = [""]
        os.environ["HOME"] = "/"
        os.chdir("/")
        __import__(name)
        return sys.modules[name]
    finally:
        path[:] = saved_path
        sys.path, sys.argv = path, saved_argv
        if saved_home is None:
            os.environ.pop("HOME", None)
        else:
            os.environ["HOME"] = saved_home
        if cwd is not None:
            try:
                os.fchdir(cwd)
            finally:
                os.close(cwd)


class ModuleOnFirstUse(type(sys)):
    """This side's own import of a module the other side holds, made when a test first reads one of
    its attributes (most programs' ``import re`` is never used by their tests, and importing costs
    milliseconds in every sandbox). If it cannot be imported here, reading an attribute fails:
    the other side's object never stands in for it (a program's ``types.ModuleType("math.forged")``
    with a permissive ``isclose`` would)."""

    def __getattr__(self, attr):
        try:
            real = import_for_the_tests(self.__name__)
        except Exception as exc:  # noqa: BLE001
            raise AttributeError("module %r cannot be imported by the judge (%s), so it has no attribute %r"
                                 % (self.__name__, exc, attr))
        self.__dict__.update(real.__dict__)
        return getattr(real, attr)


class ModuleNotImported(type(sys)):
    """A module the program names that the judge does not import for the tests (not on its list):
    never the program's object in its place either; reading an attribute fails."""

    def __getattr__(self, attr):
        raise AttributeError("module %r is not one the judge imports for the tests, so it has no attribute %r"
                             % (self.__name__, attr))
