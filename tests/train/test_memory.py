"""Memory switches: ``trainer.precision: bf16-mixed``, ``model.gradient_checkpointing`` and
``model.logprob_micro_batch_size``, each shown to take effect and to leave the numbers unchanged
where they must."""

from __future__ import annotations

import math
import string
import warnings

import lightning.pytorch as pl
import pytest
import test_module
import torch
from conftest import set_hparams

from lit_grpo.data import GRPODataModule, PromptBatch
from lit_grpo.train.module import GRPOModule

LOWERCASE = [{"name": "char_fraction", "args": {"chars": string.ascii_lowercase}}]
BATCH = PromptBatch(prompts=["Say a:", "Now say the letter b:"], columns={"target": ["a", "b"]})


def make_module(model_dir, **overrides) -> GRPOModule:
    """test_module's tiny GRPO module, rewarded for lowercase letters."""
    return test_module.make_module(model_dir, **{"rewards": LOWERCASE, **overrides})


def make_data(path) -> GRPODataModule:
    return test_module.make_data(path, batch_size=2)


def rollout_of(module, fast_trainer):
    """One scored generation batch of 8 completions, with real non-zero advantages."""
    module.configure_model()
    module.trainer = fast_trainer()
    scored, _ = module.generate_and_score(BATCH)
    scored.group.advantages = torch.linspace(-1.5, 1.5, scored.rollout.completion_ids.size(0))
    return scored


# --------------------------------------------------------------------------------------------------
# trainer.precision: bf16-mixed
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "precision, logits_dtype",
    [("32-true", torch.float32), ("bf16-mixed", torch.bfloat16)],
)
def test_bf16_mixed_runs_the_training_forward_under_cpu_autocast(
    tiny_model_dir, say_a_or_b_file, fast_trainer, precision, logits_dtype
):
    pl.seed_everything(0)
    module = make_module(tiny_model_dir, optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2))
    module.configure_model()
    before = {name: p.detach().clone() for name, p in module.policy.named_parameters()}
    training_forwards = []  # (autocast on, logits dtype) of every forward with gradient

    def record(lm_head, inputs, logits):
        if torch.is_grad_enabled():
            training_forwards.append((torch.is_autocast_enabled("cpu"), logits.dtype))

    module.policy.get_output_embeddings().register_forward_hook(record)
    losses = []

    class RecordLoss(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(trainer.callback_metrics["loss"]))

    trainer = fast_trainer(max_steps=2, precision=precision, callbacks=[RecordLoss()])
    trainer.fit(module, make_data(say_a_or_b_file))

    assert trainer.global_step == 2
    assert len(training_forwards) == 2  # one micro-batch per step
    assert all(forward == (precision == "bf16-mixed", logits_dtype) for forward in training_forwards)
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)
    # Mixed precision: the weights (and the optimizer's updates of them) stay float32.
    assert all(p.dtype == torch.float32 for p in module.policy.parameters())
    assert any(not torch.equal(p, before[name]) for name, p in module.policy.named_parameters())


# --------------------------------------------------------------------------------------------------
# model.gradient_checkpointing
# --------------------------------------------------------------------------------------------------


def micro_batch_gradient(module, scored, rows) -> tuple[torch.Tensor, int]:
    """The gradient of one micro-batch's loss, and how often the first layer's MLP was entered for it
    (a pre-hook: a recomputation stops as soon as it has rebuilt the activations the backward needs)."""
    mlp_calls = []
    mlp = module.policy.get_decoder().layers[0].mlp
    handle = mlp.register_forward_pre_hook(lambda *args: mlp_calls.append(1))
    module.policy.zero_grad(set_to_none=True)
    loss, *_ = module.logprobs.micro_batch_loss(module.policy, scored, rows)
    loss.backward()
    handle.remove()
    gradient = torch.cat([p.grad.flatten() for p in module.policy.parameters() if p.grad is not None])
    return gradient, len(mlp_calls)


@pytest.mark.parametrize("lora", [None, {"r": 4}], ids=["full", "lora"])
def test_gradient_checkpointing_recomputes_layers_and_keeps_the_gradient(tiny_model_dir, fast_trainer, lora):
    torch.manual_seed(0)
    plain = make_module(tiny_model_dir, lora=lora)
    scored = rollout_of(plain, fast_trainer)
    torch.manual_seed(0)  # the same LoRA initialisation
    checkpointed = make_module(tiny_model_dir, lora=lora, gradient_checkpointing=True)
    checkpointed.configure_model()
    checkpointed.trainer = plain.trainer

    layers = checkpointed.policy.get_decoder().layers
    assert all(layer.gradient_checkpointing for layer in layers)
    assert not any(layer.gradient_checkpointing for layer in plain.policy.get_decoder().layers)

    rows = torch.arange(4)
    expected, plain_mlp_calls = micro_batch_gradient(plain, scored, rows)
    gradient, checkpointed_mlp_calls = micro_batch_gradient(checkpointed, scored, rows)
    assert plain_mlp_calls == 1
    assert checkpointed_mlp_calls == 2  # forward, then recomputed in the backward pass
    assert expected.norm() > 1e-3
    torch.testing.assert_close(gradient, expected, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("backend", ["lit", "transformers"])
def test_generation_with_gradient_checkpointing_samples_in_eval_mode(tiny_model_dir, backend):
    """Checkpointed layers drop the KV cache in training mode; sampling must not be in it."""
    module = make_module(tiny_model_dir, gradient_checkpointing=True, generation_backend=backend)
    module.configure_model()
    modes = []
    hook = module.policy.register_forward_pre_hook(lambda model, args: modes.append(model.training))
    assert module.policy.training
    module.generate(BATCH.prompts)
    hook.remove()
    assert modes and not any(modes)  # every forward of the sampler ran in eval mode
    assert module.policy.training  # back to training mode afterwards


# --------------------------------------------------------------------------------------------------
# model.logprob_micro_batch_size
# --------------------------------------------------------------------------------------------------


def count_policy_forwards(module) -> list[int]:
    """Rows of every forward of the policy."""
    rows = []
    module.policy.register_forward_pre_hook(lambda model, args, kwargs: rows.append(kwargs["input_ids"].size(0)),
                                            with_kwargs=True)
    return rows


@pytest.mark.parametrize(
    "logprob_micro_batch_size, micro_batch_size, forward_rows",
    [
        (None, None, [8]),  # one forward of the whole batch
        (None, 4, [4, 4]),  # defaults to micro_batch_size
        (3, 4, [3, 3, 2]),  # ceil(8 / 3) forwards, independent of micro_batch_size
        (1, 2, [1] * 8),
        (8, 2, [8]),
    ],
)
def test_logprob_micro_batch_size_sets_rows_per_forward_not_values(
    tiny_model_dir, fast_trainer, logprob_micro_batch_size, micro_batch_size, forward_rows
):
    torch.manual_seed(0)
    module = make_module(tiny_model_dir)
    scored = rollout_of(module, fast_trainer)
    reference = module.logprobs.logps_no_grad(module.policy, scored.rollout)  # [8, C] in one forward

    set_hparams(module, logprob_micro_batch_size=logprob_micro_batch_size, micro_batch_size=micro_batch_size)
    rows = count_policy_forwards(module)
    logps = module.logprobs.logps_no_grad(module.policy, scored.rollout)
    assert rows == forward_rows
    mask = scored.rollout.completion_mask.bool()
    torch.testing.assert_close(logps[mask], reference[mask], atol=1e-5, rtol=0)


def test_logprob_micro_batch_size_in_a_training_step(tiny_model_dir, say_a_or_b_file, fast_trainer):
    """reference log-probs in forwards of 8 rows; the update in micro-batches of 2 (whose first pass
    gives the old log-probs: no separate pass)."""
    pl.seed_everything(0)
    module = make_module(
        tiny_model_dir, num_iterations=2, beta=0.1, micro_batch_size=2, logprob_micro_batch_size=8
    )
    module.configure_model()
    forwards = []
    for model, name in ((module.policy, "policy"), (module.ref_model, "reference")):
        model.register_forward_pre_hook(
            lambda model, args, kwargs, name=name: forwards.append(
                (name, torch.is_grad_enabled(), kwargs["input_ids"].size(0))
            ) if kwargs.get("use_cache") is False else None,  # log-prob forwards (generate uses the cache)
            with_kwargs=True,
        )
    trainer = fast_trainer(max_steps=2)  # one generation batch, 2 passes over it
    trainer.fit(module, make_data(say_a_or_b_file))

    assert trainer.global_step == 2
    assert [f for f in forwards if not f[1]] == [("reference", False, 8)]
    assert [f for f in forwards if f[1]] == [("policy", True, 2)] * 8  # 2 passes x 4 micro-batches


def test_logprob_micro_batch_size_must_be_positive(tiny_model_dir):
    with pytest.raises(ValueError, match="model.logprob_micro_batch_size must be at least 1 or null, got 0"):
        make_module(tiny_model_dir, logprob_micro_batch_size=0)


# --------------------------------------------------------------------------------------------------
# model.forward_token_budget: a training micro-batch above it goes forward and backward in chunks
# --------------------------------------------------------------------------------------------------


class SavedTensorBytes:
    """``torch.autograd.graph.saved_tensors_hooks`` that track the bytes autograd holds for backward
    (activations, and weights saved by reference) at any moment, and their peak."""

    class Held:
        def __init__(self, tensor: torch.Tensor, owner: "SavedTensorBytes"):
            self.tensor, self.owner, self.nbytes = tensor, owner, tensor.numel() * tensor.element_size()
            owner.live += self.nbytes
            owner.peak = max(owner.peak, owner.live)

        def __del__(self):
            self.owner.live -= self.nbytes

    def __init__(self):
        self.live = 0
        self.peak = 0

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(lambda t: self.Held(t, self), lambda held: held.tensor)


def micro_batch_backward(module, scored, rows, budget, scale=0.5, loss_scale=1.0):
    """``LogProbPasses.micro_batch_backward`` under ``forward_token_budget=budget``: the gradient, the statistics,
    the order of the forwards with gradient and the backward passes, and the peak saved bytes.
    ``loss_scale``: ``manual_backward`` multiplies every loss by it, as under a ``16-mixed`` GradScaler."""
    set_hparams(module, forward_token_budget=budget)
    module.policy.zero_grad(set_to_none=True)
    events = []
    hook = module.policy.register_forward_pre_hook(
        lambda model, args: events.append("forward") if torch.is_grad_enabled() else None
    )
    module.manual_backward = lambda loss: (events.append("backward"), (loss * loss_scale).backward())
    saved = SavedTensorBytes()
    with saved.hooks():
        stats, _ = module.logprobs.micro_batch_backward(module.policy, scored, rows, scale, sync=True)
    hook.remove()
    gradient = torch.cat([p.grad.flatten() for p in module.policy.parameters() if p.grad is not None])
    return gradient, stats, events, saved.peak


@pytest.mark.parametrize(
    "loss_type, beta, importance_sampling_level, off_policy, shared",
    [
        ("dapo", 0.0, "token", False, False),
        ("grpo", 0.04, "token", True, False),
        ("bnpo", 0.0, "sequence", True, False),
        ("dr_grpo", 0.04, "token", True, False),
        ("cispo", 0.04, "token", True, False),
        ("sapo", 0.0, "sequence", False, False),
        ("dapo", 0.04, "token", True, True),
        ("grpo", 0.0, "sequence", False, True),
    ],
)
def test_token_budget_trains_in_chunks_with_the_micro_batch_gradient(
    tiny_model_dir, fast_trainer, monkeypatch, loss_type, beta, importance_sampling_level, off_policy, shared
):
    import lit_grpo.train.logprob_passes
    import lit_grpo.train.module

    if shared:  # the test's short prompts are shared however few tokens that saves
        monkeypatch.setattr(lit_grpo.train.logprob_passes, "FORWARD_OVERHEAD_TOKENS", 0)
    torch.manual_seed(0)
    module = make_module(
        tiny_model_dir, loss_type=loss_type, beta=beta, importance_sampling_level=importance_sampling_level,
        epsilon_high=5.0 if loss_type == "cispo" else None, share_prompt_forward=shared,
    )
    scored = rollout_of(module, fast_trainer)
    current = module.logprobs.logps_no_grad(module.policy, scored.rollout)  # [8, C]
    mask = scored.rollout.completion_mask.bool()
    if off_policy:  # the sampling policy differs: ratios spread over and beyond the clip range
        scored.old_logps = (current + 0.3 * torch.randn(current.size(0), 1) + 0.3 * torch.randn_like(current)) * mask
    if beta:
        scored.ref_logps = (current - 0.5 * torch.rand_like(current)) * mask
    rows = torch.tensor([1, 7, 0, 4, 6, 2])  # a micro-batch of 6 rows (of both prompts), not in rollout order
    expected, expected_stats, one_pass, one_pass_peak = micro_batch_backward(module, scored, rows, None)
    prompt_width = 0 if shared else scored.rollout.select(rows).trimmed().prompt_mask.size(1)
    row_tokens = int(prompt_width + mask[rows].any(0).sum())
    gradient, stats, chunked, chunked_peak = micro_batch_backward(module, scored, rows, budget=2 * row_tokens)

    if not shared:
        assert one_pass == ["forward", "backward"]
        assert chunked == ["forward", "backward"] * 3  # 6 rows in chunks of at most 2, each freed by its backward
        # autograd never holds more than about one chunk's activations (plus the weights it saves)
        assert chunked_peak < 0.6 * one_pass_peak
    else:
        assert one_pass == ["forward", "forward", "backward"]  # the 2 prompts, then the completions
        # the prompts once, each chunk's forward and backward (stopping at the prompts' keys and
        # values), then one backward through the prompt forward
        assert chunked[0] == "forward" and chunked[-1] == "backward"
        assert chunked[1:-1] == ["forward", "backward"] * (len(chunked[1:-1]) // 2) and len(chunked) >= 6
        assert chunked_peak < one_pass_peak
    assert expected.norm() > 1e-3
    torch.testing.assert_close(gradient, expected, atol=1e-6, rtol=1e-4)
    assert stats.keys() == expected_stats.keys() and ("kl" in stats) == (beta > 0)
    for name in stats:
        torch.testing.assert_close(stats[name], expected_stats[name], atol=1e-6, rtol=1e-5, msg=name)
    if off_policy and loss_type != "cispo":
        assert expected_stats["clip_ratio/region_mean"] > 0  # the clipped branch is exercised


def rows_in_forwards_with_gradient(module) -> list[int]:
    """Rows of every policy forward that runs with autograd on (appended to as they run)."""
    rows = []
    module.policy.register_forward_pre_hook(
        lambda model, args, kwargs: rows.append(kwargs["input_ids"].size(0)) if torch.is_grad_enabled() else None,
        with_kwargs=True,
    )
    return rows


@pytest.mark.parametrize(
    "loss_type, beta, importance_sampling_level, off_policy, shared, budget",
    [
        ("dapo", 0.0, "token", False, False, None),
        ("dapo", 0.0, "token", True, True, 40),
        ("grpo", 0.0, "sequence", True, False, 40),
        ("bnpo", 0.04, "token", True, False, None),  # with beta > 0 only the masked row has no gradient
        ("dr_grpo", 0.0, "token", True, True, None),
        ("cispo", 0.0, "token", True, False, None),
        ("sapo", 0.0, "token", True, False, 40),
    ],
)
def test_rows_without_gradient_skip_the_backward_and_change_nothing(
    tiny_model_dir, fast_trainer, monkeypatch, loss_type, beta, importance_sampling_level, off_policy, shared, budget
):
    """Rows of a group with equal rewards (advantage 0) and a row with no token that counts go forward
    without autograd; the gradient and every statistic equal those of training every row."""
    import lit_grpo.train.logprob_passes
    import lit_grpo.train.module

    monkeypatch.setattr(lit_grpo.train.logprob_passes, "FORWARD_OVERHEAD_TOKENS", 0)  # the test's rows are short
    torch.manual_seed(0)
    module = make_module(
        tiny_model_dir, loss_type=loss_type, beta=beta, importance_sampling_level=importance_sampling_level,
        epsilon_high=5.0 if loss_type == "cispo" else None, share_prompt_forward=shared,
    )
    scored = rollout_of(module, fast_trainer)
    scored.group.advantages[:4] = 0.0  # the first prompt's group: equal rewards
    scored.loss_mask = scored.rollout.completion_mask.clone()
    scored.loss_mask[6] = 0  # as a truncated completion under mask_truncated_completions
    current = module.logprobs.logps_no_grad(module.policy, scored.rollout)  # [8, C]
    mask = scored.rollout.completion_mask.bool()
    if off_policy:
        scored.old_logps = (current + 0.3 * torch.randn(current.size(0), 1) + 0.3 * torch.randn_like(current)) * mask
    if beta:
        scored.ref_logps = (current - 0.5 * torch.rand_like(current)) * mask
    rows = torch.tensor([1, 7, 0, 4, 6, 2])  # rows 1, 0, 2 with advantage 0; row 6 masked

    set_hparams(module, skip_zero_gradient_rows=False)
    expected, expected_stats, *_ = micro_batch_backward(module, scored, rows, budget)
    set_hparams(module, skip_zero_gradient_rows=True)
    trained_rows = rows_in_forwards_with_gradient(module)
    gradient, stats, events, _ = micro_batch_backward(module, scored, rows, budget)

    frozen = [4] if beta else [0, 2, 4, 5]  # positions in rows: rows 6 / 1, 0, 6, 2
    assert module.logprobs.rows_without_gradient(module.policy, scored, rows).tolist() == frozen
    completions = sum(trained_rows[1:]) if shared else sum(trained_rows)  # (after the shared prompts' forward)
    assert completions == len(rows) - len(frozen)
    assert events[-1] == "backward"
    assert expected.norm() > 1e-3
    torch.testing.assert_close(gradient, expected, atol=1e-6, rtol=1e-4)
    assert stats.keys() == expected_stats.keys()
    for name in stats:
        torch.testing.assert_close(stats[name], expected_stats[name], atol=1e-6, rtol=1e-5, msg=name)


def test_rows_without_gradient_keep_one_row_and_a_zero_gradient(tiny_model_dir, fast_trainer, monkeypatch):
    """Every row without gradient: one still goes backward, so every weight gets a zero gradient (not
    None) and AdamW's step moves the weights as it would after training every row."""
    import lit_grpo.train.logprob_passes
    import lit_grpo.train.module

    monkeypatch.setattr(lit_grpo.train.logprob_passes, "FORWARD_OVERHEAD_TOKENS", 0)
    torch.manual_seed(0)
    module = make_module(tiny_model_dir)
    scored = rollout_of(module, fast_trainer)
    scored.group.advantages[:] = 0.0
    rows = torch.arange(8)
    trained_rows = rows_in_forwards_with_gradient(module)
    gradient, stats, _, _ = micro_batch_backward(module, scored, rows, None)
    assert trained_rows == [1]
    assert all(p.grad is not None for p in module.policy.parameters())
    assert gradient.abs().max() == 0 and stats["loss"] == 0 and stats["entropy"] > 0

    # not worth it: 7 short rows' backward costs less than one more forward
    monkeypatch.setattr(lit_grpo.train.logprob_passes, "FORWARD_OVERHEAD_TOKENS", 10_000)
    assert module.logprobs.rows_without_gradient(module.policy, scored, rows) is None
    monkeypatch.setattr(lit_grpo.train.logprob_passes, "FORWARD_OVERHEAD_TOKENS", 0)
    set_hparams(module, top_entropy_quantile=0.5)  # the threshold is over every row's entropy in the loss
    assert module.logprobs.rows_without_gradient(module.policy, scored, rows) is None


def test_chunks_with_shared_prompts_under_a_grad_scaler_scale_the_gradient_once(tiny_model_dir, fast_trainer, monkeypatch):
    """The prompt forward's backward gets the gradient the chunks collected, which already carries the
    GradScaler's factor: it must not be multiplied by it a second time."""
    import types

    import lit_grpo.train.logprob_passes
    import lit_grpo.train.module

    monkeypatch.setattr(lit_grpo.train.logprob_passes, "FORWARD_OVERHEAD_TOKENS", 0)
    torch.manual_seed(0)
    module = make_module(tiny_model_dir, share_prompt_forward=True)
    scored = rollout_of(module, fast_trainer)
    module.trainer.precision_plugin.scaler = types.SimpleNamespace(get_scale=lambda: 1024.0)
    rows = torch.arange(8)
    expected, *_ = micro_batch_backward(module, scored, rows, None, loss_scale=1024.0)
    gradient, _, events, _ = micro_batch_backward(module, scored, rows, budget=20, loss_scale=1024.0)
    assert events.count("backward") > 2  # chunks, then the prompts' backward
    assert expected.norm() > 1.0
    torch.testing.assert_close(gradient, expected, atol=1e-3, rtol=1e-4)


def test_token_budget_keeps_one_pass_where_the_loss_needs_every_row(tiny_model_dir, fast_trainer):
    from lit_grpo import algorithm

    torch.manual_seed(0)
    module = make_module(tiny_model_dir, forward_token_budget=8)  # far below one row
    scored = rollout_of(module, fast_trainer)
    micro = scored.rollout.select(torch.arange(8))
    assert len(module.logprobs.backward_chunks(module.policy, micro, None)) == 8  # one row each

    set_hparams(module, top_entropy_quantile=0.5)  # the entropy threshold is over every row of the micro-batch
    assert [chunk.tolist() for chunk in module.logprobs.backward_chunks(module.policy, micro, None)] == [list(range(8))]
    set_hparams(module, top_entropy_quantile=1.0)

    # a registered loss type is trained in one pass unless it says its rows are independent
    @algorithm.register_loss_type("test_batch_max")
    def batch_max(per_token_loss, completion_mask, max_completion_length, num_items_in_batch):
        return (per_token_loss * completion_mask).max()

    try:
        set_hparams(module, loss_type="test_batch_max")
        assert [chunk.tolist() for chunk in module.logprobs.backward_chunks(module.policy, micro, None)] == [list(range(8))]
        set_hparams(module, group_by_length=False, loss_type="dapo")
        assert [chunk.tolist() for chunk in module.logprobs.backward_chunks(module.policy, micro, None)] == [list(range(8))]
    finally:
        del algorithm.LOSS_TYPES["test_batch_max"]


def test_micro_batches_within_the_budget_are_one_pass(tiny_model_dir, fast_trainer):
    torch.manual_seed(0)
    module = make_module(tiny_model_dir)  # the default budget: auto, 1024 tokens on the CPU
    assert module.hparams.forward_token_budget == "auto" and module.logprobs.forward_token_budget == 1024
    scored = rollout_of(module, fast_trainer)
    assert [chunk.tolist() for chunk in module.logprobs.backward_chunks(module.policy, scored.rollout, None)] == [list(range(8))]


# --------------------------------------------------------------------------------------------------
# Gradients
# --------------------------------------------------------------------------------------------------


def test_gradients_are_freed_after_each_optimizer_step(tiny_model_dir, say_a_or_b_file, fast_trainer):
    """The gradients exist for each optimizer step and are set to None right after it, so that
    they take no memory while the next batch is sampled and goes forward."""
    events: list[tuple[str, int]] = []

    def with_gradient(module) -> int:
        return sum(p.grad is not None for p in module.policy.parameters())

    class Probe(pl.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            events.append(("optimizer step", with_gradient(pl_module)))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            events.append(("batch end", with_gradient(pl_module)))

    pl.seed_everything(0)
    module = make_module(tiny_model_dir, num_iterations=2)  # two optimizer steps per batch
    sample = module.collector.generate  # step 1, where the training step samples

    def generate(prompts, *args, **kwargs):
        events.append(("generate", with_gradient(module)))
        return sample(prompts, *args, **kwargs)

    module.collector.generate = generate
    fast_trainer(max_steps=4, callbacks=[Probe()]).fit(module, make_data(say_a_or_b_file))

    trainable = sum(p.requires_grad for p in module.policy.parameters())
    batch = [("generate", 0), ("optimizer step", trainable), ("optimizer step", trainable), ("batch end", 0)]
    assert events == batch * 2


# --------------------------------------------------------------------------------------------------
# bf16 on a CPU without bf16 matmul instructions
# --------------------------------------------------------------------------------------------------


def test_cpu_bf16_support_read_from_cpuinfo(tmp_path):
    from lit_grpo.cpu import cpu_multiplies_bf16

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 avx512f\n")
    assert cpu_multiplies_bf16(str(cpuinfo)) is False
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16\n")
    assert cpu_multiplies_bf16(str(cpuinfo)) is True
    cpuinfo.write_text("flags\t\t: fpu amx_bf16 amx_tile\n")
    assert cpu_multiplies_bf16(str(cpuinfo)) is True
    assert cpu_multiplies_bf16(str(tmp_path / "missing")) is None


@pytest.mark.parametrize("has_bf16_matmul, precision, warns", [(False, "bf16-mixed", True), (True, "bf16-mixed", False), (False, "32-true", False)])
def test_bf16_on_a_cpu_that_emulates_it_warns(tiny_model_dir, say_a_or_b_file, fast_trainer, monkeypatch, has_bf16_matmul, precision, warns):
    from lit_grpo import cpu

    monkeypatch.setattr(cpu, "cpu_multiplies_bf16", lambda: has_bf16_matmul)
    module = make_module(tiny_model_dir)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fast_trainer(precision=precision).fit(module, datamodule=make_data(say_a_or_b_file))
    emulated = [w for w in caught if "is emulated" in str(w.message)]
    assert bool(emulated) == warns
    if warns:
        assert "trainer.precision=bf16-mixed" in str(emulated[0].message)
