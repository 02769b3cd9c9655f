"""Where a completion commits to its final answer, and the number that answer states.

Shared by :func:`lit_grpo_rewards.numeric.numeric_accuracy` and
:func:`lit_grpo_rewards.math_rewards.math_accuracy` (and so ``cosine_scaled_accuracy``).

**The final answer** (:func:`final_answer`) is, in this order:

1. the content of the last complete ``<answer>...</answer>`` block (tag name: ``answer_tag``), or,
   inside it, what a marker below marks;
2. without such a block, what the last marker of the completion marks: ``\\boxed{...}``, a line
   ``#### N`` (GSM8K's solutions), "answer is N" / "Answer: N" (up to the end of its sentence), or
   a heading "Final Answer" (the line after it); or, when the completion takes that answer back
   after it, what it corrects it to (``The answer is 7. Wait, it is 9.``: 9);
3. without either, the whole completion if it is nothing but an answer: a number alone or with a
   unit (``72``, ``72 clips``), a sentence that ends and holds one number (``She sold 72 clips.``),
   or a formula without words and without ``=`` (``$\\frac{1}{2}$``, ``1/2``).

Anything else commits to no answer, and so does a negated one (``The answer is not 72.``): a
completion cut off in its reasoning ends like any step of it (``Natalia sold 48 clips in April
and``), so it scores 0 whatever number it last wrote.

**The number** (:func:`plain_number`) of an answer text that holds exactly one number, with
nothing else but words, spaces, punctuation, currency signs, ``%`` and LaTeX that only decorates:
``28,080``, ``$28,080.00``, ``28080.``, ``-$5``, ``28080 pebbles``, ``\\( 28080 \\)``,
``28{,}080``, ``$72 \\text{ cm}$``, ``25\\%``. Several numbers, fractions and other formulas are
left to Math-Verify.

Every function here is linear in the length of its text: regular expressions without nested or
adjacent unbounded repeats over the same characters, and searches from the end.
"""

from __future__ import annotations

import re
from fractions import Fraction

from lit_grpo_rewards.answer import find_last_boxed
from lit_grpo_rewards.text import last_tag_content

__all__ = ["MATH_VERIFY_MAX_CHARS", "final_answer", "marked_answer", "normalize_answer_text", "plain_number"]

# Math-Verify's parsing time grows faster than the length of its text (a 16,000-character sum
# takes a second), so it gets at most the last this many characters of an answer text.
MATH_VERIFY_MAX_CHARS = 1000

# "The answer is", "Final answer:", "**Answer:**", "answer =", and a heading "### Final Answer" that
# ends its line.
_ANSWER_PHRASE = re.compile(r"\banswer[ \t*]*(?:is\b|:|=)|\bfinal answer[ \t*#:]*$", re.IGNORECASE | re.MULTILINE)
# GSM8K's "#### 72": a value must follow. A markdown heading is not a marker: "#### Step 2" (no
# value follows), "#### 3. Totals" (a numbered heading).
_HASHES = re.compile(r"####[ \t]*(?=[-+\u2212$\\\d.(])")
_NUMBERED_HEADING = re.compile(r"\d+[.):][ \t]+[^\W\d_]")
# The end of the sentence that an answer phrase starts: ". ", "!", "?", ";" or a line break.
_SENTENCE_END = re.compile(r"[.!?;](?:\s|$)|\n")
# A correction of an answer given before: "Wait, it is 9", "Actually, it's 9", "No, that should be
# 9", "Oops, the correct answer is 9" (an answer phrase itself, found as one); "no" only as an
# interjection ("no matter how it is split" is none). The cue and the
# statement are at most 40 characters apart, so that a search stays linear.
_CORRECTION = re.compile(
    r"\b(?:wait|actually|oops|sorry|correction|no(?=\s*[,.;!])|hmm|on second thought)\b[^.!?;\n]{0,40}?"
    r"\b(?:it|that|this)(?:'s|\s+is|\s+should\s+be|\s+must\s+be)\b",
    re.IGNORECASE,
)
# A computation, which a remark after the answer may show ("that is 3 x 24") and a correction does not.
_COMPUTATION = re.compile(r"\d\s*(?:[x\u00d7*+=\u00f7]|\\times|\\cdot)\s*\d")
# An answer that says what it is not: "not 72", "definitely not 72", "never 72"; "not 72 but 70" is 70.
_NEGATED = re.compile(r"(?:[^\W\d_]+ly\s+)?(?:not|never)\b", re.IGNORECASE)
_BUT = re.compile(r"\b(?:but|rather|instead)\b[\s,:]*", re.IGNORECASE)
# A bare sentence that denies: "The answer isn't 72.", "It is not 72."
_DENIAL = re.compile(r"\b(?:not|never|cannot)\b|n't\b", re.IGNORECASE)
# The end of a bare answer that is a sentence: ".", "!" or "?", then only closing marks.
_ENDS_A_SENTENCE = re.compile(r"[.!?][\s*\"')\]$]*\Z")
# Words a bare number may take after it without ending a sentence: a unit ("72 clips", "72 square
# meters", "72 in all").
_MAX_UNIT_WORDS = 2

# A digit-group separator between digits: LaTeX's "{,}" and "\,", thin and no-break spaces.
_DIGIT_GROUP = re.compile(r"(?<=\d)(?:\{,\}|\\,|[\u2009\u202f\u00a0])(?=\d{3}(?!\d))")
# LaTeX that decorates a number without changing it (for plain_number; Math-Verify reads it itself).
_LATEX_TEXT = re.compile(r"\\(?:text|textbf|textrm|mathrm|mathbf|mbox)\s*\{([^{}]*)\}")
_LATEX_SPACING = re.compile(r"\\(?:(?:left|right|displaystyle|quad|qquad)(?![A-Za-z])|[,;:! ()\[\]%])")

# A number as written in prose: 28,080.5 (groups of three), 28080, 0.5, .5.
_NUMBER = re.compile(r"\d{1,3}(?:,\d{3})+(?:\.\d+)?(?!\d)|\d+(?:\.\d+)?|\.\d+")
# What may surround the one number of a plain answer: letters, spaces, punctuation, currency, %.
_DECORATION = re.compile(r"(?:[^\W\d_]|[\s.,:;!?'\"()*$\u20ac\u00a3\u00a5%&-])*")
_CURRENCY_AND_SPACE = " \t$\u20ac\u00a3\u00a5"

# What makes a whole completion more than a bare answer: a word (LaTeX commands aside), or "=".
_LATEX_COMMAND = re.compile(r"\\[A-Za-z]+")
_WORD = re.compile(r"[^\W\d_]{2,}")


def marked_answer(text: str) -> str | None:
    """What the last answer marker of ``text`` marks, or None without one.

    The markers are a complete ``\\boxed{...}`` (its content), ``#### N`` (the rest of its
    sentence; not a numbered heading ``#### 3. Totals``), "answer is" / "answer:" (the rest of its
    sentence) and a heading "Final Answer" (the next line); the one that starts last wins, so
    ``The answer is $\\boxed{72}$`` gives ``72``. A correction after it that states a number
    (``Wait, it is 9.``, ``Actually, it's 9.``) replaces it with the rest of its sentence. A marker at
    the very end (the completion was cut off right after it) marks the empty string, and so does a
    negated answer (``not 72``; ``not 72 but 70`` marks ``70``).
    """
    candidates: list[tuple[int, str]] = []
    boxed = find_last_boxed(text)
    if boxed is not None:
        candidates.append(boxed)
    for pattern in (_HASHES, _ANSWER_PHRASE):
        last = _last_match(pattern, text)
        if last is not None:
            if pattern is _HASHES and _NUMBERED_HEADING.match(text, last.end()):
                continue
            candidates.append((last.start(), _rest_of_sentence(text, last.end())))
    if not candidates:
        return None
    start, marked = max(candidates, key=lambda candidate: candidate[0])
    correction = _last_match(_CORRECTION, text, start + 1)
    # a correction states a value ("Wait, it is 9."), not a computation ("72. Hmm, that is 3 x 24.",
    # "72, no matter how it is split: 36 + 36")
    if correction is not None:
        corrected = _rest_of_sentence(text, correction.end())
        if any(ch.isdigit() for ch in corrected) and not _COMPUTATION.search(corrected):
            marked = corrected
    return _affirmed(marked)


def _last_match(pattern: re.Pattern, text: str, start: int = 0) -> re.Match | None:
    last = None
    for last in pattern.finditer(text, start):
        pass
    return last


def _affirmed(marked: str) -> str:
    """What an answer text affirms: ``""`` for a negated one (``not 72``), what follows "but" in
    ``not 72 but 70``, else all of it."""
    stripped = marked.lstrip()
    negation = _NEGATED.match(stripped)
    if negation is None:
        return marked
    but = _BUT.search(stripped, negation.end())
    return stripped[but.end() :] if but else ""


def _rest_of_sentence(text: str, start: int) -> str:
    """The text from ``start`` to the end of its sentence, leading spaces, colons and ``**`` skipped
    (``The answer is:\\n\\n72`` gives ``72``)."""
    while start < len(text) and text[start] in " \t\r\n*:":
        start += 1
    end = _SENTENCE_END.search(text, start)
    return text[start : end.start() if end else len(text)]


def final_answer(text: str, answer_tag: str | None = "answer") -> str | None:
    """The final answer ``text`` commits to (see the module docstring), or None if it commits to none.

    ``answer_tag`` names the block that holds the answer; None looks for markers only.
    """
    if answer_tag:
        block = last_tag_content(text, answer_tag)
        if block is not None:
            marked = marked_answer(block)
            return block.strip() if marked is None else marked.strip()
    marked = marked_answer(text)
    if marked is not None:
        return marked.strip()
    bare = text.strip()
    return bare if _is_bare_answer(bare) else None


def _has_words(text: str) -> bool:
    return _WORD.search(_LATEX_COMMAND.sub(" ", text)) is not None


def _is_bare_answer(text: str) -> bool:
    """A number alone or with a unit (``72``, ``$72``, ``72 clips``), a sentence that ends, holds one
    number and denies nothing (``She sold 72 clips.``), or a formula without words and without ``=``
    (``\\frac{1}{2}``, ``1/2``). Not a sentence cut off (``Natalia sold 48 clips in April and``)."""
    number = _the_number(normalize_answer_text(text))
    if number is not None:
        _, before, after = number
        if _DENIAL.search(text):
            return False
        if _ENDS_A_SENTENCE.search(text):
            return True
        return not _WORD.search(before) and len(_WORD.findall(after)) <= _MAX_UNIT_WORDS
    return any(ch.isdigit() for ch in text) and "=" not in text and not _has_words(text)


def normalize_answer_text(text: str) -> str:
    """``text`` with the typography that Math-Verify misreads made plain; values are unchanged.

    The minus sign ``\u2212`` becomes ``-``; ``\\$`` becomes ``$`` and ``-$5`` becomes ``-5``;
    markdown bold (``**``) goes; separators between digit groups (``28\\,080``, ``28{,}080``,
    thin and no-break spaces) become commas.
    """
    text = text.replace("\u2212", "-").replace("\\$", "$").replace("-$", "-").replace("**", "")
    return _DIGIT_GROUP.sub(",", text)


def plain_number(text: str) -> Fraction | None:
    """The value of ``text`` if it holds exactly one number and otherwise only words, spaces,
    punctuation, currency signs, ``%`` and LaTeX that only decorates (``\\text{cm}``, ``\\(``,
    ``\\,``, ``\\%``); else None (Math-Verify's case).

    Run on :func:`normalize_answer_text`'s output. A ``-`` right before the number (a currency sign
    or spaces between allowed: ``$-5``) makes it negative; a hyphen inside a word does not.
    ``25%`` is 25, as GSM8K writes percentages.
    """
    number = _the_number(text)
    return None if number is None else number[0]


def _the_number(text: str) -> tuple[Fraction, str, str] | None:
    """:func:`plain_number`'s value of ``text``, and the text before and after the number (LaTeX
    decoration made plain); None where :func:`plain_number` gives None."""
    text = _LATEX_SPACING.sub(" ", _LATEX_TEXT.sub(r" \1 ", text))
    numbers = _NUMBER.finditer(text)
    number = next(numbers, None)
    if number is None or next(numbers, None) is not None:
        return None
    before, after = text[: number.start()], text[number.end() :]
    if not _DECORATION.fullmatch(before) or not _DECORATION.fullmatch(after):
        return None
    value = Fraction(number.group().replace(",", ""))
    prefix = before.rstrip(_CURRENCY_AND_SPACE)
    if prefix.endswith("-") and not prefix[:-1][-1:].isalnum():
        value = -value
    return value, before, after
