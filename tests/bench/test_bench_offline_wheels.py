"""``requirements-offline.txt`` (the wheels a node with torch, transformers and lightning but no package
index needs, docs/gpu.md) keeps up with the projects' dependencies: whatever they need
beyond those three, as this environment's installed packages declare it for the file's Python, is
pinned there. ``bench.offline_wheels`` writes it with pip's resolver, which needs the index; its
arithmetic is tested here on a resolution given by hand."""

import re
from importlib.metadata import PackageNotFoundError, requires

import tomllib
from packaging.requirements import Requirement

from bench import offline_wheels
from bench.offline_wheels import REPO_DIR, REQUIREMENTS, canonical


def pinned() -> dict[str, str]:
    lines = [line for line in REQUIREMENTS.read_text().splitlines() if line and not line.startswith("#")]
    pins = dict(line.split("==") for line in lines)
    assert all(re.fullmatch(r"[a-z0-9-]+", name) and version for name, version in pins.items()), lines
    return pins


def target_python() -> str:
    return re.search(r"for CPython (\d+\.\d+)", REQUIREMENTS.read_text()).group(1)


def needed(requirements: list[str], python_version: str) -> set[str]:
    """The distributions ``requirements`` need, with their dependencies as the installed ones declare
    them for ``python_version`` (extras followed); one not installed here counts without its own."""
    environment = {"python_version": python_version, "python_full_version": f"{python_version}.0"}
    seen: set[tuple[str, frozenset]] = set()
    stack = [Requirement(text) for text in requirements]
    while stack:
        requirement = stack.pop()
        key = (canonical(requirement.name), frozenset(requirement.extras))
        if key in seen:
            continue
        seen.add(key)
        try:
            declared = [Requirement(text) for text in requires(requirement.name) or []]
        except PackageNotFoundError:
            continue
        for dependency in declared:
            extras = requirement.extras | {""}
            if dependency.marker is None or any(dependency.marker.evaluate({**environment, "extra": extra}) for extra in extras):
                stack.append(dependency)
    return {name for name, _ in seen}


def project_requirements() -> list[str]:
    """lit-grpo's dependencies and its bench extra, and its rewards' (lit-grpo itself left out)."""
    lit_grpo = tomllib.loads((REPO_DIR / "pyproject.toml").read_text())["project"]
    rewards = tomllib.loads((REPO_DIR / "rewards" / "pyproject.toml").read_text())["project"]
    texts = lit_grpo["dependencies"] + lit_grpo["optional-dependencies"]["bench"] + rewards["dependencies"]
    return [text for text in texts if canonical(Requirement(text).name) != "lit-grpo"]


def test_everything_the_projects_need_beyond_the_node_is_pinned():
    python = target_python()
    beyond_the_node = needed(project_requirements(), python) - needed(list(offline_wheels.NODE_PACKAGES), python)
    missing = sorted(beyond_the_node - set(pinned()))
    assert missing == [], f"add to requirements-offline.txt (python -m bench.offline_wheels): {missing}"


def test_the_build_backend_is_pinned_for_installing_the_clone():
    assert "setuptools" in pinned()
    assert offline_wheels.build_requirements() == ["setuptools>=68"]


def test_offline_wheels_are_the_projects_resolution_less_the_nodes():
    project = {"lit-grpo": "0.1.0", "lit-grpo-rewards": "0.1.0", "torch": "2.13.0", "datasets": "5.2.0", "trl": "1.16.0"}
    node = {"torch": "2.13.0", "transformers": "5.24.0"}
    wheels = offline_wheels.offline_wheels(project, node, {"setuptools": "84.2.1"})
    assert wheels == {"datasets": "5.2.0", "setuptools": "84.2.1", "trl": "1.16.0"}
    text = offline_wheels.requirements_text(wheels, "3.12", ["manylinux_2_28_x86_64"])
    assert text.splitlines()[-3:] == ["datasets==5.2.0", "setuptools==84.2.1", "trl==1.16.0"]
    assert "for CPython 3.12 on manylinux_2_28_x86_64" in text
