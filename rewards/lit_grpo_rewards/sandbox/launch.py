"""The scoring process's half of the sandbox: write the job, start the runner, hand it the program's
files, wait, read what it reports and remove everything it made (see :mod:`lit_grpo_rewards.sandbox`)."""

from __future__ import annotations

import dataclasses
import json
import logging
import marshal
import math
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable

from . import cgroup as sandbox_cgroup
from .processes import (
    ENV_MARK,
    SandboxProcesses,
    allocate_uid,
    kill_first_when_out_of_memory,
    release_uid,
    run_at_normal_priority,
    wait_for_exit,
)

log = logging.getLogger("lit_grpo_rewards.sandbox")  # its name before the package split

_HERE = os.path.dirname(os.path.abspath(__file__))
#: The runner's modules (files of this folder), in import order: each imports only those before it.
_RUNNER_MODULES = ("seccomp", "judge_values", "judge_imports", "judge_protocol", "judged_apart", "judge", "walls",
                   "audit_hook", "runner")

#: ``python -c BOOTSTRAP HERE JOB ...``: read the job; make the runner's modules the package
#: ``_sandbox`` (a name ``runner._the_judges_module`` refuses to the program) from the byte code in the
#: job (compiled once by this process) or else from their source files in this directory (``sys.path``
#: never holds it: its modules, ``code.py`` among them, must not shadow the standard library's); run.
BOOTSTRAP = """
import marshal, sys
with open(sys.argv[2], "rb") as f:
    job = marshal.load(f)
package = sys.modules["_sandbox"] = type(sys)("_sandbox")
package.__path__ = []
for name, code in job.pop("modules"):
    if isinstance(code, str):
        with open(code, "rb") as f:
            code = compile(f.read(), code, "exec", dont_inherit=True)
    sys.modules["_sandbox." + name] = module = type(sys)("_sandbox." + name)
    module.__package__ = "_sandbox"
    exec(code, module.__dict__)
    setattr(package, name, module)
sys.modules["_sandbox.runner"].main(sys.argv[1:], job)
"""
_bytecode_lock = threading.Lock()
_bytecode: list | None = None


def _runner_modules(python: str) -> list:
    """[(module name, code object)] of the runner, compiled once per process, for a sandbox whose
    interpreter is this one (byte code is version-specific); [(module name, source path)] for another
    interpreter, which compiles them itself.

    Saves each sandbox compiling its ~1,300 lines of source (no ``.pyc`` is written where
    ``PYTHONDONTWRITEBYTECODE`` is set, and the sandbox runs with ``-B``)."""
    global _bytecode
    paths = [(name, os.path.join(_HERE, name + ".py")) for name in _RUNNER_MODULES]
    if os.path.realpath(python) != os.path.realpath(sys.executable):
        return paths
    with _bytecode_lock:
        if _bytecode is None:
            compiled = []
            for name, path in paths:
                with open(path, "rb") as f:
                    compiled.append((name, compile(f.read(), path, "exec", dont_inherit=True)))
            _bytecode = compiled
        return _bytecode


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

_GRACE_S = 1.0
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


#: processes beside the program's max_processes: the judge, and the child it judges a trusting test in
#: (issue 50.9), which the program must not be able to use up
JUDGE_PROCESSES = 2


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


@dataclasses.dataclass
class _Streams:
    """The runner's standard streams and descriptors for one run (memory files: see ``_memory_file``)."""

    stdin: object  # a read-only memory file, or subprocess.DEVNULL with tests
    stdout: object  # a memory file, or subprocess.DEVNULL with tests
    stderr: object
    result: object  # the judge's result lines
    tests_fd: int  # the tests, for the judge only; -1 without tests


def _limits(timeout: float, memory_mb: int, cpu_seconds: int | None, max_output_bytes: int, max_processes: int,
            scratch_mb: int) -> dict:
    """The runner's limits for both of its processes (see ``run_in_sandbox``'s arguments)."""
    cpu = int(math.ceil(timeout)) if cpu_seconds is None else int(cpu_seconds)
    return {
        "memory_bytes": int(memory_mb) * 1024 * 1024, "cpu_seconds": max(1, cpu),
        "file_bytes": int(max_output_bytes), "open_files": 64,
        "processes": int(max_processes) + JUDGE_PROCESSES,  # the judge shares the uid
        "scratch_kb": int(scratch_mb) * 1024, "message_bytes": int(max_output_bytes),
    }


def _make_cgroup(box: SandboxProcesses, memory_mb: int, max_processes: int, without: frozenset[str]) -> str:
    """Give ``box`` its cgroup unless left out; the reason when none could be made ("" otherwise)."""
    if "cgroup" in without:
        return ""
    try:
        box.cgroup = sandbox_cgroup.create(
            box.nonce, (int(memory_mb) + SANDBOX_OVERHEAD_MB) * 1024 * 1024, int(max_processes) + JUDGE_PROCESSES,
            limit_disk_reads="disk_read_limit" not in without)
    except OSError as exc:
        return str(exc)
    return ""


def _write_job(workdir: str, box: SandboxProcesses, code: str, tests_mode: bool, python: str, limits: dict,
               audit_hook: bool, site_packages: bool, without: frozenset[str]) -> str:
    """Write the runner's job (read and deleted by the runner) into ``workdir``; its path."""
    job_path = os.path.join(workdir, f".job-{box.nonce}.json")
    job = {
        "nonce": box.nonce, "code": code, "mode": "tests" if tests_mode else "stdin",
        "dir": workdir, "uid": box.uid, "audit_hook": bool(audit_hook), "parent_pid": os.getpid(),
        "site_packages": bool(site_packages), "without": sorted(without),
        "cgroups": box.cgroup.dirs if box.cgroup is not None else [],
        "modules": _runner_modules(python),
        "limits": limits,
    }
    fd = os.open(job_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(marshal.dumps(job, 4))  # format 4: read by any Python >= 3.4
    return job_path


def _open_streams(tests: list[str] | None, stdin: bytes | str | None, files: list) -> _Streams:
    """The run's streams; every file opened is appended to ``files`` (closed by the caller)."""

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
    return _Streams(stdin_f, stdout_f, memory_file("stderr"), memory_file("result"), tests_fd)


def _start_runner(box: SandboxProcesses, argv: list[str], workdir: str, streams: _Streams,
                  without: frozenset[str]) -> tuple[bool, bool]:
    """Start the runner as ``box.proc``; make it first to die when memory runs out and of ordinary
    priority (every process of the sandbox inherits both) and move it into the cgroup while it starts
    its interpreter: it waits for the answer on its go pipe before it does anything else (cgroup v1
    migration waits out an RCU grace period: ~10 ms). (oom_first, normal_priority): what took effect."""
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir,
        "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", ENV_MARK: box.nonce,
        # numerical libraries start a thread per core unless told otherwise: past max_processes
        "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
    }
    go_read, go_write = os.pipe()
    try:
        try:
            box.proc = subprocess.Popen(
                argv + [str(streams.result.fileno()), str(streams.tests_fd), str(go_read)],
                cwd=workdir, env=env, stdin=streams.stdin, stdout=streams.stdout, stderr=streams.stderr,
                pass_fds=tuple(fd for fd in (streams.result.fileno(), streams.tests_fd, go_read) if fd >= 0),
                start_new_session=True, close_fds=True,
            )
        finally:
            os.close(go_read)
        oom_first = "oom_first" not in without and kill_first_when_out_of_memory(box.proc.pid)
        normal_priority = "normal_priority" not in without and run_at_normal_priority(box.proc.pid)
        joined = box.cgroup is not None and box.cgroup.add(box.proc.pid)
        try:
            os.write(go_write, b"1" if joined else b"0")
        except OSError:  # the runner is already gone (it could not start): reported below as such
            pass
    finally:
        os.close(go_write)
    return oom_first, normal_priority


def _sweep(box: SandboxProcesses, timed_out: bool, without: frozenset[str]) -> bool:
    """Kill what is left of the sandbox (at the deadline, or leftovers after a run that ended by
    itself) and reap the runner; whether it was reaped."""
    if timed_out or ("final_sweep" not in without and box.leftovers()):
        box.kill_all()
    try:
        box.proc.wait(timeout=_GRACE_S)
        return True
    except subprocess.TimeoutExpired:
        return False


def _remove(box: SandboxProcesses, swept: bool, files: list, workdir: str | None, own_uid: bool) -> None:
    """Remove everything the sandbox made: its processes (unless already swept), cgroup, files,
    directory and uid."""
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
    if workdir is not None:
        shutil.rmtree(workdir, ignore_errors=True)
    if own_uid:
        release_uid(box.uid)


def _result(box: SandboxProcesses, streams: _Streams, n_tests: int, timed_out: bool, elapsed: float,
            standing: tuple[bool, bool], max_output_bytes: int, stdin_mode: bool) -> SandboxResult:
    """What the run produced, from the result lines the judge wrote and the runner's streams."""
    results, done, layers = _parse_results(_read_head(streams.result, 1 << 20), box.nonce, n_tests)
    if layers:  # the scoring process's own layers, beside the sandbox's report
        layers["oom_first"], layers["normal_priority"] = standing
        layers["disk_read_limit"] = box.cgroup is not None and box.cgroup.disk_reads_limited
    return SandboxResult(
        returncode=box.proc.returncode,
        timed_out=timed_out,
        elapsed=elapsed,
        stdout=_read_head(streams.stdout, max_output_bytes) if stdin_mode else b"",
        stderr=_read_tail(streams.stderr, 8192),
        test_results=results,
        completed=done and not timed_out,
        layers=layers,
        peak_memory_bytes=box.cgroup.peak_memory_bytes() if box.cgroup is not None else None,
    )


# over 60 lines with its signature and docstring (the API's reference); its body is 30 lines, the steps in order
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
    from the program's globals (see ``judge``); the result lists, test by test, whether it
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
    limits = _limits(timeout, memory_mb, cpu_seconds, max_output_bytes, max_processes, scratch_mb)
    start = time.monotonic()
    uid, own_uid = allocate_uid()
    box = SandboxProcesses(nonce=secrets.token_hex(16), uid=uid, own_uid=own_uid and "own_uid" not in without)
    workdir = None
    files: list = []  # every file of the run, closed at its end
    swept = False  # the runner is reaped and nothing of the sandbox is left
    try:
        workdir = os.path.realpath(tempfile.mkdtemp(prefix="lit-grpo-sandbox-"))
        if uid is not None:
            os.chown(workdir, uid, uid)
        cgroup_reason = _make_cgroup(box, memory_mb, max_processes, without)
        job_path = _write_job(workdir, box, code, tests is not None, python, limits, audit_hook, site_packages,
                              without)
        streams = _open_streams(tests, stdin, files)
        argv = [python, "-I", "-B", "-X", "utf8"] + ([] if site_packages else ["-S"])
        standing = _start_runner(box, argv + ["-c", BOOTSTRAP, _HERE, job_path], workdir, streams, without)
        timed_out = not wait_for_exit(box.proc, timeout - (time.monotonic() - start))
        swept = _sweep(box, timed_out, without)
        result = _result(box, streams, len(tests) if tests is not None else 0, timed_out,
                         time.monotonic() - start, standing, max_output_bytes, stdin_mode=tests is None)
        _warn_missing(result.layers, without, cgroup_reason or sandbox_cgroup.support().reason)
        return result
    finally:
        _remove(box, swept, files, workdir, own_uid)


def sandbox_layers(python: str | None = None) -> dict:
    """Which isolation layers take effect on this machine, as reported from inside a sandbox."""
    return run_in_sandbox("pass", tests=[], timeout=10.0, python=python).layers
