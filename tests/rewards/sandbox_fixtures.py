"""Fixtures for the code sandbox's tests: every sandbox gets a private temporary directory, and after
each test nothing of any sandbox may be left (directory, process, cgroup) and a bystander process of
the machine must still be alive.

Imported by the test modules (``from sandbox_fixtures import ...``) rather than kept in a
``conftest.py``: another conftest module here would shadow tests/conftest.py for the tests that
import from it by name."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import pytest
from lit_grpo_rewards.sandbox import cgroup as _sandbox_cgroup
from lit_grpo_rewards.sandbox import UID_RANGE


def sandbox_processes() -> list[int]:
    """Processes that belong to any sandbox: a sandbox uid, or the sandbox's mark in the environment."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            if UID_RANGE[0] <= os.stat(f"/proc/{entry}").st_uid < UID_RANGE[1]:
                found.append(int(entry))
                continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                if any(v.startswith(b"LIT_GRPO_SANDBOX=") for v in f.read().split(b"\0")):
                    found.append(int(entry))
        except OSError:  # gone meanwhile, or not ours to read
            pass
    return found


def sandbox_cgroups() -> list[str]:
    where = _sandbox_cgroup.support()
    found = []
    for parent in {where.memory_parent, where.pids_parent, where.io_parent} - {None}:  # (io: the disk-read limit)
        try:
            found += [os.path.join(parent, d) for d in os.listdir(parent) if d.startswith(_sandbox_cgroup.PREFIX)]
        except OSError:
            pass
    return found


@pytest.fixture
def sandbox_tmp(tmp_path, monkeypatch):
    """A private temporary directory for the sandboxes; afterwards it must be empty, and no sandbox
    process or cgroup may be left."""
    root = tmp_path / "sandboxes"
    root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    cgroups_before = set(sandbox_cgroups())
    yield root
    assert list(root.iterdir()) == [], "a sandbox directory was left behind"
    deadline = time.monotonic() + 2.0  # SIGKILLed processes may take a moment to disappear from /proc
    while sandbox_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sandbox_processes() == [], "a sandboxed process survived"
    assert set(sandbox_cgroups()) <= cgroups_before, "a sandbox cgroup was left behind"


@pytest.fixture
def bystander():
    """A process of the machine (the scoring process's user, outside any sandbox) with a secret in its
    environment. It must still be alive after the test."""
    secret = "bystander-secret-" + os.urandom(8).hex()
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                            env={"BYSTANDER_SECRET": secret, "PATH": os.environ.get("PATH", "")})
    proc.secret = secret
    yield proc
    alive = proc.poll() is None
    proc.kill()
    proc.wait()
    assert alive, "a bystander process of the machine was killed"


def rss_kb() -> int:
    """This process's resident memory in KiB (0 where /proc is missing)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0
