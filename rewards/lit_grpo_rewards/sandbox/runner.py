"""The in-sandbox half of :mod:`lit_grpo_rewards.sandbox`: set up the walls, run the program, judge it.

The parent starts it with ``python -I [-S] -B -X utf8 -c BOOTSTRAP THIS_DIR JOB_FILE RESULT_FD TESTS_FD
GO_FD`` (see ``sandbox.BOOTSTRAP``: it reads the job, loads this module and its two helpers from the
byte code the parent compiled once and put in the job, or else from ``THIS_DIR``, and calls
``main``), with its working directory set to the throw-away sandbox directory. It uses the standard
library and its two sibling modules (``_sandbox_seccomp``, ``_sandbox_judge``) only, and must stay
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
import resource
import sys

try:
    from . import _sandbox_judge, _sandbox_seccomp  # imported as part of the package (tests, byte code)
except ImportError:
    import _sandbox_judge  # the sandbox's bootstrap: this directory is on sys.path for the moment
    import _sandbox_seccomp

CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_RDONLY = 1
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
PR_SET_DUMPABLE = 4
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38

RESULT_FD = 3
TESTS_FD = 4
GO_FD = 5
SIGKILL = 9  # the same on every Linux architecture (the signal module costs milliseconds to import)
DEVICES = ("null", "zero", "random", "urandom")

_libc = None


def _c():
    """libc through ctypes, loaded lazily."""
    global _libc
    if _libc is None:
        import ctypes

        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
        _libc.unshare.argtypes = [ctypes.c_int]
        _libc.setns.argtypes = [ctypes.c_int, ctypes.c_int]
        _libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
        _libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    return _libc


def _errno():
    import ctypes

    return ctypes.get_errno()


def _prctl(option, value):
    return _c().prctl(option, value, 0, 0, 0) == 0


def _unshare(flags):
    return _c().unshare(flags) == 0


def _mount(source, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else os.fsencode(s)  # noqa: E731
    if _c().mount(enc(source), enc(target), enc(fstype), flags, enc(data)) != 0:
        err = _errno()
        raise OSError(err, "mount %s on %s: %s" % (source, target, os.strerror(err)))


def _write_result(line):
    try:
        os.write(RESULT_FD, (line + "\n").encode())
    except OSError:
        pass


def _report(job, layers):
    _write_result("%s L %s" % (job["nonce"], _sandbox_judge.dumps(layers)))


# ---- filesystem (program process, root, in its own mount namespace) ---------------------------

def _readonly_everywhere():
    """Make every mount of this (private) mount namespace read-only and nosuid."""
    import ctypes

    class MountAttr(ctypes.Structure):
        _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                    ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]

    attr = MountAttr(MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID, 0, 0, 0)
    rc = _c().syscall(ctypes.c_long(SYS_MOUNT_SETATTR), ctypes.c_int(AT_FDCWD), ctypes.c_char_p(b"/"),
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


def _minimal_dev(root):
    """A tmpfs on ``root``/dev holding only null, zero, random and urandom (bound from the real nodes)
    and the symlinks fd, stdin, stdout and stderr."""
    nodes = [(name, os.open("/dev/" + name, os.O_PATH)) for name in DEVICES]  # before /dev is covered
    _mount("tmpfs", root + "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "size=16k,nr_inodes=32,mode=0755")
    for name, fd in nodes:
        path = root + "/dev/" + name
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o666))
        _mount("/proc/self/fd/%d" % fd, path, None, MS_BIND)
        os.close(fd)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, root + "/dev/" + name)
    return True


def _proc_and_dev(root, layers, without, pidns):
    """``/proc`` (fresh for the PID namespace) and ``/dev`` (minimal) under ``root`` ("" for /)."""
    if pidns:
        _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        layers["private_proc"] = True
    elif root:
        _mount("/proc", root + "/proc", None, MS_BIND | MS_REC)
    if "minimal_dev" not in without:
        layers["minimal_dev"] = _minimal_dev(root)
    elif root:
        _mount("/dev", root + "/dev", None, MS_BIND | MS_REC)


#: Where the interpreter's shared libraries and tools live on the usual layouts (merged /usr or not).
SYSTEM_DIRECTORIES = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
#: The few files of /etc a Python program reads: the dynamic loader's cache, the time zone, user and
#: group names, hosts, MIME types, certificates, Debian's alternatives (symlinks to interpreters).
ETC_FILES = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime", "/etc/timezone",
             "/etc/passwd", "/etc/group", "/etc/nsswitch.conf", "/etc/hosts", "/etc/mime.types", "/etc/ssl",
             "/etc/alternatives")
PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}  # syscall numbers (glibc has no wrapper)
#: Where the judge makes its own working directory (see ``_judge_directory``): a tmpfs of root's,
#: mode 1333, in the minimal root: the sandbox's uid may make a directory in it but not list it.
JUDGE_DIRECTORY = "/.judge"
MNT_DETACH = 2


def _paths_to_expose(workdir):
    """What the sandbox's root holds: the system directories, a few files of /etc, the interpreter's
    installation and import path, and the directories of every file mapped into this process (shared
    libraries outside /usr: conda, Nix, pyenv)."""
    wanted = list(SYSTEM_DIRECTORIES) + list(ETC_FILES)
    wanted += [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
               os.path.dirname(os.path.realpath(sys.executable))] + list(sys.path)
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(None, 5)
            path = fields[5].strip() if len(fields) == 6 else ""
            if path.startswith("/") and not path.endswith("(deleted)") and not path.startswith(("/dev/", "/proc/", "/sys/")):
                wanted.append(os.path.dirname(path))
    return [p for p in wanted if p and p != "/" and os.path.lexists(p)
            and not (workdir == p or workdir.startswith(p.rstrip("/") + "/"))]


def _minimal_root(workdir, layers, without, pidns):
    """Make the sandbox's root a tmpfs that holds only ``_paths_to_expose()`` (bound from the real tree),
    a fresh ``/proc``, the minimal ``/dev``, an empty ``/tmp`` and the sandbox directory; everything
    else of the machine (home directories, data, /run's sockets, /sys, /var) is not there at all.
    ``pivot_root`` moves both processes of this mount namespace into it."""
    nr_pivot_root = PIVOT_ROOT.get(os.uname().machine)
    if nr_pivot_root is None:
        layers["minimal_root_error"] = "pivot_root's number is not known on %s" % os.uname().machine
        return False
    new = workdir  # the tmpfs goes on the sandbox directory for now; the scratch tmpfs goes on top later
    _mount("tmpfs", new, "tmpfs", MS_NOSUID, "size=512k,nr_inodes=4096,mode=0755")
    bound, links = [], {}
    for path in set(_paths_to_expose(workdir)):
        parts = path.split("/")
        for i in range(2, len(parts) + 1):  # the first symlink on the way (/lib64 -> usr/lib64) stays one
            step = "/".join(parts[:i])
            if os.path.islink(step):
                links[step] = os.readlink(step)
                break
    reals = sorted({os.path.realpath(p) for p in _paths_to_expose(workdir)}, key=len)
    for real in reals:
        if any(real == b or real.startswith(b + "/") for b in bound) or not os.path.exists(real):
            continue
        if os.path.isdir(real):
            os.makedirs(new + real, 0o755, exist_ok=True)
            _mount(real, new + real, None, MS_BIND | MS_REC)
        else:
            os.makedirs(os.path.dirname(new + real), 0o755, exist_ok=True)
            os.close(os.open(new + real, os.O_CREAT | os.O_WRONLY, 0o644))
            _mount(real, new + real, None, MS_BIND)
        bound.append(real)
    for link, target in sorted(links.items()):
        if not os.path.lexists(new + link):
            os.makedirs(os.path.dirname(new + link), 0o755, exist_ok=True)
            os.symlink(target, new + link)
    for directory in ("/proc", "/dev", "/tmp", workdir, "/.old_root", JUDGE_DIRECTORY):
        os.makedirs(new + directory, 0o755, exist_ok=True)
    _proc_and_dev(new, layers, without, pidns)
    import ctypes

    if _c().syscall(ctypes.c_long(nr_pivot_root), new.encode(), (new + "/.old_root").encode()) != 0:
        err = _errno()
        raise OSError(err, "pivot_root: %s" % os.strerror(err))
    os.chdir("/")
    if _c().umount2(b"/.old_root", MNT_DETACH) != 0:
        err = _errno()
        raise OSError(err, "unmounting the old root: %s" % os.strerror(err))
    os.rmdir("/.old_root")
    layers["exposed"] = bound
    return True


def _filesystem(job, layers, without, pidns):
    workdir = job["dir"]
    for name in ("minimal_root", "read_only_root", "scratch_tmpfs", "minimal_dev"):
        layers[name] = False
    layers["private_proc"] = False
    if not layers.get("mount_namespace"):
        return
    try:
        _mount(None, "/", None, MS_REC | MS_PRIVATE)
        if "minimal_root" not in without:
            layers["minimal_root"] = _minimal_root(workdir, layers, without, pidns)
        if not layers["minimal_root"]:  # the machine's whole tree, read-only below
            layers["exposed"] = _expose(list(sys.path) + [sys.prefix, sys.base_prefix, workdir])
            _proc_and_dev("", layers, without, pidns)
        if "read_only_root" not in without:
            layers["read_only_root"] = _readonly_everywhere()
        if "scratch_tmpfs" not in without:
            opts = "size=%dk,mode=0700,nr_inodes=4096" % (job["limits"]["scratch_kb"],)
            if job.get("uid") is not None and "own_uid" not in without:
                opts += ",uid=%d,gid=%d" % (job["uid"], job["uid"])
            _mount("tmpfs", workdir, "tmpfs", MS_NOSUID | MS_NODEV, opts)
            layers["scratch_tmpfs"] = True
        os.chdir(workdir)  # the old cwd pointed below the tmpfs (or into the old root)
    except OSError as exc:
        layers["mount_error"] = str(exc)
    if layers["minimal_root"]:  # (after the read-only remount: it stays writable)
        try:
            _mount("tmpfs", JUDGE_DIRECTORY, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
                   "size=%dk,mode=1333,nr_inodes=1024" % (job["limits"]["scratch_kb"],))
        except OSError as exc:  # the judge then works in / (read-only): tests that write files fail
            layers["judge_directory_error"] = str(exc)


# ---- limits, identity, filter (both processes) ----------------------------------------------

def _set_limits(limits):
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


def _become_sandbox_user(job, layers, without):
    """As root: drop every group and switch to the sandbox's own uid/gid (exits if that fails)."""
    uid = job.get("uid")
    layers["own_uid"] = False
    if uid is not None and "own_uid" not in without:
        try:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
        except OSError as exc:  # no point going on as root
            _write_result("%s E setuid failed: %s" % (job["nonce"], exc))
            os._exit(70)
        layers["own_uid"] = True
    layers["uid"] = os.getuid()


def _die_with_parent(parent_pid):
    """SIGKILL this process when the one that started it goes away (and exit now if it already has).

    Set again after every change of uid: the kernel clears it then."""
    try:
        _prctl(PR_SET_PDEATHSIG, SIGKILL)
    except Exception:  # noqa: BLE001
        return
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(71)


def _lock_down(job, layers, without, seccomp_filter, parent_pid, in_user_namespace, prefix=""):
    """Limits, own uid (or, in a user namespace, no capabilities), no new privileges, parent-death
    signal, the seccomp filter: in that order."""
    layers[prefix + "rlimits"] = "rlimits" not in without
    if layers[prefix + "rlimits"]:
        _set_limits(job["limits"])
    _become_sandbox_user(job, layers, without)
    if in_user_namespace:
        # Without root the walls were built with the capabilities of a user namespace; a user
        # namespace nested in it has none over anything built.
        layers[prefix + "capabilities_dropped"] = _unshare(CLONE_NEWUSER)
    _prctl(PR_SET_DUMPABLE, 0)  # a change of uid reset it
    layers[prefix + "no_new_privs"] = _prctl(PR_SET_NO_NEW_PRIVS, 1)
    _die_with_parent(parent_pid)
    layers[prefix + "seccomp"] = False
    if "seccomp" in without:
        return
    if seccomp_filter is None:
        layers[prefix + "seccomp_error"] = "no filter for this architecture (%s)" % os.uname().machine
        return
    try:
        _sandbox_seccomp.install(seccomp_filter)
        layers[prefix + "seccomp"] = True
    except OSError as exc:
        layers[prefix + "seccomp_error"] = str(exc)


# ---- the audit hook (program process) ----------------------------------------------------------

def _install_audit_hook(workdir):
    """Refuse, inside the interpreter, what the sandbox never needs. A tripwire, not a wall.

    Sockets are refused except AF_UNIX stream objects (a ``socketpair``, as asyncio makes; the
    seccomp filter refuses every ``socket()`` call anyway and lets only that pair through)."""
    import errno as _errno_mod

    workdir = os.path.realpath(workdir)
    allowed_files = ("/dev/null",)
    blocked_prefixes = ("socket.", "ctypes.", "syslog.", "sqlite3.enable_load_extension", "sqlite3.load_extension")
    blocked = frozenset({
        "os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system", "os.startfile",
        "os.kill", "os.killpg", "signal.pthread_kill", "subprocess.Popen",
        "gc.get_objects", "gc.get_referrers", "gc.get_referents",
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
        except Exception:  # noqa: BLE001
            return False
        return p == workdir or p.startswith(workdir + "/") or p in allowed_files

    def deny(event):
        raise PermissionError(_errno_mod.EPERM, "sandbox: %s is not allowed" % event)

    def unix_stream_pair(event, args):  # socket.socketpair(): asyncio's self-pipe; reaches nothing
        return event == "socket.__new__" and len(args) >= 3 and args[1] == 1 and isinstance(args[2], int) \
            and args[2] & 0xF == 1

    def hook(event, args):
        if state["busy"]:
            return
        if event in blocked or (event.startswith(blocked_prefixes) and not unix_stream_pair(event, args)):
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
    _filesystem(job, layers, without, pidns)
    _lock_down(job, layers, without, seccomp_filter, os.getppid(), layers["user_namespace"])
    layers["audit_hook"] = bool(job.get("audit_hook", True)) and "audit_hook" not in without
    _report(job, layers)
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
        _install_audit_hook(os.getcwd())

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
        endpoint = _sandbox_judge.Endpoint(channel["program_reads"], channel["program_writes"], max_frame,
                                           lambda name: _the_judges_module(name, site_packages), side="program")
        _sandbox_judge.serve_program(endpoint, namespace)
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
    judge imports only those on its short list (``_sandbox_judge.may_import``); the others fail the
    test that reads them."""
    top = name.split(".")[0]
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
    _lock_down(job, judge_layers, without, seccomp_filter, job.get("parent_pid"), layers["user_namespace"],
               prefix="judge_")
    completed = None
    if channel is not None:
        tests = marshal.loads(_read_all(TESTS_FD))
        _close_quietly(TESTS_FD)
        site_packages = job.get("site_packages", False)
        endpoint = _sandbox_judge.Endpoint(channel["judge_reads"], channel["judge_writes"],
                                           job["limits"]["message_bytes"],
                                           lambda name: _the_judges_module(name, site_packages), side="judge",
                                           imports_allowed=lambda name: _sandbox_judge.may_import(name, site_packages))
        nonce = job["nonce"]
        completed = _sandbox_judge.judge_tests(
            endpoint, tests, lambda i, passed: _write_result("%s T %d %d" % (nonce, i, int(passed))),
            when_ready=lambda: _judge_directory(job["dir"]), trusting_tests_apart=True,
            close_in_child=(RESULT_FD,))
        if completed:
            _write_result("%s D" % nonce)
        _close_quietly(channel["judge_reads"], channel["judge_writes"])
    # The final sweep: as the sandbox's own uid, kill(-1) reaches exactly the sandbox's processes
    # (never this one), atomically, so a fork bomb cannot outrun it; without one (no root), killing
    # the program process, the PID namespace's init, makes the kernel kill everything in it.
    sweep_uid = bool(judge_layers.get("own_uid"))
    judge_layers["final_sweep"] = (sweep_uid or layers["pid_namespace"]) and "final_sweep" not in without
    _report(job, {k: v for k, v in judge_layers.items() if k.startswith("judge_") or k == "final_sweep"})
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
            layers[name] = _unshare(flag)
        except Exception:  # noqa: BLE001
            layers[name] = False
    if not layers["pid_namespace"] and own_pid_namespace is not None:
        _close_quietly(own_pid_namespace)
        own_pid_namespace = None
    return layers["pid_namespace"], own_pid_namespace


def _enter_user_namespace(layers, wanted):
    """Without root: a new user namespace, in which this process may make the other namespaces
    (where the system allows unprivileged user namespaces), with its uid and gid mapped to
    themselves. Its capabilities there are dropped again before any code runs (``_lock_down``)."""
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
            if _unshare(flags):
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
        _c().setns(own_pid_namespace, CLONE_NEWPID)
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
    _die_with_parent(job.get("parent_pid"))  # if the scoring process dies, so does the sandbox
    without = frozenset(job.get("without", ()))
    layers = {}
    _wait_for_cgroup(layers)
    pidns, own_pid_namespace = _enter_namespaces(layers, without, os.geteuid() == 0)
    _prctl(PR_SET_DUMPABLE, 0)  # (after a user namespace's maps are written: they are /proc/self files)
    _prctl(PR_SET_CHILD_SUBREAPER, 1)  # without a PID namespace the program's orphans come here
    seccomp_filter = None if "seccomp" in without else _sandbox_seccomp.filter_for_machine()
    channel = None
    if job["mode"] == "tests" and "separate_judge" not in without:
        judge_reads, program_writes = os.pipe()
        program_reads, judge_writes = os.pipe()
        channel = {"judge_reads": judge_reads, "judge_writes": judge_writes,
                   "program_reads": program_reads, "program_writes": program_writes}
    # stdin/stdout programs are judged by the scoring process, which the program cannot reach either
    layers["separate_judge"] = channel is not None or job["mode"] == "stdin"
    _report(job, layers)

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
