"""The in-sandbox half of :mod:`lit_grpo_rewards.sandbox`: run untrusted Python, report per-test results.

Not imported by anything: the parent starts it as a script, ``python -I -S -B -X utf8 _sandbox_runner.py
JOB_FILE RESULT_FD``, with its working directory set to the throw-away sandbox directory. It uses the
standard library only and must stay importable by any Python >= 3.8 the user passes as ``python``.

Order of events (the trusted part ends where ``exec`` of the completion's code begins):

1. read the job (code, tests, limits, nonce) from ``JOB_FILE`` and delete the file, so that the code
   never sees it; move the result descriptor to fd 3;
2. as root: ``unshare`` new mount, network, IPC and PID namespaces, then ``fork`` so the child is
   process 1 of the new PID namespace (when it dies the kernel kills and reaps everything the code
   started); this process stays behind, only waits for that child and exits with its status;
   as non-root: try a new user + network namespace (no filesystem changes);
3. in the mount namespace: make every mount private, make the Python installation readable by the
   sandbox user (a tmpfs over a root-only ancestor such as ``/root`` with the installation bound
   back), a fresh ``/proc`` for the PID namespace, the whole tree read-only (``mount_setattr``),
   and a small tmpfs, owned by the sandbox user, mounted on the sandbox directory as the only
   writable place;
4. resource limits (address space, CPU seconds, file size, open files, processes, no core files);
5. as root: drop every group and switch to the sandbox's unprivileged uid/gid (its own uid, so
   RLIMIT_NPROC is enforced and counts only this sandbox's processes), ``PR_SET_NO_NEW_PRIVS``, and a
   parent-death signal;
6. report which of these layers took effect, install the audit hook, run the code, then (assertion
   mode) each test, writing ``<nonce> T <i> <0|1>`` lines to fd 3 as they finish.
"""

import json
import os
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18

SYS_MOUNT_SETATTR = 442  # the same number on every architecture (syscalls added after 5.1 are unified)
AT_FDCWD = -100
AT_RECURSIVE = 0x8000
MOUNT_ATTR_RDONLY = 0x1
MOUNT_ATTR_NOSUID = 0x2

PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38

RESULT_FD = 3

_libc = None


def _c():
    """libc through ctypes, loaded lazily (only the namespace/mount/prctl layers need it)."""
    global _libc
    if _libc is None:
        import ctypes

        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
        _libc.unshare.argtypes = [ctypes.c_int]
        _libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    return _libc


def _errno():
    import ctypes

    return ctypes.get_errno()


def _unshare(flags):
    return _c().unshare(flags) == 0


def _mount(source, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else os.fsencode(s)  # noqa: E731
    if _c().mount(enc(source), enc(target), enc(fstype), flags, enc(data)) != 0:
        err = _errno()
        raise OSError(err, "mount %s on %s: %s" % (source, target, os.strerror(err)))


def _readonly_everywhere():
    """Make every mount of this (private) mount namespace read-only and nosuid."""
    import ctypes

    class MountAttr(ctypes.Structure):
        _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                    ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]

    attr = MountAttr(MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID, 0, 0, 0)
    libc = _c()
    rc = libc.syscall(ctypes.c_long(SYS_MOUNT_SETATTR), ctypes.c_int(AT_FDCWD), ctypes.c_char_p(b"/"),
                      ctypes.c_uint(AT_RECURSIVE), ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)))
    if rc == 0:
        return True
    # Kernels before 5.12: remount every mount point read-only, one by one.
    ok = True
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    for point in points:
        point = point.encode().decode("unicode_escape")  # mountinfo escapes spaces as \040
        try:
            _mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID)
        except OSError:
            ok = False
    return ok


def _world_traversable(path):
    try:
        return bool(os.stat(path).st_mode & 0o001)
    except OSError:
        return False


def _expose(paths):
    """Make ``paths`` (the interpreter's import path) reachable by an unprivileged uid.

    For a path under a directory that others may not enter (``/root`` is mode 0700 and pyenv
    installs Python there), mount a tmpfs over that ancestor and bind the path back onto the
    same place; everything else in the ancestor disappears from view. Returns the bound paths.
    """
    wanted = []
    for p in paths:
        if not p:
            continue
        try:
            p = os.path.realpath(p)
        except OSError:
            continue
        if os.path.isdir(p) and p not in wanted:
            wanted.append(p)
    wanted.sort(key=len)
    plans = {}  # blocking ancestor -> [paths under it]
    for p in wanted:
        parts = p.split("/")
        for i in range(2, len(parts)):  # proper ancestors, "/" excluded
            anc = "/".join(parts[:i])
            if not _world_traversable(anc):
                plans.setdefault(anc, []).append(p)
                break
    # An ancestor inside another blocked ancestor's subtree is handled by the outer one.
    tops = [a for a in plans if not any(a != b and a.startswith(b + "/") for b in plans)]
    bound = []
    for anc in tops:
        under = sorted({p for a, ps in plans.items() if a == anc or a.startswith(anc + "/") for p in ps}, key=len)
        keep = []
        for p in under:
            if not any(p == k or p.startswith(k + "/") for k in keep):
                keep.append(p)
        fds = [(p, os.open(p, os.O_PATH | os.O_DIRECTORY)) for p in keep]
        _mount("tmpfs", anc, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=0755")
        for p, fd in fds:
            os.makedirs(p, mode=0o755, exist_ok=True)
            _mount("/proc/self/fd/%d" % fd, p, None, MS_BIND | MS_REC)
            os.close(fd)
            bound.append(p)
    return bound


def _write_result(line):
    try:
        os.write(RESULT_FD, (line + "\n").encode())
    except OSError:
        pass


def _install_audit_hook(workdir):
    """Refuse, inside the interpreter, what the sandbox never needs. A layer, not the wall."""
    import errno as _errno_mod

    workdir = os.path.realpath(workdir)
    allowed_files = ("/dev/null",)
    blocked_prefixes = ("socket.", "ctypes.", "syslog.", "sqlite3.enable_load_extension", "sqlite3.load_extension")
    blocked = frozenset({
        "os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system", "os.startfile",
        "os.kill", "os.killpg", "signal.pthread_kill", "subprocess.Popen",
        "gc.get_objects", "gc.get_referrers", "gc.get_referents",  # fishing for the runner's nonce
    })
    path_events = {  # event -> indexes of path arguments that must lie in the sandbox directory
        "os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,), "os.chmod": (0,), "os.chown": (0,),
        "os.rename": (0, 1), "os.link": (0, 1), "os.symlink": (1,), "os.truncate": (0,), "os.utime": (0,),
        "os.mkfifo": (0,), "os.mknod": (0,), "os.setxattr": (0,), "os.removexattr": (0,),
        "shutil.rmtree": (0,), "shutil.move": (1,), "shutil.copyfile": (1,), "shutil.copytree": (1,),
    }
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    realpath = os.path.realpath
    fspath = os.fsdecode
    state = {"busy": False}

    def inside(path):
        if isinstance(path, int):  # an already-open descriptor
            return True
        try:
            p = realpath(fspath(path))
        except Exception:
            return False
        return p == workdir or p.startswith(workdir + "/") or p in allowed_files

    def deny(event):
        raise PermissionError(_errno_mod.EPERM, "sandbox: %s is not allowed" % event)

    def hook(event, args):
        if state["busy"]:
            return
        if event in blocked or event.startswith(blocked_prefixes):
            deny(event)
        if event == "open":
            path, mode, flags = (tuple(args) + (None, None, None))[:3]
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & write_flags)
            if writing:
                state["busy"] = True
                try:
                    ok = inside(path)
                finally:
                    state["busy"] = False
                if not ok:
                    deny("writing %r" % (path,))
        elif event == "sqlite3.connect":
            db = args[0] if args else None
            if db not in (":memory:", b":memory:", "", b""):
                state["busy"] = True
                try:
                    ok = inside(db)
                finally:
                    state["busy"] = False
                if not ok:
                    deny(event)
        elif event in path_events:
            state["busy"] = True
            try:
                ok = all(inside(args[i]) for i in path_events[event] if i < len(args) and args[i] is not None)
            finally:
                state["busy"] = False
            if not ok:
                deny(event)

    sys.addaudithook(hook)


def _set_limits(limits):
    import resource

    def lim(name, soft, hard=None):
        res = getattr(resource, name, None)
        if res is None or soft is None:
            return
        hard = soft if hard is None else hard
        try:
            cur_soft, cur_hard = resource.getrlimit(res)
            if cur_hard != resource.RLIM_INFINITY:
                hard = min(hard, cur_hard)
                soft = min(soft, hard)
            resource.setrlimit(res, (soft, hard))
        except (ValueError, OSError):
            pass

    lim("RLIMIT_CORE", 0)
    mem = limits.get("memory_bytes")
    lim("RLIMIT_AS", mem)
    lim("RLIMIT_DATA", mem)
    cpu = limits.get("cpu_seconds")
    if cpu is not None:
        lim("RLIMIT_CPU", int(cpu), int(cpu) + 1)  # SIGXCPU at the soft limit, SIGKILL one second later
    lim("RLIMIT_FSIZE", limits.get("file_bytes"))
    lim("RLIMIT_NOFILE", limits.get("open_files"))
    lim("RLIMIT_NPROC", limits.get("processes"))
    lim("RLIMIT_MEMLOCK", 0)
    lim("RLIMIT_MSGQUEUE", 0)


def _die_with_parent(parent_pid):
    """SIGKILL this process when the one that started it goes away (and exit now if it already has)."""
    try:
        import signal

        _c().prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except Exception:
        return
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(71)


def _sandboxed_child(job, layers, pidns):
    """Everything after the namespaces exist: filesystem view, limits, identity, then the code."""
    workdir = job["dir"]
    uid = job.get("uid")
    if layers.get("mntns"):
        try:
            _mount(None, "/", None, MS_REC | MS_PRIVATE)
            layers["exposed"] = _expose(list(sys.path) + [sys.prefix, sys.base_prefix, workdir])
            if pidns:
                try:
                    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
                    layers["private_proc"] = True
                except OSError:
                    pass
            layers["readonly_root"] = _readonly_everywhere()
            opts = "size=%dk,mode=0700,nr_inodes=4096" % (job["limits"]["scratch_kb"],)
            if uid is not None:
                opts += ",uid=%d,gid=%d" % (uid, uid)
            _mount("tmpfs", workdir, "tmpfs", MS_NOSUID | MS_NODEV, opts)
            os.chdir(workdir)  # the old cwd pointed into the (now read-only) directory below the tmpfs
            layers["scratch_tmpfs"] = True
        except OSError as exc:
            layers["mount_error"] = str(exc)
    _set_limits(job["limits"])
    layers["rlimits"] = True
    if uid is not None:
        try:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
        except OSError as exc:  # no point going on as root
            _write_result("%s E setuid failed: %s" % (job["nonce"], exc))
            os._exit(70)
    layers["uid"] = os.getuid()
    try:
        layers["no_new_privs"] = _c().prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0
    except Exception:
        layers["no_new_privs"] = False
    _die_with_parent(os.getppid() if pidns else job.get("parent_pid"))  # a change of uid cleared it
    return _run_code(job, layers)


def _run_code(job, layers):
    nonce = job["nonce"]
    code = job["code"]
    tests = job.get("tests")
    layers["audit_hook"] = bool(job.get("audit_hook", True))
    _write_result("%s L %s" % (nonce, json.dumps(layers, sort_keys=True)))
    import builtins
    import traceback

    # Nothing that identifies the runner stays reachable by name from the code.
    sys.argv = ["<completion>"]
    namespace = {"__name__": "__main__", "__builtins__": builtins, "__doc__": None}
    write = os.write
    encode = str.encode
    del job
    if layers["audit_hook"]:
        _install_audit_hook(os.getcwd())

    if tests is None:  # stdin/stdout program: behave like `python program.py`
        try:
            exec(compile(code, "<completion>", "exec"), namespace)
        except SystemExit:
            raise
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
            sys.exit(1)
        return 0

    try:
        exec(compile(code, "<completion>", "exec"), namespace)
    except BaseException:  # the tests still run against whatever got defined (they fail if nothing did)
        try:
            traceback.print_exc(limit=-3)
        except BaseException:
            pass
    for i, test in enumerate(tests):
        try:
            exec(compile(test, "<test %d>" % i, "exec"), namespace)
            ok = 1
        except BaseException:
            ok = 0
        try:
            write(RESULT_FD, encode("%s T %d %d\n" % (nonce, i, ok)))
        except BaseException:
            pass
    try:
        write(RESULT_FD, encode("%s D\n" % nonce))
    except BaseException:
        pass
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            stream.flush()
        except BaseException:
            pass
    os._exit(0)  # no atexit handlers or finalizers of the code after the results are in


def main(argv):
    job_path, result_fd = argv[1], int(argv[2])
    if result_fd != RESULT_FD:
        os.dup2(result_fd, RESULT_FD)
        os.close(result_fd)
    with open(job_path) as f:
        job = json.load(f)
    os.unlink(job_path)
    _die_with_parent(job.get("parent_pid"))  # if the scoring process dies, so does the sandbox
    layers = {"uid": os.getuid(), "netns": False, "mntns": False, "pidns": False, "ipcns": False,
              "userns": False, "readonly_root": False, "scratch_tmpfs": False, "private_proc": False}
    pidns = False
    if os.geteuid() == 0 and job.get("namespaces", True):
        for flags, names in (
            (CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWPID, ("mntns", "netns", "ipcns", "pidns")),
            (CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC, ("mntns", "netns", "ipcns")),
            (CLONE_NEWNET, ("netns",)),
        ):
            try:
                if _unshare(flags):
                    for n in names:
                        layers[n] = True
                    break
            except Exception:
                break
        pidns = layers["pidns"]
    elif job.get("namespaces", True):
        try:
            if _unshare(CLONE_NEWUSER | CLONE_NEWNET):
                layers["userns"] = layers["netns"] = True
        except Exception:
            pass
    if pidns:
        # This process stays outside, as root; the child is process 1 of the new PID namespace.
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            try:
                rc = _sandboxed_child(job, layers, pidns=True)
            except SystemExit as exc:
                code = exc.code
                rc = code if isinstance(code, int) else (0 if code is None else 1)
                if code is not None and not isinstance(code, int):
                    try:
                        print(code, file=sys.stderr)
                    except BaseException:
                        pass
            except BaseException:
                rc = 1
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except BaseException:
                    pass
            os._exit(rc if isinstance(rc, int) else 0)
        os.close(0)
        os.close(RESULT_FD)
        while True:
            try:
                _, status = os.waitpid(pid, 0)
                break
            except InterruptedError:
                continue
        if os.WIFEXITED(status):
            os._exit(os.WEXITSTATUS(status))
        os._exit(128 + (os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0))
    return _sandboxed_child(job, layers, pidns=False)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
