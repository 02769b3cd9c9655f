"""The entropy bonus (``model.entropy_coef``) and adaptive entropy control (``use_adaptive_entropy``)
in training: the update's loss and gradient against TRL 1.16's formula over several micro-batches and
optimizer steps, the entropy's gradient really reaching the weights, the controller's state in
checkpoints and over two ranks."""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch
from test_distributed import GLOBAL_BATCH, run_dir, run_worker  # noqa: F401 (run_dir: a fixture)
from test_module import attach_trainer, make_data, make_module, record_generation_batches
from test_trl_options import trl_adaptive_window, trl_compute_loss, trl_entropy_bonus

import lit_grpo.train.logprob_passes
from lit_grpo import algorithm
from lit_grpo.algorithm import fused_lm_head
from lit_grpo.data import PromptBatch
from lit_grpo.rollout.records import position_ids_from_mask
from lit_grpo.train.logprob_passes import ENTROPY_WINDOW, LogProbPasses
from lit_grpo.train.update import update_policy

NO_REWARD = [{"name": "char_fraction", "args": {"chars": "\u00e9"}}]  # not in the tiny model's printable vocabulary: reward 0
BATCH = PromptBatch(prompts=["Say a:", "Now say the letter b:"], columns={"target": ["a", "b"]})
# the advantages of the 8 rows: two of them 0 (a row with A = 0 still has the bonus's gradient)
ADVANTAGES = torch.tensor([-1.2, 0.0, 0.7, 1.5, 0.0, -0.4, 0.9, -1.0])
CONTROLS = {
    "fixed": dict(entropy_coef=0.3),
    # the tiny model's entropy (~4.6 nats) is below the target: up by 0.05 a step from 0.1, capped at 0.2
    "adaptive": dict(entropy_coef=0.1, use_adaptive_entropy=True, entropy_target=6.0, entropy_coef_delta=0.05,
                     entropy_coef_max=0.2),
}


def plain_passes(module) -> LogProbPasses:
    """The module's log-prob passes with a plain backward (no trainer's strategy) and one rank."""
    passes = LogProbPasses(module.settings, all_gather=lambda tensor: tensor,
                           backward=lambda loss, sync: loss.backward(), grad_scale=lambda: 1.0)
    passes.device_defaults = module.logprobs.device_defaults
    return passes


def full_vocabulary_forward(model, rollout) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies ``[n, C]`` of the completions from the model's full logits, as TRL's
    ``_get_per_token_logps_and_entropies`` (temperature 1: no scaling)."""
    input_ids = torch.cat([rollout.prompt_ids, rollout.completion_ids[:, :-1]], dim=1)
    attention_mask = torch.cat([rollout.prompt_mask, rollout.completion_mask[:, :-1]], dim=1)
    logits = model(input_ids=input_ids, attention_mask=attention_mask,
                   position_ids=position_ids_from_mask(attention_mask)).logits[:, -rollout.completion_ids.size(1):]
    logps = torch.log_softmax(logits.float(), dim=-1).gather(-1, rollout.completion_ids.unsqueeze(-1)).squeeze(-1)
    return logps, torch.distributions.Categorical(logits=logits.float()).entropy()


def trl_high_entropy_mask(entropies, mask, threshold):
    """TRL 1.16's ``GRPOTrainer.get_high_entropy_mask`` on one process (``pad_across_processes`` and
    ``gather`` of one rank are the identity), ``threshold = 1 - top_entropy_quantile``: ``[n, C]`` bool."""
    gathered = entropies[mask.bool()].float()
    if gathered.numel() == 0:
        return torch.zeros_like(entropies, dtype=torch.bool)
    entropy_threshold = torch.quantile(gathered, threshold)
    return (entropies * mask.float() >= entropy_threshold) & mask.bool()


def trl_update(model, scored, settings, orders, lr, micro_batch_size, with_bonus=True):
    """TRL 1.16's training on the generation batch ``scored``: each optimizer step's micro-batches through
    ``_compute_loss`` (:func:`trl_compute_loss` with ``top_entropy_quantile``'s mask of the micro-batch
    (:func:`trl_high_entropy_mask`), then :func:`trl_entropy_bonus` over the effective mask with the step's
    coefficient and the accumulation steps), adaptive control over the step's window (:func:`trl_adaptive_window`), SGD.
    Returns every micro-batch's (loss, policy_loss), the coefficient after each optimizer step and the entropy
    adaptive control read at each (TRL's ``last_world_entropy``; infinity with a fixed coefficient)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    rows_total = scored.rollout.completion_ids.size(0)
    steps_per_generation = settings.update.steps_per_generation
    mini_batch = rows_total // steps_per_generation
    micro_batches = mini_batch // micro_batch_size
    with torch.no_grad():
        old_logps, _ = full_vocabulary_forward(model, scored.rollout)
    entropy = settings.entropy
    windows, losses, coefficients, world_entropies = [], [], [], []
    coefficient, world_entropy = entropy.entropy_coef, float("inf")
    for order in orders:
        for start in range(0, rows_total, mini_batch):
            step_rows = order[start : start + mini_batch].split(micro_batch_size)
            forwards = [full_vocabulary_forward(model, scored.rollout.select(rows)) for rows in step_rows]
            quantile = settings.logprobs.top_entropy_quantile
            entropy_masks = [None if quantile >= 1.0 else trl_high_entropy_mask(entropies, scored.loss_mask[rows], 1 - quantile)
                             for (_, entropies), rows in zip(forwards, step_rows)]  # [n, C] bool each, or None
            effective_masks = [scored.loss_mask[rows].float() * (1.0 if entropy_mask is None else entropy_mask)
                               for rows, entropy_mask in zip(step_rows, entropy_masks)]  # TRL's effective_mask
            windows.append([(entropies.detach(), effective_mask) for (_, entropies), effective_mask in zip(forwards, effective_masks)])
            if entropy.use_adaptive_entropy:
                apply_coef, coefficient, world_entropy = trl_adaptive_window(windows, entropy.entropy_coef, entropy.entropy_target,
                                                              entropy.entropy_coef_min, entropy.entropy_coef_max,
                                                              entropy.entropy_coef_delta)[-1]
            else:
                apply_coef = coefficient
            for (logps, entropies), rows, entropy_mask, effective_mask in zip(forwards, step_rows, entropy_masks, effective_masks):
                mask = scored.loss_mask[rows].float()
                loss = trl_compute_loss(
                    logps, old_logps[rows], scored.group.advantages[rows], mask, loss_type=settings.loss.loss_type,
                    num_items_in_batch=scored.loss_mask.sum(), current_gradient_accumulation_steps=micro_batches,
                    steps_per_generation=steps_per_generation * micro_batches, entropy_mask=entropy_mask,
                )
                policy_loss = loss * micro_batches if settings.loss.loss_type == "grpo" else loss  # TRL's, before / GA
                if with_bonus:
                    loss = trl_entropy_bonus(loss, entropies, effective_mask, apply_coef, micro_batches)
                loss.backward()
                losses.append((float(loss.detach()), float(policy_loss.detach())))
            optimizer.step()
            optimizer.zero_grad()
            coefficients.append(coefficient)
            world_entropies.append(world_entropy)
    return losses, coefficients, world_entropies


@pytest.mark.parametrize("control,loss_type,budget,fused,quantile", [
    ("fixed", "grpo", None, False, 1.0), ("adaptive", "dapo", None, False, 1.0),
    # micro-batches above the token budget go backward in chunks of rows
    ("adaptive", "grpo", 12, False, 1.0), ("fixed", "dapo", 12, False, 1.0),
    # the log-probs and entropy from the fused LM head, in tiles of 5 tokens
    ("adaptive", "grpo", None, True, 1.0), ("fixed", "dapo", 12, True, 1.0),
    # top_entropy_quantile: the policy term and the bonus (and its window) on the high-entropy half of the tokens
    ("fixed", "grpo", None, False, 0.5), ("adaptive", "dapo", None, False, 0.5),
])
def test_update_matches_trls_loss_and_gradient_over_steps(tiny_model_dir, fast_trainer, monkeypatch, control, loss_type, budget,
                                                         fused, quantile):
    # every row without gradient is left out of the backward where it may be (the threshold is for long rows)
    monkeypatch.setattr(lit_grpo.train.logprob_passes, "FORWARD_OVERHEAD_TOKENS", 0)
    fused_calls = []  # the entropy_grad of each fused LM head call
    if fused:
        monkeypatch.setattr(fused_lm_head, "tile_bytes_for", lambda device_type, vocab_size: 5 * 4 * vocab_size)
        fused_token_logprobs = fused_lm_head.fused_token_logprobs
        monkeypatch.setattr(fused_lm_head, "fused_token_logprobs", lambda *args, **kwargs: (
            fused_calls.append(kwargs.get("entropy_grad", False)), fused_token_logprobs(*args, **kwargs))[1])
    torch.manual_seed(0)
    module = attach_trainer(make_module(
        tiny_model_dir, loss_type=loss_type, micro_batch_size=2, steps_per_generation=2, num_iterations=2,
        max_grad_norm=None, forward_token_budget=budget, share_prompt_forward=False, top_entropy_quantile=quantile,
        **CONTROLS[control],
    ), fast_trainer)
    module.generation_config.sequence_bias = {(module.tokenizer.eos_token_id,): 3.0}  # completions of several lengths
    scored, _ = module.generate_and_score(BATCH)
    scored.group.advantages = ADVANTAGES.clone()
    reference, without_bonus = copy.deepcopy(module.policy), copy.deepcopy(module.policy)  # initial weights
    lr = 0.5

    torch.manual_seed(7)  # the update's order of the rows: a permutation per pass (steps_per_generation > 1)
    passes = plain_passes(module)
    read_entropies = []  # the entropy adaptive control reads after each optimizer step
    step = passes.entropy_coefficient.step
    monkeypatch.setattr(passes.entropy_coefficient, "step", lambda entropy: (read_entropies.append(entropy), step(entropy))[1])
    step_stats, _ = update_policy(scored, passes, module.policy, module.policy.parameters,
                                  torch.optim.SGD(module.policy.parameters(), lr=lr), None, module.settings.update, lambda: None)
    torch.manual_seed(7)
    orders = [torch.randperm(8), torch.randperm(8)]
    expected, coefficients, world_entropies = trl_update(reference, scored, module.settings, orders, lr, micro_batch_size=2)

    assert len(step_stats) == len(expected) == 8  # 2 passes x 2 optimizer steps x 2 micro-batches
    assert [float(stats["loss"]) for stats in step_stats] == pytest.approx([loss for loss, _ in expected], rel=1e-5, abs=1e-5)
    assert [float(stats["policy_loss"]) for stats in step_stats] == pytest.approx([policy for _, policy in expected], rel=1e-5, abs=1e-5)
    # the coefficient after each optimizer step, on each of its micro-batches (TRL logs it per optimizer step)
    assert [float(stats["entropy_coef"]) for stats in step_stats] == pytest.approx([c for c in coefficients for _ in (0, 1)])
    assert all(ENTROPY_WINDOW not in stats for stats in step_stats)  # no metric
    assert not any(stats["entropy"].requires_grad for stats in step_stats)  # a statistic keeps no graph
    assert any(fused_calls) == fused  # the fused LM head's entropy with its gradient
    if control == "adaptive":
        assert coefficients == pytest.approx([0.15, 0.2, 0.2, 0.2])
        assert passes.entropy_coefficient.value == pytest.approx(0.2)
        # each step's token-weighted mean over its two micro-batches (TRL's window), not its last micro-batch's
        assert read_entropies == pytest.approx(world_entropies, rel=1e-4, abs=1e-4)  # chunks and tiles sum in another order
        assert passes.entropy_coefficient.last_entropy == pytest.approx(world_entropies[-1], rel=1e-4, abs=1e-4)
    atol = 1e-4 if budget or fused else 2e-5  # chunks and tiles sum the gradient in another order (lr 0.5, 4 steps)
    for (name, actual), expected_weight in zip(module.policy.named_parameters(), reference.parameters()):
        torch.testing.assert_close(actual, expected_weight, atol=atol, rtol=1e-4, msg=lambda text, name=name: f"{name}: {text}")
    if control == "fixed" and budget is None and not fused:  # not vacuous: without the bonus TRL's weights end elsewhere
        trl_update(without_bonus, scored, module.settings, orders, lr, micro_batch_size=2, with_bonus=False)
        moved = max((a - b).abs().max().item() for a, b in zip(without_bonus.parameters(), reference.parameters()))
        assert moved > 1e-3


def test_rows_with_zero_advantage_train_when_the_bonus_is_on(tiny_model_dir, fast_trainer, monkeypatch):
    monkeypatch.setattr(lit_grpo.train.logprob_passes, "FORWARD_OVERHEAD_TOKENS", 0)
    module = attach_trainer(make_module(tiny_model_dir, entropy_coef=0.1), fast_trainer)
    scored, _ = module.generate_and_score(BATCH)
    scored.group.advantages = ADVANTAGES.clone()
    rows = torch.arange(8)
    assert module.logprobs.rows_without_gradient(module.policy, scored, rows, entropy_bonus=True) is None
    frozen = module.logprobs.rows_without_gradient(module.policy, scored, rows)
    assert frozen is not None and frozen.tolist() == [1, 4]
    # the loss's function: zero advantage rows are inert only without the bonus; a row with no token always
    mask = torch.ones(3, 4)
    mask[2] = 0
    advantages = torch.tensor([0.0, 1.0, 0.5])
    assert algorithm.rows_without_gradient(advantages, mask, "dapo", 0.0).tolist() == [True, False, True]
    assert algorithm.rows_without_gradient(advantages, mask, "dapo", 0.0, entropy_bonus=True).tolist() == [False, False, True]


def completion_entropy(module, rollout) -> float:
    """The policy's mean entropy over the completion tokens of ``rollout``."""
    with torch.no_grad():
        _, entropy = module.logprobs.completion_logps(module.policy, rollout, with_entropy=True)
    return float(algorithm.masked_mean(entropy, rollout.completion_mask))


def test_a_positive_bonus_raises_the_entropy_with_zero_rewards(tiny_model_dir, say_a_or_b_file, fast_trainer):
    # every reward 0: every advantage 0, so only the bonus's gradient moves the weights (SGD: no weight decay)
    pl.seed_everything(0)
    module = make_module(tiny_model_dir, rewards=NO_REWARD, entropy_coef=1.0, max_grad_norm=None,
                         optimizer=lambda params: torch.optim.SGD(params, lr=2.0))
    module.configure_model()
    scored_batches = record_generation_batches(module)
    initial = copy.deepcopy(module.policy)
    trainer = fast_trainer(max_steps=4)
    trainer.fit(module, make_data(say_a_or_b_file))
    assert all(float(scored.group.advantages.abs().max()) == 0.0 for scored in scored_batches)
    first = scored_batches[0].rollout
    after = completion_entropy(module, first)
    module.policy = initial
    before = completion_entropy(module, first)
    assert after > before + 0.01, (before, after)
    assert float(trainer.logged_metrics["entropy_coef"]) == 1.0
    assert float(trainer.logged_metrics["policy_loss"]) == 0.0


def fit_adaptive(tiny_model_dir, say_a_or_b_file, fast_trainer, max_steps, directory=None, ckpt_path=None):
    """An adaptive run whose target (4.55 nats) the tiny model's entropy crosses; the controller's state after
    every training step; with ``directory``, a checkpoint there after each step."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    pl.seed_everything(0)
    module = make_module(tiny_model_dir, use_adaptive_entropy=True, entropy_coef=0.1, entropy_target=4.55,
                         entropy_coef_delta=0.05, optimizer=lambda params: torch.optim.SGD(params, lr=1.0))
    states = []

    class RecordCoefficient(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            states.append(pl_module.logprobs.entropy_coefficient.state_dict())

    callbacks = [RecordCoefficient()]
    if directory is not None:
        callbacks.append(ModelCheckpoint(dirpath=directory, save_last=True, save_top_k=0, every_n_train_steps=1))
    trainer = fast_trainer(max_steps=max_steps, enable_checkpointing=directory is not None, callbacks=callbacks)
    trainer.fit(module, make_data(say_a_or_b_file), ckpt_path=ckpt_path)
    return states


def test_the_adaptive_coefficient_resumes_exactly_from_a_checkpoint(tiny_model_dir, say_a_or_b_file, fast_trainer, tmp_path):
    straight = fit_adaptive(tiny_model_dir, say_a_or_b_file, fast_trainer, max_steps=4)
    fit_adaptive(tiny_model_dir, say_a_or_b_file, fast_trainer, max_steps=2, directory=tmp_path)
    checkpoint = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert checkpoint["entropy_control"] == straight[1]
    resumed = fit_adaptive(tiny_model_dir, say_a_or_b_file, fast_trainer, max_steps=4, ckpt_path=str(tmp_path / "last.ckpt"))
    assert resumed == straight[2:]
    # the controller moved both ways (down from 0.1 above the target, then up), and a fresh state after
    # the resume (no measurement: no bonus at step 3) would differ
    coefficients = [state["entropy_coef"] for state in straight]
    assert coefficients[0] < 0.1 < coefficients[-1]
    # a checkpoint without the state (before the key existed) loads, keeping the fresh state
    del checkpoint["entropy_control"]
    fresh = make_module(tiny_model_dir, use_adaptive_entropy=True, entropy_coef=0.1)
    fresh.on_load_checkpoint(checkpoint)
    assert fresh.logprobs.entropy_coefficient.state_dict() == {"entropy_coef": 0.1, "last_world_entropy": float("inf")}


# two ranks: the adaptive coefficient from the entropy of every rank's tokens (tests/distributed_worker.py)
ADAPTIVE_MODEL = {"use_adaptive_entropy": True, "entropy_coef": 0.1, "entropy_target": 10.0, "entropy_coef_delta": 0.05}


def test_two_ranks_agree_on_the_adaptive_coefficient_of_one_process(run_dir):
    one = run_worker(run_dir, "entropy_single", 1, {"trainer": {"devices": 1}, "data": {"batch_size": GLOBAL_BATCH},
                                                    "model": ADAPTIVE_MODEL}, "--fixed-completions")
    two = run_worker(run_dir, "entropy_ddp", 2, {"trainer": {"devices": 2, "strategy": "ddp"},
                                                 "data": {"batch_size": GLOBAL_BATCH // 2}, "model": ADAPTIVE_MODEL},
                     "--fixed-completions")
    # both ranks hold the state of the entropy of all their tokens (each rank's own would differ), that of one process
    first, second = two["entropy_control"]
    assert first == second
    assert first == pytest.approx(one["entropy_control"][0], rel=1e-5)
    assert first["entropy_coef"] == pytest.approx(0.1 + 4 * 0.05)  # 4 optimizer steps, each at or below the target
    assert [step["entropy_coef"] for step in two["steps"]] == pytest.approx([step["entropy_coef"] for step in one["steps"]])
    # the bonus, applied from the second optimizer step, gives the same weights
    for name, expected in one["state"].items():
        torch.testing.assert_close(two["state"][name], expected, rtol=1e-4, atol=1e-5, msg=name)


def test_the_entropy_settings_record_has_the_modules_and_trls_defaults(tiny_model_dir):
    import dataclasses
    import inspect

    from lit_grpo.settings import EntropyControlSettings, RunSettings
    from lit_grpo.train.module import GRPOModule

    parameters = inspect.signature(GRPOModule).parameters
    trl = pytest.importorskip("trl")
    trl_defaults = {field.name: field.default for field in dataclasses.fields(trl.GRPOConfig)}
    for field in dataclasses.fields(EntropyControlSettings):
        assert field.default == parameters[field.name].default == trl_defaults[field.name], field.name
    module = make_module(tiny_model_dir, entropy_coef=0.01, use_adaptive_entropy=True, entropy_target=0.5,
                         entropy_coef_min=0.001, entropy_coef_max=0.1, entropy_coef_delta=0.002)
    assert module.settings == RunSettings.from_hparams(module.hparams, "transformers")
    assert module.settings.entropy == EntropyControlSettings(0.01, True, 0.5, 0.001, 0.1, 0.002)
    assert module.logprobs.entropy_coefficient.settings == module.settings.entropy
    # apply_settings keeps the controller's state while the entropy settings stay, and starts afresh when they change
    module.logprobs.entropy_coefficient.step(0.1)
    module.apply_settings()
    assert module.logprobs.entropy_coefficient.state_dict() == pytest.approx({"entropy_coef": 0.012, "last_world_entropy": 0.1})
    module.hparams.entropy_target = 0.05
    module.apply_settings()
    assert module.logprobs.entropy_coefficient.state_dict() == {"entropy_coef": 0.01, "last_world_entropy": float("inf")}



BROKEN_OPTIMIZER = """import os
import sys

import torch


class BrokenOnRank1(torch.optim.AdamW):
    def step(self, closure=None):
        if os.environ["RANK"] == "1":
            raise RuntimeError("rank 1's optimizer step broke")
        loss = super().step(closure)
        print("rank 0 stepped", file=sys.stderr, flush=True)
        return loss
"""


def test_a_rank_failing_at_its_optimizer_step_ends_both_ranks_with_its_error(tiny_model_dir, tmp_path):
    """2 processes (gloo DDP, launched as a user does) with adaptive entropy control: rank 1's optimizer
    step raises, so rank 1 never joins the all-gather of the entropy window that rank 0 enters right
    after its own step. Both processes end within the bound (no hang in that collective: rank 1's exit
    closes its connection, which ends rank 0's all-gather, and the launcher stops the rest), and the
    output names rank 1's error. (Measured: a rank 1 that hangs instead of raising keeps rank 0 in the
    all-gather, and this test fails at its bound.)"""
    import os
    import subprocess
    import sys

    import yaml
    from test_distributed import REPO

    (tmp_path / "broken_optimizer.py").write_text(BROKEN_OPTIMIZER)
    config = yaml.safe_load((REPO / "configs/quickstart.yaml").read_text())
    config["model"].update(model_name_or_path=str(tiny_model_dir), max_completion_length=8, **ADAPTIVE_MODEL)
    config["data"].update(data_files=str(REPO / config["data"]["data_files"]), batch_size=2)
    config["trainer"].update(devices=2, strategy="ddp", max_steps=2, logger=False, enable_checkpointing=False)
    config["optimizer"] = {"class_path": "broken_optimizer.BrokenOnRank1", "init_args": {"lr": 1e-3}}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "-m", "lit_grpo.cli", "fit", "--config", "config.yaml"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(tmp_path)}
    launcher = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    bound = 300
    try:
        _, stderr = launcher.communicate(timeout=bound)
    except subprocess.TimeoutExpired:  # a hang: the workers killed too (each runs in a session of its own)
        import psutil

        for process in [*psutil.Process(launcher.pid).children(recursive=True), psutil.Process(launcher.pid)]:
            process.kill()
        _, stderr = launcher.communicate()
        pytest.fail(f"the ranks were still running after {bound} s: a hang\n{stderr[-3000:]}")
    assert launcher.returncode != 0
    assert "rank 0 stepped" in stderr, stderr[-3000:]  # rank 0 went on to the entropy window's all-gather
    assert "[rank1]: RuntimeError: rank 1's optimizer step broke" in stderr, stderr[-3000:]
