"""Step 5 of a GRPO step: ``num_iterations`` passes over the generation batch, each pass
``steps_per_generation`` optimizer steps on mini-batches of ``B * G / steps_per_generation``
completions, each mini-batch in micro-batches of ``micro_batch_size`` completions (gradient
accumulation). The forwards and backwards are the log-prob passes' (:mod:`lit_grpo.train.logprob_passes`).

Before the first optimizer step the policy is the sampling policy, so the first mini-batch's rows
take their ``old_logps`` from their own forward in that step; the rows trained after the policy has
moved get theirs from a pass without gradient first (step 4's rest, :meth:`LogProbPasses.sampling_policy_logps`).

With the entropy bonus (``model.entropy_coef``, ``use_adaptive_entropy``) every micro-batch of an
optimizer step adds ``- c * H / micro_batches`` to its loss, ``c`` the coefficient of that step
(:meth:`lit_grpo.algorithm.EntropyCoefficient.applied`), and after the step adaptive control moves
the coefficient with the step's mean entropy over all ranks, as TRL 1.16 does.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

import torch

from lit_grpo import algorithm
from lit_grpo.distributed import clip_grad_norm
from lit_grpo.rollout.records import ScoredRollout
from lit_grpo.settings import UpdateSettings
from lit_grpo.train.logprob_passes import ENTROPY_WINDOW, LogProbPasses

__all__ = ["update_policy"]


def update_policy(scored: ScoredRollout, logprobs: LogProbPasses, policy: torch.nn.Module,
                  parameters: Callable[[], Iterable[torch.nn.Parameter]], optimizer: Any, scheduler: Any,
                  settings: UpdateSettings, after_optimizer_step: Callable[[], None], generator: torch.Generator | None = None,
                  ) -> tuple[list[dict[str, torch.Tensor]], torch.Tensor | None]:
    """Step 5 on ``scored`` (its ``old_logps`` filled where the update needs them, its ``timings``
    given ``train`` and more ``logprobs``); every micro-batch's statistics and the last gradient norm
    (None without clipping), with ``settings``' passes, steps and micro-batches. ``after_optimizer_step`` runs after every optimizer step (the policy's
    version goes up). ``generator`` draws the mini-batches' order (default: the global random stream)."""
    num_completions = scored.rollout.completion_ids.size(0)
    device = scored.rollout.completion_ids.device
    mini_batch_size = num_completions // settings.steps_per_generation
    first_order = torch.randperm(num_completions, device=device, generator=generator) if settings.steps_per_generation > 1 else None
    policy_moves = settings.num_iterations > 1 or settings.steps_per_generation > 1
    if policy_moves:  # step 4's old_logps, for the rows that are trained after the policy has moved
        start = time.perf_counter()
        first_step_rows = first_order if first_order is not None else torch.arange(num_completions, device=device)
        scored.old_logps = logprobs.sampling_policy_logps(policy, scored, later_rows=first_step_rows[mini_batch_size:])
        scored.timings["logprobs"] += time.perf_counter() - start
    train_start = time.perf_counter()
    step_stats: list[dict[str, torch.Tensor]] = []
    grad_norm = None
    for iteration in range(settings.num_iterations):
        # the mini-batches' rows: in order with one optimizer step per pass, else shuffled each pass
        order = first_order if iteration == 0 or first_order is None else torch.randperm(num_completions, device=device,
                                                                                          generator=generator)
        for mini_start in range(0, num_completions, mini_batch_size):
            # Before the first optimizer step the policy is the sampling policy: its rows' own
            # forward gives their old_logps (ratio exactly 1, as without a move), kept for later.
            fills_old_logps = policy_moves and iteration == 0 and mini_start == 0
            mini_batch_stats = mini_batch_backward(scored, logprobs, policy, settings.micro_batch_size, order,
                                                   range(mini_start, mini_start + mini_batch_size), fills_old_logps)
            grad_norm = clip_grad_norm(parameters(), settings.max_grad_norm)
            optimizer.step()
            step_entropy_coefficient(logprobs, mini_batch_stats)
            step_stats += mini_batch_stats
            after_optimizer_step()  # the engine's weights are stale from here (engine.sync_weights)
            # free the gradients now (set to None), which also starts the next mini-batch's
            # accumulation from nothing: kept, they would stay allocated through the next
            # generation batch and forward pass, one float32 copy of the trainable weights
            optimizer.zero_grad()
            if scheduler is not None:
                scheduler.step()
    scored.timings["train"] = time.perf_counter() - train_start
    return step_stats, grad_norm


def mini_batch_backward(scored: ScoredRollout, logprobs: LogProbPasses, policy: torch.nn.Module, micro_batch_size: int | None,
                        order: torch.Tensor | None, positions: range, fills_old_logps: bool) -> list[dict[str, torch.Tensor]]:
    """The accumulated gradient of one mini-batch (the rows at ``positions`` of ``order``, in
    micro-batches of ``micro_batch_size`` rows, None: one); every micro-batch's statistics. With ``fills_old_logps`` the forwards' log-probs
    are the rows' ``old_logps``."""
    device = scored.rollout.completion_ids.device
    micro_batch_size = micro_batch_size or len(positions)
    micro_batches = len(positions) // micro_batch_size
    step_scored = replace(scored, old_logps=None) if fills_old_logps else scored
    # the loss type grpo_loss aggregates with (the passes' settings, built once), so the two never disagree
    scale = 1 / micro_batches if algorithm.LOSS_TYPES[logprobs.settings.loss.loss_type].accumulates_by_mean else 1.0
    # the entropy bonus's coefficient of this optimizer step, the same for each micro-batch, over their number (TRL's)
    coefficient = logprobs.entropy_coefficient
    bonus_weight = coefficient.applied() / micro_batches if coefficient.settings.enabled else 0.0
    step_stats = []
    # the gradients are None here: set so after every optimizer step
    for micro_start in range(positions.start, positions.stop, micro_batch_size):
        rows = torch.arange(micro_start, micro_start + micro_batch_size, device=device)
        rows = order[rows] if order is not None else rows
        # DDP all-reduces the accumulated gradient once, after the last micro-batch
        is_last = micro_start + micro_batch_size == positions.stop
        stats, logps = logprobs.micro_batch_backward(policy, step_scored, rows, scale, sync=is_last, bonus_weight=bonus_weight)
        step_stats.append(stats)
        if fills_old_logps:
            scored.old_logps[rows, : logps.size(1)] = logps  # logps [n, c]
    return step_stats


def step_entropy_coefficient(logprobs: LogProbPasses, mini_batch_stats: list[dict[str, torch.Tensor]]) -> None:
    """After an optimizer step with the entropy bonus on: adaptive control's step, with the mean entropy
    of the step's bonus tokens over all ranks (its micro-batches' :data:`ENTROPY_WINDOW` summed, then
    over ranks: TRL's window, token-weighted), and the coefficient after it as each micro-batch's
    ``entropy_coef`` statistic (TRL logs it at every optimizer step)."""
    coefficient = logprobs.entropy_coefficient
    if not coefficient.settings.enabled:
        return
    window = torch.stack([stats.pop(ENTROPY_WINDOW) for stats in mini_batch_stats]).sum(dim=0)  # [2]: entropy sum, tokens
    if coefficient.settings.use_adaptive_entropy:
        window = logprobs.all_gather(window).reshape(-1, 2).sum(dim=0)  # over ranks ([2] on one, [W, 2] on W)
        coefficient.step(float(window[0] / window[1].clamp(min=1.0)))
    for stats in mini_batch_stats:
        stats["entropy_coef"] = torch.tensor(coefficient.value, device=window.device)
