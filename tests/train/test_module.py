"""GRPOModule + GRPODataModule driven by a Lightning Trainer on CPU with the tiny model.

Each test asserts a behaviour of the training step that could break: the optimizer steps taken,
the metrics logged (TRL's names, DESIGN.md 3.3), the importance ratios of the PPO update, the
reference model, the agreement of sampling and training log-probs, the invariance of the gradient to
micro-batching, learning itself, truncation masking, gradient clipping and the LR scheduler, chat
prompts and the TensorBoard table of completions.
"""

from __future__ import annotations

import copy
import math
import string

import lightning.pytorch as pl
import pytest
import torch

import lit_grpo.train.logprob_passes
import lit_grpo.train.module
from lit_grpo import algorithm
from lit_grpo.data import GRPODataModule, PromptBatch
from lit_grpo.train.logprob_passes import LogProbPasses
from lit_grpo.train.module import GRPOModule, ignore_expected_lightning_warnings

CHAR_FRACTION = [{"name": "char_fraction", "weight": 1.0}]
# The fraction of lowercase letters varies between a random model's completions, so (unlike the
# fraction of one target letter, almost always 0 at first) it gives non-zero advantages from step 1.
LOWERCASE = [{"name": "char_fraction", "args": {"chars": string.ascii_lowercase}}]

DESIGN_METRICS = [
    "reward",
    "reward_std",
    "rewards/char_fraction/mean",
    "rewards/char_fraction/std",
    "frac_reward_zero_std",
    "entropy",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "completions/mean_length",
    "completions/min_length",
    "completions/max_length",
    "completions/clipped_ratio",
    "loss",
    "step_time",
]


def make_module(model_dir, **overrides) -> GRPOModule:
    kwargs = dict(
        model_name_or_path=str(model_dir),
        rewards=CHAR_FRACTION,
        num_generations=4,
        max_completion_length=8,
        log_completions_every_n_steps=0,
    )
    kwargs.update(overrides)
    return GRPOModule(**kwargs)


def make_data(path, batch_size=2, **overrides) -> GRPODataModule:
    return GRPODataModule(path="json", data_files=str(path), batch_size=batch_size, **overrides)


def adamw(lr):
    """AdamW without weight decay, so that parameters move only where there is a gradient."""
    return lambda params: torch.optim.AdamW(params, lr=lr, weight_decay=0.0)


def sgd(lr):
    """Plain SGD: the weights move by the gradient itself (AdamW's normalisation would magnify rounding
    differences in tiny gradient elements to a fraction of the learning rate)."""
    return lambda params: torch.optim.SGD(params, lr=lr)


class MetricRecorder(pl.Callback):
    """Keeps ``trainer.callback_metrics`` after every training step (generation batch)."""

    def __init__(self):
        self.steps: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps.append({key: float(value) for key, value in trainer.callback_metrics.items()})


def record_generation_batches(module: GRPOModule, edit=None) -> list:
    """The ScoredRollout of every generation batch the module trains on, appended as they come
    (after ``edit(scored)``, which may change them, e.g. set advantages)."""
    batches = []
    generate_and_score = module.generate_and_score

    def recording(batch, training=True):
        scored, completions = generate_and_score(batch, training)
        if edit is not None:
            edit(scored)
        batches.append(scored)
        return scored, completions

    module.generate_and_score = recording
    return batches


def attach_trainer(module: GRPOModule, fast_trainer) -> GRPOModule:
    """Load the policy and attach an (unfitted) trainer, so the step's pieces can be called directly."""
    module.configure_model()
    module.trainer = fast_trainer()
    return module


# --------------------------------------------------------------------------------------------------
# 1. A short fit
# --------------------------------------------------------------------------------------------------


def test_two_step_fit_updates_policy_and_logs_trl_metrics(tiny_model_dir, say_a_or_b_file, fast_trainer):
    pl.seed_everything(0)
    module = make_module(tiny_model_dir, rewards=LOWERCASE, optimizer=adamw(1e-3))
    module.configure_model()  # idempotent: the trainer's own call keeps this policy
    before = {name: p.detach().clone() for name, p in module.policy.named_parameters()}
    scored_batches = record_generation_batches(module)
    trainer = fast_trainer(max_steps=2)
    trainer.fit(module, make_data(say_a_or_b_file))

    assert trainer.global_step == 2
    changed = [name for name, p in module.policy.named_parameters() if not torch.equal(p, before[name])]
    assert len(changed) == len(before), f"unchanged parameters: {set(before) - set(changed)}"

    metrics = {key: float(value) for key, value in trainer.logged_metrics.items()}
    missing = [name for name in DESIGN_METRICS if name not in metrics]
    assert not missing, f"metrics missing from {sorted(metrics)}"
    for name in DESIGN_METRICS:
        assert math.isfinite(metrics[name]), (name, metrics[name])
    assert "kl" not in metrics  # beta == 0
    assert 1 <= metrics["completions/min_length"] <= metrics["completions/mean_length"]
    assert metrics["completions/mean_length"] <= metrics["completions/max_length"] <= 8
    assert 0.0 <= metrics["completions/clipped_ratio"] <= 1.0
    assert 0.0 <= metrics["reward"] <= 1.0
    assert 0.0 <= metrics["frac_reward_zero_std"] <= 1.0
    assert metrics["entropy"] > 0
    assert metrics["step_time"] > 0
    # the time split: every phase timed, together within the step, and the throughput from it
    phases = [metrics[f"time/{phase}"] for phase in ("generate", "rewards", "logprobs", "train")]
    assert all(seconds >= 0 for seconds in phases) and metrics["time/generate"] > 0 and metrics["time/train"] > 0
    assert sum(phases) <= metrics["step_time"]
    completion_tokens = metrics["completions/mean_length"] * 2 * 4  # batch 2 prompts x G 4
    assert metrics["tokens_per_second"] == pytest.approx(completion_tokens / metrics["step_time"], rel=1e-4)
    # num_iterations 1: the ratio is exactly 1, so nothing is ever clipped.
    assert metrics["clip_ratio/region_mean"] == 0.0

    # The last step's metrics are those of its rollout. At ratio 1 the dapo loss is
    # -sum_i A_i * len_i / sum_i len_i (every token of completion i carries A_i).
    assert len(scored_batches) == 2
    last = scored_batches[-1]
    lengths = last.loss_mask.sum(dim=1).float()
    assert metrics["loss"] == pytest.approx(float(-(last.group.advantages * lengths).sum() / lengths.sum()), abs=1e-6)
    assert metrics["reward"] == pytest.approx(float(last.rewards.mean()), abs=1e-6)
    assert metrics["rewards/char_fraction/mean"] == pytest.approx(float(last.rewards_per_func[:, 0].mean()), abs=1e-6)
    assert metrics["completions/max_length"] == float(last.rollout.completion_lengths.max())
    assert metrics["completions/mean_length"] == pytest.approx(float(last.rollout.completion_lengths.float().mean()))
    # TRL's reward_std: the std of the whole batch's rewards (until issue 54: the mean of the groups' stds)
    assert metrics["reward_std"] == pytest.approx(float(last.rewards.std()), abs=1e-6)


# --------------------------------------------------------------------------------------------------
# 2. num_iterations: old log-probs, ratios, optimizer steps
# --------------------------------------------------------------------------------------------------


def record_ratios(monkeypatch):
    """Wrap ``algorithm.grpo_loss`` (as the module calls it) to record the masked ratios of every call."""
    calls = []
    original = algorithm.grpo_loss

    def wrapper(inputs, settings):
        mask = inputs.completion_mask.bool()
        calls.append(torch.exp(inputs.logps.detach() - inputs.old_logps)[mask])
        return original(inputs, settings)

    monkeypatch.setattr(lit_grpo.train.module.algorithm, "grpo_loss", wrapper)
    return calls


@pytest.mark.parametrize(
    "num_iterations, steps_per_generation",
    [(2, 1), (1, 2)],  # either way: 2 optimizer steps per generation batch, the second after a move
)
def test_second_optimizer_step_sees_moved_policy_and_clips(
    tiny_model_dir, say_a_or_b_file, fast_trainer, monkeypatch, num_iterations, steps_per_generation
):
    pl.seed_everything(0)
    ratios = record_ratios(monkeypatch)
    batches = MetricRecorder()
    module = make_module(
        tiny_model_dir,
        rewards=LOWERCASE,
        num_iterations=num_iterations,
        steps_per_generation=steps_per_generation,
        optimizer=adamw(0.05),
        max_grad_norm=None,
    )
    trainer = fast_trainer(max_steps=4, callbacks=[batches])
    trainer.fit(module, make_data(say_a_or_b_file))

    assert len(batches.steps) == 2  # two generation batches ...
    assert trainer.global_step == 2 * len(batches.steps)  # ... of 2 optimizer steps each
    assert len(ratios) == 4  # one grpo_loss call per optimizer step (no micro-batching)
    first_steps, second_steps = ratios[0::2], ratios[1::2]
    for ratio in first_steps:  # old_logps come from the same weights: ratio 1
        assert (ratio - 1).abs().max() < 1e-5
    for ratio in second_steps:  # after one step at lr 0.05 the policy has moved
        assert (ratio - 1).abs().max() > 1e-3
    # Clipping happens in the second pass; the logged metric averages both passes.
    assert max(step["clip_ratio/region_mean"] for step in batches.steps) > 0


def count_completion_logps(monkeypatch):
    calls = []
    original = LogProbPasses.completion_logps

    def counting(self, model, rollout, with_entropy=False, **options):  # options: entropy_grad, group_by_length
        calls.append({"rows": rollout.completion_ids.size(0), "with_grad": torch.is_grad_enabled()})
        return original(self, model, rollout, with_entropy=with_entropy, **options)

    monkeypatch.setattr(LogProbPasses, "completion_logps", counting)
    return calls


@pytest.mark.parametrize(
    "num_iterations, steps_per_generation, grad_calls, no_grad_rows",
    [
        (1, 1, 2, []),  # 2 micro-batches with grad; the ratio is 1, no old_logps at all
        (2, 1, 2 * 2, []),  # the first pass's own forwards give old_logps: no separate pass
        (1, 2, 2, [4]),  # only the second mini-batch's 4 rows need a pass before the policy moves
        (2, 2, 2 * 2, [4]),
    ],
)
def test_old_logps_pass_only_for_rows_trained_after_the_policy_moves(
    tiny_model_dir, say_a_or_b_file, fast_trainer, monkeypatch, num_iterations, steps_per_generation, grad_calls, no_grad_rows
):
    pl.seed_everything(0)
    calls = count_completion_logps(monkeypatch)
    module = make_module(
        tiny_model_dir,
        num_iterations=num_iterations,
        steps_per_generation=steps_per_generation,
        micro_batch_size=4,
        beta=0.0,
        skip_zero_gradient_rows=False,  # its no-gradient forwards would count here too
    )
    optimizer_steps = num_iterations * steps_per_generation
    trainer = fast_trainer(max_steps=2 * optimizer_steps)
    trainer.fit(module, make_data(say_a_or_b_file))  # 2 prompts * G 4 = 8 completions per step

    assert trainer.global_step == 2 * optimizer_steps
    assert sum(call["with_grad"] for call in calls) == 2 * grad_calls
    assert [call["rows"] for call in calls if not call["with_grad"]] == 2 * no_grad_rows


@pytest.mark.parametrize(
    "num_iterations, steps_per_generation, micro_batch_size, forward_token_budget",
    [(2, 1, 4, None), (1, 2, 2, None), (2, 2, 2, 24), (3, 1, 8, 24)],  # 24 tokens: chunked backwards
)
def test_old_logps_equal_the_sampling_policys_log_probs(
    tiny_model_dir, say_a_or_b_file, fast_trainer, monkeypatch,
    num_iterations, steps_per_generation, micro_batch_size, forward_token_budget,
):
    """Whether they came from the first optimizer step's forwards (with gradient, in micro-batches,
    in chunks, or without gradient for rows left out of the backward) or from the pass before
    training, ``old_logps`` are the log-probs of the policy that sampled, computed afresh. The pass
    before training leaves out rows with advantage 0 (their old log-probs are multiplied by 0)."""
    pl.seed_everything(0)
    monkeypatch.setattr(lit_grpo.train.logprob_passes, "FORWARD_OVERHEAD_TOKENS", 0)  # short rows: leave them out all the same
    module = make_module(
        tiny_model_dir,
        rewards=LOWERCASE,
        num_iterations=num_iterations,
        steps_per_generation=steps_per_generation,
        micro_batch_size=micro_batch_size,
        forward_token_budget=forward_token_budget,
        optimizer=adamw(0.05),
    )
    sampled = []  # (scored, the policy that sampled it)
    generate_and_score = module.generate_and_score

    def recording(batch):
        scored, completions = generate_and_score(batch)
        scored.group.advantages[:4] = 0.0  # a group of equal rewards: its rows skip the backward
        sampled.append((scored, copy.deepcopy(module.policy)))
        return scored, completions

    module.generate_and_score = recording
    later_rows_per_batch = []  # the rows trained after the policy's first move
    sampling_policy_logps = module.logprobs.sampling_policy_logps

    def recording_later_rows(policy, scored, later_rows):
        later_rows_per_batch.append(later_rows)
        return sampling_policy_logps(policy, scored, later_rows=later_rows)

    module.logprobs.sampling_policy_logps = recording_later_rows
    trainer = fast_trainer(max_steps=2 * num_iterations * steps_per_generation)
    trainer.fit(module, make_data(say_a_or_b_file))

    assert len(sampled) == len(later_rows_per_batch) == 2
    for (scored, sampling_policy), later_rows in zip(sampled, later_rows_per_batch):
        with torch.no_grad():
            expected, _ = module.logprobs.completion_logps(sampling_policy, scored.rollout)
        mask = scored.rollout.completion_mask.bool()
        mask[:4] = False  # the zero-advantage group: checked below
        assert mask.sum() > 8
        torch.testing.assert_close(scored.old_logps[mask], expected[mask], rtol=0, atol=1e-5)
        # the zero-advantage group's rows trained in the first optimizer step have theirs from that
        # step's forward; its later rows get no pass
        later = torch.isin(torch.arange(4), later_rows)  # [4]
        assert later.any() == (steps_per_generation > 1)
        first = ~later[:, None] & scored.rollout.completion_mask[:4].bool()  # [4, C]
        torch.testing.assert_close(scored.old_logps[:4][first], expected[:4][first], rtol=0, atol=1e-5)
        assert (scored.old_logps[:4][later] == 0).all()
        # ... and the policy did move, so a stale value would show
        with torch.no_grad():
            after, _ = module.logprobs.completion_logps(module.policy, scored.rollout)
        assert (after[mask] - expected[mask]).abs().max() > 1e-3


@pytest.mark.parametrize("steps_per_generation", [1, 2, 4])
def test_dapo_normalises_each_optimizer_step_by_its_share_of_the_generation_batchs_tokens(
    tiny_model_dir, say_a_or_b_file, fast_trainer, monkeypatch, steps_per_generation
):
    """TRL 1.16: with S optimizer steps per generation batch, dapo divides each step's token sum by
    1/S of the batch's real completion tokens (micro-batches of a step still share one normaliser)."""
    calls = []
    original = lit_grpo.train.module.algorithm.grpo_loss

    def recording(inputs, settings):
        calls.append(inputs.num_items_in_batch)
        return original(inputs, settings)

    monkeypatch.setattr(lit_grpo.train.module.algorithm, "grpo_loss", recording)
    module = make_module(tiny_model_dir, steps_per_generation=steps_per_generation, micro_batch_size=2, loss_type="dapo")
    sampled = record_generation_batches(module)
    trainer = fast_trainer(max_steps=steps_per_generation)  # one generation batch
    trainer.fit(module, make_data(say_a_or_b_file))

    assert len(sampled) == 1
    tokens = float(sampled[0].loss_mask.sum())  # 8 completions
    assert tokens > 8
    assert calls and set(calls) == {tokens / steps_per_generation}


def count_rows_of_no_grad_passes(module) -> list[int]:
    """The rows of each no-gradient log-prob pass of ``module`` from now on (a list that grows as they run)."""
    rows_per_pass = []
    logps_no_grad = module.logprobs.logps_no_grad

    def counting(model, rollout):
        rows_per_pass.append(rollout.completion_ids.size(0))
        return logps_no_grad(model, rollout)

    module.logprobs.logps_no_grad = counting
    return rows_per_pass


@pytest.mark.parametrize("loss_type, importance_sampling_level", [("dapo", "token"), ("grpo", "sequence"), ("sapo", "token")])
def test_old_logps_pass_leaves_out_zero_advantage_rows_and_changes_nothing(
    tiny_model_dir, say_a_or_b_file, fast_trainer, monkeypatch, loss_type, importance_sampling_level
):
    """With ``steps_per_generation`` 2, the pass before training computes old log-probs only for the
    second mini-batch's rows whose advantage is not 0; the update and every logged value equal those
    of computing them for every row (``skip_zero_gradient_rows`` off)."""
    monkeypatch.setattr(lit_grpo.train.logprob_passes, "FORWARD_OVERHEAD_TOKENS", 0)  # short rows: leave them out all the same
    runs = {}
    for skip in (False, True):
        pl.seed_everything(0)
        module = make_module(
            tiny_model_dir, rewards=LOWERCASE, steps_per_generation=2, loss_type=loss_type,
            importance_sampling_level=importance_sampling_level, optimizer=sgd(1.0), skip_zero_gradient_rows=skip,
        )
        record_generation_batches(module, edit=lambda scored: scored.group.advantages[:4].zero_())  # equal rewards
        rows_per_pass = count_rows_of_no_grad_passes(module)  # beta 0: the only such pass is the old log-probs'
        steps = MetricRecorder()
        trainer = fast_trainer(max_steps=2, callbacks=[steps])  # one generation batch, two optimizer steps
        module.configure_model()  # idempotent: the trainer's own call keeps this policy
        initial = [p.detach().clone() for p in module.policy.parameters()]
        trainer.fit(module, make_data(say_a_or_b_file))
        assert trainer.global_step == 2 and len(steps.steps) == 1
        runs[skip] = rows_per_pass, steps.steps[0], [p.detach().clone() for p in module.policy.parameters()]

    (every_row, expected_metrics, expected), (left_out, metrics, weights) = runs[False], runs[True]
    assert every_row == [4] and len(left_out) == 1 and left_out[0] < 4  # some zero-advantage rows were in the second half
    assert max(float((after - before).abs().max()) for after, before in zip(expected, initial)) > 1e-3
    for got, want in zip(weights, expected):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    for name in ("loss", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
        assert metrics[name] == pytest.approx(expected_metrics[name], rel=1e-5, abs=1e-7), name


# --------------------------------------------------------------------------------------------------
# 3. Reference model and KL
# --------------------------------------------------------------------------------------------------


def test_beta_loads_frozen_reference_and_logs_kl(tiny_model_dir, say_a_or_b_file, fast_trainer):
    pl.seed_everything(0)
    steps = MetricRecorder()
    module = make_module(tiny_model_dir, rewards=LOWERCASE, beta=0.1, optimizer=adamw(0.05))
    trainer = fast_trainer(max_steps=2, callbacks=[steps])
    trainer.fit(module, make_data(say_a_or_b_file))

    assert module.ref_model is not None
    assert module.ref_model is not module.policy
    assert all(not p.requires_grad for p in module.ref_model.parameters())
    assert not module.ref_model.training
    # The reference keeps the initial weights while the policy moves.
    ref_params = dict(module.ref_model.named_parameters())
    assert any(not torch.equal(p, ref_params[name]) for name, p in module.policy.named_parameters())
    optimized = {id(p) for group in trainer.optimizers[0].param_groups for p in group["params"]}
    assert optimized == {id(p) for p in module.policy.parameters()}
    assert all("kl" in step for step in steps.steps)
    assert steps.steps[0]["kl"] == pytest.approx(0.0, abs=1e-5)  # policy == reference at step 1
    assert steps.steps[1]["kl"] > 1e-6  # after one update at lr 0.05 they differ


def test_beta_zero_loads_no_reference_and_logs_no_kl(tiny_model_dir, say_a_or_b_file, fast_trainer):
    pl.seed_everything(0)
    module = make_module(tiny_model_dir, beta=0.0)
    trainer = fast_trainer(max_steps=1)
    trainer.fit(module, make_data(say_a_or_b_file))
    assert module.ref_model is None
    assert "kl" not in trainer.logged_metrics
    assert "kl" not in trainer.callback_metrics
    assert "loss" in trainer.logged_metrics


# --------------------------------------------------------------------------------------------------
# 4. Sampling log-probs equal training log-probs (left padding, positions)
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_completion_logps_match_generate_logits_with_left_padding(tiny_model_dir, monkeypatch, temperature):
    torch.manual_seed(0)
    # generate's logits are captured here; the lit sampler gives generate's tokens (test_sampler.py)
    module = make_module(
        tiny_model_dir, num_generations=3, max_completion_length=12, temperature=temperature, generation_backend="transformers"
    )
    module.configure_model()
    module.policy.eval()
    captured = {}
    original_generate = module.policy.generate

    def generate_with_logits(*args, **kwargs):
        out = original_generate(*args, output_logits=True, return_dict_in_generate=True, **kwargs)
        captured["logits"] = torch.stack(out.logits, dim=1)  # [N, C_gen, V]
        return out.sequences

    monkeypatch.setattr(module.policy, "generate", generate_with_logits)
    prompts = ["a:", "Say a:", "Please say the letter b, many times:"]  # very different lengths
    rollout = module.generate(prompts)

    # Left padding really is present in this batch.
    pad_counts = (rollout.prompt_mask == 0).sum(dim=1)
    assert pad_counts.max() >= 20 and pad_counts.min() == 0
    # output_logits are the raw logits; tokens were sampled from softmax(logits / temperature).
    generated_logps = torch.log_softmax(captured["logits"].float() / temperature, dim=-1)
    num_cols = rollout.completion_ids.size(1)
    expected = generated_logps[:, :num_cols].gather(-1, rollout.completion_ids.unsqueeze(-1)).squeeze(-1)

    with torch.no_grad():
        logps, entropy = module.logprobs.completion_logps(module.policy, rollout, with_entropy=True)
    mask = rollout.completion_mask.bool()
    assert logps.shape == rollout.completion_ids.shape
    assert mask.sum() > 10
    torch.testing.assert_close(logps[mask], expected[mask], atol=1e-4, rtol=0)
    assert (entropy[mask] > 0).all()

    # Micro-batches of one row each (different padding after trimming) give the same values.
    for row in range(rollout.completion_ids.size(0)):
        single = rollout.select(torch.tensor([row]))
        with torch.no_grad():
            row_logps, _ = module.logprobs.completion_logps(module.policy, single)
        width = row_logps.size(1)
        row_mask = mask[row, :width]
        torch.testing.assert_close(row_logps[0][row_mask], expected[row, :width][row_mask], atol=1e-4, rtol=0)


# --------------------------------------------------------------------------------------------------
# 5. Micro-batching does not change the gradient
# --------------------------------------------------------------------------------------------------


def accumulated_gradient(module, scored, micro_batch_size):
    """The summed gradient of one optimizer step, accumulated over micro-batches as training_step does."""
    module.zero_grad(set_to_none=True)
    num_completions = scored.rollout.completion_ids.size(0)
    micro_batches = num_completions // micro_batch_size
    for start in range(0, num_completions, micro_batch_size):
        loss, *_ = module.logprobs.micro_batch_loss(module.policy, scored, torch.arange(start, start + micro_batch_size))
        if algorithm.LOSS_TYPES[module.hparams.loss_type].accumulates_by_mean:
            loss = loss / micro_batches
        loss.backward()
    return torch.cat([p.grad.flatten() for p in module.policy.parameters() if p.grad is not None])


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo", "cispo", "sapo"])
def test_micro_batching_does_not_change_the_gradient(tiny_model_dir, fast_trainer, loss_type):
    torch.manual_seed(0)
    epsilon_high = 5.0 if loss_type == "cispo" else None  # cispo: the importance weight's bound
    module = attach_trainer(
        make_module(tiny_model_dir, loss_type=loss_type, max_completion_length=10, epsilon_high=epsilon_high),
        fast_trainer,
    )
    # A likelier EOS gives completions of different lengths, which weigh differently per loss_type.
    module.generation_config.sequence_bias = {(module.tokenizer.eos_token_id,): 3.0}
    batch = PromptBatch(prompts=["Say a:", "Now say the letter b:"], columns={"target": ["a", "b"]})
    scored, _ = module.generate_and_score(batch)
    num_completions = scored.rollout.completion_ids.size(0)
    assert num_completions == 8
    # Completions of different lengths make the aggregations differ if done wrong.
    assert len(set(scored.rollout.completion_lengths.tolist())) > 1
    # Real, non-zero advantages so that the gradient is not trivially zero.
    scored.group.advantages = torch.linspace(-1.5, 1.5, num_completions)
    assert scored.num_items_in_batch == float(scored.loss_mask.sum())

    whole = accumulated_gradient(module, scored, micro_batch_size=num_completions)
    split = accumulated_gradient(module, scored, micro_batch_size=2)
    assert whole.norm() > 1e-3
    torch.testing.assert_close(split, whole, atol=1e-6, rtol=1e-4)


# --------------------------------------------------------------------------------------------------
# 6. It learns
# --------------------------------------------------------------------------------------------------


def test_seeded_quickstart_task_learns(tiny_model_dir, say_a_or_b_file, fast_trainer):
    pl.seed_everything(0)
    rewards = MetricRecorder()
    module = make_module(
        tiny_model_dir,
        num_generations=8,
        max_completion_length=16,
        optimizer=adamw(3e-3),
    )
    trainer = fast_trainer(max_steps=150, callbacks=[rewards])
    trainer.fit(module, make_data(say_a_or_b_file, batch_size=8))

    per_step = [step["reward"] for step in rewards.steps]
    assert len(per_step) == 150
    first, last = sum(per_step[:10]) / 10, sum(per_step[-10:]) / 10
    assert last > first + 0.2, f"reward went from {first:.3f} to {last:.3f}"


# --------------------------------------------------------------------------------------------------
# 7. mask_truncated_completions
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mask_truncated", [True, False])
def test_mask_truncated_completions_leaves_truncated_rows_out_of_the_loss(
    tiny_model_dir, fast_trainer, mask_truncated
):
    torch.manual_seed(0)
    module = make_module(
        tiny_model_dir, num_generations=8, max_completion_length=6, mask_truncated_completions=mask_truncated
    )
    attach_trainer(module, fast_trainer)
    # Make EOS likely enough that a batch has both finished and truncated completions.
    module.generation_config.sequence_bias = {(module.tokenizer.eos_token_id,): 4.0}
    batch = PromptBatch(prompts=["Say a:", "Say b:"], columns={"target": ["a", "b"]})
    scored, _ = module.generate_and_score(batch)

    rollout = scored.rollout
    truncated = rollout.is_truncated
    assert truncated.any() and (~truncated).any(), truncated
    lengths = rollout.completion_lengths
    assert (lengths[truncated] == 6).all()
    for i in range(truncated.numel()):
        expected = 0 if (mask_truncated and truncated[i]) else int(lengths[i])
        assert int(scored.loss_mask[i].sum()) == expected, (i, bool(truncated[i]))
    assert scored.num_items_in_batch == float(scored.loss_mask.sum())

    # A truncated row then contributes no gradient at all.
    row = int(truncated.nonzero()[0])
    scored.group.advantages = torch.ones_like(scored.group.advantages)
    module.zero_grad(set_to_none=True)
    loss, *_ = module.logprobs.micro_batch_loss(module.policy, scored, torch.tensor([row]))
    loss.backward()
    grad_norm = torch.cat([p.grad.flatten() for p in module.policy.parameters() if p.grad is not None]).norm()
    assert (grad_norm == 0) if mask_truncated else (grad_norm > 0)


# --------------------------------------------------------------------------------------------------
# 8. Gradient clipping and the LR scheduler
# --------------------------------------------------------------------------------------------------


class OptimizerStepProbe(pl.Callback):
    """At every optimizer step: the gradient norm the optimizer sees and the learning rate it uses."""

    def __init__(self):
        self.grad_norms: list[float] = []
        self.lrs: list[float] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        grads = [p.grad.flatten() for p in pl_module.parameters() if p.grad is not None]
        self.grad_norms.append(float(torch.cat(grads).norm()))
        self.lrs.append(optimizer.param_groups[0]["lr"])


def test_max_grad_norm_clips_and_scheduler_steps_per_optimizer_step(tiny_model_dir, say_a_or_b_file, fast_trainer):
    pl.seed_everything(0)
    probe, steps = OptimizerStepProbe(), MetricRecorder()
    max_norm = 1e-3
    module = make_module(
        tiny_model_dir,
        rewards=LOWERCASE,
        max_grad_norm=max_norm,
        num_iterations=2,  # 2 optimizer steps per training step: the scheduler follows optimizer steps
        optimizer=adamw(0.01),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s),
    )
    trainer = fast_trainer(max_steps=4, callbacks=[probe, steps])
    trainer.fit(module, make_data(say_a_or_b_file))

    assert trainer.global_step == 4
    assert len(probe.grad_norms) == 4
    pre_clip = [step["grad_norm"] for step in steps.steps]
    assert any(norm > 10 * max_norm for norm in pre_clip), pre_clip  # clipping had work to do
    for norm in probe.grad_norms:
        assert norm <= max_norm + 1e-6
    # The logged grad_norm is the pre-clip norm (of the last optimizer step of the batch).
    assert all(norm > max_norm for norm in pre_clip if norm > 0)
    assert probe.lrs == pytest.approx([0.01 * 0.5**k for k in range(4)])
    optimizer = trainer.optimizers[0]
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.01 * 0.5**4)


def test_max_grad_norm_none_leaves_gradient_alone(tiny_model_dir, say_a_or_b_file, fast_trainer):
    pl.seed_everything(0)
    probe = OptimizerStepProbe()
    module = make_module(tiny_model_dir, max_grad_norm=None)
    trainer = fast_trainer(max_steps=1, callbacks=[probe])
    trainer.fit(module, make_data(say_a_or_b_file))
    assert "grad_norm" not in trainer.logged_metrics
    assert probe.lrs == [pytest.approx(1e-6)]  # the default optimizer: AdamW at lr 1e-6


def test_max_grad_norm_zero_does_not_zero_the_gradient(tiny_model_dir, say_a_or_b_file, fast_trainer):
    pl.seed_everything(0)
    try:
        module = make_module(tiny_model_dir, rewards=LOWERCASE, max_grad_norm=0.0)
    except ValueError as error:  # refusing 0 with a message is a fix as good as disabling clipping
        assert "max_grad_norm" in str(error)
        return
    probe = OptimizerStepProbe()
    trainer = fast_trainer(max_steps=1, callbacks=[probe])
    trainer.fit(module, make_data(say_a_or_b_file))
    assert probe.grad_norms[0] > 0


# --------------------------------------------------------------------------------------------------
# 9. Conversational prompts
# --------------------------------------------------------------------------------------------------


def test_conversational_prompts_reach_rewards_as_messages(
    tiny_model_dir, write_jsonl, fast_trainer, reward_plugin
):
    seen = []

    def says_a(prompts, completions, completion_ids, **columns):
        seen.append({"prompts": prompts, "completions": completions, "ids": completion_ids, "columns": columns})
        return [float("a" in c[0]["content"]) for c in completions]

    reward_plugin(says_a=says_a)
    rows = [
        {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"Say {c}:"}], "target": c}
        for c in "ab" * 4
    ]
    data = write_jsonl(rows)
    pl.seed_everything(0)
    module = make_module(tiny_model_dir, rewards=[{"name": "says_a"}])
    trainer = fast_trainer(max_steps=1)
    trainer.fit(module, make_data(data))

    assert trainer.global_step == 1
    assert len(seen) == 1
    call = seen[0]
    assert len(call["completions"]) == 2 * 4
    texts = module.tokenizer.batch_decode(call["ids"], skip_special_tokens=True)
    for prompt, completion, text in zip(call["prompts"], call["completions"], texts):
        assert prompt in [row["prompt"] for row in rows]
        assert completion == [{"role": "assistant", "content": text}]
    # Group layout: G consecutive completions share a prompt and the prompt's other columns.
    assert call["prompts"][0] == call["prompts"][3] and call["columns"]["target"][:4] == [call["columns"]["target"][0]] * 4
    assert "rewards/says_a/mean" in trainer.logged_metrics


# --------------------------------------------------------------------------------------------------
# 10. TensorBoard table of completions
# --------------------------------------------------------------------------------------------------


def read_text_summaries(log_dir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    accumulator.Reload()
    tags = accumulator.Tags()["tensors"]
    matching = [t for t in tags if t.startswith(tag)]
    assert matching, f"no {tag!r} text in {tags}"
    return [
        event.tensor_proto.string_val[0].decode() for t in matching for event in accumulator.Tensors(t)
    ]


def test_tensorboard_completion_table(tiny_model_dir, say_a_or_b_file, fast_trainer, tmp_path):
    from lightning.pytorch.loggers import TensorBoardLogger

    pl.seed_everything(0)
    logger = TensorBoardLogger(save_dir=tmp_path / "runs", name="table")
    module = make_module(tiny_model_dir, log_completions_every_n_steps=1, num_completions_to_log=5)
    trainer = fast_trainer(max_steps=2, logger=logger)
    trainer.fit(module, make_data(say_a_or_b_file))

    tables = read_text_summaries(logger.log_dir, "completions")
    assert len(tables) == 2  # every step
    table = tables[0]
    lines = table.splitlines()
    assert lines[0] == "| prompt | completion | char_fraction | reward | advantage |"
    assert len(lines) == 2 + 5  # header, separator, num_completions_to_log rows
    assert any(prompt in table for prompt in ("Say a:", "Say b:"))
    for row in lines[2:]:
        cells = [cell.strip() for cell in row.strip("|").split(" | ")]
        reward, advantage = float(cells[-2]), float(cells[-1])
        assert 0.0 <= reward <= 1.0 and math.isfinite(advantage)


def test_completion_table_shares_the_step_of_its_batch_scalars(
    tiny_model_dir, say_a_or_b_file, fast_trainer, tmp_path
):
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    pl.seed_everything(0)
    logger = TensorBoardLogger(save_dir=tmp_path / "runs", name="steps")
    module = make_module(tiny_model_dir, num_iterations=2, log_completions_every_n_steps=1)
    trainer = fast_trainer(max_steps=4, logger=logger)
    trainer.fit(module, make_data(say_a_or_b_file))

    accumulator = EventAccumulator(str(logger.log_dir), size_guidance={"tensors": 0, "scalars": 0})
    accumulator.Reload()
    scalar_steps = [event.step for event in accumulator.Scalars("reward")]
    (tag,) = [t for t in accumulator.Tags()["tensors"] if t.startswith("completions")]
    table_steps = [event.step for event in accumulator.Tensors(tag)]
    assert len(scalar_steps) == len(table_steps) == 2
    assert table_steps == scalar_steps


def test_fit_without_validation_data_does_not_warn_about_validation(tiny_model_dir, say_a_or_b_file, fast_trainer):
    import warnings

    pl.seed_everything(0)
    module = make_module(tiny_model_dir)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # the filter lit_grpo.train.module installs at import; it must match Lightning's actual message
        ignore_expected_lightning_warnings()
        fast_trainer(max_steps=1).fit(module, make_data(say_a_or_b_file))
    messages = [str(w.message) for w in caught]
    assert not [m for m in messages if "validation_step" in m or "val_dataloader" in m], messages


def test_top_entropy_quantile_trains_only_the_highest_entropy_tokens(tiny_model_dir, fast_trainer):
    torch.manual_seed(0)
    module = attach_trainer(
        make_module(tiny_model_dir, max_completion_length=8, top_entropy_quantile=0.25), fast_trainer
    )
    batch = PromptBatch(prompts=["Say a:", "Say b:"], columns={"target": ["a", "b"]})
    scored, _ = module.generate_and_score(batch)
    scored.group.advantages = torch.linspace(-1.5, 1.5, 8)
    rows = torch.arange(8)
    loss, *_ = module.logprobs.micro_batch_loss(module.policy, scored, rows)

    # by hand: at ratio 1 the dapo loss is -sum(A_i over kept tokens) / real tokens of the batch
    with torch.no_grad():
        _, entropy = module.logprobs.completion_logps(module.policy, scored.rollout.select(rows), with_entropy=True)
    mask = scored.loss_mask[:, : entropy.size(1)].bool()
    threshold = torch.quantile(entropy[mask], 0.75)
    kept = mask & (entropy >= threshold)
    assert 0 < kept.sum() < mask.sum()
    expected = -(scored.group.advantages.unsqueeze(1) * kept).sum() / scored.num_items_in_batch
    assert float(loss) == pytest.approx(float(expected), rel=1e-4, abs=1e-6)


def test_a_module_pickles_and_its_copy_samples_with_its_own_policy(tiny_model_dir):
    """Lightning's ddp_spawn and ``torch.save(module)`` pickle the module: what the collector is handed
    (the policy and its version, the rank, the device) pickles with it and belongs to the copy."""
    import pickle

    module = make_module(tiny_model_dir)
    module.configure_model()
    copy = pickle.loads(pickle.dumps(module))
    policy, version = copy.collector.weights()
    assert policy is copy.policy and policy is not module.policy and version == 0
    rollout = copy.generate(["Say a:"], num_generations=2)
    assert rollout.completion_ids.size(0) == 2
