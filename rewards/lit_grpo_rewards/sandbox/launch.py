"""Run untrusted Python (model-written code) in a throw-away, walled-in pair of processes.

``run_in_sandbox(code, tests=[...])`` runs one program and reports, test by test, which assertions
held; ``run_in_sandbox(code, stdin=b"...")`` runs it as a stdin/stdout program. Each call starts one
``python -I -S -B`` subprocess (``-S`` unless ``site_packages=True``) running the runner
(``_sandbox_runner``) in a fresh directory made with ``tempfile.mkdtemp(prefix="lit-grpo-sandbox-")``;
it forks into the *program process* and the *judge*. Linux only. No preexec_fn is used (it is unsafe with threads),
so calls may run concurrently from threads; each call is independent.

Threat model: the program is hostile. It may be written to escape, to damage the machine, to
outlive the call, to read what it should not, or to score tests it fails; the tests themselves and
the interpreter are trusted. Layers, outermost first. The kernel-enforced ones are the wall; the
audit hook is a tripwire. Which layers took effect is reported per run (``SandboxResult.layers``);
a missing one is logged once per process as a warning naming the protection that is gone
(``sandbox_layers()`` probes them).

1. **Wall-clock timeout and cleanup (always).** The runner starts in a new session with a minimal
   environment and only its stdio, one result descriptor and (tests) one tests descriptor open.
   The scoring process waits on a pidfd (no polling). When the sandbox is over, the judge sweeps
   with ``kill(-1, SIGKILL)`` as the sandbox's own uid (one atomic kernel operation: a fork bomb
   cannot outrun it; without root it kills the PID namespace's init, which takes the namespace
   along); then the scoring process checks that the sandbox's cgroup (or, without one,
   its uid) has no process left and sweeps again if it has (at the deadline: ``kill -1`` run as
   that uid, ``cgroup.kill``, the process group), reaps the runner and removes the directory and
   the cgroup. Without root (no uid of its own) the leftovers are found by a per-run mark in their
   environment. Every process of the sandbox also gets a parent-death signal, is the
   out-of-memory killer's first choice (``oom_score_adj`` 1000) and runs at an ordinary scheduling
   priority whatever the scoring thread runs at. Output goes to anonymous memory files (``memfd``),
   never to pipes (bounded by layer 5; ``fallocate`` is refused by layer 7) nor to the scoring
   process's disk; stdin is an anonymous memory file open for reading only, mode 0400 (it cannot be
   reopened for writing through ``/proc/self/fd/0``).
2. **Cgroup (where the machine lets this process create one: root, or a delegated cgroup v2; see**
   ``_sandbox_cgroup`` **).**
   Memory of the whole sandbox (``memory_mb`` plus ``SANDBOX_OVERHEAD_MB`` for its two
   interpreters; shared memory and the scratch tmpfs count) and its number of processes and
   threads, whatever the program forks; and its disk reads (where ``io``/``blkio`` can be used:
   ``_sandbox_cgroup.DISK_READ_BYTES_PER_S``). Without it, memory is bounded per process only.
3. **Namespaces.** Network: only a loopback interface, down. IPC. PID: the program is process 1
   of its own namespace, in a session and process group of its own (a signal to the caller's group,
   ``kill(0, ...)``, crosses PID namespaces), sees only its own processes in a fresh ``/proc``,
   cannot see or signal the judge or the trainer, and when it dies the kernel kills everything it
   started. Mount (layer
   4). Without root they are made inside a new user namespace, where the system allows
   unprivileged ones (most do), with the user's uid mapped to itself; the capabilities that
   namespace gave are dropped (a nested user namespace) before any code runs.
4. **File system (in a private mount namespace).** The root is a small tmpfs holding only
   what a Python program needs, bound read-only from the machine: ``/usr``, ``/bin``, ``/lib*``, a
   few files of ``/etc`` (loader cache, time zone, users, hosts, certificates), the interpreter's
   installation and import path, the directories of the shared libraries it has loaded; a fresh
   ``/proc``; a ``/dev`` with only ``null``, ``zero``, ``random`` and ``urandom`` (no ``/dev/shm``,
   terminals or GPUs); an empty ``/tmp``; and the sandbox directory, a small tmpfs (``scratch_mb``)
   owned by the sandbox uid: the only writable place (its pages are memory, charged to the
   cgroup). Home directories, data sets, ``/run``'s sockets, ``/sys`` and ``/var`` are not there.
   Every mount is read-only and nosuid. (Where ``pivot_root`` fails, the machine's whole tree is
   shown read-only instead, with a warning.)
5. **Resource limits (always).** RLIMIT_AS and RLIMIT_DATA (``memory_mb``), RLIMIT_CPU, RLIMIT_FSIZE
   (``max_output_bytes``: the largest file, stdout included), RLIMIT_NOFILE (64), RLIMIT_NPROC
   (``max_processes``, plus the judge and its child for a trusting test), RLIMIT_CORE, RLIMIT_MEMLOCK and RLIMIT_MSGQUEUE 0.
6. **Unprivileged identity (root).** The program and the judge run under a uid/gid drawn at random
   from ``UID_RANGE`` for this call alone (owning no file), with no supplementary groups and
   ``PR_SET_NO_NEW_PRIVS``; so RLIMIT_NPROC holds and counts only this sandbox, sandboxes cannot
   signal each other, and file permissions apply. The judge is also non-dumpable: no process of
   the same uid can ptrace it, read its memory or open its descriptors.
7. **System-call filter (seccomp, Linux x86_64/aarch64; both processes).** Deny by default: only the
   calls a Python test program needs (see ``_sandbox_seccomp``). No sockets (Unix sockets at a
   path included), no SysV IPC, no memfd, no keyring, no namespaces or mounts, no ptrace, bpf,
   perf, io_uring or userfaultfd, no ``execve``, no ``fallocate`` (it allocates past the end of a
   file, beyond RLIMIT_FSIZE); nothing that watches or marks the machine's files for others to see:
   file locks succeed and lock nothing, no leases or ``F_NOTIFY``, no page-cache eviction
   (``POSIX_FADV_DONTNEED`` is ignored) or ``RWF_NOWAIT`` probe; nothing that makes the machine's
   disk work for it: the sync calls succeed and do nothing, ``O_DIRECT`` and ``RWF_DONTCACHE`` are
   refused.
8. **The judge (assertion tests).** The tests run in the judge process, which receives what the
   program hands over as plain data and compares it with its own types (see ``_sandbox_judge``):
   a lying ``__eq__``, a patched ``AssertionError`` or ``exec``, ``os._exit(0)`` before the tests,
   printed markers or writes to any descriptor cannot make a test pass; a global named like a
   standard-library module that a test reads attributes of is the judge's own module, whatever the
   program bound to it. Nothing the judge hands the program leads into the judge's interpreter (no
   frames, code, globals, builtins or modules). Only the judge holds the result descriptor.
   Stdin/stdout tests are judged by the scoring process, which compares the output in place
   (``code._output_matches``: linear time, no object per line).
9. **Audit hook (in the program's interpreter; unless ``audit_hook=False``).** Refuses sockets,
   ``fork``/``exec``/``subprocess``, ``kill``, ctypes, ``gc`` object walks, and writes or renames
   outside the sandbox directory, as clean Python exceptions. It can be switched off by code that
   tries (it lives in the program's interpreter); everything above holds without it.

What remains possible is listed in ``rewards/README.md`` (CPU time up to the limits, the machine's
name and kernel, what a test itself asks the program, ...).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import marshal
import math
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable

from lit_grpo_rewards import _sandbox_cgroup

__all__ = ["LAYERS", "SANDBOX_OVERHEAD_MB", "SandboxResult", "UID_RANGE", "run_in_sandbox", "sandbox_layers"]

log = logging.getLogger(__name__)

_HERE = os.path.dirname(os.path.abspath(__file__))
_RUNNER_MODULES = ("_sandbox_seccomp", "_sandbox_judge", "_sandbox_runner")  # in import order

#: ``python -c BOOTSTRAP HERE JOB ...``: read the job; load the runner and its helpers from the byte
#: code in it (compiled once by this process) or else import them from this directory, which then
#: leaves ``sys.path`` again (its modules, ``code.py`` among them, must not shadow the standard
#: library's); run.
BOOTSTRAP = """
import marshal, sys
with open(sys.argv[2], "rb") as f:
    job = marshal.load(f)
modules = job.pop("modules", None)
if modules:
    for name, code in modules:
        sys.modules[name] = module = type(sys)(name)
        exec(code, module.__dict__)
else:
    sys.path.insert(0, sys.argv[1])
    import _sandbox_runner
    del sys.path[0]
sys.modules["_sandbox_runner"].main(sys.argv[1:], job)
"""
_bytecode_lock = threading.Lock()
_bytecode: list | None = None


def _runner_bytecode(python: str) -> list | None:
    """[(module name, code object)] of the runner, compiled once per process, for a sandbox whose
    interpreter is this one (byte code is version-specific); None for another interpreter.

    Saves each sandbox compiling its ~1,300 lines of source (no ``.pyc`` is written where
    ``PYTHONDONTWRITEBYTECODE`` is set, and the sandbox runs with ``-B``)."""
    global _bytecode
    if os.path.realpath(python) != os.path.realpath(sys.executable):
        return None
    with _bytecode_lock:
        if _bytecode is None:
            compiled = []
            for name in _RUNNER_MODULES:
                path = os.path.join(_HERE, name + ".py")
                with open(path, "rb") as f:
                    compiled.append((name, compile(f.read(), path, "exec", dont_inherit=True)))
            _bytecode = compiled
        return _bytecode

#: uids given to sandboxes when running as root: far above login users (and above the ranges
#: systemd-nspawn and rootless containers use). Each call draws a fresh one at random, unique within
#: this process; two scoring processes collide with odds of about one in a million per pair of
#: concurrent calls (then they share RLIMIT_NPROC and the final sweep of one kills the other).
UID_RANGE = (1_900_000_000, 1_900_000_000 + (1 << 20))

#: memory the sandbox's cgroup allows on top of ``memory_mb``: the judge's and the program's own
#: interpreters (about 10 MiB each once running) and the kernel's bookkeeping.
SANDBOX_OVERHEAD_MB = 48

#: Every isolation layer, by the name the runner reports it under, with what is lost without it.
LAYERS = {
    "seccomp": "the system-call filter: the program may make any system call its uid may (Unix sockets "
               "at a path, SysV shared memory, memfd, the kernel keyring, user namespaces, ptrace, ...)",
    "cgroup": "the sandbox's cgroup: memory is bounded per process only (memory_mb for each of up to "
              "max_processes processes), not for the sandbox as a whole",
    "disk_read_limit": "the cgroup's limit on disk reads: a program that reads more of the machine's files "
                       "than its memory holds reads them from the disk on every pass, at the disk's full "
                       "speed, ahead of the trainer's checkpoints and data",
    "oom_first": "the out-of-memory killer's preference for the sandbox: when the machine runs out of memory "
                 "the kernel kills the largest process, the trainer, before a sandbox",
    "normal_priority": "the sandbox's ordinary scheduling: started from a thread with a real-time policy or a "
                       "negative nice value, the program inherits it, and its busy loops take the machine's CPUs "
                       "from every ordinary process (the trainer's other threads, servers, the shell)",
    "network_namespace": "the network namespace: only the system-call filter keeps the program off the network",
    "pid_namespace": "the PID namespace: the program sees the machine's processes and may outlive its "
                     "runner until the final sweep",
    "ipc_namespace": "the IPC namespace",
    "minimal_root": "the minimal root: the program sees the machine's whole file system (read-only) and may "
                    "read whatever its uid may there (home directories, data sets, sockets under /run)",
    "read_only_root": "the read-only file system: the program may write wherever its uid may",
    "scratch_tmpfs": "the scratch tmpfs: the program's files go to the disk, bounded per file only",
    "minimal_dev": "the minimal /dev: the program sees the machine's devices",
    "own_uid": "the sandbox's own uid: the program runs as the scoring process's user (the other layers "
               "keep it from that user's files and processes; without them it could read, write and signal "
               "whatever that user can)",
    "rlimits": "the resource limits",
    "separate_judge": "the separate judge: assertion tests run in the program's interpreter, where a "
                      "wrong program can forge a pass",
    "final_sweep": "the sweeps after a run that ended by itself (the judge's kill(-1) as the sandbox's uid, "
                   "the scoring process's check for leftovers): a process that left the PID namespace's "
                   "reach outlives the call (the deadline still kills everything)",
    "audit_hook": "the audit hook",
}

_ENV_MARK = "LIT_GRPO_SANDBOX"
_GRACE_S = 1.0
_NOBODY = 65534
_uid_lock = threading.Lock()
_uids_in_use: set[int] = set()
_warned_lock = threading.Lock()
_warned: set[str] = set()


@dataclasses.dataclass
class SandboxResult:
    """What one sandboxed run produced.

    ``test_results[i]`` is True/False for the tests that ran and None for those that never got to
    run (the program died, broke the judge protocol or ran out of time first). ``returncode`` is the
    runner's exit status: the program's (negative: the runner was killed by that signal, as at the
    deadline; 128 + N: the program was), or 0 when the judge ran every test. ``layers`` is the
    sandbox's own report of which isolation layers took effect (empty when it died before
    reporting). ``peak_memory_bytes``: the sandbox cgroup's peak, when there is one.
    """

    returncode: int | None
    timed_out: bool
    elapsed: float
    stdout: bytes = b""
    stderr: bytes = b""
    test_results: list[bool | None] = dataclasses.field(default_factory=list)
    completed: bool = False
    layers: dict = dataclasses.field(default_factory=dict)
    peak_memory_bytes: int | None = None


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


def _allocate_uid() -> tuple[int | None, bool]:
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


def _release_uid(uid: int | None) -> None:
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
    needle = f"{_ENV_MARK}={nonce}".encode()
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
class _Sandbox:
    """What the scoring process needs to find and remove everything one sandbox made."""

    nonce: str
    uid: int | None
    own_uid: bool
    cgroup: _sandbox_cgroup.SandboxCgroup | None = None
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


def _wait(proc: subprocess.Popen, timeout: float) -> bool:
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
#: processes beside the program's max_processes: the judge, and the child it judges a trusting test in
#: (issue 50.9), which the program must not be able to use up
JUDGE_PROCESSES = 2


def _kill_first_when_out_of_memory(pid: int) -> bool:
    """Make process ``pid`` (and what it starts) the out-of-memory killer's first choice; False if the
    kernel refused. Raising it needs no privilege."""
    try:
        with open(f"/proc/{pid}/oom_score_adj", "w") as f:
            f.write(str(OOM_SCORE_ADJ))
        return True
    except OSError:
        return False


_ORDINARY_POLICIES = {getattr(os, name) for name in ("SCHED_OTHER", "SCHED_BATCH", "SCHED_IDLE") if hasattr(os, name)}


def _run_at_normal_priority(pid: int) -> bool:
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


def _read_tail(f, limit: int) -> bytes:
    try:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - limit))
        return f.read()
    except (OSError, ValueError):
        return b""


def _read_head(f, limit: int) -> bytes:
    try:
        f.seek(0)
        return f.read(limit)
    except (OSError, ValueError):
        return b""


def _memory_file(name: str):
    """An anonymous file in memory (``memfd``; else an unlinked file on ``/dev/shm``), open for reading
    and writing: the sandbox's stdin, stdout, stderr and result files. Never a file of the scoring
    process's disk: the program could make that disk work for it (``fdatasync`` on its stdout, a
    reopening with ``O_SYNC``), and its pages are dirty page cache the disk must absorb. The size is
    bounded by RLIMIT_FSIZE (``max_output_bytes``) like any file the sandbox writes; its pages are
    charged to the sandbox's cgroup, which writes them."""
    try:
        fd = os.memfd_create(f"lit-grpo-sandbox-{name}", os.MFD_CLOEXEC)  # no MFD_ALLOW_SEALING: no seals
    except (AttributeError, OSError):
        return tempfile.TemporaryFile(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    return open(fd, "w+b")


def _read_only_file(data: bytes):
    """``data`` in an anonymous memory file, open for reading only, and readable only (mode 0400): the
    program's stdin. Neither that descriptor nor a reopening of it (``/proc/self/fd/0``) can write."""
    with _memory_file("stdin") as f:
        f.write(data)
        f.flush()
        os.fchmod(f.fileno(), 0o400)
        return open(f"/proc/self/fd/{f.fileno()}", "rb", buffering=0)


def _parse_results(raw: bytes, nonce: str, n_tests: int) -> tuple[list[bool | None], bool, dict]:
    results: list[bool | None] = [None] * n_tests
    done = False
    layers: dict = {}
    for line in raw.decode("utf-8", "replace").splitlines():
        parts = line.split(" ", 2)
        if len(parts) < 2 or parts[0] != nonce:
            continue
        kind = parts[1]
        if kind == "T" and len(parts) == 3:
            try:
                i, ok = (int(x) for x in parts[2].split())
            except ValueError:
                continue
            if 0 <= i < n_tests and results[i] is None:
                results[i] = ok == 1
        elif kind == "D":
            done = True
        elif kind == "L" and len(parts) == 3:
            try:
                layers.update(json.loads(parts[2]))
            except ValueError:
                pass
    return results, done, layers


def _check_layer_names(names: Iterable[str]) -> frozenset[str]:
    names = frozenset(names)
    unknown = sorted(names - set(LAYERS))
    if unknown:
        raise ValueError(f"unknown sandbox layer(s) {unknown}; the layers are {sorted(LAYERS)}")
    return names


def _warn_missing(layers: dict, without: frozenset[str], cgroup_reason: str) -> None:
    """Log once per process each layer that should have taken effect and did not."""
    if not layers:
        return
    for name, loss in LAYERS.items():
        if name in without or name == "final_sweep" or (name == "disk_read_limit" and not layers.get("cgroup")):
            continue
        present = layers.get(name)
        if name == "seccomp":
            present = present and layers.get("judge_seccomp", present)
        if present is False or (present is None and name in ("seccomp", "cgroup", "separate_judge")):
            with _warned_lock:
                if name in _warned:
                    continue
                _warned.add(name)
            detail = layers.get(f"{name}_error") or (cgroup_reason if name == "cgroup" else "")
            if os.geteuid() != 0 and name not in ("seccomp", "rlimits", "separate_judge", "audit_hook"):
                detail = detail or "needs root"
            log.warning("code sandbox: running without %s%s", loss, f" ({detail})" if detail else "")


def run_in_sandbox(
    code: str,
    *,
    tests: list[str] | None = None,
    stdin: bytes | str | None = None,
    timeout: float = 5.0,
    memory_mb: int = 512,
    cpu_seconds: int | None = None,
    max_output_bytes: int = 8 * 1024 * 1024,
    max_processes: int = 16,
    scratch_mb: int = 64,
    python: str | None = None,
    audit_hook: bool = True,
    site_packages: bool = False,
    _disable_layers: Iterable[str] = (),
) -> SandboxResult:
    """Run ``code`` once in a fresh sandbox and return what happened; never raises for the code's sake.

    With ``tests`` (Python statements, typically assertions) the code is executed as ``__main__``
    with stdin at EOF and stdout discarded, then each test runs in the judge, in a namespace made
    from the program's globals (see ``_sandbox_judge``); the result lists, test by test, whether it
    ran without raising. Without ``tests`` the code runs as a stdin/stdout program fed ``stdin``;
    its stdout (up to ``max_output_bytes``) and exit status are returned for the caller to judge.

    Args:
        timeout: wall-clock seconds for the whole run; the sandbox is killed at the deadline.
        memory_mb: address-space limit of each process (RLIMIT_AS) and, with a cgroup, the memory of
            the whole sandbox (plus ``SANDBOX_OVERHEAD_MB``).
        cpu_seconds: CPU-time limit per process; default ``ceil(timeout)``.
        max_output_bytes: the most the program may write to stdout, or to any one file, or hand to
            the tests in one value.
        max_processes: processes and threads of the program (RLIMIT_NPROC, and the cgroup's
            ``pids.max``; enforced when running as root).
        scratch_mb: size of the writable tmpfs on the sandbox directory.
        python: interpreter to run the code with; default ``sys.executable``.
        audit_hook: install the in-interpreter audit hook. Turn off only to test the other layers.
        site_packages: let the code import third-party packages (drops ``-S``).
        _disable_layers: names from ``LAYERS`` to leave out. For the attack tests only, which show
            that each attack succeeds without the layer that stops it.
    """
    if not sys.platform.startswith("linux"):
        raise RuntimeError("the code sandbox needs Linux")
    if timeout <= 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    without = _check_layer_names(_disable_layers) | ({"audit_hook"} if not audit_hook else frozenset())
    python = python or sys.executable
    cpu = int(math.ceil(timeout)) if cpu_seconds is None else int(cpu_seconds)
    nonce = secrets.token_hex(16)
    start = time.monotonic()
    uid, own_uid = _allocate_uid()
    box = _Sandbox(nonce=nonce, uid=uid, own_uid=own_uid and "own_uid" not in without)
    cgroup_reason = ""
    workdir = None
    files = []
    pipe_ends: list[int] = []
    timed_out = False
    swept = False  # the runner is reaped and nothing of the sandbox is left
    try:
        workdir = os.path.realpath(tempfile.mkdtemp(prefix="lit-grpo-sandbox-"))
        if uid is not None:
            os.chown(workdir, uid, uid)
        if "cgroup" not in without:
            try:
                box.cgroup = _sandbox_cgroup.create(
                    nonce, (int(memory_mb) + SANDBOX_OVERHEAD_MB) * 1024 * 1024, int(max_processes) + JUDGE_PROCESSES,
                    limit_disk_reads="disk_read_limit" not in without)
            except OSError as exc:
                cgroup_reason = str(exc)
        job_path = os.path.join(workdir, f".job-{nonce}.json")
        job = {
            "nonce": nonce, "code": code, "mode": "stdin" if tests is None else "tests",
            "dir": workdir, "uid": uid, "audit_hook": bool(audit_hook), "parent_pid": os.getpid(),
            "site_packages": bool(site_packages), "without": sorted(without),
            "cgroups": box.cgroup.dirs if box.cgroup is not None else [],
            "modules": _runner_bytecode(python),
            "limits": {
                "memory_bytes": int(memory_mb) * 1024 * 1024, "cpu_seconds": max(1, cpu),
                "file_bytes": int(max_output_bytes), "open_files": 64,
                "processes": int(max_processes) + JUDGE_PROCESSES,  # the judge shares the uid
                "scratch_kb": int(scratch_mb) * 1024, "message_bytes": int(max_output_bytes),
            },
        }
        fd = os.open(job_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(marshal.dumps(job, 4))  # format 4: read by any Python >= 3.4

        def memory_file(name):
            f = _memory_file(name)
            files.append(f)
            return f

        tests_fd = -1
        if tests is None:
            stdin_f = _read_only_file(stdin.encode() if isinstance(stdin, str) else (stdin or b""))
            files.append(stdin_f)
            stdout_f = memory_file("stdout")
        else:
            stdin_f = subprocess.DEVNULL
            stdout_f = subprocess.DEVNULL
            tests_f = memory_file("tests")  # read by the judge only, after the program process exists
            tests_f.write(marshal.dumps([str(t) for t in tests], 4))
            tests_f.flush()
            tests_f.seek(0)
            tests_fd = tests_f.fileno()
        stderr_f = memory_file("stderr")
        result_f = memory_file("result")
        go_read, go_write = os.pipe()
        pipe_ends = [go_read, go_write]
        env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir,
            "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", _ENV_MARK: nonce,
            # numerical libraries start a thread per core unless told otherwise: past max_processes
            "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
        }
        argv = [python, "-I", "-B", "-X", "utf8"] + ([] if site_packages else ["-S"])
        argv += ["-c", BOOTSTRAP, _HERE, job_path, str(result_f.fileno()), str(tests_fd), str(go_read)]
        box.proc = subprocess.Popen(
            argv, cwd=workdir, env=env, stdin=stdin_f, stdout=stdout_f, stderr=stderr_f,
            pass_fds=tuple(fd for fd in (result_f.fileno(), tests_fd, go_read) if fd >= 0),
            start_new_session=True, close_fds=True,
        )
        os.close(go_read)
        pipe_ends.remove(go_read)
        # First to die when the machine runs out of memory, at an ordinary priority (every process of
        # the sandbox inherits both), and into the cgroup, while the runner starts its interpreter; it
        # waits for the answer before it does anything else. (cgroup v1 migration waits out an RCU
        # grace period: ~10 ms.)
        oom_first = "oom_first" not in without and _kill_first_when_out_of_memory(box.proc.pid)
        normal_priority = "normal_priority" not in without and _run_at_normal_priority(box.proc.pid)
        joined = box.cgroup is not None and box.cgroup.add(box.proc.pid)
        try:
            os.write(go_write, b"1" if joined else b"0")
        except OSError:  # the runner is already gone (it could not start): reported below as such
            pass
        os.close(go_write)
        pipe_ends.remove(go_write)
        timed_out = not _wait(box.proc, timeout - (time.monotonic() - start))
        if timed_out or ("final_sweep" not in without and box.leftovers()):
            box.kill_all()
        try:
            box.proc.wait(timeout=_GRACE_S)
            swept = True
        except subprocess.TimeoutExpired:
            pass
        n = len(tests) if tests is not None else 0
        results, done, layers = _parse_results(_read_head(result_f, 1 << 20), nonce, n)
        if layers:  # the scoring process's own layers, beside the sandbox's report
            layers["oom_first"] = oom_first
            layers["normal_priority"] = normal_priority
            layers["disk_read_limit"] = box.cgroup is not None and box.cgroup.disk_reads_limited
        _warn_missing(layers, without, cgroup_reason or _sandbox_cgroup.support().reason)
        return SandboxResult(
            returncode=box.proc.returncode,
            timed_out=timed_out,
            elapsed=time.monotonic() - start,
            stdout=_read_head(stdout_f, max_output_bytes) if tests is None else b"",
            stderr=_read_tail(stderr_f, 8192),
            test_results=results,
            completed=done and not timed_out,
            layers=layers,
            peak_memory_bytes=box.cgroup.peak_memory_bytes() if box.cgroup is not None else None,
        )
    finally:
        if box.proc is not None and not swept:
            box.kill_all()
            try:
                box.proc.wait(timeout=_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
        if box.cgroup is not None and not box.cgroup.remove():
            log.warning("code sandbox: could not remove cgroup %s", box.cgroup.dirs)
        for f in files:
            f.close()
        for fd in pipe_ends:
            os.close(fd)
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)
        if own_uid:
            _release_uid(uid)


def sandbox_layers(python: str | None = None) -> dict:
    """Which isolation layers take effect on this machine, as reported from inside a sandbox."""
    return run_in_sandbox("pass", tests=[], timeout=10.0, python=python).layers
