"""The sandbox's parts on their own: the seccomp filter (read by a small BPF interpreter, so both
architectures are checked on any machine, every syscall number included), the judge protocol
(two endpoints over pipes, no sandbox), the cgroup helper, and the parent's checks and warnings."""

from __future__ import annotations

import collections
import ctypes
import ctypes.util
import decimal
import errno
import fractions
import logging
import os
import re
import struct
import sys
import threading

import pytest
from lit_grpo_rewards.sandbox import cgroup as _sandbox_cgroup
from lit_grpo_rewards.sandbox import judge as _sandbox_judge
from lit_grpo_rewards.sandbox import launch as sandbox
from lit_grpo_rewards.sandbox import seccomp as _sandbox_seccomp
from lit_grpo_rewards.sandbox.judge_protocol import Endpoint, ProgramError, ProgramGone, Remote, dumps

# --------------------------------------------------------------------------------------------------
# The seccomp filter, run by a BPF interpreter
# --------------------------------------------------------------------------------------------------

ALLOW = "allow"
KILL = "kill"


def run_filter(program, arch, nr, args=(0, 0, 0, 0, 0, 0)):
    """What the kernel would do with syscall ``nr(args)`` from ``arch``: ALLOW, KILL or an errno."""
    args = tuple(args) + (0,) * (6 - len(args))
    data = struct.pack("<iIQ6Q", nr, arch, 0, *[a & (2**64 - 1) for a in args])
    acc, pc = 0, 0
    while True:
        code, jt, jf, k = program[pc]
        if code == _sandbox_seccomp.BPF_LD_W_ABS:
            acc = struct.unpack_from("<I", data, k)[0]
        elif code == _sandbox_seccomp.BPF_ALU_AND_K:
            acc &= k
        elif code == _sandbox_seccomp.BPF_JEQ_K:
            pc += jt if acc == k else jf
        elif code == _sandbox_seccomp.BPF_JSET_K:
            pc += jt if acc & k else jf
        elif code == _sandbox_seccomp.BPF_RET_K:
            if k == _sandbox_seccomp.SECCOMP_RET_ALLOW:
                return ALLOW
            if k == _sandbox_seccomp.SECCOMP_RET_KILL_PROCESS:
                return KILL
            assert k & 0xFFFF0000 == _sandbox_seccomp.SECCOMP_RET_ERRNO
            return k & 0xFFFF
        else:
            raise AssertionError(f"unexpected BPF instruction {code:#x}")
        pc += 1


ARCHES = {
    "x86_64": (_sandbox_seccomp.AUDIT_ARCH_X86_64, _sandbox_seccomp.X86_64),
    "aarch64": (_sandbox_seccomp.AUDIT_ARCH_AARCH64, _sandbox_seccomp.AARCH64),
}


@pytest.fixture(params=sorted(ARCHES))
def arch(request):
    audit_arch, numbers = ARCHES[request.param]
    return request.param, audit_arch, numbers, _sandbox_seccomp.filter_for_machine(request.param)


def test_filter_fits_the_kernel_limits(arch):
    _, _, _, program = arch
    assert len(program) < 4096  # BPF_MAXINSNS
    assert len(_sandbox_seccomp.packed(program)) == 8 * len(program)


def test_every_listed_call_is_allowed(arch):
    _, audit_arch, numbers, program = arch
    for name in _sandbox_seccomp.ALLOWED:
        if name in numbers:
            assert run_filter(program, audit_arch, numbers[name]) == ALLOW, name


def test_every_other_syscall_number_is_refused(arch):
    """Deny by default, exhaustively: every number up to 1023 that is not listed is refused."""
    _, audit_arch, numbers, program = arch
    listed = {numbers[n] for n in _sandbox_seccomp.ALLOWED if n in numbers}
    checked = {numbers[n] for n in list(_sandbox_seccomp.ARG_RULES) + list(_sandbox_seccomp.REFUSED_WITH)
               if n in numbers}  # (``open`` is x86_64's alone)
    for nr in range(1024):
        if nr not in listed | checked:
            assert run_filter(program, audit_arch, nr) == errno.EPERM, nr


@pytest.mark.parametrize("name", [
    "socket", "connect", "bind", "execve", "ptrace", "process_vm_readv", "bpf", "perf_event_open",
    "userfaultfd", "io_uring_setup", "add_key", "keyctl", "request_key", "shmget", "shmat", "semget",
    "msgget", "mq_open", "memfd_create", "unshare", "setns", "mount", "pivot_root", "chroot", "open_tree",
    "fsopen", "pidfd_open", "pidfd_getfd", "kcmp", "setuid", "mknodat", "fchownat", "setxattr", "mlock",
    "inotify_init1", "splice", "seccomp", "personality", "reboot",
])
def test_named_dangerous_calls_are_refused(arch, name):
    arch_name, audit_arch, _, program = arch
    numbers = _kernel_header_numbers(arch_name)
    if name not in numbers:
        pytest.skip(f"{name} is not in this machine's {arch_name} kernel headers")
    assert run_filter(program, audit_arch, numbers[name]) == errno.EPERM


def test_argument_rules(arch):
    _, a, n, p = arch
    assert run_filter(p, a, n["socketpair"], (1, 1 | 0o2000000)) == ALLOW  # AF_UNIX, SOCK_STREAM|SOCK_CLOEXEC
    assert run_filter(p, a, n["socketpair"], (1, 2)) == errno.EPERM  # a datagram pair could sendto any path
    assert run_filter(p, a, n["socketpair"], (1, 5)) == errno.EPERM  # SOCK_SEQPACKET
    assert run_filter(p, a, n["socketpair"], (2, 1)) == errno.EPERM  # AF_INET
    thread_flags = 0x3D0F00  # what glibc's pthread_create passes
    assert run_filter(p, a, n["clone"], (thread_flags,)) == ALLOW
    assert run_filter(p, a, n["clone"], (0x11,)) == ALLOW  # fork: SIGCHLD
    for flag in (0x10000000, 0x20000, 0x40000000, 0x20000000, 0x08000000, 0x04000000, 0x02000000):
        assert run_filter(p, a, n["clone"], (0x11 | flag,)) == errno.EPERM, hex(flag)
    assert run_filter(p, a, n["clone3"]) == errno.ENOSYS  # so that glibc falls back to clone
    assert run_filter(p, a, n["ioctl"], (1, 0x5401)) == ALLOW  # TCGETS (isatty)
    assert run_filter(p, a, n["ioctl"], (1, 0x5412)) == errno.EPERM  # TIOCSTI: typing into a terminal
    assert run_filter(p, a, n["ioctl"], (1, 0x1_0000_5401)) == ALLOW  # the kernel reads 32 bits of cmd
    assert run_filter(p, a, n["prctl"], (15,)) == ALLOW  # PR_SET_NAME
    assert run_filter(p, a, n["prctl"], (22,)) == errno.EPERM  # PR_SET_SECCOMP
    assert run_filter(p, a, n["prctl"], (4,)) == errno.EPERM  # PR_SET_DUMPABLE
    assert run_filter(p, a, n["prlimit64"], (0, 9)) == ALLOW
    assert run_filter(p, a, n["prlimit64"], (1, 9)) == errno.EPERM  # another process's limits
    assert run_filter(p, a, n["mmap"], (0, 4096, 3, 0x22)) == ALLOW
    assert run_filter(p, a, n["mmap"], (0, 4096, 3, 0x22 | 0x40000)) == errno.EPERM  # MAP_HUGETLB
    assert run_filter(p, a, n["fallocate"], (1, 1, 0, 1 << 30)) == errno.EOPNOTSUPP  # glibc writes instead
    assert run_filter(p, a, n["flock"], (0, 2)) == 0  # succeeds, locks nothing
    for cmd in (0, 1, 2, 3, 4, 1030):  # F_DUPFD, F_GETFD, F_SETFD, F_GETFL, F_SETFL, F_DUPFD_CLOEXEC
        assert run_filter(p, a, n["fcntl"], (0, cmd)) == ALLOW, cmd
    for cmd in (5, 6, 7, 36, 37, 38):  # F_GETLK, F_SETLK, F_SETLKW and their OFD forms: do nothing
        assert run_filter(p, a, n["fcntl"], (0, cmd)) == 0, cmd
    for cmd in (1024, 1025, 1026):  # F_SETLEASE, F_GETLEASE, F_NOTIFY
        assert run_filter(p, a, n["fcntl"], (0, cmd)) == errno.EPERM, cmd
    assert run_filter(p, a, n["fadvise64"], (0, 0, 0, 4)) == 0  # POSIX_FADV_DONTNEED: ignored
    assert run_filter(p, a, n["fadvise64"], (0, 0, 0, 2)) == ALLOW  # POSIX_FADV_SEQUENTIAL
    assert run_filter(p, a, n["preadv2"], (0, 0, 1, 0, 0, 0x1)) == ALLOW  # RWF_HIPRI
    assert run_filter(p, a, n["preadv2"], (0, 0, 1, 0, 0, 0x8)) == errno.EPERM  # RWF_NOWAIT


def test_other_abis_are_killed_or_refused(arch):
    arch_name, audit_arch, numbers, program = arch
    assert run_filter(program, 0x40000003, numbers["getpid"]) == KILL  # i386 (int 0x80)
    assert run_filter(program, 0x40000028, numbers["getpid"]) == KILL  # 32-bit ARM
    if arch_name == "x86_64":
        assert run_filter(program, audit_arch, 0x40000000 | numbers["getpid"]) == errno.EPERM  # x32


def test_unknown_architecture_has_no_filter():
    assert _sandbox_seccomp.filter_for_machine("riscv64") is None


def _kernel_header_numbers(arch_name: str) -> dict[str, int]:
    paths = {"x86_64": ["/usr/include/x86_64-linux-gnu/asm/unistd_64.h", "/usr/include/asm/unistd_64.h"],
             "aarch64": ["/usr/include/asm-generic/unistd.h"]}[arch_name]
    for path in paths:
        if os.path.exists(path):
            with open(path) as f:
                text = f.read()
            found = {m.group(2): int(m.group(3)) for m in re.finditer(r"#define __NR(3264)?_(\w+)\s+(\d+)", text)}
            if "fstatat" in found:  # the generic table's name for newfstatat
                found["newfstatat"] = found.pop("fstatat")
            return found
    pytest.skip(f"no {arch_name} kernel headers here")


@pytest.mark.parametrize("arch_name", sorted(ARCHES))
def test_syscall_numbers_match_the_kernel_headers(arch_name):
    headers = _kernel_header_numbers(arch_name)
    table = ARCHES[arch_name][1]
    compared = [name for name in table if name in headers]
    assert len(compared) > 0.9 * len(table)  # only calls newer than the headers are skipped
    assert {name: table[name] for name in compared} == {name: headers[name] for name in compared}


LIBSECCOMP_UNKNOWN = -1  # __NR_SCMP_ERROR: a name this libseccomp does not know (newer than it)


def _libseccomp_numbers(audit_arch: int, names) -> dict[str, int]:
    """libseccomp's own syscall numbers for ``names`` on an architecture (its tables cover every
    architecture, whatever this machine is; a negative number: not a call there, or unknown)."""
    path = ctypes.util.find_library("seccomp") or "libseccomp.so.2"  # libseccomp2: apt itself depends on it
    try:
        libseccomp = ctypes.CDLL(path)
    except OSError:
        pytest.skip("no libseccomp on this machine")
    resolve = libseccomp.seccomp_syscall_resolve_name_arch
    resolve.argtypes, resolve.restype = [ctypes.c_uint32, ctypes.c_char_p], ctypes.c_int
    return {name: resolve(audit_arch, name.encode()) for name in names}


@pytest.mark.parametrize("arch_name", sorted(ARCHES))
def test_syscall_numbers_match_libseccomp(arch_name):
    """Every number of the hand-written tables, on both architectures, is the one libseccomp knows."""
    audit_arch, table = ARCHES[arch_name]
    known = {name: number for name, number in _libseccomp_numbers(audit_arch, table).items()
             if number != LIBSECCOMP_UNKNOWN}
    assert len(known) > 0.9 * len(table)  # only calls newer than this libseccomp are skipped
    assert known == {name: table[name] for name in known}


# --------------------------------------------------------------------------------------------------
# The judge protocol between two endpoints in this process
# --------------------------------------------------------------------------------------------------


class Pair:
    """A judge endpoint here and a program endpoint served from a thread, over two pipes."""

    def __init__(self, namespace, max_frame=1 << 20):
        judge_reads, program_writes = os.pipe()
        program_reads, judge_writes = os.pipe()
        self.fds = [judge_reads, program_writes, program_reads, judge_writes]
        self.judge = Endpoint(judge_reads, judge_writes, max_frame, lambda name: name in ("math", "re", "copy"))
        self.program = Endpoint(program_reads, program_writes, max_frame, lambda name: False, side="program")
        self.thread = threading.Thread(target=_sandbox_judge.serve_program, args=(self.program, namespace), daemon=True)
        self.thread.start()

    def run(self, tests):
        results = {}
        completed = _sandbox_judge.judge_tests(self.judge, tests, results.__setitem__)
        return [results.get(i) for i in range(len(tests))], completed

    def close(self):
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.thread.join(timeout=5)


def judge(namespace, tests):
    pair = Pair(namespace)
    try:
        return pair.run(tests)[0]
    finally:
        pair.close()


class LyingInt(int):
    def __eq__(self, other):
        return True

    __hash__ = int.__hash__


class Liar:
    __eq__ = __ne__ = __lt__ = __gt__ = __le__ = __ge__ = __contains__ = lambda self, *a: True  # noqa: E731
    __bool__ = lambda self: True  # noqa: E731

    def __len__(self):
        return 3


def test_plain_values_cross_as_copies_of_the_judges_own_types():
    Point = collections.namedtuple("Point", "x y")
    namespace = {
        "n": 10**40, "neg": -7, "f": 0.1, "inf": float("inf"), "c": 1 - 2j, "s": "é\ud800", "b": b"\x00\xff",
        "ba": bytearray(b"ab"), "l": [1, [2, (3, {4: frozenset({5})})]], "st": {1, 2}, "r": range(1, 9, 2),
        "fr": fractions.Fraction(1, 3), "d": decimal.Decimal("1.10"), "cnt": collections.Counter("aab"),
        "od": collections.OrderedDict(a=1), "dq": collections.deque([1, 2], 5), "p": Point(1, 2),
        "dd": collections.defaultdict(list, a=[1]), "none": None, "t": True, "cyclic": [1],
    }
    namespace["cyclic"].append(namespace["cyclic"])
    tests = [
        "assert type(n) is int and n == 10**40 and neg == -7 and type(f) is float and f == 0.1",
        "assert inf == float('inf') and c == 1 - 2j and s == 'é\\ud800' and b == bytes([0, 255])",
        "assert type(ba) is bytearray and ba == b'ab' and l == [1, [2, (3, {4: frozenset({5})})]]",
        "assert st == {1, 2} and r == range(1, 9, 2) and none is None and t is True",
        "from fractions import Fraction\nfrom decimal import Decimal\nassert type(fr) is Fraction and fr == Fraction(1, 3)"
        " and type(d) is Decimal and str(d) == '1.10'",
        "import collections as C\nassert type(cnt) is C.Counter and cnt == C.Counter('aab') and type(od) is C.OrderedDict"
        " and type(dq) is C.deque and dq.maxlen == 5 and list(dq) == [1, 2]",
        "assert p == (1, 2) and p.x == 1 and p._fields == ('x', 'y') and dd['missing'] == [] and dd['a'] == [1]",
        "assert cyclic[0] == 1 and len(cyclic) == 2",
    ]
    assert judge(namespace, tests) == [True] * len(tests)


def test_subclasses_arrive_as_their_base_type():
    class MyStr(str):
        def __eq__(self, other):
            return True

    class MyList(list):
        def __iter__(self):
            return iter([99])

    ns = {"i": LyingInt(5), "s": MyStr("x"), "lst": MyList([1, 2])}
    tests = ["assert type(i) is int and i == 5 and i != 6", "assert type(s) is str and s != 'y'",
             "assert type(lst) is list and lst == [1, 2]"]
    assert judge(ns, tests) == [True, True, True]


def test_program_objects_cannot_decide_a_comparison_or_a_truth_value():
    ns = {"make": Liar}
    tests = ["assert make() == 3", "assert not (make() != 3)", "assert make()", "assert not make()",
             "assert make() < 1", "assert 3 in [make()]", "assert sorted([make(), make()])",
             "assert len(make()) == 3"]  # len is the program's answer: a plain int, compared here
    assert judge(ns, tests) == [False] * 7 + [True]


def test_remote_objects_work_through_calls_attributes_and_iteration():
    class Stack:
        def __init__(self):
            self.items = []

        def push(self, x):
            self.items.append(x)

        def __iter__(self):
            return iter(self.items)

        def __getitem__(self, i):
            return self.items[i]

    def gen(n):
        yield from range(n)

    ns = {"Stack": Stack, "gen": gen, "apply": lambda f, x: f(f(x))}
    tests = ["s = Stack(); s.push(1); s.push(2)\nassert list(s) == [1, 2] and s[1] == 2 and s.items == [1, 2]",
             "assert sum(gen(1000)) == 499500 and 7 in gen(10)",
             "g = gen(3)\nassert next(g) == 0 and list(g) == [1, 2]",
             "assert apply(lambda v: v * 3, 2) == 18", "assert str(Stack()).startswith('<')"]
    assert judge(ns, tests) == [True] * 5


def test_exceptions_map_to_builtins_but_never_to_stop_iteration():
    def raises(kind):
        raise {"value": ValueError("bad"), "stop": StopIteration(), "exit": SystemExit(0),
               "key": KeyError("k")}[kind]

    ns = {"raises": raises, "is_even": lambda x: raises("stop")}
    tests = ["try:\n    raises('value')\nexcept ValueError as e:\n    assert str(e) == 'bad'",
             "try:\n    raises('key')\nexcept KeyError as e:\n    assert e.args == ('k',)",
             "assert all(map(is_even, [1, 3]))",  # a StopIteration would end map() early: True
             "try:\n    raises('exit')\nexcept Exception as e:\n    assert type(e).__name__ == 'ProgramError'"]
    assert judge(ns, tests) == [True, True, False, True]


def test_builtins_and_dunders_are_never_taken_from_the_program():
    ns = {"abs": lambda x: 0, "len": lambda x: 3, "isinstance": lambda *a: True, "AssertionError": Exception,
          "__builtins__": {}, "add": lambda a, b: 0}
    tests = ["assert abs(add(1, 2) - 3) < 1e-9", "assert len([]) == 0", "assert not isinstance(1, str)"]
    assert judge(ns, tests) == [False, True, True]


def test_modules_are_the_judges_own_imports():
    import math

    fake = type(sys)("math")
    fake.isclose = lambda *a, **k: True
    tests = ["assert not math.isclose(1, 2)", "assert math is __import__('math') or math.pi > 3",
             "assert not hasattr(other, 'isclose') or other.isclose(1, 1)"]
    assert judge({"math": fake, "other": math}, tests) == [True, True, True]


def test_a_fake_module_under_a_module_name_the_tests_use_is_replaced_by_the_real_one():
    class FakeMath:
        @staticmethod
        def isclose(*args, **kwargs):
            return True

    ns = {"math": FakeMath(), "copy": lambda x: "mine"}
    tests = ["assert not math.isclose(1, 2)", "assert copy(1) == 'mine'"]  # called, not read as a module
    assert judge(ns, tests) == [True, True]
    assert _sandbox_judge._attributes_read("math", ["x = math .pi", "math.\tisclose(1, 1)"]) == {"pi", "isclose"}
    assert not _sandbox_judge._attributes_read("math", ["x = mymath.pi", "x = self.math.pi", "math(1)", "math2.e"])


def test_a_broken_or_hostile_channel_fails_the_remaining_tests():
    for garbage in (b"\xff\xff\xff\xff", (5).to_bytes(4, "big") + b"[1,2", (2).to_bytes(4, "big") + b"{}",
                    (20).to_bytes(4, "big") + b'["ok",["??",1]]'.ljust(20), b""):
        judge_reads, program_writes = os.pipe()
        program_reads, judge_writes = os.pipe()
        endpoint = Endpoint(judge_reads, judge_writes, 1 << 20, lambda n: False)
        ready = dumps(["ready", [["f", ["R", 0]]]]).encode()
        os.write(program_writes, len(ready).to_bytes(4, "big") + ready + garbage)
        os.close(program_writes)
        results = {}
        completed = _sandbox_judge.judge_tests(endpoint, ["assert f() == 1", "assert True"], results.__setitem__)
        assert results == {0: False} and not completed, garbage
        for fd in (judge_reads, program_reads, judge_writes):
            os.close(fd)


def test_program_gone_is_not_an_exception_a_test_can_swallow():
    assert issubclass(ProgramGone, BaseException) and not issubclass(ProgramGone, Exception)
    assert issubclass(ProgramError, Exception)


def test_too_large_values_fail_the_test_not_the_judge():
    pair = Pair({"big": lambda: "x" * 5000}, max_frame=1000)
    try:
        assert pair.run(["assert len(big()) == 5000", "assert big.__name__ == '<lambda>'"]) == ([False, True], True)
    finally:
        pair.close()


def test_remote_references_refuse_pickling_and_copy_to_themselves():
    import copy
    import pickle

    endpoint = Endpoint(-1, -1, 1, lambda n: False)
    ref = Remote(endpoint, 0)
    assert copy.copy(ref) is ref and copy.deepcopy([ref])[0] is ref
    with pytest.raises(TypeError):
        pickle.dumps(ref)
    with pytest.raises(TypeError):
        bool(ref)
    with pytest.raises(AttributeError):
        ref.__globals__  # noqa: B018 - dunders are never asked of the other side


# --------------------------------------------------------------------------------------------------
# The cgroup helper and the parent's checks
# --------------------------------------------------------------------------------------------------


def test_cgroup_paths_within_a_hierarchy():
    assert _sandbox_cgroup._under("/sys/fs/cgroup/memory", "/", "/a/b") == "/sys/fs/cgroup/memory/a/b"
    assert _sandbox_cgroup._under("/sys/fs/cgroup", "/a", "/a/b") == "/sys/fs/cgroup/b"
    assert _sandbox_cgroup._under("/sys/fs/cgroup", "/a", "/c") is None


@pytest.mark.skipif(_sandbox_cgroup.support().version is None, reason="no sandbox cgroups on this machine")
def test_cgroup_create_limits_and_remove():
    cg = _sandbox_cgroup.create("unit-test-" + os.urandom(4).hex(), 64 << 20, 5)
    try:
        files = os.listdir(cg.dirs[0])
        limit_file = "memory.max" if cg.version == 2 else "memory.limit_in_bytes"
        assert limit_file in files
        with open(os.path.join(cg.dirs[0], limit_file)) as f:
            assert int(f.read()) == 64 << 20
        assert cg.procs() == []
    finally:
        assert cg.remove()
    assert not any(os.path.exists(d) for d in cg.dirs)


def test_cgroup_v2_limits_are_the_v2_files(monkeypatch, tmp_path):
    """The v2 branch of ``create`` on a stand-in directory (this machine's memory controller is v1)."""
    monkeypatch.setattr(_sandbox_cgroup, "_support", _sandbox_cgroup.CgroupSupport(2, str(tmp_path), str(tmp_path)))
    cg = _sandbox_cgroup.create("v2", 100 << 20, 9)
    assert cg.dirs == [str(tmp_path / "lit-grpo-sandbox-v2")]
    written = {p.name: p.read_text() for p in (tmp_path / "lit-grpo-sandbox-v2").iterdir()}
    assert written == {"memory.max": str(100 << 20), "memory.swap.max": "0", "memory.oom.group": "1", "pids.max": "9"}
    assert not cg.remove(wait_s=0)  # a real cgroup directory's files go with it; these do not


def test_unknown_layer_names_are_refused():
    with pytest.raises(ValueError, match=r"unknown sandbox layer\(s\) \['secomp'\]"):
        sandbox.run_in_sandbox("pass", tests=[], _disable_layers=["secomp"])


def test_a_missing_layer_is_warned_about_once(monkeypatch, caplog, tmp_path):
    monkeypatch.setattr(sandbox, "_warned", set())
    monkeypatch.setattr(_sandbox_cgroup, "_support", _sandbox_cgroup.CgroupSupport(None, reason="pretend"))
    monkeypatch.setattr(sandbox.tempfile, "tempdir", str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="lit_grpo_rewards.sandbox"):
        for _ in range(2):
            result = sandbox.run_in_sandbox("x = 1", tests=["assert x == 1"])
            assert result.test_results == [True] and result.layers["cgroup"] is False
    warnings = [r.getMessage() for r in caplog.records if "cgroup" in r.getMessage()]
    assert len(warnings) == 1 and "memory is bounded per process only" in warnings[0] and "pretend" in warnings[0]


# --------------------------------------------------------------------------------------------------
# The runner's modules as the bootstrap loads them (the package _sandbox, in the sandbox)
# --------------------------------------------------------------------------------------------------


def test_the_runners_modules_import_only_the_standard_library_and_those_loaded_before_them():
    """The bootstrap runs them in ``_RUNNER_MODULES``' order, with the standard library only."""
    import ast

    from lit_grpo_rewards.sandbox import runner

    folder = os.path.dirname(runner.__file__)
    order = list(sandbox._RUNNER_MODULES)
    assert order[-1] == "runner"
    for position, name in enumerate(order):
        with open(os.path.join(folder, name + ".py")) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level:
                siblings = [node.module] if node.module else [alias.name for alias in node.names]
                assert all(s in order[:position] for s in siblings), f"{name} imports {siblings}"
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                tops = [alias.name.split(".")[0] for alias in node.names] if isinstance(node, ast.Import) \
                    else [node.module.split(".")[0]]
                assert all(top in sys.stdlib_module_names for top in tops), f"{name} imports {tops}"


@pytest.mark.parametrize("name", ["_sandbox", "_sandbox.judge", "_sandbox.judge_protocol", "_sandbox.runner"])
def test_the_runners_own_modules_are_never_the_judges_business(name):
    from lit_grpo_rewards.sandbox import runner

    assert not runner._the_judges_module(name, site_packages=False)
    assert not runner._the_judges_module(name, site_packages=True)
    assert runner._the_judges_module("math", site_packages=False)  # while a standard-library module is
