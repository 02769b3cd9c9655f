"""Importance weights for completions sampled by other weights or another engine, as pure tensor math.

Two reasons the policy that sampled (the *behaviour* policy) is not the one trained:

- the sampling engine computes slightly different probabilities than the trainer for the same
  weights (vLLM: other kernels, other precision). TRL 1.16's ``vllm_importance_sampling_correction``
  reweights each token's policy loss by ``rho = pi_trainer / pi_engine`` (per token, or per sequence
  as ``exp`` of the summed log-ratio), truncated to ``[clip_min, clip_max]`` or set to 0 outside it
  (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training");
- asynchronous GRPO (``model.max_staleness: k``): the weights that sampled are up to k optimizer
  steps old. This is decoupled PPO (Hilton et al. 2022, "Batch size-invariance for policy
  optimization"; AReaL, Fu et al. 2025, arXiv:2505.24298), with three policies: the behaviour policy
  ``pi_behav`` that sampled, the *proximal* policy ``pi_prox`` (the trainer's weights when the batch's
  update starts: the loss's ``old_logps``) and the policy being optimised ``pi_theta``. Each token's
  loss is the clipped surrogate of ``pi_theta / pi_prox`` (the trust region, around weights the
  trainer has) times the behaviour weight ``w = pi_prox / pi_behav`` (the off-policy correction),
  computed per token and left out of the loss above a cap: AReaL's ``ppo_actor_loss_fn``
  (``areal/utils/functional.py``: ``behav_imp_weight``, tokens above ``behav_imp_weight_cap`` masked)
  and prime-rl's token mask (``src/prime_rl/trainer/rl/loss.py``, ``compute_loss``: tokens whose
  ratio is outside ``[mask_ratio_low, mask_ratio_high]`` leave the loss). That is ``token_mask`` here
  with ``trainer_logps`` the proximal policy's, the default with ``max_staleness > 0``
  (:func:`correction_mode`).

Why per token under staleness: one weight per sequence is the product of its tokens' ratios, which
after an optimizer step is far from 1 for most sequences (16 tokens at 0.1 nat each: e^1.6 = 5).
``sequence_mask`` (TRL's default against the engine mismatch) then zeroes the sequences the last
update made more likely (ratio above the cap: the ones it reinforced) and keeps, with weights near 0,
the ones it made less likely: one-sided, and most of the batch's signal lost.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = [
    "SAMPLING_CORRECTION_MODES",
    "SAMPLING_CORRECTION_SETTINGS",
    "SamplingCorrection",
    "correction_mode",
    "sampling_correction",
]

SAMPLING_CORRECTION_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
# what ``model.vllm_importance_sampling_mode`` may say: a mode, or "auto" (:func:`correction_mode`)
SAMPLING_CORRECTION_SETTINGS = ("auto", *SAMPLING_CORRECTION_MODES)
ENGINE_MISMATCH_MODE = "sequence_mask"  # TRL 1.16's default, for synchronous runs
STALENESS_MODE = "token_mask"  # decoupled PPO's per-token behaviour weight, masked above the cap


def correction_mode(setting: str, max_staleness: int) -> str:
    """The correction mode of ``model.vllm_importance_sampling_mode``: as written, or for ``"auto"``
    TRL's ``sequence_mask`` in a synchronous run (the engine mismatch only: ratios near 1) and the
    decoupled correction ``token_mask`` with ``max_staleness > 0`` (see the module doc)."""
    if setting != "auto":
        return setting
    return STALENESS_MODE if max_staleness > 0 else ENGINE_MISMATCH_MODE


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

    ``trainer_logps`` are the trainer's log-probs under the policy that sampled, or with staleness
    under the proximal policy (the loss's ``old_logps``; no gradient); ``sampling_logps`` the
    behaviour policy's (the engine's, or the trainer's when the weights that sampled were older);
    both ``[n, T]``. NaN differences (tokens the engine did not score) count as 0.
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
