"""tests/marked_tests.py names tests that exist, and conftest marks them before ``-m`` selects."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from marked_tests import EVERY_TEST, INTEGRATION, SLOW

REPO = Path(__file__).resolve().parent.parent


def functions_named_test(path: Path) -> set[str]:
    """The names of the test functions of a test file, top-level or in a class."""
    tree = ast.parse(path.read_text())
    functions = [node for node in tree.body if isinstance(node, ast.FunctionDef)]
    functions += [node for cls in tree.body if isinstance(cls, ast.ClassDef) for node in cls.body
                  if isinstance(node, ast.FunctionDef)]
    return {node.name for node in functions if node.name.startswith("test_")}


@pytest.mark.parametrize("marker, tests_by_file", [("integration", INTEGRATION), ("slow", SLOW)])
def test_every_marked_name_is_a_test_of_its_file(marker, tests_by_file):
    for file, names in tests_by_file.items():
        assert (REPO / file).is_file(), f"{marker}: {file} does not exist (moved? update tests/marked_tests.py)"
        if names != EVERY_TEST:
            missing = set(names) - functions_named_test(REPO / file)
            assert not missing, f"{marker}: {file} has no test {sorted(missing)} (renamed? update tests/marked_tests.py)"


def test_every_collected_test_named_there_carries_its_marker(request):
    """conftest's hook marked this session's tests (``-m`` has already dropped those it deselects)."""
    for item in request.session.items:
        path = item.path.relative_to(REPO).as_posix() if item.path.is_relative_to(REPO) else None
        function = getattr(item, "originalname", item.name)
        for marker, tests_by_file in (("integration", INTEGRATION), ("slow", SLOW)):
            named = tests_by_file.get(path, ())
            assert (named == EVERY_TEST or function in named) == (item.get_closest_marker(marker) is not None), (
                item.nodeid, marker)
