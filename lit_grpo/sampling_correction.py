"""Importance weights for completions another engine sampled (vLLM), as pure tensor math.

The sampling engine computes slightly different probabilities than the trainer for the same
weights (other kernels, other precision), so its samples are not exactly on-policy for the trainer.
TRL 1.16's ``vllm_importance_sampling_correction`` reweights each token's policy loss by
``rho = pi_trainer / pi_engine`` (per token, or per sequence as ``exp`` of the summed log-ratio),
truncated to ``[clip_min, clip_max]`` or set to 0 outside it (Yao et al. 2025, "Your Efficient RL
Framework Secretly Brings You Off-Policy RL Training").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["SAMPLING_CORRECTION_MODES", "SamplingCorrection", "sampling_correction"]

SAMPLING_CORRECTION_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


@dataclass
class SamplingCorrection:
    """Truncated importance sampling between the engine that sampled and the trainer's policy."""

    weights: torch.Tensor  # [n, T] (token modes) or [n, 1] (sequence modes): multiply each token's policy loss
    ratio: torch.Tensor  # the same shape, before truncation or masking
    changed: torch.Tensor  # the same shape, bool: truncated or masked


def sampling_correction(
    trainer_logps: torch.Tensor,
    sampling_logps: torch.Tensor,
    completion_mask: torch.Tensor,
    mode: str = "sequence_mask",
    clip_min: float | None = None,
    clip_max: float | None = 3.0,
) -> SamplingCorrection:
    """TRL 1.16's ``vllm_importance_sampling_correction``: the sampling engine (vLLM) computes
    slightly different probabilities than the trainer, so its samples are reweighted by
    ``rho = pi_trainer / pi_engine`` (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings
    You Off-Policy RL Training"), per token or per sequence (``exp`` of the summed log-ratio), then
    truncated to ``[clip_min, clip_max]`` (``*_truncate``) or set to 0 outside it (``*_mask``).

    ``trainer_logps`` are the trainer's log-probs under the policy that sampled (no gradient);
    ``sampling_logps`` the engine's; both ``[n, T]``. NaN differences (tokens the engine did not score)
    count as 0.
    """
    if mode not in SAMPLING_CORRECTION_MODES:
        raise ValueError(f"sampling correction mode must be one of {SAMPLING_CORRECTION_MODES}, got {mode!r}")
    mask = completion_mask.to(trainer_logps.dtype)
    log_ratio = torch.nan_to_num((trainer_logps.detach() - sampling_logps) * mask, nan=0.0)  # [n, T]
    if mode.startswith("sequence"):
        log_ratio = log_ratio.sum(dim=-1, keepdim=True)  # [n, 1]
    ratio = torch.exp(log_ratio)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    changed = (ratio < low) | (ratio > high)
    if mode.endswith("truncate"):
        weights = ratio.clamp(min=clip_min, max=clip_max)
    else:
        weights = ratio.masked_fill(changed, 0.0)
    return SamplingCorrection(weights=weights, ratio=ratio, changed=changed)
