"""The scoring process's hold on one sandbox's processes: the uid it runs as, finding and killing
whatever it started, waiting for its runner, and its standing with the kernel (first to die when memory
runs out, never above an ordinary priority)."""

from __future__ import annotations

import dataclasses
import math
import os
import secrets
import select
import shutil
import signal
import subprocess
import threading
import time

from . import cgroup as sandbox_cgroup

#: uids given to sandboxes when running as root: far above login users (and above the ranges
#: systemd-nspawn and rootless containers use). Each call draws a fresh one at random, unique within
#: this process; two scoring processes collide with odds of about one in a million per pair of
#: concurrent calls (then they share RLIMIT_NPROC and the final sweep of one kills the other).
UID_RANGE = (1_900_000_000, 1_900_000_000 + (1 << 20))

#: the environment variable that marks every process of a sandbox with its nonce
ENV_MARK = "LIT_GRPO_SANDBOX"
_NOBODY = 65534
_uid_lock = threading.Lock()
_uids_in_use: set[int] = set()


def _mapped_uid_range() -> tuple[int, int] | None:
    """UID_RANGE if this user namespace maps it entirely (for uid and gid), else None."""
    lo, hi = UID_RANGE
    for name in ("uid_map", "gid_map"):
        try:
            with open(f"/proc/self/{name}") as f:
                rows = [tuple(int(x) for x in line.split()) for line in f if line.strip()]
        except OSError:
            return None
        if not any(inner <= lo and hi <= inner + count for inner, _outer, count in rows):
            return None
    return UID_RANGE


def allocate_uid() -> tuple[int | None, bool]:
    """(uid to run the code as, whether that uid is this sandbox's alone); (None, False) if not root."""
    if os.geteuid() != 0:
        return None, False
    rng = _mapped_uid_range()
    if rng is None:  # a user namespace that maps few ids: share `nobody`
        return _NOBODY, False
    with _uid_lock:
        while True:
            uid = rng[0] + secrets.randbelow(rng[1] - rng[0])
            if uid not in _uids_in_use:
                _uids_in_use.add(uid)
                return uid, True


def release_uid(uid: int | None) -> None:
    if uid is not None:
        with _uid_lock:
            _uids_in_use.discard(uid)


_KILL = shutil.which("kill", path="/usr/bin:/bin")


def _pids_of_uid(uid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    pids.append(int(entry))
            except OSError:
                pass
    return pids


def _pids_with_mark(nonce: str) -> list[int]:
    needle = f"{ENV_MARK}={nonce}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        pids.append(int(entry))
            except OSError:
                pass
    return pids


def _kill_pids(find) -> None:
    for _ in range(50):
        pids = find()
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.01)


def _kill_uid(uid: int) -> None:
    """SIGKILL every process of ``uid``: ``kill(-1)`` run as that uid is one atomic kernel sweep."""
    if _KILL:
        try:
            subprocess.run([_KILL, "-s", "KILL", "--", "-1"], user=uid, group=uid, extra_groups=[],
                           env={}, cwd="/", stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, timeout=10, check=False)
        except (OSError, subprocess.SubprocessError):
            pass
    _kill_pids(lambda: _pids_of_uid(uid))  # fallback / belt and braces: whatever is still there


@dataclasses.dataclass
class SandboxProcesses:
    """What the scoring process needs to find and remove everything one sandbox made."""

    nonce: str
    uid: int | None
    own_uid: bool
    cgroup: sandbox_cgroup.SandboxCgroup | None = None
    proc: subprocess.Popen | None = None

    def leftovers(self) -> list[int]:
        if self.cgroup is not None:
            return self.cgroup.procs()
        if self.own_uid:
            return _pids_of_uid(self.uid)
        return _pids_with_mark(self.nonce)

    def kill_all(self) -> None:
        if self.cgroup is not None:
            self.cgroup.kill()
        if self.own_uid:
            _kill_uid(self.uid)
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # the runner and whatever stayed in its group
            except OSError:
                pass
        if not self.own_uid:  # same uid as us (or root): find the leftovers by the mark in their environment
            _kill_pids(lambda: _pids_with_mark(self.nonce))
        if self.cgroup is not None:
            _kill_pids(self.cgroup.procs)


def wait_for_exit(proc: subprocess.Popen, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for the runner to exit; True if it did. Wakes up at once (pidfd)."""
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):  # Python < 3.9 or Linux < 5.3: Popen's polling wait
        try:
            proc.wait(timeout=max(0.0, timeout))
            return True
        except subprocess.TimeoutExpired:
            return False
    try:
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or poller.poll(max(1, int(math.ceil(left * 1000)))):
                break
        if proc.poll() is None:
            return False
        return True
    finally:
        os.close(pidfd)


#: oom_score_adj of every sandbox process: the most, so that the kernel's out-of-memory killer takes a
#: sandbox before anything else on the machine. By size alone (its ranking) the largest process dies
#: first: the trainer (gigabytes), not a sandbox holding up to memory_mb in each of max_processes
#: processes, where no cgroup bounds the whole, or many sandboxes at once.
OOM_SCORE_ADJ = 1000


def kill_first_when_out_of_memory(pid: int) -> bool:
    """Make process ``pid`` (and what it starts) the out-of-memory killer's first choice; False if the
    kernel refused. Raising it needs no privilege."""
    try:
        with open(f"/proc/{pid}/oom_score_adj", "w") as f:
            f.write(str(OOM_SCORE_ADJ))
        return True
    except OSError:
        return False


_ORDINARY_POLICIES = {getattr(os, name) for name in ("SCHED_OTHER", "SCHED_BATCH", "SCHED_IDLE") if hasattr(os, name)}


def run_at_normal_priority(pid: int) -> bool:
    """Make process ``pid`` (and what it starts) schedule like any ordinary process: never above the
    machine's others, whatever the scoring thread runs at (a child inherits its thread's real-time
    policy and nice value). False if the kernel refused. Lowering one's own priority needs no privilege."""
    try:
        if os.sched_getscheduler(pid) & ~getattr(os, "SCHED_RESET_ON_FORK", 0) not in _ORDINARY_POLICIES:
            os.sched_setscheduler(pid, os.SCHED_OTHER, os.sched_param(0))
        if os.getpriority(os.PRIO_PROCESS, pid) < 0:
            os.setpriority(os.PRIO_PROCESS, pid, 0)
        return True
    except (AttributeError, OSError):
        return False
