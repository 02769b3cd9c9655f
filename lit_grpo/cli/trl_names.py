"""TRL's ``GRPOConfig`` names, answered with lit-grpo's.

lit-grpo keeps TRL's names for the GRPO settings, under ``model:``; the rest of a TRL config is
Lightning's ``trainer:``, the ``data:`` module or the ``optimizer:`` / ``lr_scheduler:`` blocks here.
A key or option lit-grpo does not know whose last part is one of TRL's names is answered with
:func:`trl_hint` instead of the closest spelling (which would send ``learning_rate`` to ``lora``).

The table "Coming from TRL" in docs/configuration.md shows :data:`TRL_NAMES` row by row (a test
checks that each name gets the message the table promises and that the keys it names exist). The
table after it, "Every field of TRL 1.16's GRPOConfig", gives each other field of TRL 1.16's
``GRPOConfig`` (``tests/fixtures/trl_1_16_grpo_config_fields.txt``) and why lit-grpo has no key of
that name: the two tables together have one row for each field, checked by a test.
"""

from __future__ import annotations

__all__ = ["TRL_NAMES", "trl_hint"]

# TRL name -> what it is in lit-grpo
TRL_NAMES: dict[str, str] = {
    # the batch, steps and epochs
    "per_device_train_batch_size": (
        "data.batch_size, which counts prompts per process, not completions: data.batch_size = "
        "per_device_train_batch_size x gradient_accumulation_steps / model.num_generations (one generation "
        "batch per optimizer step, as TRL's default), and model.micro_batch_size = per_device_train_batch_size"
    ),
    "gradient_accumulation_steps": (
        "model.micro_batch_size: an optimizer step takes the whole generation batch of data.batch_size x "
        "model.num_generations completions, in micro-batches of model.micro_batch_size completions"
    ),
    "generation_batch_size": (
        "data.batch_size x model.num_generations completions per process (data.batch_size counts prompts)"
    ),
    "steps_per_generation": (
        "model.steps_per_generation, which counts optimizer steps: TRL's steps_per_generation / "
        "gradient_accumulation_steps"
    ),
    "per_device_eval_batch_size": "data.batch_size (prompts), for validation too",
    "num_train_epochs": "trainer.max_epochs",
    "max_steps": "trainer.max_steps (optimizer steps, as in TRL)",
    "shuffle_dataset": "data.shuffle",
    "dataloader_num_workers": "data.num_workers",
    # the optimizer and its schedule
    "learning_rate": "optimizer.init_args.lr (AdamW at 1e-6 without an optimizer block, TRL's default)",
    "optim": "optimizer (a class_path such as torch.optim.AdamW, with init_args)",
    "weight_decay": "optimizer.init_args.weight_decay",
    "adam_beta1": "optimizer.init_args.betas (a pair: [adam_beta1, adam_beta2])",
    "adam_beta2": "optimizer.init_args.betas (a pair: [adam_beta1, adam_beta2])",
    "adam_epsilon": "optimizer.init_args.eps",
    "lr_scheduler_type": (
        "lr_scheduler (a torch.optim.lr_scheduler class, stepped after every optimizer step: linear is "
        "LinearLR with end_factor 0, cosine is CosineAnnealingLR; without one the rate is constant)"
    ),
    "warmup_ratio": (
        "lr_scheduler: LinearLR with start_factor near 0 and total_iters = warmup_ratio x trainer.max_steps"
    ),
    "warmup_steps": "lr_scheduler: LinearLR with start_factor near 0 and total_iters = warmup_steps",
    "max_grad_norm": "model.max_grad_norm (trainer.gradient_clip_val sets it too)",
    # precision, memory, seeds, outputs
    "bf16": "trainer.precision: bf16-mixed (weights and optimizer state stay float32)",
    "fp16": "trainer.precision: 16-mixed",
    "gradient_checkpointing": "model.gradient_checkpointing",
    "seed": "seed_everything (sampling, new weights such as LoRA's); data.seed orders the prompts",
    "output_dir": "trainer.default_root_dir (where a run without a logger of its own writes its logs and checkpoints)",
    "report_to": "trainer.logger (a Lightning logger: TensorBoard without one, WandbLogger, MLFlowLogger, ...)",
    "logging_steps": "trainer.log_every_n_steps",
    "save_steps": (
        "trainer.callbacks: a ModelCheckpoint with every_n_train_steps and save_last: true (without one, "
        "last.ckpt is written every 100 optimizer steps; also every 30 minutes and on SIGTERM)"
    ),
    "log_completions": (
        "model.log_completions_every_n_steps (0 turns the logger's completions table off); completions.jsonl "
        "is written every trainer.log_every_n_steps steps (model.save_completions)"
    ),
    "num_completions_to_print": "model.print_completions",
    # rewards and data
    "reward_funcs": (
        "model.rewards, a list of {name: ...} entries: an installed reward (lit-grpo rewards lists them), "
        "file.py:function or package.module:function"
    ),
    "reward_weights": "the weight of each model.rewards entry: {name: ..., weight: 2.0}",
    "remove_unused_columns": "not needed: every column but the prompt column reaches the rewards",
    "chat_template_kwargs": "data.chat_template_kwargs",
    # generation
    "max_prompt_length": "model.max_prompt_length (a longer prompt keeps its last tokens)",
    "max_completion_length": "model.max_completion_length",
    "num_generations": "model.num_generations",
    "num_generations_eval": "model.num_generations_eval",
    "temperature": "model.temperature",
    "top_p": "model.top_p",
    "top_k": "model.top_k",
    "min_p": "model.min_p",
    "repetition_penalty": "model.repetition_penalty",
    "use_vllm": "model.generation_backend: vllm",
    "vllm_mode": (
        "model.generation_backend: vllm, one engine inside each training process (TRL's colocate), or "
        "model.generation_backend: vllm_server (TRL's server)"
    ),
    "vllm_gpu_memory_utilization": "model.vllm_gpu_memory_utilization",
    "vllm_max_model_length": "model.vllm_max_model_length",
    "vllm_server_base_url": "model.vllm_server_urls, one or more",
    "vllm_server_timeout": "model.vllm_server_timeout",
    "max_tool_calling_iterations": "model.max_tool_calling_iterations",
    # the loss
    "beta": "model.beta",
    "epsilon": "model.epsilon",
    "epsilon_high": "model.epsilon_high",
    "delta": "model.delta",
    "loss_type": "model.loss_type",
    "num_iterations": "model.num_iterations",
    "scale_rewards": "model.scale_rewards: group, batch or none (TRL's true and false are group and none)",
    "importance_sampling_level": "model.importance_sampling_level",
    "mask_truncated_completions": "model.mask_truncated_completions",
    "top_entropy_quantile": "model.top_entropy_quantile",
    "use_bias_correction_kl": "model.use_bias_correction_kl",
    "sync_ref_model": "model.sync_ref_model",
    "model_init_kwargs": "model.model_init_kwargs",
    # the rest of TRL 1.16's settings that lit-grpo has under the same name, under model:
    "ref_model_mixup_alpha": "model.ref_model_mixup_alpha",
    "ref_model_sync_steps": "model.ref_model_sync_steps",
    "sapo_temperature_pos": "model.sapo_temperature_pos",
    "sapo_temperature_neg": "model.sapo_temperature_neg",
    "vespo_k_pos": "model.vespo_k_pos (with model.loss_type: vespo)",
    "vespo_lambda_pos": "model.vespo_lambda_pos (with model.loss_type: vespo)",
    "vespo_k_neg": "model.vespo_k_neg (with model.loss_type: vespo)",
    "vespo_lambda_neg": "model.vespo_lambda_neg (with model.loss_type: vespo)",
    "off_policy_mask_threshold": "model.off_policy_mask_threshold",
    "multi_objective_aggregation": "model.multi_objective_aggregation",
    "entropy_coef": "model.entropy_coef",
    "use_adaptive_entropy": "model.use_adaptive_entropy",
    "entropy_target": "model.entropy_target",
    "entropy_coef_min": "model.entropy_coef_min",
    "entropy_coef_max": "model.entropy_coef_max",
    "entropy_coef_delta": "model.entropy_coef_delta",
    "disable_dropout": "model.disable_dropout",
    "cast_lm_head_to_fp32": "model.cast_lm_head_to_fp32",
    "generation_kwargs": (
        "model.generation_kwargs (GenerationConfig fields for the lit and transformers backends, SamplingParams "
        "fields for vLLM)"
    ),
    "vllm_enable_sleep_mode": "model.vllm_enable_sleep_mode",
    "vllm_tensor_parallel_size": "model.vllm_tensor_parallel_size",
    "vllm_structured_outputs_regex": "model.vllm_structured_outputs_regex",
    "vllm_importance_sampling_correction": "model.vllm_importance_sampling_correction",
    "vllm_importance_sampling_mode": "model.vllm_importance_sampling_mode",
    "vllm_importance_sampling_clip_min": "model.vllm_importance_sampling_clip_min",
    "vllm_importance_sampling_clip_max": "model.vllm_importance_sampling_clip_max",
    "vllm_importance_sampling_cap": (
        "model.vllm_importance_sampling_cap, deprecated as in TRL 1.16: model.vllm_importance_sampling_clip_max"
    ),
    "log_unique_prompts": "model.log_unique_prompts",
}


def trl_hint(key: str) -> str | None:
    """``"TRL's learning_rate is optimizer.init_args.lr ..."`` for a key whose last part is one of
    TRL's names (``learning_rate``, ``model.learning_rate``), else None."""
    name = key.rsplit(".", 1)[-1]
    return f"TRL's {name} is {TRL_NAMES[name]}" if name in TRL_NAMES else None
