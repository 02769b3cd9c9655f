"""Run untrusted Python (model-written code) in a throw-away, walled-in pair of processes.

``run_in_sandbox(code, tests=[...])`` runs one program and reports, test by test, which assertions
held; ``run_in_sandbox(code, stdin=b"...")`` runs it as a stdin/stdout program. Each call starts one
``python -I -S -B`` subprocess (``-S`` unless ``site_packages=True``) running the runner
(``runner``) in a fresh directory made with ``tempfile.mkdtemp(prefix="lit-grpo-sandbox-")``;
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
   ``cgroup`` **).**
   Memory of the whole sandbox (``memory_mb`` plus ``SANDBOX_OVERHEAD_MB`` for its two
   interpreters; shared memory and the scratch tmpfs count) and its number of processes and
   threads, whatever the program forks; and its disk reads (where ``io``/``blkio`` can be used:
   ``cgroup.DISK_READ_BYTES_PER_S``). Without it, memory is bounded per process only.
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
   calls a Python test program needs (see ``seccomp``). No sockets (Unix sockets at a
   path included), no SysV IPC, no memfd, no keyring, no namespaces or mounts, no ptrace, bpf,
   perf, io_uring or userfaultfd, no ``execve``, no ``fallocate`` (it allocates past the end of a
   file, beyond RLIMIT_FSIZE); nothing that watches or marks the machine's files for others to see:
   file locks succeed and lock nothing, no leases or ``F_NOTIFY``, no page-cache eviction
   (``POSIX_FADV_DONTNEED`` is ignored) or ``RWF_NOWAIT`` probe; nothing that makes the machine's
   disk work for it: the sync calls succeed and do nothing, ``O_DIRECT`` and ``RWF_DONTCACHE`` are
   refused.
8. **The judge (assertion tests).** The tests run in the judge process, which receives what the
   program hands over as plain data and compares it with its own types (see ``judge``):
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

The files: in the scoring process, ``launch`` (write the job, start the runner, read its report,
remove what it made), ``processes`` (the sandbox's uid, its processes found and killed, the wait)
and ``cgroup``. In the sandbox (loaded by the bootstrap as the package ``_sandbox``, standard
library only): ``runner`` (the two processes), ``walls`` (file system, limits, identity, filter),
``audit_hook``, ``seccomp``; the judge's ``judge`` (its roles and the test run),
``judge_protocol`` (the messages and values between the processes), ``judge_values`` (standard-
library values, and what is never handed over), ``judge_imports`` (the modules it imports for the
tests) and ``judged_apart`` (which tests run in a child of their own).
"""

from .launch import LAYERS, SANDBOX_OVERHEAD_MB, SandboxResult, run_in_sandbox, sandbox_layers
from .processes import UID_RANGE

__all__ = ["LAYERS", "SANDBOX_OVERHEAD_MB", "SandboxResult", "UID_RANGE", "run_in_sandbox", "sandbox_layers"]
