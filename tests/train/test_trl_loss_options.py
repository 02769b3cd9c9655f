"""TRL 1.16's loss options through GRPOModule (issue 54): ``model.loss_type: luspo`` / ``vespo``, the
``model.vespo_*`` keys and ``model.off_policy_mask_threshold`` reach the loss the module trains on, as
TRL's ``_compute_loss`` (its lines copied in tests/algorithm/test_trl_options.py) computes it, and
``vespo/phi_seq_mean`` is logged with TRL's value. The tiny model, one or two optimizer steps."""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch
from test_entropy_bonus import plain_passes
from test_module import (
    LOWERCASE,
    MetricRecorder,
    accumulated_gradient,
    adamw,
    attach_trainer,
    count_rows_of_no_grad_passes,
    make_data,
    make_module,
)
from test_trl_layouts import (
    LAYOUT_CASES,
    ROWS_PER_MICRO_BATCH,
    layout_batch,
    layout_micro_batches,
    lit_layout,
    trl_layout,
)
from test_trl_options import close, trl_compute_loss, trl_get_gamma_weights, trl_get_off_policy_mask

import lit_grpo.train.logprob_passes
import lit_grpo.train.module
from lit_grpo.data import PromptBatch
from lit_grpo.train.step_metrics import update_metrics
from lit_grpo.train.update import update_policy


def scored_batch(module):
    """8 completions of 2 prompts, of different lengths, with advantages of either sign and none 0."""
    module.generation_config.sequence_bias = {(module.tokenizer.eos_token_id,): 3.0}
    batch = PromptBatch(prompts=["Say a:", "Now say the letter b:"], columns={"target": ["a", "b"]})
    scored, _ = module.generate_and_score(batch)
    assert len(set(scored.rollout.completion_lengths.tolist())) > 1
    scored.group.advantages = torch.tensor([-1.5, 1.0, -0.5, 2.0, -1.0, 0.5, -2.0, 1.5])
    return scored


def with_old_logps(module, scored, shift):
    """Set ``scored.old_logps`` to the policy's own log-probs plus ``shift`` ``[N, 1]`` (a policy that moved)."""
    with torch.no_grad():
        current, _ = module.logprobs.completion_logps(module.policy, scored.rollout)  # [N, c]
    scored.old_logps = torch.zeros(scored.rollout.completion_ids.shape)
    scored.old_logps[:, : current.size(1)] = current + shift
    return current


@pytest.mark.parametrize("settings", [
    {"loss_type": "luspo", "importance_sampling_level": "sequence"},
    {"loss_type": "luspo", "importance_sampling_level": "token"},
    {"loss_type": "vespo"},  # TRL's defaults (2, 3, 3, 2)
    {"loss_type": "vespo", "vespo_k_pos": 4.0, "vespo_lambda_pos": 0.5, "vespo_k_neg": 0.5, "vespo_lambda_neg": 4.0},
])
@pytest.mark.filterwarnings("ignore:When using 'luspo' loss")  # TRL's warning for luspo at token level
def test_the_module_trains_luspo_and_vespo_as_trl(tiny_model_dir, fast_trainer, settings):
    torch.manual_seed(0)
    module = attach_trainer(make_module(tiny_model_dir, max_completion_length=10, **settings), fast_trainer)
    scored = scored_batch(module)
    shift = 0.02 * torch.arange(-4, 4).float().unsqueeze(1)  # [N, 1] per-token log-ratios of either sign
    with_old_logps(module, scored, shift)
    rows = torch.arange(8)
    loss, stats, logps = module.logprobs.micro_batch_loss(module.policy, scored, rows)  # logps [n, c] with grad
    width = logps.size(1)
    mask, old_logps = scored.loss_mask[:, :width].float(), scored.old_logps[:, :width]
    vespo = tuple(module.hparams[name] for name in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"))
    expected = trl_compute_loss(logps, old_logps, scored.group.advantages, mask, loss_type=settings["loss_type"],
                                importance_sampling_level=module.hparams.importance_sampling_level,
                                num_items_in_batch=scored.num_items_in_batch, vespo=vespo)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-7)
    (grad,) = torch.autograd.grad(loss, logps, retain_graph=True)
    (expected_grad,) = torch.autograd.grad(expected, logps)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-7)
    assert grad.abs().sum() > 0
    if settings["loss_type"] == "vespo":  # TRL's metric, and no clip fractions (VESPO clips no ratio)
        phi = trl_get_gamma_weights(scored.group.advantages.unsqueeze(1), logps.detach() - old_logps, mask, None, *vespo)
        assert float(stats["vespo/phi_seq_mean"]) == pytest.approx(float(phi.mean()), rel=1e-5)
        assert abs(float(phi.mean()) - 1.0) > 1e-3 and not any(key.startswith("clip_ratio/") for key in stats)
    else:
        assert "vespo/phi_seq_mean" not in stats and "clip_ratio/region_mean" in stats


@pytest.mark.parametrize("loss_type", ["luspo", "vespo"])
@pytest.mark.filterwarnings("ignore:When using 'luspo' loss")
def test_micro_batching_does_not_change_the_gradient_of_luspo_and_vespo(tiny_model_dir, fast_trainer, loss_type):
    # luspo is a mean over sequences (each micro-batch's loss / micro-batches), vespo a token sum over
    # the generation batch's tokens (as dapo): either way the accumulated gradient is the whole batch's
    torch.manual_seed(0)
    module = attach_trainer(make_module(tiny_model_dir, loss_type=loss_type, max_completion_length=10), fast_trainer)
    scored = scored_batch(module)
    with_old_logps(module, scored, 0.05 * torch.arange(-4, 4).float().unsqueeze(1))
    whole = accumulated_gradient(module, scored, micro_batch_size=8)
    split = accumulated_gradient(module, scored, micro_batch_size=2)
    assert whole.norm() > 1e-3
    torch.testing.assert_close(split, whole, atol=1e-6, rtol=1e-4)


def test_off_policy_mask_threshold_masks_the_rows_trl_masks(tiny_model_dir, fast_trainer):
    torch.manual_seed(0)
    module = attach_trainer(
        make_module(tiny_model_dir, max_completion_length=10, off_policy_mask_threshold=0.1, loss_type="dapo"), fast_trainer
    )
    scored = scored_batch(module)
    # rows 0-3 sampled by a policy 0.3 nats per token above the current one (KL 0.3 > 0.1), rows 4-7 by
    # one 0.05 above; of the advantages -1.5, 1, -0.5, 2 | -1, 0.5, -2, 1.5 the negative far rows go: 0 and 2
    shift = torch.tensor([0.3] * 4 + [0.05] * 4).unsqueeze(1)
    with_old_logps(module, scored, shift)
    loss, _, logps = module.logprobs.micro_batch_loss(module.policy, scored, torch.arange(8))
    (grad,) = torch.autograd.grad(loss, logps, retain_graph=True)
    width = logps.size(1)
    mask, old_logps = scored.loss_mask[:, :width].float(), scored.old_logps[:, :width]
    trained = grad.abs().sum(dim=1) > 0
    assert trained.tolist() == [False, True, False, True, True, True, True, True]
    keep = trl_get_off_policy_mask(scored.group.advantages.unsqueeze(1), logps, old_logps, mask, 0.1)
    assert keep.squeeze(1).bool().tolist() == trained.tolist()
    expected = trl_compute_loss(logps, old_logps, scored.group.advantages, mask, loss_type="dapo", off_policy_mask_threshold=0.1,
                                num_items_in_batch=scored.num_items_in_batch)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-7)
    (expected_grad,) = torch.autograd.grad(expected, logps)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-7)


def test_off_policy_mask_measures_the_engines_log_probs_where_it_scored_them(tiny_model_dir, fast_trainer):
    # TRL: inputs.get("sampling_per_token_logps", old_per_token_logps). The trainer's old log-probs are its
    # own (ratio 1); the engine's are 0.3 nats per token above them on rows 4-7: of those, -1 and -2 go
    torch.manual_seed(0)
    module = attach_trainer(
        make_module(tiny_model_dir, max_completion_length=10, off_policy_mask_threshold=0.1,
                    vllm_importance_sampling_correction=False),  # the engine's log-probs without its weights
        fast_trainer,
    )
    scored = scored_batch(module)
    current = with_old_logps(module, scored, 0.0)
    sampling = torch.zeros(scored.rollout.completion_ids.shape)
    sampling[:, : current.size(1)] = current + torch.tensor([0.0] * 4 + [0.3] * 4).unsqueeze(1)
    scored.rollout.sampling_logps = sampling
    loss, stats, logps = module.logprobs.micro_batch_loss(module.policy, scored, torch.arange(8))
    (grad,) = torch.autograd.grad(loss, logps)
    assert (grad.abs().sum(dim=1) > 0).tolist() == [True, True, True, True, False, True, False, True]
    assert "sampling/sampling_logp_difference/mean" in stats  # the engine's log-probs were read


def recorded_loss_inputs(monkeypatch):
    """Every ``grpo_loss`` call's inputs and settings, as the log-prob passes make them."""
    calls = []
    original = lit_grpo.train.module.algorithm.grpo_loss

    def recording(inputs, settings):
        calls.append((inputs, settings))
        return original(inputs, settings)

    monkeypatch.setattr(lit_grpo.train.module.algorithm, "grpo_loss", recording)
    return calls


def test_vespo_phi_seq_mean_is_logged_with_trls_value(tiny_model_dir, say_a_or_b_file, fast_trainer, monkeypatch):
    # two optimizer steps on one generation batch: the first on-policy (phi = 1 for every row), the second
    # after the policy moved; as TRL with logging_steps = steps_per_generation: the mean of the two micro-batches'
    # means of phi over sequences
    pl.seed_everything(0)
    calls = recorded_loss_inputs(monkeypatch)
    vespo = (6.0, 0.5, 0.5, 6.0)  # far from TRL's defaults (2, 3, 3, 2): a key that did not arrive would show
    module = make_module(
        tiny_model_dir, rewards=LOWERCASE, loss_type="vespo", steps_per_generation=2, optimizer=adamw(0.02),
        vespo_k_pos=vespo[0], vespo_lambda_pos=vespo[1], vespo_k_neg=vespo[2], vespo_lambda_neg=vespo[3],
        skip_zero_gradient_rows=False, forward_token_budget=None,  # one grpo_loss call per micro-batch
    )
    steps = MetricRecorder()
    trainer = fast_trainer(max_steps=2, callbacks=[steps])
    trainer.fit(module, make_data(say_a_or_b_file))
    assert trainer.global_step == 2 and len(steps.steps) == 1 and len(calls) == 2

    def phi_mean(inputs, parameters):
        log_ratio = inputs.logps.detach() - inputs.old_logps
        return float(trl_get_gamma_weights(inputs.advantages.unsqueeze(1), log_ratio, inputs.completion_mask, None,
                                           *parameters).mean())

    assert phi_mean(calls[0][0], vespo) == pytest.approx(1.0)  # on-policy
    expected = (phi_mean(calls[0][0], vespo) + phi_mean(calls[1][0], vespo)) / 2
    logged = steps.steps[0]
    assert logged["vespo/phi_seq_mean"] == pytest.approx(expected, rel=1e-5)
    with_defaults = (phi_mean(calls[0][0], (2.0, 3.0, 3.0, 2.0)) + phi_mean(calls[1][0], (2.0, 3.0, 3.0, 2.0))) / 2
    assert abs(expected - with_defaults) > 1e-3
    assert not any(name.startswith("clip_ratio/") for name in logged)


def trl_phi_seq_mean(batch, case, rows_by_rank):
    """TRL's ``vespo/phi_seq_mean`` of one micro-batch index: ``global_masked_mean(phi_seq)``, a ``(B, 1)``
    tensor's sum over every rank's rows / their count."""
    phis = [trl_get_gamma_weights(batch["advantages"][rows].unsqueeze(1), batch["logps"][rows] - batch["old_logps"][rows],
                                  batch["mask"][rows], batch["sampling_weights"][rows] if case.get("engine") else None,
                                  *case.get("vespo", (2.0, 3.0, 3.0, 2.0))) for rows in rows_by_rank]
    totals = torch.stack([torch.stack([phi.sum(), torch.tensor(float(phi.shape[0]))]) for phi in phis]).sum(0)
    return totals[0] / totals[1].clamp(min=1.0)


@pytest.mark.parametrize("layout", [(1, 1, 3), (2, 2, 2)], ids=["world1-steps1-micro3", "world2-steps2-micro2"])
@pytest.mark.parametrize("name", ["vespo-default", "vespo-asymmetric", "mask-vespo"])
def test_vespo_phi_seq_mean_is_trls_logged_value(name, layout):
    # TRL appends one value per micro-batch (its global mean over ranks) and logs their mean; lit-grpo's
    # update_metrics takes each rank's mean over its micro-batches, then the mean over ranks
    case = LAYOUT_CASES[name]
    world_size, steps, micro_batches = layout
    batch = layout_batch(seed=23, rows=world_size * steps * micro_batches * ROWS_PER_MICRO_BATCH)
    batch["old_logps"][2] = batch["logps"][2] + 0.8  # a row of a weight far from 1: phi far from 1
    _, metrics, _ = lit_layout(batch, case, *layout)
    assert all(set(step) == {"vespo/phi_seq_mean"} for step in metrics)
    per_rank = len(metrics) // world_size
    rank_values = [update_metrics(metrics[rank * per_rank:(rank + 1) * per_rank], 1, steps, lambda value, op: value)
                   for rank in range(world_size)]
    logged = torch.stack([values["vespo/phi_seq_mean"] for values in rank_values]).mean()

    slots = list(layout_micro_batches(world_size, steps, micro_batches))
    by_index = [[rows for rank, rows in slots if rank == r][index] for r in range(world_size) for index in range(per_rank)]
    trl_values = [trl_phi_seq_mean(batch, case, [by_index[r * per_rank + index] for r in range(world_size)])
                  for index in range(per_rank)]
    close(logged, torch.stack(trl_values).mean())
    assert abs(float(logged) - 1.0) > 1e-3  # the weights are not all 1


def test_vespo_computes_the_old_log_probs_of_zero_advantage_rows_that_phi_counts(
    tiny_model_dir, say_a_or_b_file, fast_trainer, monkeypatch
):
    # skip_zero_gradient_rows leaves the old log-probs of zero-advantage rows out (their loss terms are 0),
    # but vespo/phi_seq_mean averages phi over every row, those too: vespo computes them, and the update
    # and every logged value equal those of a run that does not skip
    monkeypatch.setattr(lit_grpo.train.logprob_passes, "FORWARD_OVERHEAD_TOKENS", 0)  # short rows: left out all the same
    runs = {}
    for skip in (False, True):
        pl.seed_everything(0)
        module = make_module(tiny_model_dir, rewards=LOWERCASE, loss_type="vespo", steps_per_generation=2,
                             optimizer=adamw(0.02), skip_zero_gradient_rows=skip)
        sampled = []
        generate_and_score = module.generate_and_score

        def recording(batch, training=True, generate_and_score=generate_and_score, sampled=sampled):
            scored, completions = generate_and_score(batch, training)
            scored.group.advantages[:4] = 0.0  # a group of equal rewards
            sampled.append(scored)
            return scored, completions

        module.generate_and_score = recording
        rows_per_pass = count_rows_of_no_grad_passes(module)
        steps = MetricRecorder()
        trainer = fast_trainer(max_steps=2, callbacks=[steps])
        trainer.fit(module, make_data(say_a_or_b_file))
        runs[skip] = rows_per_pass, steps.steps[0], [p.detach().clone() for p in module.policy.parameters()], sampled[0]

    (every_row, expected_metrics, expected, _), (rows_per_pass, metrics, weights, scored) = runs[False], runs[True]
    assert every_row == rows_per_pass == [4]  # the second optimizer step's 4 rows, zero advantage or not
    later_zero_rows = (scored.old_logps[:4] != 0).any(dim=1)  # the zero-advantage group's rows have old log-probs
    assert later_zero_rows.all()
    assert metrics["vespo/phi_seq_mean"] == pytest.approx(expected_metrics["vespo/phi_seq_mean"], rel=1e-5)
    assert abs(metrics["vespo/phi_seq_mean"] - 1.0) > 1e-4
    for got, want in zip(weights, expected):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_vespo_with_the_off_policy_mask_on_two_processes_matches_one_process(tiny_model_dir, tmp_path):
    """DDP on 2 ranks (tests/distributed_worker.py through torch.distributed.run, as a user launches it):
    vespo's token sum over the generation batch's tokens of every rank, the off-policy mask and
    ``vespo/phi_seq_mean`` averaged over ranks give the losses, metrics and weights of one process on the
    same global batch. ``num_iterations: 2``: the second pass is off-policy (phi away from 1, the mask on)."""
    import json
    from concurrent.futures import ThreadPoolExecutor

    import yaml
    from test_distributed import BASE_CONFIG, GLOBAL_BATCH, run_worker

    rows = [{"prompt": f"Say {c} {i}:"} for i, c in enumerate("abcdefghijkl")]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = json.loads(json.dumps(BASE_CONFIG))
    config["model"].update(model_name_or_path=str(tiny_model_dir), loss_type="vespo", vespo_k_pos=3.0, vespo_lambda_pos=1.0,
                           off_policy_mask_threshold=0.0)
    config["data"]["data_files"] = str(tmp_path / "prompts.jsonl")
    config["trainer"]["max_steps"] = 2  # one generation batch, two passes
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(config))
    single = {"trainer": {"devices": 1}, "data": {"batch_size": GLOBAL_BATCH}}
    with ThreadPoolExecutor(max_workers=1) as pool:  # the run without the mask beside the others (CI's 2 cores)
        without_mask = pool.submit(run_worker, tmp_path, "single_vespo_no_mask", 1,
                                   {**single, "model": {"off_policy_mask_threshold": None}}, "--fixed-completions")
        one = run_worker(tmp_path, "single_vespo", 1, single, "--fixed-completions")
        two = run_worker(tmp_path, "ddp_vespo", 2, {"trainer": {"devices": 2, "strategy": "ddp"},
                                                    "data": {"batch_size": GLOBAL_BATCH // 2}}, "--fixed-completions")
        without_mask = without_mask.result()
    assert two["world_size"] == 2 and len(one["steps"]) == len(two["steps"]) == 1
    expected, actual = one["steps"][0], two["steps"][0]
    for name in ["loss", "kl", "entropy", "vespo/phi_seq_mean", "grad_norm"]:
        assert actual[name] == pytest.approx(expected[name], rel=1e-4, abs=1e-6), name
    assert abs(expected["vespo/phi_seq_mean"] - 1.0) > 1e-4  # the second pass's weights are not all 1
    assert not any(name.startswith("clip_ratio/") for name in expected)
    for name, weights in one["state"].items():
        torch.testing.assert_close(two["state"][name], weights, rtol=1e-4, atol=1e-5, msg=name)
    # the mask fired: without it (off_policy_mask_threshold: null) the same run ends with other weights
    assert not all(torch.allclose(without_mask["state"][name], weights, rtol=1e-4, atol=1e-5)
                   for name, weights in one["state"].items())


# update.py's own loop against TRL's layout: micro_batch_size 2, steps_per_generation 2 on 8 rows (two optimizer
# steps of two micro-batches); "sampling": another engine's log-probs, 0.3 nats per token above the policy's on rows 0-3
UPDATE_CASES = {
    "luspo": {"loss_type": "luspo", "importance_sampling_level": "sequence"},
    "vespo": {"loss_type": "vespo", "vespo": (4.0, 0.5, 0.5, 4.0)},
    "dapo-off-policy-mask": {"loss_type": "dapo", "threshold": 0.1, "sampling": True},
}


def padded(values, width):
    """``values`` ``[n, c]`` padded with zeros to ``[n, width]``."""
    return torch.nn.functional.pad(values, (0, width - values.size(1)))


@pytest.mark.parametrize("name", sorted(UPDATE_CASES))
def test_update_policys_first_optimizer_step_accumulates_trls_gradient(tiny_model_dir, fast_trainer, name):
    # the real update_policy, with update.py's accumulation scale (1/micro_batches for luspo, 1 for vespo and dapo):
    # the gradient in the weights at its first optimizer step is TRL's over the same micro-batches (trl_layout:
    # current_gradient_accumulation_steps 2, steps_per_generation 4), pulled back through the policy's log-probs
    case = UPDATE_CASES[name]
    vespo = dict(zip(("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"), case.get("vespo", (2.0, 3.0, 3.0, 2.0))))
    torch.manual_seed(0)
    module = attach_trainer(make_module(
        tiny_model_dir, loss_type=case["loss_type"], importance_sampling_level=case.get("importance_sampling_level", "token"),
        off_policy_mask_threshold=case.get("threshold"), vllm_importance_sampling_correction=False, micro_batch_size=2,
        steps_per_generation=2, max_grad_norm=None, max_completion_length=10, skip_zero_gradient_rows=False,
        forward_token_budget=None, share_prompt_forward=False, **vespo,
    ), fast_trainer)
    scored = scored_batch(module)
    passes = plain_passes(module)
    initial = copy.deepcopy(module.policy)
    width = scored.loss_mask.size(1)
    with torch.no_grad():
        logps = padded(passes.completion_logps(initial, scored.rollout)[0], width)  # [8, width]: on-policy, the old ones too
    if case.get("sampling"):
        scored.rollout.sampling_logps = logps + torch.tensor([0.3] * 4 + [0.0] * 4).unsqueeze(1)

    optimizer = torch.optim.SGD(module.policy.parameters(), lr=0.1)
    first_step_grads = []
    optimizer_step = optimizer.step

    def recording_step():
        if not first_step_grads:
            first_step_grads.extend(torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in module.policy.parameters())
        optimizer_step()

    optimizer.step = recording_step
    torch.manual_seed(7)  # the update's order of the rows (steps_per_generation > 1: one permutation)
    step_stats, _ = update_policy(scored, passes, module.policy, module.policy.parameters, optimizer, None,
                                  module.settings.update, lambda: None)
    torch.manual_seed(7)
    order = torch.randperm(8)
    assert len(step_stats) == 4 and first_step_grads

    # TRL on the rows in the update's order: trl_layout's micro-batches [0, 1], [2, 3] are the first optimizer step's
    batch = {"logps": logps[order], "old_logps": logps[order], "ref_logps": logps[order], "advantages": scored.group.advantages[order],
             "mask": scored.loss_mask[order].float()}
    if case.get("sampling"):
        batch["sampling_logps"] = scored.rollout.sampling_logps[order]
        keep = trl_get_off_policy_mask(batch["advantages"][:4].unsqueeze(1), batch["logps"][:4], batch["sampling_logps"][:4],
                                       batch["mask"][:4], case["threshold"])
        assert keep.squeeze(1).tolist() == [1.0, 0.0, 1.0, 1.0]  # row 0 (A = -1.5, KL 0.3) dropped, row 4 (A = -1, KL 0) kept
    _, trl_grad = trl_layout(batch, case, world_size=1, steps=2, micro_batches=2)  # [8, width]
    for micro_batch in (0, 1):
        rows = torch.arange(2 * micro_batch, 2 * micro_batch + 2)
        micro_logps, _ = passes.completion_logps(initial, scored.rollout.select(order[rows]))  # [2, c] with grad
        (micro_logps * trl_grad[rows, : micro_logps.size(1)]).sum().backward()
    expected = torch.cat([p.grad.flatten() for p in initial.parameters()])
    actual = torch.cat([grad.flatten() for grad in first_step_grads])
    assert expected.norm() > 1e-3
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-6)
