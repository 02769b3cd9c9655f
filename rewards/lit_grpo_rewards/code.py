"""Rewards that run the completion's code: ``code_execution``.

The code runs in :mod:`lit_grpo_rewards.sandbox`, built to hold against a hostile program (see that
module for each isolation layer, and ``rewards/README.md`` for the threat model and what remains
possible); its assertion tests run in a separate judge process that the program cannot reach.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from lit_grpo_rewards.sandbox import run_in_sandbox
from lit_grpo_rewards.text import completion_text

__all__ = ["code_execution", "extract_code", "parse_test_cases"]

log = logging.getLogger(__name__)

_PYTHON_LANGS = {"", "python", "py", "python3", "py3"}
# The two kinds of fence line, each matched within one line and anchored at its start: an opening
# fence (its language tag is the first group; anything may follow on the line) and a closing fence
# (three backquotes alone, with spaces or tabs around, and the \r of a \r\n line ending). Neither
# can backtrack beyond its own line.
_OPENING_FENCE = re.compile(r"[ \t]*```[ \t]*([A-Za-z0-9_+.#-]*)")
_CLOSING_FENCE = re.compile(r"[ \t]*```[ \t]*\r?")


def extract_code(text: str) -> str:
    """The program in a completion: its last ```python (or untagged) fenced block, else all of it.

    An opening fence is a line starting with three backquotes (after spaces or tabs), its language
    tag right after; the block runs up to the next line that is only a closing fence or, for a
    completion cut off by the length limit, to the end of the text. Blocks tagged with another
    language (```bash, ```text) are skipped. Lines may end in ``\n`` or ``\r\n``; the program is
    returned with ``\n`` line endings.

    It runs on model text in the training process, so it reads the text line by line, each line at
    most twice: linear in the length of the completion, whatever the completion holds.
    """
    blocks = []
    line_start = 0
    while True:
        newline = text.find("\n", line_start)
        if newline < 0:
            break  # a last line without a newline cannot open a block
        opening = _OPENING_FENCE.match(text, line_start, newline)
        if opening is None:
            line_start = newline + 1
            continue
        body_start = body_end = newline + 1
        while True:  # the block's lines up to a closing fence or the end of the text
            newline = text.find("\n", body_end)
            line_end = len(text) if newline < 0 else newline
            if _CLOSING_FENCE.fullmatch(text, body_end, line_end):
                line_start = line_end + 1
                break
            if newline < 0:
                body_end = line_start = len(text)
                break
            body_end = newline + 1
        if opening.group(1).lower() in _PYTHON_LANGS:
            blocks.append(text[body_start:body_end])
    if not blocks:
        return text
    return textwrap.dedent(blocks[-1].replace("\r\n", "\n"))  # (dedent sees "\r" as indented text)


def _as_text(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "\n".join(str(v) for v in value)
    return "" if value is None else str(value)


def parse_test_cases(spec: Any) -> tuple[str, list] | None:
    """Normalize one sample's test cases to ``("assert", [stmt, ...])`` or ``("io", [(stdin, stdout), ...])``.

    Accepted: a list of Python statements (``"assert add(1, 2) == 3"``); a list of
    ``{"input": ..., "output": ...}`` dicts (``stdin``/``stdout`` are accepted as key names too); an
    APPS-style ``{"inputs": [...], "outputs": [...]}`` dict; any of these as a JSON string; a
    plain (non-JSON) string, taken as one test. Returns None when there are no test cases.
    Raises ValueError for anything else (a data problem that should not pass silently).
    """
    if spec is None:
        return None
    if isinstance(spec, (bytes, bytearray)):
        spec = spec.decode()
    if isinstance(spec, str):
        if not spec.strip():
            return None
        try:
            spec = json.loads(spec)
        except ValueError:
            return ("assert", [spec])
        if isinstance(spec, str):
            return ("assert", [spec])
    if isinstance(spec, dict):
        if "fn_name" in spec:
            raise ValueError("call-based APPS test cases (with 'fn_name') are not supported; give assertion strings")
        if "inputs" in spec and "outputs" in spec:
            ins, outs = list(spec["inputs"]), list(spec["outputs"])
            if len(ins) != len(outs):
                raise ValueError(f"test cases have {len(ins)} inputs but {len(outs)} outputs")
            spec = [{"input": i, "output": o} for i, o in zip(ins, outs)]
        elif ("input" in spec or "stdin" in spec) and ("output" in spec or "stdout" in spec):
            spec = [spec]
        else:
            raise ValueError(f"test cases: a dict needs 'input'/'output' (or 'inputs'/'outputs'), got keys {sorted(spec)}")
    if not isinstance(spec, (list, tuple)):
        raise ValueError(f"test cases must be a list (or its JSON), got {type(spec).__name__}")
    cases = list(spec)
    if not cases:
        return None
    if all(isinstance(c, str) for c in cases):
        return ("assert", cases)
    if all(isinstance(c, dict) for c in cases):
        io = []
        for c in cases:
            stdin = c["input"] if "input" in c else c.get("stdin")
            stdout = c["output"] if "output" in c else c.get("stdout")
            if stdout is None:
                raise ValueError(f"stdin/stdout test case without an expected 'output': {c!r}")
            io.append((_as_text(stdin), _as_text(stdout)))
        return ("io", io)
    raise ValueError("test cases must be all strings (assertions) or all {'input', 'output'} dicts")


def _normalize_output(text: str) -> str:
    """Line endings as ``\\n``, each line's trailing whitespace and the surrounding blank lines
    stripped. For the expected output (the data set's, trusted): it builds one string per line."""
    lines = text.replace("\r\n", "\n").replace("\r", "\n").strip().split("\n")
    return "\n".join(line.rstrip() for line in lines)


_WHITESPACE_RUN = re.compile(r"\s*")  # whitespace as str.isspace() sees it; it cannot backtrack


def _output_matches(stdout: bytes, expected_lines: list[str]) -> bool:
    """Whether a program's ``stdout`` equals ``"\\n".join(expected_lines)`` after
    :func:`_normalize_output`, without normalizing the output itself.

    The output is the program's: up to ``max_output_bytes`` of anything. It is decoded once (one
    string of at most 4 bytes per byte of output; the decoder needs up to 5 on the way) and read in
    place: no per-line strings (four
    million one-character lines would take hundreds of MiB), no copies, one pass that stops at the
    first difference; the time is linear in the output's length.
    """
    text = stdout.decode("utf-8", "replace")
    end = len(text)
    pos = _WHITESPACE_RUN.match(text).end()  # leading blank lines and indentation: stripped
    next_cr = text.find("\r", pos)  # kept until passed: looking for it on every line would be quadratic
    for i, expected in enumerate(expected_lines):
        if i:  # past the previous line's ending: \n, \r\n or \r
            if pos == end:
                return False
            pos += 2 if text.startswith("\r\n", pos) else 1
        if 0 <= next_cr < pos:
            next_cr = text.find("\r", pos)
        newline = text.find("\n", pos)
        line_end = min(x for x in (newline, next_cr, end) if x >= 0)
        # the line, its trailing whitespace stripped, must be the expected one (which ends in none)
        if not (text.startswith(expected, pos, line_end)
                and _WHITESPACE_RUN.fullmatch(text, pos + len(expected), line_end)):
            return False
        pos = line_end
    return _WHITESPACE_RUN.fullmatch(text, pos) is not None  # trailing blank lines: stripped


def _score_one(code: str, cases: tuple[str, list], sandbox_kwargs: dict) -> float:
    kind, tests = cases
    timeout = sandbox_kwargs["timeout"]
    if kind == "assert":
        result = run_in_sandbox(code, tests=tests, **sandbox_kwargs)
        return sum(1 for ok in result.test_results if ok) / len(tests)
    # stdin/stdout: one sandboxed run per case, all of them within the completion's time budget.
    deadline = time.monotonic() + timeout
    passed = 0
    for stdin, expected in tests:
        expected_lines = _normalize_output(expected).split("\n")
        left = deadline - time.monotonic()
        if left <= 0.05:
            break  # out of time: the remaining cases fail
        kwargs = dict(sandbox_kwargs, timeout=left)
        result = run_in_sandbox(code, stdin=stdin, **kwargs)
        if result.timed_out:
            break
        if result.returncode == 0 and _output_matches(result.stdout, expected_lines):
            passed += 1
        del result  # its output (up to max_output_bytes) before the next case's
    return passed / len(tests)


def code_execution(
    completions,
    test_cases=None,
    *,
    timeout: float = 5.0,
    memory_mb: int = 512,
    cpu_seconds: int | None = None,
    max_output_bytes: int = 8 * 1024 * 1024,
    max_processes: int = 16,
    python: str | None = None,
    site_packages: bool = False,
    num_workers: int = 1,
    test_column: str | None = None,
    **kwargs,
) -> list[float | None]:
    """Fraction (0..1) of a sample's test cases that the completion's Python code passes.

    The code is the completion's last ```python (or untagged) fenced block, else the whole
    completion. It runs in a throw-away sandbox (:mod:`lit_grpo_rewards.sandbox`; as root: a system-call
    filter, a memory/process cgroup, no network, its own PID namespace, a minimal read-only root
    apart from its scratch directory, its own unprivileged uid, resource limits, killed with
    everything it started at the deadline). Any failure (syntax error, exception, timeout, memory,
    crash) fails the test (or every test, when the program dies); the reward never raises for the
    code's sake.

    Two kinds of test cases, from the ``test_cases`` column:

    - assertions, ``["assert add(1, 2) == 3", ...]``: the code runs once as ``__main__`` (stdin at
      EOF, stdout discarded); then each statement runs in a judge process whose namespace holds the
      code's globals (plain values as copies, functions and objects as references answered by the
      program; see ``lit_grpo_rewards.sandbox.judge``), and passes if it does not raise. What the
      program returns reaches the test as plain data, so a wrong program cannot make a comparison
      or an ``assert`` come out true. The code's own top-level errors do not stop the tests (a stray
      ``input()`` after the definitions is harmless); a test that never ran (program killed) fails.
    - stdin/stdout, ``[{"input": "1 2\\n", "output": "3\\n"}, ...]`` (or APPS-style
      ``{"inputs": [...], "outputs": [...]}``): one sandboxed run per case; it passes when the
      program exits with status 0 and its stdout equals the expected output, both with line
      endings normalized, trailing whitespace of each line and surrounding blank lines stripped.
      The output is compared where it lies, in linear time and without an object per line: the
      trainer's memory for one completion stays under ``6 * max_output_bytes`` (the output, and the
      decoder's text of it: up to 4 bytes a character, and a copy while it widens), whatever the
      program prints.

    Either may be given as a JSON string. A sample without test cases (None, empty) scores None.

    args:
        timeout (float): wall-clock seconds for one completion, all its test cases together
            (stdin/stdout cases share the budget; cases left when it runs out fail). Default 5.
        memory_mb (int): address-space limit per process, MiB, and (as root, with a cgroup) the memory
            of the whole sandbox, shared memory and scratch files included. Default 512.
        cpu_seconds (int, optional): CPU seconds per process; default ``ceil(timeout)``.
        max_output_bytes (int): the most a program may write to stdout or any one file, or hand to a
            test in one value. Default 8 MiB.
        max_processes (int): process/thread limit of the sandbox (enforced when running as root).
            Default 16.
        python (str, optional): interpreter to run the code with; default ``sys.executable``.
        site_packages (bool): allow importing third-party packages (default: standard library only).
        num_workers (int): completions scored at once, each in its own subprocess, from a thread
            pool. Default 1 (one after the other).
        test_column (str, optional): read the tests from this dataset column instead of
            ``test_cases`` (e.g. ``input_output`` for APPS-style data).

    columns:
        test_cases (list | str | None): the sample's tests, as above.
    """
    n = len(completions)
    if test_column is not None and test_column != "test_cases":
        if test_column not in kwargs:
            raise ValueError(f"code_execution: no dataset column {test_column!r} (test_column) in this batch")
        test_cases = kwargs[test_column]
    if test_cases is None:
        return [None] * n
    if isinstance(test_cases, (str, bytes, dict)):
        test_cases = [test_cases] * n  # one spec for every completion
    test_cases = list(test_cases)
    if len(test_cases) != n:
        raise ValueError(f"code_execution: {n} completions but {len(test_cases)} test_cases values")
    python = python or sys.executable
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        raise ValueError(f"code_execution: python interpreter {python!r} is not an executable file")
    sandbox_kwargs = dict(
        timeout=float(timeout), memory_mb=int(memory_mb), cpu_seconds=cpu_seconds,
        max_output_bytes=int(max_output_bytes), max_processes=int(max_processes), python=python,
        site_packages=bool(site_packages),
    )
    parsed = [parse_test_cases(spec) for spec in test_cases]
    codes = [extract_code(completion_text(c)) for c in completions]

    def score(i: int) -> float | None:
        if parsed[i] is None:
            return None
        try:
            return _score_one(codes[i], parsed[i], sandbox_kwargs)
        except Exception as exc:  # the sandbox machinery itself failed (e.g. no processes left)
            log.warning("code_execution: could not run completion %d in the sandbox: %r", i, exc)
            return 0.0

    if num_workers <= 1 or n <= 1:
        return [score(i) for i in range(n)]
    with ThreadPoolExecutor(max_workers=min(int(num_workers), n), thread_name_prefix="code_execution") as pool:
        return list(pool.map(score, range(n)))

# Safe in any thread (no signals, no state shared between calls): lit-grpo's scorer keeps such a
# reward in the asynchronous pipeline's scoring thread rather than in a worker process of its own.
code_execution.thread_safe = True
