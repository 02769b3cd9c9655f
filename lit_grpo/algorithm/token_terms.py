"""The per-token terms of the GRPO loss: KL to the reference, the importance ratio, the policy
objectives (PPO's clipped surrogate, CISPO, SAPO, VESPO's sequence weight), which tokens train, and the clip statistics.

Shapes: ``N`` completions of padded length ``T``; ``logps[i, t]`` is the log-probability of
completion token ``t`` of completion ``i``, ``completion_mask[i, t]`` 1 on real tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

def k3_kl(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(policy || reference) (Schulman 2020, "Approximating KL divergence").

    ``kl = exp(ref - logp) - (ref - logp) - 1``, non-negative and unbiased, ``[N, T] -> [N, T]``.
    """
    delta = ref_logps - logps
    return torch.exp(delta) - delta - 1


def kl_estimate(logps: torch.Tensor, ref_logps: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from the sampled tokens' log-probs, ``[N, T]``.

    Schulman 2020, "Approximating KL divergence" (http://joschu.net/blog/kl-approx.html), with
    ``log_r = logp - ref`` on tokens sampled from the policy:

    - ``k1 = log_r``: unbiased, high variance, can be negative;
    - ``k2 = log_r ** 2 / 2``: biased, low variance, non-negative (its gradient is that of a
      reverse-KL penalty on the sampled tokens);
    - ``k3 = exp(-log_r) + log_r - 1``: unbiased, low variance, non-negative (GRPO's choice; :func:`k3_kl`).
    """
    if estimator == "k1":
        return logps - ref_logps
    if estimator == "k2":
        return 0.5 * (logps - ref_logps) ** 2
    if estimator == "k3":
        return k3_kl(logps, ref_logps)
    raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")


KL_ESTIMATORS = ("k1", "k2", "k3")

IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")


def importance_ratio(
    logps: torch.Tensor, old_logps: torch.Tensor, completion_mask: torch.Tensor, level: str = "token"
) -> torch.Tensor:
    """Importance ratio between the current policy and the policy that sampled.

    ``token`` (GRPO/PPO): ``rho[i, t] = exp(logp[i, t] - old_logp[i, t])``, shape ``[N, T]``.
    ``sequence`` (GSPO; Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv:2507.18071):
    one ratio per completion from the masked mean log-ratio, ``rho_i = exp(mean_t(logp - old_logp))``,
    shape ``[N, 1]`` so it broadcasts over tokens.
    """
    log_ratio = logps - old_logps  # [N, T]
    if level == "token":
        return torch.exp(log_ratio)
    if level == "sequence":
        mask = completion_mask.to(log_ratio.dtype)
        seq_log_ratio = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)  # [N]
        return torch.exp(seq_log_ratio).unsqueeze(-1)  # [N, 1]
    raise ValueError(f"importance_sampling_level must be one of {IMPORTANCE_SAMPLING_LEVELS}, got {level!r}")


def clipped_surrogate_loss(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    epsilon_low: float,
    epsilon_high: float,
    delta: float | None = None,
) -> torch.Tensor:
    """PPO's clipped surrogate (Schulman et al. 2017), per token, as a loss to minimise.

    ``l = -min(rho * A, clamp(rho, 1 - epsilon_low, 1 + epsilon_high) * A)``. An ``epsilon_high``
    above ``epsilon_low`` is DAPO's "clip-higher" (Yu et al. 2025, arXiv:2503.14476).

    ``delta`` (two-sided clipping; INTELLECT-2, Prime Intellect 2025, arXiv:2505.07291): the
    unclipped term uses ``min(rho, delta)``, so a token with ``A < 0`` and a huge ratio, which
    PPO's ``min`` leaves unbounded, contributes at most ``delta * |A|``. ``delta > 1 + epsilon_high``.

    Args:
        ratio: ``[N, T]`` or ``[N, 1]`` importance ratios.
        advantages: ``[N]`` one advantage per completion, broadcast over its tokens.
    Returns:
        per-token loss ``[N, T]`` (``[N, 1]`` for a sequence-level ratio).
    """
    advantages = advantages.unsqueeze(-1)  # [N, 1]
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high) * advantages
    if delta is not None:
        ratio = torch.clamp(ratio, max=delta)
    unclipped = ratio * advantages
    return -torch.min(unclipped, clipped)


def cispo_loss(ratio: torch.Tensor, advantages: torch.Tensor, logps: torch.Tensor, epsilon_max: float) -> torch.Tensor:
    """CISPO (MiniMax 2025, "MiniMax-M1", arXiv:2506.13585), per token, as a loss to minimise.

    ``l = -sg(min(rho, epsilon_max)) * A * logp``: the importance weight is clipped and detached
    (stop-gradient), and every token keeps a REINFORCE gradient ``A * grad logp`` scaled by it, so no
    token is dropped by clipping as in PPO. ``epsilon_max`` is ``model.epsilon_high`` used as an
    absolute bound, as in TRL (ScaleRL recommends 5.0).
    """
    weight = torch.clamp(ratio, max=epsilon_max).detach()  # [N, T] or [N, 1]
    return -weight * advantages.unsqueeze(-1) * logps


def sapo_loss(
    ratio: torch.Tensor, advantages: torch.Tensor, temperature_pos: float, temperature_neg: float
) -> torch.Tensor:
    """SAPO (Gao et al. 2025, "Soft Adaptive Policy Optimization", arXiv:2511.20347), per token.

    A smooth gate instead of the hard clip: ``l = -(4 / tau) * sigmoid(tau * (rho - 1)) * A``, with
    ``tau = temperature_pos`` for ``A > 0`` and ``temperature_neg`` otherwise. At ``rho = 1`` the
    gradient equals the unclipped ``A * grad rho`` (``sigmoid' (0) = 1/4``); it fades smoothly as the
    ratio moves away from 1, faster for negative advantages when ``temperature_neg > temperature_pos``.
    """
    advantages = advantages.unsqueeze(-1)  # [N, 1]
    tau = torch.where(advantages > 0, temperature_pos, temperature_neg)  # [N, 1]
    return -(4.0 / tau) * torch.sigmoid(tau * (ratio - 1)) * advantages


# VESPO clamps the log-weights to [log 1e-8, 20] (TRL 1.16, ``GRPOTrainer.get_gamma_weights``)
VESPO_LOG_WEIGHT_MIN = math.log(1e-8)
VESPO_LOG_WEIGHT_MAX = 20.0


@torch.no_grad()
def vespo_gamma_weights(
    advantages: torch.Tensor,
    log_ratio: torch.Tensor,
    completion_mask: torch.Tensor,
    sampling_weights: torch.Tensor | None = None,
    k_pos: float = 2.0,
    lambda_pos: float = 3.0,
    k_neg: float = 3.0,
    lambda_neg: float = 2.0,
) -> torch.Tensor:
    """VESPO's sequence weight ``phi(w) = exp(lambda) * w**k * exp(-lambda * w)`` (Gamma-shaped,
    ``phi(1) = 1``; "Variational Sequence-Level Soft Policy Optimization", arXiv:2602.10693), ``[n, 1]``,
    without gradient. As TRL 1.16's ``GRPOTrainer.get_gamma_weights``:

    - ``log w = sum_t m * clamp(logp - old_logp, -20, 20)``, the sequence's summed log-ratio (not a
      mean), plus with ``sampling_weights`` (a token-level correction for another engine, ``[n, T]``)
      the sum over every position of ``clamp(log weight, log 1e-8, 20)``; then clamped to
      ``[log 1e-8, 20]``;
    - ``(k, lambda) = (k_pos, lambda_pos)`` where ``A >= 0``, else ``(k_neg, lambda_neg)``;
      ``lambda`` at least 1e-4;
    - ``phi = exp(lambda + k * log w - lambda * w)``, non-finite values set to 0.

    ``advantages [n]``, ``log_ratio [n, T]`` (``logp - old_logp`` per token), ``completion_mask [n, T]``.
    """
    if sampling_weights is not None and sampling_weights.shape != log_ratio.shape:
        # a sequence-level weight [n, 1] would be summed in as one token's: TRL refuses sequence modes for vespo
        raise ValueError(
            f"vespo_gamma_weights takes token-level sampling_weights of the log-ratios' shape "
            f"{tuple(log_ratio.shape)}, "
            f"got {tuple(sampling_weights.shape)} (a sequence-level correction mode?)"
        )
    mask = completion_mask.to(log_ratio.dtype)
    seq_log_ratio = (log_ratio.clamp(-20.0, 20.0) * mask).sum(dim=-1, keepdim=True)  # [n, 1]
    if sampling_weights is not None:
        log_sampling = torch.log(sampling_weights).clamp(VESPO_LOG_WEIGHT_MIN, VESPO_LOG_WEIGHT_MAX)  # [n, T]
        seq_log_ratio = seq_log_ratio + log_sampling.sum(dim=-1, keepdim=True)
    log_w = seq_log_ratio.clamp(VESPO_LOG_WEIGHT_MIN, VESPO_LOG_WEIGHT_MAX)  # [n, 1]
    non_negative = advantages.unsqueeze(-1) >= 0  # [n, 1]
    k = torch.where(non_negative, k_pos, k_neg).to(log_w.dtype)
    lam = torch.where(non_negative, lambda_pos, lambda_neg).to(log_w.dtype).clamp(min=1e-4)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)  # [n, 1]


def vespo_loss(gamma_weights: torch.Tensor, advantages: torch.Tensor, logps: torch.Tensor) -> torch.Tensor:
    """VESPO's per-token loss ``-phi_i * A_i * logp[i, t]`` (``phi`` from :func:`vespo_gamma_weights`,
    detached): the gradient is REINFORCE's ``A * grad logp`` scaled by the soft sequence weight,
    which replaces PPO's hard clip. ``[n, 1], [n], [n, T] -> [n, T]``."""
    return -gamma_weights.detach() * advantages.unsqueeze(-1) * logps


def high_entropy_mask(
    entropy: torch.Tensor, completion_mask: torch.Tensor, top_quantile: float, reference_entropies: torch.Tensor | None = None
) -> torch.Tensor:
    """Tokens among the ``top_quantile`` fraction of highest entropy (Wang et al. 2025, "Beyond the
    80/20 Rule: High-Entropy Minority Tokens Drive Effective RL", arXiv:2506.01939), ``[n, T]`` bool.

    The threshold is the ``1 - top_quantile`` quantile of ``reference_entropies`` (the real tokens'
    entropies over which the fraction is taken, e.g. gathered from every rank), by default the real
    tokens of ``entropy``. ``top_quantile = 1`` keeps every real token.
    """
    real = completion_mask.bool()
    if reference_entropies is None:
        reference_entropies = entropy[real]
    if top_quantile >= 1.0 or reference_entropies.numel() == 0:
        return real
    threshold = torch.quantile(reference_entropies.detach().float(), 1.0 - top_quantile)
    return real & (entropy.detach() >= threshold)


@dataclass
class ClipFractions:
    """Fraction of real tokens whose ratio the clip cut off (TRL's ``clip_ratio/*`` metrics)."""

    low: torch.Tensor  # A < 0 and rho < 1 - epsilon_low
    high: torch.Tensor  # A > 0 and rho > 1 + epsilon_high
    region: torch.Tensor  # either of the two


def clip_fractions(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    epsilon_low: float,
    epsilon_high: float,
) -> ClipFractions:
    """Masked fractions of tokens clipped below, above, and in total (see :class:`ClipFractions`)."""
    ratio = ratio.detach().expand_as(completion_mask.to(ratio.dtype))  # [N, T]
    advantages = advantages.unsqueeze(-1)  # [N, 1]
    low = (ratio < 1 - epsilon_low) & (advantages < 0)
    high = (ratio > 1 + epsilon_high) & (advantages > 0)
    return ClipFractions(
        low=masked_mean(low.float(), completion_mask),
        high=masked_mean(high.float(), completion_mask),
        region=masked_mean((low | high).float(), completion_mask),
    )


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over the positions where ``mask`` is 1 (0 when the mask is empty)."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1.0)

