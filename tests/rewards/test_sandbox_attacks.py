"""The code sandbox against a hostile program: one test per attack class.

Each attack runs once with every layer and then with the layer (or layers) that should stop it
switched off (``run_in_sandbox(_disable_layers=...)``, a test-only switch): it must fail with the
layers on and succeed without them, so that each test is shown to be able to fail. Where two layers
each stop an attack alone, each is switched off on its own (the attack still fails) and then both
(it succeeds). The audit hook is off (``audit_hook=False``) unless a test says otherwise: it is a
tripwire in the program's own interpreter, and the other layers must hold without it.

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

from sandbox_fixtures import bystander, rss_kb, sandbox_processes, sandbox_tmp  # noqa: F401 - fixtures
from lit_grpo_rewards.code import code_execution
from lit_grpo_rewards.sandbox import run_in_sandbox, sandbox_layers

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
    from lit_grpo_rewards import _sandbox_seccomp as sc

    numbers = sc.MACHINES[MACHINE][1]
    skip = {numbers[n] for n in list(sc.ALLOWED) + list(sc.ARG_RULES) + list(sc.FALLBACK_TO_OLDER) if n in numbers}
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
}
# Forgeries that beat a harness running the tests in the program's own interpreter, which is what the
# judge replaced; the others never worked and are checked with the judge only.
BEAT_THE_OLD_HARNESS = {
    "int-subclass-equal-to-everything", "object-that-agrees-with-everything", "shadowed-builtins",
    "result-lines-with-the-nonce-from-the-runners-frames", "patched-exec-compile-and-AssertionError",
    "expected-values-read-from-its-own-memory", "stop-iteration-ending-the-tests-loop",
    "fake-module-under-the-name-the-tests-use",
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


