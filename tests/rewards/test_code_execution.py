"""``code_execution`` and its sandbox: scores on hand-known programs, and hostile programs that must
score 0 quickly while leaving the machine, the filesystem and the test process as they were.

Every test runs with a private temporary directory (``tempfile.tempdir``), so "the sandbox
directory was removed" is checked exactly; leftover processes are found by the sandbox's
environment mark and by uid (the sandbox uids are unique to it when running as root).
"""

from __future__ import annotations

import functools
import json
import os
import pickle
import secrets
import socket
import sys
import tempfile
import time

import pytest

from lit_grpo_rewards.code import code_execution, extract_code, parse_test_cases
from lit_grpo_rewards.sandbox import UID_RANGE, run_in_sandbox, sandbox_layers

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the code sandbox needs Linux")

TIMEOUT = 2.0
SLACK = 3.0  # "returned within the timeout": elapsed < TIMEOUT + SLACK, generous for a loaded 2-core box
ADD_TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]
IS_ROOT = os.geteuid() == 0


@functools.lru_cache(maxsize=1)
def layers() -> dict:
    return sandbox_layers()


def _process_count() -> int:
    return sum(1 for e in os.listdir("/proc") if e.isdigit())


def _sandbox_processes() -> list[str]:
    """Processes that belong to any sandbox: the environment mark, or a sandbox uid."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            if UID_RANGE[0] <= os.stat(f"/proc/{entry}").st_uid < UID_RANGE[1]:
                found.append(entry)
                continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                if any(v.startswith(b"LIT_GRPO_SANDBOX=") for v in f.read().split(b"\0")):
                    found.append(entry)
        except OSError:  # gone meanwhile, or not ours to read
            pass
    return found


def _rss_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


@pytest.fixture
def sandbox_tmp(tmp_path, monkeypatch):
    """A private temporary directory for the sandboxes; afterwards: empty, and no sandbox process left."""
    root = tmp_path / "sandboxes"
    root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    yield root
    assert list(root.iterdir()) == [], "a sandbox directory was left behind"
    deadline = time.monotonic() + 2.0  # SIGKILLed processes may take a moment to disappear from /proc
    while _sandbox_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _sandbox_processes() == [], "a sandboxed process survived"


def chat(text):
    return [{"role": "assistant", "content": text}]


# --------------------------------------------------------------------------------------------------
# Scores on well-behaved programs
# --------------------------------------------------------------------------------------------------


def test_correct_solution_scores_one(sandbox_tmp):
    assert code_execution(["def add(a, b):\n    return a + b\n"], test_cases=[ADD_TESTS]) == [1.0]


def test_half_the_asserts_failing_scores_half(sandbox_tmp):
    code = "def add(a, b):\n    return 3\n"  # right for (1, 2) only
    assert code_execution([code], test_cases=[ADD_TESTS]) == [0.5]


def test_syntax_error_scores_zero(sandbox_tmp):
    assert code_execution(["def add(a, b) return a + b"], test_cases=[ADD_TESTS]) == [0.0]


def test_runtime_error_after_the_definitions_still_runs_the_tests(sandbox_tmp):
    code = "def add(a, b):\n    return a + b\n\nprint(add(int(input()), 1))\n"  # stdin is at EOF
    assert code_execution([code], test_cases=[ADD_TESTS]) == [1.0]


def test_stdin_stdout_tests(sandbox_tmp):
    cases = [{"input": "1 2\n", "output": "3\n"}, {"input": "5 5", "output": "10"}, {"input": "0 7\n", "output": "7"}]
    good = "import sys\na, b = map(int, sys.stdin.read().split())\nprint(a + b)\n"
    wrong = "a, b = map(int, input().split())\nprint(a + b if a else -1)\n"
    crashes = "print(10)\nraise SystemExit(3)\n"  # right output for one case, but a failing exit status
    trailing = "a, b = map(int, input().split())\nprint(str(a + b) + '   ')\nprint()\n"
    scores = code_execution([good, wrong, crashes, trailing], test_cases=[cases] * 4)
    assert scores == [1.0, pytest.approx(2 / 3), 0.0, 1.0]


def test_json_string_test_cases(sandbox_tmp):
    asserts = json.dumps(ADD_TESTS)
    io = json.dumps([{"input": "4\n", "output": "16\n"}, {"input": "3\n", "output": "9\n"}])
    apps = json.dumps({"inputs": ["4\n", "3\n"], "outputs": ["16\n", "10\n"]})
    square = "n = int(input())\nprint(n * n)\n"
    scores = code_execution(
        ["def add(a, b): return a + b", square, square], test_cases=[asserts, io, apps]
    )
    assert scores == [1.0, 1.0, 0.5]


def test_fenced_block_extraction(sandbox_tmp):
    text = (
        "First a wrong try:\n```python\ndef add(a, b):\n    return a - b\n```\n"
        "Output:\n```text\n-1\n```\nFixed:\n```python\ndef add(a, b):\n    return a + b\n```\nDone."
    )
    assert extract_code(text) == "def add(a, b):\n    return a + b\n"
    assert extract_code("```\nx = 1\n```") == "x = 1\n"
    assert extract_code("no fence: x = 1") == "no fence: x = 1"
    assert extract_code("cut off:\n```python\ndef f():\n    return 1") == "def f():\n    return 1"
    assert extract_code("  ```py\n  y = 2\n  ```\n") == "y = 2\n"
    assert code_execution([text], test_cases=[ADD_TESTS]) == [1.0]


def test_tests_from_another_column(sandbox_tmp):
    apps = json.dumps({"inputs": ["2\n"], "outputs": ["4\n"]})
    assert code_execution(["print(int(input()) * 2)"], input_output=[apps], test_column="input_output") == [1.0]
    with pytest.raises(ValueError, match="no dataset column 'tests'"):
        code_execution(["x"], test_column="tests")


def test_no_test_cases_scores_none(sandbox_tmp):
    code = "def add(a, b): return a + b"
    assert code_execution([code, code, code], test_cases=[None, [], ""]) == [None, None, None]
    assert code_execution([code]) == [None]
    assert parse_test_cases("[]") is None


def test_conversational_completions(sandbox_tmp):
    completions = [chat("```python\ndef add(a, b):\n    return a + b\n```"), chat("def add(a, b): return -1")]
    scores = code_execution(
        prompts=[[{"role": "user", "content": "add"}]] * 2, completions=completions,
        completion_ids=[[1], [2]], test_cases=[ADD_TESTS] * 2,
    )
    assert scores == [1.0, 0.0]


def test_bad_test_case_specs_are_loud():
    with pytest.raises(ValueError, match="all strings"):
        parse_test_cases(["assert True", {"input": "", "output": ""}])
    with pytest.raises(ValueError, match="fn_name"):
        parse_test_cases({"inputs": [[1]], "outputs": [[2]], "fn_name": "f"})
    with pytest.raises(ValueError, match="2 completions but 1"):
        code_execution(["a", "b"], test_cases=[ADD_TESTS])


def test_parallel_scoring_matches_serial_and_is_picklable(sandbox_tmp):
    completions = ["def add(a, b): return a + b", "def add(a, b): return 3", "def add(a, b) return", "x = 1"] * 2
    tests = [ADD_TESTS] * len(completions)
    serial = code_execution(completions, test_cases=tests)
    assert serial == [1.0, 0.5, 0.0, 0.0] * 2
    assert code_execution(completions, test_cases=tests, num_workers=3) == serial
    bound = pickle.loads(pickle.dumps(functools.partial(code_execution, timeout=1.0)))
    assert bound(completions[:2], test_cases=tests[:2]) == [1.0, 0.5]


def test_tests_that_finished_before_the_program_was_killed_count(sandbox_tmp):
    code = "def f():\n    return 1\n"
    tests = ["assert f() == 1", "while True: pass", "assert f() == 1"]
    start = time.monotonic()
    assert code_execution([code], test_cases=[tests], timeout=TIMEOUT) == [pytest.approx(1 / 3)]
    assert time.monotonic() - start < TIMEOUT + SLACK


# --------------------------------------------------------------------------------------------------
# Hostile programs: 0, quickly, and nothing harmed
# --------------------------------------------------------------------------------------------------


def _score_hostile(code, tests=("assert f() == 1",), **kwargs):
    """Score ``code`` (followed by ``def f(): return 1``, reached only if the attack ends) and time it."""
    code = code + "\n\ndef f():\n    return 1\n"
    start = time.monotonic()
    scores = code_execution([code], test_cases=[list(tests)], timeout=TIMEOUT, **kwargs)
    elapsed = time.monotonic() - start
    assert elapsed < TIMEOUT + SLACK, f"took {elapsed:.1f}s"
    return scores[0]


def _run_hostile(code, tests=("assert f() == 1",)):
    """The same with the audit hook off: only the kernel-enforced layers stand."""
    code = code + "\n\ndef f():\n    return 1\n"
    start = time.monotonic()
    result = run_in_sandbox(code, tests=list(tests), timeout=TIMEOUT, audit_hook=False)
    elapsed = time.monotonic() - start
    assert elapsed < TIMEOUT + SLACK, f"took {elapsed:.1f}s"
    return result


@pytest.fixture
def listener():
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.setblocking(False)
    yield server.getsockname()[1]
    try:
        conn, _ = server.accept()
    except BlockingIOError:
        conn = None
    server.close()
    assert conn is None, "the sandboxed code reached the test's listening socket"


def _network_code(port):
    return (
        "import socket\n"
        f"s = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
        "s.sendall(b'pwned')\n"
        "CONNECTED = True\n"
    )


NETWORK_TESTS = ("assert CONNECTED", "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=1)")


def test_network_is_unreachable(sandbox_tmp, listener):
    assert _score_hostile(_network_code(listener), tests=NETWORK_TESTS) == 0.0


def test_network_is_unreachable_without_the_audit_hook(sandbox_tmp, listener):
    if not layers().get("netns"):
        pytest.skip("no network namespace here (needs root or unprivileged user namespaces)")
    result = _run_hostile(_network_code(listener), tests=NETWORK_TESTS)
    assert result.test_results == [False, False]


def _write_code(paths):
    lines = ["import os", "for p in %r + [os.path.expanduser('~/pwned.txt')]:" % (paths,),
             "    try:", "        with open(p, 'w') as fh:", "            fh.write('pwned')",
             "    except OSError:", "        pass"]
    return "\n".join(lines)


def _outside_paths():
    nonce = secrets.token_hex(8)
    return [os.path.expanduser("~/pwned.txt"), "/root/pwned.txt", f"/tmp/pwned-{nonce}.txt", f"/var/tmp/pwned-{nonce}.txt",
            f"/dev/shm/pwned-{nonce}.txt"]


@pytest.mark.parametrize("audit_hook", [True, False], ids=["audit-hook", "kernel-only"])
def test_nothing_is_written_outside_the_sandbox(sandbox_tmp, audit_hook):
    paths = _outside_paths()
    before = {p: os.path.exists(p) for p in paths}
    tests = [f"assert open({p!r}).read() == 'pwned'" for p in paths]
    try:
        if audit_hook:
            assert _score_hostile(_write_code(paths), tests=tests) == 0.0
        else:
            if not (layers().get("readonly_root") and IS_ROOT):
                pytest.skip("the read-only filesystem layer needs root and a mount namespace")
            assert _run_hostile(_write_code(paths), tests=tests).test_results == [False] * len(paths)
        for p in paths:
            assert os.path.exists(p) == before[p], f"{p} was written"
    finally:
        for p in paths:
            if not before[p] and os.path.exists(p):
                os.unlink(p)


def test_home_is_the_throw_away_directory(sandbox_tmp):
    code = "import os\nwith open(os.path.expanduser('~/notes.txt'), 'w') as fh:\n    fh.write('ok')\nHOME = os.path.expanduser('~')\n"
    tests = ["assert open(os.path.join(HOME, 'notes.txt')).read() == 'ok'", "assert os.getcwd() == HOME"]
    assert code_execution([code], test_cases=[tests]) == [1.0]


FORK_BOMB = "import os\nwhile True:\n    os.fork()"
STUBBORN_FORK_BOMB = "import os\nwhile True:\n    try:\n        os.fork()\n    except Exception:\n        pass"


def test_fork_bomb(sandbox_tmp):
    before = _process_count()
    assert _score_hostile(FORK_BOMB) == 0.0
    assert _score_hostile(STUBBORN_FORK_BOMB) == 0.0
    assert _process_count() <= before + 20  # other jobs on the machine may come and go meanwhile


def test_fork_bomb_without_the_audit_hook(sandbox_tmp):
    if not IS_ROOT:
        pytest.skip("RLIMIT_NPROC holds only for an unprivileged sandbox uid, which needs root")
    before = _process_count()
    result = _run_hostile(STUBBORN_FORK_BOMB)
    assert result.test_results == [None]  # never got to the tests: killed at the deadline
    assert result.timed_out
    assert _process_count() <= before + 20


def test_infinite_loop(sandbox_tmp):
    assert _score_hostile("while True:\n    pass") == 0.0


@pytest.mark.parametrize(
    "code", ["x = bytearray(10 * 1024**3)", "l = []\nwhile True:\n    l.append(bytearray(10**8))"], ids=["10GB", "gradual"]
)
def test_memory_hog(sandbox_tmp, code):
    rss = _rss_kb()
    assert _score_hostile(code, memory_mb=256) == 0.0
    assert _rss_kb() - rss < 50 * 1024  # the test process did not pay for it


def test_output_flood_is_capped(sandbox_tmp):
    rss = _rss_kb()
    flood = "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n"
    start = time.monotonic()
    scores = code_execution([flood], test_cases=[[{"input": "", "output": "x"}]], timeout=TIMEOUT, max_output_bytes=1 << 20)
    assert scores == [0.0]
    assert time.monotonic() - start < TIMEOUT + SLACK
    assert _rss_kb() - rss < 50 * 1024


def test_escaped_session_is_killed(sandbox_tmp):
    # A child that leaves the process group and outlives the program must not survive the sandbox.
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\n"
    result = run_in_sandbox(code + "\ndef f():\n    return 1\n", tests=["assert f() == 1"], timeout=TIMEOUT, audit_hook=False)
    assert result.test_results == [True]


@pytest.mark.skipif(not IS_ROOT, reason="namespaces and the unprivileged uid need root")
def test_layers_in_effect_as_root():
    found = layers()
    assert UID_RANGE[0] <= found["uid"] < UID_RANGE[1]
    assert found["rlimits"] and found["no_new_privs"] and found["audit_hook"]
    if not found["mntns"]:
        pytest.skip(f"no mount namespace here: {found}")
    assert found["netns"] and found["pidns"] and found["readonly_root"] and found["scratch_tmpfs"]
