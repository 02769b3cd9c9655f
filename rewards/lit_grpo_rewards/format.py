"""Rewards for the shape of a completion."""

from __future__ import annotations

import functools
import re

__all__ = ["think_format"]

from lit_grpo_rewards.text import completion_text


@functools.lru_cache(maxsize=32)
def _format_re(think_tag: str, answer_tag: str, strict: bool) -> re.Pattern:
    t, a = re.escape(think_tag), re.escape(answer_tag)
    if strict:  # open-r1's format_reward layout: every tag on its own line
        return re.compile(rf"<{t}>\n.*?\n</{t}>\n<{a}>\n.*?\n</{a}>\n?", re.DOTALL)
    return re.compile(rf"<{t}>.*?</{t}>\s*<{a}>.*?</{a}>", re.DOTALL)


def think_format(
    completions, think_tag: str = "think", answer_tag: str = "answer", strict: bool = False, **kwargs
) -> list[float]:
    """1.0 if the completion is ``<think>...</think>`` then ``<answer>...</answer>``, else 0.0.

    The whole completion (surrounding whitespace ignored) must match
    ``<think>.*?</think>\\s*<answer>.*?</answer>`` (``.`` matches newlines too), as in
    DeepSeek-R1's format reward: the reasoning block comes first, only whitespace separates the two
    blocks, and nothing precedes or follows them. Each of the four tags must occur exactly once, so
    a second ``<answer>`` block (or a nested ``<think>``) scores 0.0.

    With ``strict``, the layout of open-r1's ``format_reward`` is required instead:
    ``"<think>\\n...\\n</think>\\n<answer>\\n...\\n</answer>"`` exactly (one trailing newline
    allowed, no other surrounding whitespace).

    args:
        think_tag (str): name of the reasoning tag (default ``think``).
        answer_tag (str): name of the answer tag (default ``answer``).
        strict (bool): require open-r1's one-tag-per-line layout (default false).

    columns: none.
    """
    if not think_tag or not answer_tag or think_tag == answer_tag:
        raise ValueError(
            f"think_format: think_tag and answer_tag must be two different non-empty names; "
            f"got think_tag={think_tag!r}, answer_tag={answer_tag!r}"
        )
    pattern = _format_re(think_tag, answer_tag, bool(strict))
    tags = [f"<{think_tag}>", f"</{think_tag}>", f"<{answer_tag}>", f"</{answer_tag}>"]
    scores = []
    for completion in completions:
        text = completion_text(completion)
        if not strict:
            text = text.strip()
        # counting first leaves the pattern one place for each tag: linear in the completion's length
        ok = all(text.count(tag) == 1 for tag in tags) and pattern.fullmatch(text) is not None
        scores.append(1.0 if ok else 0.0)
    return scores

# Safe in any thread (no signals, no state shared between calls): lit-grpo's scorer keeps such a
# reward in the asynchronous pipeline's scoring thread rather than in a worker process of its own.
think_format.thread_safe = True
