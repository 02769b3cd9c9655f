"""The shape of the code: modules of a readable size, imports that only go down the layers, and a
list in docs/architecture.md that names every module."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "lit_grpo"
MAX_LINES = 700

# The packages of lit_grpo (and the modules at its top level), lowest first: a module may import from
# its own layer and the layers below, never from above. Inside a layer, the cycle test below keeps order.
LAYERS = [
    # errors, records, settings and pure tensor math (algorithm/); the plugin markers; a tiny model
    ["lit_grpo", "errors", "settings", "openmp", "former_paths", "hookspecs", "tiny", "redaction", "algorithm", "config"],
    # loading models, CPU-only tuning, several processes
    ["models", "cpu", "distributed", "device_defaults"],
    # the files of a run: its directory, checkpoints, preemption, callbacks, completions, export
    ["run"],
    # the plugin registry and the objects and names that stand for rewards, tools, environments
    ["plugins"],
    ["data"],
    # steps 2 (scores) and 1-3 (rollouts: engines, tools, records, the pipelines)
    ["scoring"],
    ["rollout"],
    # step 4 and the module that runs all four
    ["train"],
    # the command
    ["cli"],
]


def unit_of(name: str) -> str:
    """``lit_grpo.rollout.engines.base`` -> ``rollout``; ``lit_grpo.errors`` -> ``errors``; ``lit_grpo`` -> itself."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


UNIT_LAYER = {unit: index for index, units in enumerate(LAYERS) for unit in units}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _lazy_exports(tree: ast.Module) -> set[ast.AST]:
    """The nodes inside a module-level ``__getattr__``: ``lit_grpo/__init__``'s lazy re-exports of
    ``GRPOModule`` and ``GRPODataModule`` (imported on first use, so that ``import lit_grpo`` stays
    cheap) are the one import allowed to go up the layers."""
    return {node for top in tree.body if isinstance(top, ast.FunctionDef) and top.name == "__getattr__"
            for node in ast.walk(top)}


def imported_modules(path: Path) -> set[str]:
    """Every ``lit_grpo``/``bench`` module imported anywhere in the file (functions included, a lazy
    re-export in ``__getattr__`` not)."""
    found = set()
    tree = ast.parse(path.read_text())
    lazy = _lazy_exports(tree)
    for node in ast.walk(tree):
        if node in lazy:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            # ``from lit_grpo import algorithm`` imports the module lit_grpo.algorithm
            found.update(f"{node.module}.{alias.name}" for alias in node.names if f"{node.module}.{alias.name}" in MODULES)
    return {name for name in found if name.split(".")[0] in ("lit_grpo", "bench")}


GRAPH = {name: imported_modules(path) - {name} for name, path in MODULES.items()}


def test_every_package_and_top_level_module_has_a_layer():
    units = {unit_of(name) for name in MODULES}
    assert sorted(units - set(UNIT_LAYER)) == [], "add the new package or top-level module to LAYERS"
    assert sorted(set(UNIT_LAYER) - units) == [], "a package or module of LAYERS no longer exists"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_is_of_a_readable_size(name):
    lines = len(MODULES[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{name} has {lines} lines"


# the reward helpers (rewards/lit_grpo_rewards, the code sandbox among them) keep the same limit
REWARDS_MODULES = {str(path.relative_to(REPO)): path for path in (REPO / "rewards" / "lit_grpo_rewards").rglob("*.py")}


@pytest.mark.parametrize("name", sorted(REWARDS_MODULES))
def test_reward_module_is_of_a_readable_size(name):
    lines = len(REWARDS_MODULES[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{name} has {lines} lines"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_go_down_the_layers_and_never_to_bench(name):
    for imported in GRAPH[name]:
        assert not imported.startswith("bench"), f"{name} imports {imported}"
        assert UNIT_LAYER[unit_of(imported)] <= UNIT_LAYER[unit_of(name)], (
            f"{name} (layer {UNIT_LAYER[unit_of(name)]}) imports {imported} (layer {UNIT_LAYER[unit_of(imported)]})"
        )


def test_import_graph_has_no_cycles():
    visiting, done = set(), set()

    def visit(name: str, path: list[str]) -> None:
        if name in done:
            return
        assert name not in visiting, "import cycle: " + " -> ".join(path + [name])
        visiting.add(name)
        for imported in sorted(GRAPH[name]):
            # a package's __init__ importing its own submodules is how packages work
            if not imported.startswith(name + "."):
                visit(imported, path + [name])
        visiting.discard(name)
        done.add(name)

    for name in sorted(MODULES):
        visit(name, [])


def test_architecture_page_names_every_module():
    page = (REPO / "docs" / "architecture.md").read_text()
    section = page.split("## Every module", 1)[1]
    listed = set()
    for line in section.splitlines():  # "lit_grpo/cpu/__init__.py, allocator.py   what they are"
        match = re.match(r"(lit_grpo/(?:\w+/)*)(\w+\.py(?:, \w+\.py)*)", line)
        if match:
            folder, names = match.groups()
            listed |= {folder + name for name in names.split(", ")}
    files = {str(path.relative_to(REPO)) for path in PACKAGE.rglob("*.py")}
    assert sorted(files - listed) == [], "add these to docs/architecture.md's list of every module"
    assert sorted(listed - files) == [], "docs/architecture.md's list of every module names modules that do not exist"


def test_configuration_reference_documents_every_model_key():
    import inspect

    from lit_grpo.train.module import GRPOModule

    reference = (REPO / "docs" / "configuration.md").read_text()
    keys = [name for name in inspect.signature(GRPOModule).parameters if name not in ("optimizer", "lr_scheduler")]
    assert [key for key in keys if f"`{key}`" not in reference] == [], "add these keys to docs/configuration.md"


def test_every_former_import_path_is_the_module_where_it_moved():
    """``from lit_grpo.module import GRPOModule`` (a user's script), ``lit_grpo.preemption.CheckpointOnSignal``
    (a saved config's class path): the module at its new path, not a copy, so that classes compare equal."""
    import importlib
    import sys

    from lit_grpo.former_paths import MOVED

    for former, now in MOVED.items():
        if "vllm" in former and importlib.util.find_spec("vllm") is None:
            continue
        assert importlib.import_module(former) is importlib.import_module(now), former
        assert sys.modules[former].__spec__.name == now, former
    from lit_grpo.distributed import ModelParallelStrategy  # moved out of distributed.py, still named there
    from lit_grpo.run.sharded_checkpoints import ModelParallelStrategy as moved

    assert ModelParallelStrategy is moved


def test_the_records_still_import_from_lit_grpo_rollout():
    """``lit_grpo.rollout`` was the records module before it became the rollout package."""
    from lit_grpo.rollout import Rollout, ScoredRollout, records

    assert Rollout is records.Rollout and ScoredRollout is records.ScoredRollout
    with pytest.raises(ImportError, match="Nothing"):
        from lit_grpo.rollout import Nothing  # noqa: F401
