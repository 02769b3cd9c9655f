"""One memory + process-count cgroup per sandbox: the whole sandbox's memory bounded, not each process's.

The scoring process creates the cgroup (a directory per controller hierarchy) and writes its limits;
the runner moves itself in before it starts anything, so that everything the sandbox ever runs,
and the memory it ever touches (shared memory and tmpfs pages included), is charged there. When
the sandbox is over the directories are removed.

Where the cgroup can be created, in order:

1. ``$LIT_GRPO_SANDBOX_CGROUP``: a cgroup v2 directory delegated to this process's user (writable,
   with ``memory`` and ``pids`` in its ``cgroup.subtree_control``, or enabled there now; root or
   not), e.g. made by ``systemd-run --user --scope -p Delegate=yes`` or by hand in a container;
2. cgroup v2, when this process sits in the root cgroup of the hierarchy (a VM or a container whose
   cgroup namespace is its own): ``memory`` and ``pids`` are enabled below the root and the
   sandboxes go under ``lit-grpo-sandboxes/``;
3. cgroup v1 (hybrid hierarchies: the ``memory`` and ``pids`` controllers mounted on their own):
   a child of this process's own cgroup in each of the two hierarchies.

Otherwise (not root and no delegated directory, a v2 hierarchy this process may not delegate
from, no such controllers) there
is no cgroup: the sandbox reports the layer missing, the scoring process warns once, and memory is
bounded per process only (``RLIMIT_AS`` times ``RLIMIT_NPROC``; the system-call filter refuses the
kinds of memory that belong to no process: SysV shared memory, memfd, POSIX message queues).

Limits written: v2 ``memory.max``, ``memory.swap.max`` = 0, ``memory.oom.group`` = 1 (an
out-of-memory kill takes the whole sandbox), ``pids.max``; v1 ``memory.limit_in_bytes``,
``memory.memsw.limit_in_bytes`` (when swap accounting exists), ``pids.max``.

Disk reads, where the ``io`` controller (v2) or the ``blkio`` hierarchy (v1) can be used too: at most
``DISK_READ_BYTES_PER_S`` and ``DISK_READ_IOPS`` from each of the machine's disks (v2 ``io.max``, v1
``blkio.throttle.read_bps_device`` and ``read_iops_device``). The memory limit keeps the sandbox's
page cache small: a program that reads more of the machine's files than it holds (``/usr`` is
gigabytes) reads them from the disk again on every pass, at the disk's full speed (about 230 MB/s a
sandbox here), the trainer's checkpoints and data sets waiting behind it. What is cached is not
limited (the interpreter's start-up reads come from memory); a cold start reads a few MB.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import threading
import time

ENV_PARENT = "LIT_GRPO_SANDBOX_CGROUP"
PREFIX = "lit-grpo-sandbox-"
#: Disk reads a sandbox may make per second, from each disk of the machine: what a Python program
#: needs to start cold (a few MB), far below what a disk serves.
DISK_READ_BYTES_PER_S = 32 << 20
DISK_READ_IOPS = 2000


@dataclasses.dataclass(frozen=True)
class CgroupSupport:
    """Where sandbox cgroups go on this machine; ``version`` None means nowhere (``reason`` says why)."""

    version: int | None
    memory_parent: str | None = None
    pids_parent: str | None = None
    reason: str = ""
    #: where the disk-read limit goes (v2: the memory parent, with ``io`` enabled; v1: a ``blkio``
    #: directory), or None; and the machine's disks as "major:minor"
    io_parent: str | None = None
    disks: tuple = ()


@dataclasses.dataclass
class SandboxCgroup:
    """The directories of one sandbox's cgroup (one per hierarchy; the same one on v2)."""

    version: int
    dirs: list[str]
    disk_reads_limited: bool = False

    def procs(self) -> list[int]:
        """Processes still in the cgroup."""
        pids: set[int] = set()
        for d in self.dirs:
            try:
                with open(os.path.join(d, "cgroup.procs")) as f:
                    pids.update(int(line) for line in f if line.strip())
            except OSError:
                pass
        return sorted(pids)

    def add(self, pid: int) -> bool:
        """Move process ``pid`` into the cgroup (every hierarchy); False if the kernel refused."""
        try:
            for d in self.dirs:
                _write(os.path.join(d, "cgroup.procs"), str(pid))
            return True
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL everything in the cgroup at once, where the kernel can (v2, Linux >= 5.14)."""
        if self.version == 2:
            try:
                _write(os.path.join(self.dirs[0], "cgroup.kill"), "1")
            except OSError:
                pass

    def peak_memory_bytes(self) -> int | None:
        for d in self.dirs:
            for name in ("memory.peak", "memory.max_usage_in_bytes"):
                try:
                    with open(os.path.join(d, name)) as f:
                        return int(f.read().split()[0])
                except (OSError, ValueError, IndexError):
                    continue
        return None

    def remove(self, wait_s: float = 2.0) -> bool:
        """Remove the directories (empty cgroups only); False if one stayed (its processes live on)."""
        deadline = time.monotonic() + wait_s
        left, failed = list(self.dirs), False
        while left:
            for d in list(left):
                try:
                    os.rmdir(d)
                    left.remove(d)
                except FileNotFoundError:
                    left.remove(d)
                except OSError as exc:
                    if exc.errno != errno.EBUSY:  # not a matter of waiting
                        left.remove(d)
                        failed = True
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.005)  # the last processes are being reaped
        return not left and not failed


_support: CgroupSupport | None = None
_support_lock = threading.Lock()


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _mounts() -> list[tuple[str, str, str, str]]:
    """(mount point, root of the mount within its hierarchy, fs type, super options) of cgroup mounts."""
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, rfields = left.split(), right.split()
            if len(fields) < 5 or len(rfields) < 3 or rfields[0] not in ("cgroup", "cgroup2"):
                continue
            point = fields[4].encode().decode("unicode_escape")
            found.append((point, fields[3], rfields[0], rfields[2]))
    return found


def _own_cgroups() -> dict[str, str]:
    """Controller (or "" for v2) -> this process's cgroup path in that hierarchy."""
    paths = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            parts = line.rstrip("\n").split(":", 2)
            if len(parts) == 3:
                for controller in parts[1].split(",") if parts[1] else [""]:
                    paths[controller] = parts[2]
    return paths


def _under(mount_point: str, mount_root: str, path: str) -> str | None:
    """The directory of cgroup ``path`` in a hierarchy mounted at ``mount_point`` (from ``mount_root``)."""
    if mount_root != "/":
        if not (path == mount_root or path.startswith(mount_root.rstrip("/") + "/")):
            return None
        path = path[len(mount_root.rstrip("/")):] or "/"
    return os.path.normpath(mount_point + "/" + path.lstrip("/"))


def _v2_delegated(parent: str) -> bool:
    """Make ``memory`` and ``pids`` available to children of ``parent``; True when they are."""
    try:
        available = _read(os.path.join(parent, "cgroup.controllers")).split()
        if not {"memory", "pids"} <= set(available):
            return False
        enabled = _read(os.path.join(parent, "cgroup.subtree_control")).split()
        if not {"memory", "pids"} <= set(enabled):
            _write(os.path.join(parent, "cgroup.subtree_control"), "+memory +pids")
        return {"memory", "pids"} <= set(_read(os.path.join(parent, "cgroup.subtree_control")).split())
    except OSError:
        return False


def _detect() -> CgroupSupport:
    override = os.environ.get(ENV_PARENT)
    if override:  # root or not: a delegated directory is this process's to use
        if _v2_delegated(override):
            return _with_disk_limit(CgroupSupport(2, override, override))
        return CgroupSupport(None, reason=f"${ENV_PARENT}={override} is not a cgroup v2 directory with memory and pids delegated")
    if os.geteuid() != 0:
        return CgroupSupport(None, reason=f"not running as root (or set ${ENV_PARENT} to a delegated cgroup v2 directory)")
    try:
        mounts, own = _mounts(), _own_cgroups()
    except OSError as exc:
        return CgroupSupport(None, reason=f"cannot read the cgroup setup: {exc}")
    reasons = []
    for point, root, fstype, _ in mounts:
        if fstype != "cgroup2" or "" not in own:
            continue
        directory = _under(point, root, own[""])
        if directory is None or os.path.normpath(directory) != os.path.normpath(point):
            reasons.append("cgroup v2: this process is not in the root cgroup (set $%s to a delegated one)" % ENV_PARENT)
            continue
        try:
            controllers = _read(os.path.join(point, "cgroup.controllers")).split()
        except OSError:
            continue
        if not {"memory", "pids"} <= set(controllers):
            reasons.append("cgroup v2 at %s has no memory/pids controllers" % point)
            continue
        parent = os.path.join(point, "lit-grpo-sandboxes")
        try:
            os.makedirs(parent, exist_ok=True)
        except OSError as exc:
            reasons.append(f"cannot create {parent}: {exc}")
            continue
        if _v2_delegated(point) and _v2_delegated(parent):
            return _with_disk_limit(CgroupSupport(2, parent, parent), point)
        reasons.append(f"cannot enable memory and pids below {point}")
    v1 = {}
    for point, root, fstype, options in mounts:
        if fstype != "cgroup":
            continue
        for controller in ("memory", "pids", "blkio"):
            if controller in options.split(",") and controller in own and controller not in v1:
                directory = _under(point, root, own[controller])
                if directory and os.path.isdir(directory) and os.access(directory, os.W_OK):
                    v1[controller] = directory
    if "memory" in v1 and "pids" in v1:
        return _with_disk_limit(CgroupSupport(1, v1["memory"], v1["pids"], io_parent=v1.get("blkio")))
    if v1:
        reasons.append("cgroup v1: only %s is usable" % ", ".join(sorted(v1)))
    return CgroupSupport(None, reason="; ".join(reasons) or "no usable memory and pids cgroup controllers")


def _disks() -> tuple:
    """The machine's disks with something on them, as "major:minor" (whole disks: the limit is set on
    them and covers their partitions)."""
    found = []
    try:
        names = sorted(os.listdir("/sys/block"))
    except OSError:
        return ()
    for name in names:
        if name.startswith(("ram", "zram")):  # memory: nothing to protect, and no limit to take
            continue
        try:
            if int(_read(f"/sys/block/{name}/size")) > 0:
                found.append(_read(f"/sys/block/{name}/dev").strip())
        except (OSError, ValueError):
            continue
    return tuple(found)


def _with_disk_limit(where: CgroupSupport, *v2_ancestors: str) -> CgroupSupport:
    """``where`` with the disk-read limit's place filled in, where there is one."""
    disks = _disks()
    if not disks:
        return where
    if where.version == 1:
        return dataclasses.replace(where, disks=disks) if where.io_parent else where
    try:  # v2: enable ``io`` below each ancestor down to the parent (best effort)
        for d in (*v2_ancestors, where.memory_parent):
            if "io" not in _read(os.path.join(d, "cgroup.subtree_control")).split():
                _write(os.path.join(d, "cgroup.subtree_control"), "+io")
    except OSError:
        return where
    return dataclasses.replace(where, io_parent=where.memory_parent, disks=disks)


def support() -> CgroupSupport:
    """Where sandbox cgroups can be created on this machine (probed once per process)."""
    global _support
    with _support_lock:
        if _support is None:
            _support = _detect()
        return _support


def create(name: str, memory_bytes: int, max_pids: int, limit_disk_reads: bool = True) -> SandboxCgroup:
    """A new cgroup for one sandbox with these limits (and, where the machine allows it and
    ``limit_disk_reads``, the disk-read limit). Raises OSError when it cannot be made."""
    where = support()
    if where.version is None:
        raise OSError(errno.ENOTSUP, f"no sandbox cgroup: {where.reason}")
    memory_dir = os.path.join(where.memory_parent, PREFIX + name)
    pids_dir = os.path.join(where.pids_parent, PREFIX + name)
    dirs = [memory_dir] if memory_dir == pids_dir else [memory_dir, pids_dir]
    io_dir = None
    if limit_disk_reads and where.io_parent is not None:
        io_dir = os.path.join(where.io_parent, PREFIX + name)
        if io_dir not in dirs:
            dirs.append(io_dir)
    made = SandboxCgroup(where.version, [])
    try:
        for d in dirs:
            os.mkdir(d, 0o700)
            made.dirs.append(d)
        if where.version == 2:
            _write(os.path.join(memory_dir, "memory.max"), str(memory_bytes))
            for name_, value in (("memory.swap.max", "0"), ("memory.oom.group", "1")):
                try:
                    _write(os.path.join(memory_dir, name_), value)
                except OSError:
                    pass  # no swap accounting / an older kernel: the memory limit still holds
        else:
            _write(os.path.join(memory_dir, "memory.limit_in_bytes"), str(memory_bytes))
            memsw = os.path.join(memory_dir, "memory.memsw.limit_in_bytes")
            if os.path.exists(memsw):
                _write(memsw, str(memory_bytes))
        _write(os.path.join(pids_dir, "pids.max"), str(max_pids))
    except OSError:
        made.remove(wait_s=0.0)
        raise
    if io_dir is not None:
        made.disk_reads_limited = _limit_disk_reads(where, io_dir)
    return made


def _limit_disk_reads(where: CgroupSupport, io_dir: str) -> bool:
    """Write the disk-read limit for every disk; False if the kernel refused it for one (the others
    keep theirs)."""
    refused = False
    for disk in where.disks:
        try:
            if where.version == 2:
                _write(os.path.join(io_dir, "io.max"), f"{disk} rbps={DISK_READ_BYTES_PER_S} riops={DISK_READ_IOPS}")
            else:
                _write(os.path.join(io_dir, "blkio.throttle.read_bps_device"), f"{disk} {DISK_READ_BYTES_PER_S}")
                _write(os.path.join(io_dir, "blkio.throttle.read_iops_device"), f"{disk} {DISK_READ_IOPS}")
        except OSError:
            refused = True
    return not refused
