"""The in-sandbox half of :mod:`lit_grpo_rewards.sandbox`: set up the walls, run the program, judge it.

The parent starts it with ``python -I [-S] -B -X utf8 -c BOOTSTRAP THIS_DIR JOB_FILE RESULT_FD TESTS_FD
GO_FD`` (see ``launch.BOOTSTRAP``: it reads the job, loads this module and its siblings as the package
``_sandbox`` from the byte code the parent compiled once and put in the job, or else from their source
files in ``THIS_DIR``, and calls ``main``), with its working directory set to the throw-away sandbox
directory. It uses the standard library and its sibling modules (``walls``, ``audit_hook``,
``seccomp`` and the judge's) only, and must stay
runnable by any Python >= 3.8 the user passes as ``python``.

Two processes come out of it. The *program process* runs the completion's code; the *judge* (this
process, after the fork) runs the tests, if any, and is the only one that can write results:

1. read the job (code, limits, layers to leave out) from ``JOB_FILE`` and delete the file; move the
   result descriptor to fd 3 and the tests' descriptor to fd 4 (the tests are not in the job, so they
   are never in the program process's memory); die with the scoring process;
2. wait on ``GO_FD`` while the parent moves this process into the sandbox's cgroup (memory and
   process limits for everything it will start; done by the parent so that the kernel's slow cgroup
   migration overlaps this interpreter's start-up), then ``unshare`` new mount, network, IPC and PID
   namespaces (without root: inside a new user namespace, where the system allows one); become
   non-dumpable (no same-uid process may ptrace this one or open its ``/proc/PID/mem`` or ``fd/``);
3. ``fork``. The child is process 1 of the new PID namespace: the program process, in a session and
   process group of its own. The judge stays outside that namespace and that group, invisible to
   the program and out of reach of its signals;
4. program process: a private mount tree (the interpreter made reachable, a fresh ``/proc``, a
   minimal ``/dev`` of null, zero, random and urandom, everything read-only, a small tmpfs on the
   sandbox directory as the only writable place); resource limits; its own unprivileged uid, no
   groups, ``PR_SET_NO_NEW_PRIVS``; the seccomp filter; a report of the layers that took effect;
   the result descriptor closed; the audit hook; then the code, and (assertion tests) the program
   side of the judge protocol;
5. judge: the same limits, uid, no-new-privs and filter; then it reads the tests and runs them
   against the program through the judge protocol, writing ``<nonce> T <i> <0|1>`` per test and
   ``<nonce> D`` when all ran; then ``kill(-1, SIGKILL)`` as the sandbox's own uid (one atomic sweep
   of everything the program started), reaps the program process and exits with its status.
"""

import marshal
import os
import sys

from . import seccomp
from .audit_hook import install_audit_hook
from .judge import judge_tests, serve_program
from .judge_imports import may_import
from .judge_protocol import Endpoint
from .walls import (
    CLONE_NEWIPC,
    CLONE_NEWNET,
    CLONE_NEWNS,
    CLONE_NEWPID,
    CLONE_NEWUSER,
    GO_FD,
    JUDGE_DIRECTORY,
    PR_SET_CHILD_SUBREAPER,
    PR_SET_DUMPABLE,
    RESULT_FD,
    SIGKILL,
    TESTS_FD,
    build_filesystem,
    die_with_parent,
    libc,
    lock_down,
    prctl,
    report_layers,
    unshare,
    write_result,
)

# ---- the program process ------------------------------------------------------------------------

def _close_quietly(*fds):
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _program_process(job, layers, without, pidns, channel, seccomp_filter):
    """Everything after the fork on the program's side: walls, then the code. Returns an exit status."""
    # A session and process group of its own: kill(0, ...) and killpg reach the program's processes
    # only. (In the judge's group, a signal to the group reaches the judge across the PID namespace.)
    os.setsid()
    layers = dict(layers)
    in_process_tests = None
    if job["mode"] == "tests" and channel is None:  # the unprotected way (attack tests only)
        in_process_tests = marshal.loads(_read_all(TESTS_FD))
    _close_quietly(TESTS_FD)
    if channel is not None:
        _close_quietly(channel["judge_reads"], channel["judge_writes"])
    build_filesystem(job, layers, without, pidns)
    lock_down(job, layers, without, seccomp_filter, os.getppid(), layers["user_namespace"])
    layers["audit_hook"] = bool(job.get("audit_hook", True)) and "audit_hook" not in without
    report_layers(job, layers)
    if in_process_tests is None:
        _close_quietly(RESULT_FD)  # results are the judge's alone
    return _run_program(job, layers, channel, in_process_tests)


def _print_traceback(limit=None):
    import traceback  # only when there is one to print: importing it costs milliseconds per sandbox

    traceback.print_exc(limit=limit)


def _run_program(job, layers, channel, in_process_tests):
    import builtins

    code = job["code"]
    nonce = job["nonce"]
    max_frame = job["limits"]["message_bytes"]
    site_packages = job.get("site_packages", False)
    sys.argv = ["<completion>"]
    namespace = {"__name__": "__main__", "__builtins__": builtins, "__doc__": None}
    del job
    if layers["audit_hook"]:
        install_audit_hook(os.getcwd())

    if channel is None and in_process_tests is None:  # stdin/stdout program: behave like `python program.py`
        try:
            exec(compile(code, "<completion>", "exec"), namespace)
        except SystemExit:
            raise
        except BaseException:  # noqa: BLE001
            _print_traceback()
            sys.stderr.flush()
            sys.exit(1)
        return 0

    try:
        exec(compile(code, "<completion>", "exec"), namespace)
    except BaseException:  # noqa: BLE001 - the tests still run against whatever got defined
        try:
            _print_traceback(limit=-3)
        except BaseException:  # noqa: BLE001
            pass
    if channel is not None:
        endpoint = Endpoint(channel["program_reads"], channel["program_writes"], max_frame,
                                           lambda name: _the_judges_module(name, site_packages), side="program")
        serve_program(endpoint, namespace)
    else:
        _judge_in_program_interpreter(nonce, in_process_tests, namespace)
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001
            pass
    os._exit(0)  # no atexit handlers or finalizers of the code


def _judge_in_program_interpreter(nonce, tests, namespace):
    """The tests in the program's own interpreter, results written by it: what the judge process
    replaced. A wrong program can forge these results; only the attack tests use it, to show that."""
    for i, test in enumerate(tests):
        try:
            exec(compile(test, "<test %d>" % i, "exec"), namespace)
            ok = 1
        except BaseException:  # noqa: BLE001
            ok = 0
        try:
            os.write(RESULT_FD, ("%s T %d %d\n" % (nonce, i, ok)).encode())
        except BaseException:  # noqa: BLE001
            pass
    try:
        os.write(RESULT_FD, ("%s D\n" % nonce).encode())
    except BaseException:  # noqa: BLE001
        pass


def _the_judges_module(name, site_packages):
    """Is a module the program names the judge's business (never the program's own object)? Every
    module the judge could import: the standard library's (with site-packages, any). Of these the
    judge imports only those on its short list (``may_import``); the others fail the
    test that reads them."""
    top = name.split(".")[0]
    # _sandbox: the runner's own modules, as the bootstrap names them in the sandbox
    if not top.isidentifier() or top == "__main__" or top.startswith("_sandbox"):
        return False
    stdlib = getattr(sys, "stdlib_module_names", None)  # Python >= 3.10
    if stdlib is not None:
        return top in stdlib or top in sys.builtin_module_names or bool(site_packages)
    if site_packages or top in sys.builtin_module_names:
        return True
    import importlib.util
    import sysconfig

    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return False
    origin = getattr(spec, "origin", None) or ""
    roots = [sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib")]
    return origin in ("built-in", "frozen") or any(origin.startswith(r + os.sep) for r in roots)


def _read_all(fd):
    chunks = []
    while True:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


# ---- the judge (this process after the fork) --------------------------------------------------

def _judge_process(job, layers, without, child, channel, seccomp_filter):
    """The judge: lock itself down like the program, run the tests, sweep, reap. Exits."""
    if channel is not None:
        _close_quietly(channel["program_reads"], channel["program_writes"])
    _close_quietly(0)  # the program's stdin is the program's
    judge_layers = {}
    lock_down(job, judge_layers, without, seccomp_filter, job.get("parent_pid"), layers["user_namespace"],
               prefix="judge_")
    completed = None
    if channel is not None:
        tests = marshal.loads(_read_all(TESTS_FD))
        _close_quietly(TESTS_FD)
        site_packages = job.get("site_packages", False)
        endpoint = Endpoint(channel["judge_reads"], channel["judge_writes"],
                                           job["limits"]["message_bytes"],
                                           lambda name: _the_judges_module(name, site_packages), side="judge",
                                           imports_allowed=lambda name: may_import(name, site_packages))
        nonce = job["nonce"]
        completed = judge_tests(
            endpoint, tests, lambda i, passed: write_result("%s T %d %d" % (nonce, i, int(passed))),
            when_ready=lambda: _judge_directory(job["dir"]), trusting_tests_apart=True,
            close_in_child=(RESULT_FD,))
        if completed:
            write_result("%s D" % nonce)
        _close_quietly(channel["judge_reads"], channel["judge_writes"])
    # The final sweep: as the sandbox's own uid, kill(-1) reaches exactly the sandbox's processes
    # (never this one), atomically, so a fork bomb cannot outrun it; without one (no root), killing
    # the program process, the PID namespace's init, makes the kernel kill everything in it.
    sweep_uid = bool(judge_layers.get("own_uid"))
    judge_layers["final_sweep"] = (sweep_uid or layers["pid_namespace"]) and "final_sweep" not in without
    report_layers(job, {k: v for k, v in judge_layers.items() if k.startswith("judge_") or k == "final_sweep"})
    status = None
    if channel is None:  # a stdin/stdout program (or tests in its own interpreter): it ends by itself
        status = _reap(child)
    if judge_layers["final_sweep"]:
        try:
            if sweep_uid:
                os.kill(-1, SIGKILL)
            elif status is None:  # (once reaped, its pid could be another process's: not then)
                os.kill(child, SIGKILL)
        except OSError:
            pass
    if status is None:
        status = _reap(child)
    _reap_orphans(wait=judge_layers["final_sweep"])
    if completed:
        os._exit(0)
    if os.WIFEXITED(status):
        os._exit(os.WEXITSTATUS(status))
    os._exit(128 + (os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0))


def _judge_directory(scratch):
    """The judge's own working directory, HOME and TMPDIR, made once the program has run: a
    directory of a random name in ``JUDGE_DIRECTORY``, which the program cannot list (so it cannot
    plant a file where the tests read and write). Where the minimal root is off, a directory of a
    random name in the program's scratch directory (which the program can list: weaker). Where
    neither can be made (the program filled the space), ``/``: nothing for a test to write."""
    name = os.urandom(16).hex()
    path = "/"
    for parent in (JUDGE_DIRECTORY, scratch):
        try:
            os.mkdir(os.path.join(parent, name), 0o700)
            path = os.path.join(parent, name)
            break
        except FileNotFoundError:  # no such parent here (the minimal root is off): the next one
            continue
        except OSError:
            break
    try:
        os.chdir(path)
    except OSError:
        pass
    os.environ["HOME"] = os.environ["TMPDIR"] = path
    if "tempfile" in sys.modules:
        sys.modules["tempfile"].tempdir = None  # gettempdir() reads TMPDIR again


def _reap_orphans(wait):
    """Reap the program's orphans, which came to this process (a child subreaper) rather than to the
    machine's init: all of them after the sweep (``wait``), else those already dead."""
    while True:
        try:
            pid, _ = os.waitpid(-1, 0 if wait else os.WNOHANG)
        except InterruptedError:
            continue
        except ChildProcessError:
            return
        if pid == 0:
            return


def _reap(child):
    while True:
        try:
            return os.waitpid(child, 0)[1]
        except InterruptedError:
            continue
        except ChildProcessError:
            return 0


# ---- setting up ---------------------------------------------------------------------------------

def _wait_for_cgroup(layers):
    """Block until the parent has moved this process into the sandbox's cgroup (b"1") or not (b"0")."""
    try:
        answer = os.read(GO_FD, 1)
    except OSError:
        answer = b""
    _close_quietly(GO_FD)
    layers["cgroup"] = answer == b"1"


def _enter_namespaces(layers, without, is_root):
    """New namespaces for this process and its children.

    Returns whether the children get a new PID namespace, and (root only) a descriptor of this
    process's own PID namespace to return to after the fork (see ``_threads_again``), else None."""
    for name in ("mount_namespace", "network_namespace", "ipc_namespace", "pid_namespace", "user_namespace"):
        layers[name] = False
    wanted = []
    if not {"minimal_root", "read_only_root", "scratch_tmpfs", "minimal_dev", "pid_namespace"} <= without:
        wanted.append((CLONE_NEWNS, "mount_namespace"))
    for flag, name in ((CLONE_NEWNET, "network_namespace"), (CLONE_NEWIPC, "ipc_namespace"),
                       (CLONE_NEWPID, "pid_namespace")):
        if name not in without:
            wanted.append((flag, name))
    if not is_root:
        return _enter_user_namespace(layers, wanted), None
    own_pid_namespace = None
    for flag, name in wanted:
        try:
            if flag == CLONE_NEWPID:
                own_pid_namespace = os.open("/proc/self/ns/pid", os.O_RDONLY)
            layers[name] = unshare(flag)
        except Exception:  # noqa: BLE001
            layers[name] = False
    if not layers["pid_namespace"] and own_pid_namespace is not None:
        _close_quietly(own_pid_namespace)
        own_pid_namespace = None
    return layers["pid_namespace"], own_pid_namespace


def _enter_user_namespace(layers, wanted):
    """Without root: a new user namespace, in which this process may make the other namespaces
    (where the system allows unprivileged user namespaces), with its uid and gid mapped to
    themselves. Its capabilities there are dropped again before any code runs (``lock_down``)."""
    uid, gid = os.getuid(), os.getgid()
    everything = CLONE_NEWUSER
    for flag, _ in wanted:
        everything |= flag
    attempts = [everything]
    if any(name == "network_namespace" for _, name in wanted) and everything != CLONE_NEWUSER | CLONE_NEWNET:
        attempts.append(CLONE_NEWUSER | CLONE_NEWNET)  # some systems allow the user namespace, not the rest
    made = 0
    for flags in attempts:
        try:
            if unshare(flags):
                made = flags
                break
        except Exception:  # noqa: BLE001
            break
    if not made:
        return False
    layers["user_namespace"] = True
    try:
        for name, text in (("setgroups", "deny"), ("uid_map", "%d %d 1" % (uid, uid)), ("gid_map", "%d %d 1" % (gid, gid))):
            with open("/proc/self/" + name, "w") as f:
                f.write(text)
    except OSError as exc:
        layers["user_namespace_error"] = str(exc)
    for flag, name in wanted:
        layers[name] = bool(made & flag)
    return layers["pid_namespace"]


def _threads_again(own_pid_namespace):
    """After forking the program into the new PID namespace, point this process's future children
    back at its own namespace: the kernel refuses threads (clone with CLONE_THREAD) to a process
    whose children would land in another PID namespace, and the tests may use threads."""
    try:
        libc().setns(own_pid_namespace, CLONE_NEWPID)
    finally:
        _close_quietly(own_pid_namespace)


def _take_descriptors(pairs):
    """Move each (fd, target) to its fixed number without clobbering another one on the way."""
    import fcntl

    high = [(fcntl.fcntl(fd, fcntl.F_DUPFD, 10), fd, target) for fd, target in pairs if fd >= 0]
    for _, fd, _ in high:
        os.close(fd)
    for dup, _, target in high:
        os.dup2(dup, target)
        os.close(dup)


def main(argv, job):
    """``argv``: this directory, the job file, and the result, tests and go descriptors (-1: none);
    ``job``: the job file's contents (read by the bootstrap)."""
    job_path = argv[1]
    result_fd, tests_fd, go_fd = (int(a) for a in argv[2:5])
    _take_descriptors([(result_fd, RESULT_FD), (tests_fd, TESTS_FD), (go_fd, GO_FD)])
    os.unlink(job_path)
    die_with_parent(job.get("parent_pid"))  # if the scoring process dies, so does the sandbox
    without = frozenset(job.get("without", ()))
    layers = {}
    _wait_for_cgroup(layers)
    pidns, own_pid_namespace = _enter_namespaces(layers, without, os.geteuid() == 0)
    prctl(PR_SET_DUMPABLE, 0)  # (after a user namespace's maps are written: they are /proc/self files)
    prctl(PR_SET_CHILD_SUBREAPER, 1)  # without a PID namespace the program's orphans come here
    seccomp_filter = None if "seccomp" in without else seccomp.filter_for_machine()
    channel = None
    if job["mode"] == "tests" and "separate_judge" not in without:
        judge_reads, program_writes = os.pipe()
        program_reads, judge_writes = os.pipe()
        channel = {"judge_reads": judge_reads, "judge_writes": judge_writes,
                   "program_reads": program_reads, "program_writes": program_writes}
    # stdin/stdout programs are judged by the scoring process, which the program cannot reach either
    layers["separate_judge"] = channel is not None or job["mode"] == "stdin"
    report_layers(job, layers)

    sys.stdout.flush()
    sys.stderr.flush()
    os.chdir("/")  # so that the program process's pivot_root moves the judge's working directory too
    child = os.fork()
    if child == 0:
        if own_pid_namespace is not None:
            _close_quietly(own_pid_namespace)
        try:
            rc = _program_process(job, layers, without, pidns, channel, seccomp_filter)
        except SystemExit as exc:
            code = exc.code
            rc = code if isinstance(code, int) else (0 if code is None else 1)
            if code is not None and not isinstance(code, int):
                try:
                    print(code, file=sys.stderr)
                except BaseException:  # noqa: BLE001
                    pass
        except BaseException:  # noqa: BLE001
            rc = 1
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:  # noqa: BLE001
                pass
        os._exit(rc if isinstance(rc, int) else 0)
    if own_pid_namespace is not None:
        _threads_again(own_pid_namespace)
    _judge_process(job, layers, without, child, channel, seccomp_filter)
