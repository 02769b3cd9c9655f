"""Penalties for repetitive completions."""

from __future__ import annotations

import math
import numbers

from lit_grpo_rewards.text import completion_text

__all__ = ["repetition_penalty"]


def repetition_penalty(completions, ngram_size: int = 3, max_penalty: float = -1.0, **kwargs) -> list[float]:
    """Penalty (max_penalty..0) for repeated word n-grams: 0.0 if none repeats, max_penalty if all do.

    As open-r1's ``get_repetition_penalty_reward`` (from Yeo et al. 2025, "Demystifying Long
    Chain-of-Thought Reasoning in LLMs", arXiv:2502.03373): the completion is lower-cased and split
    on whitespace into words, its word n-grams are counted, and the reward is
    ``(1 - unique_ngrams / total_ngrams) * max_penalty``. A completion with fewer than
    ``ngram_size`` words (an empty one included) scores 0.0.

    Example: ``"a b a b a b"`` with ``ngram_size=2`` has 5 bigrams, 2 of them distinct:
    ``(1 - 2/5) * -1.0 = -0.6``.

    args:
        ngram_size (int): words per n-gram, >= 1 (default 3).
        max_penalty (float): the reward of a completion made of one repeated n-gram as the length
            grows; must be <= 0 (default -1.0).

    columns: none.
    """
    if isinstance(ngram_size, bool) or not isinstance(ngram_size, numbers.Integral) or ngram_size < 1:
        raise ValueError(f"repetition_penalty: ngram_size must be an integer >= 1; got {ngram_size!r}")
    if (
        isinstance(max_penalty, bool)
        or not isinstance(max_penalty, numbers.Real)
        or not math.isfinite(max_penalty)
        or max_penalty > 0
    ):
        raise ValueError(f"repetition_penalty: max_penalty must be a number <= 0; got {max_penalty!r}")
    n = int(ngram_size)
    scores = []
    for completion in completions:
        words = completion_text(completion).lower().split()
        if len(words) < n:
            scores.append(0.0)
            continue
        ngrams = [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
        scaling = 1.0 - len(set(ngrams)) / len(ngrams)
        scores.append(scaling * float(max_penalty) + 0.0)  # + 0.0 turns -0.0 into 0.0
    return scores

# Safe in any thread (no signals, no state shared between calls): lit-grpo's scorer keeps such a
# reward in the asynchronous pipeline's scoring thread rather than in a worker process of its own.
repetition_penalty.thread_safe = True
