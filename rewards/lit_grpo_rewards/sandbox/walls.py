"""The walls the runner builds around both of its processes: a private file system (the program
process's minimal root), resource limits, its own uid, no new privileges and the system-call filter;
the libc calls they need, and the result lines the runner writes about them."""

import os
import resource
import sys

from . import seccomp
from .judge_protocol import dumps

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


def libc():
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


def prctl(option, value):
    return libc().prctl(option, value, 0, 0, 0) == 0


def unshare(flags):
    return libc().unshare(flags) == 0


def _mount(source, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else os.fsencode(s)  # noqa: E731
    if libc().mount(enc(source), enc(target), enc(fstype), flags, enc(data)) != 0:
        err = _errno()
        raise OSError(err, "mount %s on %s: %s" % (source, target, os.strerror(err)))


def write_result(line):
    try:
        os.write(RESULT_FD, (line + "\n").encode())
    except OSError:
        pass


def report_layers(job, layers):
    write_result("%s L %s" % (job["nonce"], dumps(layers)))


# ---- filesystem (program process, root, in its own mount namespace) ---------------------------

def _readonly_everywhere():
    """Make every mount of this (private) mount namespace read-only and nosuid."""
    import ctypes

    class MountAttr(ctypes.Structure):
        _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                    ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]

    attr = MountAttr(MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID, 0, 0, 0)
    rc = libc().syscall(ctypes.c_long(SYS_MOUNT_SETATTR), ctypes.c_int(AT_FDCWD), ctypes.c_char_p(b"/"),
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

    if libc().syscall(ctypes.c_long(nr_pivot_root), new.encode(), (new + "/.old_root").encode()) != 0:
        err = _errno()
        raise OSError(err, "pivot_root: %s" % os.strerror(err))
    os.chdir("/")
    if libc().umount2(b"/.old_root", MNT_DETACH) != 0:
        err = _errno()
        raise OSError(err, "unmounting the old root: %s" % os.strerror(err))
    os.rmdir("/.old_root")
    layers["exposed"] = bound
    return True


def build_filesystem(job, layers, without, pidns):
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
            write_result("%s E setuid failed: %s" % (job["nonce"], exc))
            os._exit(70)
        layers["own_uid"] = True
    layers["uid"] = os.getuid()


def die_with_parent(parent_pid):
    """SIGKILL this process when the one that started it goes away (and exit now if it already has).

    Set again after every change of uid: the kernel clears it then."""
    try:
        prctl(PR_SET_PDEATHSIG, SIGKILL)
    except Exception:  # noqa: BLE001
        return
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(71)


def lock_down(job, layers, without, seccomp_filter, parent_pid, in_user_namespace, prefix=""):
    """Limits, own uid (or, in a user namespace, no capabilities), no new privileges, parent-death
    signal, the seccomp filter: in that order."""
    layers[prefix + "rlimits"] = "rlimits" not in without
    if layers[prefix + "rlimits"]:
        _set_limits(job["limits"])
    _become_sandbox_user(job, layers, without)
    if in_user_namespace:
        # Without root the walls were built with the capabilities of a user namespace; a user
        # namespace nested in it has none over anything built.
        layers[prefix + "capabilities_dropped"] = unshare(CLONE_NEWUSER)
    prctl(PR_SET_DUMPABLE, 0)  # a change of uid reset it
    layers[prefix + "no_new_privs"] = prctl(PR_SET_NO_NEW_PRIVS, 1)
    die_with_parent(parent_pid)
    layers[prefix + "seccomp"] = False
    if "seccomp" in without:
        return
    if seccomp_filter is None:
        layers[prefix + "seccomp_error"] = "no filter for this architecture (%s)" % os.uname().machine
        return
    try:
        seccomp.install(seccomp_filter)
        layers[prefix + "seccomp"] = True
    except OSError as exc:
        layers[prefix + "seccomp_error"] = str(exc)
