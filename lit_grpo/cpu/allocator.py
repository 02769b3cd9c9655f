"""Keep freed CPU memory in the process for reuse, instead of handing it back to the OS.

PyTorch's CPU tensors come from the C library's ``malloc``. glibc serves blocks above its mmap
threshold (128 KiB, raised as mapped blocks are freed) with fresh ``mmap`` pages and returns the top
of its heap to the OS once more than twice that is free there. A GRPO step allocates and frees
activations, caches and logits of changing sizes again and again, so with these defaults each
step faults many of the same pages in once more: 5,000-45,000 page faults per step of a
4M-parameter run at L = 32 (at 1-2 microseconds each in a virtual machine), against about 300
(bf16) and 10 (float32) with this setting, 4-6 % of the step time (bench/README.md at d59a9c4).

:func:`keep_freed_memory` sets glibc's mmap threshold to its maximum (32 MiB) and its trim
threshold to 2 GiB, so blocks up to 32 MiB come from the heap and freed ones stay there for the
next step, as PyTorch's CUDA caching allocator keeps GPU memory. The peak resident memory stays
what the steps need (the freed pages are the ones the next step touches again; measured within 4 % of
the defaults); the process just does not shrink between steps. ``GRPOModule`` calls it when a run on
the CPU starts. ``LIT_GRPO_KEEP_FREED_MEMORY=0`` turns it off; glibc settings of the user's own
(``MALLOC_*_`` variables, ``glibc.malloc`` tunables) are left alone.
"""

from __future__ import annotations

import ctypes
import os
import platform

ENV = "LIT_GRPO_KEEP_FREED_MEMORY"
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)
MMAP_THRESHOLD = 32 * 2**20  # the largest mmap threshold glibc accepts on 64-bit systems
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes a C int
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")

_applied = False


def uses_glibc() -> bool:
    """Whether this process's ``malloc`` is glibc's (the only one these settings are for)."""
    return platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def keep_freed_memory() -> str:
    """Apply the settings above once per process; says what happened (for logs and tests)."""
    global _applied
    if _applied:
        return "already set"
    if os.environ.get(ENV, "1") == "0":
        return f"off ({ENV}=0)"
    user = [name for name in USER_SETTINGS if name in os.environ]
    if "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        user.append("GLIBC_TUNABLES")
    if user:
        return f"left to the user's settings ({', '.join(user)})"
    if not uses_glibc():
        return "not glibc"
    libc = ctypes.CDLL(None)
    if not (libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        return "mallopt refused"
    _applied = True
    return "set"
