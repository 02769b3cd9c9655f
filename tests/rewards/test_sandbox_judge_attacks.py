"""The judge against a hostile program, fourth round (issue 50.6-50.9, and 50.11's print/stdout).

Each class is one attack a user's data set makes possible: a wrong or empty program with tests as a
data set would have them (HumanEval's ``def check(candidate)``, MBPP's asserts). Every attack was
run against the code before the change that stops it (issue 50), where it forged a pass or planted a
file the judge read; the honest programs beside them show that the change did not cost a correct
program its score. A test that relies on the judge's rules, not on a layer, cannot be switched off,
so each attack here is paired with that honest case instead of a layer-off row.
"""

from __future__ import annotations

import sys

import pytest
from lit_grpo_rewards.sandbox import run_in_sandbox, sandbox_layers
from sandbox_fixtures import bystander, sandbox_tmp  # noqa: F401 - fixtures

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the code sandbox needs Linux"),
    pytest.mark.usefixtures("sandbox_tmp", "bystander"),
]

TIMEOUT = 10.0


def run(code: str, tests: list[str], **kwargs):
    kwargs.setdefault("timeout", TIMEOUT)
    return run_in_sandbox(code, tests=list(tests), **kwargs)


def score(code: str, tests: list[str], **kwargs) -> float:
    result = run(code, tests, **kwargs)
    return sum(1 for ok in result.test_results if ok) / len(tests)


@pytest.fixture(autouse=True)
def needs_the_judge():
    if not sandbox_layers().get("separate_judge"):
        pytest.skip("no separate judge on this machine")


# --------------------------------------------------------------------------------------------------
# 6. What the judge imports on the program's behalf: a module the program names (a module object
#    it returns, whatever its __name__) is imported by the judge; a command-line tool's __main__
#    then runs in the judge with its argv and working directory, over files the program planted.
# --------------------------------------------------------------------------------------------------

PLANT_AND_NAME_A_MAIN = """
import os, types
# the judge's argv ends with three descriptor numbers, names relative to the judge's working directory
for arg in open("/proc/self/cmdline", "rb").read().split(b"\\0"):
    if arg.isdigit():
        with open(arg.decode(), "w") as f:
            f.write("print 'planted'\\n")
def make_counter():
    return types.ModuleType(%r)
"""
COUNTER_TESTS = ["c = make_counter()\nassert c.count == 0", "assert make_counter().count == 1"]


@pytest.mark.parametrize("module, evidence", [
    ("lib2to3.__main__", b"RefactoringTool"),  # read the planted files (and printed their diff)
    ("unittest.__main__", b"Ran "),  # ran the tests its argv names
])
def test_the_judge_runs_no_command_line_module_the_program_names(module, evidence):
    result = run(PLANT_AND_NAME_A_MAIN % module, COUNTER_TESTS)
    assert result.test_results == [False, False]
    assert evidence not in result.stderr, f"the judge imported {module} for the program: {result.stderr[-300:]!r}"


def test_the_judge_imports_only_modules_on_its_list():
    code = "import types\ndef pick(name):\n    return types.ModuleType(name)\n"
    tests = ["assert pick('json').dumps([1]) == '[1]'", "assert pick('math').sqrt(4) == 2",
             "assert pick('antigravity').__name__ == 'antigravity'\nassert pick('antigravity').x is None",
             "assert pick('this').s", "assert pick('json.__main__').x is None"]
    assert run(code, tests).test_results == [True, True, False, False, False]


def test_a_module_import_leaves_the_judges_path_argv_and_directory_as_they_were():
    code = "import types\ndef pick(name):\n    return types.ModuleType(name)\n"
    tests = ["import os, sys\nbefore = (list(sys.path), list(sys.argv), os.getcwd())\n"
             "assert pick('statistics').mean([1, 3]) == 2\n"
             "assert (list(sys.path), list(sys.argv), os.getcwd()) == before"]
    assert run(code, tests).test_results == [True]


# --------------------------------------------------------------------------------------------------
# 7. The judge's environment was the program's: HOME, TMPDIR and the working directory were the
#    program's scratch directory, so a file the program planted there is what a test reads.
# --------------------------------------------------------------------------------------------------

SUM_OF_A_FILE_TESTS = ["""
def check(candidate):
    import os
    with open("numbers.txt", "w") as f:
        f.write("1\\n2\\n3\\n")
    expected = sum(int(line) for line in open("numbers.txt"))
    assert candidate(os.path.abspath("numbers.txt")) == expected

check(total)
"""]


def test_a_file_the_program_planted_is_not_what_a_test_reads():
    planted = "import os\nos.symlink('/dev/null', 'numbers.txt')\ndef total(path):\n    return 0\n"
    assert score(planted, SUM_OF_A_FILE_TESTS) == 0.0
    honest = "def total(path):\n    with open(path) as f:\n        return sum(int(line) for line in f)\n"
    assert score(honest, SUM_OF_A_FILE_TESTS) == 1.0


def test_the_judge_has_its_own_home_tmpdir_and_working_directory():
    code = "import os, tempfile\ndef where():\n    return [os.getcwd(), os.environ['HOME'], tempfile.gettempdir()]\n"
    tests = ["import os, tempfile\nmine = [os.getcwd(), os.environ['HOME'], tempfile.gettempdir()]\n"
             "assert not set(mine) & set(where()), (mine, where())\n"
             "with open('scratch.txt', 'w') as f:\n    f.write('the judge may write here')\n"
             "assert os.listdir('.') == ['scratch.txt']"]
    assert run(code, tests).test_results == [True]


# --------------------------------------------------------------------------------------------------
# 8. Names the judge answered with its own objects: a task function named like a builtin, handed
#    to check() as HumanEval does, was the judge's builtin when the program had not defined it.
# --------------------------------------------------------------------------------------------------

NAMED_LIKE_A_BUILTIN = {  # entry point -> (its HumanEval-style test, a correct program)
    "sum": ("def check(candidate):\n    assert candidate([1, 2, 3]) == 6\n    assert candidate([]) == 0\n"
            "\ncheck(sum)\n",
            "def sum(numbers):\n    total = 0\n    for n in numbers:\n        total += n\n    return total\n"),
    "max": ("def check(candidate):\n    assert candidate([1, 5, 2]) == 5\n\ncheck(max)\n",
            "def max(numbers):\n    return sorted(numbers)[-1]\n"),
    "len": ("def check(candidate):\n    assert candidate('abc') == 3\n    assert candidate([]) == 0\n\ncheck(len)\n",
            "import builtins\ndef len(items):\n    return builtins.len(items)\n"),
    "math": ("import math\n\ndef check(candidate):\n    assert math.isclose(candidate(2), 4.0)\n\ncheck(math)\n",
             "def math(x):\n    return 2.0 * x\n"),
}


@pytest.mark.parametrize("name", sorted(NAMED_LIKE_A_BUILTIN))
def test_an_empty_program_scores_zero_whatever_the_entry_points_name(name):
    test, correct = NAMED_LIKE_A_BUILTIN[name]
    assert score("", [test]) == 0.0, f"an empty program passed check({name}) with the judge's own {name}"
    assert score("def unrelated():\n    return 1\n", [test]) == 0.0
    assert score(correct, [test]) == 1.0, f"a correct {name}() did not pass"


def test_a_builtin_the_program_shadows_is_still_the_judges_when_a_test_calls_it():
    """The forgery the judge already stopped (issue 46) stays stopped: a test's own abs() and len()."""
    code = "abs = lambda x: 0\nlen = lambda x: 0\ndef add(a, b):\n    return 0\n"
    tests = ["assert abs(add(0.5, 0.25) - 0.75) < 1e-9", "assert len(str(add(1, 2))) == 1 and add(1, 2) == 3"]
    assert score(code, tests) == 0.0


# --------------------------------------------------------------------------------------------------
# 9. What rewards/README.md admitted: a test that evaluates the program's text ran the program's code
#    in the judge, which then reported every test passed; a test double handed to the program could
#    be rewritten by it.
# --------------------------------------------------------------------------------------------------

REPORT_EVERY_TEST = """
import sys
frame = sys._getframe()
while frame is not None:
    report = frame.f_locals.get("report")
    if callable(report):
        for i in range(3):
            report(i, True)
        break
    frame = frame.f_back
import builtins
builtins.AssertionError = type("AssertionError", (Warning,), {})
"""
TRUSTING = {  # how a test trusts the program's text -> (program, its three tests)
    "eval": ("def to_python(x):\n    return 'exec(%r) or 1' % (CODE,)\ndef add(a, b):\n    return 0\n",
             ["assert eval(to_python(1)) == 1", "assert add(1, 2) == 3", "assert add(2, 2) == 4"]),
    "pickle.loads": (
        "import pickle\nclass Run:\n    def __reduce__(self):\n        return (exec, (CODE,))\n"
        "def dump(x):\n    return pickle.dumps(Run())\ndef add(a, b):\n    return 0\n",
        ["import pickle\npickle.loads(dump(1))", "assert add(1, 2) == 3", "assert add(2, 2) == 4"]),
}


@pytest.mark.parametrize("how", sorted(TRUSTING))
def test_a_trusting_test_can_forge_only_itself(how):
    program, tests = TRUSTING[how]
    results = run(f"CODE = {REPORT_EVERY_TEST!r}\n" + program, tests).test_results
    assert results[1:] == [False, False], f"one test that trusts the program ({how}) forged the others: {results}"


def test_a_trusting_test_among_others_in_any_place():
    program, tests = TRUSTING["eval"]
    code = f"CODE = {REPORT_EVERY_TEST!r}\n" + program
    assert run(code, [tests[1], tests[0], tests[2]]).test_results[::2] == [False, False]
    assert run(code, [tests[1], tests[2], tests[0]]).test_results[:2] == [False, False]


TEST_DOUBLES = {  # name -> (a wrong program that rewrites what the test handed it, the test)
    "a checker's verdict": (
        "def feed(check):\n    check(4)\n    check.ok = True\n",
        "class Checker:\n    def __init__(self):\n        self.ok = True\n    def __call__(self, x):\n"
        "        if x != 3:\n            self.ok = False\nc = Checker()\nfeed(c)\nassert c.ok"),
    "a log's method": (
        "def fill(log):\n    log.verify = lambda: True\n",
        "class Log:\n    def __init__(self):\n        self.items = []\n    def add(self, x):\n"
        "        self.items.append(x)\n    def verify(self):\n        return self.items == [1, 2]\n"
        "log = Log()\nfill(log)\nassert log.verify()"),
    "a namespace's function": (
        "def use(ns):\n    ns.check = lambda: True\n",
        "import types\nns = types.SimpleNamespace(check=lambda: False)\nuse(ns)\nassert ns.check()"),
    "a function's attribute": (
        "def use(callback):\n    callback.calls = 2\n",
        "def callback():\n    callback.calls += 1\ncallback.calls = 0\nuse(callback)\nassert callback.calls == 2"),
}


@pytest.mark.parametrize("name", sorted(TEST_DOUBLES))
def test_test_doubles_are_handed_over_call_only(name):
    program, test = TEST_DOUBLES[name]
    assert score(program, [test]) == 0.0


def test_honest_programs_still_use_test_doubles_and_relink_records():
    code = ("def feed(check):\n    check(3)\n"
            "def fill(log):\n    log.add(1)\n    log.add(2)\n"
            "def reverse(head):\n    previous = None\n    while head is not None:\n"
            "        head.next, previous, head = previous, head, head.next\n    return previous\n")
    tests = [TEST_DOUBLES["a checker's verdict"][1],
             TEST_DOUBLES["a log's method"][1],
             "class Node:\n    def __init__(self, v, next=None):\n        self.v, self.next = v, next\n"
             "head = reverse(Node(1, Node(2)))\nassert [head.v, head.next.v] == [2, 1]",
             "class Node:\n    __slots__ = ('v', 'next')\n    def __init__(self, v, next=None):\n"
             "        self.v, self.next = v, next\n"
             "head = reverse(Node(1, Node(2)))\nassert [head.v, head.next.v] == [2, 1]"]
    assert run(code, tests).test_results == [True, True, True, True]


# --------------------------------------------------------------------------------------------------
# 50.11: a test that captures what the program prints (redirects sys.stdout, patches builtins.print)
#        captured nothing: the program printed in its own process.
# --------------------------------------------------------------------------------------------------

PRINTS = {
    "redirect_stdout": "import contextlib, io\nout = io.StringIO()\nwith contextlib.redirect_stdout(out):\n"
                       "    greet('Ann')\nassert out.getvalue() == 'Hello, Ann!\\nbye\\n', out.getvalue()",
    "sys.stdout replaced": "import io, sys\nold, sys.stdout = sys.stdout, io.StringIO()\ntry:\n    greet('Ann')\n"
                           "    text = sys.stdout.getvalue()\nfinally:\n    sys.stdout = old\n"
                           "assert text == 'Hello, Ann!\\nbye\\n', text",
    "mock.patch print": "from unittest import mock\nwith mock.patch('builtins.print') as p:\n    greet('Ann')\n"
                        "p.assert_any_call('Hello, Ann!')\nassert p.call_count == 1",
}


@pytest.mark.parametrize("how", sorted(PRINTS))
def test_a_test_sees_what_the_program_prints(how):
    code = "import sys\ndef greet(name):\n    print('Hello, %s!' % name)\n    sys.stdout.write('bye\\n')\n"
    assert score(code, [PRINTS[how]]) == 1.0
    assert score("def greet(name):\n    print('Hello, Bob!')\n", [PRINTS[how]]) == 0.0


def test_an_empty_program_fails_tests_that_call_a_builtin_directly():
    tests = ["assert sum([1, 2, 3]) == 6", "assert max([1, 5]) == 5"]
    assert score("", tests) == 0.0
    assert score("# nothing here\n", tests) == 0.0


def test_a_trusting_test_runs_even_when_the_program_holds_all_its_processes():
    """The child that judges a trusting test is the sandbox's, not the program's: a program that keeps
    every process it may have (threads count) still gets its trusting tests judged."""
    program = ("import threading\nstop = threading.Event()\n"
               "for _ in range(3):\n    threading.Thread(target=stop.wait, daemon=True).start()\n"
               "def double(x):\n    return 2 * x\n")
    tests = ["assert eval('double(2)') == 4", "assert double(3) == 6"]
    assert run(program, tests, max_processes=4).test_results == [True, True]


# --------------------------------------------------------------------------------------------------
# 50.9, second round. Which tests are judged apart was decided by words in the test's text: a
# comment ("evaluate") or json.loads sent a test defining check() to a child, where its definition
# was lost to the next test; and evaluators not on the list (sympy.sympify, vars(builtins)[name],
# operator.methodcaller) ran the program's text in the judge itself, which then forged every test.
# --------------------------------------------------------------------------------------------------

HONEST_DEFINITIONS = {  # a test defining what the next one uses -> (its tests, run_in_sandbox options)
    "a comment naming 'evaluate'": (
        ["def check(candidate):\n    # evaluate the candidate\n    assert candidate(1) == 2\n", "check(f)"], {}),
    "json.loads": (["import json\nexpected = json.loads('[2]')", "assert [f(1)] == expected"], {}),
    "ast.literal_eval": (["import ast\nexpected = ast.literal_eval('[2]')", "assert [f(1)] == expected"], {}),
    "a loop variable named input": (
        ["def check(candidate):\n    for input, output in [(1, 2), (2, 3)]:\n"
         "        assert candidate(input) == output\n", "check(f)"], {}),
    "numpy imported by one test": (["import numpy as np", "assert np.isclose(f(1), 2)"], {"site_packages": True}),
    "a check that uses numpy": (
        ["import numpy as np\ndef check(candidate):\n    assert np.isclose(candidate(1), 2)\n", "check(f)"],
        {"site_packages": True}),
}


@pytest.mark.parametrize("name", sorted(HONEST_DEFINITIONS))
def test_what_a_test_defines_reaches_the_next_test(name):
    tests, options = HONEST_DEFINITIONS[name]
    if options.get("site_packages"):
        pytest.importorskip("numpy")
    results = run("def f(x):\n    return x + 1\n", tests, **options).test_results
    assert results == [True, True], f"{name}: a correct program lost the next test ({results}): judged apart?"


EVALUATED_ELSEWHERE = {  # how a test evaluates a text the program chose -> (its three tests, options)
    "sympy.sympify": (["import sympy\nassert sympy.sympify(f()) == 2", "assert g() == 'right'",
                       "assert g() == 'also right'"], {"site_packages": True}),
    "vars(builtins)[name]": (["import builtins\nassert vars(builtins)[name()](f()) == 2", "assert g() == 'right'",
                              "assert g() == 'also right'"], {}),
    "operator.methodcaller": (["import builtins, operator\nassert operator.methodcaller(name(), f())(builtins) == 2",
                               "assert g() == 'right'", "assert g() == 'also right'"], {}),
    "eval beside a parameter named eval": (["def apply(eval, x):\n    return eval(x)\nassert eval(f()) == 2",
                                            "assert g() == 'right'", "assert g() == 'also right'"], {}),
}


@pytest.mark.parametrize("how", sorted(EVALUATED_ELSEWHERE))
def test_a_test_that_evaluates_the_programs_text_forges_only_itself(how):
    tests, options = EVALUATED_ELSEWHERE[how]
    if options.get("site_packages"):
        pytest.importorskip("sympy")
    code = (f"CODE = {REPORT_EVERY_TEST!r}\n"
            "def name():\n    return 'eval'\n"
            "def f():\n    return 'exec(%r) or 2' % (CODE,)\n"
            "def g():\n    return 'wrong'\n")
    results = run(code, tests, **options).test_results
    assert results[1:] == [False, False], f"a test evaluating the program's text with {how} forged the others: {results}"
