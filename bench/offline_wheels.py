"""Writes ``requirements-offline.txt``: the wheels a machine that has torch, transformers and lightning
but no package index needs for lit-grpo, its rewards and the benchmark extra (TRL), pinned.

    python -m bench.offline_wheels                            # CPython 3.12, manylinux x86-64
    python -m bench.offline_wheels --python-version 3.11 --platform manylinux_2_28_aarch64

Run it on a machine with the index, from the repository root, when a dependency changes. pip's
resolver is asked twice for the target's Python and platform, in a dry run (it reads each wheel's
metadata, downloads none): what ``pip install -e ".[bench]" -e ./rewards`` would install, and what
``pip install torch transformers lightning`` would. The file lists the first less the second, plus
the build backend that installing the clone needs there (``setuptools``, from ``pyproject.toml``).
docs/gpu.md downloads and installs the file's wheels.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_DIR = Path(__file__).resolve().parents[1]
REQUIREMENTS = REPO_DIR / "requirements-offline.txt"
NODE_PACKAGES = ("torch", "transformers", "lightning")  # what the node has, with their dependencies
PROJECT = (f"{REPO_DIR}[bench]", str(REPO_DIR / "rewards"))
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux2014_x86_64")


def canonical(name: str) -> str:
    """A distribution's name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def resolve(requirements: list[str], python_version: str, platforms: list[str]) -> dict[str, str]:
    """``{name: version}`` of everything pip would install for ``requirements`` on the target."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        target = [f"--platform={platform}" for platform in platforms]
        target += [f"--python-version={python_version}", "--implementation=cp", "--only-binary=:all:"]
        command = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                   "--target", str(Path(tmp) / "unused"), "--report", str(report), *target, *requirements]
        subprocess.run(command, check=True)
        installs = json.loads(report.read_text())["install"]
    return {canonical(item["metadata"]["name"]): item["metadata"]["version"] for item in installs}


def build_requirements() -> list[str]:
    """The build backends of the repository's two projects (``[build-system] requires``)."""
    import tomllib  # Python 3.11+

    requires = set()
    for project in (REPO_DIR, REPO_DIR / "rewards"):
        requires.update(tomllib.loads((project / "pyproject.toml").read_text())["build-system"]["requires"])
    return sorted(requires)


def offline_wheels(project: dict[str, str], node: dict[str, str], build: dict[str, str]) -> dict[str, str]:
    """What ``project``'s resolution adds to the ``node``'s (the repository's own projects left out:
    they install from the clone), and the ``build`` backends."""
    local = {canonical("lit-grpo"), canonical("lit-grpo-rewards")}
    wheels = {name: version for name, version in project.items() if name not in node and name not in local}
    return dict(sorted({**wheels, **build}.items()))


def requirements_text(wheels: dict[str, str], python_version: str, platforms: list[str]) -> str:
    header = [
        f"# What lit-grpo, ./rewards and the bench extra need beyond {', '.join(NODE_PACKAGES)} (and their own",
        "# dependencies), plus setuptools to install the clone: docs/gpu.md. Written by python -m bench.offline_wheels",
        f"# for CPython {python_version} on {' / '.join(platforms)}, {datetime.date.today().isoformat()}.",
    ]
    return "\n".join(header + [f"{name}=={version}" for name, version in wheels.items()]) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.offline_wheels", description=__doc__.split("\n\n")[0])
    parser.add_argument("--python-version", default="3.12")
    parser.add_argument("--platform", nargs="+", default=list(PLATFORMS))
    parser.add_argument("--out", type=Path, default=REQUIREMENTS)
    args = parser.parse_args(argv)
    project = resolve(list(PROJECT), args.python_version, args.platform)
    node = resolve(list(NODE_PACKAGES), args.python_version, args.platform)
    build = resolve(build_requirements(), args.python_version, args.platform)
    wheels = offline_wheels(project, node, build)
    args.out.write_text(requirements_text(wheels, args.python_version, args.platform))
    print(f"wrote {len(wheels)} pinned wheels to {args.out}")


if __name__ == "__main__":
    main()
