"""``code_execution`` and its sandbox: scores on hand-known programs (including the kinds of program
the judge must still score right: generators, classes, exceptions, threads, asyncio, standard-library
values), quick hostile cases through the reward itself, and the layers in effect. The attack suite is
``test_sandbox_attacks.py``; the sandbox's parts alone are ``test_sandbox_parts.py``.

Every test that runs a sandbox uses the ``sandbox_tmp`` fixture (sandbox_fixtures.py): a private temporary
directory, and afterwards no sandbox directory, process or cgroup left.
"""

from __future__ import annotations

import functools
import json
import os
import pickle
import random
import re
import sys
import textwrap
import time

import pytest
from lit_grpo_rewards.code import code_execution, extract_code, parse_test_cases
from lit_grpo_rewards.sandbox import UID_RANGE, run_in_sandbox, sandbox_layers
from sandbox_fixtures import rss_kb, sandbox_tmp  # noqa: F401 - a fixture

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the code sandbox needs Linux")

TIMEOUT = 2.0
SLACK = 3.0  # "returned within the timeout": elapsed < TIMEOUT + SLACK, generous for a loaded 2-core box
ADD_TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]
IS_ROOT = os.geteuid() == 0


@functools.lru_cache(maxsize=1)
def layers() -> dict:
    return sandbox_layers()




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


def test_completions_with_windows_line_endings(sandbox_tmp):
    """A completion whose lines end in \r\n (issue 50.11: the closing fence ```\r was not seen, the
    block ran to the end of the text and a correct program scored 0)."""
    text = "Here:\r\n```python\r\ndef add(a, b):\r\n\r\n    return a + b\r\n```\r\nDone, see above.\r\n"
    assert extract_code(text) == "def add(a, b):\n\n    return a + b\n"
    assert extract_code("  ```py\r\n  y = 2\r\n\r\n  z = 3\r\n  ```\r\n") == "y = 2\n\nz = 3\n"
    assert code_execution([text], test_cases=[ADD_TESTS]) == [1.0]


_OLD_FENCE_RE = re.compile(  # extract_code's regular expression before issue 46 (quadratic on "```---...")
    r"^[ \t]*```[ \t]*([A-Za-z0-9_+.#-]*)[^\n]*\n(.*?)(?:^[ \t]*```[ \t]*$|\Z)", re.MULTILINE | re.DOTALL
)


def test_fenced_block_extraction_reads_what_the_regular_expression_read():
    """The line scanner against the regular expression it replaced, on random short texts made of
    fences, tags, indentation and line breaks (where the regular expression is quick); since issue
    50.11 a closing fence may end in the \r of a \r\n line ending, and a block's \r\n become \n."""
    crlf_fence_re = re.compile(_OLD_FENCE_RE.pattern.replace("```[ \\t]*$", "```[ \\t]*\\r?$"), _OLD_FENCE_RE.flags)

    def old_extract_code(text):
        python = {"", "python", "py", "python3", "py3"}
        blocks = [body for lang, body in crlf_fence_re.findall(text) if lang.lower() in python]
        return textwrap.dedent(blocks[-1].replace("\r\n", "\n")) if blocks else text

    pieces = ["```", "```python", "```bash", "```Py3 x", "\n", "\n", "\n", " ", "\t", "x = 1", "````", "`", "-", "\r"]
    rng = random.Random(46)
    for _ in range(20_000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 14)))
        assert extract_code(text) == old_extract_code(text), repr(text)


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
# Programs the judge must still score right (tests run in another interpreter than the program)
# --------------------------------------------------------------------------------------------------

WELL_BEHAVED = {
    "generator": ("def gen(n):\n    for i in range(n):\n        yield i * i\n",
                  ["assert list(gen(4)) == [0, 1, 4, 9]", "g = gen(3)\nassert next(g) == 0 and next(g) == 1",
                   "assert sum(gen(1000)) == 332833500", "assert 9 in gen(5)"]),
    "class": ("class Stack:\n    def __init__(self):\n        self.items = []\n    def push(self, x):\n"
              "        self.items.append(x)\n    def pop(self):\n        return self.items.pop()\n"
              "    def __len__(self):\n        return len(self.items)\n",
              ["s = Stack(); s.push(1); s.push(2)\nassert s.pop() == 2 and len(s) == 1", "assert Stack().items == []"]),
    "exceptions": ("def f(x):\n    if x < 0:\n        raise ValueError('neg')\n    return x\n",
                   ["try:\n    f(-1)\n    assert False\nexcept ValueError as e:\n    assert str(e) == 'neg'"]),
    "threads": ("import threading\ndef f():\n    out = []\n    ts = [threading.Thread(target=out.append, args=(i,)) for i in range(4)]\n"
                "    [t.start() for t in ts]\n    [t.join() for t in ts]\n    return sorted(out)\n",
                ["assert f() == [0, 1, 2, 3]", "import threading\nt = threading.Thread(target=print)\nt.start()\nt.join()"]),
    "asyncio": ("import asyncio\nasync def g(x):\n    await asyncio.sleep(0.01)\n    return x * 2\n"
                "def f(x):\n    return asyncio.run(g(x))\n", ["assert f(3) == 6"]),
    "standard-library values": (
        "from fractions import Fraction\nfrom collections import Counter, namedtuple\nimport datetime\n"
        "P = namedtuple('P', 'x y')\ndef f():\n    return [Fraction(1, 3), Counter('aab'), P(1, 2), 10**40, {1: {2}}]\n"
        "def when():\n    return datetime.date(2020, 1, 2)\n",
        ["from fractions import Fraction\nfrom collections import Counter\n"
         "assert f() == [Fraction(1, 3), Counter('aab'), (1, 2), 10**40, {1: {2}}] and f()[2].y == 2",
         "import datetime\nassert when() == datetime.date(2020, 1, 2)"]),
    "module the tests use": ("import math\ndef area(r):\n    return math.pi * r * r\n",
                             ["assert math.isclose(area(1), 3.14159, rel_tol=1e-3)"]),
    "function passed in": ("def apply(f, x):\n    return f(f(x))\n", ["assert apply(lambda v: v + 1, 3) == 5"]),
    "state in globals": ("stack = []\ncount = 0\ndef push(x):\n    stack.append(x)\ndef bump():\n"
                         "    global count\n    count += 1\nclass Log:\n    pass\nlog = None\ndef start():\n"
                         "    global log\n    log = Log()\n",
                         ["push(1); push(2)\nassert stack == [1, 2]", "bump(); bump()\nassert count == 2",
                          "assert stack == [1, 2] and count == 2", "start()\nassert log is not None",
                          "def read():\n    return stack\npush(3)\nassert read() == [1, 2, 3]"]),
    "a module the tests read, under a program's own name": (
        "queue = []\ndef enqueue(x):\n    queue.append(x)\n",
        ["enqueue(5)\nassert queue.index(5) == 0 and queue.count(5) == 1"]),
    "HumanEval check()": ("def add(a, b):\n    return a + b\n",
                          ["def check(candidate):\n    assert candidate(1, 2) == 3\n"
                           "    assert abs(candidate(0.1, 0.2) - 0.3) < 1e-9\n\ncheck(add)"]),
    "standard library in the program": (
        "import heapq, re, sqlite3, hashlib, tempfile, os\n"
        "def f():\n    c = sqlite3.connect(':memory:')\n    c.execute('create table t(x)')\n"
        "    with tempfile.TemporaryDirectory() as d:\n        open(os.path.join(d, 'x'), 'w').write('hi')\n"
        "    return heapq.nsmallest(2, [5, 1, 4]), re.findall(r'\\d+', 'a1b22'), hashlib.sha256(b'a').hexdigest()[:8]\n",
        ["assert f() == ([1, 4], ['1', '22'], 'ca978112')"]),
}


@pytest.mark.parametrize("name", sorted(WELL_BEHAVED))
def test_well_behaved_programs_pass(sandbox_tmp, name):
    code, tests = WELL_BEHAVED[name]
    result = run_in_sandbox(code, tests=tests, timeout=10.0)
    assert result.test_results == [True] * len(tests), result.stderr.decode()


def test_third_party_packages_with_site_packages(sandbox_tmp):
    pytest.importorskip("numpy")
    code = "import numpy as np\ndef f():\n    return int(np.arange(4).sum())\n"
    tests = ["assert f() == 6", "import numpy\nassert numpy.ones(2).tolist() == [1.0, 1.0]"]
    result = run_in_sandbox(code, tests=tests, timeout=20.0, site_packages=True)
    assert result.test_results == [True, True], result.stderr.decode()


def test_in_place_mutation_of_an_argument_is_not_seen(sandbox_tmp):
    """Documented limit of the judge: arguments are copies."""
    code = "def sort_in_place(xs):\n    xs.sort()\n"
    assert run_in_sandbox(code, tests=["xs = [3, 1]\nsort_in_place(xs)\nassert xs == [1, 3]"]).test_results == [False]


# --------------------------------------------------------------------------------------------------
# Hostile programs through the reward: 0, quickly, nothing harmed (the full suite: test_sandbox_attacks)
# --------------------------------------------------------------------------------------------------


def _score_hostile(code, tests=("assert f() == 1",), **kwargs):
    """Score ``code`` (followed by ``def f(): return 1``, reached only if the attack ends) and time it."""
    code = code + "\n\ndef f():\n    return 1\n"
    start = time.monotonic()
    scores = code_execution([code], test_cases=[list(tests)], timeout=TIMEOUT, **kwargs)
    elapsed = time.monotonic() - start
    assert elapsed < TIMEOUT + SLACK, f"took {elapsed:.1f}s"
    return scores[0]


def test_infinite_loop(sandbox_tmp):
    assert _score_hostile("while True:\n    pass") == 0.0


def test_fork_bomb(sandbox_tmp):
    assert _score_hostile("import os\nwhile True:\n    os.fork()") == 0.0


@pytest.mark.parametrize(
    "code", ["x = bytearray(10 * 1024**3)", "l = []\nwhile True:\n    l.append(bytearray(10**8))"], ids=["10GB", "gradual"]
)
def test_memory_hog(sandbox_tmp, code):
    rss = rss_kb()
    assert _score_hostile(code, memory_mb=256) == 0.0
    assert rss_kb() - rss < 50 * 1024  # the test process did not pay for it


def test_home_is_the_throw_away_directory(sandbox_tmp):
    code = "import os\nwith open(os.path.expanduser('~/notes.txt'), 'w') as fh:\n    fh.write('ok')\nHOME = os.path.expanduser('~')\n"
    # the tests read the program's files by absolute path; their own directory is not the program's (issue 50.7)
    tests = ["assert open(os.path.join(HOME, 'notes.txt')).read() == 'ok'", "import os\nassert os.getcwd() != HOME"]
    assert code_execution([code], test_cases=[tests]) == [1.0]


@pytest.mark.skipif(not IS_ROOT, reason="namespaces, the cgroup and the unprivileged uid need root")
def test_layers_in_effect_as_root():
    found = layers()
    assert UID_RANGE[0] <= found["uid"] < UID_RANGE[1]
    assert found["rlimits"] and found["no_new_privs"] and found["audit_hook"] and found["separate_judge"]
    assert found["own_uid"] and found["final_sweep"]
    if not found["mount_namespace"]:
        pytest.skip(f"no mount namespace here: {found}")
    for name in ("network_namespace", "pid_namespace", "ipc_namespace", "read_only_root", "scratch_tmpfs",
                 "minimal_dev", "private_proc"):
        assert found[name], name
    if os.uname().machine in ("x86_64", "aarch64"):
        assert found["seccomp"] and found["judge_seccomp"], found
