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
- a module: the judge's own import of the module of that name (standard library only, unless
  the sandbox allows site-packages), never the program's module object; a name the judge cannot
  import fails the test that reads the module (``types.ModuleType("math.forged")``);
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

What the judge hands to the program (the arguments a test passes, the values its callbacks return)
leads nowhere into the judge's interpreter (:func:`leads_into_the_interpreter`): plain data goes
as copies, modules by name only (the program's side imports its own), and the judge refuses to hand
over frames, code objects, tracebacks and cells (a generator's ``gi_frame``, whatever the attribute
is called), the globals of a module or of the tests, the builtins that reach attributes,
namespaces or code by a name or text (``getattr``, ``vars``, ``eval``, ``str.format``, ...) and the
functions of the modules that reach frames, objects or descriptors (``sys``, ``gc``, ``inspect``,
``os``, ``io``, ``pickle``, ...). Any other object of a test (a function, a generator, an instance
of a test's class) goes as a reference the program may call, iterate and read and write the
attributes of, dunders apart.

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
[values], end]``. A module is ``["M", name, h]``, ``h`` being -1 from the judge (no reference).
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

    def __init__(self, read_fd, write_fd, max_frame_bytes, modules_allowed, side="judge"):
        if side not in ("judge", "program"):
            raise ValueError("side must be 'judge' or 'program', got %r" % (side,))
        self.read_fd = read_fd
        self.write_fd = write_fd
        self.max_frame = max_frame_bytes
        self.modules_allowed = modules_allowed  # name -> bool: may a ["M", name] become our import
        self.side = side
        self.exports = []  # our objects the other side holds a number for
        self.export_numbers = {}  # id(obj) -> number
        self.remotes = {}  # their number -> Remote
        self.dead = False
        self.depth = 0
        self.namedtuples = {}
        self.program_ran = 0  # requests sent so far (the judge's side: each may run the program's code)
        self.namespace = None  # the program's side: the globals the judge may ask for

    # ---- framing ----------------------------------------------------------------------------

    def send(self, message):
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
                self.answer(reply)  # the other side's request, made while we wait
        finally:
            self.depth -= 1

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


class _ModuleOnFirstUse(type(sys)):
    """This side's own import of a module the other side holds, made when a test first reads one of
    its attributes (most programs' ``import re`` is never used by their tests, and importing costs
    milliseconds in every sandbox). If it cannot be imported here, reading an attribute fails:
    the other side's object never stands in for it (a program's ``types.ModuleType("math.forged")``
    with a permissive ``isclose`` would)."""

    def __getattr__(self, attr):
        try:
            __import__(self.__name__)
            real = sys.modules[self.__name__]
        except Exception as exc:  # noqa: BLE001
            raise AttributeError("module %r cannot be imported by the judge (%s), so it has no attribute %r"
                                 % (self.__name__, exc, attr))
        self.__dict__.update(real.__dict__)
        return getattr(real, attr)


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
    try:
        endpoint.send(["ready", names])
        while True:
            endpoint.answer(endpoint.receive())
    except ProgramGone:
        return


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


def _standard_module_for(name, value, tests, modules_allowed):
    """The judge's own module for a program global named like an importable module (the standard
    library's, or with site-packages any) when a test reads one of that module's attributes through
    it (``math.isclose``, relying on the program's ``import math``), whatever the program bound to
    the name: a module, a named tuple, a ``types.ModuleType("math.forged")``. A module the judge
    cannot import fails the test that reads it. None when the name is the program's own (the test
    reads attributes the module does not have: ``queue.append`` on the program's list ``queue``)."""
    if not modules_allowed(name):
        return None
    read = _attributes_read(name, tests)
    if not read:
        return None
    try:
        __import__(name)
        module = sys.modules[name]
    except Exception:  # noqa: BLE001 - not importable here: no stand-in either
        return _ModuleOnFirstUse(name)
    if isinstance(value, type(sys)) or any(hasattr(module, attr) for attr in read):
        return module
    return None


def judge_tests(endpoint, tests, report, when_ready=None):
    """Judge side: build the tests' namespace from the program's globals, run each test, report it.

    ``report(i, passed)`` is called once per test that ran. A test passes when it runs to the end
    without raising and the program is still answering. ``when_ready()`` is called once the program
    has run (its sandbox is set up). Returns whether every test ran.
    """
    try:
        ready = endpoint.receive()
        if ready[0] != "ready" or len(ready) != 2 or type(ready[1]) is not list:
            endpoint._protocol_error("expected the program's globals")
        namespace = TestNamespace(endpoint)
        for entry in ready[1]:
            if type(entry) is not list or len(entry) != 2 or type(entry[0]) is not str:
                endpoint._protocol_error("a malformed global")
            name = entry[0]
            if (name.startswith("__") and name.endswith("__")) or hasattr(builtins, name):
                continue  # dunders and builtins stay the judge's own
            value = endpoint.decode(entry[1])
            module = _standard_module_for(name, value, tests, endpoint.modules_allowed)
            if module is not None:
                namespace[name] = module  # fixed: never read from the program again
            else:
                namespace.add_program_global(name, value)
    except ProgramGone:
        return False
    if when_ready is not None:
        when_ready()
    for i, test in enumerate(tests):
        if endpoint.dead:
            return False
        try:
            exec(compile(test, "<test %d>" % i, "exec"), namespace)
            passed = True
        except BaseException:  # noqa: BLE001 - any failure, ProgramGone included, fails the test
            passed = False
        report(i, passed and not endpoint.dead)
    return not endpoint.dead
