"""How many CPU threads a step uses, on a machine that other processes may share.

PyTorch splits each CPU kernel over its intra-op threads and waits for the slowest. When another
job holds a core, one of those threads waits for that core at every kernel, and the step runs at
the pace of the preempted thread (and, with OpenMP's spin-waiting, much slower still:
:mod:`lit_grpo.openmp`). :class:`CpuThreads` measures, between steps, how much of the CPUs this
process may run on that *other* processes used (``/proc/stat`` minus this process and its children,
such as reward workers), and sets ``torch.set_num_threads`` to the cores left free: all of them
(up to the threads torch had when training started) on a quiet machine, fewer beside another job,
and back up when it ends. Several training processes on one machine see each other as that other
load, and share the cores.

It chooses only where nobody else did: a run with ``OMP_NUM_THREADS`` set keeps what it says, and the
threads torch has at the start of training (``torch.set_num_threads`` before ``fit``) are the most it
uses. Linux only (elsewhere it does nothing).
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import torch

__all__ = ["CpuThreads", "other_processes_busy_cores"]

CHECK_INTERVAL = 1.0  # seconds between two measurements (a step boundary at least this late)
CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _cpus() -> set[int]:
    return set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


def busy_ticks(cpus: set[int], stat: str = "/proc/stat") -> int | None:
    """Clock ticks the CPUs ``cpus`` spent running anything (every field but idle and iowait)."""
    try:
        lines = Path(stat).read_text().splitlines()
    except OSError:
        return None
    total = 0
    for line in lines:
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            values = [int(value) for value in fields[:8]]  # user nice system idle iowait irq softirq steal
            total += sum(values) - values[3] - values[4]
    return total


def process_tree_ticks(pid: int | str = "self") -> int:
    """Clock ticks (user + system) this process and its descendants have run: the living ones' own,
    and those of the exited children each of them waited for (``cutime``/``cstime``), so that a child
    that ends between two measurements (a sandboxed code reward's process) stays this run's load."""
    total = 0
    pending = [str(pid)]
    while pending:
        current = pending.pop()
        try:
            fields = Path(f"/proc/{current}/stat").read_text().rsplit(")", 1)[1].split()
            total += sum(int(value) for value in fields[11:15])  # utime, stime, cutime, cstime
            for task in Path(f"/proc/{current}/task").iterdir():
                pending += (task / "children").read_text().split()
        except (OSError, IndexError, ValueError):
            continue
    return total


def other_processes_busy_cores(before: tuple[int, int, float], after: tuple[int, int, float]) -> float:
    """Cores that other processes kept busy between two ``(busy ticks, own ticks, monotonic time)``."""
    seconds = after[2] - before[2]
    if seconds <= 0:
        return 0.0
    others = (after[0] - before[0]) - (after[1] - before[1])
    return max(0.0, others / CLOCK_TICKS / seconds)


class CpuThreads:
    """Sets torch's intra-op threads to the cores other processes leave free (see the module doc)."""

    def __init__(self, max_threads: int | None = None, interval: float = CHECK_INTERVAL) -> None:
        self.cpus = _cpus()
        self.max_threads = max_threads or torch.get_num_threads()
        self.interval = interval
        self.enabled = "OMP_NUM_THREADS" not in os.environ and busy_ticks(self.cpus) is not None
        self.last: tuple[int, int, float] | None = None
        self.changes = 0  # how often the thread count moved (logged as cpu/threads_changes)

    def describe(self) -> str:
        if "OMP_NUM_THREADS" in os.environ:
            return f"{torch.get_num_threads()} CPU threads (OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']})"
        if not self.enabled:
            return f"{torch.get_num_threads()} CPU threads"
        return f"up to {self.max_threads} CPU threads, fewer while other processes keep cores busy"

    def sample(self) -> tuple[int, int, float]:
        return busy_ticks(self.cpus) or 0, process_tree_ticks(), time.monotonic()

    def threads_for(self, busy_cores: float) -> int:
        """The threads for ``busy_cores`` cores kept busy by others: the free cores, rounded to the
        nearest (a light background job costs no thread), at least 1 and at most ``max_threads``."""
        free = len(self.cpus) - busy_cores
        return max(1, min(self.max_threads, math.floor(free + 0.5)))

    def update(self) -> int:
        """At a step boundary: measure (at most once per ``interval``) and set the thread count;
        returns the threads now in use."""
        if not self.enabled:
            return torch.get_num_threads()
        now = self.sample()
        if self.last is None:
            self.last = now
            return torch.get_num_threads()
        if now[2] - self.last[2] < self.interval:
            return torch.get_num_threads()
        threads = self.threads_for(other_processes_busy_cores(self.last, now))
        self.last = now
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)
            self.changes += 1
        return threads
