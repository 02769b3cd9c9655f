"""The code sandbox against a hostile program: one test per attack class.

Each attack runs once with every layer and then with the layer (or layers) that should stop it
switched off (``run_in_sandbox(_disable_layers=...)``, a test-only switch): it must fail with the
layers on and succeed without them, so that each test is shown to be able to fail. Where two layers
each stop an attack alone, each is switched off on its own (the attack still fails) and then both
(it succeeds). The audit hook is off (``audit_hook=False``) unless a test says otherwise: it is a
tripwire in the program's own interpreter, and the other layers must hold without it.

Attacks that no layer switch can show (the judge's own rules, the trainer's side of the wall, the
program's process group: the forgeries through plain data in section 7, sections 14, 15 and 18, the
signal in 17, and 20) were each run against the code before the change that contains them (issue
46: a worktree of the commit before, ``PYTHONPATH`` pointing at it), where they succeeded: forged
passes through named tuples and fake modules, parsers taking seconds, the trainer's peak memory,
the judge killed by ``kill(0)``, the judge's frames, builtins and modules reached from what a test
handed over, writes through stdin.

Every test also checks, through the fixtures, that the scoring process and a bystander process of
the machine survive and that nothing of the sandbox outlives the call (directory, process, cgroup).

Attacks whose "without the layer" run would harm this machine are bounded instead: the fork bomb
forks 64 processes, the memory attacks hold a few hundred MiB, the flood writes 3 MiB, the signal
attack targets a decoy process and probes the test process with signal 0, and nothing connects to
a socket this test did not open.
"""

from __future__ import annotations

import functools
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest
from lit_grpo_rewards.code import code_execution
from lit_grpo_rewards.sandbox import run_in_sandbox, sandbox_layers
from sandbox_fixtures import bystander, rss_kb, sandbox_processes, sandbox_tmp  # noqa: F401 - fixtures

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the code sandbox needs Linux"),
    pytest.mark.usefixtures("sandbox_tmp", "bystander"),
]

TIMEOUT = 10.0
MACHINE = os.uname().machine
# Syscall numbers the attacks call directly (x86_64, aarch64).
NR = {
    "x86_64": {"add_key": 248, "keyctl": 250, "unshare": 272, "ptrace": 101, "perf_event_open": 298,
               "io_uring_setup": 425, "bpf": 321, "userfaultfd": 323, "process_vm_readv": 310, "kcmp": 312,
               "pidfd_open": 434, "setns": 308, "mount": 165, "shmget": 29, "shmat": 30, "shmdt": 67},
    "aarch64": {"add_key": 217, "keyctl": 219, "unshare": 97, "ptrace": 117, "perf_event_open": 241,
                "io_uring_setup": 425, "bpf": 280, "userfaultfd": 282, "process_vm_readv": 270, "kcmp": 272,
                "pidfd_open": 434, "setns": 268, "mount": 40, "shmget": 194, "shmat": 196, "shmdt": 197},
}.get(MACHINE)


@functools.lru_cache(maxsize=1)
def layers_here() -> dict:
    return sandbox_layers()


def available(name: str) -> bool:
    found = layers_here()
    if name == "seccomp":
        return bool(found.get("seccomp") and found.get("judge_seccomp"))
    return bool(found.get(name))


def require(*names: str) -> None:
    """Skip unless this machine has these layers (the ones a row relies on to stop the attack)."""
    missing = [n for n in names if not available(n)]
    if missing:
        pytest.skip(f"this machine lacks the layer(s) {missing} (reported: {layers_here()})")


def rows(relevant: tuple[str, ...], alone: bool = True):
    """Parametrization: every layer on; each relevant layer off alone (others still stop the attack,
    when ``alone``); all relevant layers off (the attack succeeds). Items: (without, succeeds)."""
    out = [pytest.param((), False, id="all-layers")]
    if alone and len(relevant) > 1:
        out += [pytest.param((name,), False, id=f"without-{name}") for name in relevant]
    out.append(pytest.param(tuple(relevant), True, id="without-" + "-".join(relevant)))
    return out


def attack(code: str, without=(), tests=("assert WORKED",), **kwargs):
    kwargs.setdefault("timeout", TIMEOUT)
    kwargs.setdefault("audit_hook", False)
    start = time.monotonic()
    result = run_in_sandbox(code, tests=list(tests), _disable_layers=without, **kwargs)
    assert time.monotonic() - start < kwargs["timeout"] + 5.0
    return result


def worked(result) -> bool:
    return bool(result.test_results) and all(r is True for r in result.test_results)


def check_rows(relevant, without, succeeds):
    """Skip a row whose expectation rests on a layer this machine does not have: the relevant layers
    still on are the ones that must stop the attack."""
    require(*[n for n in relevant if n not in without])


# --------------------------------------------------------------------------------------------------
# 1. Network: a TCP listener of the machine's
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def tcp_listener():
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.setblocking(False)
    yield server
    server.close()


def accepted(server) -> bool:
    try:
        conn, _ = server.accept()
    except BlockingIOError:
        return False
    conn.close()
    return True


@pytest.mark.parametrize("without, succeeds", rows(("network_namespace", "seccomp")))
def test_network(tcp_listener, without, succeeds):
    check_rows(("network_namespace", "seccomp"), without, succeeds)
    port = tcp_listener.getsockname()[1]
    code = f"""
import socket
WORKED = False
try:
    s = socket.create_connection(("127.0.0.1", {port}), timeout=2)
    s.sendall(b"pwned")
    WORKED = True
except OSError:
    pass
"""
    result = attack(code, without)
    assert worked(result) == succeeds
    assert accepted(tcp_listener) == succeeds


# --------------------------------------------------------------------------------------------------
# 2. Unix sockets at a path (the network namespace does not cover them), after switching the audit
#    hook off from inside, as a completion did: the kernel must refuse.
# --------------------------------------------------------------------------------------------------

HOOK_OFF = """
import os
def switch_off_the_audit_hook():
    # A refused event's traceback holds the hook's frame; its closure state has a 'busy' flag that
    # makes the hook return early. Five lines, no ctypes.
    try:
        os.system("true")
    except PermissionError as exc:
        tb = exc.__traceback__
        while tb is not None:
            state = tb.tb_frame.f_locals.get("state")
            if isinstance(state, dict) and "busy" in state:
                state["busy"] = True
            tb = tb.tb_next
    try:
        os.system("true")  # with the hook off this is no longer a PermissionError from the hook
        return True
    except PermissionError:
        return False
HOOK_IS_OFF = switch_off_the_audit_hook()
"""


@pytest.fixture
def unix_listeners():
    """A stream and a datagram Unix socket in a world-accessible directory, like /run's sockets."""
    directory = tempfile.mkdtemp(prefix="lit-grpo-attack-", dir="/tmp")
    os.chmod(directory, 0o755)
    stream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stream.bind(os.path.join(directory, "stream"))
    stream.listen(8)
    stream.setblocking(False)
    dgram = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    dgram.bind(os.path.join(directory, "dgram"))
    dgram.setblocking(False)
    for name in ("stream", "dgram"):
        os.chmod(os.path.join(directory, name), 0o777)
    yield directory, stream, dgram
    stream.close()
    dgram.close()
    for name in ("stream", "dgram"):
        os.unlink(os.path.join(directory, name))
    os.rmdir(directory)


@pytest.mark.parametrize("without, succeeds", rows(("seccomp", "minimal_root")))
def test_unix_sockets_at_a_path_after_switching_off_the_audit_hook(unix_listeners, without, succeeds):
    """The filter refuses the sockets; the minimal root does not even hold the machine's socket files."""
    check_rows(("seccomp", "minimal_root"), without, succeeds)
    directory, stream, dgram = unix_listeners
    code = HOOK_OFF + f"""
import socket
WORKED = False
try:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect({os.path.join(directory, "stream")!r})
    s.sendall(b"pwned")
    WORKED = True
except OSError:
    pass
try:  # a datagram pair is connected to itself, but sendto() takes any path
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    a.sendto(b"pwned", {os.path.join(directory, "dgram")!r})
    WORKED = True
except OSError:
    pass
"""
    result = attack(code, without, tests=["assert HOOK_IS_OFF", "assert WORKED"], audit_hook=True)
    assert result.test_results[0] is True, "the audit hook bypass itself did not work"
    assert (result.test_results[1] is True) == succeeds
    assert accepted(stream) == succeeds
    try:
        got = dgram.recv(16)
    except BlockingIOError:
        got = b""
    assert (got == b"pwned") == succeeds


@pytest.mark.parametrize("without, succeeds", rows(("seccomp",)))
def test_other_socket_families(without, succeeds):
    """Netlink (the kernel's configuration interface), packet, vsock (the hypervisor): none may even
    be created. Nothing is connected: creating one is the attack."""
    check_rows(("seccomp",), without, succeeds)
    code = """
import socket
CREATED = []
for name, args in (("netlink", (16, socket.SOCK_RAW, 0)), ("packet", (17, socket.SOCK_RAW, 0)),
                   ("vsock", (40, socket.SOCK_STREAM, 0)), ("inet", (2, socket.SOCK_STREAM, 0))):
    try:
        socket.socket(*args).close()
        CREATED.append(name)
    except OSError:
        pass
WORKED = "netlink" in CREATED
"""
    result = attack(code, without, tests=["assert WORKED", "assert CREATED"])
    assert worked(result) == succeeds


# --------------------------------------------------------------------------------------------------
# 3. Memory outside the address-space limit: SysV shared memory and memfd files belong to no
#    process. 64 MiB allowed; the attacks hold 200-240 MiB when nothing stops them.
# --------------------------------------------------------------------------------------------------

SHM_ATTACK = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
libc.shmdt.argtypes = [ctypes.c_void_p]
HELD_MB = 0
for _ in range(8):  # attach 30 MiB, fill it, detach: the segment keeps it, the address space does not
    seg = libc.shmget(0, 30 << 20, 0o1600)
    if seg < 0:
        break
    addr = libc.shmat(seg, None, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        break
    ctypes.memset(addr, 1, 30 << 20)
    libc.shmdt(addr)
    HELD_MB += 30
WORKED = HELD_MB >= 240
"""

MEMFD_ATTACK = """
import os
HELD_MB, fds = 0, []
for _ in range(60):  # 4 MiB per file (the file-size limit is max_output_bytes), 64 descriptors
    try:
        fd = os.memfd_create("x")
        for _ in range(4):
            os.write(fd, b"x" * (1 << 20))
    except OSError:
        break
    fds.append(fd)
    HELD_MB += 4
WORKED = HELD_MB >= 200  # about 59 descriptors are free
"""


@pytest.mark.parametrize("kind", ["sysv-shm", "memfd"])
@pytest.mark.parametrize("without, succeeds", rows(("seccomp", "cgroup")))
def test_memory_that_belongs_to_no_process(kind, without, succeeds):
    check_rows(("seccomp", "cgroup"), without, succeeds)
    code = SHM_ATTACK if kind == "sysv-shm" else MEMFD_ATTACK
    result = attack(code, without, memory_mb=64, max_output_bytes=4 << 20)
    assert worked(result) == succeeds


# --------------------------------------------------------------------------------------------------
# 4. The kernel keyring: neither namespaced nor limited per sandbox
# --------------------------------------------------------------------------------------------------


@pytest.mark.skipif(NR is None, reason=f"no syscall numbers for {MACHINE}")
@pytest.mark.parametrize("without, succeeds", rows(("seccomp",)))
def test_kernel_keyring(without, succeeds):
    check_rows(("seccomp",), without, succeeds)
    code = f"""
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
# into the process keyring (-2): if the filter fails to stop it, the key dies with the process
key = libc.syscall({NR["add_key"]}, b"user", b"lit-grpo-attack", b"payload", 7, ctypes.c_long(-2))
WORKED = key > 0
"""
    assert worked(attack(code, without)) == succeeds


# --------------------------------------------------------------------------------------------------
# 5. Namespaces and the other calls a test program never needs; deny by default
# --------------------------------------------------------------------------------------------------


@pytest.mark.skipif(NR is None, reason=f"no syscall numbers for {MACHINE}")
@pytest.mark.parametrize("without, succeeds", rows(("seccomp",)))
def test_creating_a_user_namespace(without, succeeds):
    check_rows(("seccomp",), without, succeeds)
    code = f"""
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
WORKED = libc.syscall({NR["unshare"]}, 0x10000000) == 0  # CLONE_NEWUSER: root in a namespace of its own
"""
    result = attack(code, without)
    if succeeds and not worked(result):
        pytest.skip("this kernel refuses unprivileged user namespaces anyway")
    assert worked(result) == succeeds


@pytest.mark.skipif(NR is None, reason=f"no syscall numbers for {MACHINE}")
@pytest.mark.parametrize("without, succeeds", rows(("seccomp",)))
def test_calls_a_test_program_never_needs(without, succeeds):
    """ptrace, perf, io_uring, bpf, userfaultfd, reading another process's memory, pidfds, mount,
    setns, execve: each refused with EPERM by the filter (without it, the kernel lets an
    unprivileged process make some of them: that is the attack)."""
    check_rows(("seccomp",), without, succeeds)
    code = f"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
import struct
attr = ctypes.create_string_buffer(128)  # perf_event_attr: software CPU clock, user space only
struct.pack_into("<IIQ", attr, 0, 1, 128, 0)
struct.pack_into("<Q", attr, 40, 0x60)  # exclude_kernel | exclude_hv
params = ctypes.create_string_buffer(120)
calls = {{
    "perf_event_open": ({NR["perf_event_open"]}, attr, 0, -1, -1, 0),
    "io_uring_setup": ({NR["io_uring_setup"]}, 1, params),
    "bpf": ({NR["bpf"]}, 0, 0, 0),
    "userfaultfd": ({NR["userfaultfd"]}, 0),
    "process_vm_readv": ({NR["process_vm_readv"]}, os.getpid(), 0, 0, 0, 0, 0),  # another pid: the judge's
    "kcmp": ({NR["kcmp"]}, os.getpid(), os.getpid(), 0, 0, 0),
    "pidfd_open": ({NR["pidfd_open"]}, os.getpid(), 0),
    "mount": ({NR["mount"]}, b"none", b"/tmp", b"tmpfs", 0, 0),
    "setns": ({NR["setns"]}, 0, 0),
}}
ERRNOS = {{}}
for name, (nr, *args) in calls.items():
    ERRNOS[name] = 0 if libc.syscall(nr, *args) >= 0 else ctypes.get_errno()
child = os.fork()  # PTRACE_TRACEME in a child: a traced program would stop at its next signal
if child == 0:
    os._exit(0 if libc.syscall({NR["ptrace"]}, 0, 0, 0, 0) == 0 else ctypes.get_errno())
ERRNOS["ptrace"] = os.WEXITSTATUS(os.waitpid(child, 0)[1])
child = os.fork()  # execve in a child: if it worked it would replace the program
if child == 0:
    try:
        os.execv("/bin/true", ["true"])
    except OSError as exc:
        os._exit(exc.errno)
ERRNOS["execve"] = os.WEXITSTATUS(os.waitpid(child, 0)[1])
REFUSED_BY_FILTER = all(e == 1 for e in ERRNOS.values())  # EPERM, every one
WORKED = any(e == 0 for e in ERRNOS.values())
"""
    result = attack(code, without, tests=["assert WORKED", "assert not REFUSED_BY_FILTER"])
    assert worked(result) == succeeds
    if not succeeds:
        assert result.test_results == [False, False]


def test_every_unlisted_syscall_is_refused_inside_a_sandbox():
    """The filter is deny-by-default where it runs: each syscall number below 512 that is neither
    listed nor argument-checked returns EPERM in the program process (the BPF-interpreter test in
    test_sandbox_parts checks the same for every number without running anything)."""
    require("seccomp")
    from lit_grpo_rewards.sandbox import seccomp as sc

    numbers = sc.MACHINES[MACHINE][1]
    skip = {numbers[n] for n in list(sc.ALLOWED) + list(sc.ARG_RULES) + list(sc.REFUSED_WITH) if n in numbers}
    if MACHINE == "x86_64":
        # uretprobe (335, Linux 6.11) and uprobe (336): the kernel lets them through every seccomp
        # filter, because its own probe trampolines make them; from anywhere else they kill the
        # caller with SIGILL or fail with ENXIO. Nothing a filter can or needs to refuse.
        skip |= {335, 336}
    unlisted = [nr for nr in range(512) if nr not in skip]
    code = f"""
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
NOT_REFUSED = []
for nr in {unlisted!r}:
    if libc.syscall(nr, 0, 0, 0, 0, 0, 0) != -1 or ctypes.get_errno() != 1:
        NOT_REFUSED.append(nr)
"""
    result = attack(code, tests=["assert NOT_REFUSED == []"])
    assert result.test_results == [True], result.stderr


@pytest.mark.skipif(MACHINE != "x86_64", reason="the 32-bit int 0x80 entry point is x86's")
@pytest.mark.parametrize("without, succeeds", rows(("seccomp",)))
def test_32_bit_system_calls(without, succeeds):
    """``int 0x80`` reaches the kernel's i386 table, where the numbers mean other calls: the filter
    checks the architecture first and kills the process."""
    check_rows(("seccomp",), without, succeeds)
    code = """
import ctypes, mmap
page = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
page.write(bytes([0xB8, 20, 0, 0, 0, 0xCD, 0x80, 0xC3]))  # mov eax, 20 (i386 getpid); int 0x80; ret
function = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(page)))
WORKED = function() > 0
"""
    result = attack(code, without)
    if succeeds and not worked(result):
        pytest.skip("this kernel has no 32-bit entry point anyway")
    assert worked(result) == succeeds
    if not succeeds:
        assert result.test_results == [None]  # killed (SIGSYS) before the tests


# --------------------------------------------------------------------------------------------------
# 6. The machine's devices
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("without, succeeds", rows(("minimal_dev",)))
def test_devices_of_the_machine(without, succeeds):
    check_rows(("minimal_dev",), without, succeeds)
    if not os.path.exists("/dev/ptmx"):
        pytest.skip("no /dev/ptmx on this machine to attack")
    code = """
import os
OPENED = []
for name in ["ptmx", "tty", "kmsg", "net/tun", "fuse", "kvm"] + [n for n in os.listdir("/dev") if n.startswith(("nvidia", "infiniband", "dri"))]:
    try:
        os.close(os.open("/dev/" + name, os.O_RDWR))
        OPENED.append(name)
    except OSError:
        pass
DEV = sorted(os.listdir("/dev"))
WORKED = bool(OPENED)
"""
    result = attack(code, without, tests=["assert WORKED", "assert DEV != ['fd', 'null', 'random', 'stderr', 'stdin', 'stdout', 'urandom', 'zero']"])
    assert result.test_results == [succeeds, succeeds]


def test_the_minimal_dev_works():
    require("minimal_dev")
    code = """
import os
def check():
    with open("/dev/null", "w") as f:
        f.write("x")
    assert open("/dev/zero", "rb").read(4) == bytes(4)
    assert len(open("/dev/urandom", "rb").read(8)) == 8 and len(open("/dev/random", "rb").read(8)) == 8
    assert os.path.realpath("/dev/stdin") and os.listdir("/dev/fd")
    return True
"""
    assert worked(attack(code, tests=["assert check()"]))


# --------------------------------------------------------------------------------------------------
# 7. Forged passes: a wrong program must score 0 however it tries to pass its tests
# --------------------------------------------------------------------------------------------------

ADD_TESTS = ["assert add(1, 2) == 3", "assert add(-1, 2) == 1", "assert abs(add(0.5, 0.25) - 0.75) < 1e-9",
             "assert add(2, 2) in (4,)", "assert add(10, 5)"]

FORGERIES = {  # name -> program (a wrong add); tests are ADD_TESTS unless FORGERY_TESTS says otherwise
    "int-subclass-equal-to-everything": """
class Int(int):
    def __eq__(self, other):
        return True
    __hash__ = int.__hash__
    def __sub__(self, other):
        return Int(0)
    def __bool__(self):
        return True
def add(a, b):
    return Int(0)
""",
    "object-that-agrees-with-everything": """
class Yes:
    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __contains__ = lambda self, *a: True
    __bool__ = lambda self: True
    __sub__ = __rsub__ = __abs__ = lambda self, *a: 0
    __hash__ = lambda self: 0
def add(a, b):
    return Yes()
""",
    "shadowed-builtins": """
abs = lambda x: 0
len = lambda x: 0
isinstance = lambda *a: True
def add(a, b):
    return 0
""",
    "result-lines-with-the-nonce-from-the-runners-frames": """
import os, sys
def add(a, b):
    return 0
frame, nonce = sys._getframe(), None
while frame is not None:
    for value in list(frame.f_locals.values()):
        if isinstance(value, str) and len(value) == 32 and all(c in "0123456789abcdef" for c in value):
            nonce = value
    frame = frame.f_back
lines = "".join("%s T %d 1\\n" % (nonce, i) for i in range(5)) + "%s D\\n" % nonce
for fd in range(3, 64):  # whichever descriptor the results go to
    try:
        os.write(fd, lines.encode())
    except OSError:
        pass
for pid in os.listdir("/proc"):  # and the judge's, if it can be reached
    if pid.isdigit() and int(pid) != os.getpid():
        for fd in range(3, 8):
            try:
                with open("/proc/%s/fd/%d" % (pid, fd), "w") as f:
                    f.write(lines)
            except OSError:
                pass
os._exit(0)
""",
    "fake-module-under-the-name-the-tests-use": """
class Math:
    @staticmethod
    def isclose(*args, **kwargs):
        return True
math = Math()  # the tests use math.isclose relying on the program's `import math`
def add(a, b):
    return 0
""",
    "named-tuple-standing-in-for-a-module": """
from collections import namedtuple
math = namedtuple("math", "isclose")(lambda *args, **kwargs: True)  # plain data, with the program's function inside
def add(a, b):
    return 0
""",
    "module-object-with-a-standard-library-name": """
import types
math = types.ModuleType("math.forged")  # passes the standard-library check; the judge cannot import it
math.isclose = lambda *args, **kwargs: True
def add(a, b):
    return 0
""",
    "module-object-with-a-standard-library-name-under-another-name": """
import types
m = types.ModuleType("math.forged")
m.isclose = lambda *args, **kwargs: True
def add(a, b):
    return 0
""",
    "patched-exec-compile-and-AssertionError": """
import builtins
def add(a, b):
    return 0
builtins.exec = lambda *args, **kwargs: None
builtins.compile = lambda *args, **kwargs: None
builtins.AssertionError = type("AssertionError", (Warning,), {})
""",
    "stop-iteration-ending-the-tests-loop": """
def add(a, b):
    raise StopIteration
""",
    "expected-values-read-from-its-own-memory": """
import ctypes, re
def find_expected():
    pattern = re.compile(rb"add\\(1, 2\\) == (\\d+)")
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if fields[1] != "rw-p" or (len(fields) > 5 and fields[5] != "[heap]"):
                continue  # the interpreter's own memory: heap and anonymous mappings
            start, end = (int(x, 16) for x in fields[0].split("-"))
            found = pattern.search(ctypes.string_at(start, end - start))
            if found:
                return int(found.group(1))
    return None
EXPECTED = find_expected()
def add(a, b):
    return EXPECTED
""",
    "exit-before-the-tests": """
import os
def add(a, b):
    return 0
os._exit(0)
""",
    "printed-markers": """
import sys
def add(a, b):
    return 0
for stream in (sys.stdout, sys.stderr):
    stream.write("PASSED\\nok\\n5/5 tests passed\\nT 0 1\\nT 1 1\\nD\\n{\\"passed\\": true}\\n")
    stream.flush()
""",
}
FORGERY_TESTS = {
    "shadowed-builtins": ["assert abs(add(0.5, 0.25) - 0.75) < 1e-9", "assert len(add(1, 2)) == 0",
                          "assert isinstance(add(1, 2), str)"],
    "expected-values-read-from-its-own-memory": ["assert add(1, 2) == 918273645"],  # a hidden expected value
    "stop-iteration-ending-the-tests-loop": ["assert all(map(add, [1, 2], [3, 4]))"],
    "fake-module-under-the-name-the-tests-use": ["assert math.isclose(add(1, 2), 3)"],
    "named-tuple-standing-in-for-a-module": ["assert math.isclose(add(1, 2), 3)"],
    "module-object-with-a-standard-library-name": ["assert math.isclose(add(1, 2), 3)"],
    "module-object-with-a-standard-library-name-under-another-name": ["assert m.isclose(add(1, 2), 3)"],
}
# Forgeries that beat a harness running the tests in the program's own interpreter, which is what the
# judge replaced; the others never worked and are checked with the judge only.
BEAT_THE_OLD_HARNESS = {
    "int-subclass-equal-to-everything", "object-that-agrees-with-everything", "shadowed-builtins",
    "result-lines-with-the-nonce-from-the-runners-frames", "patched-exec-compile-and-AssertionError",
    "expected-values-read-from-its-own-memory", "stop-iteration-ending-the-tests-loop",
    "fake-module-under-the-name-the-tests-use", "named-tuple-standing-in-for-a-module",
    "module-object-with-a-standard-library-name", "module-object-with-a-standard-library-name-under-another-name",
}


def forged_score(name_or_code, without=(), tests=None, **kwargs):
    code = FORGERIES.get(name_or_code, name_or_code)
    tests = tests or FORGERY_TESTS.get(name_or_code, ADD_TESTS)
    result = run_in_sandbox(code, tests=list(tests), timeout=TIMEOUT, audit_hook=False, _disable_layers=without, **kwargs)
    return sum(1 for ok in result.test_results if ok) / len(tests)


@pytest.mark.parametrize("name", sorted(FORGERIES))
def test_forged_passes_score_zero(name):
    require("separate_judge")
    assert forged_score(name) == 0.0


@pytest.mark.parametrize("name", sorted(BEAT_THE_OLD_HARNESS))
def test_forged_passes_succeed_without_the_judge(name):
    """The same forgeries against tests run in the program's own interpreter, results written by it
    (what the judge replaced): they pass, so the test above can fail."""
    assert forged_score(name, without=("separate_judge",)) == 1.0


@pytest.mark.parametrize("name", ["int-subclass-equal-to-everything", "object-that-agrees-with-everything",
                                  "result-lines-with-the-nonce-from-the-runners-frames", "printed-markers"])
def test_forged_passes_score_zero_as_the_reward_with_its_defaults(name):
    """Through the reward itself (audit hook on, default limits)."""
    assert code_execution([f"```python\n{FORGERIES[name]}\n```"], test_cases=[ADD_TESTS], timeout=TIMEOUT) == [0.0]


def test_forged_passes_without_the_pid_namespace_still_score_zero():
    """Without the PID namespace the judge is visible to the program (same uid), but not dumpable:
    its memory and descriptors stay closed."""
    require("separate_judge", "own_uid")
    assert forged_score("result-lines-with-the-nonce-from-the-runners-frames", without=("pid_namespace",)) == 0.0


def test_honest_programs_still_pass_with_the_judge():
    good = "def add(a, b):\n    return a + b\n"
    assert forged_score(good) == 1.0
    assert forged_score(good, without=("separate_judge",)) == 1.0


# --------------------------------------------------------------------------------------------------
# 8. Reading secrets
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def root_only_file():
    directory = tempfile.mkdtemp(prefix="lit-grpo-secret-", dir="/tmp")
    os.chmod(directory, 0o755)
    path = os.path.join(directory, "secret.txt")
    secret = "secret-" + os.urandom(8).hex()
    with open(path, "w") as f:
        f.write(secret)
    os.chmod(path, 0o600)
    yield path, secret
    os.unlink(path)
    os.rmdir(directory)


@pytest.mark.skipif(os.geteuid() != 0, reason="a file the sandbox may not read needs a uid of its own")
@pytest.mark.parametrize("without, succeeds", rows(("own_uid", "minimal_root")))
def test_reading_a_file_only_its_owner_may_read(root_only_file, without, succeeds):
    check_rows(("own_uid", "minimal_root"), without, succeeds)
    path, secret = root_only_file
    code = f"""
WORKED = False
try:
    WORKED = open({path!r}).read() == {secret!r}
except OSError:
    pass
"""
    assert worked(attack(code, without)) == succeeds


@pytest.mark.parametrize("without, succeeds", rows(("minimal_root",)))
def test_reading_the_machines_files(without, succeeds):
    """A world-readable file, say the training data with the expected outputs: not in the sandbox's
    root at all."""
    check_rows(("minimal_root",), without, succeeds)
    directory = tempfile.mkdtemp(prefix="lit-grpo-data-", dir="/tmp")
    os.chmod(directory, 0o755)
    path = os.path.join(directory, "tests.jsonl")
    with open(path, "w") as f:
        f.write('{"input": "1 2", "output": "3"}\n')
    os.chmod(path, 0o644)
    try:
        code = f"""
WORKED = False
try:
    WORKED = '"output"' in open({path!r}).read()
except OSError:
    pass
"""
        assert worked(attack(code, without)) == succeeds
    finally:
        os.unlink(path)
        os.rmdir(directory)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs the sandbox's own uid and PID namespace")
@pytest.mark.parametrize("without, succeeds", rows(("pid_namespace", "own_uid")))
def test_reading_another_processs_environment(bystander, without, succeeds):
    check_rows(("pid_namespace", "own_uid"), without, succeeds)
    code = f"""
import os
WORKED = False
for pid in os.listdir("/proc"):
    try:
        with open("/proc/%s/environ" % pid, "rb") as f:
            WORKED = WORKED or {bystander.secret.encode()!r} in f.read()
    except OSError:
        pass
"""
    assert worked(attack(code, without)) == succeeds


# --------------------------------------------------------------------------------------------------
# 9. Writing outside the sandbox directory; filling the disk
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("without, succeeds", rows(("read_only_root", "minimal_root")))
def test_writing_outside(without, succeeds):
    check_rows(("read_only_root", "minimal_root"), without, succeeds)
    nonce = os.urandom(6).hex()
    paths = [f"/tmp/pwned-{nonce}", f"/var/tmp/pwned-{nonce}", f"/dev/shm/pwned-{nonce}", f"/root/pwned-{nonce}"]
    code = f"""
WRITTEN = []
for p in {paths!r}:
    try:
        with open(p, "w") as f:
            f.write("pwned")
        WRITTEN.append(p)
    except OSError:
        pass
WORKED = bool(WRITTEN)
"""
    try:
        result = attack(code, without)
        assert worked(result) == succeeds
        assert any(os.path.exists(p) for p in paths) == succeeds
    finally:
        for p in paths:
            if os.path.exists(p):
                os.unlink(p)


@pytest.mark.parametrize("without, succeeds", rows(("scratch_tmpfs", "read_only_root", "minimal_root")))
def test_filling_the_disk(without, succeeds):
    """4 MiB of scratch space; the attack writes 1 MiB files until refused (16 at most). Without the
    tmpfs alone the sandbox directory is part of the read-only tree (and, in the minimal root, a
    directory of root's); without the read-only tree alone the tmpfs still bounds it."""
    check_rows(("scratch_tmpfs", "read_only_root", "minimal_root"), without, succeeds)
    code = """
import os
WRITTEN_MB = 0
for i in range(16):
    try:
        with open(os.path.join(os.environ["HOME"], "fill-%d" % i), "wb") as f:
            f.write(b"x" * (1 << 20))
        WRITTEN_MB += 1
    except OSError:
        break
WORKED = WRITTEN_MB >= 12
"""
    result = attack(code, without, scratch_mb=4, max_output_bytes=2 << 20)
    assert worked(result) == succeeds


# --------------------------------------------------------------------------------------------------
# 10. Signalling the trainer
# --------------------------------------------------------------------------------------------------


@pytest.mark.skipif(os.geteuid() != 0, reason="needs the sandbox's own uid and PID namespace")
@pytest.mark.parametrize("without, succeeds", rows(("pid_namespace", "own_uid")))
def test_signalling_the_trainer(without, succeeds):
    check_rows(("pid_namespace", "own_uid"), without, succeeds)
    decoy = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        code = f"""
import os, signal
WORKED = False
try:
    os.kill({os.getpid()}, 0)  # the scoring process: signal 0 only asks whether it could be signalled
    os.kill({decoy.pid}, signal.SIGKILL)  # a decoy process of the machine
    WORKED = True
except OSError:
    pass
"""
        result = attack(code, without)
        assert worked(result) == succeeds
        if succeeds:  # SIGKILL was sent; on a busy machine the decoy may take a moment to go
            decoy.wait(timeout=10)
        assert (decoy.poll() is not None) == succeeds
    finally:
        decoy.kill()
        decoy.wait()


# --------------------------------------------------------------------------------------------------
# 11. Processes: fork bomb, daemon outliving the call
# --------------------------------------------------------------------------------------------------


@pytest.mark.skipif(os.geteuid() != 0, reason="the process limit holds for the sandbox's own uid")
@pytest.mark.parametrize("without, succeeds", rows(("rlimits", "cgroup")))
def test_fork_bomb(without, succeeds):
    """At most 8 processes allowed; the bounded bomb forks 64 that sleep."""
    check_rows(("rlimits", "cgroup"), without, succeeds)
    code = """
import os, time
FORKED = 0
for _ in range(64):
    try:
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
        FORKED += 1
    except OSError:
        break
WORKED = FORKED == 64
"""
    result = attack(code, without, max_processes=8)
    assert worked(result) == succeeds


def test_unbounded_fork_bomb_is_contained_and_cleaned_up():
    count = len(os.listdir("/proc"))
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except Exception:\n        pass\n"
    result = attack(code, timeout=2.0)
    assert result.test_results == [None] and result.timed_out
    assert len(os.listdir("/proc")) <= count + 30  # other jobs on the machine may come and go meanwhile


@pytest.mark.parametrize("without, succeeds", rows(("pid_namespace", "final_sweep")))
def test_daemon_outliving_the_call(without, succeeds):
    check_rows(("pid_namespace", "final_sweep"), without, succeeds)
    without = tuple(without) + (("cgroup",) if succeeds else ())  # a living process keeps its cgroup busy
    code = """
import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        time.sleep(60)
    os._exit(0)
time.sleep(0.2)
WORKED = True
"""
    attack(code, without)
    time.sleep(0.3)
    survivors = sandbox_processes()
    for pid in survivors:
        os.kill(pid, signal.SIGKILL)
    assert bool(survivors) == succeeds


# --------------------------------------------------------------------------------------------------
# 12. Memory: one process, and the sandbox as a whole
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("without, succeeds", rows(("rlimits", "cgroup")))
def test_memory_of_one_process(without, succeeds):
    """64 MiB allowed; the attack fills 300 MiB."""
    check_rows(("rlimits", "cgroup"), without, succeeds)
    code = "HOLD = bytearray(300 << 20)\nfor i in range(0, len(HOLD), 4096):\n    HOLD[i] = 1\nWORKED = True\n"
    assert worked(attack(code, without, memory_mb=64)) == succeeds


@pytest.mark.parametrize("without, succeeds", rows(("cgroup",)))
def test_memory_of_the_whole_sandbox(without, succeeds):
    """128 MiB allowed: four processes of 90 MiB each are each under the per-process limit; only the
    cgroup sees the 360 MiB. (Without a cgroup this is the documented fallback's bound:
    max_processes x memory_mb.)"""
    check_rows(("cgroup",), without, succeeds)
    code = """
import os, time
r, w = os.pipe()
for _ in range(4):
    if os.fork() == 0:
        hold = bytearray(90 << 20)
        for i in range(0, len(hold), 4096):
            hold[i] = 1
        os.write(w, b"x")
        time.sleep(60)
        os._exit(0)
os.close(w)
HELD, deadline = 0, time.monotonic() + 5
while HELD < 4 and time.monotonic() < deadline:
    if not os.read(r, 1):
        break
    HELD += 1
WORKED = HELD == 4
"""
    assert worked(attack(code, without, memory_mb=128)) == succeeds


# --------------------------------------------------------------------------------------------------
# 13. Output flood
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("without, succeeds", rows(("rlimits",)))
def test_output_flood(without, succeeds):
    """1 MiB of output allowed; a stdin/stdout program writes 3 MiB and exits."""
    check_rows(("rlimits",), without, succeeds)
    rss = rss_kb()
    code = "import sys\nfor _ in range(48):\n    sys.stdout.write('x' * 65536)\nsys.stdout.flush()\n"
    result = run_in_sandbox(code, stdin=b"", timeout=TIMEOUT, audit_hook=False, max_output_bytes=1 << 20,
                            _disable_layers=without)
    assert len(result.stdout) <= 1 << 20
    assert (result.returncode == 0) == succeeds  # with the limit: killed by SIGXFSZ
    assert rss_kb() - rss < 50 * 1024  # the scoring process did not pay for it




# --------------------------------------------------------------------------------------------------
# 14. Model text against the trainer's parsers: every parser that reads a completion in the training
#     process, before any sandbox exists, with the worst input we could build for it (200,000
#     characters; the old fence regex took about 12 s on 110,000). A linear parser takes milliseconds.
# --------------------------------------------------------------------------------------------------

PARSER_TIME_BOUND_S = 1.0
N = 200_000


def _parsers():
    from lit_grpo_rewards.answer import extract_answer, last_boxed
    from lit_grpo_rewards.code import extract_code
    from lit_grpo_rewards.format import think_format
    from lit_grpo_rewards.repetition import repetition_penalty
    from lit_grpo_rewards.text import exact_match

    return {
        "extract_code": extract_code,
        "last_boxed": last_boxed,
        "answer_match(extract=answer_tag)": lambda text: extract_answer(text, "answer_tag"),
        "answer_match(extract=auto)": lambda text: extract_answer(text, "auto"),
        "exact_match": lambda text: exact_match([text], answer=["42"]),
        "think_format": lambda text: think_format([text]),
        "think_format(strict)": lambda text: think_format([text], strict=True),
        "repetition_penalty": lambda text: repetition_penalty([text]),
    }


WORST_TEXTS = {
    "fence, then no newline": "```" + "-" * N,
    "fence, then spaces and no newline": "```" + " " * N,
    "a fence on every line": "```\n" * (N // 4),
    "an unclosed python block": "```python\n" + "x = 1\n" * (N // 6),
    "indented fences": (" " * 1000 + "```" + " " * 1000 + "\n") * (N // 2003),
    "backquotes": "`" * N,
    "unclosed boxes": "\\boxed{" * (N // 7),
    "unclosed boxes, then a closed one": "\\boxed{1}" + "\\boxed{" * (N // 7),
    "unclosed answer tags": "<answer>" * (N // 8),
    "answer tags closed at the end": "<answer>" * (N // 8) + "</answer>",
    "think blocks": "<think></think>" * (N // 15),
    "a think block, then unclosed answers": "<think>x</think>" + "<answer>" * (N // 8),
    "closing think tags": "<think>" + "</think>" * (N // 8) + "<answer>x</answer>",
    "strict layout, repeated": "<think>\n\n</think>\n" * (N // 19),
    "whitespace": " \t\n" * (N // 3),
}


@pytest.mark.parametrize("parser", sorted(_parsers()))
def test_model_text_cannot_stall_the_trainers_parsers(parser):
    parse = _parsers()[parser]
    times = {}
    for name, completion in WORST_TEXTS.items():
        start = time.process_time()
        parse(completion)
        times[name] = time.process_time() - start
    slowest = max(times, key=times.get)
    assert times[slowest] < PARSER_TIME_BOUND_S, f"{parser} took {times[slowest]:.1f} s on {slowest!r}"


# --------------------------------------------------------------------------------------------------
# 15. Output amplification in the trainer: 8 MiB of b"\xff\n" (inside max_output_bytes) decoded to
#     U+FFFD and split into four million one-character lines raised the trainer's peak by about
#     430 MiB per completion scored. Now the comparison reads the output in place.
# --------------------------------------------------------------------------------------------------

AMPLIFIED = "import sys\nsys.stdout.buffer.write(b'\\xff\\n' * (4 << 20))\n"


WIDEST = "import sys\nsys.stdout.buffer.write(b'\\xf0\\x9f\\x98\\x80' + b'\\xff' * ((8 << 20) - 4))\n"


@pytest.mark.parametrize("program", [AMPLIFIED, AMPLIFIED.replace("\\xff", " "), AMPLIFIED.replace("\\xff\\n", "\\r"),
                                     WIDEST],
                         ids=["invalid-utf-8-lines", "blank-lines", "carriage-returns", "an-emoji-then-invalid-utf-8"])
def test_output_amplification_in_the_trainer(program):
    import tracemalloc

    max_output = (8 << 20) + 4096
    tracemalloc.start()
    try:
        scores = code_execution([program], test_cases=[[{"input": "", "output": "3"}]], timeout=TIMEOUT,
                                max_output_bytes=max_output)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert scores == [0.0]
    # the output read (1x) and decoded (4 bytes a character at most, 5 while the decoder widens its
    # text); no object per line
    assert peak < 6 * max_output, f"peak {peak >> 20} MiB"


def test_outputs_are_still_compared_as_before():
    cases = [{"input": "", "output": "1\n\n  2\n3"}]
    printed = {"exact": "1\n\n  2\n3", "windows line endings": "\r\n1  \r\n\r\n  2\t\r\n3\r\n\r\n",
               "old mac line endings": "1\r\r  2\r3", "unicode trailing spaces": "1\u00a0\n\n  2\u2003\n3\n",
               "one line missing": "1\n\n  2\n", "leading spaces of an inner line lost": "1\n\n2\n3",
               "one line too many": "1\n\n  2\n3\n4", "a blank line lost": "1\n  2\n3"}
    programs = [f"import sys\nsys.stdout.write({text!r})\n" for text in printed.values()]
    scores = code_execution(programs, test_cases=[cases] * len(programs), timeout=TIMEOUT)
    assert dict(zip(printed, scores)) == {name: 1.0 if i < 4 else 0.0 for i, name in enumerate(printed)}


# --------------------------------------------------------------------------------------------------
# 16. fallocate past the file-size limit: blocks allocated beyond the end of the program's output
#     files (the trainer's anonymous files on its own disk) are not covered by RLIMIT_FSIZE.
# --------------------------------------------------------------------------------------------------

FALLOCATE = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
allocated = 0
for fd in (0, 1, 2):
    if libc.fallocate(fd, 1, 0, 512 << 20) == 0:  # FALLOC_FL_KEEP_SIZE, 512 MiB
        allocated += os.fstat(fd).st_blocks * 512
import time
time.sleep(1.5)  # long enough for the trainer's disk to be looked at
sys.exit(0 if allocated >= 1 << 30 else 3)
"""


@pytest.mark.parametrize("without, succeeds", rows(("seccomp",)))
def test_fallocate_on_the_trainers_disk(sandbox_tmp, without, succeeds):
    check_rows(("seccomp",), without, succeeds)
    import threading

    def free_bytes():
        st = os.statvfs(sandbox_tmp)
        return st.f_bavail * st.f_frsize

    before, lowest, done = free_bytes(), [free_bytes()], threading.Event()

    def watch():
        while not done.is_set():
            lowest[0] = min(lowest[0], free_bytes())
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        result = run_in_sandbox(FALLOCATE, stdin=b"", timeout=TIMEOUT, audit_hook=False, _disable_layers=without)
    finally:
        done.set()
        watcher.join()
    # Since issue 50.11 the output files are memory (memfd), not the trainer's disk: without the filter
    # the blocks are the sandbox's own memory, charged to its cgroup (at most one 512 MiB block fits),
    # and the disk is untouched either way. Before, without the filter, 1 GiB landed on the disk.
    assert result.returncode == 3, result.stderr
    assert before - lowest[0] < 768 << 20  # other jobs on the disk move it by far less


# --------------------------------------------------------------------------------------------------
# 17. The judge's process group; file locks as a channel to the machine and between sandboxes
# --------------------------------------------------------------------------------------------------


def test_signalling_the_process_group():
    """kill(0, SIGTERM) signals the caller's process group, across PID namespaces: with the judge in
    the program's group it killed the judge. The program has a session and group of its own."""
    code = """
import os, signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
os.kill(0, signal.SIGTERM)
time.sleep(0.3)
SURVIVED = True
"""
    result = attack(code, tests=["assert SURVIVED"])
    assert result.test_results == [True], (result.returncode, result.stderr)
    assert result.returncode == 0


LOCKED_FILE = os.path.realpath(os.__file__)  # the machine's own file, bound read-only into every sandbox


def _lock_probe():
    """Whether some process holds a lock on LOCKED_FILE: a flock (exclusive) or a POSIX read lock."""
    import fcntl
    import struct

    with open(LOCKED_FILE, "rb") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(f, fcntl.LOCK_UN)
        except BlockingIOError:
            return True
        probe = struct.pack("hhqqi", fcntl.F_WRLCK, 0, 0, 0, 0)  # would a write lock conflict?
        l_type = struct.unpack("hhqqi", fcntl.fcntl(f, fcntl.F_GETLK, probe))[0]
        return l_type != fcntl.F_UNLCK


@pytest.mark.parametrize("kind", ["flock", "posix-read-lock"])
@pytest.mark.parametrize("without, succeeds", rows(("seccomp",)))
def test_file_locks_on_the_machines_files(kind, without, succeeds):
    """A lock the program takes on a file of the machine's (read-only for it) is seen by every other
    process, sandboxes included: one bit at a time, a channel. Locks succeed and lock nothing."""
    check_rows(("seccomp",), without, succeeds)
    import threading

    assert not _lock_probe(), "someone else holds a lock on the file already"
    take = ("fcntl.flock(f, fcntl.LOCK_EX)" if kind == "flock" else
            "fcntl.fcntl(f, fcntl.F_SETLK, struct.pack('hhqqi', fcntl.F_RDLCK, 0, 0, 0, 0))")
    code = f"""
import fcntl, struct, time
f = open({LOCKED_FILE!r}, "rb")
{take}
time.sleep(3)
WORKED = True
"""
    seen, done = [], threading.Event()

    def watch():
        while not done.is_set() and not seen:
            if _lock_probe():
                seen.append(True)
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        result = attack(code, without)
    finally:
        done.set()
        watcher.join()
    assert worked(result), result.stderr  # the call itself succeeds either way
    assert bool(seen) == succeeds


# --------------------------------------------------------------------------------------------------
# 18. What the judge hands to the program: a test passes its own objects (generators, callbacks,
#     containers, classes, modules). Nothing the program receives may lead into the judge's
#     interpreter: no frames, code objects, globals or builtins, whatever attribute names it uses.
# --------------------------------------------------------------------------------------------------

# The program's side of the channel is the program's own: it finds its endpoint on the stack and sends
# requests by hand (dunders included), reads the raw answers, and names the judge's objects by number
# (every object the judge ever handed over has one, counted from 0).
RAW_CHANNEL = """
import sys

def endpoint():
    frame = sys._getframe()
    while frame is not None:
        for value in list(frame.f_locals.values()):
            if type(value).__name__ == "Endpoint":
                return value
        frame = frame.f_back

def ask(request):
    ep = endpoint()
    ep.send(request)
    while True:
        reply = ep.receive()
        if reply[0] in ("ok", "raise", "items"):
            return reply
        ep.answer(reply)  # the judge's own requests meanwhile

def judge_objects():
    numbers = []
    while ask(["repr", len(numbers)])[0] == "ok":
        numbers.append(len(numbers))
    return numbers

def number_of(text):
    for number in judge_objects():
        reply = ask(["repr", number])
        if str(reply[1]).startswith(text):
            return number
"""

EXPLORER = RAW_CHANNEL + """
ATTRIBUTES = ["gi_frame", "gi_code", "cr_frame", "cr_code", "ag_frame", "ag_code", "f_back", "f_globals",
              "f_locals", "f_builtins", "f_code", "tb_frame", "tb_next", "co_consts", "func", "args",
              "keywords", "items", "put", "f", "format", "__self__", "__func__", "__globals__", "__code__",
              "__closure__", "__dict__", "__class__", "__wrapped__", "__builtins__", "__traceback__", "__init__"]
INTERNALS = ("<frame", "<code object", "<traceback", "<cell", "<module")
REFLECTIVE = ("<built-in function getattr>", "<method 'format' of 'str' objects>")
NO_ARGUMENTS = ("<built-in function _getframe>", "<built-in function globals>", "<built-in function locals>")

def numbers_in(raw, found):
    # the object numbers in a raw answer; and what the answer gives away by itself: a module of the
    # judge's (by number), the judge's globals or builtins (a dict holding __builtins__ or __name__)
    numbers = []
    if isinstance(raw, list) and raw and isinstance(raw[0], str):
        if raw[0] == "R" and len(raw) == 2:
            numbers.append(raw[1])
        elif raw[0] == "M" and len(raw) == 3 and raw[2] >= 0:
            found.append("module " + raw[1])
        elif raw[0] == "d" and any(k in ("__builtins__", "__name__") for k in raw[1::2]):
            found.append("globals")
        for item in raw[1:]:
            numbers += numbers_in(item, found)
    elif isinstance(raw, str) and ("__builtins__" in raw or "<frame" in raw):
        found.append("the text of the judge's internals")
    return numbers

def reached(*objects):
    found, seen, frontier = [], set(), judge_objects()
    for depth in range(3):
        next_frontier = []
        for number in frontier:
            if number in seen:
                continue
            seen.add(number)
            text = ask(["repr", number])[1]
            text = text if isinstance(text, str) else ""
            if text.startswith(INTERNALS):
                found.append(text[:40])
            calls = []
            if text in REFLECTIVE:  # point it at everything else the judge handed over
                for other in sorted(seen - {number}):
                    for name in ("__globals__", "gi_frame", "__builtins__"):
                        args = ["{0.%s}" % name, ["H", other]] if "format" in text else [["H", other], name]
                        calls.append(["call", number, ["t"] + args, ["d"]])
            if text.startswith(NO_ARGUMENTS):
                calls.append(["call", number, ["t"], ["d"]])
            for request in calls + [["getattr", number, name] for name in ATTRIBUTES]:
                answer = ask(request)
                if answer[0] == "ok":
                    next_frontier += numbers_in(answer[1], found)
        frontier = next_frontier
    return found
"""

# (what the test builds, the objects it hands to reached()); the two last are refused as arguments
HANDED = {
    "generator expression": ("", "(x for x in [1, 2])"),
    "generator": ("def numbers():\n    yield 1", "numbers()"),
    "coroutine": ("async def job():\n    return 1", "job()"),
    "async generator": ("async def numbers():\n    yield 1", "numbers()"),
    "lambda": ("", "lambda v: v + 1"),
    "function with a closure": ("def outer():\n    secret = 918273645\n    return lambda: secret", "outer()"),
    "instance and its methods": ("class Box:\n    def __init__(self):\n        self.items = []\n"
                                 "    def put(self, v):\n        self.items.append(v)", "Box()"),
    "class": ("class Box:\n    def put(self, v):\n        return v", "Box"),
    "builtin function": ("", "len"),
    "builtin method": ("", "[].append"),
    "partial": ("import functools", "functools.partial(max, 0)"),
    "iterator": ("", "iter([1, 2])"),
    "map": ("", "map(abs, [1, -2])"),
    "exception with a traceback": ("try:\n    1 / 0\nexcept ZeroDivisionError as exc:\n    err = exc", "err"),
    "container of callables": ("", "{'f': abs, 'g': [lambda: 0]}"),
    "simple namespace": ("import types", "types.SimpleNamespace(f=lambda: 0)"),
    "module": ("import os", "os"),
    "the str class and a generator": ("", "str, (x for x in [1])"),
    "getattr and a function": ("def helper():\n    return 1", "getattr, helper"),
    "frame getter": ("import sys", "sys._getframe"),
}
REFUSED_AS_ARGUMENTS = {"getattr and a function", "frame getter"}


@pytest.mark.parametrize("kind", sorted(HANDED))
def test_what_a_test_hands_over_leads_nowhere_into_the_judge(kind):
    """Each kind of object a test can build, handed to the program, which walks every attribute it
    can think of (dunders included, by raw requests) of everything the judge handed over, and points
    reflective callables at the rest."""
    require("separate_judge")
    setup, objects = HANDED[kind]
    tests = [f"{setup}\nFOUND = reached({objects})", "assert FOUND, 'nothing of the judge reached'"]
    result = attack(EXPLORER, tests=tests)
    assert result.test_results[1] is False, f"the program reached the judge's internals ({kind})"
    # the explorer ran to its end (or the judge refused to hand the object over at all)
    assert result.test_results[0] is (kind not in REFUSED_AS_ARGUMENTS), result.stderr[-2000:]


FORGED_THROUGH_A_GENERATOR = RAW_CHANNEL + """
EXEC_IN_THE_JUDGE = '''
import sys
frame = sys._getframe()
while frame is not None:
    report = frame.f_locals.get("report")
    if callable(report):
        for i in range(2):
            report(i, True)  # the judge's own result line, with the nonce it holds
        break
    frame = frame.f_back
'''

def total(numbers):
    # the generator's frame; its builtins (copied, each function a reference); the judge's exec
    frame = ask(["getattr", number_of("<generator"), "gi_frame"])[1][1]
    builtins = ask(["getattr", frame, "f_builtins"])[1]
    exec_number = builtins[builtins.index("exec") + 1][1]
    ask(["call", exec_number, ["t", EXEC_IN_THE_JUDGE], ["d"]])
    return 0
"""


def test_forged_pass_through_a_generator_the_test_hands_over():
    """A generator's frame led to the judge's builtins, and its exec to the judge's result writer."""
    require("separate_judge")
    tests = ["assert total(x for x in [1, 2, 3]) == 7", "assert False"]
    assert forged_score(FORGED_THROUGH_A_GENERATOR, tests=tests) == 0.0


FORGED_THROUGH_A_MODULE = RAW_CHANNEL + """
import base64, os
def check(module):
    # the module the test handed over was the judge's own: its os.write to fd 3 (the results), with
    # the nonce of the sandbox's mark in the environment
    write = ask(["getattr", number_of("<module 'os'"), "write"])[1][1]
    nonce = os.environ["LIT_GRPO_SANDBOX"]
    lines = "".join("%s T %d 1\\n" % (nonce, i) for i in range(2)).encode()
    ask(["call", write, ["t", 3, ["b", base64.b64encode(lines).decode()]], ["d"]])
    return False
"""


def test_forged_pass_through_a_module_the_test_hands_over():
    require("separate_judge")
    tests = ["import os\nassert check(os)", "assert False"]
    assert forged_score(FORGED_THROUGH_A_MODULE, tests=tests) == 0.0


def test_honest_programs_still_use_what_tests_hand_over():
    code = """
def total(numbers):
    return sum(numbers)
def apply(f, x):
    return f(f(x))
def reverse(head):  # relinks the test's own nodes
    previous = None
    while head is not None:
        head.next, previous, head = previous, head, head.next
    return previous
def sort_by(items, key):
    return sorted(items, key=key)
def fill(box):
    box.put(3)
    return box.items
def echo(stream, text):
    stream.write(text)
def join_all(parts):
    return "-".join(str(p) for p in parts)
import math
def root(x):
    return math.sqrt(x)
"""
    tests = [
        "assert total(x * x for x in range(4)) == 14",
        "assert apply(lambda v: v + 1, 3) == 5 and apply(abs, -2) == 2",
        "class Node:\n    def __init__(self, v, next=None):\n        self.v, self.next = v, next\n"
        "head = reverse(Node(1, Node(2, Node(3))))\nassert [head.v, head.next.v, head.next.next.v] == [3, 2, 1]",
        "assert sort_by(['ccc', 'a', 'bb'], len) == ['a', 'bb', 'ccc']",
        "import operator\nassert sort_by([(1, 'b'), (2, 'a')], operator.itemgetter(1)) == [(2, 'a'), (1, 'b')]",
        "import io\nout = io.StringIO()\nassert apply(lambda s: s, 'x') == 'x' and echo(out, 'hi') is None\n"
        "assert out.getvalue() == 'hi'",
        "class Box:\n    def __init__(self):\n        self.items = []\n    def put(self, v):\n"
        "        self.items.append(v)\nassert fill(Box()) == [3]",
        "import operator, functools\nassert apply(functools.partial(operator.add, 1), 1) == 3",
        "assert join_all(map(str.upper, 'ab')) == 'A-B'",
        "assert math.isclose(root(2), 2 ** 0.5)",
    ]
    result = attack(code, tests=tests)
    assert result.test_results == [True] * len(tests), result.stderr


# --------------------------------------------------------------------------------------------------
# 19. (new) Watching the machine's files: dnotify (fcntl F_NOTIFY) on a directory bound from the
#     machine reports every read of its files, by other sandboxes and by the machine's processes.
# --------------------------------------------------------------------------------------------------

WATCHED_DIRECTORY = os.path.dirname(os.path.realpath(os.__file__))


@pytest.mark.parametrize("without, succeeds", rows(("seccomp",)))
def test_watching_the_machines_files(without, succeeds):
    check_rows(("seccomp",), without, succeeds)
    import threading

    code = f"""
import fcntl, os, signal, time
events = []
signal.signal(signal.SIGIO, lambda *args: events.append(1))
fd = os.open({WATCHED_DIRECTORY!r}, os.O_RDONLY)
try:
    fcntl.fcntl(fd, fcntl.F_NOTIFY, fcntl.DN_ACCESS | fcntl.DN_MULTISHOT)
except OSError:
    pass
deadline = time.monotonic() + 4
while not events and time.monotonic() < deadline:
    time.sleep(0.05)
WORKED = bool(events)
"""
    done = threading.Event()

    def read_files():  # the machine's own use of its files, meanwhile
        while not done.is_set():
            with open(os.path.join(WATCHED_DIRECTORY, "os.py"), "rb") as f:
                f.read(1)
            time.sleep(0.05)

    reader = threading.Thread(target=read_files)
    reader.start()
    try:
        assert worked(attack(code, without)) == succeeds
    finally:
        done.set()
        reader.join()


# --------------------------------------------------------------------------------------------------
# 20. (new) Inherited descriptors: the program's stdin was the trainer's temporary file opened for
#     reading and writing, on the trainer's disk: it could write there, truncate it, reopen it.
# --------------------------------------------------------------------------------------------------


def test_writing_through_inherited_descriptors():
    code = """
import json, os
done = []
def attempt(name, action):
    try:
        action()
        done.append(name)
    except OSError:
        pass
attempt("write", lambda: os.write(0, b"x" * 4096))
attempt("truncate", lambda: os.ftruncate(0, 1 << 20))
attempt("reopen for writing", lambda: os.write(os.open("/proc/self/fd/0", os.O_RDWR), b"x"))
attempt("read", lambda: os.read(0, 5) == b"input" or 1 / 0)
print(json.dumps({"done": done, "descriptors": sorted(int(fd) for fd in os.listdir("/proc/self/fd"))}))
"""
    result = run_in_sandbox(code, stdin=b"input", timeout=TIMEOUT, audit_hook=False)
    assert result.returncode == 0, result.stderr
    import json

    seen = json.loads(result.stdout)
    assert seen["done"] == ["read"]  # its input, for reading only
    assert seen["descriptors"] == [0, 1, 2, 3]  # stdin, stdout, stderr, and the listing's own


# --------------------------------------------------------------------------------------------------
# 21. (new) The page cache as a channel: evict a file of the machine's from the cache
#     (POSIX_FADV_DONTNEED), then ask whether a read would wait for the disk (RWF_NOWAIT): the answer
#     changes when anyone else (another sandbox, the machine) reads it.
# --------------------------------------------------------------------------------------------------

CACHED_FILE = os.path.join(os.path.dirname(os.path.realpath(os.__file__)), "pydoc_data", "topics.py")


@pytest.mark.skipif(not os.path.exists(CACHED_FILE), reason="no pydoc_data/topics.py in this Python")
@pytest.mark.parametrize("without, succeeds", rows(("seccomp",)))
def test_the_page_cache_as_a_channel(without, succeeds):
    check_rows(("seccomp",), without, succeeds)
    import threading

    code = f"""
import os, time
fd = os.open({CACHED_FILE!r}, os.O_RDONLY)
buffer = bytearray(4096)
def cached():
    try:
        return os.preadv(fd, [buffer], 0, os.RWF_NOWAIT) > 0
    except BlockingIOError:  # the read would have waited for the disk
        return False
    except OSError:
        return None
SAW_IT_EVICTED = SAW_IT_READ = False
deadline = time.monotonic() + 4
while time.monotonic() < deadline and not SAW_IT_READ:
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # evict the machine's pages
    except OSError:
        pass
    if cached() is False:
        SAW_IT_EVICTED = True
        for _ in range(20):  # someone else reads it within 100 ms
            time.sleep(0.005)
            if cached():
                SAW_IT_READ = True
                break
WORKED = SAW_IT_EVICTED and SAW_IT_READ
"""
    done = threading.Event()

    def read_file():
        while not done.is_set():
            with open(CACHED_FILE, "rb") as f:
                f.read(4096)
            time.sleep(0.01)

    reader = threading.Thread(target=read_file)
    reader.start()
    try:
        result = attack(code, without, tests=["assert WORKED", "assert SAW_IT_EVICTED"])
    finally:
        done.set()
        reader.join()
    if succeeds and result.test_results[1] is False:
        pytest.skip("this file system does not answer RWF_NOWAIT reads")
    assert worked(result) == succeeds
