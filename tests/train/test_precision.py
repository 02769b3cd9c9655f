"""Trainable weights and optimizer state are float32 whatever the checkpoint's dtype; half precision is
for compute (``bf16-mixed``) and for the frozen reference model; and a completion ends at every EOS id
of a chat model (Qwen2.5 ends a turn with ``<|im_end|>`` or ``<|endoftext|>``)."""

from __future__ import annotations

import string
import warnings

import pytest
import test_module
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from lit_grpo.data import GRPODataModule
from lit_grpo.rollout.engines.policy import SAMPLERS, generate_completions
from lit_grpo.train.module import GRPOModule

LOWERCASE = [{"name": "char_fraction", "args": {"chars": string.ascii_lowercase}}]


def make_module(model_dir, **overrides) -> GRPOModule:
    """test_module's tiny GRPO module, rewarded for lowercase letters."""
    return test_module.make_module(model_dir, **{"rewards": LOWERCASE, **overrides})


def fit(module, say_a_or_b_file, fast_trainer, **trainer):
    data = GRPODataModule(path="json", data_files=str(say_a_or_b_file), batch_size=2)
    trainer = fast_trainer(**trainer)
    trainer.fit(module, datamodule=data)
    return trainer


def test_bf16_checkpoint_trains_in_float32_and_keeps_updates_too_small_for_bf16(tiny_qwen2_dir, say_a_or_b_file, fast_trainer):
    saved = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir)
    assert saved.dtype == torch.bfloat16  # what transformers 5 loads a bf16 checkpoint as by default
    initial = {name: p.detach().float().clone() for name, p in saved.named_parameters()}
    # Adam moves every weight with a gradient by about lr per step: 1e-6, far below bf16's spacing
    module = make_module(tiny_qwen2_dir, optimizer=lambda params: torch.optim.Adam(params, lr=1e-6))
    fit(module, say_a_or_b_file, fast_trainer, max_steps=2)

    params = dict(module.policy.named_parameters())
    assert {p.dtype for p in params.values()} == {torch.float32}
    state = module.trainer.optimizers[0].state
    assert {s["exp_avg"].dtype for s in state.values()} == {torch.float32}
    changes = torch.cat([(params[name].detach() - initial[name]).abs().flatten() for name in initial])
    moved = changes[changes > 0]
    assert moved.numel() > 0.5 * changes.numel() and moved.max() < 1e-5  # small updates, kept
    # the same updates applied to bf16 weights would have rounded away almost everywhere
    in_bf16 = torch.cat([(params[name].detach().bfloat16().float() - initial[name]).abs().flatten() for name in initial])
    assert (in_bf16 > 0).sum() < 0.05 * moved.numel()  # (only weights very close to 0 keep theirs)


def test_half_precision_trainable_weights_with_a_torch_optimizer_are_refused(tiny_qwen2_dir, say_a_or_b_file, fast_trainer):
    module = make_module(tiny_qwen2_dir, model_init_kwargs={"dtype": "bfloat16"})
    with pytest.raises(ValueError, match=r"model\.model_init_kwargs\.dtype loads the trainable weights in bfloat16.*"
                       r"AdamW.*remove model\.model_init_kwargs\.dtype.*trainer\.precision: bf16-mixed"):
        fit(module, say_a_or_b_file, fast_trainer)


def test_bf16_true_precision_is_refused_naming_the_setting(tiny_model_dir, say_a_or_b_file, fast_trainer):
    module = make_module(tiny_model_dir)
    with pytest.raises(ValueError, match=r"trainer\.precision: bf16-true casts the trainable weights.*use trainer\.precision: bf16-mixed"):
        fit(module, say_a_or_b_file, fast_trainer, precision="bf16-true")


class HalfPrecisionAwareSGD(torch.optim.Optimizer):
    """An optimizer outside ``torch.optim`` (as one that rounds stochastically would be)."""

    def __init__(self, params, lr=1e-3):
        super().__init__(params, {"lr": lr})

    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data.add_(p.grad, alpha=-group["lr"])


def test_half_precision_weights_with_another_optimizer_only_warn(tiny_qwen2_dir, say_a_or_b_file, fast_trainer):
    module = make_module(tiny_qwen2_dir, model_init_kwargs={"dtype": "bfloat16"}, optimizer=HalfPrecisionAwareSGD)
    with pytest.warns(UserWarning, match=r"model\.model_init_kwargs\.dtype loads the trainable weights in bfloat16.*HalfPrecisionAwareSGD"):
        fit(module, say_a_or_b_file, fast_trainer)
    assert next(module.policy.parameters()).dtype == torch.bfloat16


def test_lora_over_a_bf16_base_trains_float32_adapters(tiny_qwen2_dir, say_a_or_b_file, fast_trainer):
    module = make_module(tiny_qwen2_dir, model_init_kwargs={"dtype": "bfloat16"}, lora={"r": 4})
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*trainable weights.*")
        fit(module, say_a_or_b_file, fast_trainer)
    trainable = {p.dtype for p in module.policy.parameters() if p.requires_grad}
    frozen = {p.dtype for p in module.policy.parameters() if not p.requires_grad}
    assert trainable == {torch.float32} and frozen == {torch.bfloat16}


@pytest.mark.parametrize("precision, reference_dtype", [("32-true", torch.float32), ("bf16-mixed", torch.bfloat16)])
def test_frozen_reference_computes_in_the_run_s_precision(tiny_model_dir, say_a_or_b_file, fast_trainer, precision, reference_dtype):
    module = make_module(tiny_model_dir, beta=0.04)
    fit(module, say_a_or_b_file, fast_trainer, precision=precision)
    assert {p.dtype for p in module.ref_model.parameters()} == {reference_dtype}
    assert {p.dtype for p in module.policy.parameters()} == {torch.float32}
    assert torch.isfinite(torch.tensor(float(module.trainer.callback_metrics["kl"])))


# ----------------------------------------------------------------------------------------------
# Every EOS id ends a completion
# ----------------------------------------------------------------------------------------------


def x_then(tokenizer, token_id: int) -> dict:
    """A ``sequence_bias`` that makes completions of prompts ending with ":" read "x" then ``token_id``."""
    colon, x = tokenizer.convert_tokens_to_ids([":", "x"])
    return {(colon, x): 100.0, (x, token_id): 100.0}


@pytest.mark.parametrize("backend", sorted(SAMPLERS))  # vllm: tests/rollout/test_vllm.py
def test_sampling_stops_at_every_eos_id_of_the_generation_config(tiny_qwen2_dir, backend):
    """The tiny Qwen2 model's generation config lists <|im_end|> (the tokenizer's EOS) and
    <|endoftext|>; a completion that emits <|endoftext|> has ended: its mask stops there and it is
    not truncated."""
    from transformers import AutoTokenizer

    module = make_module(tiny_qwen2_dir)
    module.configure_model()
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen2_dir)
    endoftext = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert tokenizer.eos_token_id != endoftext
    assert module.generation_config.eos_token_id == [tokenizer.eos_token_id, endoftext]
    # completions "x<|endoftext|>"
    config = GenerationConfig(**{**module.generation_config.to_dict(), "do_sample": False})
    config.sequence_bias = x_then(tokenizer, endoftext)
    rollout = generate_completions(module.policy, tokenizer, ["Say a:", "Say b:"], 2, config, backend=backend)
    assert rollout.completion_ids.size(1) == 2  # every row ended at its second token
    assert (rollout.completion_ids[:, 1] == endoftext).all()
    assert rollout.completion_mask.tolist() == [[1, 1]] * 4
    assert not rollout.is_truncated.any()


def test_completions_ending_at_the_second_eos_id_count_as_terminated_in_training(tiny_qwen2_dir, say_a_or_b_file, fast_trainer):
    module = make_module(tiny_qwen2_dir, mask_truncated_completions=True, max_completion_length=16)
    module.configure_model()
    endoftext = module.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    module.generation_config.sequence_bias = x_then(module.tokenizer, endoftext)
    fit(module, say_a_or_b_file, fast_trainer)
    metrics = module.trainer.callback_metrics
    assert float(metrics["completions/clipped_ratio"]) == 0.0
    assert float(metrics["completions/max_length"]) == 2.0
