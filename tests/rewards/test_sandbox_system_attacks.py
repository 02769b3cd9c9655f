"""The code sandbox against a program that turns the machine against the trainer (issue 50.10-11).

Attacks on what the sandbox shares with the machine rather than on its walls: the disk (its flush
and its bandwidth), memory the kernel must take back from someone. Each attack runs with every
layer and, where a layer stops it, without that layer (``run_in_sandbox(_disable_layers=...)``, as in
``test_sandbox_attacks.py``), where it must succeed; what the scoring process itself changed (its
output files) was checked against the code before the change, where the attack succeeded.

Each test also checks, through the fixtures, that the scoring process and a bystander process
survive and that nothing of the sandbox outlives the call.
"""

from __future__ import annotations

import functools
import json
import os
import sys

import pytest
from lit_grpo_rewards.sandbox import cgroup as _sandbox_cgroup
from lit_grpo_rewards.sandbox import run_in_sandbox, sandbox_layers
from sandbox_fixtures import bystander, sandbox_tmp  # noqa: F401 - fixtures

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the code sandbox needs Linux"),
    pytest.mark.usefixtures("sandbox_tmp", "bystander"),
]

TIMEOUT = 10.0


@functools.lru_cache(maxsize=1)
def layers_here() -> dict:
    return sandbox_layers()


def require(*names: str) -> None:
    found = layers_here()
    missing = [n for n in names if not (found.get(n) and (n != "seccomp" or found.get("judge_seccomp")))]
    if missing:
        pytest.skip(f"this machine lacks the layer(s) {missing} (reported: {found})")


def run(code: str, without=(), **kwargs):
    """Run ``code`` as a stdin/stdout program; what it printed last, as JSON."""
    kwargs.setdefault("timeout", TIMEOUT)
    result = run_in_sandbox(code, stdin=b"", audit_hook=False, _disable_layers=without, **kwargs)
    assert result.returncode == 0, result.stderr.decode(errors="replace")
    return json.loads(result.stdout.decode().strip().splitlines()[-1]), result


# --------------------------------------------------------------------------------------------------
# 1. (issue 50.11) The trainer's disk, flushed and read past its cache: the program's stdout was a
#    file of the trainer's disk, so ``fdatasync(1)`` flushed that disk (12,603 device flushes in 2 s
#    here), and ``O_DIRECT`` read the machine's files at the disk's speed (1.65 GB in 2 s). Now the
#    output files are memory, the sync calls succeed without reaching the kernel (a sync of a pipe,
#    which the kernel refuses with EINVAL, "succeeds") and uncached reads are refused.
# --------------------------------------------------------------------------------------------------

MACHINE_FILE = os.path.realpath(os.__file__)  # bound read-only into every sandbox

DISK_IO = f"""
import ctypes, json, mmap, os, time
libc = ctypes.CDLL(None, use_errno=True)
def status(call):
    try:
        call()
        return 0
    except OSError as exc:
        return exc.errno
def c_status(result):
    return 0 if result == 0 else ctypes.get_errno()
out = {{"stdout": os.readlink("/proc/self/fd/1"), "stdout_device": os.fstat(1).st_dev}}
start, flushed = time.monotonic(), 0
while time.monotonic() - start < 0.5:  # what a hostile program does: write, flush, again
    os.write(1, b"x")
    flushed += status(lambda: os.fdatasync(1)) == 0
os.write(1, b"\\n")
out["fdatasync_per_s"] = flushed / (time.monotonic() - start)
r, w = os.pipe()
out["fsync(pipe)"] = status(lambda: os.fsync(r))  # the kernel: EINVAL
out["fdatasync(pipe)"] = status(lambda: os.fdatasync(r))  # EINVAL
out["sync_file_range(pipe)"] = c_status(libc.sync_file_range(r, 0, 0, 2))  # ESPIPE
mapping = mmap.mmap(-1, 4096)
out["msync(unaligned)"] = c_status(libc.msync(ctypes.c_void_p(ctypes.addressof(
    ctypes.c_char.from_buffer(mapping)) + 1), 4096, 4))  # EINVAL
out["syncfs"] = c_status(libc.syncfs(0))
out["sync"] = c_status(libc.syscall({os.uname().machine == "aarch64" and 81 or 162}))
def o_direct():
    fd = os.open({MACHINE_FILE!r}, os.O_RDONLY | os.O_DIRECT)
    os.close(fd)
out["open(O_DIRECT)"] = status(o_direct)
fd = os.open({MACHINE_FILE!r}, os.O_RDONLY)
import fcntl
status(lambda: fcntl.fcntl(fd, fcntl.F_SETFL, os.O_DIRECT))
out["O_DIRECT set by fcntl"] = bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)
out["preadv2(RWF_DONTCACHE)"] = status(lambda: os.preadv(fd, [bytearray(4096)], 0, 0x80))
print(json.dumps(out))
"""


SYNC_PROBES = ("fsync(pipe)", "fdatasync(pipe)", "sync_file_range(pipe)", "msync(unaligned)", "syncfs", "sync")


@pytest.mark.parametrize("without", [(), ("seccomp",)], ids=["all-layers", "without-seccomp"])
def test_the_trainers_disk_is_neither_flushed_nor_read_uncached(sandbox_tmp, without):
    if not without:
        require("seccomp")
    seen, result = run(DISK_IO, without)
    # The output files are memory, whatever the filter does: not the trainer's disk, where each
    # fdatasync(1) was a flush of the disk's write cache.
    assert seen["stdout"].startswith(("/memfd:", "/dev/shm/")), \
        f"stdout is {seen['stdout']!r}: a file of the trainer's disk"
    assert seen["stdout_device"] != os.stat(sandbox_tmp).st_dev, \
        "stdout lies on the trainer's temporary directory's disk"
    assert result.stdout.count(b"x") > 0
    reached_the_kernel = {k: seen[k] for k in SYNC_PROBES}
    if not without:
        assert all(v == 0 for v in reached_the_kernel.values()), \
            f"sync calls reached the kernel (the filter must make them succeed and do nothing): {reached_the_kernel}"
        assert seen["open(O_DIRECT)"] == 22, "open(O_DIRECT) must fail with EINVAL (the filter)"
        assert not seen["O_DIRECT set by fcntl"], "fcntl(F_SETFL, O_DIRECT) must be refused (the filter)"
        assert seen["preadv2(RWF_DONTCACHE)"] == 95, "preadv2(RWF_DONTCACHE) must fail with EOPNOTSUPP (the filter)"
    else:  # the kernel itself answers: the calls reach it
        assert seen["fsync(pipe)"] == 22 and seen["fdatasync(pipe)"] == 22 and seen["sync_file_range(pipe)"] == 29
        assert seen["msync(unaligned)"] == 22
        with open(MACHINE_FILE, "rb"):  # O_DIRECT works on this file system for the scoring process too
            try:
                os.close(os.open(MACHINE_FILE, os.O_RDONLY | os.O_DIRECT))
            except OSError:
                return
        assert seen["open(O_DIRECT)"] == 0 and seen["O_DIRECT set by fcntl"]


@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
def test_the_filter_tells_o_direct_from_its_neighbours(machine):
    """O_DIRECT's value depends on the architecture (aarch64's 0o40000 is O_DIRECTORY): the filter,
    read instruction by instruction, refuses each one's own and lets the others through."""
    from lit_grpo_rewards.sandbox import seccomp as sc
    from test_sandbox_parts import ALLOW, run_filter

    audit_arch, numbers = sc.MACHINES[machine]
    program = sc.filter_for_machine(machine)
    o_direct = {"x86_64": 0o40000, "aarch64": 0o200000}[machine]
    o_directory = {"x86_64": 0o200000, "aarch64": 0o40000}[machine]
    assert run_filter(program, audit_arch, numbers["openat"], (-100, 0, o_direct)) == 22  # EINVAL
    assert run_filter(program, audit_arch, numbers["openat"], (-100, 0, o_directory | 0o2000000)) == ALLOW
    assert run_filter(program, audit_arch, numbers["fcntl"], (3, 4, o_direct | 0o4000)) == 22  # F_SETFL
    assert run_filter(program, audit_arch, numbers["fcntl"], (3, 4, 0o4000)) == ALLOW  # O_NONBLOCK
    assert run_filter(program, audit_arch, numbers["preadv2"], (3, 0, 1, 0, 0, 0x80)) == 95  # RWF_DONTCACHE
    assert run_filter(program, audit_arch, numbers["pwritev2"], (3, 0, 1, 0, 0, 0x10)) == ALLOW  # RWF_APPEND
    for name in ("fsync", "fdatasync", "msync", "sync", "syncfs", "sync_file_range"):
        assert run_filter(program, audit_arch, numbers[name]) == 0, name  # succeeds, does nothing
    if "open" in numbers:
        assert run_filter(program, audit_arch, numbers["open"], (0, o_direct)) == 22


# --------------------------------------------------------------------------------------------------
# 2. (new) The disk through a page cache the memory limit keeps small: a program that reads more of
#    the machine's files than its memory holds (/usr is gigabytes) finds nothing cached on the next
#    pass and reads everything from the disk again, at the disk's full speed (about 230 MB/s a
#    sandbox here, no O_DIRECT needed), the trainer's checkpoints and data sets waiting behind it.
#    Now the sandbox's cgroup limits its disk reads (DISK_READ_BYTES_PER_S).
# --------------------------------------------------------------------------------------------------

READ_SECONDS = 1.5


def _uncached_files(total_bytes: int) -> list[str]:
    """Files of the machine's that every sandbox sees (under /usr), about ``total_bytes`` of them,
    evicted from the page cache (the scoring process may: it is the machine's)."""
    chosen, size = [], 0
    for root, dirs, files in os.walk("/usr/share"):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(root, name)
            try:
                if os.path.islink(path) or os.path.getsize(path) < (64 << 10) or "locale" in path:
                    continue
                with open(path, "rb") as f:
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            except OSError:
                continue
            chosen.append(path)
            size += os.path.getsize(path)
            if size >= total_bytes:
                return chosen
    return chosen


READ_AGAIN_AND_AGAIN = """
import json, os, time
paths = {paths!r}
buffer = bytearray(1 << 20)
start = time.monotonic()
while time.monotonic() - start < {seconds}:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        while os.readv(fd, [buffer]) == len(buffer) and time.monotonic() - start < {seconds}:
            pass
        os.close(fd)
        if time.monotonic() - start >= {seconds}:
            break
import resource
read_bytes = 512 * resource.getrusage(resource.RUSAGE_SELF).ru_inblock  # what the disk served this process
print(json.dumps({{"disk_bytes_per_s": read_bytes / (time.monotonic() - start)}}))
"""


@pytest.mark.parametrize("without", [(), ("disk_read_limit",)], ids=["all-layers", "without-disk_read_limit"])
def test_reading_the_machines_files_from_the_disk_again_and_again(without):
    require("cgroup")
    if _sandbox_cgroup.support().io_parent is None:
        pytest.skip("no io (v2) or blkio (v1) cgroup controller on this machine")
    paths = _uncached_files(192 << 20)  # more than the sandbox's memory (32 + 48 MiB) holds
    if sum(os.path.getsize(p) for p in paths) < (160 << 20):
        pytest.skip("not enough files under /usr/share to read")
    code = READ_AGAIN_AND_AGAIN.format(paths=paths, seconds=READ_SECONDS)
    seen, result = run(code, without, memory_mb=32)
    limit = _sandbox_cgroup.DISK_READ_BYTES_PER_S
    rate = seen["disk_bytes_per_s"]
    if not without:
        assert rate <= 1.5 * limit, \
            f"the sandbox read {rate / 1e6:.0f} MB/s from the disk: the cgroup's limit " \
            f"({limit / 1e6:.0f} MB/s) did not hold"
        assert result.layers.get("disk_read_limit") is True
    elif rate < 2 * limit:
        pytest.skip(f"this machine's disk served only {rate / 1e6:.0f} MB/s: too slow to show the attack")
    else:
        assert result.layers.get("disk_read_limit") is False


@pytest.mark.parametrize("version", [1, 2])
def test_the_disk_read_limit_is_written_for_every_disk(monkeypatch, tmp_path, version):
    """Both branches on stand-in directories (a machine has one kind of hierarchy): every disk gets
    the limit (v2 ``io.max``, v1 ``blkio.throttle``), and leaving the layer out writes none."""
    io_parent = tmp_path / "io"
    io_parent.mkdir()
    where = _sandbox_cgroup.CgroupSupport(version, str(tmp_path), str(tmp_path), io_parent=str(io_parent),
                                          disks=("8:0", "259:0"))
    monkeypatch.setattr(_sandbox_cgroup, "_support", where)
    written = []
    monkeypatch.setattr(_sandbox_cgroup, "_write",
                        lambda path, value: written.append((os.path.relpath(path, tmp_path), value)))
    monkeypatch.setattr(os, "mkdir", lambda path, mode=0o777: None)
    cg = _sandbox_cgroup.create("limits", 100 << 20, 9)
    rate, iops = _sandbox_cgroup.DISK_READ_BYTES_PER_S, _sandbox_cgroup.DISK_READ_IOPS
    disk_rules = [w for w in written if w[0].startswith("io/")]
    if version == 2:
        assert disk_rules == [("io/lit-grpo-sandbox-limits/io.max", f"{d} rbps={rate} riops={iops}")
                              for d in ("8:0", "259:0")]
    else:
        assert disk_rules == [(f"io/lit-grpo-sandbox-limits/blkio.throttle.read_{kind}_device", f"{d} {value}")
                              for d in ("8:0", "259:0") for kind, value in (("bps", rate), ("iops", iops))]
    assert cg.disk_reads_limited and str(io_parent / "lit-grpo-sandbox-limits") in cg.dirs
    written.clear()
    cg = _sandbox_cgroup.create("unlimited", 100 << 20, 9, limit_disk_reads=False)
    assert not [w for w in written if w[0].startswith("io/")] and not cg.disk_reads_limited


# --------------------------------------------------------------------------------------------------
# 3. (new) The out-of-memory killer's choice: when the machine runs out of memory the kernel kills
#    the process it ranks first, by size: the trainer (gigabytes), not a sandbox holding up to
#    memory_mb in each of max_processes processes (no cgroup bounds the whole without root), or
#    eight sandboxes at once. The kernel's own ranking (/proc/PID/oom_score) put the trainer first.
#    Now every sandbox process is the killer's first choice (oom_score_adj 1000).
# --------------------------------------------------------------------------------------------------

HOLD_MEMORY = """
import json
held = b"\\x01" * (96 << 20)
with open("/proc/self/oom_score") as f:
    print(json.dumps({"oom_score": int(f.read())}))
"""


@pytest.mark.parametrize("without", [(), ("oom_first",)], ids=["all-layers", "without-oom_first"])
def test_the_out_of_memory_killer_takes_the_sandbox_before_the_trainer(without):
    trainer_memory = b"\x01" * (384 << 20)  # a trainer's weights, small: it is gigabytes
    with open("/proc/self/oom_score") as f:
        trainer_score = int(f.read())
    seen, result = run(HOLD_MEMORY, without)
    del trainer_memory
    if not without:
        assert seen["oom_score"] > trainer_score, \
            f"the kernel would kill the trainer (oom_score {trainer_score}) before the sandbox ({seen['oom_score']})"
        assert result.layers.get("oom_first") is True
    else:
        assert seen["oom_score"] <= trainer_score


# --------------------------------------------------------------------------------------------------
# 4. (new) The trainer's scheduling privileges: a process inherits its parent thread's scheduling
#    policy and nice value, so a sandbox started from a scoring thread that runs at a real-time
#    policy (chrt) or a negative nice value ran the program at that priority: its busy loops (up to
#    max_processes of them) would take the machine's CPUs from every ordinary process, the trainer's
#    other threads and servers included, until the deadline. Now a sandbox starts at the ordinary
#    policy and a nice value of at least 0.
# --------------------------------------------------------------------------------------------------

REPORT_PRIORITY = """
import json, os
print(json.dumps({"policy": os.sched_getscheduler(0), "nice": os.getpriority(os.PRIO_PROCESS, 0)}))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="a real-time policy and a negative nice need root")
@pytest.mark.parametrize("without", [(), ("normal_priority",)], ids=["all-layers", "without-normal_priority"])
def test_the_program_does_not_inherit_the_trainers_real_time_priority(without):
    os.setpriority(os.PRIO_PROCESS, 0, -5)  # this thread: the scoring thread of a boosted trainer
    try:
        os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(1))
    except OSError:
        os.setpriority(os.PRIO_PROCESS, 0, 0)
        pytest.skip("this machine refuses a real-time policy (a cgroup without real-time runtime)")
    try:
        seen, result = run(REPORT_PRIORITY, without)
    finally:
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
        os.setpriority(os.PRIO_PROCESS, 0, 0)
    if not without:
        assert seen == {"policy": os.SCHED_OTHER, "nice": 0}, \
            f"the program ran at the trainer's priority {seen}: it could take the machine's CPUs from everyone"
        assert result.layers.get("normal_priority") is True
    else:
        assert seen == {"policy": os.SCHED_RR, "nice": -5}


# --------------------------------------------------------------------------------------------------
# Checked, and holding already: the trainer's environment (tokens, keys) never reaches the program,
# which gets a fixed, minimal one.
# --------------------------------------------------------------------------------------------------


def test_the_trainers_secrets_in_its_environment_stay_out(monkeypatch):
    secret = "hf_" + os.urandom(12).hex()
    for name in ("HF_TOKEN", "OPENAI_API_KEY", "WANDB_API_KEY"):
        monkeypatch.setenv(name, secret)
    code = "import json, os\nprint(json.dumps({'environ': dict(os.environ)}))\n"
    seen, _ = run(code)
    assert secret not in json.dumps(seen), "the trainer's secret reached the program's environment"
    assert not {"HF_TOKEN", "OPENAI_API_KEY", "WANDB_API_KEY"} & set(seen["environ"])
