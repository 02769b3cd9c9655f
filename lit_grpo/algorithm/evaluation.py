"""Evaluation while training: pass@k, mean@k and maj@k of k sampled completions per prompt.

Pure tensor functions (no Lightning import), and :class:`ValidationMetrics`, the ``torchmetrics``
aggregators the module logs, so that the values reduce correctly across ranks (a weighted mean over
every rank's prompts).

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
from collections.abc import Callable

import torch
import torchmetrics

__all__ = ["ValidationMetrics", "majority_correct", "pass_at_k"]


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


class ValidationMetrics(torch.nn.ModuleDict):
    """The validation metrics of one epoch: ``reward``, ``mean@k``, ``pass@j`` for each j of
    ``pass_ks`` and (for binary rewards) ``maj@k``, each a ``torchmetrics.MeanMetric`` reduced over
    every rank's prompts when the epoch ends."""

    def __init__(self, pass_ks: list[int]) -> None:
        super().__init__({name: torchmetrics.MeanMetric() for name in ["reward", "mean", "maj", *(f"pass{k}" for k in pass_ks)]})
        self.pass_ks = list(pass_ks)

    def add_batch(
        self, rewards: torch.Tensor, answers: list[list[str]], threshold: float, all_ranks_min: Callable[[torch.Tensor], torch.Tensor]
    ) -> None:
        """Add one batch: ``rewards`` ``[B, k]`` (NaN where no reward applied) of the completions whose
        normalised texts are ``answers[b]``; a completion is correct at ``reward >= threshold``.
        ``all_ranks_min`` reduces a value over the ranks (maj@k only where every rank's rewards are binary)."""
        k = rewards.size(1)
        valid = ~torch.isnan(rewards)
        correct = valid & (rewards >= threshold)  # [B, k]
        self["reward"].update(rewards[valid])
        per_prompt_mean = rewards.nanmean(dim=1)  # [B], NaN for a prompt no reward applied to
        self["mean"].update(per_prompt_mean[~torch.isnan(per_prompt_mean)])
        for pass_k in self.pass_ks:
            self[f"pass{pass_k}"].update(pass_at_k(correct.sum(dim=1), k, pass_k).to(rewards.device))
        binary = torch.tensor(float(bool(((rewards[valid] == 0) | (rewards[valid] == 1)).all())), device=rewards.device)
        if float(all_ranks_min(binary)) == 1.0:
            self["maj"].update(majority_correct(answers, correct.cpu()).to(rewards.device))

    def to_log(self, k: int) -> dict[str, torchmetrics.Metric]:
        """``val/<name>`` -> metric, for ``LightningModule.log`` (maj@k once it has values)."""
        names = {"reward": "val/reward", "mean": f"val/mean@{k}", **{f"pass{j}": f"val/pass@{j}" for j in self.pass_ks}}
        if self["maj"].weight > 0:
            names["maj"] = f"val/maj@{k}"
        return {tag: self[name] for name, tag in names.items()}
