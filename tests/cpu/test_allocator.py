"""lit_grpo.allocator: freed CPU memory stays in the process, so the next step's tensors cost no page
faults. Each case runs in its own process: malloc settings are process-wide."""

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from lit_grpo.cpu.allocator import uses_glibc

pytestmark = pytest.mark.skipif(not uses_glibc(), reason="glibc malloc settings")

# Fills a tensor of 16 MiB and frees it, then fills tensors of 3, 5 and 7 MiB (a training step frees
# activations of one shape and allocates others); reports the mmapped blocks and the page faults of each.
FREE_THEN_ALLOCATE = """
import ctypes, json, resource, sys
import torch
from lit_grpo.cpu.allocator import keep_freed_memory
status = keep_freed_memory() if sys.argv[1] == "keep" else "glibc defaults"
class MallInfo(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo
def fill(size_mib):
    blocks, faults = libc.mallinfo2().hblks, resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    tensor = torch.ones(size_mib * 2**18)
    return tensor, {"mapped": libc.mallinfo2().hblks - blocks, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults}
first, first_record = fill(16)
del first
later = [fill(size_mib) for size_mib in (3, 5, 7)]
print(json.dumps({"status": status, "first": first_record, "later": [record for _, record in later]}))
"""
LATER_PAGES = (3 + 5 + 7) * 256  # pages of 4 KiB


def free_then_allocate(mode: str, **env: str) -> dict:
    environment = {key: value for key, value in os.environ.items() if not key.startswith("MALLOC_")}
    environment.pop("GLIBC_TUNABLES", None)
    environment.pop("LIT_GRPO_KEEP_FREED_MEMORY", None)
    environment.update(env)
    output = subprocess.run(
        [sys.executable, "-c", FREE_THEN_ALLOCATE, mode], env=environment, capture_output=True, text=True, check=True
    ).stdout
    return json.loads(output.strip().splitlines()[-1])


# each case of the tests below: (mode, environment)
CASES = {
    "kept": ("keep", {}),
    "default": ("default", {}),
    "off": ("keep", {"LIT_GRPO_KEEP_FREED_MEMORY": "0"}),
    "user": ("keep", {"MALLOC_TRIM_THRESHOLD_": "131072"}),
    "tunables": ("keep", {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=131072"}),
}


@pytest.fixture(scope="module")
def reports():
    """Each case's report, from a process of its own, all started side by side by the first test that asks
    (each process imports torch on one thread: on 2 cores they overlap). ``reports[name].result()``."""
    with ThreadPoolExecutor(len(CASES)) as beside:
        yield {name: beside.submit(free_then_allocate, mode, **env) for name, (mode, env) in CASES.items()}


def test_freed_memory_is_reused_without_page_faults(reports):
    kept = reports["kept"].result()
    assert kept["status"] == "set"
    assert kept["first"]["mapped"] == 0 and kept["first"]["faults"] >= 0.9 * 16 * 256  # the heap grew
    assert all(record["mapped"] == 0 for record in kept["later"])
    assert sum(record["faults"] for record in kept["later"]) < 100  # they reuse its pages


def test_without_it_freed_memory_is_faulted_in_again(reports):
    """The control: glibc's defaults map the 16 MiB block and unmap it at once."""
    default = reports["default"].result()
    assert default["first"]["mapped"] == 1
    assert sum(record["faults"] for record in default["later"]) >= 0.9 * LATER_PAGES


def test_opt_out_and_the_users_own_settings_win(reports):
    off = reports["off"].result()
    assert off["status"] == "off (LIT_GRPO_KEEP_FREED_MEMORY=0)"
    assert sum(record["faults"] for record in off["later"]) >= 0.9 * LATER_PAGES
    user = reports["user"].result()
    assert user["status"] == "left to the user's settings (MALLOC_TRIM_THRESHOLD_)"
    tunables = reports["tunables"].result()
    assert tunables["status"] == "left to the user's settings (GLIBC_TUNABLES)"


def test_a_cpu_run_applies_it(monkeypatch, tiny_model_dir, say_a_or_b_file):
    """GRPOModule.setup applies it when the run is on the CPU."""
    from conftest import cpu_trainer
    from test_module import make_data, make_module

    import lit_grpo.cpu
    import lit_grpo.train.module

    calls = []
    monkeypatch.setattr(lit_grpo.cpu, "keep_freed_memory", lambda: calls.append("set") or "set")
    cpu_trainer().fit(make_module(tiny_model_dir), datamodule=make_data(say_a_or_b_file))
    assert calls == ["set"]
