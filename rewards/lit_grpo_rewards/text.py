"""Rewards that compare the completion's text with a target."""

from __future__ import annotations

import re
from typing import Any

__all__ = [
    "char_fraction",
    "compile_answer_pattern",
    "completion_text",
    "exact_match",
    "last_tag_content",
    "reference_answer",
]


def completion_text(completion: Any) -> str:
    """The text of one completion: the string itself, or the last message's ``content``.

    Conversational completions are lists of messages (``[{"role": "assistant", "content": ...}]``);
    a content given as a list of parts keeps the ``text`` of its text parts.
    """
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        message = completion
    elif isinstance(completion, (list, tuple)):
        if not completion:
            return ""
        message = completion[-1]
        if not isinstance(message, dict):
            raise TypeError(f"expected a chat message dict, got {type(message).__name__}: {message!r}")
    else:
        raise TypeError(
            f"expected a completion string or a list of chat messages, got {type(completion).__name__}"
        )
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):  # [{"type": "text", "text": ...}, ...]
        return "".join(
            part.get("text", "") for part in content if isinstance(part, dict) and part.get("type", "text") == "text"
        )
    return str(content)


def last_tag_content(text: str, tag: str) -> str | None:
    """The content of the last complete ``<tag>...</tag>`` block of ``text``, or None if there is none.

    The block ends at the last closing tag and starts at the last opening tag before it, so a tag
    named earlier in prose ("I will put it inside the <answer> tag") does not start it, and an
    opening tag left unclosed at the end (a completion cut off inside its block) is no block.
    Two searches from the end: linear in the length of the text.
    """
    closing = text.rfind(f"</{tag}>")
    if closing == -1:
        return None
    opening = text.rfind(f"<{tag}>", 0, closing)
    if opening == -1:
        return None
    return text[opening + len(tag) + 2 : closing]


def compile_answer_pattern(answer_pattern: str | re.Pattern | None) -> re.Pattern | None:
    """The compiled ``answer_pattern`` argument (``re.MULTILINE``), or None when it is not set.

    An invalid expression raises :class:`ValueError` naming the argument.
    """
    if answer_pattern is None or isinstance(answer_pattern, re.Pattern):
        return answer_pattern
    try:
        return re.compile(answer_pattern, re.MULTILINE)
    except re.error as exc:
        raise ValueError(f"answer_pattern {answer_pattern!r} is not a valid regular expression: {exc}") from None


def reference_answer(value: Any, answer_pattern: re.Pattern | None) -> Any:
    """The reference answer taken from one value of an ``answer`` column.

    Without a pattern the value is returned unchanged (None stays None). With one, the value is
    searched as text and its first group (or whole match) returned; no match gives None.
    """
    if value is None or answer_pattern is None:
        return value
    match = answer_pattern.search(str(value))
    if match is None:
        return None
    return match.group(1) if match.groups() else match.group(0)


def char_fraction(completions, target=None, chars=None, **kwargs) -> list[float | None]:
    """Fraction (0..1) of the completion's characters that belong to a character set.

    The set is ``chars`` when given in YAML ``args`` (one set for every sample), otherwise the
    per-sample dataset column ``target`` (a string whose characters form the set; a sample whose
    ``target`` is None scores None). Every character counts, whitespace included; an empty
    completion scores 0.0.

    args:
        chars (str, optional): the characters that count, for all samples.

    columns:
        target (str): the characters that count for this sample (used when ``chars`` is not set).

    Example (the quickstart): ``{name: char_fraction, args: {chars: "a"}}`` rewards completions
    made only of ``a``; a random character-level model scores about 1/vocab.
    """
    n = len(completions)
    if chars is not None:
        targets = [chars] * n
    elif target is None:
        raise TypeError(
            "char_fraction needs the character set: set `args: {chars: ...}` in the reward config "
            "or provide a `target` dataset column"
        )
    elif isinstance(target, str):  # a single set given directly, not a column
        targets = [target] * n
    else:
        targets = list(target)
    scores: list[float | None] = []
    for completion, charset in zip(completions, targets):
        if charset is None:
            scores.append(None)
            continue
        text = completion_text(completion)
        if not text:
            scores.append(0.0)
            continue
        allowed = set(str(charset))
        scores.append(sum(ch in allowed for ch in text) / len(text))
    return scores


def exact_match(completions, answer, answer_pattern: str | None = None, **kwargs) -> list[float | None]:
    """1.0 if the completion's answer equals the ``answer`` column, else 0.0 (None without answer).

    The completion's answer is the text inside its last ``<answer>...</answer>`` when there is one
    (:func:`last_tag_content`), otherwise the whole completion; both sides are compared as strings
    after stripping surrounding whitespace (``72.0`` is not ``72``: ``numeric_accuracy`` compares
    values). Non-string answers (e.g. the integer 42 read from JSON) are compared as ``str(answer)``.

    args:
        answer_pattern (str, optional): a regular expression that extracts the reference from the
            ``answer`` column (its first group, or the whole match): ``"####\\s*(.+)$"`` takes
            GSM8K's final answer out of its worked solution. A reference it does not match scores None.

    columns:
        answer (str | number | None): the reference answer; None scores None (not applicable).
    """
    gold_re = compile_answer_pattern(answer_pattern)
    scores: list[float | None] = []
    for completion, ref in zip(completions, answer):
        ref = reference_answer(ref, gold_re)
        if ref is None:
            scores.append(None)
            continue
        text = completion_text(completion)
        tagged = last_tag_content(text, "answer")
        predicted = text if tagged is None else tagged
        scores.append(1.0 if predicted.strip() == str(ref).strip() else 0.0)
    return scores

# Safe in any thread (no signals, no state shared between calls): lit-grpo's scorer keeps such a
# reward in the asynchronous pipeline's scoring thread rather than in a worker process of its own.
char_fraction.thread_safe = exact_match.thread_safe = True
