"""``numeric_accuracy``: whether a completion's final answer has the gold answer's value.

Made for numeric answers (GSM8K, MATH-style integers, decimals, fractions, negatives, percentages):
both sides are read as values, not strings. Where the final answer is and what counts as a plain
number is :mod:`lit_grpo_rewards.final_answer`; anything that is not a plain number (a fraction,
``\\frac{3}{4}``, ``2^{10}``) goes to Math-Verify through :mod:`lit_grpo_rewards.math_rewards`.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

from lit_grpo_rewards.final_answer import (
    MATH_VERIFY_MAX_CHARS,
    final_answer,
    marked_answer,
    normalize_answer_text,
    plain_number,
)
from lit_grpo_rewards.math_rewards import parse_math_answer, verify_math_answer
from lit_grpo_rewards.text import compile_answer_pattern, completion_text, reference_answer

__all__ = ["answer_value", "numeric_accuracy", "same_value"]

# An exact number, or Math-Verify's parse of a formula (a non-empty list).
Value = Fraction | list


def answer_value(text: str, timeout_seconds: float | None = 5) -> Value | None:
    """The value an answer text states: an exact :class:`~fractions.Fraction` for a plain number
    (:func:`~lit_grpo_rewards.final_answer.plain_number`), else Math-Verify's parse of its last
    :data:`~lit_grpo_rewards.final_answer.MATH_VERIFY_MAX_CHARS` characters; None if neither finds one."""
    normalized = normalize_answer_text(text)
    number = plain_number(normalized)
    if number is not None:
        return number
    return parse_math_answer(normalized[-MATH_VERIFY_MAX_CHARS:], timeout_seconds) or None


def same_value(gold: Value, predicted: Value, timeout_seconds: float | None = 5) -> bool:
    """Whether two values are equal: exactly for two plain numbers, else by Math-Verify's ``verify``."""
    if isinstance(gold, Fraction) and isinstance(predicted, Fraction):
        return gold == predicted

    def parsed(value: Value) -> list:
        return parse_math_answer(str(value), timeout_seconds) if isinstance(value, Fraction) else value

    return verify_math_answer(parsed(gold), parsed(predicted), timeout_seconds)


def _gold_value(gold: Any, answer_pattern, index: int, timeout_seconds: float | None) -> Value | None:
    """The value of one gold answer; None when it is None or ``answer_pattern`` does not match it."""
    if gold is None:
        return None
    if isinstance(gold, bool) or (isinstance(gold, float) and not math.isfinite(gold)):
        raise ValueError(f"numeric_accuracy: the gold answer of sample {index} is {gold!r}, not a number")
    if isinstance(gold, numbers.Integral):
        return Fraction(int(gold))
    if isinstance(gold, float):
        return Fraction(repr(gold))  # 0.1 as written, not its binary approximation
    text = reference_answer(gold, answer_pattern)
    if text is None:
        return None
    text = str(text)
    marked = marked_answer(text)  # GSM8K's "... #### 72", a MATH solution's \boxed{...}
    value = None if not marked else answer_value(marked, timeout_seconds)
    if value is None:  # no marker, or what it marks states nothing: all of the text
        value = answer_value(text, timeout_seconds)
    if value is None:
        shown = text if len(text) <= 80 else text[:77] + "..."
        raise ValueError(
            f"numeric_accuracy: the gold answer of sample {index}, {shown!r}, states no number or formula "
            "(give `answer_pattern` to cut the answer out of a longer text)"
        )
    return value


def numeric_accuracy(
    completions: Sequence,
    answer: Any,
    answer_pattern: str | None = None,
    answer_tag: str | None = "answer",
    timeout_seconds: float | None = 5,
    **kwargs,
) -> list[float | None]:
    """1.0 if the completion's final answer has the gold answer's value, else 0.0 (None without gold).

    Values, not strings, on both sides: ``28080`` = ``28080.0`` = ``28080.`` = ``28,080`` =
    ``$28,080.00`` = ``28080 pebbles`` = ``\\boxed{28080}`` = ``\\( 28080 \\)`` = ``28{,}080``;
    ``-5`` = ``\u22125`` = ``-$5``; ``25%`` = ``25``; ``3/4`` = ``\\frac{3}{4}`` = ``0.75``.

    **The completion's final answer** is the content of its last complete ``<answer>...</answer>``
    block (prose that names the tag earlier does not count); without one, the last ``\\boxed{...}``,
    ``#### N`` or "the answer is N" / "Answer: N"; without any of them, the whole completion if it
    is a bare number or formula. Inside the block those markers are read too
    (``<answer>The answer is 72.</answer>``). A completion that commits to no answer, such as one
    cut off in its reasoning, scores 0.0 whatever number it wrote last.

    **The gold answer** is read the same way: ``#### 72`` at the end of GSM8K's worked solution,
    ``\\boxed{...}`` in a MATH solution, or the whole value (``72``, ``8.0``, ``1,000``, ``\\frac34``,
    a number from JSON).

    **The value** of an answer that holds exactly one number among words, spaces, punctuation,
    currency signs and ``%`` is that number, compared exactly. Anything else (``3/4``,
    ``\\frac{3}{4}``, ``2^{10}``, several numbers) is parsed and compared by Math-Verify, as in
    ``math_accuracy``.

    args:
        answer_pattern (str, optional): a regular expression that cuts the gold out of the
            ``answer`` column (its first group, or the whole match); a gold it does not match scores
            None. Not needed for GSM8K: ``#### N`` is found without it.
        answer_tag (str | None): the tag of the answer block (default ``answer``; null: markers only).
        timeout_seconds (float | None): Math-Verify's time limit per parse / comparison (default 5;
            main thread only).

    columns:
        answer (str | number | None): the gold answer or a worked solution that marks it; None
            scores None. A gold that states no number or formula is an error naming its sample.
    """
    gold_re = compile_answer_pattern(answer_pattern)
    if isinstance(answer, (str, numbers.Number)) or answer is None:  # one gold for every completion
        answer = [answer] * len(completions)
    golds = list(answer)
    if len(golds) != len(completions):
        raise ValueError(f"numeric_accuracy: got {len(completions)} completions but {len(golds)} gold answers")
    gold_values: dict[str, Value | None] = {}  # the G completions of a prompt share one gold
    scores: list[float | None] = []
    for index, (completion, gold) in enumerate(zip(completions, golds)):
        key = repr(gold)
        if key not in gold_values:
            gold_values[key] = _gold_value(gold, gold_re, index, timeout_seconds)
        gold_value = gold_values[key]
        if gold_value is None:
            scores.append(None)
            continue
        answer_text = final_answer(completion_text(completion), answer_tag)
        predicted = None if not answer_text else answer_value(answer_text, timeout_seconds)
        scores.append(1.0 if predicted is not None and same_value(gold_value, predicted, timeout_seconds) else 0.0)
    return scores
