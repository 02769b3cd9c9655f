"""Parity with TRL 1.16 on its layouts (issue 54): the loss options (luspo, vespo, the off-policy mask) and the
entropy bonus over world size 1-2, 1-2 optimizer steps per generation batch and 1-3 micro-batches per step,
loss and gradient, against TRL's ``_compute_loss`` as copied in ``tests/algorithm/test_trl_options.py``
(``trl_compute_loss``); where trl is installed, that copy against TRL's own code.

These helpers apply lit-grpo's accumulation scale themselves (as ``lit_grpo.train.update`` does);
``tests/train/test_trl_loss_options.py`` runs the real ``update_policy`` against :func:`trl_layout`.
"""

from __future__ import annotations

import pytest
import torch
from test_trl_options import (
    NAN,
    close,
    trl_adaptive_window,
    trl_compute_loss,
    trl_entropy_bonus,
    trl_get_gamma_weights,
    trl_get_off_policy_mask,
)

from lit_grpo.algorithm import LOSS_TYPES, EntropyControlSettings, LossInputs, LossOptions, grpo_loss
from lit_grpo.algorithm.losses import dapo_normaliser
from lit_grpo.settings import (
    EvaluationSettings,
    GenerationSettings,
    LogProbSettings,
    LossSettings,
    RunSettings,
    SamplingSettings,
    ToolSettings,
    UpdateSettings,
)
from lit_grpo.train.logprob_passes import LogProbPasses
from lit_grpo.train.update import step_entropy_coefficient

ROWS_PER_MICRO_BATCH = 2
# (world size, lit-grpo's steps_per_generation, micro-batches per optimizer step = TRL's gradient_accumulation_steps)
LAYOUTS = [(1, 1, 1), (1, 1, 3), (1, 2, 2), (2, 1, 1), (2, 2, 2)]
# the loss options on each layout; "engine": another engine's token-level weights, "sampling": its log-probs,
# "policy_mask": top_entropy_quantile's mask
LAYOUT_CASES = {
    "luspo-token": {"loss_type": "luspo"},
    "luspo-sequence-kl": {"loss_type": "luspo", "importance_sampling_level": "sequence", "beta": 0.04},
    "luspo-engine-weights": {"loss_type": "luspo", "importance_sampling_level": "sequence", "engine": True},
    "vespo-default": {"loss_type": "vespo"},
    "vespo-flat": {"loss_type": "vespo", "vespo": (1.0, 1.0, 1.0, 1.0), "beta": 0.04},
    "vespo-asymmetric": {"loss_type": "vespo", "vespo": (4.0, 0.5, 0.5, 4.0), "engine": True},
    "vespo-policy-mask": {"loss_type": "vespo", "vespo": (0.0, 0.0, 2.0, 6.0), "policy_mask": True},
    "mask-grpo": {"loss_type": "grpo", "threshold": 0.05},
    "mask-dapo-engine": {"loss_type": "dapo", "threshold": 0.05, "sampling": True, "policy_mask": True},
    "mask-luspo": {"loss_type": "luspo", "importance_sampling_level": "sequence", "threshold": 0.0, "sampling": True},
    "mask-vespo": {"loss_type": "vespo", "threshold": 0.05, "sampling": True, "engine": True, "policy_mask": True},
}


def layout_batch(seed, rows, T=6):
    """One generation batch of ``rows`` completions: log-probs near the sampling policy's (VESPO's
    sequence weights stay away from 0), another engine's log-probs and token weights, an entropy mask."""
    generator = torch.Generator().manual_seed(seed)
    logps = -torch.rand(rows, T, generator=generator) * 3
    old_logps = logps + 0.05 * torch.randn(rows, T, generator=generator)
    batch = {
        "logps": logps,
        "old_logps": old_logps,
        "ref_logps": logps + 0.3 * torch.randn(rows, T, generator=generator),
        "sampling_logps": old_logps + 0.1 * torch.randn(rows, T, generator=generator),
        "sampling_weights": torch.exp(0.05 * torch.randn(rows, T, generator=generator)),
        "policy_mask": (torch.rand(rows, T, generator=generator) < 0.7).float(),
        "advantages": torch.randn(rows, generator=generator),
        "mask": (torch.arange(T) < torch.randint(1, T + 1, (rows, 1), generator=generator)).float(),
    }
    batch["mask"][-1] = 0.0  # a row with no token that counts
    if rows > 2:
        batch["advantages"][1] = 0.0  # a group with equal rewards
    return batch


def layout_micro_batches(world_size, steps, micro_batches):
    """(rank, rows) of every micro-batch: rank r holds its share of the generation batch, its optimizer
    steps' micro-batches in order."""
    per_rank = steps * micro_batches * ROWS_PER_MICRO_BATCH
    for rank in range(world_size):
        for start in range(rank * per_rank, (rank + 1) * per_rank, ROWS_PER_MICRO_BATCH):
            yield rank, torch.arange(start, start + ROWS_PER_MICRO_BATCH)


def lit_layout(batch, case, world_size, steps, micro_batches):
    """lit-grpo's update on the layout (lit_grpo.train.update): each micro-batch's ``grpo_loss`` with the
    generation batch's :func:`dapo_normaliser`, times 1/micro_batches for a mean loss type, and DDP's mean
    of the ranks' gradients. (every micro-batch's loss and metrics, the gradient [N, T])."""
    vespo = case.get("vespo", (2.0, 3.0, 3.0, 2.0))
    options = LossOptions(*vespo, off_policy_mask_threshold=case.get("threshold"))
    settings = LossSettings(loss_type=case["loss_type"], max_completion_length=batch["mask"].size(1), beta=case.get("beta", 0.0),
                            importance_sampling_level=case.get("importance_sampling_level", "token"), options=options)
    num_items = dapo_normaliser(float(batch["mask"].sum()), world_size, steps)
    scale = 1 / micro_batches if LOSS_TYPES[case["loss_type"]].accumulates_by_mean else 1.0
    logps = batch["logps"].clone().requires_grad_(True)
    losses, metrics, total = [], [], 0.0
    for _, rows in layout_micro_batches(world_size, steps, micro_batches):
        inputs = LossInputs(
            logps[rows], batch["old_logps"][rows], batch["advantages"][rows], batch["mask"][rows],
            ref_logps=batch["ref_logps"][rows], num_items_in_batch=num_items,
            policy_mask=batch["policy_mask"][rows] if case.get("policy_mask") else None,
            sampling_weights=batch["sampling_weights"][rows] if case.get("engine") else None,
            sampling_logps=batch["sampling_logps"][rows] if case.get("sampling") else None,
        )
        out = grpo_loss(inputs, settings)
        losses.append(out.loss.detach() * scale)
        metrics.append(out.metrics)
        total = total + out.loss * scale / world_size
    total.backward()
    return losses, metrics, logps.grad


def trl_layout(batch, case, world_size, steps, micro_batches):
    """TRL 1.16's training on the same layout: :func:`trl_compute_loss` of each micro-batch with the
    generation batch's token count over all processes (``num_items_in_batch``), its
    ``current_gradient_accumulation_steps`` and its ``steps_per_generation`` (micro-batches per generation
    batch), DDP's mean over ranks. (every micro-batch's loss, the gradient [N, T])."""
    logps = batch["logps"].clone().requires_grad_(True)
    losses, total = [], 0.0
    for _, rows in layout_micro_batches(world_size, steps, micro_batches):
        loss = trl_compute_loss(
            logps[rows], batch["old_logps"][rows], batch["advantages"][rows], batch["mask"][rows], loss_type=case["loss_type"],
            importance_sampling_level=case.get("importance_sampling_level", "token"), beta=case.get("beta", 0.0),
            ref_per_token_logps=batch["ref_logps"][rows], off_policy_mask_threshold=case.get("threshold"),
            sampling_per_token_logps=batch["sampling_logps"][rows] if case.get("sampling") else None,
            importance_sampling_ratio=batch["sampling_weights"][rows] if case.get("engine") else None,
            num_items_in_batch=batch["mask"].sum(), vespo=case.get("vespo", (2.0, 3.0, 3.0, 2.0)),
            entropy_mask=batch["policy_mask"][rows] if case.get("policy_mask") else None,
            num_processes=world_size, current_gradient_accumulation_steps=micro_batches,
            steps_per_generation=steps * micro_batches,
        )
        losses.append(loss.detach())
        total = total + loss / world_size
    total.backward()
    return losses, logps.grad


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: "world{}-steps{}-micro{}".format(*layout))
@pytest.mark.parametrize("name", sorted(LAYOUT_CASES))
def test_loss_options_match_trl_on_every_layout(name, layout):
    case = LAYOUT_CASES[name]
    world_size, steps, micro_batches = layout
    batch = layout_batch(seed=21, rows=world_size * steps * micro_batches * ROWS_PER_MICRO_BATCH)
    losses, _, grad = lit_layout(batch, case, *layout)
    expected_losses, expected_grad = trl_layout(batch, case, *layout)
    close(torch.stack(losses), torch.stack(expected_losses))
    close(grad, expected_grad)
    assert grad.abs().sum() > 0


# the entropy bonus on the layouts: its coefficient fixed, or adapted after every optimizer step
ENTROPY_CONTROLS = {
    "fixed": EntropyControlSettings(entropy_coef=0.05),
    # the batch's entropies (about 1.2) below the target: up after each step, the bonus from the second step on
    "adaptive": EntropyControlSettings(entropy_coef=0.05, use_adaptive_entropy=True, entropy_target=1.5,
                                       entropy_coef_delta=0.02),
    # a target between the micro-batches' mean entropies (0.96-1.85): a step's mean over its window of micro-batches
    # (token-weighted, all ranks) decides, up or down (the last micro-batch's alone would differ)
    "adaptive-both-ways": EntropyControlSettings(entropy_coef=0.05, use_adaptive_entropy=True, entropy_target=1.2,
                                                 entropy_coef_delta=0.02),
}


def layout_steps(world_size, steps, micro_batches):
    """``[optimizer step][rank]`` -> the rows of that rank's micro-batches of the step, in order."""
    slots = list(layout_micro_batches(world_size, steps, micro_batches))
    by_rank = [[rows for rank, rows in slots if rank == r] for r in range(world_size)]
    return [[by_rank[r][step * micro_batches:(step + 1) * micro_batches] for r in range(world_size)] for step in range(steps)]


class Gathered(Exception):
    """Raised by :func:`handed_windows`' ``all_gather``: the probe ends there."""


def handed_windows(ranks_passes, ranks_stats):
    """``[W, 2]``: the window each rank's :func:`step_entropy_coefficient` hands to its ``all_gather`` (run on
    copies of the step's statistics, stopped there, before the controller moves); None if it gathers nothing."""
    windows = []

    def record(window):
        windows.append(window)
        raise Gathered

    for passes, rank_stats in zip(ranks_passes, ranks_stats):
        passes.all_gather = record
        try:
            step_entropy_coefficient(passes, [dict(stats) for stats in rank_stats])
        except Gathered:
            pass
    return torch.stack(windows) if windows else None


def lit_entropy_layout(batch, entropies, loss_type, control, policy_mask, world_size, steps, micro_batches):
    """lit-grpo's update on the layout with the bonus, one :class:`LogProbPasses` per rank: each micro-batch's
    ``grpo_loss`` through :meth:`LogProbPasses.with_entropy_bonus` (its accumulation scale, the step's applied
    coefficient over the micro-batches), then each rank's :func:`step_entropy_coefficient` after the step, its
    ``all_gather`` handing it every rank's window. (losses, (applied, value, last_entropy) per step, total,
    entropy_coef logged)."""
    loss_settings = LossSettings(loss_type=loss_type, max_completion_length=batch["mask"].size(1))
    run_settings = RunSettings(loss=loss_settings, sampling=SamplingSettings(), logprobs=LogProbSettings(),
                               generation=GenerationSettings(), update=UpdateSettings(), tools=ToolSettings(),
                               evaluation=EvaluationSettings(num_generations_eval=1), entropy=control)
    ranks_passes = [LogProbPasses(run_settings, None, None, lambda: 1.0) for _ in range(world_size)]
    num_items = dapo_normaliser(float(batch["mask"].sum()), world_size, steps)
    scale = 1 / micro_batches if LOSS_TYPES[loss_type].accumulates_by_mean else 1.0
    losses, history, total, logged = [], [], 0.0, []
    for ranks in layout_steps(world_size, steps, micro_batches):
        applied = ranks_passes[0].entropy_coefficient.applied()
        ranks_stats = []
        for passes, rank_rows in zip(ranks_passes, ranks):
            ranks_stats.append([])
            for rows in rank_rows:
                mask = batch["mask"][rows] * (batch["policy_mask"][rows] if policy_mask else 1.0)  # TRL's effective_mask
                inputs = LossInputs(batch["logps"][rows], batch["old_logps"][rows], batch["advantages"][rows], batch["mask"][rows],
                                    num_items_in_batch=num_items, policy_mask=batch["policy_mask"][rows] if policy_mask else None)
                loss, stats = passes.with_entropy_bonus(grpo_loss(inputs, loss_settings).loss, {}, entropies[rows], mask,
                                                        scale, applied / micro_batches)
                losses.append(loss.detach())
                ranks_stats[-1].append(stats)
                total = total + loss / world_size  # DDP's mean of the ranks' gradients
        windows = handed_windows(ranks_passes, ranks_stats)  # [W, 2]: what all_gather returns on every rank
        for passes, rank_stats in zip(ranks_passes, ranks_stats):
            passes.all_gather = lambda window, windows=windows: windows
            step_entropy_coefficient(passes, rank_stats)
        assert len({passes.entropy_coefficient.value for passes in ranks_passes}) == 1  # the ranks agree
        logged.append([float(stats["entropy_coef"]) for rank_stats in ranks_stats for stats in rank_stats])
        coefficient = ranks_passes[0].entropy_coefficient
        history.append((applied, coefficient.value, coefficient.last_entropy))
    return losses, history, total, logged


def trl_entropy_layout(batch, entropies, loss_type, control, policy_mask, world_size, steps, micro_batches):
    """TRL 1.16 on the same layout: :func:`trl_compute_loss` then :func:`trl_entropy_bonus` of each micro-batch
    with ``apply_coef`` and ``current_gradient_accumulation_steps``; adaptive control by :func:`trl_adaptive_window`
    over the step's micro-batches of every rank (``accelerator.reduce(..., "sum")`` of the ranks' windows)."""
    windows, losses, total = [], [], 0.0
    for ranks in layout_steps(world_size, steps, micro_batches):
        windows.append([(entropies[rows].detach(), batch["mask"][rows] * (batch["policy_mask"][rows] if policy_mask else 1.0))
                        for rank_rows in ranks for rows in rank_rows])
        if control.use_adaptive_entropy:
            apply_coef = trl_adaptive_window(windows, control.entropy_coef, control.entropy_target, control.entropy_coef_min,
                                             control.entropy_coef_max, control.entropy_coef_delta)[-1][0]
        else:
            apply_coef = control.entropy_coef
        for rank_rows in ranks:
            for rows in rank_rows:
                loss = trl_compute_loss(
                    batch["logps"][rows], batch["old_logps"][rows], batch["advantages"][rows], batch["mask"][rows],
                    loss_type=loss_type, num_items_in_batch=batch["mask"].sum(), num_processes=world_size,
                    entropy_mask=batch["policy_mask"][rows] if policy_mask else None,
                    current_gradient_accumulation_steps=micro_batches, steps_per_generation=steps * micro_batches,
                )
                effective_mask = batch["mask"][rows] * (batch["policy_mask"][rows] if policy_mask else 1.0)
                loss = trl_entropy_bonus(loss, entropies[rows], effective_mask, apply_coef, micro_batches)
                losses.append(loss.detach())
                total = total + loss / world_size
    history = [(control.entropy_coef, control.entropy_coef, float("inf"))] * steps  # fixed: no entropy measured
    if control.use_adaptive_entropy:
        history = trl_adaptive_window(windows, control.entropy_coef, control.entropy_target, control.entropy_coef_min,
                                      control.entropy_coef_max, control.entropy_coef_delta)
    return losses, history, total, None


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: "world{}-steps{}-micro{}".format(*layout))
@pytest.mark.parametrize("loss_type,policy_mask", [("grpo", False), ("dapo", True)], ids=["grpo", "dapo-policy-mask"])
@pytest.mark.parametrize("control", sorted(ENTROPY_CONTROLS))
def test_entropy_bonus_matches_trl_on_every_layout(control, loss_type, policy_mask, layout):
    world_size, steps, micro_batches = layout
    rows = world_size * steps * micro_batches * ROWS_PER_MICRO_BATCH
    batch = layout_batch(seed=22, rows=rows)
    generator = torch.Generator().manual_seed(5)
    entropy_values = 1.0 + 0.6 * torch.randn(rows, batch["mask"].size(1), generator=generator).abs().sub(0.5)
    results = []
    for run in (lit_entropy_layout, trl_entropy_layout):
        logps = batch["logps"].clone().requires_grad_(True)
        entropies = entropy_values.clone().requires_grad_(True)
        losses, history, total, logged = run({**batch, "logps": logps}, entropies, loss_type, ENTROPY_CONTROLS[control],
                                             policy_mask, *layout)
        total.backward()
        entropy_grad = torch.zeros_like(entropies) if entropies.grad is None else entropies.grad  # None: no bonus applied
        results.append((torch.stack(losses), history, logps.grad, entropy_grad, logged))
    (losses, history, logps_grad, entropy_grad, logged), (expected_losses, expected_history, expected_logps_grad,
                                                          expected_entropy_grad, _) = results
    # entropy_coef: every micro-batch of a step carries the value after it (TRL logs it once per optimizer step)
    assert logged == [pytest.approx([value] * world_size * micro_batches) for _, value, _ in expected_history]
    close(losses, expected_losses)
    # with the entropy each step's control read (TRL's last_world_entropy)
    assert [value for triple in history for value in triple] == pytest.approx(
        [value for triple in expected_history for value in triple])
    close(logps_grad, expected_logps_grad)
    close(entropy_grad, expected_entropy_grad)
    assert (entropy_grad.abs().sum() > 0 or control == "adaptive" and steps == 1  # one adaptive step applies no bonus
            or control == "adaptive-both-ways" and not any(applied for applied, _, _ in history))
    if control == "adaptive":
        assert history[-1][1] == pytest.approx(0.05 + 0.02 * steps)
    if control == "adaptive-both-ways" and layout == (1, 2, 2):  # step 1 at or below the target (up), step 2 above (down)
        assert [value for _, value, _ in history] == pytest.approx([0.07, 0.05]) and history[1][0] == pytest.approx(0.07)


# ----------------------------------------------------------------------------------------------
# The copies in test_trl_options.py against TRL's own code, where trl is installed (not in CI)
# ----------------------------------------------------------------------------------------------


class OneProcessAccelerator:
    """The part of ``accelerate.Accelerator`` that ``_compute_loss`` reads: every rank's values are this one's."""

    sync_gradients = True

    def __init__(self, num_processes):
        self.num_processes = num_processes

    def reduce(self, tensor, reduction="sum"):
        return tensor

    def gather(self, tensor):
        return tensor

    def gather_for_metrics(self, tensor):
        return tensor


def trl_trainer_stub(trl, case, logps, policy_mask, num_processes, accumulation_steps, steps_per_generation):
    """A ``self`` for ``trl.GRPOTrainer._compute_loss``: the attributes it reads in training, the forward's
    log-probs ``logps`` and ``get_high_entropy_mask`` answering ``policy_mask`` (None: no entropy mask)."""
    from collections import defaultdict
    from types import SimpleNamespace

    vespo = case.get("vespo", (2.0, 3.0, 3.0, 2.0))
    return SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *args, **kwargs: (logps, torch.zeros_like(logps), None),
        top_entropy_quantile=1.0 if policy_mask is None else 0.5,
        get_high_entropy_mask=lambda entropies, mask, threshold: policy_mask,
        off_policy_mask_threshold=case.get("threshold"),
        importance_sampling_level=case.get("importance_sampling_level", "token"),
        beta=case.get("beta", 0.0), loss_type=case["loss_type"], epsilon_low=0.2, epsilon_high=0.2,
        use_vllm=bool(case.get("engine")), vllm_importance_sampling_correction=bool(case.get("engine")),
        model=SimpleNamespace(training=True), current_gradient_accumulation_steps=accumulation_steps,
        accelerator=OneProcessAccelerator(num_processes), _entropy_bonus_enabled=False, aux_loss_enabled=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)}, max_completion_length=logps.size(1),
        args=SimpleNamespace(use_bias_correction_kl=True, delta=case.get("delta"), vespo_k_pos=vespo[0],
                             vespo_lambda_pos=vespo[1], vespo_k_neg=vespo[2], vespo_lambda_neg=vespo[3],
                             steps_per_generation=steps_per_generation),
        get_off_policy_mask=trl.GRPOTrainer.get_off_policy_mask, get_gamma_weights=trl.GRPOTrainer.get_gamma_weights,
    )


# LAYOUT_CASES and what trl_compute_loss has beyond them: delta (the two-sided clip), dapo at sequence level
REAL_TRL_CASES = {**LAYOUT_CASES, "grpo-delta": {"loss_type": "grpo", "delta": 1.02, "beta": 0.04},
                  "dapo-sequence-engine": {"loss_type": "dapo", "importance_sampling_level": "sequence", "engine": True}}


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: "world{}-steps{}-micro{}".format(*layout))
@pytest.mark.parametrize("name", sorted(REAL_TRL_CASES))
def test_the_copy_of_compute_loss_is_trls(name, layout):
    trl = pytest.importorskip("trl")
    case = REAL_TRL_CASES[name]
    world_size, steps, micro_batches = layout
    batch = layout_batch(seed=31, rows=4)
    batch["old_logps"][2] = batch["logps"][2] + 0.8  # a row far off-policy: clipped, masked if A < 0, phi far from 1
    policy_mask = batch["policy_mask"] if case.get("policy_mask") else None
    num_items = batch["mask"].sum() * world_size * steps * micro_batches  # the generation batch's tokens
    inputs = {"prompt_ids": torch.zeros(4, 1, dtype=torch.long), "prompt_mask": torch.ones(4, 1, dtype=torch.long),
              "completion_ids": torch.zeros(4, 6, dtype=torch.long), "completion_mask": batch["mask"],
              "advantages": batch["advantages"], "num_items_in_batch": num_items, "old_per_token_logps": batch["old_logps"],
              "ref_per_token_logps": batch["ref_logps"]}
    if case.get("sampling"):
        inputs["sampling_per_token_logps"] = batch["sampling_logps"]
    if case.get("engine"):
        inputs["importance_sampling_ratio"] = batch["sampling_weights"]
    results = []
    for run in ("trl", "copy"):
        logps = batch["logps"].clone().requires_grad_(True)
        if run == "trl":
            stub = trl_trainer_stub(trl, case, logps, policy_mask, world_size, micro_batches, steps * micro_batches)
            loss = trl.GRPOTrainer._compute_loss(stub, None, inputs)
        else:
            loss = trl_compute_loss(
                logps, batch["old_logps"], batch["advantages"], batch["mask"], loss_type=case["loss_type"],
                importance_sampling_level=case.get("importance_sampling_level", "token"), delta=case.get("delta"),
                beta=case.get("beta", 0.0), ref_per_token_logps=batch["ref_logps"], off_policy_mask_threshold=case.get("threshold"),
                sampling_per_token_logps=inputs.get("sampling_per_token_logps"),
                importance_sampling_ratio=inputs.get("importance_sampling_ratio"), num_items_in_batch=num_items,
                vespo=case.get("vespo", (2.0, 3.0, 3.0, 2.0)), entropy_mask=policy_mask, num_processes=world_size,
                current_gradient_accumulation_steps=micro_batches, steps_per_generation=steps * micro_batches,
            )
        (grad,) = torch.autograd.grad(loss, logps)
        results.append((loss.detach(), grad))
    (loss, grad), (expected_loss, expected_grad) = results
    close(loss, expected_loss)
    close(grad, expected_grad)
    assert grad.abs().sum() > 0
    if case["loss_type"] == "vespo":  # TRL's logged value: the mean phi over the micro-batch's sequences
        phi = trl_get_gamma_weights(batch["advantages"].unsqueeze(1), batch["logps"] - batch["old_logps"], batch["mask"],
                                    inputs.get("importance_sampling_ratio"), *case.get("vespo", (2.0, 3.0, 3.0, 2.0)))
        assert stub._metrics["train"]["vespo/phi_seq_mean"] == pytest.approx([float(phi.mean())], rel=1e-6)


@pytest.mark.parametrize("seed", range(3))
def test_the_copies_of_the_gamma_weights_and_the_off_policy_mask_are_trls(seed):
    trl = pytest.importorskip("trl")
    generator = torch.Generator().manual_seed(seed)
    rows, T = 8, 7
    logps = -torch.rand(rows, T, generator=generator) * 3
    # log-ratios from small to beyond the clamps (+-20 per token, [log 1e-8, 20] per sequence), NaN where masked
    log_ratio = torch.randn(rows, T, generator=generator) * torch.tensor([0.01, 0.1, 0.5, 1.0, 3.0, 10.0, 30.0, 0.2]).unsqueeze(1)
    mask = (torch.arange(T) < torch.randint(0, T + 1, (rows, 1), generator=generator)).float()
    log_ratio = log_ratio.masked_fill(mask == 0, NAN)
    advantages = torch.randn(rows, 1, generator=generator)
    ratio = torch.exp(0.3 * torch.randn(rows, T, generator=generator))
    for parameters in [(2.0, 3.0, 3.0, 2.0), (4.0, 0.5, 0.5, 4.0), (0.0, 0.0, 2.0, 6.0)]:
        for importance_sampling_ratio in (None, ratio):
            close(trl_get_gamma_weights(advantages, log_ratio.nan_to_num(), mask, importance_sampling_ratio, *parameters),
                  trl.GRPOTrainer.get_gamma_weights(advantages, log_ratio.nan_to_num(), mask, importance_sampling_ratio,
                                                    *parameters))
    sampling_logps = logps + log_ratio.nan_to_num().abs() * 0.05  # KL >= 0: the rows with A < 0 above a threshold go
    sampling_logps[0, 0] = NAN  # TRL's nan_to_num of the KL
    kept = []
    for threshold in (0.0, 0.01, 0.1, 1.0):
        expected = trl.GRPOTrainer.get_off_policy_mask(advantages, logps, sampling_logps, mask, threshold)
        close(trl_get_off_policy_mask(advantages, logps, sampling_logps, mask, threshold), expected)
        kept.append(int(expected.sum()))
    assert kept[0] < rows and kept != [kept[0]] * 4  # the mask drops rows, and fewer as the threshold grows
