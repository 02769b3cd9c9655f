"""How PyTorch's CPU threads wait between parallel regions, chosen before torch is imported.

PyTorch runs its CPU kernels on an OpenMP thread pool (GNU libgomp in the Linux wheels). By default
a pool thread that reaches a barrier first *spins* for a while (libgomp: up to 300,000 iterations)
before it sleeps, betting that its siblings finish at once. On a machine to itself that saves a
wake-up per region. On a machine shared with another job, the bet loses: a sibling preempted by the
other job leaves the rest of the pool spinning on the cores it needs, at every one of the thousands
of small regions of a step. On an Intel Xeon the quickstart beside one busy 2-thread process ran
35x slower than alone with torch's defaults (bench/README.md, "The quickstart on a shared CPU"; on
the AMD EPYC measured there the spin count made no difference, quiet or busy).

So lit-grpo lets the pool spin only briefly, :data:`SPIN_COUNT` iterations (``GOMP_SPINCOUNT``;
``OMP_WAIT_POLICY`` is left unset so that libgomp still spins that long), then sleep. libgomp reads
the variable once, when torch loads it: :func:`choose_wait_policy` runs from ``lit_grpo/__init__``,
before lit-grpo imports torch. A value the user set (``GOMP_SPINCOUNT`` or ``OMP_WAIT_POLICY``) wins;
in a process that imported torch before lit-grpo the pool already runs with torch's default, which
:func:`wait_policy` then reports.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

__all__ = ["SPIN_COUNT", "choose_wait_policy", "wait_policy"]

SPIN_COUNT = 10_000  # about 10-50 microseconds of spinning at a barrier before the thread sleeps
_chosen: str | None = None  # what choose_wait_policy did, for wait_policy


def choose_wait_policy(environ: MutableMapping[str, str] = os.environ, torch_loaded: bool | None = None) -> str:
    """Set ``GOMP_SPINCOUNT`` unless the user chose a wait policy; returns what the run's OpenMP
    threads will do, in words (for the start-of-run summary and the README)."""
    global _chosen
    torch_loaded = "torch" in sys.modules if torch_loaded is None else torch_loaded
    if "GOMP_SPINCOUNT" in environ or "OMP_WAIT_POLICY" in environ:
        chosen = ", ".join(f"{name}={environ[name]}" for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if name in environ)
        _chosen = f"{chosen} (set by the user)"
    elif torch_loaded:
        _chosen = "torch's default (torch was imported before lit_grpo; set GOMP_SPINCOUNT before importing torch)"
    else:
        environ["GOMP_SPINCOUNT"] = str(SPIN_COUNT)
        _chosen = f"GOMP_SPINCOUNT={SPIN_COUNT} (spin briefly, then sleep: a shared CPU does not stall the run)"
    return _chosen


def wait_policy() -> str:
    """What :func:`choose_wait_policy` chose for this process."""
    return _chosen or "torch's default"
