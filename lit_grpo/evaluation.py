"""Evaluation while training: pass@k, mean@k and maj@k of k sampled completions per prompt.

Pure tensor functions (no Lightning import); the module feeds them to ``torchmetrics`` aggregators
so that the values reduce correctly across ranks (a weighted mean over every rank's prompts).

For one prompt with ``n`` sampled completions of which ``c`` are correct (reward at or above the
success threshold):

- ``pass@k`` (Chen et al. 2021, "Evaluating Large Language Models Trained on Code",
  arXiv:2107.03374): the unbiased estimate of the probability that at least one of ``k`` completions
  drawn without replacement from the ``n`` is correct, ``1 - C(n - c, k) / C(n, k)``;
- ``mean@n``: the mean reward of the ``n`` completions;
- ``maj@n``: whether the most frequent answer among the ``n`` (ties: the first seen) is correct
  (self-consistency, Wang et al. 2022, arXiv:2203.11171); reported only for binary rewards.
"""

from __future__ import annotations

from collections import Counter

import torch

__all__ = ["majority_correct", "pass_at_k"]


def pass_at_k(num_correct: torch.Tensor, num_samples: int, k: int) -> torch.Tensor:
    """Unbiased pass@k per prompt, ``[B] -> [B]``, from ``c`` correct out of ``n`` samples.

    Computed as ``1 - prod_{i = n - c + 1}^{n} (1 - k / i)``, the numerically stable form of
    ``1 - C(n - c, k) / C(n, k)`` (1 when ``n - c < k``).
    """
    if not 1 <= k <= num_samples:
        raise ValueError(f"pass@k needs 1 <= k <= n = {num_samples} samples, got k = {k}")
    values = []
    for c in num_correct.tolist():
        c = int(c)
        if num_samples - c < k:
            values.append(1.0)
            continue
        i = torch.arange(num_samples - c + 1, num_samples + 1, dtype=torch.float64)
        values.append(1.0 - float(torch.prod(1.0 - k / i)))
    return torch.tensor(values, dtype=torch.float64)


def majority_correct(answers: list[list[str]], correct: torch.Tensor) -> torch.Tensor:
    """``[B]`` 1.0 where the most frequent of a prompt's answers (first seen on ties) is correct.

    ``answers[b][j]`` is completion ``j`` of prompt ``b`` reduced to its answer; ``correct`` is
    ``[B, n]`` bool.
    """
    result = []
    for prompt_answers, prompt_correct in zip(answers, correct.tolist()):
        counts = Counter(prompt_answers)
        top = max(counts.values())
        winner = next(answer for answer in prompt_answers if counts[answer] == top)  # first seen on ties
        result.append(float(prompt_correct[prompt_answers.index(winner)]))
    return torch.tensor(result, dtype=torch.float64)
