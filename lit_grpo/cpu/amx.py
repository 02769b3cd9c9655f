"""Permission to use Intel AMX in this process (Linux), which vLLM's CPU attention needs."""

from __future__ import annotations

__all__ = ["request_amx_permission"]


def request_amx_permission() -> bool:
    """Ask Linux for permission to use AMX tile data in this process (``arch_prctl(ARCH_REQ_XCOMP_PERM,
    XFEATURE_XTILEDATA)``); True when granted (or already).

    Since Linux 5.16 a process must request it before its first AMX instruction or die with SIGILL.
    vLLM's CPU attention picks its AMX kernel for bfloat16 when the CPU reports AMX and does not ask
    (oneDNN asks only for its own kernels): on these machines a bfloat16 engine was killed by
    "Illegal instruction" at the first forward pass until this was called. Harmless elsewhere.
    """
    import ctypes
    import platform

    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return False
    SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA = 158, 0x1023, 18
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):  # pragma: no cover
        return False
