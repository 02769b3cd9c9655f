"""The shape of the code: modules of a readable size, imports that only go down the layers, and a
README Layout section that names every module."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "lit_grpo"
MAX_LINES = 700

# Lowest first: a module may import from its own layer and the layers below, never from above.
LAYERS = [
    # pure functions, records and settings
    ["lit_grpo", "lit_grpo.errors", "lit_grpo.algorithm", "lit_grpo.sampling_correction", "lit_grpo.sampling_filters",
     "lit_grpo.config", "lit_grpo.evaluation",
     "lit_grpo.hookspecs", "lit_grpo.tiny", "lit_grpo.config_files", "lit_grpo.trl_names", "lit_grpo.openmp",
     "lit_grpo.python_objects", "lit_grpo.redaction", "lit_grpo.named_functions"],
    # loading models, checkpoints, a run's directory, the plugin registry
    ["lit_grpo.models", "lit_grpo.preemption", "lit_grpo.checkpointing", "lit_grpo.runs", "lit_grpo.plugins", "lit_grpo.tools",
     "lit_grpo.device_defaults"],
    # several processes; CPU-only tuning; a reward's settings, arguments and worker processes
    ["lit_grpo.distributed", "lit_grpo.cpu.allocator", "lit_grpo.cpu.attention", "lit_grpo.cpu.prepacked", "lit_grpo.cpu.threads",
     "lit_grpo.cpu.amx", "lit_grpo.policy_weights",
     "lit_grpo.scoring.specs", "lit_grpo.scoring.arguments", "lit_grpo.scoring.failures", "lit_grpo.scoring.pool",
     "lit_grpo.scoring.own_process", "lit_grpo.scoring.event_loop",
     "lit_grpo.environments"],
    ["lit_grpo.cpu", "lit_grpo.rollout", "lit_grpo.reference", "lit_grpo.scoring.scorer", "lit_grpo.completions"],
    # what a step is built from
    ["lit_grpo.shared_prompt", "lit_grpo.engines.lit_sampler", "lit_grpo.scoring", "lit_grpo.data", "lit_grpo.callbacks",
     "lit_grpo.multi_turn", "lit_grpo.dynamic_sampling", "lit_grpo.engines.base", "lit_grpo.engines.vllm_sampling",
     "lit_grpo.engines.server_lost"],
    ["lit_grpo.generation", "lit_grpo.logprobs", "lit_grpo.engines.policy"],
    ["lit_grpo.agent", "lit_grpo.async_rollouts"],
    # the vLLM engines (the vllm extra): in each process; on servers, with their weights over gloo
    ["lit_grpo.engines.vllm_colocated", "lit_grpo.engines.vllm_plugin", "lit_grpo.engines.vllm_auth"],
    ["lit_grpo.engines.vllm_gloo", "lit_grpo.engines.vllm_serve"],
    ["lit_grpo.engines.vllm_server"],
    ["lit_grpo.engines"],
    # the Lightning module, what is built on it, and the command
    ["lit_grpo.module"],
    ["lit_grpo.export"],
    ["lit_grpo.lightning_cli"],
    ["lit_grpo.cli"],
]
LAYER_OF = {name: index for index, names in enumerate(LAYERS) for name in names}


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


def test_every_module_has_a_layer():
    assert sorted(set(MODULES) - set(LAYER_OF)) == [], "add the new module to LAYERS"
    assert sorted(set(LAYER_OF) - set(MODULES)) == [], "a module of LAYERS no longer exists"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_is_of_a_readable_size(name):
    lines = len(MODULES[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{name} has {lines} lines"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_go_down_the_layers_and_never_to_bench(name):
    for imported in GRAPH[name]:
        assert not imported.startswith("bench"), f"{name} imports {imported}"
        assert LAYER_OF[imported] <= LAYER_OF[name], (
            f"{name} (layer {LAYER_OF[name]}) imports {imported} (layer {LAYER_OF[imported]})"
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


def test_readme_layout_names_every_module():
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Layout", 1)[1]
    listed = set()
    for line in section.splitlines():  # "lit_grpo/cpu/__init__.py, allocator.py   what they are"
        match = re.match(r"(lit_grpo/(?:\w+/)*)(\w+\.py(?:, \w+\.py)*)", line)
        if match:
            folder, names = match.groups()
            listed |= {folder + name for name in names.split(", ")}
    files = {str(path.relative_to(REPO)) for path in PACKAGE.rglob("*.py")}
    assert sorted(files - listed) == [], "add these to the README's Layout section"
    assert sorted(listed - files) == [], "the README's Layout section names modules that do not exist"


def test_configuration_reference_documents_every_model_key():
    import inspect

    from lit_grpo.module import GRPOModule

    reference = (REPO / "docs" / "configuration.md").read_text()
    keys = [name for name in inspect.signature(GRPOModule).parameters if name not in ("optimizer", "lr_scheduler")]
    assert [key for key in keys if f"`{key}`" not in reference] == [], "add these keys to docs/configuration.md"
