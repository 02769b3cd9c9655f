"""The judge: a program's assertion tests run in an interpreter that the program's code cannot reach.

The sandbox runs the program in one process and its tests in another (the *judge*; see
``runner``). The judge never holds one of the program's objects. What the program hands
over, it hands over as plain data, copied through a pipe and rebuilt in the judge from the judge's
own types; so ``==``, ``<``, ``bool()``, ``hash()``, ``AssertionError`` and ``exec`` in a test are
the judge's, and a test's verdict is decided where the program cannot reach (a separate process,
not ptrace-able, invisible in the program's PID namespace, holding the only result descriptor).

How a test sees the program. After the program has run, each of its global names becomes, in the
test's namespace (:class:`TestNamespace`), read again whenever the program has run since it was
last read (a test that calls ``push(1)`` and then reads the program's global ``stack`` sees ``[1]``):

- plain data (``None``, ``bool``, ``int``, ``float``, ``complex``, ``str``, ``bytes``, ``bytearray``,
  ``list``, ``tuple``, ``dict``, ``set``, ``frozenset``, ``range``, and from the standard library
  ``Fraction``, ``Decimal``, ``Counter``, ``OrderedDict``, ``defaultdict``, ``deque``, named tuples,
  ``date``/``datetime``/``time``/``timedelta``): a copy. Subclasses of these become the base type
  (an ``int`` subclass whose ``__eq__`` lies arrives as the plain ``int`` it holds);
- a module: the judge's own import of the module of that name, never the program's module
  object, and only from a short list (:data:`JUDGE_IMPORTS`; with site-packages also
  :data:`SITE_PACKAGES_IMPORTS`), imported with a neutral argv, working directory and HOME and
  ``sys.path`` restored after (:func:`.judge_imports.import_for_the_tests`): never a command-line tool's
  ``__main__``. Another standard-library name, or one the judge cannot import, fails the test that
  reads the module (``types.ModuleType("math.forged")``, ``types.ModuleType("unittest.__main__")``);
- anything else (functions, classes, instances of the program's classes, generators): a
  :class:`.judge_protocol.Remote` reference. Calling it, reading its attributes, iterating it, ``len``, indexing,
  ``str`` and ``repr`` are done by the program and answered, again, as plain data or as
  references. A reference has no truth value and no equality or order: ``bool(ref)``, ``ref == x``,
  ``ref < x`` raise TypeError, so an object of the program cannot decide a comparison or an
  ``assert`` (an always-equal object fails the test).

Names that are dunders or the names of builtins (``abs``, ``len``, ``isinstance``,
``AssertionError``, ...) are not taken from the program: a test's builtins are the judge's. A
program global named like a standard-library module through which a test reads one of that module's
attributes (``math`` in ``math.isclose(...)``, relying on the program's ``import math``) is the
judge's own module, whatever the program bound to that name: a module, a named tuple whose
``isclose`` is the program's function, any object. (A name through which tests read only attributes
the module lacks is the program's: ``queue.append`` on its list ``queue``.)

A task handed over by name, HumanEval's ``check(sum)`` (a top-level call of a function the tests
define, with a bare name), is the program's global of that name even where the name is a builtin's
or a module's: an empty program fails ``check(sum)`` instead of passing with the judge's ``sum``.

What the program prints while it serves the tests (``print``, ``sys.stdout.write``) is printed again
in the judge, with the judge's ``builtins.print`` and to its ``sys.stdout`` as the test has them: a
test that redirects ``sys.stdout`` or patches ``builtins.print`` sees what the program printed.

A test that may run the program's text as code in the judge (its syntax tree reads ``eval``,
``getattr``, ``vars``, a dunder, a module off :data:`.judged_apart.PLAIN_MODULES` such as ``pickle``, ``operator``
or ``sympy``, or a name an earlier test bound to one: :func:`.judged_apart.judged_apart`) runs in a child of the
judge forked for it, which reports its verdict to the judge and holds no result descriptor: the
program's code, once it runs there, decides that test only. (The last test runs in the judge
itself: every other verdict is written by then.)

What the judge hands to the program (the arguments a test passes, the values its callbacks return)
leads nowhere into the judge's interpreter (:func:`.judge_values.leads_into_the_interpreter`): plain data goes
as copies, modules by name only (the program's side imports its own), and the judge refuses to hand
over frames, code objects, tracebacks and cells (a generator's ``gi_frame``, whatever the attribute
is called), the globals of a module or of the tests, the builtins that reach attributes,
namespaces or code by a name or text (``getattr``, ``vars``, ``eval``, ``str.format``, ...) and the
functions of the modules that reach frames, objects or descriptors (``sys``, ``gc``, ``inspect``,
``os``, ``io``, ``pickle``, ...). Any other object of a test (a function, a generator, an instance
of a test's class) goes as a reference the program may call, iterate and read, never write
(call-only: a checker's verdict or a log's method stays the test's), except the data attributes
of a plain record, an instance of a test's class with no methods of its own and no ``__call__``
(a linked list's node, which a program relinks).

What remains in the program's hands, by construction: whatever a test asks the program itself. A
test that calls a second function of the program (HumanEval's ``poly`` in ``find_zero``'s test,
``encode_cyclic`` in ``decode_cyclic``'s) trusts that function's answer; ``str(obj)``, ``len(obj)``
and iteration of a program object are the program's. Arguments are copied too: a test that relies
on a function mutating its argument in place sees the unchanged copy.

Wire format: each message is a 4-byte big-endian length and that many bytes of JSON. A value is
encoded as JSON ``null``/``true``/``false``/string/number for ``None``/``bool``/``str``/``int``
(64-bit)/``float``, else as an array whose first element names its type (``["l", ...]`` a list,
``["i", "1f"]`` a large int in hex, ``["R", 3]`` the sender's object number 3, ``["H", 3]`` the
receiver's own object number 3, ...). Requests are ``["call", h, args, kwargs]``, ``["getattr", h,
name]``, ``["setattr", h, name, value]``, ``["iter", h]``, ``["next", h, n]``, ``["len", h]``,
``["getitem", h, key]``, ``["setitem", h, key, value]``, ``["delitem", h, key]``, ``["str", h]``,
``["repr", h]``, and from the judge only ``["global", name]`` (the program global's current value);
answers ``["ok", value]``, ``["raise", type_name, args, message]`` or, for ``next``, ``["items",
[values], end]``; and from the program, unanswered, what it printed: ``["output", [...]]`` of
``["print", args, kwargs]`` (``sep``/``end`` only) and ``["write", text]``. A module is ``["M",
name, h]``, ``h`` being -1 from the judge (no reference).
Both sides may send requests (a test may pass a function of its own to the program); a side
waiting for an answer serves the other's requests meanwhile.

The program side of this module runs in the program's interpreter and may be tampered with by the
program: nothing the judge concludes depends on it behaving. The judge side checks every message
and treats anything malformed as the program having gone away (its remaining tests fail).

Standard library only; importable by any Python >= 3.8.
"""

import builtins
import os
import sys

from .judge_imports import JUDGE_IMPORTS, ModuleNotImported, ModuleOnFirstUse, import_for_the_tests
from .judge_protocol import ProgramGone, global_value
from .judged_apart import judged_apart


def serve_program(endpoint, namespace):
    """Program side: announce the program's globals, then answer the judge until it hangs up (the
    judge asks again for a global it reads after the program ran: see :class:`TestNamespace`)."""
    endpoint.namespace = namespace
    names = []
    for name, value in list(namespace.items()):
        if type(name) is not str or (name.startswith("__") and name.endswith("__")):
            continue
        names.append([name, global_value(endpoint, value)])
    _print_to_the_judge(endpoint)
    try:
        endpoint.send(["ready", names])
        while True:
            endpoint.answer(endpoint.receive())
    except ProgramGone:
        return


class _StdoutToTheJudge:
    """The program's ``sys.stdout`` while it serves the tests: what it writes goes to the judge's."""

    def __init__(self, endpoint, real):
        self._endpoint, self._real = endpoint, real

    def write(self, text):
        if type(text) is not str:
            raise TypeError("write() argument must be str, not %s" % type(text).__name__)
        self._endpoint.queue_output(["write", text])
        return len(text)

    def writelines(self, lines):
        for line in lines:
            self.write(line)

    def flush(self):
        pass

    def isatty(self):
        return False

    def writable(self):
        return True

    def __getattr__(self, name):  # encoding, fileno, buffer...: the real stream's
        return getattr(self._real, name)


def _print_to_the_judge(endpoint):
    """Program side: while the program serves the tests, its ``print`` and ``sys.stdout`` send what
    it prints to the judge (see ``Endpoint._show_output``); a print to another file is its own."""
    real_print, stdout = builtins.print, _StdoutToTheJudge(endpoint, sys.stdout)

    def print(*args, **kwargs):  # noqa: A001 - the program's print
        file = kwargs.pop("file", None)
        kwargs.pop("flush", None)
        if file is None:
            file = sys.stdout
        if file is not stdout:
            return real_print(*args, file=file, **kwargs)
        unknown = set(kwargs) - {"sep", "end"}
        if unknown:
            raise TypeError("%r is an invalid keyword argument for print()" % unknown.pop())
        for key, value in kwargs.items():
            if value is not None and not isinstance(value, str):
                raise TypeError("%s must be None or a string, not %s" % (key, type(value).__name__))
        endpoint.queue_output(["print", endpoint.encode(args),
                               endpoint.encode({k: None if v is None else str.__str__(v) for k, v in kwargs.items()})])

    builtins.print, sys.stdout = print, stdout


class TestNamespace(dict):
    """The tests' globals: the judge's builtins and what the tests define, and the program's globals
    read live.

    A program global is not stored here: reading it (``__missing__``) gives its value as of the last
    time the program ran, asking the program again when it has run since (a call, an attribute, an
    iteration...): a test that calls ``push(1)`` and then reads the program's global ``stack``
    sees ``[1]``. A test that assigns the name has its own value from then on. Builtins are stored
    here, so that reading one costs no call.
    """

    def __init__(self, endpoint):
        super().__init__((k, v) for k, v in builtins.__dict__.items() if not k.startswith("__"))
        self["__name__"], self["__builtins__"], self["__doc__"] = "__main__", builtins, None
        self._endpoint = endpoint
        self._program_globals = {}  # name -> (value, endpoint.program_ran when it was read)

    def add_program_global(self, name, value):
        self._program_globals[name] = (value, self._endpoint.program_ran)

    def __missing__(self, name):
        if name not in self._program_globals:
            raise KeyError(name)
        value, when = self._program_globals[name]
        if when != self._endpoint.program_ran:  # the program ran since: read it again
            value = self._endpoint.request(["global", name])
            self._program_globals[name] = (value, self._endpoint.program_ran)
        return value


def _attributes_read(name, tests):
    """The attribute names that some test reads of the global ``name`` (``name.attr``, spaces allowed
    around the dot), as written in the tests' text."""
    found = set()
    for test in tests:
        start = test.find(name)
        while start >= 0:
            end = start + len(name)
            before = test[start - 1] if start else " "
            if not (before.isalnum() or before in "_."):
                i = end
                while test[i:i + 1] in (" ", "\t"):
                    i += 1
                if test[i:i + 1] == ".":
                    i += 1
                    while test[i:i + 1] in (" ", "\t"):
                        i += 1
                    attr_start = i
                    while i < len(test) and (test[i].isalnum() or test[i] == "_"):
                        i += 1
                    if i > attr_start:
                        found.add(test[attr_start:i])
            start = test.find(name, end)
    return found


_PLAIN_TYPES = (type(None), bool, int, float, complex, str, bytes, bytearray, list, tuple, dict, set, frozenset)


def _standard_module_for(name, value, tests, modules_allowed, imports_allowed):
    """The judge's own module for a program global named like an importable module (the standard
    library's, or with site-packages any) when a test reads one of that module's attributes through
    it (``math.isclose``, relying on the program's ``import math``), whatever the program bound to
    the name: a module, a named tuple, a ``types.ModuleType("math.forged")``. A module the judge
    cannot import, or does not import for the tests (not on its list), fails the test that reads it.
    None when the name is the program's own (the test reads attributes the module does not have:
    ``queue.append`` on the program's list ``queue``; or, for a module off the list, the program
    bound plain data to the name)."""
    if not modules_allowed(name):
        return None
    read = _attributes_read(name, tests)
    if not read:
        return None
    if not imports_allowed(name):  # not imported for the tests under this name: what the program bound to it
        # stays, if it is plain data or a module (which the judge decoded as its own, or as one that
        # fails); anything else of the program's in a module's place fails the tests that read it
        return None if type(value) in _PLAIN_TYPES or isinstance(value, type(sys)) else ModuleNotImported(name)
    try:
        module = import_for_the_tests(name)
    except Exception:  # noqa: BLE001 - not importable here: no stand-in either
        return ModuleOnFirstUse(name)
    if isinstance(value, type(sys)) or any(hasattr(module, attr) for attr in read):
        return module
    return None


def _functions_defined(tests):
    """Names the tests define as top-level functions (``def check(candidate):``)."""
    names = set()
    for test in tests:
        for line in test.split("\n"):
            if line.startswith("def "):
                name = line[4:].partition("(")[0].strip()
                if name.isidentifier():
                    names.add(name)
    return names


def _answered_by_the_judge(name):
    """Whether the judge would answer ``name`` with an object of its own: a builtin, or a module."""
    stdlib = getattr(sys, "stdlib_module_names", JUDGE_IMPORTS)
    return hasattr(builtins, name) or name in stdlib or name in sys.builtin_module_names


def handing_over_the_programs_task(test, functions):
    """``test`` with each top-level ``check(name)`` (a function the tests define, called with a bare
    name: HumanEval's way of handing the task's function over) reading ``name`` from the program
    (``check(__program_global__('sum'))``) where the judge would otherwise answer with its own
    object: a task named like a builtin or a module is the program's or missing, never the judge's
    ``sum`` (with which an empty program would pass). Other lines are unchanged."""
    lines = test.split("\n")
    changed = False
    for i, line in enumerate(lines):
        call = line.rstrip()
        if not call.endswith(")") or call[:1].isspace():
            continue
        function, paren, argument = call[:-1].partition("(")
        function, argument = function.strip(), argument.strip()
        if (paren and function in functions and argument.isidentifier() and argument not in functions
                and _answered_by_the_judge(argument)):
            lines[i] = "%s(__program_global__(%r))" % (function, argument)
            changed = True
    return "\n".join(lines) if changed else test


#: Standard-library modules whose functions compute on the data they are given: none of them runs,
#: imports or unpickles a text or bytes it is handed, or reaches an attribute, a name or a
#: descriptor the text chooses (what their attributes lead to is checked too: ``typing.sys`` is
#: ``sys``); of ``operator``, only the plain operations (``operator.add``, ``itemgetter``; not
#: ``attrgetter`` or ``methodcaller``, which reach attributes by a name). A test using any other



def _run_one(test, i, namespace, endpoint):
    """Run one test in ``namespace``: whether it passed (ran to its end, the program still answering)."""
    try:
        exec(compile(test, "<test %d>" % i, "exec"), namespace)
        passed = True
    except BaseException:  # noqa: BLE001 - any failure, ProgramGone included, fails the test
        passed = False
    return passed and not endpoint.dead


def _flush_standard_streams():
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001
            pass


def _run_one_in_a_child(test, i, namespace, endpoint, close_in_child):
    """Run one test in a child of the judge (forked after the setup: the namespace is copied), which
    tells the judge its verdict through a pipe of its own and holds no descriptor the judge writes
    results to (``close_in_child``): a test that runs the program's code (``eval`` of its text,
    ``pickle.loads`` of its bytes) can make its own verdict, and that of no other test. Returns
    (passed, channel still up)."""
    verdict_read, verdict_write = os.pipe()
    try:
        child = os.fork()
    except OSError:
        os.close(verdict_read)
        os.close(verdict_write)
        return False, True
    if child == 0:  # the test's own process
        try:
            os.close(verdict_read)
            for fd in close_in_child:
                try:
                    os.close(fd)
                except OSError:
                    pass
            passed = _run_one(test, i, namespace, endpoint)
            _flush_standard_streams()
            verdict = b"x" if endpoint.dead else b"1" if passed else b"0"
            os.write(verdict_write, verdict + b"%d" % len(endpoint.exports))
        finally:
            os._exit(0)
    os.close(verdict_write)
    try:  # one write: what the test's process leaves running cannot stall this
        verdict, exported = os.read(verdict_read, 32), b""
        verdict, exported = verdict[:1], verdict[1:]
    except OSError:
        verdict = b""
    finally:
        os.close(verdict_read)
    # The numbers of the objects the child handed over are never used again (the program keeps the
    # references it holds, and their state: an iterator it ran to its end stays ended).
    if exported.isdigit() and len(endpoint.exports) < int(exported) <= 1 << 20:
        endpoint.exports.extend([None] * (int(exported) - len(endpoint.exports)))
    try:
        os.kill(child, 9)  # SIGKILL: nothing of the test's process outlives its verdict
    except OSError:
        pass
    while True:
        try:
            os.waitpid(child, 0)
            break
        except InterruptedError:
            continue
        except ChildProcessError:
            break
    endpoint.program_ran += 1  # the program ran for the child: the judge reads its globals again
    return verdict == b"1", verdict in (b"0", b"1")


def judge_tests(endpoint, tests, report, when_ready=None, trusting_tests_apart=False, close_in_child=()):
    """Judge side: build the tests' namespace from the program's globals, run each test, report it.

    ``report(i, passed)`` is called once per test that ran. A test passes when it runs to the end
    without raising and the program is still answering. ``when_ready()`` is called once the program
    has run (its sandbox is set up). With ``trusting_tests_apart``, a test that may run the
    program's text as code (:func:`judged_apart`: ``eval``, ``pickle.loads``, ``sympy``, ...) runs
    in a child of the judge forked for it (:func:`_run_one_in_a_child`), unless it is the last (it
    runs after every other verdict is written: it can forge nothing but its own either): whatever
    the program's code does there, it decides that test only. Such a test starts from the namespace
    as the tests before it left it, and what it defines is not seen by the tests after it; the other
    tests share one namespace, in order. Returns whether every test ran.
    """
    try:
        ready = endpoint.receive()
        if ready[0] != "ready" or len(ready) != 2 or type(ready[1]) is not list:
            endpoint._protocol_error("expected the program's globals")
        namespace = TestNamespace(endpoint)
        announced = set()
        for entry in ready[1]:
            if type(entry) is not list or len(entry) != 2 or type(entry[0]) is not str:
                endpoint._protocol_error("a malformed global")
            name = entry[0]
            announced.add(name)
            if (name.startswith("__") and name.endswith("__")) or hasattr(builtins, name):
                continue  # dunders and builtins stay the judge's own
            value = endpoint.decode(entry[1])
            module = _standard_module_for(name, value, tests, endpoint.modules_allowed, endpoint.imports_allowed)
            if module is not None:
                namespace[name] = module  # fixed: never read from the program again
            else:
                namespace.add_program_global(name, value)
    except ProgramGone:
        return False
    def program_global(name):
        """The program's own global ``name``, whatever the judge has under that name."""
        if type(name) is not str or name not in announced:
            raise NameError("the program defines no %r" % (name,))
        return endpoint.request(["global", name])

    namespace["__program_global__"] = program_global
    functions = _functions_defined(tests)
    tests = [handing_over_the_programs_task(test, functions) for test in tests]
    bindings = {}  # the tests' top-level names, for judged_apart
    if when_ready is not None:
        when_ready()
    for i, test in enumerate(tests):
        if endpoint.dead:
            return False
        if not announced:  # an empty program passes no test, whatever the tests answer by themselves
            report(i, False)
            continue
        if trusting_tests_apart and i < len(tests) - 1 and judged_apart(test, bindings):
            passed, channel_up = _run_one_in_a_child(test, i, namespace, endpoint, close_in_child)
            if not channel_up:
                endpoint.dead = True
        else:
            passed = _run_one(test, i, namespace, endpoint)
        report(i, passed and not endpoint.dead)
    return not endpoint.dead
