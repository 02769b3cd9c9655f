"""Memory switches: ``trainer.precision: bf16-mixed``, ``model.gradient_checkpointing`` and
``model.logprob_micro_batch_size``, each shown to take effect and to leave the numbers unchanged
where they must."""

from __future__ import annotations

import math
import string
import warnings

import lightning.pytorch as pl

import pytest
import torch

from lit_grpo.data import GRPODataModule, PromptBatch
from lit_grpo.module import GRPOModule

import test_module

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
    scored, _ = module._generate_and_score(BATCH)
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
    loss, _ = module._micro_batch_loss(scored, rows)
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
    reference = module._logps_no_grad(module.policy, scored.rollout)  # [8, C] in one forward

    module.hparams.logprob_micro_batch_size = logprob_micro_batch_size
    module.hparams.micro_batch_size = micro_batch_size
    rows = count_policy_forwards(module)
    logps = module._logps_no_grad(module.policy, scored.rollout)
    assert rows == forward_rows
    mask = scored.rollout.completion_mask.bool()
    torch.testing.assert_close(logps[mask], reference[mask], atol=1e-5, rtol=0)


def test_logprob_micro_batch_size_in_a_training_step(tiny_model_dir, say_a_or_b_file, fast_trainer):
    """old and reference log-probs in forwards of 8 rows; the update in micro-batches of 2."""
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
    assert [f for f in forwards if not f[1]] == [("policy", False, 8), ("reference", False, 8)]
    assert [f for f in forwards if f[1]] == [("policy", True, 2)] * 8  # 2 passes x 4 micro-batches


def test_logprob_micro_batch_size_must_be_positive(tiny_model_dir):
    with pytest.raises(ValueError, match="model.logprob_micro_batch_size must be at least 1 or null, got 0"):
        make_module(tiny_model_dir, logprob_micro_batch_size=0)


# --------------------------------------------------------------------------------------------------
# bf16 on a CPU without bf16 matmul instructions
# --------------------------------------------------------------------------------------------------


def test_cpu_bf16_support_read_from_cpuinfo(tmp_path):
    from lit_grpo.models import cpu_multiplies_bf16

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
    from lit_grpo import models

    monkeypatch.setattr(models, "cpu_multiplies_bf16", lambda: has_bf16_matmul)
    module = make_module(tiny_model_dir)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fast_trainer(precision=precision).fit(module, datamodule=make_data(say_a_or_b_file))
    emulated = [w for w in caught if "is emulated" in str(w.message)]
    assert bool(emulated) == warns
    if warns:
        assert "trainer.precision=bf16-mixed" in str(emulated[0].message)
