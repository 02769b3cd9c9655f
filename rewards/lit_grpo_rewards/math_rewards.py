"""Math answer checking with `Math-Verify <https://github.com/huggingface/Math-Verify>`_.

The module is called ``math_rewards`` (not ``math``) so that it never shadows the standard library.
``math_verify`` is imported on first use, so listing rewards (``lit-grpo rewards``) stays fast.

Parsing rules shared by :func:`math_accuracy` and
:func:`lit_grpo_rewards.length.cosine_scaled_accuracy`:

* **The completion.** Its final answer is found as in :mod:`lit_grpo_rewards.final_answer`: the
  last complete ``<answer>...</answer>`` block (tag name: ``answer_tag``), else the last
  ``\\boxed{...}``, ``#### N`` or "the answer is N", else the whole completion if it is nothing
  but an answer. A completion that commits to no answer (one cut off in its reasoning) scores 0,
  whatever number it wrote last. The answer text is made plain
  (:func:`~lit_grpo_rewards.final_answer.normalize_answer_text`: ``\\$``, ``-$5``, ``**``,
  ``28\\,080``, the minus sign) and Math-Verify reads its last
  :data:`~lit_grpo_rewards.final_answer.MATH_VERIFY_MAX_CHARS` characters (its parsing time grows
  faster than the text): a ``\\boxed{...}`` first, else the last LaTeX (``$...$``) or plain
  expression (``1/2``, ``0.5``, ``x = 3``).
* **The gold answer** (the ``answer`` column, or ``solution`` as in open-r1), optionally cut out
  with ``answer_pattern``: what its last marker marks (GSM8K's ``#### 72``, a ``\\boxed{...}``),
  else all of it, made plain as above; a plain number is read as its exact value (``#### 8.0`` is
  8). A gold that contains ``$``, ``\\(``, ``\\[`` or ``\\boxed`` is parsed as it is.
* **Bare LaTeX.** A short answer that looks like LaTeX (it contains ``\\ ^ _ { }`` and no words)
  is parsed as if written ``$...$``, so ``\\frac12`` or ``3\\sqrt{2}`` work; any other text is
  parsed as plain text. This holds for the gold and the completion's answer alike.
* **Timeouts.** Math-Verify bounds parsing and comparison with ``signal.alarm``, which works only in
  the main thread of a process. There ``timeout_seconds`` applies. lit-grpo's scorer calls these
  rewards in a main thread always: off the trainer's main thread (the asynchronous pipeline's scoring
  thread) it runs them in a worker process of its own. Called directly in any other thread, the
  timeout is switched off (Math-Verify's own advice), so that the call does not fail, and a warning
  says so once: a pathological answer can then take unbounded time.
"""

from __future__ import annotations

import functools
import logging
import math
import re
import threading
from collections.abc import Sequence
from typing import Any

from lit_grpo_rewards.final_answer import (
    MATH_VERIFY_MAX_CHARS,
    final_answer,
    marked_answer,
    normalize_answer_text,
    plain_number,
)
from lit_grpo_rewards.text import compile_answer_pattern, completion_text, reference_answer

__all__ = ["math_accuracy", "parse_math_answer", "verify_math_answer"]

_ANCHORED = re.compile(r"\$|\\\(|\\\[|\\boxed")
_LATEX_MARK = re.compile(r"[\\^_{}]")
_LATEX_NOISE = re.compile(r"\\text\{[^{}]*\}|\\[A-Za-z]+")
_WORD = re.compile(r"[A-Za-z]{2,}")

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=1)
def _math_verify():
    """``(parse, verify, extraction_config)``, imported on first use."""
    try:
        from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
    except ImportError as exc:  # pragma: no cover - it is a declared dependency
        raise ImportError(
            "math rewards need the `math-verify` package: pip install 'math-verify>=0.9'"
        ) from exc
    # \boxed{} wins over every other candidate, as in open-r1's accuracy reward.
    config = (LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig())
    return parse, verify, config


def _timeout(timeout_seconds: float | None) -> int | None:
    """The timeout to hand to Math-Verify: None (no signal) outside the main thread."""
    if timeout_seconds is None or timeout_seconds <= 0:
        return None
    if threading.current_thread() is not threading.main_thread():
        _warn_no_timeout_in_thread()
        return None
    return max(1, math.ceil(timeout_seconds))  # signal.alarm takes whole seconds


@functools.lru_cache(maxsize=1)
def _warn_no_timeout_in_thread() -> None:
    """Once per process: a math reward called outside a main thread runs without its timeout."""
    logger.warning(
        "math_accuracy / cosine_scaled_accuracy called in thread %r, not in a main thread: Math-Verify's "
        "timeout (timeout_seconds, signal.alarm) works only in a process's main thread, so these calls run "
        "without one and a pathological answer can take unbounded time. lit-grpo's RewardScorer calls them "
        "in a main thread (a worker process of their own when it scores off the trainer's main thread); "
        "call them in one too.",
        threading.current_thread().name,
    )


def _looks_like_bare_latex(text: str) -> bool:
    return bool(_LATEX_MARK.search(text)) and not _WORD.search(_LATEX_NOISE.sub(" ", text))


def parse_math_answer(text: str, timeout_seconds: float | None = 5) -> list:
    """Math-Verify's parse of ``text`` (a gold answer or a completion's answer); ``[]`` if none.

    See the module docstring for how bare LaTeX and anchored text are told apart.
    """
    parse, _, config = _math_verify()
    text = str(text).strip()
    if not text:
        return []
    timeout = _timeout(timeout_seconds)
    if not _ANCHORED.search(text) and _looks_like_bare_latex(text):
        parsed = parse(f"${text}$", extraction_config=config, parsing_timeout=timeout)
        if parsed:
            return parsed
    return parse(text, extraction_config=config, parsing_timeout=timeout)


def _parse_gold(gold: str, timeout_seconds: float | None) -> list:
    """Math-Verify's parse of a gold answer: what its last marker marks (GSM8K's ``#### 72``, a
    worked solution's ``\\boxed{...}``), else (no marker, or it does not parse) all of it; ``[]`` if
    neither parses. A plain number is given as its exact value: ``#### 8.0`` becomes 8, which
    Math-Verify then finds equal to ``8%`` too, as it does for any integer gold."""
    for text in (marked_answer(gold), gold):  # all of it when the marked part does not parse
        if not text:
            continue
        text = normalize_answer_text(text)
        number = plain_number(text)
        parsed = parse_math_answer(text if number is None else str(number), timeout_seconds)
        if parsed:
            return parsed
    return []


def verify_math_answer(gold: list, predicted: list, timeout_seconds: float | None = 5) -> bool:
    """Whether the parsed ``predicted`` answer equals the parsed ``gold`` (Math-Verify's ``verify``)."""
    if not gold or not predicted:
        return False
    _, verify, _ = _math_verify()
    return bool(verify(gold, predicted, timeout_seconds=_timeout(timeout_seconds)))


def _gold_column(answer: Any, solution: Any, n: int, who: str) -> Sequence:
    gold = answer if answer is not None else solution
    if gold is None:
        raise TypeError(
            f"{who} needs the gold answers: provide an `answer` (or `solution`) dataset column"
        )
    if isinstance(gold, (str, int, float)):  # one gold for every completion, given directly
        return [gold] * n
    return list(gold)


def math_correctness(
    completions: Sequence,
    answer: Any = None,
    solution: Any = None,
    answer_pattern: str | None = None,
    answer_tag: str | None = "answer",
    timeout_seconds: float | None = 5,
    who: str = "math_accuracy",
) -> list[bool | None]:
    """Per completion: True if its answer equals the gold, False if not, None if the gold does not parse."""
    gold_re = compile_answer_pattern(answer_pattern)
    golds = _gold_column(answer, solution, len(completions), who)
    if len(golds) != len(completions):
        raise ValueError(f"{who}: got {len(completions)} completions but {len(golds)} gold answers")
    cache: dict[str, list] = {}  # the G completions of a prompt share one gold
    results: list[bool | None] = []
    for completion, gold in zip(completions, golds):
        gold = reference_answer(gold, gold_re)
        if gold is None:
            results.append(None)
            continue
        key = str(gold)
        if key not in cache:
            cache[key] = _parse_gold(key, timeout_seconds)
        gold_parsed = cache[key]
        if not gold_parsed:
            results.append(None)
            continue
        answer_text = final_answer(completion_text(completion), answer_tag)
        if not answer_text:  # no final answer: cut off, or never given
            results.append(False)
            continue
        predicted = parse_math_answer(normalize_answer_text(answer_text)[-MATH_VERIFY_MAX_CHARS:], timeout_seconds)
        results.append(verify_math_answer(gold_parsed, predicted, timeout_seconds))
    return results


def math_accuracy(
    completions,
    answer=None,
    solution=None,
    answer_pattern: str | None = None,
    answer_tag: str | None = "answer",
    timeout_seconds: float | None = 5,
    **kwargs,
) -> list[float | None]:
    """1.0 if the completion's final answer is mathematically equal to the gold answer, else 0.0.

    Equality is decided by Math-Verify (``1/2``, ``0.5``, ``\\frac{1}{2}`` and
    ``\\boxed{\\frac12}`` are all equal), as in open-r1's ``accuracy_reward``. A gold answer that
    is None, that ``answer_pattern`` does not match, or that Math-Verify cannot parse scores None
    (not applicable). A completion that commits to no final answer (an ``<answer>`` block, a
    ``\\boxed{}``, ``#### N``, "the answer is N", or nothing but the answer), such as one cut off in
    its reasoning, scores 0.0, and so does one whose answer does not parse. How the completion and
    the gold are parsed is described in :mod:`lit_grpo_rewards.math_rewards`.

    args:
        answer_pattern (str, optional): a regular expression that cuts the gold out of the
            ``answer`` column (its first group, or the whole match): ``"####\\s*(.+)$"`` takes
            GSM8K's final answer out of its worked solution.
        answer_tag (str | None): if the completion has ``<answer_tag>...</answer_tag>``, only the
            last such block is checked (default ``answer``; null: only the markers above).
        timeout_seconds (float | None): Math-Verify's time limit per parse / comparison (default
            5; null or 0 disables it). It uses ``signal.alarm``, so it applies in a main thread only,
            where the trainer always calls this reward (see the module docstring).

    columns:
        answer (str | number | None): the gold answer, or a worked solution containing it
            (``\\boxed{...}``, or use ``answer_pattern``).
        solution (str | None): used instead when there is no ``answer`` column (open-r1's name).
    """
    return [
        None if ok is None else float(ok)
        for ok in math_correctness(
            completions,
            answer=answer,
            solution=solution,
            answer_pattern=answer_pattern,
            answer_tag=answer_tag,
            timeout_seconds=timeout_seconds,
            who="math_accuracy",
        )
    ]
