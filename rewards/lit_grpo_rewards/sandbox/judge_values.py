"""The values that cross the judge protocol besides JSON's own: standard-library types (encoded by
name), and what the judge never hands to the program (whatever leads into its interpreter)."""

import builtins
import sys


def one_str(rest):
    (value,) = rest
    if type(value) is not str:
        raise TypeError("expected a string")
    return value


# ---- standard-library value types, encoded by name so that the program side need not import them ----

def stdlib_type(t):
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


STDLIB_ENCODERS = {
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

    return decimal.Decimal(one_str(rest))


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

    return datetime.date.fromisoformat(one_str(rest))


def _dec_datetime(ep, rest):
    import datetime

    return datetime.datetime.fromisoformat(one_str(rest))


def _dec_time(ep, rest):
    import datetime

    return datetime.time.fromisoformat(one_str(rest))


def _dec_timedelta(ep, rest):
    import datetime

    days, seconds, micro = rest
    if not all(type(v) is int for v in (days, seconds, micro)):
        raise TypeError("timedelta")
    return datetime.timedelta(days=days, seconds=seconds, microseconds=micro)


STDLIB_DECODERS = {
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
_INTERPRETER_CLASSES = _INTERPRETER_TYPES + (type(_a_closure), type(_a_closure.__get__(0)))  # + a bound method's type
#: Builtins that reach into the interpreter by a name or a text they are given: attributes by name,
#: namespaces, code from text, imports, files and descriptors. ``str.format`` reads attributes by
#: name too (``"{0.gi_frame.f_globals}"``).
REFLECTIVE_BUILTINS = tuple(getattr(builtins, name) for name in (
    "getattr", "setattr", "delattr", "vars", "globals", "locals", "eval", "exec", "compile", "__import__",
    "breakpoint", "open", "input", "help") if hasattr(builtins, name)) + (str.format, str.format_map)
_NEVER_HANDED_OVER = _INTERPRETER_CLASSES + REFLECTIVE_BUILTINS
#: Modules whose functions and classes reach frames, objects, code or descriptors (``sys._getframe``,
#: ``gc.get_referrers``, ``inspect.stack``, ``pickle.loads``, ``os.write`` to the results descriptor).
_REFLECTIVE_MODULES = frozenset({
    "sys", "gc", "inspect", "pickle", "_pickle", "marshal", "copyreg", "ctypes", "_ctypes", "importlib",
    "posix", "os", "io", "_io", "operator", "_operator", "string", "_string", "types", "code", "codeop",
    "pdb", "bdb", "runpy", "subprocess", "faulthandler",
})
#: Of those, what tests hand to programs as plain operations (``reduce(operator.add, ...)``).
PLAIN_OPERATIONS = frozenset({"abs", "add", "and_", "concat", "contains", "countOf", "eq", "floordiv", "ge",
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
    only; a namespace dict is refused by :func:`is_a_namespace`).
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
        module in ("operator", "_operator") and name in PLAIN_OPERATIONS)


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


def writable_by_the_program(obj, name):
    """Whether the program may set attribute ``name`` of the tests' ``obj``: a data attribute of a
    plain record (:func:`_a_record`), never one that holds a function (a ``SimpleNamespace``'s)."""
    return _a_record(obj) and not callable(getattr(obj, "__dict__", {}).get(name))


def is_a_namespace(mapping):
    """Whether ``mapping`` (a dict of the judge's) is a module's globals or a test's namespace."""
    if dict.__contains__(mapping, "__builtins__"):
        return True
    name = dict.get(mapping, "__name__")
    return type(name) is str and getattr(sys.modules.get(name), "__dict__", None) is mapping
