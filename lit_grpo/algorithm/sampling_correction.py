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
  ratio is outside ``[mask_ratio_low, mask_ratio_high]``, default ``[0.125, 8]``, leave the loss).
  That is ``token_mask`` here with ``trainer_logps`` the proximal policy's; with ``max_staleness >
  0`` the default, with prime-rl's bounds (:func:`correction_settings`).

Why per token under staleness: one weight per sequence is the product of its tokens' ratios, far
from 1 once the weights have moved. ``sequence_mask`` (TRL's default against the engine mismatch)
then zeroes the sequences the last update made more likely (the ones it reinforced) and keeps, at
weights near 0, the ones it made less likely: one-sided, and most of the batch's signal lost (on the
quickstart at ``max_staleness: 1`` it stalled on the 0.25 plateau the synchronous run leaves after
about 150 steps: ``bench/results/staleness.md``).

With one optimizer step per batch the clipped ratio against the proximal policy is 1 (the trainer's
weights have not moved yet), so the clip bounds nothing and a stale batch pushes on tokens the step
before already moved: keep the learning rate lower than a synchronous run's (docs/configuration.md,
"Asynchronous GRPO").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

__all__ = [
    "AUTO",
    "SAMPLING_CORRECTION_MODES",
    "SAMPLING_CORRECTION_SETTINGS",
    "CorrectionSettings",
    "SamplingCorrection",
    "correction_settings",
    "off_policy_sequence_mask",
    "sampling_correction",
]

SAMPLING_CORRECTION_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
AUTO = "auto"
# what ``model.vllm_importance_sampling_mode`` may say: a mode, or "auto" (:func:`correction_settings`)
SAMPLING_CORRECTION_SETTINGS = (AUTO, *SAMPLING_CORRECTION_MODES)


class CorrectionSettings(NamedTuple):
    """A correction's mode and the range ``[clip_min, clip_max]`` its weights are kept in (None: unbounded)."""

    mode: str
    clip_min: float | None
    clip_max: float | None

    def as_hparams(self) -> dict:
        """The three ``model.vllm_importance_sampling_*`` settings, resolved."""
        return {"vllm_importance_sampling_mode": self.mode, "vllm_importance_sampling_clip_min": self.clip_min,
                "vllm_importance_sampling_clip_max": self.clip_max}


# TRL 1.16's defaults against the engine mismatch alone (weights near 1): one weight per sequence, 0 above 3
ENGINE_MISMATCH = CorrectionSettings("sequence_mask", None, 3.0)
# With staleness: per token, tokens outside [1/8, 8] leave the loss (prime-rl's mask_ratio_low / _high)
STALENESS = CorrectionSettings("token_mask", 0.125, 8.0)


def correction_settings(mode: str, clip_min, clip_max, max_staleness: int) -> CorrectionSettings:
    """The correction of ``model.vllm_importance_sampling_mode`` / ``_clip_min`` / ``_clip_max``: each as
    written, or where it says ``"auto"`` :data:`ENGINE_MISMATCH`'s in a synchronous run and
    :data:`STALENESS`'s with ``max_staleness > 0`` (see the module doc)."""
    default = STALENESS if max_staleness > 0 else ENGINE_MISMATCH
    return CorrectionSettings(
        mode=default.mode if mode == AUTO else mode,
        clip_min=default.clip_min if clip_min == AUTO else clip_min,
        clip_max=default.clip_max if clip_max == AUTO else clip_max,
    )


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
        # torch.clamp refuses two None bounds; with no bound the ratio is kept whole.
        unbounded = clip_min is None and clip_max is None
        weights = ratio if unbounded else ratio.clamp(min=clip_min, max=clip_max)
    else:
        weights = ratio.masked_fill(changed, 0.0)
    return SamplingCorrection(weights=weights, ratio=ratio, changed=changed)


def off_policy_sequence_mask(
    advantages: torch.Tensor,
    logps: torch.Tensor,
    sampling_logps: torch.Tensor,
    completion_mask: torch.Tensor,
    threshold: float,
) -> torch.Tensor:
    """Off-policy sequence masking (DeepSeek-AI 2025, "DeepSeek-V3.2", arXiv:2512.02556, eq. 9), as
    TRL 1.16's ``GRPOTrainer.get_off_policy_mask`` (``off_policy_mask_threshold``): ``[n, 1]``, 1.0 to
    keep a sequence's policy loss, 0.0 to drop it.

    A sequence is dropped when its advantage is negative *and* its mean KL to the sampling policy,
    ``mean_t m * (sampling_logp - logp)`` over its real tokens (the k1 estimate of KL(sampling ||
    policy); NaN differences, tokens the engine did not score, count as 0), is above ``threshold``:
    pushing down a completion the policy has already moved far from is mostly noise.

    ``advantages [n]``; ``logps [n, T]`` the current policy's (detached here); ``sampling_logps
    [n, T]`` the policy's that sampled (another engine's where it scored them, else the trainer's
    ``old_logps``); ``completion_mask [n, T]``.
    """
    mask = completion_mask.to(logps.dtype)
    kl = torch.nan_to_num(sampling_logps - logps.detach(), nan=0.0)  # [n, T]
    mean_kl = (kl * mask).sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1.0)  # [n, 1]
    keep = (advantages.unsqueeze(-1) >= 0) | (mean_kl <= threshold)  # [n, 1]
    return keep.to(mask.dtype)
