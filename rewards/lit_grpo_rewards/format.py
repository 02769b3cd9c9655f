"""Rewards for the shape of a completion."""

from __future__ import annotations

import functools
import re

__all__ = ["think_format"]

from lit_grpo_rewards.text import completion_text


@functools.lru_cache(maxsize=32)
def _format_re(think_tag: str, answer_tag: str) -> re.Pattern:
    t, a = re.escape(think_tag), re.escape(answer_tag)
    return re.compile(rf"^<{t}>.*?</{t}>\s*<{a}>.*?</{a}>$", re.DOTALL)


def think_format(completions, think_tag="think", answer_tag="answer", **kwargs) -> list[float]:
    """1.0 if the completion is ``<think>...</think>`` then ``<answer>...</answer>``, else 0.0.

    The whole completion (surrounding whitespace ignored) must match
    ``^<think>.*?</think>\\s*<answer>.*?</answer>$`` (``.`` matches newlines too), as in
    DeepSeek-R1's format reward.

    args:
        think_tag (str): name of the reasoning tag (default ``think``).
        answer_tag (str): name of the answer tag (default ``answer``).
    """
    pattern = _format_re(think_tag, answer_tag)
    return [1.0 if pattern.match(completion_text(c).strip()) else 0.0 for c in completions]
