"""Run untrusted Python (model-written code) in a throw-away, resource-limited subprocess.

``run_in_sandbox(code, tests=[...])`` runs one program and reports, test by test, which assertions
held; ``run_in_sandbox(code, stdin=b"...")`` runs it as a stdin/stdout program. Each call starts one
``python -I -S -B`` subprocess (``-S`` unless ``site_packages=True``) running ``_sandbox_runner.py`` in a fresh directory made with
``tempfile.mkdtemp(prefix="lit-grpo-sandbox-")``. Linux only. No preexec_fn is used (it is unsafe
with threads), so calls may run concurrently from threads; each call is independent.

Layers, outermost first, and what each is worth. The kernel-enforced ones are the wall; the audit
hook is a tripwire for the obvious cases. Which layers actually took effect is reported per run
(``SandboxResult.layers``); ``sandbox_layers()`` probes them once.

1. **Wall-clock timeout and cleanup (parent side; always).** The runner starts in a new session
   (``start_new_session=True``), with a minimal environment (``HOME`` and ``TMPDIR`` = the sandbox
   directory, a short ``PATH``, no proxies, nothing inherited) and only its stdio plus one result
   descriptor open. At the deadline, and again after every run whatever happened, the parent kills
   every process of the sandbox's uid (``kill -KILL -1`` executed *as that uid*, which the kernel
   applies atomically, so a fork bomb cannot outrun it), then the process group, then reaps the
   runner and removes the directory. Without root (no uid of its own) the leftovers are found by
   a per-run marker in their environment (``/proc/PID/environ``), which only code that rewrites
   its own initial environment in memory (ctypes, refused by layer 6) could hide. The runner and the code also get a parent-death signal, so
   a scoring process that is itself killed takes its sandboxes along (their empty directories
   then stay behind). Output goes to anonymous temporary files, never to pipes, so a chatty
   program can neither block nor fill the parent's memory (file size is capped, layer 4).
2. **Namespaces (root; verified on the development machine).** New network namespace: only a
   loopback interface, and it is down, so every ``connect``/``sendto`` fails with ENETUNREACH,
   127.0.0.1 included. New IPC namespace. New PID namespace: the code runs as process 1 of its own
   namespace, sees only its own processes in a fresh ``/proc``, and when it dies the kernel kills
   and reaps everything it started. Without root the runner tries an unprivileged user + network
   namespace (it worked on the development machine as an ordinary user; some distributions and
   container runtimes disable it); without either, only the audit hook stands between the code
   and the network.
3. **Read-only filesystem (root only).** In a private mount namespace every mount is made
   read-only and nosuid (``mount_setattr(AT_RECURSIVE)``, with a per-mount remount fallback), and
   a small tmpfs (64 MiB by default) owned by the sandbox uid is mounted on the sandbox directory:
   it is the only writable place (``/tmp``, ``/dev/shm`` and ``$HOME`` are read-only), and what is
   written there lives in memory and vanishes with the namespace. When the interpreter lives under
   a root-only directory (pyenv under ``/root``), a tmpfs is mounted over that directory in the
   sandbox's view and the installation bound back, so the rest of it is hidden.
4. **Resource limits (always).** RLIMIT_AS and RLIMIT_DATA (``memory_mb``, per process),
   RLIMIT_CPU (``cpu_seconds`` soft, +1 s hard), RLIMIT_FSIZE (``max_output_bytes``: the largest
   file, stdout included), RLIMIT_NOFILE (64), RLIMIT_NPROC (``max_processes``), RLIMIT_CORE 0.
   Limits are per process: a program that forks may use up to ``max_processes x memory_mb`` in
   total; there is no cgroup (the machine's cgroups belong to whoever runs this process).
5. **Unprivileged identity (root only).** The code runs under its own uid/gid, chosen at random
   from ``UID_RANGE`` for each call and owning no file, with no supplementary groups and
   ``PR_SET_NO_NEW_PRIVS`` (setuid binaries do not elevate). So RLIMIT_NPROC is enforced (root
   ignores it) and counts only this sandbox's processes and threads, concurrent sandboxes cannot
   signal each other, and ordinary file permissions apply. As non-root, the code runs under the
   caller's uid: RLIMIT_NPROC then counts all of that user's processes, and the code can touch
   whatever the caller can (layer 3 needs root: without it the sandbox directory is an ordinary
   directory, bounded only per file by RLIMIT_FSIZE).
6. **Audit hook (in the interpreter; always unless ``audit_hook=False``).** Installed just before
   the code runs; refuses sockets, ``fork``/``exec``/``posix_spawn``/``system``/``subprocess``,
   ``kill``, ctypes, ``gc.get_objects``/``get_referrers``, and writes or renames outside the
   sandbox directory. Audit hooks can be bypassed by code that tries hard enough (they only see
   what CPython reports); they turn the common accidents into clean Python exceptions.

The per-test results travel on a dedicated descriptor (not stdout), each line tagged with a random
nonce that the code is not given. Code running in the same interpreter as its tests can still,
with deliberate effort, forge them (or define objects that compare equal to anything): rewards
from assertions are only as trustworthy as the policy is unmotivated to attack the harness.
Stdin/stdout tests are judged by the parent and cannot be forged that way.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

__all__ = ["SandboxResult", "UID_RANGE", "run_in_sandbox", "sandbox_layers"]

_RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sandbox_runner.py")

#: uids given to sandboxes when running as root: far above login users (and above the ranges
#: systemd-nspawn and rootless containers use). Each call draws a fresh one at random, unique within
#: this process; two scoring processes collide with odds of about one in a million per pair of
#: concurrent calls (then they share RLIMIT_NPROC and the final sweep of one kills the other).
UID_RANGE = (1_900_000_000, 1_900_000_000 + (1 << 20))

_ENV_MARK = "LIT_GRPO_SANDBOX"
_GRACE_S = 1.0
_NOBODY = 65534
_uid_lock = threading.Lock()
_uids_in_use: set[int] = set()


@dataclasses.dataclass
class SandboxResult:
    """What one sandboxed run produced.

    ``test_results[i]`` is True/False for the tests that ran and None for those that never got to
    run (the program died or ran out of time first). ``returncode`` is the runner's exit status
    (negative: the runner was killed by that signal, as at the deadline; 128 + N: the code was). ``layers`` is the runner's own report of which isolation
    layers took effect (empty when it died before reporting).
    """

    returncode: int | None
    timed_out: bool
    elapsed: float
    stdout: bytes = b""
    stderr: bytes = b""
    test_results: list[bool | None] = dataclasses.field(default_factory=list)
    completed: bool = False
    layers: dict = dataclasses.field(default_factory=dict)


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


def _kill_uid(uid: int) -> None:
    """SIGKILL every process of ``uid``: ``kill(-1)`` run as that uid is one atomic kernel sweep."""
    if _KILL:
        try:
            subprocess.run([_KILL, "-s", "KILL", "--", "-1"], user=uid, group=uid, extra_groups=[],
                           env={}, cwd="/", stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, timeout=10, check=False)
        except (OSError, subprocess.SubprocessError):
            pass
    for _ in range(50):  # fallback / belt and braces: whatever is still there
        pids = _pids_of_uid(uid)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.01)


def _kill_all(proc: subprocess.Popen, uid: int | None, nonce: str) -> None:
    if uid is not None:
        _kill_uid(uid)
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the runner and whatever stayed in its group
    except OSError:
        pass
    if uid is None:  # same uid as us: find the leftovers by the mark in their environment
        for _ in range(50):
            pids = _pids_with_mark(nonce)
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            time.sleep(0.01)


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
        elif kind == "L" and len(parts) == 3 and not layers:
            try:
                layers = json.loads(parts[2])
            except ValueError:
                pass
    return results, done, layers


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
) -> SandboxResult:
    """Run ``code`` once in a fresh sandbox and return what happened; never raises for the code's sake.

    With ``tests`` (Python statements, typically assertions) the code is executed as ``__main__``
    with stdin at EOF and stdout discarded, then each test in the same namespace; the result lists,
    test by test, whether it ran without raising. Without ``tests`` the code runs as a
    stdin/stdout program fed ``stdin``; its stdout (up to ``max_output_bytes``) and exit status are
    returned for the caller to judge.

    Args:
        timeout: wall-clock seconds for the whole run; the sandbox is killed at the deadline.
        memory_mb: address-space limit per process (RLIMIT_AS).
        cpu_seconds: CPU-time limit per process; default ``ceil(timeout)``.
        max_output_bytes: the most the program may write to stdout, or to any one file.
        max_processes: RLIMIT_NPROC (processes and threads; enforced only when running as root).
        scratch_mb: size of the writable tmpfs on the sandbox directory (root only).
        python: interpreter to run the code with; default ``sys.executable``.
        audit_hook: install the in-interpreter audit hook (layer 6). Turn off only to test the
            kernel-enforced layers alone.
        site_packages: let the code import third-party packages (drops ``-S``).
    """
    if not sys.platform.startswith("linux"):
        raise RuntimeError("the code sandbox needs Linux")
    if timeout <= 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    python = python or sys.executable
    cpu = int(math.ceil(timeout)) if cpu_seconds is None else int(cpu_seconds)
    nonce = secrets.token_hex(16)
    start = time.monotonic()
    uid, own_uid = _allocate_uid()
    workdir = None
    files = []
    proc = None
    timed_out = False
    try:
        workdir = os.path.realpath(tempfile.mkdtemp(prefix="lit-grpo-sandbox-"))
        if uid is not None:
            os.chown(workdir, uid, uid)
        job_path = os.path.join(workdir, f".job-{nonce}.json")
        job = {
            "nonce": nonce, "code": code, "tests": None if tests is None else [str(t) for t in tests],
            "dir": workdir, "uid": uid, "audit_hook": bool(audit_hook), "parent_pid": os.getpid(),
            "limits": {
                "memory_bytes": int(memory_mb) * 1024 * 1024, "cpu_seconds": max(1, cpu),
                "file_bytes": int(max_output_bytes), "open_files": 64, "processes": int(max_processes),
                "scratch_kb": int(scratch_mb) * 1024,
            },
        }
        fd = os.open(job_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(job, f)

        def tmpfile():
            f = tempfile.TemporaryFile()
            files.append(f)
            return f

        if tests is None:
            stdin_f = tmpfile()
            data = stdin.encode() if isinstance(stdin, str) else (stdin or b"")
            stdin_f.write(data)
            stdin_f.flush()
            stdin_f.seek(0)
            stdout_f = tmpfile()
        else:
            stdin_f = subprocess.DEVNULL
            stdout_f = subprocess.DEVNULL
        stderr_f = tmpfile()
        result_f = tmpfile()
        env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir,
            "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", _ENV_MARK: nonce,
        }
        argv = [python, "-I", "-B", "-X", "utf8"] + ([] if site_packages else ["-S"])
        argv += [_RUNNER, job_path, str(result_f.fileno())]
        proc = subprocess.Popen(
            argv, cwd=workdir, env=env, stdin=stdin_f, stdout=stdout_f, stderr=stderr_f,
            pass_fds=(result_f.fileno(),), start_new_session=True, close_fds=True,
        )
        try:
            proc.wait(timeout=max(0.0, timeout - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            timed_out = True
        _kill_all(proc, uid if own_uid else None, nonce)
        try:
            proc.wait(timeout=_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
        n = len(tests) if tests is not None else 0
        raw = _read_head(result_f, 1 << 20)
        results, done, layers = _parse_results(raw, nonce, n)
        return SandboxResult(
            returncode=proc.returncode,
            timed_out=timed_out,
            elapsed=time.monotonic() - start,
            stdout=_read_head(stdout_f, max_output_bytes) if tests is None else b"",
            stderr=_read_tail(stderr_f, 8192),
            test_results=results,
            completed=done and not timed_out,
            layers=layers,
        )
    finally:
        if proc is not None and proc.returncode is None:
            _kill_all(proc, uid if own_uid else None, nonce)
            try:
                proc.wait(timeout=_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
        for f in files:
            f.close()
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)
        if own_uid:
            _release_uid(uid)


def sandbox_layers(python: str | None = None) -> dict:
    """Which isolation layers take effect on this machine, as reported from inside a sandbox."""
    return run_in_sandbox("pass", tests=[], timeout=10.0, python=python).layers
