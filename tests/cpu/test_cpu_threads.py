"""CPU threads on a machine shared with other jobs (lit_grpo.cpu.threads, lit_grpo.openmp)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from lit_grpo import openmp
from lit_grpo.cpu import threads as cpu_threads
from lit_grpo.cpu.threads import CpuThreads, busy_ticks, other_processes_busy_cores, process_tree_ticks

STAT = """cpu  900 0 300 5000 100 0 0 0 0 0
cpu0 100 0 50 1000 50 0 0 0 0 0
cpu1 200 10 20 900 0 5 5 60 0 0
cpu2 600 0 230 3100 50 0 0 0 0 0
intr 12345
"""


def test_busy_ticks_count_every_state_but_idle_and_iowait_on_the_given_cpus(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text(STAT)
    assert busy_ticks({0}, str(stat)) == 150
    assert busy_ticks({1}, str(stat)) == 200 + 10 + 20 + 5 + 5 + 60  # steal counts: another tenant ran
    assert busy_ticks({0, 1}, str(stat)) == 450
    assert busy_ticks({0}, str(tmp_path / "missing")) is None


def test_other_processes_busy_cores_leave_out_this_process():
    ticks = cpu_threads.CLOCK_TICKS
    # 2 s in which all CPUs ran 3 cores' worth, 1 of them this process's
    assert other_processes_busy_cores((0, 0, 10.0), (6 * ticks, 2 * ticks, 12.0)) == pytest.approx(2.0)
    assert other_processes_busy_cores((0, 0, 10.0), (ticks, 2 * ticks, 12.0)) == 0.0  # never negative
    assert other_processes_busy_cores((0, 0, 10.0), (ticks, 0, 10.0)) == 0.0


@pytest.mark.parametrize("busy, expected", [(0.0, 2), (0.3, 2), (0.6, 1), (1.0, 1), (1.4, 1), (2.0, 1)])
def test_the_threads_are_the_free_cores_rounded(busy, expected, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    threads = CpuThreads(max_threads=2)
    threads.cpus = {0, 1}
    assert threads.threads_for(busy) == expected


def test_the_threads_follow_other_load_and_never_pass_the_starting_count(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        threads = CpuThreads(interval=0.0)
        threads.cpus = {0, 1, 2, 3}
        ticks = cpu_threads.CLOCK_TICKS
        samples = iter([(0, 0, 0.0), (3 * ticks, 0, 1.0), (3 * ticks, 0, 2.0)])  # 3 of 4 cores busy, then none
        monkeypatch.setattr(threads, "sample", lambda: next(samples))
        assert threads.update() == 2  # the first call only measures
        assert threads.update() == 1 and torch.get_num_threads() == 1
        assert threads.update() == 2 and torch.get_num_threads() == 2  # 4 free cores, but at most the 2 it had
        assert threads.changes == 2
    finally:
        torch.set_num_threads(before)


def test_omp_num_threads_is_left_alone(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    threads = CpuThreads(interval=0.0)
    monkeypatch.setattr(threads, "sample", lambda: pytest.fail("measured although the user chose"))
    assert not threads.enabled and threads.update() == torch.get_num_threads()
    assert "OMP_NUM_THREADS=2" in threads.describe()


SPINNER = "import os\nos.sched_setaffinity(0, {0, 1})\nwhile True:\n    pass\n"


def start_other_job() -> int:
    """A spinning process that is *not* this one's descendant (started through a shell that exits),
    as another user's job is; returns its pid."""
    shell = subprocess.run(["sh", "-c", f'"{sys.executable}" -c "$0" >/dev/null 2>&1 & echo $!', SPINNER],
                           capture_output=True, text=True, check=True)
    return int(shell.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux") or len(os.sched_getaffinity(0)) < 2, reason="Linux, 2 CPUs")
def test_two_busy_processes_on_this_processs_two_cpus_leave_it_one_thread(monkeypatch):
    """Real load: two other processes spinning on the CPUs this test runs on (all pinned to CPUs 0 and 1)."""
    import signal

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    affinity, before = os.sched_getaffinity(0), torch.get_num_threads()
    others = [start_other_job() for _ in range(2)]
    try:
        os.sched_setaffinity(0, {0, 1})
        torch.set_num_threads(2)
        threads = CpuThreads(interval=0.5)
        start = threads.sample()
        threads.update()
        time.sleep(1.5)
        busy = other_processes_busy_cores(start, threads.sample())
        assert busy > 1.5 and threads.update() == 1
        for pid in others:
            os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)
        threads.update()  # the window that still had them
        start = threads.sample()
        time.sleep(1.5)
        after = other_processes_busy_cores(start, threads.sample())
        # without them the threads follow whatever else the machine runs (2 where nothing else does)
        assert threads.update() == threads.threads_for(after)
    finally:
        for pid in others:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        os.sched_setaffinity(0, affinity)
        torch.set_num_threads(before)


def test_a_childs_cpu_time_counts_as_this_processs_own():
    """Reward workers are this run's own load, not another job's: while they run..."""
    child = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 1.0\nwhile time.time() < end:\n    pass\n"])
    try:
        start = process_tree_ticks()
        time.sleep(0.6)
        assert child.poll() is None, "the child was to be running while measured"
        assert process_tree_ticks() - start >= 0.3 * cpu_threads.CLOCK_TICKS
    finally:
        child.kill()
        child.wait()


def test_an_exited_childs_cpu_time_stays_this_processs_own():
    """...and after they exit: a sandboxed code reward starts one process per call, which ends between two
    measurements; its CPU time moves to this process's cutime/cstime and must not turn into other jobs' load
    (which would lower the trainer's threads)."""
    start = process_tree_ticks()
    busy = "import time\nend = time.process_time() + 0.5\nwhile time.process_time() < end:\n    pass\n"
    subprocess.run([sys.executable, "-c", busy], check=True)  # started, ran 0.5 s of CPU, exited, reaped
    assert process_tree_ticks() - start >= 0.5 * cpu_threads.CLOCK_TICKS


def test_openmp_spins_briefly_unless_the_user_chose_a_wait_policy():
    environ: dict[str, str] = {}
    assert "GOMP_SPINCOUNT" in openmp.choose_wait_policy(environ, torch_loaded=False)
    assert environ == {"GOMP_SPINCOUNT": str(openmp.SPIN_COUNT)}
    user = {"OMP_WAIT_POLICY": "ACTIVE"}
    assert openmp.choose_wait_policy(user, torch_loaded=False) == "OMP_WAIT_POLICY=ACTIVE (set by the user)"
    assert user == {"OMP_WAIT_POLICY": "ACTIVE"}
    late: dict[str, str] = {}
    assert "torch was imported before lit_grpo" in openmp.choose_wait_policy(late, torch_loaded=True) and late == {}


def test_lit_grpo_sets_the_wait_policy_before_torch_loads():
    code = "import os, lit_grpo, torch\nprint(os.environ.get('GOMP_SPINCOUNT'))"
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == str(openmp.SPIN_COUNT)
