"""The judge: a program's assertion tests run in an interpreter that the program's code cannot reach.

The sandbox runs the program in one process and its tests in another (the *judge*; see
``_sandbox_runner``). The judge never holds one of the program's objects. What the program hands
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
  ``sys.path`` restored after (:func:`import_for_the_tests`): never a command-line tool's
  ``__main__``. Another standard-library name, or one the judge cannot import, fails the test that
  reads the module (``types.ModuleType("math.forged")``, ``types.ModuleType("unittest.__main__")``);
- anything else (functions, classes, instances of the program's classes, generators): a
  :class:`Remote` reference. Calling it, reading its attributes, iterating it, ``len``, indexing,
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
``getattr``, ``vars``, a dunder, a module off :data:`PLAIN_MODULES` such as ``pickle``, ``operator``
or ``sympy``, or a name an earlier test bound to one: :func:`judged_apart`) runs in a child of the
judge forked for it, which reports its verdict to the judge and holds no result descriptor: the
program's code, once it runs there, decides that test only. (The last test runs in the judge
itself: every other verdict is written by then.)

What the judge hands to the program (the arguments a test passes, the values its callbacks return)
leads nowhere into the judge's interpreter (:func:`leads_into_the_interpreter`): plain data goes
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

import binascii
import builtins
import os
import sys

HEADER_BYTES = 4
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
#: dunder attributes a side may read on the other's objects (plain strings; nothing reachable from them)
SAFE_DUNDERS = frozenset({"__name__", "__qualname__", "__doc__", "__module__"})
#: a program global larger than this (encoded) is handed to the tests as a reference, not a copy
GLOBAL_COPY_LIMIT = 1 << 16
MAX_CALL_DEPTH = 64  # nested calls from one side into the other and back
NAMEDTUPLE_TYPES_LIMIT = 256


def _json_codec():
    """(dumps, loads) for compact JSON, from the C accelerator ``_json`` when it is there.

    The ``json`` package imports ``re`` (and ``enum``, ``functools``, ...): milliseconds of start-up
    in every sandbox. Its C scanner and encoder need none of that; the package is the fallback.
    """
    try:
        import _json

        class Options:  # what the C scanner reads from a json.JSONDecoder
            strict = True
            object_hook = None
            object_pairs_hook = None
            parse_float = float
            parse_int = int
            parse_constant = float  # NaN, Infinity, -Infinity
            memo = {}

        scan = _json.make_scanner(Options())
        encode = _json.make_encoder(None, None, _json.encode_basestring_ascii, None, ":", ",", False, False, True)
        encode([0, "x", 1.5], 0)
    except Exception:  # noqa: BLE001 - another Python: the json package does the same
        import json

        return (lambda value: json.dumps(value, separators=(",", ":")),
                lambda text: json.loads(text))

    def dumps(value):
        return "".join(encode(value, 0))

    def loads(text):
        try:
            value, end = scan(text, 0)
        except StopIteration:
            raise ValueError("not JSON")
        if end != len(text):
            raise ValueError("trailing data after JSON")
        return value

    return dumps, loads


dumps, loads = _json_codec()


class ProgramGone(BaseException):
    """The program's side of the channel closed, broke the protocol or sent something malformed.

    A BaseException, so that a test's ``except Exception`` cannot swallow it; the judge fails the
    test during which it happened and does not run the rest.
    """


class ProgramError(Exception):
    """An exception raised in the other interpreter that the judge does not map to a builtin one."""


class Remote:
    """A reference to an object that lives in the other interpreter.

    Calls, attributes, iteration, ``len``, indexing, ``str`` and ``repr`` are answered by the
    other side. Truth value, equality and ordering are refused: on the judge's side they would
    let a program object decide a test.
    """

    __slots__ = ("_endpoint", "_handle", "_buffer", "_end", "_batch", "__weakref__")

    def __init__(self, endpoint, handle):
        object.__setattr__(self, "_endpoint", endpoint)
        object.__setattr__(self, "_handle", handle)
        object.__setattr__(self, "_buffer", [])
        object.__setattr__(self, "_end", None)
        object.__setattr__(self, "_batch", 1)

    def __call__(self, *args, **kwargs):
        return self._endpoint.request(["call", self._handle, self._endpoint.encode(args),
                                       self._endpoint.encode(kwargs)])

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__") and name not in SAFE_DUNDERS:
            raise AttributeError(name)
        return self._endpoint.request(["getattr", self._handle, name])

    def __setattr__(self, name, value):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        self._endpoint.request(["setattr", self._handle, name, self._endpoint.encode(value)])

    def __iter__(self):
        return self._endpoint.request(["iter", self._handle])

    def __next__(self):
        # Items come in growing batches (1, 2, 4, ... 256): few round trips for long iterations, and a
        # test that takes one item advances the program's iterator by one.
        if not self._buffer:
            if self._end is not None:
                raise self._end
            items, end = self._endpoint.request_items(self._handle, self._batch)
            object.__setattr__(self, "_batch", min(256, self._batch * 2))
            self._buffer.extend(reversed(items))
            object.__setattr__(self, "_end", end)
            if not self._buffer:
                if end is None:
                    self._endpoint._protocol_error("an empty batch of items that did not end")
                raise end
        return self._buffer.pop()

    def __len__(self):
        return self._endpoint.request(["len", self._handle])

    def __getitem__(self, key):
        return self._endpoint.request(["getitem", self._handle, self._endpoint.encode(key)])

    def __setitem__(self, key, value):
        self._endpoint.request(["setitem", self._handle, self._endpoint.encode(key), self._endpoint.encode(value)])

    def __delitem__(self, key):
        self._endpoint.request(["delitem", self._handle, self._endpoint.encode(key)])

    def __str__(self):
        return _expect_str(self._endpoint.request(["str", self._handle]))

    def __repr__(self):
        return _expect_str(self._endpoint.request(["repr", self._handle]))

    def __copy__(self):
        return self  # a reference to an object in another process copies to itself

    def __deepcopy__(self, memo):
        return self

    def __reduce_ex__(self, protocol):
        raise TypeError("a reference to an object of the other interpreter cannot be pickled")

    def _refuse(self, *args):
        raise TypeError("an object of the program cannot decide a comparison or a truth value in a test")

    __bool__ = __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = _refuse
    __hash__ = object.__hash__


def _expect_str(value):
    if type(value) is not str:
        raise TypeError("__str__/__repr__ of a program object returned %s" % type(value).__name__)
    return value


class Endpoint:
    """One side of the judge <-> program channel: framing, encoding, and serving the other side.

    ``side`` is ``"judge"`` or ``"program"``. The judge's side hands the program no object that leads
    into its interpreter (see :func:`leads_into_the_interpreter`) and counts the requests it sends
    (``program_ran``: after one, the program may have changed its globals); the program's side
    answers the judge's requests for the current value of a global of ``namespace``.
    """

    def __init__(self, read_fd, write_fd, max_frame_bytes, modules_allowed, side="judge", imports_allowed=None):
        if side not in ("judge", "program"):
            raise ValueError("side must be 'judge' or 'program', got %r" % (side,))
        self.read_fd = read_fd
        self.write_fd = write_fd
        self.max_frame = max_frame_bytes
        self.modules_allowed = modules_allowed  # name -> bool: is a ["M", name] ours to import (never theirs)
        # name -> bool: of those, which the judge does import (the others fail the test that reads them)
        self.imports_allowed = modules_allowed if imports_allowed is None else imports_allowed
        self.side = side
        self.exports = []  # our objects the other side holds a number for
        self.export_numbers = {}  # id(obj) -> number
        self.remotes = {}  # their number -> Remote
        self.dead = False
        self.depth = 0
        self.namedtuples = {}
        self.program_ran = 0  # requests sent so far (the judge's side: each may run the program's code)
        self.namespace = None  # the program's side: the globals the judge may ask for
        self.output = []  # the program's side: what it printed since its last message, for the tests
        self.output_size = 0

    # ---- framing ----------------------------------------------------------------------------

    def send(self, message):
        if self.output:  # the program's side: what it printed goes first, in order
            self._send_output()
        self._send_frame(message)

    def queue_output(self, message):
        """The program's side: a ``["print", args, kwargs]`` or ``["write", text]`` for the judge, sent
        in one ``["output", [...]]`` before the program's next message (at once past 64 KiB)."""
        self.output.append(message)
        self.output_size += len(dumps(message))
        if self.output_size > 1 << 16:
            self._send_output()

    def _send_output(self):
        pending, self.output, self.output_size = self.output, [], 0
        self._send_frame(["output", pending])

    def _send_frame(self, message):
        if self.dead:
            raise ProgramGone("the channel is closed")
        data = dumps(message).encode("ascii")
        if len(data) > self.max_frame:
            raise MemoryError("a value of %d bytes is too large to hand over (limit %d)" % (len(data), self.max_frame))
        view = memoryview(len(data).to_bytes(HEADER_BYTES, "big") + data)
        try:
            while view:
                view = view[os.write(self.write_fd, view):]
        except OSError as exc:
            self.dead = True
            raise ProgramGone("writing to the channel failed: %s" % exc)

    def _read_exactly(self, n):
        chunks = []
        while n:
            try:
                chunk = os.read(self.read_fd, min(n, 1 << 20))
            except InterruptedError:
                continue
            except OSError as exc:
                self.dead = True
                raise ProgramGone("reading the channel failed: %s" % exc)
            if not chunk:
                self.dead = True
                raise ProgramGone("the other side closed the channel")
            chunks.append(chunk)
            n -= len(chunk)
        return b"".join(chunks)

    def receive(self):
        if self.dead:
            raise ProgramGone("the channel is closed")
        size = int.from_bytes(self._read_exactly(HEADER_BYTES), "big")
        if size > self.max_frame:
            self.dead = True
            raise ProgramGone("a message of %d bytes exceeds the limit of %d" % (size, self.max_frame))
        try:
            message = loads(self._read_exactly(size).decode("ascii"))
        except (ValueError, RecursionError) as exc:
            self.dead = True
            raise ProgramGone("a malformed message: %s" % exc)
        if not (isinstance(message, list) and message and isinstance(message[0], str)):
            self.dead = True
            raise ProgramGone("a malformed message")
        return message

    # ---- requests ---------------------------------------------------------------------------

    def request(self, message):
        """Send a request, serve the other side's requests until the answer comes, return/raise it."""
        kind, payload = self._exchange(message)
        if kind != "ok":
            self._protocol_error("expected an answer, got %r" % kind)
        return payload

    def request_items(self, handle, count):
        kind, payload = self._exchange(["next", handle, count])
        if kind != "items":
            self._protocol_error("expected items, got %r" % kind)
        return payload

    def _exchange(self, message):
        if self.depth >= MAX_CALL_DEPTH:
            raise RecursionError("too many nested calls between the tests and the program")
        self.depth += 1
        self.program_ran += 1
        try:
            self.send(message)
            while True:
                reply = self.receive()
                kind = reply[0]
                if kind == "ok" and len(reply) == 2:
                    return "ok", self.decode(reply[1])
                if kind == "items" and len(reply) == 3 and isinstance(reply[1], list):
                    return "items", ([self.decode(v) for v in reply[1]], self._decode_end(reply[2]))
                if kind == "raise" and len(reply) == 4:
                    raise self._decode_exception(reply)
                if kind in ("ok", "items", "raise"):
                    self._protocol_error("a malformed answer")
                if kind == "output" and self.side == "judge" and len(reply) == 2 and type(reply[1]) is list:
                    for printed in reply[1]:
                        self._show_output(printed)
                    continue
                self.answer(reply)  # the other side's request, made while we wait
        finally:
            self.depth -= 1

    def _show_output(self, message):
        """What the program printed, printed again by the judge: with its ``print`` and to its
        ``sys.stdout`` as they are now, so that a test that patched ``builtins.print`` or redirected
        ``sys.stdout`` sees what the program printed."""
        if type(message) is not list or not message:
            self._protocol_error("a malformed output")
        if message[0] == "write" and len(message) == 2 and type(message[1]) is str:
            show = lambda: sys.stdout.write(message[1])  # noqa: E731
        elif message[0] == "print" and len(message) == 3:
            args, kwargs = self.decode(message[1]), self.decode(message[2])
            if type(args) is not tuple or type(kwargs) is not dict or not all(
                    k in ("sep", "end") and (v is None or type(v) is str) for k, v in kwargs.items()):
                self._protocol_error("a malformed print")
            show = lambda: builtins.print(*args, **kwargs)  # noqa: E731
        else:
            self._protocol_error("a malformed output")
        try:
            show()
        except ProgramGone:
            raise
        except Exception:  # noqa: BLE001 - a test's print that raises does not break the exchange
            pass

    def _protocol_error(self, what):
        self.dead = True
        raise ProgramGone(what)

    def answer(self, request):
        """Handle one request from the other side and send the answer (an error if it is too large)."""
        reply = self.handle(request)
        try:
            self.send(reply)
        except MemoryError as exc:
            self.send(self._encode_exception(exc))

    def handle(self, request):
        """The answer to one request from the other side about one of our exported objects."""
        kind = request[0]
        try:
            if kind == "global" and self.namespace is not None and len(request) == 2 and type(request[1]) is str:
                return ["ok", _global_value(self, self.namespace[request[1]])]
            if len(request) < 2 or type(request[1]) is not int or not 0 <= request[1] < len(self.exports):
                raise TypeError("no such object")
            target = self.exports[request[1]]
            if target is None:  # a number of an object a test's own process handed over (gone with it)
                raise TypeError("no such object")
            if kind == "call" and len(request) == 4:
                args, kwargs = self.decode(request[2]), self.decode(request[3])
                if type(args) is not tuple or type(kwargs) is not dict or not all(type(k) is str for k in kwargs):
                    raise TypeError("malformed call")
                result = target(*args, **kwargs)
            elif kind in ("getattr", "setattr") and len(request) >= 3 and type(request[2]) is str:
                name = request[2]
                if name.startswith("__") and name.endswith("__") and (kind == "setattr" or name not in SAFE_DUNDERS):
                    raise AttributeError(name)
                if kind == "getattr" and len(request) == 3:
                    result = getattr(target, name)
                elif kind == "setattr" and len(request) == 4:
                    if self.side == "judge" and not _writable_by_the_program(target, name):
                        raise AttributeError("the tests' %s is handed to the program call-only: it cannot set %r"
                                             % (type(target).__name__, name))
                    setattr(target, name, self.decode(request[3]))
                    result = None
                else:
                    raise TypeError("malformed request")
            elif kind == "iter" and len(request) == 2:
                result = iter(target)
            elif kind == "next" and len(request) == 3 and type(request[2]) is int:
                return self._next_items(target, max(1, min(request[2], 256)))
            elif kind == "len" and len(request) == 2:
                result = len(target)
            elif kind == "getitem" and len(request) == 3:
                result = target[self.decode(request[2])]
            elif kind == "setitem" and len(request) == 4:
                target[self.decode(request[2])] = self.decode(request[3])
                result = None
            elif kind == "delitem" and len(request) == 3:
                del target[self.decode(request[2])]
                result = None
            elif kind == "str" and len(request) == 2:
                result = str(target)
            elif kind == "repr" and len(request) == 2:
                result = repr(target)
            else:
                raise TypeError("unknown request %r" % (kind,))
            return ["ok", self.encode(result)]
        except ProgramGone:
            raise
        except BaseException as exc:  # noqa: BLE001 - whatever it was, the other side gets it as an error
            return self._encode_exception(exc)

    def _next_items(self, iterator, count):
        items, end = [], None
        try:
            for _ in range(count):
                items.append(self.encode(next(iterator)))
        except StopIteration:
            end = "stop"
        except ProgramGone:
            raise
        except BaseException as exc:  # noqa: BLE001
            end = self._encode_exception(exc)
        return ["items", items, end]

    def _decode_end(self, end):
        if end is None:
            return None
        if end == "stop":
            return StopIteration()
        if isinstance(end, list) and len(end) == 4 and end[0] == "raise":
            return self._decode_exception(end)
        self._protocol_error("a malformed end of iteration")

    def _encode_exception(self, exc):
        try:
            args = self.encode(tuple(exc.args))
        except BaseException:  # noqa: BLE001
            args = ["t"]
        try:
            message = str(exc)[:2000]
        except BaseException:  # noqa: BLE001
            message = ""
        return ["raise", type(exc).__name__, args, message]

    def _decode_exception(self, reply):
        """The builtin exception of that name (an Exception, never StopIteration), else ProgramError."""
        _, name, args, message = reply
        if type(name) is not str or type(message) is not str:
            self._protocol_error("a malformed exception")
        cls = getattr(builtins, name, None)
        if (isinstance(cls, type) and issubclass(cls, Exception)
                and not issubclass(cls, (StopIteration, StopAsyncIteration))):
            try:
                decoded = self.decode(args)
                if type(decoded) is tuple:
                    return cls(*decoded)
            except ProgramGone:
                raise
            except Exception:  # noqa: BLE001 - an exception type whose arguments did not fit
                pass
        return ProgramError("%s: %s" % (name, message))

    # ---- values -----------------------------------------------------------------------------

    def export(self, obj):
        """Our object's number for the other side (the same object always gets the same number).

        The judge's side refuses (TypeError) an object that leads into its interpreter."""
        if self.side == "judge" and leads_into_the_interpreter(obj):
            raise TypeError("the judge does not hand the program a %s" % type(obj).__name__)
        number = self.export_numbers.get(id(obj))
        if number is None or self.exports[number] is not obj:
            number = len(self.exports)
            self.exports.append(obj)
            self.export_numbers[id(obj)] = number
        return number

    def encode(self, value):
        """``value`` as the other side will rebuild it: plain data copied, other objects by number.

        Raises TypeError for what the judge does not hand over (see :meth:`export`)."""
        try:
            return self._encode(value, set())
        except RecursionError:
            return ["R", self.export(value)]

    def _encode(self, x, active):
        t = type(x)
        if x is None or t is bool or t is str:
            return x
        if t is int:
            return x if INT64_MIN <= x <= INT64_MAX else ["i", format(x, "x")]
        if t is float:
            return x
        if t is Remote:
            if x._endpoint is self:
                return ["H", x._handle]
            return ["R", self.export(x)]
        special = _STDLIB_ENCODERS.get((getattr(t, "__module__", None), getattr(t, "__qualname__", None)))
        if special is not None and type(x) is _stdlib_type(t):
            return special(self, x, active)
        if isinstance(x, int):  # a subclass (bool cannot be subclassed): its plain value
            return self._encode(int.__index__(x), active)
        if isinstance(x, float):
            return float.__float__(x)
        if isinstance(x, str):
            return str.__str__(x)
        if isinstance(x, complex):
            return ["c", complex.__complex__(x).real, complex.__complex__(x).imag]
        if isinstance(x, (bytes, bytearray)):
            tag = "b" if isinstance(x, bytes) else "ba"
            return [tag, binascii.b2a_base64(bytes(memoryview(x)), newline=False).decode("ascii")]
        if t is range:
            return ["r", self._encode(x.start, active), self._encode(x.stop, active), self._encode(x.step, active)]
        if x is Ellipsis:
            return ["..."]
        if isinstance(x, type(sys)):  # a module: by name (the judge's side never hands over its modules)
            name = getattr(x, "__name__", None)
            return ["M", name if type(name) is str else "", -1 if self.side == "judge" else self.export(x)]
        if isinstance(x, (list, tuple, set, frozenset, dict)):
            if id(x) in active:  # a cycle: the inner occurrence goes as a reference
                return ["R", self.export(x)]
            if self.side == "judge" and isinstance(x, dict) and _is_a_namespace(x):
                raise TypeError("the judge does not hand the program a module's or a test's globals")
            active.add(id(x))
            try:
                if isinstance(x, tuple) and isinstance(getattr(t, "_fields", None), tuple):
                    fields = [f for f in t._fields if type(f) is str]
                    if len(fields) == len(t._fields) == tuple.__len__(x):
                        return ["nt", str(getattr(t, "__name__", "namedtuple"))[:100], fields] + [
                            self._encode(v, active) for v in tuple.__iter__(x)]
                if isinstance(x, dict):
                    out = ["d"]
                    for k, v in dict.items(x):
                        out.append(self._encode(k, active))
                        out.append(self._encode(v, active))
                    return out
                tag = "l" if isinstance(x, list) else "t" if isinstance(x, tuple) else "s" if isinstance(x, set) else "fs"
                items = list.__iter__(x) if tag == "l" else tuple.__iter__(x) if tag == "t" else set.__iter__(x) if tag == "s" else frozenset.__iter__(x)
                return [tag] + [self._encode(v, active) for v in items]
            finally:
                active.discard(id(x))
        return ["R", self.export(x)]

    def decode(self, data):
        try:
            return self._decode(data)
        except ProgramGone:
            raise
        except Exception as exc:  # noqa: BLE001 - whatever did not decode was malformed
            self._protocol_error("a malformed value: %r" % (exc,))

    def _decode(self, d):
        if d is None or type(d) in (bool, str, int, float):
            return d
        if type(d) is not list or not d or type(d[0]) is not str:
            raise TypeError("not a value")
        tag, rest = d[0], d[1:]
        if tag == "l":
            return [self._decode(v) for v in rest]
        if tag == "t":
            return tuple(self._decode(v) for v in rest)
        if tag == "d":
            if len(rest) % 2:
                raise ValueError("odd dict")
            out = {}
            for i in range(0, len(rest), 2):
                out[self._decode(rest[i])] = self._decode(rest[i + 1])
            return out
        if tag == "s":
            return {self._decode(v) for v in rest}
        if tag == "fs":
            return frozenset(self._decode(v) for v in rest)
        if tag == "i":
            return int(_one_str(rest), 16)
        if tag == "c":
            re_, im = rest
            if type(re_) not in (int, float) or type(im) not in (int, float):
                raise TypeError("complex parts")
            return complex(re_, im)
        if tag in ("b", "ba"):
            raw = binascii.a2b_base64(_one_str(rest).encode("ascii"))
            return raw if tag == "b" else bytearray(raw)
        if tag == "r":
            start, stop, step = (self._decode(v) for v in rest)
            if not all(type(v) is int for v in (start, stop, step)):
                raise TypeError("range bounds")
            return range(start, stop, step)
        if tag == "...":
            return Ellipsis
        if tag == "R":
            (number,) = rest
            if type(number) is not int or number < 0:
                raise TypeError("object number")
            remote = self.remotes.get(number)
            if remote is None:
                remote = self.remotes[number] = Remote(self, number)
            return remote
        if tag == "H":
            (number,) = rest
            if type(number) is not int or not 0 <= number < len(self.exports):
                raise TypeError("object number")
            return self.exports[number]
        if tag == "M":  # a module: our own import of that name, never the other side's object
            name, number = rest
            if type(name) is not str or type(number) is not int or number < -1:
                raise TypeError("module")
            if number >= 0 and (not name or not self.modules_allowed(name)):
                return self._decode(["R", number])  # a module we may not import: theirs, by reference
            if self.side == "judge" and not self.imports_allowed(name):
                return _ModuleNotImported(name)
            return sys.modules.get(name) or _ModuleOnFirstUse(name)
        if tag == "nt":
            return self._namedtuple(rest)
        decoder = _STDLIB_DECODERS.get(tag)
        if decoder is None:
            raise TypeError("unknown tag %r" % (tag,))
        return decoder(self, rest)

    def _namedtuple(self, rest):
        import collections
        import keyword

        typename, fields, values = rest[0], rest[1], rest[2:]
        if type(typename) is not str or type(fields) is not list or not all(type(f) is str for f in fields):
            raise TypeError("named tuple")
        if len(fields) != len(values):
            raise ValueError("named tuple arity")
        if not typename.isidentifier() or keyword.iskeyword(typename):
            typename = "namedtuple"
        key = (typename, tuple(fields))
        cls = self.namedtuples.get(key)
        if cls is None:
            if len(self.namedtuples) >= NAMEDTUPLE_TYPES_LIMIT:
                return tuple(self._decode(v) for v in values)
            cls = self.namedtuples[key] = collections.namedtuple(typename, fields, rename=True)
        return cls(*[self._decode(v) for v in values])


#: The standard-library modules the judge imports on a program's behalf: a module the program hands
#: over (a value it returns, whatever its ``__name__``) or a program global named like one through
#: which a test reads an attribute. Modules a test plausibly uses; never a command-line tool, a
#: ``__main__``, a package's ``__init__`` that starts something, or anything found on a path the
#: program can write.
JUDGE_IMPORTS = frozenset({
    "abc", "array", "base64", "binascii", "bisect", "calendar", "cmath", "collections", "collections.abc",
    "colorsys", "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "enum", "errno",
    "fnmatch", "fractions", "functools", "graphlib", "hashlib", "heapq", "hmac", "html", "io", "ipaddress",
    "itertools", "json", "keyword", "math", "numbers", "operator", "os", "os.path", "pprint", "queue",
    "random", "re", "reprlib", "secrets", "statistics", "string", "struct", "sys", "textwrap", "time",
    "types", "typing", "unicodedata", "uuid", "weakref", "zlib",
})
#: With ``site_packages``, these packages and their submodules (dunder-named parts, ``__main__``
#: among them, excepted).
SITE_PACKAGES_IMPORTS = frozenset({
    "numpy", "scipy", "pandas", "sympy", "networkx", "sortedcontainers", "mpmath", "more_itertools", "regex",
    "torch", "sklearn",
})


def may_import(name, site_packages=False):
    """Whether the judge imports module ``name`` for the tests (see ``JUDGE_IMPORTS``)."""
    if type(name) is not str:
        return False
    if name in JUDGE_IMPORTS:
        return True
    parts = name.split(".")
    return bool(site_packages) and parts[0] in SITE_PACKAGES_IMPORTS and all(
        part.isidentifier() and not part.startswith("__") for part in parts)


def import_for_the_tests(name):
    """The judge's own import of module ``name`` (already checked by :func:`may_import`), made with a
    neutral argv, working directory and HOME, and ``sys.path`` as it was afterwards: a module that
    reads its command line, the working directory or the home directory at import time reads
    nothing of the program's."""
    module = sys.modules.get(name)
    if module is not None:
        return module
    path, saved_path, saved_argv = sys.path, list(sys.path), sys.argv
    saved_home = os.environ.get("HOME")
    try:
        cwd = os.open(".", os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        cwd = None
    try:
        sys.argv = [""]
        os.environ["HOME"] = "/"
        os.chdir("/")
        __import__(name)
        return sys.modules[name]
    finally:
        path[:] = saved_path
        sys.path, sys.argv = path, saved_argv
        if saved_home is None:
            os.environ.pop("HOME", None)
        else:
            os.environ["HOME"] = saved_home
        if cwd is not None:
            try:
                os.fchdir(cwd)
            finally:
                os.close(cwd)


class _ModuleOnFirstUse(type(sys)):
    """This side's own import of a module the other side holds, made when a test first reads one of
    its attributes (most programs' ``import re`` is never used by their tests, and importing costs
    milliseconds in every sandbox). If it cannot be imported here, reading an attribute fails:
    the other side's object never stands in for it (a program's ``types.ModuleType("math.forged")``
    with a permissive ``isclose`` would)."""

    def __getattr__(self, attr):
        try:
            real = import_for_the_tests(self.__name__)
        except Exception as exc:  # noqa: BLE001
            raise AttributeError("module %r cannot be imported by the judge (%s), so it has no attribute %r"
                                 % (self.__name__, exc, attr))
        self.__dict__.update(real.__dict__)
        return getattr(real, attr)


class _ModuleNotImported(type(sys)):
    """A module the program names that the judge does not import for the tests (not on its list):
    never the program's object in its place either; reading an attribute fails."""

    def __getattr__(self, attr):
        raise AttributeError("module %r is not one the judge imports for the tests, so it has no attribute %r"
                             % (self.__name__, attr))


def _one_str(rest):
    (value,) = rest
    if type(value) is not str:
        raise TypeError("expected a string")
    return value


# ---- standard-library value types, encoded by name so that the program side need not import them ----

def _stdlib_type(t):
    """The standard-library class ``t`` claims to be (by module and name), if it really is that class."""
    module = sys.modules.get(getattr(t, "__module__", ""))
    return getattr(module, getattr(t, "__qualname__", ""), None) if module is not None else None


def _enc_fraction(ep, x, active):
    return ["Q", ep._encode(x.numerator, active), ep._encode(x.denominator, active)]


def _enc_decimal(ep, x, active):
    return ["D", str(x)]


def _enc_counter(ep, x, active):
    return ["Counter"] + ep._encode(dict(dict.items(x)), active)[1:]


def _enc_ordered(ep, x, active):
    return ["OrderedDict"] + ep._encode(dict(dict.items(x)), active)[1:]


def _enc_defaultdict(ep, x, active):
    factory = x.default_factory
    name = factory.__name__ if factory in (int, float, str, list, dict, set, tuple, bool) else None
    return ["defaultdict", name] + ep._encode(dict(dict.items(x)), active)[1:]


def _enc_deque(ep, x, active):
    return ["deque", x.maxlen] + [ep._encode(v, active) for v in list(x)]


def _enc_date(ep, x, active):
    return ["date", x.isoformat()]


def _enc_datetime(ep, x, active):
    if x.tzinfo is not None and type(x.tzinfo).__name__ != "timezone":
        return ["R", ep.export(x)]
    return ["datetime", x.isoformat()]


def _enc_time(ep, x, active):
    if x.tzinfo is not None:
        return ["R", ep.export(x)]
    return ["time", x.isoformat()]


def _enc_timedelta(ep, x, active):
    return ["timedelta", x.days, x.seconds, x.microseconds]


_STDLIB_ENCODERS = {
    ("fractions", "Fraction"): _enc_fraction, ("decimal", "Decimal"): _enc_decimal,
    ("collections", "Counter"): _enc_counter, ("collections", "OrderedDict"): _enc_ordered,
    ("collections", "defaultdict"): _enc_defaultdict, ("collections", "deque"): _enc_deque,
    ("datetime", "date"): _enc_date, ("datetime", "datetime"): _enc_datetime,
    ("datetime", "time"): _enc_time, ("datetime", "timedelta"): _enc_timedelta,
}


def _pairs(ep, rest):
    return ep._decode(["d"] + list(rest))


def _dec_fraction(ep, rest):
    import fractions

    num, den = (ep._decode(v) for v in rest)
    if type(num) is not int or type(den) is not int:
        raise TypeError("fraction")
    return fractions.Fraction(num, den)


def _dec_decimal(ep, rest):
    import decimal

    return decimal.Decimal(_one_str(rest))


def _dec_counter(ep, rest):
    import collections

    return collections.Counter(_pairs(ep, rest))


def _dec_ordered(ep, rest):
    import collections

    return collections.OrderedDict(_pairs(ep, rest))


def _dec_defaultdict(ep, rest):
    import collections

    factories = {"int": int, "float": float, "str": str, "list": list, "dict": dict, "set": set,
                 "tuple": tuple, "bool": bool}
    name = rest[0]
    if name is not None and name not in factories:
        raise TypeError("defaultdict factory")
    return collections.defaultdict(factories.get(name), _pairs(ep, rest[1:]))


def _dec_deque(ep, rest):
    import collections

    maxlen = rest[0]
    if maxlen is not None and (type(maxlen) is not int or maxlen < 0):
        raise TypeError("deque maxlen")
    return collections.deque((ep._decode(v) for v in rest[1:]), maxlen)


def _dec_date(ep, rest):
    import datetime

    return datetime.date.fromisoformat(_one_str(rest))


def _dec_datetime(ep, rest):
    import datetime

    return datetime.datetime.fromisoformat(_one_str(rest))


def _dec_time(ep, rest):
    import datetime

    return datetime.time.fromisoformat(_one_str(rest))


def _dec_timedelta(ep, rest):
    import datetime

    days, seconds, micro = rest
    if not all(type(v) is int for v in (days, seconds, micro)):
        raise TypeError("timedelta")
    return datetime.timedelta(days=days, seconds=seconds, microseconds=micro)


_STDLIB_DECODERS = {
    "Q": _dec_fraction, "D": _dec_decimal, "Counter": _dec_counter, "OrderedDict": _dec_ordered,
    "defaultdict": _dec_defaultdict, "deque": _dec_deque, "date": _dec_date, "datetime": _dec_datetime,
    "time": _dec_time, "timedelta": _dec_timedelta,
}


# ---- what the judge never hands to the program ---------------------------------------------------

def _a_closure():
    cell = None
    return lambda: cell


def _a_traceback():
    try:
        raise TypeError
    except TypeError as exc:
        return exc.__traceback__


#: The interpreter's own workings: frames (their locals, globals and callers), code (its constants:
#: a test's expected values), tracebacks (frames), cells (a closure's variables); and the classes
#: that make functions, methods and code out of parts. A generator's ``gi_frame``, a coroutine's
#: ``cr_code`` or a traceback's ``tb_frame`` is one of them, whatever its attribute is called.
_INTERPRETER_TYPES = (type(sys._getframe()), type(_a_closure.__code__), type(_a_closure().__closure__[0]),
                      type(_a_traceback()))
_INTERPRETER_CLASSES = _INTERPRETER_TYPES + (type(_a_closure), type(Endpoint.__init__.__get__(0)))
#: Builtins that reach into the interpreter by a name or a text they are given: attributes by name,
#: namespaces, code from text, imports, files and descriptors. ``str.format`` reads attributes by
#: name too (``"{0.gi_frame.f_globals}"``).
_REFLECTIVE_BUILTINS = tuple(getattr(builtins, name) for name in (
    "getattr", "setattr", "delattr", "vars", "globals", "locals", "eval", "exec", "compile", "__import__",
    "breakpoint", "open", "input", "help") if hasattr(builtins, name)) + (str.format, str.format_map)
_NEVER_HANDED_OVER = _INTERPRETER_CLASSES + _REFLECTIVE_BUILTINS
#: Modules whose functions and classes reach frames, objects, code or descriptors (``sys._getframe``,
#: ``gc.get_referrers``, ``inspect.stack``, ``pickle.loads``, ``os.write`` to the results descriptor).
_REFLECTIVE_MODULES = frozenset({
    "sys", "gc", "inspect", "pickle", "_pickle", "marshal", "copyreg", "ctypes", "_ctypes", "importlib",
    "posix", "os", "io", "_io", "operator", "_operator", "string", "_string", "types", "code", "codeop",
    "pdb", "bdb", "runpy", "subprocess", "faulthandler",
})
#: Of those, what tests hand to programs as plain operations (``reduce(operator.add, ...)``).
_PLAIN_OPERATIONS = frozenset({"abs", "add", "and_", "concat", "contains", "countOf", "eq", "floordiv", "ge",
                               "gt", "index", "indexOf", "inv", "invert", "is_", "is_not", "le", "lshift", "lt",
                               "matmul", "mod", "mul", "ne", "neg", "not_", "or_", "pos", "pow", "rshift",
                               "sub", "truediv", "truth", "xor", "itemgetter"})


def leads_into_the_interpreter(obj):
    """Whether handing ``obj`` to the program could lead it into the judge's interpreter.

    True for frames, code objects, tracebacks and cells and the classes that build functions,
    methods and code; for the builtins that reach attributes, namespaces or code by a name or text
    they are given; for the functions and classes of the modules that reach frames, objects or
    descriptors. The program reaches the judge only through what the judge hands it, so refusing
    these whatever attribute or call produced them closes every path (a module is handed by name
    only; a namespace dict is refused by :func:`_is_a_namespace`).
    """
    if isinstance(obj, _INTERPRETER_TYPES):
        return True
    if any(obj is known for known in _NEVER_HANDED_OVER):
        return True
    if not callable(obj):
        return False
    try:
        module = getattr(obj, "__module__", None)
        if module is None and hasattr(obj, "__objclass__"):  # a method descriptor: str.format
            module = getattr(obj.__objclass__, "__module__", None)
        name = getattr(obj, "__name__", None) or type(obj).__name__  # a function's, or an instance's class
    except Exception:  # noqa: BLE001 - an object that will not say what it is is not handed over
        return True
    if type(module) is not str:
        return False
    return module.split(".")[0] in _REFLECTIVE_MODULES and not (
        module in ("operator", "_operator") and name in _PLAIN_OPERATIONS)


_SLOT = type(type("Slotted", (), {"__slots__": ("field",)}).field)  # a __slots__ field's descriptor


def _a_record(obj):
    """Whether ``obj`` (an object of the tests) is a plain record whose attributes the program may
    write: an instance of a class of the tests that defines no methods or descriptors besides
    dunders and is not callable (a linked list's ``Node``, a tree's ``TreeNode``). Everything else
    the tests hand over (functions, generators, classes, a checker with methods or ``__call__``)
    is call-only: the program may call it, iterate it and read it, never rewrite it."""
    cls = type(obj)
    if isinstance(obj, type) or callable(obj) or getattr(cls, "__module__", "builtins") == "builtins":
        return False
    for klass in cls.__mro__[:-1]:  # without object
        for attr, value in vars(klass).items():
            if attr.startswith("__") and attr.endswith("__"):
                continue
            if callable(value) or (hasattr(value, "__get__") and type(value) is not _SLOT):
                return False
    return True


def _writable_by_the_program(obj, name):
    """Whether the program may set attribute ``name`` of the tests' ``obj``: a data attribute of a
    plain record (:func:`_a_record`), never one that holds a function (a ``SimpleNamespace``'s)."""
    return _a_record(obj) and not callable(getattr(obj, "__dict__", {}).get(name))


def _is_a_namespace(mapping):
    """Whether ``mapping`` (a dict of the judge's) is a module's globals or a test's namespace."""
    if dict.__contains__(mapping, "__builtins__"):
        return True
    name = dict.get(mapping, "__name__")
    return type(name) is str and getattr(sys.modules.get(name), "__dict__", None) is mapping


# ---- the two roles ---------------------------------------------------------------------------

def _global_value(endpoint, value):
    """A program global as the judge receives it: a copy, or a reference when its copy is large."""
    encoded = endpoint.encode(value)
    if len(dumps(encoded)) > GLOBAL_COPY_LIMIT:
        encoded = ["R", endpoint.export(value)]
    return encoded


def serve_program(endpoint, namespace):
    """Program side: announce the program's globals, then answer the judge until it hangs up (the
    judge asks again for a global it reads after the program ran: see :class:`TestNamespace`)."""
    endpoint.namespace = namespace
    names = []
    for name, value in list(namespace.items()):
        if type(name) is not str or (name.startswith("__") and name.endswith("__")):
            continue
        names.append([name, _global_value(endpoint, value)])
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
        return None if type(value) in _PLAIN_TYPES or isinstance(value, type(sys)) else _ModuleNotImported(name)
    try:
        module = import_for_the_tests(name)
    except Exception:  # noqa: BLE001 - not importable here: no stand-in either
        return _ModuleOnFirstUse(name)
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
#: module (a site-package's, ``os``, ``sys``, ``pickle``, ``importlib``...) is judged apart.
PLAIN_MODULES = frozenset({
    "__future__", "abc", "array", "ast", "base64", "binascii", "bisect", "calendar", "cmath", "collections",
    "collections.abc", "colorsys", "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal", "difflib",
    "enum", "errno", "fnmatch", "fractions", "functools", "graphlib", "hashlib", "heapq", "hmac", "html",
    "ipaddress", "itertools", "json", "keyword", "math", "numbers", "operator", "pprint", "queue", "random", "re",
    "reprlib", "secrets", "statistics", "string", "struct", "textwrap", "time", "typing", "unicodedata", "uuid",
    "zlib",
})
#: Functions of those modules that evaluate a text as code (string annotations).
_EVALUATING_MODULE_FUNCTIONS = frozenset({"get_type_hints", "ForwardRef"})
#: Builtins that compute on the values they are given (the exceptions besides); the others reach
#: attributes, namespaces or code by a name or a text (``getattr``, ``vars``, ``globals``, ``eval``,
#: ``__import__``), or files and descriptors (``open``).
SAFE_BUILTINS = frozenset({
    "abs", "all", "any", "ascii", "bin", "bool", "bytearray", "bytes", "callable", "chr", "classmethod",
    "complex", "dict", "dir", "divmod", "enumerate", "filter", "float", "format", "frozenset", "hasattr", "hash",
    "hex", "id", "int", "isinstance", "issubclass", "iter", "len", "list", "map", "max", "memoryview", "min",
    "next", "object", "oct", "ord", "pow", "print", "property", "range", "repr", "reversed", "round", "set",
    "slice", "sorted", "staticmethod", "str", "sum", "super", "tuple", "type", "zip", "True", "False", "None",
    "Ellipsis", "NotImplemented", "aiter", "anext",
}) | frozenset(name for name, value in vars(builtins).items()
                if isinstance(value, type) and issubclass(value, BaseException))
#: Dunder names and attributes a plain test may use (``if __name__ == "__main__":``,
#: ``super().__init__()``, ``type(x).__name__``, the program's task handed over by name).
_PLAIN_DUNDERS = SAFE_DUNDERS | {"__init__", "__class__", "__program_global__"}
#: Methods that evaluate a text or bytes as code, reached through an object rather than a module a
#: test names (a program's global or return value may be the judge's ``sympy`` or ``pandas``).
EVALUATING_METHODS = frozenset({
    "eval", "exec", "query", "sympify", "parse_expr", "lambdify", "simplify", "load", "loads", "read_pickle",
    "compile", "attrgetter", "methodcaller", "import_module", "system", "popen", "runsource", "runcode",
})
_TRUSTING = "trusting"  # a binding through which a test may run the program's text


def _syntax():
    """The ``_ast`` module: the node classes of ``ast`` without importing ``ast`` (with ``enum`` and
    ``contextlib``, ~5 ms of a fresh judge's start-up; ``_ast`` ~1 ms, and only for tests read)."""
    import _ast

    return _ast


def _walk(node, local=frozenset()):
    """``node`` and every node under it (``ast.walk``, in another order), each with the names local
    to the functions and lambdas it is in (their parameters and what they bind)."""
    ast = _syntax()
    todo = [(node, local)]
    while todo:
        node, local = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            arguments = node.args
            local = local | {a.arg for a in arguments.posonlyargs + arguments.args + arguments.kwonlyargs
                             + [arguments.vararg, arguments.kwarg] if a is not None}
            local = local | _names_bound(node.body if isinstance(node.body, list) else [node.body])
        yield node, local
        for field in node._fields:
            value = getattr(node, field, None)
            if isinstance(value, list):
                todo.extend((item, local) for item in value if isinstance(item, ast.AST))
            elif isinstance(value, ast.AST):
                todo.append((value, local))


def _names_bound(statements):
    """The names ``statements`` bind in their own scope (not inside the functions they define)."""
    ast = _syntax()
    bound = set()
    todo = list(statements)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            bound.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((alias.asname or alias.name).partition(".")[0] for alias in node.names)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue  # its body is its own scope (its decorators and defaults are not: rarely binding)
        for field in node._fields:
            value = getattr(node, field, None)
            if isinstance(value, list):
                todo.extend(item for item in value if isinstance(item, ast.AST))
            elif isinstance(value, ast.AST):
                todo.append(value)
    return bound


def _is_dunder(name):
    return name.startswith("__") and name.endswith("__")


def _plain_module_attribute(module_name, attribute):
    """Whether ``module_name.attribute`` (a plain module's) is plain: public, no text evaluator, and
    not itself a module off the list (``typing.sys``, ``json.codecs``) or a reflective builtin."""
    if attribute.startswith("_") or attribute in _EVALUATING_MODULE_FUNCTIONS:
        return False
    if module_name == "operator":
        return attribute in _PLAIN_OPERATIONS
    try:
        value = getattr(import_for_the_tests(module_name), attribute, None)
    except Exception:  # noqa: BLE001 - not importable here: the test fails without running anything
        return True
    if isinstance(value, type(sys)):
        return getattr(value, "__name__", None) in PLAIN_MODULES
    return not any(value is reflective for reflective in _REFLECTIVE_BUILTINS)


class _PlainTestReader:
    """Reads a test's syntax tree for what may run the program's text (see :func:`judged_apart`).

    ``bindings`` maps the tests' top-level names to what they hold: a plain module's name
    (``("module", "json")``), :data:`_TRUSTING`, or the names its value reads (a function's free
    names: ``check`` is as trusting as what its body calls, whenever it is called).
    """

    def __init__(self, bindings, stored):
        self.bindings = bindings
        self.stored = stored  # the names the test binds at its top level: its own

    def name_is_trusting(self, name, seen=()):
        """Whether ``name``, read at the test's top level, may hold what runs the program's text."""
        entry = self.bindings.get(name)
        if entry is _TRUSTING or self.bindings.get("*") is _TRUSTING:
            return True
        if type(entry) is tuple:
            return False
        if type(entry) is frozenset:
            seen = set(seen) | {name}
            return any(self.name_is_trusting(read, seen) for read in entry if read not in seen)
        if name in self.stored or name in _PLAIN_DUNDERS:
            return False
        if _is_dunder(name):  # __builtins__, __import__, __loader__...
            return True
        if hasattr(builtins, name):
            return name not in SAFE_BUILTINS
        # a free name: the program's global, or the judge's module of that name in its place
        return name not in PLAIN_MODULES and may_import(name, site_packages=True)

    def module_named(self, node, local):
        """The plain module that ``node`` (a name or an attribute chain) is, or None."""
        ast = _syntax()
        if isinstance(node, ast.Name):
            if node.id in local:  # a function's own import of a plain module (one of another is judged apart)
                return node.id if node.id in PLAIN_MODULES else None
            entry = self.bindings.get(node.id)
            if type(entry) is tuple:
                return entry[1]
            if entry is None and node.id not in self.stored and node.id in PLAIN_MODULES:
                return node.id
            return None
        if isinstance(node, ast.Attribute):
            base = self.module_named(node.value, local)
            if base is not None and "%s.%s" % (base, node.attr) in PLAIN_MODULES:
                return "%s.%s" % (base, node.attr)
        return None

    def is_trusting(self, nodes):
        """Whether any of ``nodes`` (and what they contain) may run the program's text."""
        ast = _syntax()
        for root in nodes:
            for node, local in _walk(root):
                if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
                    if node.id not in local and self.name_is_trusting(node.id):
                        return True
                elif isinstance(node, ast.Attribute):
                    if _is_dunder(node.attr) and node.attr not in _PLAIN_DUNDERS:
                        return True
                    module = self.module_named(node.value, local)
                    if module is not None:
                        if not _plain_module_attribute(module, node.attr):
                            return True
                    elif node.attr in EVALUATING_METHODS:
                        return True
                elif isinstance(node, (ast.Import, ast.ImportFrom)):
                    if any(binding is _TRUSTING for _, binding in self.imported(node)):
                        return True
        return False

    def imported(self, statement):
        """(name, binding) for each name an import statement binds."""
        ast = _syntax()
        if isinstance(statement, ast.Import):
            for alias in statement.names:
                plain = alias.name in PLAIN_MODULES
                if alias.asname:
                    yield alias.asname, ("module", alias.name) if plain else _TRUSTING
                else:  # import collections.abc binds collections
                    top = alias.name.partition(".")[0]
                    yield top, ("module", top) if plain and top in PLAIN_MODULES else _TRUSTING
            return
        module = statement.module or ""
        plain = statement.level == 0 and module in PLAIN_MODULES
        for alias in statement.names:
            name = alias.asname or alias.name
            if alias.name == "*":  # a plain module's names stay plain; any other's make every name trusting
                if not plain:
                    yield "*", _TRUSTING
            elif not plain or not _plain_module_attribute(module, alias.name):
                yield name, _TRUSTING
            elif "%s.%s" % (module, alias.name) in PLAIN_MODULES:
                yield name, ("module", "%s.%s" % (module, alias.name))
            else:
                yield name, frozenset()

    @staticmethod
    def names_read(node):
        """The names ``node`` reads outside its functions' locals: the top-level and free ones, which
        may hold something else by the time it runs (``check`` calls ``helper``, bound later)."""
        ast = _syntax()
        return frozenset(n.id for n, local in _walk(node)
                         if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id not in local)


def _run_at_definition(definition):
    """What of a ``def`` or ``class`` statement runs when it runs: decorators, defaults, annotations,
    bases, and a class's body but its methods' bodies."""
    ast = _syntax()
    parts = list(definition.decorator_list)
    if isinstance(definition, ast.ClassDef):
        parts += definition.bases + [argument.value for argument in definition.keywords]
        for statement in definition.body:
            if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                parts += _run_at_definition(statement)
            else:
                parts.append(statement)
        return parts
    arguments = definition.args
    parts += [d for d in arguments.defaults + arguments.kw_defaults if d is not None]
    parts += [a.annotation for a in arguments.posonlyargs + arguments.args + arguments.kwonlyargs
              + [arguments.vararg, arguments.kwarg] if a is not None and a.annotation is not None]
    if definition.returns is not None:
        parts.append(definition.returns)
    return parts


def judged_apart(test, bindings):
    """Whether ``test`` may run a text or bytes of the program's as code in the judge, read from its
    syntax tree (comments and strings say nothing): it reads a builtin off :data:`SAFE_BUILTINS`
    (``eval``, ``getattr``, ``vars``, ``open``...), a dunder name or attribute (``__builtins__``,
    ``__globals__``), a module off :data:`PLAIN_MODULES` (any site-package's: ``sympy.sympify``,
    ``pandas.DataFrame.query``; ``operator``, ``pickle``, ``importlib``, ``os``, ``sys``...), a
    private or module attribute of a plain module (``typing.sys``), a method named like a text
    evaluator (:data:`EVALUATING_METHODS`), or a name an earlier test bound to any of these
    (``check``, whose body calls ``sympy.sympify``). What only runs later (a function's body) and
    imports are allowed in a test judged in the judge itself: ``import numpy as np`` or ``def
    check(...)`` using it is judged there, and the test that calls ``check`` or reads ``np`` apart.

    ``bindings`` (the tests' top-level names so far, see :class:`_PlainTestReader`) is updated with
    what ``test`` binds when it is judged in the judge (False is returned).
    """
    ast = _syntax()
    try:
        tree = compile(test, "<test>", "exec", ast.PyCF_ONLY_AST)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return False  # it will not run
    updated = dict(bindings)
    reader = _PlainTestReader(updated, _names_bound(tree.body))
    for statement in tree.body:
        if isinstance(statement, (ast.Import, ast.ImportFrom)):
            for name, binding in reader.imported(statement):
                updated[name] = binding
        elif isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if reader.is_trusting(_run_at_definition(statement)):
                return True
            updated[statement.name] = _TRUSTING if reader.is_trusting([statement]) else reader.names_read(statement)
        else:
            if reader.is_trusting([statement]):
                return True
            read = reader.names_read(statement)
            for name in _names_bound([statement]):
                updated[name] = read
    bindings.clear()
    bindings.update(updated)
    return False


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
