"""Extract a final answer from a completion and compare it with a reference (non-math tasks)."""

from __future__ import annotations

import re
from typing import Any

from lit_grpo_rewards.text import compile_answer_pattern, completion_text, last_tag_content, reference_answer

__all__ = ["answer_match", "extract_answer", "find_last_boxed", "last_boxed"]

EXTRACT_MODES = ("auto", "boxed", "answer_tag", "regex")

_WHITESPACE = re.compile(r"\s+")


def last_boxed(text: str, command: str = "boxed") -> str | None:
    """The content of the last ``\\boxed{...}`` in ``text`` (nested braces allowed), or None.

    ``\\boxed{\\frac{1}{2}}`` gives ``\\frac{1}{2}``. An unclosed last box is skipped in favour of
    the previous complete one.
    """
    found = find_last_boxed(text, command)
    return None if found is None else found[1]


def find_last_boxed(text: str, command: str = "boxed") -> tuple[int, str] | None:
    """``(where it starts, its content)`` of the last complete ``\\boxed{...}`` in ``text``, or None.

    One pass over the braces: linear in the length of the text.
    """
    # the opening brace of each box -> where its command starts
    box_starts = {
        match.end() - 1: match.start() for match in re.finditer(re.escape("\\" + command) + r"[ \t]*\{", text)
    }
    if not box_starts:
        return None
    last: tuple[int, int] | None = None  # (opening brace, closing brace) of the last complete box
    open_braces: list[int] = []
    for brace in re.finditer(r"[{}]", text):
        position = brace.start()
        if text[position] == "{":
            open_braces.append(position)
        elif open_braces:
            opening = open_braces.pop()
            if opening in box_starts and (last is None or opening > last[0]):
                last = (opening, position)
    if last is None:
        return None
    return box_starts[last[0]], text[last[0] + 1 : last[1]]


def _last_regex(text: str, pattern: re.Pattern) -> str | None:
    matches = list(pattern.finditer(text))
    if not matches:
        return None
    match = matches[-1]
    return match.group(1) if pattern.groups else match.group(0)


def extract_answer(
    text: str, extract: str = "auto", pattern: str | re.Pattern | None = None, answer_tag: str = "answer"
) -> str | None:
    """The answer part of ``text`` according to ``extract`` (see :func:`answer_match`); None if absent."""
    if extract == "boxed":
        return last_boxed(text)
    if extract == "answer_tag":
        return last_tag_content(text, answer_tag)
    if extract == "regex":
        if pattern is None:
            raise ValueError("answer_match: extract='regex' needs a `pattern` argument")
        if not isinstance(pattern, re.Pattern):
            pattern = _compile_pattern(pattern)
        return _last_regex(text, pattern)
    if extract == "auto":
        found = last_boxed(text)
        if found is None:
            found = last_tag_content(text, answer_tag)
        return text.strip() if found is None else found
    raise ValueError(f"answer_match: extract must be one of {', '.join(EXTRACT_MODES)}; got {extract!r}")


def _compile_pattern(pattern: str) -> re.Pattern:
    try:
        return re.compile(pattern, re.MULTILINE)
    except re.error as exc:
        raise ValueError(f"answer_match: pattern {pattern!r} is not a valid regular expression: {exc}") from None


def _normalize(text: Any, case_sensitive: bool, normalize_whitespace: bool) -> str:
    text = str(text)
    text = _WHITESPACE.sub(" ", text).strip() if normalize_whitespace else text.strip()
    return text if case_sensitive else text.casefold()


def answer_match(
    completions,
    answer,
    extract: str = "auto",
    pattern: str | None = None,
    case_sensitive: bool = False,
    normalize_whitespace: bool = True,
    answer_tag: str = "answer",
    answer_pattern: str | None = None,
    **kwargs,
) -> list[float | None]:
    """1.0 if the answer extracted from the completion equals the ``answer`` column, else 0.0.

    Extraction (``extract``):

    * ``boxed``: the content of the last ``\\boxed{...}`` (nested braces allowed);
    * ``answer_tag``: the content of the last ``<answer>...</answer>``;
    * ``regex``: the last match of ``pattern`` (its first group, or the whole match);
    * ``auto`` (default): the last ``\\boxed{}``, else the last ``<answer>...</answer>``, else the
      whole completion.

    A completion from which nothing can be extracted scores 0.0. Both sides are stripped; with
    ``normalize_whitespace`` every run of whitespace counts as one space, and unless
    ``case_sensitive`` the comparison ignores case (``str.casefold``). For math answers
    (``1/2`` = ``0.5``) use ``math_accuracy`` instead.

    args:
        extract (str): ``auto`` | ``boxed`` | ``answer_tag`` | ``regex``.
        pattern (str): the regular expression for ``extract: regex`` (``re.MULTILINE``).
        case_sensitive (bool): compare case-sensitively (default false).
        normalize_whitespace (bool): collapse whitespace runs before comparing (default true).
        answer_tag (str): the tag name for ``answer_tag`` / ``auto`` (default ``answer``).
        answer_pattern (str, optional): a regular expression that cuts the reference out of the
            ``answer`` column (first group, or whole match; no match scores None), as in
            ``exact_match``.

    columns:
        answer (str | number | list | None): the reference; a list means any of its items is
            accepted (aliases); None scores None (not applicable).
    """
    if extract not in EXTRACT_MODES:
        raise ValueError(f"answer_match: extract must be one of {', '.join(EXTRACT_MODES)}; got {extract!r}")
    if extract == "regex" and not pattern:
        raise ValueError("answer_match: extract='regex' needs a `pattern` argument")
    compiled = _compile_pattern(pattern) if pattern else None
    gold_re = compile_answer_pattern(answer_pattern)
    if isinstance(answer, (str, int, float)):  # one reference for every completion
        answer = [answer] * len(completions)
    scores: list[float | None] = []
    for completion, ref in zip(completions, answer):
        refs = list(ref) if isinstance(ref, (list, tuple)) else [ref]
        refs = [reference_answer(r, gold_re) for r in refs]
        refs = [_normalize(r, case_sensitive, normalize_whitespace) for r in refs if r is not None]
        if not refs:
            scores.append(None)
            continue
        predicted = extract_answer(completion_text(completion), extract, compiled, answer_tag)
        if predicted is None:
            scores.append(0.0)
            continue
        scores.append(1.0 if _normalize(predicted, case_sensitive, normalize_whitespace) in refs else 0.0)
    return scores

# Safe in any thread (no signals, no state shared between calls): lit-grpo's scorer keeps such a
# reward in the asynchronous pipeline's scoring thread rather than in a worker process of its own.
answer_match.thread_safe = True
