"""The entropy bonus (``entropy_coef``) and adaptive entropy control (Skywork-OR1), as TRL 1.16 has them.

The bonus subtracts ``coefficient * H`` from a micro-batch's loss, ``H`` the mean per-token entropy
of the policy over the tokens the policy term trains, the same for every ``loss_type``
(:func:`entropy_bonus_loss`). Adaptive control (He et al. 2025, "Skywork Open Reasoner 1 Technical
Report", arXiv:2505.22312) moves the coefficient by a fixed step after every optimizer step: up
while the entropy is at or below a target, down above it, within ``[coef_min, coef_max]``; the bonus
applies only while the entropy of the last step was at or below the target
(:class:`EntropyCoefficient`). TRL 1.16: ``GRPOTrainer._compute_loss`` (the block after the loss
types' aggregation) and ``_save_checkpoint`` / ``_load_from_checkpoint`` (the controller's state).
"""

from __future__ import annotations

import math

import torch

from lit_grpo.settings import EntropyControlSettings  # the record of the model.* keys, built once with the others

__all__ = ["EntropyCoefficient", "EntropyControlSettings", "entropy_bonus_loss", "entropy_sum_and_count", "token_entropy"]


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` over the last dimension *with its gradient*, ``[..., V] -> [...]``,
    for the bonus (:func:`lit_grpo.algorithm.entropy_from_logits` is a metric, without one).

    ``H = logsumexp(z) - sum_v softmax(z)_v * z_v``; a ``-inf`` logit (a token outside the sampling
    support, e.g. top-k) has probability 0 and adds 0 to the value and to the gradient. Divide the
    logits by the temperature (and apply the filters) first, as for the log-probs. Computed in float32
    (as :func:`lit_grpo.algorithm.entropy_from_logits`): over a vocabulary of 150k, bfloat16 sums are
    off by most of a nat; the result is float32, its gradient flows back in the logits' dtype.
    Autograd keeps the float32 logits (the same tensor the log-probs' backward keeps, when they are
    float32 already) and two values per position: :class:`EntropyOfLogits`.
    """
    return EntropyOfLogits.apply(logits.float())


class EntropyOfLogits(torch.autograd.Function):
    """``H(z) [...]`` of float32 logits ``z [..., V]``, whose backward recomputes the probabilities from
    ``z`` instead of keeping them (autograd's own graph of the formula keeps three more ``[..., V]``
    tensors: the probabilities, the finite logits and their mask). ``dH/dz_v = -p_v (log p_v + H)``."""

    @staticmethod
    def forward(ctx, z: torch.Tensor) -> torch.Tensor:
        log_normaliser = torch.logsumexp(z, dim=-1, keepdim=True)  # [..., 1]
        log_probs = z - log_normaliser  # [..., V], -inf off the support
        probs = torch.exp(log_probs)
        # -sum p log p (0 where p = 0, not 0 * -inf), not logsumexp(z) - sum p z: no difference of large numbers
        entropy = -torch.where(probs > 0, probs * log_probs, torch.zeros_like(z)).sum(-1)  # [...]
        ctx.save_for_backward(z, log_normaliser, entropy)
        return entropy

    @staticmethod
    @torch.autograd.function.once_differentiable  # the backward is no graph of its own: no second derivative
    def backward(ctx, grad_entropy: torch.Tensor) -> torch.Tensor:
        z, log_normaliser, entropy = ctx.saved_tensors
        log_probs = z - log_normaliser  # [..., V], -inf off the support
        probs = torch.exp(log_probs)
        # -p (log p + H), 0 where p = 0 (log p = -inf)
        grad_z = torch.where(probs > 0, -probs * (log_probs + entropy.unsqueeze(-1)), torch.zeros_like(z))
        return grad_z * grad_entropy.unsqueeze(-1)


def entropy_bonus_loss(
    entropies: torch.Tensor, token_mask: torch.Tensor, coefficient: float, micro_batches: int = 1
) -> torch.Tensor:
    """The entropy bonus's term of a micro-batch's loss, ``-coefficient * H / micro_batches``, ``[]``.

    ``H = sum(entropy * m) / max(sum(m), 1)`` is the mean per-token entropy over ``token_mask``
    (the completion tokens that count, times ``top_entropy_quantile``'s mask where that is on), with
    the gradient of ``entropies [n, T]``. It is never rescaled by a loss type's normaliser (dapo's
    global token count included), only divided by the micro-batches of the optimizer step, as TRL
    1.16 divides it by its gradient accumulation steps: add it to the loss *after* that loss's own
    accumulation scaling.
    """
    mask = token_mask.to(entropies.dtype)
    mean_entropy = (entropies * mask).sum() / mask.sum().clamp(min=1.0)
    return -coefficient * mean_entropy / micro_batches


def entropy_sum_and_count(entropies: torch.Tensor, token_mask: torch.Tensor) -> torch.Tensor:
    """``[2]``: the summed entropy over ``token_mask`` and the number of its tokens, detached. Summed
    over the micro-batches of an optimizer step and over ranks, they give the step's token-weighted
    mean entropy that :meth:`EntropyCoefficient.step` takes (TRL's ``_entropy_window_stats``)."""
    mask = token_mask.to(entropies.dtype)
    return torch.stack([(entropies * mask).sum(), mask.sum()]).detach()


class EntropyCoefficient:
    """The entropy coefficient of a run: fixed, or adapted after every optimizer step (Skywork-OR1).

    ``value`` is what TRL logs as ``entropy_coef`` (after each optimizer step);
    :meth:`applied` the coefficient every micro-batch of the next optimizer step uses, the same for
    all of them. The state (``value`` and the last step's entropy) goes into checkpoints through
    :meth:`state_dict` / :meth:`load_state_dict`, with TRL's keys.
    """

    def __init__(self, settings: EntropyControlSettings):
        self.settings = settings
        self.value = settings.entropy_coef
        # no measurement yet: infinity, so the first step applies no adaptive bonus (as TRL)
        self.last_entropy = math.inf

    def applied(self) -> float:
        """The coefficient of this optimizer step's bonus: ``value``, or under adaptive control
        ``value`` while the last step's entropy was at or below the target and 0 above it."""
        if not self.settings.use_adaptive_entropy:
            return self.value
        return self.value if self.last_entropy <= self.settings.entropy_target else 0.0

    def step(self, entropy: float) -> None:
        """After an optimizer step, with its mean per-token entropy over all ranks (``entropy_sum /
        max(count, 1)`` of :func:`entropy_sum_and_count`): under adaptive control, ``value`` moves by
        ``entropy_coef_delta`` up (entropy at or below the target) or down, within
        ``[entropy_coef_min, entropy_coef_max]``; a fixed coefficient stays."""
        settings = self.settings
        if not settings.use_adaptive_entropy:
            return
        if entropy <= settings.entropy_target:
            self.value = min(self.value + settings.entropy_coef_delta, settings.entropy_coef_max)
        else:
            self.value = max(self.value - settings.entropy_coef_delta, settings.entropy_coef_min)
        self.last_entropy = float(entropy)

    def state_dict(self) -> dict[str, float]:
        return {"entropy_coef": self.value, "last_world_entropy": self.last_entropy}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["entropy_coef"])
        self.last_entropy = float(state["last_world_entropy"])
