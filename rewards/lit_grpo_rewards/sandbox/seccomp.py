"""The sandbox's system-call filter: a deny-by-default seccomp program, built by hand, no dependency.

The sandboxed program may make only the system calls that a Python test program needs (files,
memory, threads and ``fork``, time, signals, pipes); everything else fails with ``EPERM`` before
the kernel looks at it (``clone3`` with ``ENOSYS``, so that the C library falls back to ``clone``,
whose flags the filter can read; ``fallocate`` with ``EOPNOTSUPP``, so that ``posix_fallocate`` writes
the blocks instead, within RLIMIT_FSIZE, which ``fallocate`` past the end of a file escapes). ``flock``
succeeds and does nothing (see ``fcntl``); so do ``fsync``, ``fdatasync``, ``msync``, ``sync``, ``syncfs``
and ``sync_file_range``: on a read-only file of the machine they still flush the disk's cache or commit
its journal, and the program's writable files are memory. A few allowed calls have their arguments
checked:

- ``open``, ``openat``, ``fcntl(F_SETFL)``: no ``O_DIRECT`` (``EINVAL``, as on a file system without
  it); ``preadv2``/``pwritev2``: no ``RWF_DONTCACHE`` (``EOPNOTSUPP``). Both read the machine's files
  past the page cache, at the disk's speed, on every read.
- ``clone``: no namespace flags (``CLONE_NEWUSER``, ``CLONE_NEWNS``, ...): no user namespaces.
- ``socketpair``: only a connected ``AF_UNIX`` ``SOCK_STREAM`` pair (asyncio's self-pipe), which can
  reach nothing outside; a datagram pair could ``sendto`` any socket path, so it is refused.
  ``socket()`` itself, ``connect``, ``bind``, ``listen`` and ``accept`` are not allowed at all: no
  Unix, netlink, packet or IP sockets.
- ``ioctl``: only the terminal and descriptor queries Python makes (``TCGETS`` for ``isatty``,
  ``TIOCGWINSZ``, ``FIONREAD``, ``FIONBIO``, ``FIOCLEX``, ``FIONCLEX``).
- ``prctl``: only naming threads and memory areas.
- ``prlimit64``: only on the calling process.
- ``mmap``: no ``MAP_HUGETLB`` (huge pages are a separate, often pre-reserved pool).
- ``fadvise64``: ``POSIX_FADV_DONTNEED`` succeeds and does nothing; ``preadv2``: no ``RWF_NOWAIT``.
  The page cache of the machine's files is shared: evicting a file's pages and then asking whether
  a read would wait for the disk tells when another process read them.
- ``fcntl``: file locks (``F_SETLK``, ``F_GETLK``, their OFD forms) succeed and do nothing, like
  ``flock``: every file but the scratch directory's is the machine's own, and a lock on it would be
  seen by other sandboxes and by the machine (a channel); leases and ``F_NOTIFY`` (watching a
  directory for other processes' reads and writes) are refused.

Refused, among everything not listed: ``execve`` (no other programs), sockets, SysV IPC (``shmget``,
``semget``, ``msgget``) and POSIX message queues, ``memfd_create``, the keyring (``add_key``,
``keyctl``, ``request_key``), ``unshare``/``setns``/``mount`` and the new mount API, ``ptrace``,
``process_vm_*``, ``pidfd_*``, ``bpf``, ``perf_event_open``, ``userfaultfd``, ``io_uring_*``,
``chown``, ``mknod``, setting extended attributes, ``mlock``, ``inotify``, ``splice``, every
``set*id``. The filter first checks the architecture: a 32-bit (``int 0x80``) call from an x86_64
process kills it, and x32-ABI numbers match nothing in the table, so they are refused.

The kernel itself lets two x86_64 calls through every filter, ``uretprobe`` (335) and ``uprobe``
(336): its own probe trampolines make them; from anywhere else they kill the caller (SIGILL) or fail.

Only x86_64 and aarch64 are known (``filter_for_machine`` returns None elsewhere: the sandbox then
runs without this layer and says so). The filter is installed with ``PR_SET_SECCOMP`` after
``PR_SET_NO_NEW_PRIVS``; it is inherited by every thread and child and cannot be removed.

This module is imported both by the runner (as a plain file next to it, by any Python >= 3.8) and by
the tests; it uses the standard library only.
"""

import ctypes
import errno
import os
import struct
import sys

# Syscall numbers. x86_64: arch/x86/entry/syscalls/syscall_64.tbl; aarch64 uses the generic table,
# include/uapi/asm-generic/unistd.h. Written by hand: the runner uses the standard library only (libseccomp
# is a C library, not always installed); the tests compare them with libseccomp's tables and the kernel headers.
X86_64 = {
    "read": 0, "write": 1, "open": 2, "close": 3, "stat": 4, "fstat": 5, "lstat": 6, "poll": 7, "lseek": 8,
    "mmap": 9, "mprotect": 10, "munmap": 11, "brk": 12, "rt_sigaction": 13, "rt_sigprocmask": 14,
    "rt_sigreturn": 15, "ioctl": 16, "pread64": 17, "pwrite64": 18, "readv": 19, "writev": 20, "access": 21,
    "pipe": 22, "select": 23, "sched_yield": 24, "mremap": 25, "msync": 26, "mincore": 27, "madvise": 28,
    "dup": 32, "dup2": 33, "pause": 34, "nanosleep": 35, "getitimer": 36, "alarm": 37, "setitimer": 38,
    "getpid": 39, "sendfile": 40, "sendto": 44, "recvfrom": 45, "sendmsg": 46, "recvmsg": 47, "shutdown": 48,
    "getsockname": 51, "getpeername": 52, "socketpair": 53, "setsockopt": 54, "getsockopt": 55, "clone": 56,
    "fork": 57, "vfork": 58, "exit": 60, "wait4": 61, "kill": 62, "uname": 63, "fcntl": 72, "flock": 73,
    "fsync": 74, "fdatasync": 75, "truncate": 76, "ftruncate": 77, "getdents": 78, "getcwd": 79, "chdir": 80,
    "fchdir": 81, "rename": 82, "mkdir": 83, "rmdir": 84, "link": 86, "unlink": 87, "symlink": 88,
    "readlink": 89, "chmod": 90, "fchmod": 91, "umask": 95, "gettimeofday": 96, "getrlimit": 97,
    "getrusage": 98, "sysinfo": 99, "times": 100, "getuid": 102, "getgid": 104, "geteuid": 107, "getegid": 108,
    "setpgid": 109, "getppid": 110, "getpgrp": 111, "setsid": 112, "getgroups": 115, "getresuid": 118,
    "getresgid": 120, "getpgid": 121, "getsid": 124, "rt_sigpending": 127, "rt_sigtimedwait": 128,
    "rt_sigsuspend": 130, "sigaltstack": 131, "statfs": 137, "fstatfs": 138, "getpriority": 140,
    "sched_getparam": 143, "sched_getscheduler": 145, "sched_get_priority_max": 146,
    "sched_get_priority_min": 147, "prctl": 157, "arch_prctl": 158, "setrlimit": 160, "sync": 162,
    "gettid": 186, "getxattr": 191, "lgetxattr": 192, "fgetxattr": 193, "listxattr": 194, "llistxattr": 195,
    "flistxattr": 196,
    "tkill": 200, "time": 201, "futex": 202, "sched_getaffinity": 204, "epoll_create": 213, "getdents64": 217,
    "set_tid_address": 218, "restart_syscall": 219, "fadvise64": 221, "timer_create": 222, "timer_settime": 223,
    "timer_gettime": 224, "timer_getoverrun": 225, "timer_delete": 226, "clock_gettime": 228,
    "clock_getres": 229, "clock_nanosleep": 230, "exit_group": 231, "epoll_wait": 232, "epoll_ctl": 233,
    "tgkill": 234, "waitid": 247, "openat": 257, "mkdirat": 258, "newfstatat": 262, "unlinkat": 263,
    "renameat": 264, "linkat": 265, "symlinkat": 266, "readlinkat": 267, "fchmodat": 268, "faccessat": 269,
    "pselect6": 270, "ppoll": 271, "set_robust_list": 273, "utimensat": 280, "epoll_pwait": 281,
    "sync_file_range": 277, "signalfd": 282, "timerfd_create": 283, "eventfd": 284, "fallocate": 285,
    "timerfd_settime": 286,
    "timerfd_gettime": 287, "signalfd4": 289, "eventfd2": 290, "epoll_create1": 291, "dup3": 292, "pipe2": 293,
    "preadv": 295, "pwritev": 296, "recvmmsg": 299, "prlimit64": 302, "syncfs": 306, "sendmmsg": 307, "getcpu": 309,
    "renameat2": 316, "getrandom": 318, "copy_file_range": 326, "preadv2": 327, "pwritev2": 328, "statx": 332,
    "rseq": 334, "clone3": 435, "close_range": 436, "faccessat2": 439, "epoll_pwait2": 441, "fchmodat2": 452,
    "map_shadow_stack": 453,
}
AARCH64 = {
    "getxattr": 8, "lgetxattr": 9, "fgetxattr": 10, "listxattr": 11, "llistxattr": 12, "flistxattr": 13,
    "getcwd": 17, "eventfd2": 19, "epoll_create1": 20, "epoll_ctl": 21, "epoll_pwait": 22, "dup": 23,
    "dup3": 24, "fcntl": 25, "ioctl": 29, "flock": 32, "mkdirat": 34, "unlinkat": 35, "symlinkat": 36,
    "linkat": 37, "renameat": 38, "statfs": 43, "fstatfs": 44, "truncate": 45, "ftruncate": 46,
    "fallocate": 47, "faccessat": 48, "chdir": 49, "fchdir": 50, "fchmod": 52, "fchmodat": 53, "openat": 56,
    "close": 57, "pipe2": 59, "getdents64": 61, "lseek": 62, "read": 63, "write": 64, "readv": 65,
    "writev": 66, "pread64": 67, "pwrite64": 68, "preadv": 69, "pwritev": 70, "sendfile": 71, "pselect6": 72,
    "ppoll": 73, "signalfd4": 74, "readlinkat": 78, "newfstatat": 79, "fstat": 80, "sync": 81, "fsync": 82,
    "fdatasync": 83, "sync_file_range": 84, "timerfd_create": 85, "timerfd_settime": 86, "timerfd_gettime": 87,
    "utimensat": 88,
    "exit": 93, "exit_group": 94, "waitid": 95, "set_tid_address": 96, "futex": 98, "set_robust_list": 99,
    "nanosleep": 101, "getitimer": 102, "setitimer": 103, "timer_create": 107, "timer_gettime": 108,
    "timer_getoverrun": 109, "timer_settime": 110, "timer_delete": 111, "clock_gettime": 113,
    "clock_getres": 114, "clock_nanosleep": 115, "sched_getscheduler": 120, "sched_getparam": 121,
    "sched_getaffinity": 123, "sched_yield": 124, "sched_get_priority_max": 125, "sched_get_priority_min": 126,
    "restart_syscall": 128, "kill": 129, "tkill": 130, "tgkill": 131, "sigaltstack": 132, "rt_sigsuspend": 133,
    "rt_sigaction": 134, "rt_sigprocmask": 135, "rt_sigpending": 136, "rt_sigtimedwait": 137,
    "rt_sigreturn": 139, "getpriority": 141, "getresuid": 148, "getresgid": 150, "times": 153, "setpgid": 154,
    "getpgid": 155, "getsid": 156, "setsid": 157, "getgroups": 158, "uname": 160, "getrlimit": 163,
    "setrlimit": 164, "getrusage": 165, "umask": 166, "prctl": 167, "getcpu": 168, "gettimeofday": 169,
    "getpid": 172, "getppid": 173, "getuid": 174, "geteuid": 175, "getgid": 176, "getegid": 177, "gettid": 178,
    "sysinfo": 179, "socketpair": 199, "getsockname": 204, "getpeername": 205, "sendto": 206, "recvfrom": 207,
    "setsockopt": 208, "getsockopt": 209, "shutdown": 210, "sendmsg": 211, "recvmsg": 212, "brk": 214,
    "munmap": 215, "mremap": 216, "clone": 220, "mmap": 222, "fadvise64": 223, "mprotect": 226, "msync": 227,
    "mincore": 232, "madvise": 233, "recvmmsg": 243, "wait4": 260, "prlimit64": 261, "syncfs": 267, "sendmmsg": 269,
    "renameat2": 276, "getrandom": 278, "copy_file_range": 285, "preadv2": 286, "pwritev2": 287, "statx": 291,
    "rseq": 293, "clone3": 435, "close_range": 436, "faccessat2": 439, "epoll_pwait2": 441, "fchmodat2": 452,
}

AUDIT_ARCH_X86_64 = 0xC000003E
AUDIT_ARCH_AARCH64 = 0xC00000B7
MACHINES = {"x86_64": (AUDIT_ARCH_X86_64, X86_64), "amd64": (AUDIT_ARCH_X86_64, X86_64),
            "aarch64": (AUDIT_ARCH_AARCH64, AARCH64), "arm64": (AUDIT_ARCH_AARCH64, AARCH64)}

#: Calls allowed whatever their arguments. Everything else is refused, except the calls in ARG_RULES
#: (allowed for some arguments) and ``clone3`` (ENOSYS, so that the C library falls back to ``clone``).
ALLOWED = (
    # the hottest first: the filter compares one number after the other
    "read", "write", "futex", "munmap", "brk", "mprotect", "madvise", "mremap", "close", "lseek", "fstat", "newfstatat",
    "stat", "lstat", "statx", "getdents64", "getdents",
    "pread64", "pwrite64", "readv", "writev", "preadv", "pwritev", "close_range",
    "access", "faccessat", "faccessat2", "readlink", "readlinkat", "getcwd", "chdir", "fchdir",
    "mkdir", "mkdirat", "rmdir", "unlink", "unlinkat", "rename", "renameat", "renameat2", "link", "linkat",
    "symlink", "symlinkat", "chmod", "fchmod", "fchmodat", "fchmodat2", "truncate", "ftruncate", "utimensat", "dup",
    "dup2", "dup3", "pipe", "pipe2",
    "select", "pselect6", "poll", "ppoll", "epoll_create", "epoll_create1", "epoll_ctl", "epoll_wait",
    "epoll_pwait", "epoll_pwait2", "eventfd", "eventfd2", "statfs", "fstatfs", "sendfile",
    "copy_file_range", "getxattr", "lgetxattr", "fgetxattr", "listxattr", "llistxattr", "flistxattr", "umask",
    "mincore", "map_shadow_stack",
    "fork", "vfork", "exit", "exit_group", "wait4", "waitid", "kill", "tgkill", "tkill", "getpid", "getppid",
    "gettid", "getuid", "geteuid", "getgid", "getegid", "getgroups", "getresuid", "getresgid", "setsid",
    "setpgid", "getpgid", "getpgrp", "getsid", "set_tid_address", "set_robust_list", "rseq", "arch_prctl",
    "sched_yield", "sched_getaffinity", "sched_getparam", "sched_getscheduler", "sched_get_priority_max",
    "sched_get_priority_min", "getpriority", "getcpu",
    "nanosleep", "clock_nanosleep", "clock_gettime", "clock_getres", "gettimeofday", "time", "times", "alarm",
    "setitimer", "getitimer", "timer_create", "timer_settime", "timer_gettime", "timer_getoverrun",
    "timer_delete", "timerfd_create", "timerfd_settime", "timerfd_gettime",
    "getrandom", "getrlimit", "setrlimit", "getrusage", "sysinfo", "uname", "restart_syscall",
    "rt_sigaction", "rt_sigprocmask", "rt_sigreturn", "rt_sigpending", "rt_sigtimedwait", "rt_sigsuspend",
    "sigaltstack", "pause", "signalfd", "signalfd4",
    # on the one kind of socket a sandbox can have (a connected AF_UNIX stream pair, see socketpair)
    "sendto", "recvfrom", "sendmsg", "recvmsg", "sendmmsg", "recvmmsg", "shutdown", "getsockname",
    "getpeername", "getsockopt", "setsockopt",
)

AF_UNIX = 1
SOCK_STREAM = 1
SOCK_TYPE_MASK = 0xF  # the rest of socketpair's type are SOCK_NONBLOCK / SOCK_CLOEXEC
CLONE_NAMESPACES = (0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000)
# NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET
MAP_HUGETLB = 0x40000
IOCTLS = {"TCGETS": 0x5401, "TIOCGWINSZ": 0x5413, "FIONREAD": 0x541B, "FIONBIO": 0x5421,
          "FIONCLEX": 0x5450, "FIOCLEX": 0x5451}
PRCTLS = {"PR_SET_NAME": 15, "PR_GET_NAME": 16, "PR_SET_VMA": 0x53564D41}
#: fcntl commands that take or test a file lock: the lock would be on the file itself, which for every
#: file but the scratch directory's is the machine's (the minimal root binds the machine's files),
#: seen by other sandboxes and the machine's own processes (a channel). They succeed and do nothing.
FCNTL_LOCKS = {"F_GETLK": 5, "F_SETLK": 6, "F_SETLKW": 7, "F_OFD_GETLK": 36, "F_OFD_SETLK": 37, "F_OFD_SETLKW": 38}
#: fcntl commands refused: leases and directory notification (dnotify) watch what other processes do
#: with the machine's files.
FCNTL_WATCHES = {"F_SETLEASE": 1024, "F_GETLEASE": 1025, "F_NOTIFY": 1026}
SUCCEED = 0  # SECCOMP_RET_ERRNO with errno 0: the call returns 0 and the kernel does nothing
#: The page cache of the machine's files is shared with every other process: evicting a file's pages
#: (``posix_fadvise(POSIX_FADV_DONTNEED)``) and then asking whether a read would wait for the disk
#: (``preadv2(RWF_NOWAIT)``) tells when another sandbox or the machine read them (a channel).
POSIX_FADV_DONTNEED = 4
RWF_NOWAIT = 0x8
#: The machine's disk is the trainer's too (checkpoints, data sets, its own fsync latency). A program
#: reads the machine's files through the page cache only: ``O_DIRECT`` (set by ``open``/``openat`` or
#: later by ``fcntl(F_SETFL)``) and ``RWF_DONTCACHE`` (``preadv2``/``pwritev2``, Linux >= 6.14) read
#: them uncached, at the disk's speed, every time; they are refused with the errors of a file system
#: that lacks them (EINVAL, EOPNOTSUPP). The value of ``O_DIRECT`` depends on the architecture.
O_DIRECT = {AUDIT_ARCH_X86_64: 0o40000, AUDIT_ARCH_AARCH64: 0o200000}
RWF_DONTCACHE = 0x80
F_SETFL = 4
#: Calls that push the page cache to the disk and wait for it: on a read-only file of the machine
#: they still flush the disk's write cache or commit its journal, once per call (four programs made
#: ~1,100 ``fdatasync`` calls in 2 s; the trainer's fsync p95 went from 3.0 to 8.6 ms). The
#: program's only writable files are memory (the scratch tmpfs, its output), where they do nothing
#: either: they succeed and do nothing.
SYNCS = ("fsync", "fdatasync", "msync", "sync", "syncfs", "sync_file_range")


def arg_rules(audit_arch):
    """Calls allowed only for some arguments: name -> (argument index, test, values).

    ``("in", values)``: the argument's low 32 bits are one of ``values``; ``("none_of", mask)``: none
    of the bits of ``mask`` is set; ``("flags", ((mask, errno), ...))``: the errno of the first
    ``mask`` with a bit set, else allowed; ``("pair", ...)`` is socketpair's own rule (family and
    type); ``("cases", {value: outcome})``: for these values the outcome, an errno (``SUCCEED``: none)
    or a rule on another argument; every other value allowed."""
    uncached = ((O_DIRECT[audit_arch], errno.EINVAL),)
    return {
        "mmap": (3, "none_of", MAP_HUGETLB),  # first: malloc calls it often
        "openat": (2, "flags", uncached),
        "open": (1, "flags", uncached),
        "clone": (0, "none_of", CLONE_NAMESPACES),
        "socketpair": (0, "pair", (AF_UNIX, SOCK_STREAM)),
        "ioctl": (1, "in", tuple(IOCTLS.values())),
        "prctl": (0, "in", tuple(PRCTLS.values())),
        "prlimit64": (0, "in", (0,)),
        "fadvise64": (3, "cases", {POSIX_FADV_DONTNEED: SUCCEED}),  # advice may be ignored: it is
        "preadv2": (5, "flags", ((RWF_NOWAIT, errno.EPERM), (RWF_DONTCACHE, errno.EOPNOTSUPP))),
        "pwritev2": (5, "flags", ((RWF_DONTCACHE, errno.EOPNOTSUPP),)),
        "fcntl": (1, "cases", dict([(cmd, SUCCEED) for cmd in FCNTL_LOCKS.values()]
                                   + [(cmd, errno.EPERM) for cmd in FCNTL_WATCHES.values()]
                                   + [(F_SETFL, (2, "flags", uncached))])),
    }


#: The calls with argument rules (the same names on every architecture; the values may differ).
ARG_RULES = arg_rules(AUDIT_ARCH_X86_64)
#: Calls refused with another errno than EPERM, for the C library's sake: ``clone3`` with ENOSYS (it
#: falls back to ``clone``, whose flags the filter can read); ``fallocate`` with EOPNOTSUPP
#: (``posix_fallocate`` then writes the blocks, which RLIMIT_FSIZE bounds: the call itself allocates
#: blocks past the end of a file, where the limit does not look); ``flock`` with no error at all: it
#: succeeds and locks nothing (see ``FCNTL_LOCKS``); the ``SYNCS``, which succeed and do nothing.
REFUSED_WITH = dict([("clone3", errno.ENOSYS), ("fallocate", errno.EOPNOTSUPP), ("flock", SUCCEED)]
                    + [(name, SUCCEED) for name in SYNCS])

# struct seccomp_data: int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6]
OFFSET_NR = 0
OFFSET_ARCH = 4
OFFSET_ARGS = 16

BPF_LD_W_ABS = 0x20
BPF_ALU_AND_K = 0x54
BPF_JEQ_K = 0x15
BPF_JSET_K = 0x45
BPF_RET_K = 0x06
SECCOMP_RET_KILL_PROCESS = 0x80000000
SECCOMP_RET_ERRNO = 0x00050000
SECCOMP_RET_ALLOW = 0x7FFF0000
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2


def _low_word_offset(index):
    """Offset of the low 32 bits of syscall argument ``index`` in struct seccomp_data."""
    return OFFSET_ARGS + 8 * index + (0 if sys.byteorder == "little" else 4)


def _stmt(code, k):
    return (code, 0, 0, k)


def _jump(code, k, jt, jf):
    if not (0 <= jt < 256 and 0 <= jf < 256):
        raise ValueError("seccomp filter: jump out of range")
    return (code, jt, jf, k)


def _deny(err=errno.EPERM):
    return _stmt(BPF_RET_K, SECCOMP_RET_ERRNO | err)


def _allow():
    return _stmt(BPF_RET_K, SECCOMP_RET_ALLOW)


def _arg_block(rule):
    """Instructions that decide a call by one argument (the syscall number already matched)."""
    index, test, values = rule
    if test == "none_of":
        # A = low word; if A & mask: deny else allow
        return [_stmt(BPF_LD_W_ABS, _low_word_offset(index)), _jump(BPF_JSET_K, values, 0, 1), _deny(), _allow()]
    if test == "in":
        block = [_stmt(BPF_LD_W_ABS, _low_word_offset(index))]
        n = len(values)
        for i, value in enumerate(values):  # a match jumps over the remaining comparisons and the deny
            block.append(_jump(BPF_JEQ_K, value, n - i, 0))
        return block + [_deny(), _allow()]
    if test == "flags":
        # A = low word; for each mask: if A & mask: deny with its errno; else allow
        block = [_stmt(BPF_LD_W_ABS, _low_word_offset(index))]
        for mask, err in values:
            block += [_jump(BPF_JSET_K, mask, 0, 1), _deny(err)]
        return block + [_allow()]
    if test == "cases":
        block = [_stmt(BPF_LD_W_ABS, _low_word_offset(index))]
        for value, outcome in values.items():
            # an errno, or a rule on another argument (its block ends in returns: a mismatch jumps
            # over it with A still this argument)
            inner = _arg_block(outcome) if isinstance(outcome, tuple) else [_deny(outcome)]
            block += [_jump(BPF_JEQ_K, value, 0, len(inner))] + inner
        return block + [_allow()]
    if test == "pair":
        family, sock_type = values
        return [
            _stmt(BPF_LD_W_ABS, _low_word_offset(0)), _jump(BPF_JEQ_K, family, 0, 3),
            _stmt(BPF_LD_W_ABS, _low_word_offset(1)), _stmt(BPF_ALU_AND_K, SOCK_TYPE_MASK),
            _jump(BPF_JEQ_K, sock_type, 1, 0), _deny(), _allow(),
        ]
    raise ValueError("seccomp filter: unknown argument test %r" % (test,))


def build_filter(audit_arch, numbers):
    """The filter as a list of ``(code, jt, jf, k)`` BPF instructions for one architecture."""
    overlap = set(ALLOWED) & (set(ARG_RULES) | set(REFUSED_WITH))
    if overlap:  # an unconditional allow would come first and skip the rule
        raise ValueError("seccomp filter: %s both allowed outright and by rule" % sorted(overlap))
    program = [
        _stmt(BPF_LD_W_ABS, OFFSET_ARCH),
        _jump(BPF_JEQ_K, audit_arch, 1, 0),
        _stmt(BPF_RET_K, SECCOMP_RET_KILL_PROCESS),  # another ABI (32-bit int 0x80): kill, never guess
        _stmt(BPF_LD_W_ABS, OFFSET_NR),
    ]
    for name in ALLOWED:
        if name in numbers:
            program += [_jump(BPF_JEQ_K, numbers[name], 0, 1), _allow()]
    for name, rule in arg_rules(audit_arch).items():
        if name in numbers:
            block = _arg_block(rule)
            program.append(_jump(BPF_JEQ_K, numbers[name], 0, len(block)))
            program += block  # every block ends in returns; a mismatch jumps over it with A still = nr
    for name, err in REFUSED_WITH.items():
        if name in numbers:
            program += [_jump(BPF_JEQ_K, numbers[name], 0, 1), _deny(err)]
    program.append(_deny())
    return program


def filter_for_machine(machine=None):
    """The filter for this (or the named) machine, or None for an architecture this module does not know."""
    machine = (machine or os.uname().machine).lower()
    if machine not in MACHINES:
        return None
    audit_arch, numbers = MACHINES[machine]
    return build_filter(audit_arch, numbers)


def install(program):
    """Load ``program`` into the kernel for this process (its threads and children inherit it).

    Needs ``PR_SET_NO_NEW_PRIVS`` (or CAP_SYS_ADMIN). Raises OSError when the kernel refuses.
    """
    class SockFilter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint)]

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]

    instructions = (SockFilter * len(program))(*[SockFilter(*ins) for ins in program])
    fprog = SockFprog(len(program), instructions)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(fprog), 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, "seccomp filter refused: %s" % errno.errorcode.get(err, err))


def packed(program):
    """The filter as the bytes the kernel reads (struct sock_filter[]), for inspection."""
    return b"".join(struct.pack("=HBBI", *ins) for ins in program)
