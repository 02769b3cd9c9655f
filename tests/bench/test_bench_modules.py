"""Every script of bench/ imports as a module of the ``bench`` package (``python -m bench.<name>`` from
the repository root) without patching ``sys.path``: nothing is run, each module is only imported."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MODULES = sorted(path.stem for path in (REPO / "bench").glob("*.py") if path.stem != "__init__")

# Run in a fresh interpreter whose sys.path holds the repository root (as ``python -m`` from the root
# gives) and not bench/ itself: a module that needed ``sys.path.insert`` or ``import harness`` fails.
IMPORT_ALL = """
import importlib, json, sys
before = list(sys.path)
failures = {}
for name in json.loads(sys.argv[1]):
    try:
        importlib.import_module("bench." + name)
    except Exception as error:
        failures[name] = f"{type(error).__name__}: {error}"
top_level = sorted(set(json.loads(sys.argv[1])) & set(sys.modules))
print(json.dumps({"failures": failures, "path_changed": sys.path != before, "top_level": top_level}))
"""


def test_every_bench_script_imports_as_a_module_of_the_bench_package_without_path_patches():
    assert {"compare_trl", "harness", "flops", "trainer_runs", "gpu_check"} <= set(MODULES)
    proc = subprocess.run(
        [sys.executable, "-c", IMPORT_ALL, json.dumps(MODULES)], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["failures"] == {}
    assert not report["path_changed"], "a bench module changed sys.path on import"
    assert report["top_level"] == [], "imported as top-level modules (bench/ on sys.path), not as bench.<name>"
