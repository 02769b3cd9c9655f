"""The program process's audit hook: a tripwire inside the interpreter, not a wall."""

import os
import sys

#: files outside the sandbox directory the program may open for writing
ALLOWED_FILES = ("/dev/null",)
#: audit events refused outright, by prefix (sockets: but for a Unix stream pair) and by name
BLOCKED_PREFIXES = ("socket.", "ctypes.", "syslog.", "sqlite3.enable_load_extension", "sqlite3.load_extension")
BLOCKED = frozenset({
    "os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system", "os.startfile",
    "os.kill", "os.killpg", "signal.pthread_kill", "subprocess.Popen",
    "gc.get_objects", "gc.get_referrers", "gc.get_referents",
})
#: event -> indexes of path arguments that must lie in the sandbox directory
PATH_EVENTS = {
    "os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,), "os.chmod": (0,), "os.chown": (0,),
    "os.rename": (0, 1), "os.link": (0, 1), "os.symlink": (1,), "os.truncate": (0,), "os.utime": (0,),
    "os.mkfifo": (0,), "os.mknod": (0,), "os.setxattr": (0,), "os.removexattr": (0,),
    "shutil.rmtree": (0,), "shutil.move": (1,), "shutil.copyfile": (1,), "shutil.copytree": (1,),
}


def install_audit_hook(workdir):
    """Refuse, inside the interpreter, what the sandbox never needs. A tripwire, not a wall.

    Sockets are refused except AF_UNIX stream objects (a ``socketpair``, as asyncio makes; the
    seccomp filter refuses every ``socket()`` call anyway and lets only that pair through)."""
    import errno as _errno_mod

    workdir = os.path.realpath(workdir)
    # the hook reads the tables from its closure, not from this module's globals (which the program can rebind)
    allowed_files, blocked_prefixes, blocked, path_events = ALLOWED_FILES, BLOCKED_PREFIXES, BLOCKED, dict(PATH_EVENTS)
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

    def all_inside(paths):  # the check's own calls raise audit events too: the hook lets them pass
        state["busy"] = True
        try:
            return all(inside(path) for path in paths)
        finally:
            state["busy"] = False

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
            if writing and not all_inside([path]):
                deny("writing %r" % (path,))
        elif event == "sqlite3.connect":
            db = args[0] if args else None
            if db not in (":memory:", b":memory:", "", b"") and not all_inside([db]):
                deny(event)
        elif event in path_events:
            if not all_inside([args[i] for i in path_events[event] if i < len(args) and args[i] is not None]):
                deny(event)

    sys.addaudithook(hook)
