"""GRPO as a LightningModule: ``training_step`` reads as the numbered steps of the algorithm.

One call of ``training_step`` handles one *generation batch* (B prompts from the data module); steps
1-3 are the rollout collector's (:mod:`lit_grpo.rollout.collector`):

1. sample G completions per prompt with the current policy (:mod:`lit_grpo.rollout.engines`);
2. score every completion with the configured reward functions (:mod:`lit_grpo.scoring`);
3. turn rewards into group-relative advantages (:func:`lit_grpo.algorithm.multi_objective_advantages`);
4. compute, without gradient, the log-probs the update needs besides the policy's own: the
   sampling policy's (``old_logps``, only when the policy changes between sampling and an update,
   i.e. ``num_iterations > 1`` or ``steps_per_generation > 1``, and only for the rows trained after
   the first optimizer step: the others take theirs from their own forward in that step, before the
   policy has moved) and the reference model's (only when ``beta > 0``; with LoRA the reference is
   the policy with its adapter disabled);
5. run ``num_iterations`` passes over the generation batch; each pass is ``steps_per_generation``
   optimizer steps on mini-batches of ``B * G / steps_per_generation`` completions, and each
   mini-batch is processed in micro-batches of ``micro_batch_size`` completions (gradient
   accumulation) to bound memory (:mod:`lit_grpo.train.update`; the forwards and backwards:
   :mod:`lit_grpo.train.logprob_passes`);
6. log the metrics (TRL's names, :mod:`lit_grpo.train.step_metrics`) and, every few steps, a table of
   completions (:mod:`lit_grpo.run.completions`).

So one ``training_step`` makes ``num_iterations * steps_per_generation`` optimizer steps and
``trainer.max_steps`` counts optimizer steps, as in TRL. Optimization is manual
(``automatic_optimization = False``) because one batch drives several optimizer steps. With
``dynamic_sampling`` steps 1-3 repeat on further prompts until the batch holds enough groups with a
signal (:mod:`lit_grpo.rollout.dynamic_sampling`).
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from transformers import GenerationConfig

from lit_grpo import algorithm, cpu, device_defaults, models
from lit_grpo.algorithm.evaluation import ValidationMetrics
from lit_grpo.config import AsWritten, check_batch_sizes
from lit_grpo.data import PromptBatch
from lit_grpo.distributed import data_parallel_mesh, mixed_precision_policy, shard_model
from lit_grpo.errors import ConfigError
from lit_grpo.plugins.python_objects import RedactedSettings, save_settings
from lit_grpo.rollout.async_pipeline import RolloutPipeline
from lit_grpo.rollout.collector import Collectives, RolloutCollector
from lit_grpo.rollout.dynamic_sampling import check_data_fetcher, next_prompt_batch
from lit_grpo.rollout.engines import check_backend, engine_class, engine_for_run
from lit_grpo.rollout.engines.base import GenerationEngine
from lit_grpo.rollout.engines.requests import NO_CHAT_TEMPLATE, run_generation_configs
from lit_grpo.rollout.engines.server_lost import CheckpointWhenServerLost
from lit_grpo.rollout.records import (
    Rollout,
    SampledGroups,
    ScoredRollout,
    decode_completions,
    rollout_statistics,
)
from lit_grpo.run.callbacks import (
    CpuThreadsCallback,
    ValidateBeforeTraining,
    ignore_expected_lightning_warnings,
    step_progress_bar_for,
)
from lit_grpo.run.checkpointing import (
    RNGStateCheckpoint,
    check_no_weight_left_behind,
    check_python_rewards,
    check_resumed_partition,
    default_checkpointing_of,
)
from lit_grpo.run.completions import CompletionLog, completion_records, log_step_completions, logged_step
from lit_grpo.run.directory import run_directory
from lit_grpo.scoring import RewardSpec, check_data_columns
from lit_grpo.settings import RunSettings
from lit_grpo.train.logprob_passes import LogProbPasses
from lit_grpo.train.reference import ReferenceModelSync
from lit_grpo.train.sequence_parallel import SequenceParallel, check_model
from lit_grpo.train.sequence_parallel import check_settings as check_sequence_parallel
from lit_grpo.train.setup import check_settings_as_given, resolve_rewards_and_tools
from lit_grpo.train.step_metrics import timing_metrics, update_metrics
from lit_grpo.train.update import update_policy

__all__ = ["GRPOModule"]


ignore_expected_lightning_warnings()


class GRPOModule(RedactedSettings, pl.LightningModule):
    """Group Relative Policy Optimization (Shao et al. 2024, arXiv:2402.03300) for a causal LM.

    Every argument is a ``model:`` key of the config (docs/configuration.md).

    Args:
        model_name_or_path: Hugging Face hub id or local directory of the policy (and tokenizer); in Python
            also a model object (``PreTrainedModel``), trained in place. Rewards, tools and environments
            may likewise be functions and classes in Python (named ``module:qualname`` in checkpoints).
        rewards: rewards by registered name, ``[{name: char_fraction, weight: 1.0, args: {chars: "a"}}]``
            (``lit-grpo rewards`` lists them; ``lit_grpo.scoring.RewardSpec`` has the other keys).
        num_generations: G, completions sampled per prompt (at least 2).
        max_prompt_length: prompts longer than this keep their last tokens; None keeps all.
        max_completion_length: maximum new tokens per completion.
        temperature: sampling temperature (log-probs are computed at the same temperature).
        top_p: nucleus sampling threshold (1.0 disables).
        top_k: top-k sampling (0 disables).
        min_p: min-p sampling (None disables).
        repetition_penalty: generation repetition penalty (1.0 disables).
        num_iterations: mu, passes over each generation batch.
        steps_per_generation: optimizer steps per pass (equal mini-batches of the generation batch).
        micro_batch_size: completions per forward/backward (gradient accumulation); None: a whole mini-batch.
        loss_type: ``grpo`` | ``bnpo`` | ``dr_grpo`` | ``dapo`` | ``cispo`` | ``sapo`` | ``luspo`` | ``vespo``
            (``lit_grpo.algorithm.LOSS_TYPES``; for ``cispo`` ``epsilon_high`` bounds the weight, e.g. 5.0).
        beta: weight of the KL penalty to the reference model; 0 loads no reference model.
        epsilon: lower clip range, ratio >= 1 - epsilon.
        epsilon_high: upper clip range, ratio <= 1 + epsilon_high; None uses ``epsilon``.
        scale_rewards: ``group`` | ``batch`` | ``none``, the std that divides advantages.
        importance_sampling_level: ``token`` (GRPO) or ``sequence`` (GSPO).
        mask_truncated_completions: leave completions that never emitted EOS out of the loss.
        max_grad_norm: clip the gradient norm to this before each optimizer step; None or 0 disables.
        log_completions_every_n_steps: a table of completions to the logger every this many steps; 0 disables.
        num_completions_to_log: rows of that table.
        model_init_kwargs: extra ``from_pretrained`` arguments; weights load in float32 unless ``dtype`` is given.
        delta: two-sided clipping (INTELLECT-2): the unclipped ratio is capped at ``delta``; None disables.
        sapo_temperature_pos: SAPO's gate temperature for positive advantages (``loss_type: sapo``).
        sapo_temperature_neg: SAPO's gate temperature for negative advantages.
        kl_estimator: ``k1`` | ``k2`` | ``k3`` estimator of the KL penalty.
        use_bias_correction_kl: multiply the KL term by the importance ratio (TRL 1.16's default).
        top_entropy_quantile: train the policy term only on this fraction of highest-entropy tokens.
        num_generations_eval: completions per validation prompt (k); None uses ``num_generations``.
        temperature_eval: validation's temperature (0 decodes greedily); None uses ``temperature``.
        eval_rewards: rewards for validation (as ``rewards``); None uses the training ones.
        eval_pass_k: the k values of ``val/pass@k``; None logs pass@1 and pass@n.
        eval_success_threshold: a validation completion is correct when its reward is at least this.
        dynamic_sampling: DAPO's dynamic sampling: replace groups whose rewards are all equal.
        max_generation_rounds: at most this many generation rounds per step with dynamic sampling.
        validate_before_training: validate once before the first step (needs ``data.val_split``).
        save_completions: append every logged step's completions to ``completions.jsonl`` in the log directory.
        print_completions: print this many rows of each logged step's completions.
        sync_ref_model: every ``ref_model_sync_steps`` optimizer steps move the reference towards the
            policy, ``ref <- alpha * policy + (1 - alpha) * ref`` (TR-DPO; ``lit_grpo.train.reference``).
        ref_model_mixup_alpha: alpha of that update.
        ref_model_sync_steps: optimizer steps between two updates.
        lora: train a LoRA adapter: ``peft.LoraConfig`` arguments, e.g. ``{r: 16, lora_alpha: 32}``.
        gradient_checkpointing: recompute each decoder layer's activations in the backward pass.
        logprob_micro_batch_size: completions per no-gradient log-prob forward; None uses ``micro_batch_size``.
        group_by_length: log-prob forwards in chunks of rows of similar length (``lit_grpo.train.logprob_passes``).
        forward_token_budget: at most this many padded tokens per forward of several rows; None: no limit;
            auto: 1024 on the CPU, from the free memory on CUDA (``lit_grpo.device_defaults``).
        share_prompt_forward: encode each distinct prompt once in the log-prob forwards; auto: on the CPU only.
        skip_zero_gradient_rows: rows whose loss terms have no gradient skip the backward pass.
        padding_free: training forwards pack their rows into one sequence, positions restarting per row.
        sequence_parallel_size: split each row's tokens over this many ranks (Ulysses); 1: off.
        generation_backend: ``lit``, ``transformers``, ``vllm`` or ``vllm_server`` (``lit_grpo.rollout.engines``;
            vLLM: the ``lit-grpo[vllm]`` extra).
        vllm_gpu_memory_utilization: GPU memory share of the colocated engine (weights and KV cache).
        vllm_enable_sleep_mode: release the engine's GPU memory while the trainer trains.
        vllm_tensor_parallel_size: the engine's tensor-parallel degree (1 for now).
        vllm_max_model_length: the engine's longest sequence; None: prompt + completion maximum (tools: the model's).
        vllm_server_urls: ``vllm_server``: the servers' addresses (``lit-grpo serve``), ``[http://HOST:PORT, ...]``.
        vllm_server_timeout: seconds a server may be unreachable (at start, mid-run) before the run stops.
        vllm_importance_sampling_correction: reweight the engine's samples by trainer / engine probability,
            ``vllm_importance_sampling_mode`` (``token|sequence`` x ``truncate|mask``) within
            [``vllm_importance_sampling_clip_min``, ``vllm_importance_sampling_clip_max``] (TRL 1.16); with
            ``max_staleness > 0`` it also corrects for the staleness, and cannot be off. ``auto``: TRL's
            ``sequence_mask`` in [None, 3]; with ``max_staleness > 0`` decoupled PPO's per-token weights,
            ``token_mask`` in [0.125, 8] (``lit_grpo.algorithm.sampling_correction``).
        chat_template_kwargs: ``apply_chat_template`` arguments (``lit-grpo fit``: ``data.chat_template_kwargs``).
        tools: functions the policy may call, ``package.module:function`` or ``file.py:function``: multi-turn
            rollouts (``lit_grpo.rollout.tools.multi_turn``); with ``environment``: ``{name, args, weight}`` (or a list of
            them), stateful tools from a plugin (``lit_grpo.rollout.tools.environments``, ``lit-grpo environments``).
        max_tool_calling_iterations: rounds of tool results per rollout; None: until the completion budget.
        tool_timeout: seconds a tool call may take before the model reads a timeout error; None: no limit.
        tool_call_parser: None (the tokenizer's parser, else its chat template's format), ``hermes``,
            ``llama3_json``, ``mistral``, or ``package.module:function`` returning ``[{name, arguments}]``.
        max_tool_result_length: tokens of one tool result (a longer one keeps both ends); None: no limit.
        max_staleness: asynchronous GRPO: train on batches sampled up to this many optimizer steps before, while the
            next are scored (``lit_grpo.rollout.async_pipeline``); 0: synchronous.
        vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg: VESPO's Gamma weighting of the sequence
            importance weight for positive and negative advantages (``loss_type: vespo``; TRL's defaults).
        off_policy_mask_threshold: DeepSeek-V3.2's mask: a completion with a negative advantage whose KL to the
            sampling policy exceeds this leaves the policy loss (its KL term stays); None disables.
        multi_objective_aggregation: ``sum_then_normalize`` (weighted sum of the rewards, then group advantages)
            or ``normalize_then_sum`` (GDPO: each reward normalised within its group, then the weighted sum).
        entropy_coef: an entropy bonus, ``- entropy_coef * mean token entropy`` added to the loss; 0 disables.
        use_adaptive_entropy: adapt ``entropy_coef`` each optimizer step towards ``entropy_target`` (Skywork-OR1),
            within [``entropy_coef_min``, ``entropy_coef_max``] by steps of ``entropy_coef_delta``.
        entropy_target: the entropy below which the adaptive bonus applies.
        entropy_coef_min: the adaptive coefficient's lower bound.
        entropy_coef_max: its upper bound.
        entropy_coef_delta: its change per optimizer step.
        disable_dropout: set every dropout probability of the policy (and reference) to 0.
        cast_lm_head_to_fp32: compute the LM head and its log-probs in float32 whatever the model's dtype.
        generation_kwargs: extra sampling arguments for every backend, overriding the named ones (TRL's).
        vllm_structured_outputs_regex: vLLM backends: constrain completions to this regular expression.
        log_unique_prompts: the logger's completions table keeps one completion per distinct prompt (TRL's).
        vllm_importance_sampling_cap: deprecated (TRL 1.16): ``vllm_importance_sampling_clip_max``, with TRL's warning.
        tokenizer: Python only: the tokenizer of a model given as an object (default: its ``name_or_path``'s).
        optimizer: the ``optimizer:`` block, built once the policy exists; None: AdamW at lr 1e-6 (TRL's).
        lr_scheduler: the ``lr_scheduler:`` block; stepped after every optimizer step.
    """

    # over 60 lines only by its signature, the config's model: keys one a line; the body is under 30
    def __init__(
        self,
        model_name_or_path: str,
        rewards: list[RewardSpec],
        num_generations: int = 8,
        max_prompt_length: int | None = None,
        max_completion_length: int = 256,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float | None = None,
        repetition_penalty: float = 1.0,
        num_iterations: int = 1,
        steps_per_generation: int = 1,
        micro_batch_size: int | None = None,
        loss_type: str = "dapo",
        beta: float = 0.0,
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        scale_rewards: str = "group",
        importance_sampling_level: str = "token",
        mask_truncated_completions: bool = False,
        max_grad_norm: float | None = 1.0,
        log_completions_every_n_steps: int = 10,
        num_completions_to_log: int = 8,
        model_init_kwargs: dict[str, AsWritten] | None = None,
        delta: float | None = None,
        sapo_temperature_pos: float = 1.0,
        sapo_temperature_neg: float = 1.05,
        kl_estimator: str = "k3",
        use_bias_correction_kl: bool = True,
        top_entropy_quantile: float = 1.0,
        num_generations_eval: int | None = None,
        temperature_eval: float | None = None,
        eval_rewards: list[RewardSpec] | None = None,
        eval_pass_k: list[int] | None = None,
        eval_success_threshold: float = 1.0,
        dynamic_sampling: bool = False,
        max_generation_rounds: int = 4,
        validate_before_training: bool = False,
        save_completions: bool = True,
        print_completions: int = 0,
        sync_ref_model: bool = False,
        ref_model_mixup_alpha: float = 0.6,
        ref_model_sync_steps: int = 512,
        lora: dict[str, AsWritten] | None = None,
        gradient_checkpointing: bool = False,
        logprob_micro_batch_size: int | None = None,
        group_by_length: bool = True,
        forward_token_budget: int | Literal["auto"] | None = "auto",
        share_prompt_forward: bool | Literal["auto"] = "auto",
        skip_zero_gradient_rows: bool = True,
        padding_free: bool | Literal["auto"] = "auto",
        sequence_parallel_size: int = 1,
        generation_backend: str = "lit",
        vllm_gpu_memory_utilization: float = 0.3,
        vllm_enable_sleep_mode: bool = False,
        vllm_tensor_parallel_size: int = 1,
        vllm_max_model_length: int | None = None,
        vllm_server_urls: list[str] | None = None,
        vllm_server_timeout: float = 300.0,
        vllm_importance_sampling_correction: bool = True,
        vllm_importance_sampling_mode: str = "auto",
        vllm_importance_sampling_clip_min: float | Literal["auto"] | None = "auto",
        vllm_importance_sampling_clip_max: float | Literal["auto"] | None = "auto",
        chat_template_kwargs: dict[str, AsWritten] | None = None,
        tools: list[str] | None = None,
        environment: AsWritten | None = None,
        max_tool_calling_iterations: int | None = None,
        tool_timeout: float | None = 30.0,
        tool_call_parser: str | None = None,
        max_tool_result_length: int | None = 1024,
        max_staleness: int = 0,
        vespo_k_pos: float = 2.0,
        vespo_lambda_pos: float = 3.0,
        vespo_k_neg: float = 3.0,
        vespo_lambda_neg: float = 2.0,
        off_policy_mask_threshold: float | None = None,
        multi_objective_aggregation: str = "sum_then_normalize",
        entropy_coef: float = 0.0,
        use_adaptive_entropy: bool = False,
        entropy_target: float = 0.2,
        entropy_coef_min: float = 0.0,
        entropy_coef_max: float = 1.0,
        entropy_coef_delta: float = 0.005,
        disable_dropout: bool = False,
        cast_lm_head_to_fp32: bool = False,
        generation_kwargs: dict[str, AsWritten] | None = None,
        vllm_structured_outputs_regex: str | None = None,
        log_unique_prompts: bool = False,
        vllm_importance_sampling_cap: float | None = None,
        tokenizer: Any = None,
        optimizer: OptimizerCallable | None = None,
        lr_scheduler: LRSchedulerCallable | None = None,
    ):
        # The settings as given: in Python, functions, classes and a model object too.
        settings = {name: value for name, value in locals().items()
                    if name not in ("self", "__class__", "optimizer", "lr_scheduler", "tokenizer")}
        super().__init__()
        save_settings(self, settings, ignore=["optimizer", "lr_scheduler", "tokenizer"])  # names, never objects
        self.model_source = model_name_or_path  # a hub id, a directory, or a model given in Python
        self.optimizer_factory = optimizer
        self.lr_scheduler_factory = lr_scheduler
        self.automatic_optimization = False
        check_settings_as_given(self, settings)
        # the setting groups, built once from the hyperparameters (lit_grpo.settings; again by apply_settings)
        self.settings = self._run_settings()
        # so a misspelt name fails before any model is loaded
        self.scorer, self.eval_scorer, self.tool_use = resolve_rewards_and_tools(settings)
        # validation metrics, reduced over every rank's prompts at the end of the validation epoch
        self.val_metrics = ValidationMetrics(list(self.settings.evaluation.eval_pass_k))
        self.tokenizer = models.load_tokenizer(model_name_or_path, tokenizer)
        self.policy: torch.nn.Module | None = None
        self.ref_model: torch.nn.Module | None = None
        # every forward and backward after sampling (lit_grpo.train.logprob_passes), with settings built once
        self.logprobs = LogProbPasses(self.settings, self.all_gather, self._backward, self._grad_scaler_scale)
        self.run_log_dir: Path | None = None  # the logger's directory of this run, set in setup
        self._warned_prompt_truncation = False
        self.completion_log: CompletionLog | None = None  # where and how often completions are logged, set in setup
        self.policy_version = 0  # optimizer steps the policy has taken (checkpointed): the weights' version
        # steps 1-3: the engine (made by configure_model), the rewards, the tools (lit_grpo.rollout.collector)
        self.collector = RolloutCollector(self.scorer, self.tool_use, self.tokenizer, self.settings.generation,
                                          weights=self._current_weights,
                                          collectives=Collectives(self.all_gather, self._reduce, self._current_rank, self._current_device))
        self.rollout_pipeline = RolloutPipeline.for_settings(self.hparams)  # max_staleness > 0, else None
        check_backend(self.hparams)  # a missing extra or server address fails before any model is loaded

    def _run_settings(self) -> RunSettings:
        """The setting groups of ``hparams``, with the order the run's engine samples in (its class's)."""
        return RunSettings.from_hparams(self.hparams, engine_class(self.hparams.generation_backend).sampling_filter_order)

    def apply_settings(self) -> None:
        """Build the setting groups (:class:`lit_grpo.settings.RunSettings`) from ``hparams`` again and hand
        them to the log-prob passes and the rollout collector: the one way a setting changed in ``hparams``
        after construction takes effect (the code after setup reads the records, not ``hparams``). It does not
        re-check the settings, and what was built from them at construction stays as built: the engine and
        its sampling configs (``generation_config``, ``eval_generation_config``: a changed temperature
        changes what the trainer recomputes, not what the engine samples), the rewards, the tool use, the
        validation metrics and the asynchronous pipeline."""
        self.settings = self._run_settings()
        self.logprobs.settings = self.settings
        self.collector.settings = self.settings.generation

    # ------------------------------------------------------------------------------------------
    # Setup
    # ------------------------------------------------------------------------------------------

    def configure_model(self) -> None:
        """Build the policy (``lit_grpo.models.build_policy``: LoRA, gradient checkpointing), load
        the frozen reference model only when ``beta > 0`` without LoRA, and shard both under
        Lightning's ``ModelParallelStrategy`` (FSDP2)."""
        if self.policy is not None:
            return
        hp = self.hparams
        precision = self._precision()
        # the engine first: vLLM's memory check then sees none of the trainer's; a server not found fails now
        self.collector.engine = engine_for_run(hp, self.model_source, precision, grows_with_tools=self.tool_use is not None)
        self.engine.start()
        if hp.beta > 0 and hp.lora is None:  # with LoRA: the policy, adapter disabled
            self.ref_model = models.build_reference(self.model_source, hp.model_init_kwargs, precision)
        self.policy = models.build_policy(self.model_source, models.model_init_kwargs(hp.model_init_kwargs), lora=hp.lora,
                                          gradient_checkpointing=hp.gradient_checkpointing)
        if hp.sequence_parallel_size > 1:  # sequence_parallel: a model it can split, or one line now
            check_model(self.policy, hp.sequence_parallel_size)
        if hp.disable_dropout:  # TRL's: every dropout of the policy and the reference model at 0
            models.disable_dropout(self.policy, self.ref_model)
        eos_token_ids = models.completion_end_token_ids(self.policy, self.tokenizer)
        self.collector.generation_config, self.eval_generation_config = run_generation_configs(
            self.settings.sampling, self.settings.generation, self.settings.evaluation, self.tokenizer, eos_token_ids)
        if self.device_mesh is not None:  # Lightning's ModelParallelStrategy: shard with FSDP2
            mesh = data_parallel_mesh(self.device_mesh)
            mp_policy = mixed_precision_policy(precision)  # float32 shards, half-precision compute
            for model in (self.policy, self.ref_model):
                if model is not None:
                    shard_model(model, mesh, mp_policy)

    def _precision(self) -> str:
        """Lightning's ``trainer.precision`` (``32-true`` when no trainer is attached)."""
        return str(self._trainer.precision) if self._trainer is not None else "32-true"

    def setup(self, stage: str) -> None:
        # The run's log directory, resolved now, on every rank: ``trainer.log_dir`` is a collective
        # (rank 0 broadcasts the logger's version directory), so asking for it later on rank 0 alone,
        # where completions are written, would pair with another collective of the other ranks.
        log_dir = self.trainer.log_dir if self.trainer.logger is not None else None
        self.run_log_dir = run_directory(self.trainer.logger, log_dir, self.trainer.default_root_dir)
        hp = self.hparams
        self.completion_log = CompletionLog(hp.log_completions_every_n_steps, hp.num_completions_to_log, self.trainer.log_every_n_steps,
                                            hp.save_completions, hp.print_completions, self.run_log_dir, hp.log_unique_prompts)
        device = self.trainer.strategy.root_device
        cpu.prepare(device, self._precision(), self.policy)  # a no-op off the CPU
        self.logprobs.device_defaults = device_defaults.for_run(device, self.policy, self.hparams)  # and said once
        datamodule = getattr(self.trainer, "datamodule", None)
        prompt_format = getattr(datamodule, "prompt_format", None)
        if prompt_format is not None and prompt_format.makes_conversations and self.tokenizer.chat_template is None:
            raise ConfigError(NO_CHAT_TEMPLATE.format(model=f"model.model_name_or_path {self.hparams.model_name_or_path!r}"))
        if stage == "fit" and datamodule is not None and hasattr(datamodule, "batch_size"):
            update = self.settings.update
            check_batch_sizes(datamodule.batch_size, self.settings.generation.num_generations, update.steps_per_generation,
                              update.micro_batch_size)
        check_data_columns(datamodule, self.scorer, self.eval_scorer, self.tool_use and self.tool_use.environments)
        check_sequence_parallel(hp, self.trainer.world_size)  # sequence_parallel: groups of k ranks train the same rows
        if hp.sequence_parallel_size > 1 and self.logprobs.sequence_parallel is None:
            self.logprobs.sequence_parallel = SequenceParallel.of_world(hp.sequence_parallel_size)
            self.logprobs.all_gather = self.logprobs.sequence_parallel.one_rank_per_group(self.all_gather)
            if hp.share_prompt_forward == "auto" and self.logprobs.device_defaults["share_prompt_forward"]:
                rank_zero_info(f"model.share_prompt_forward auto: off with model.sequence_parallel_size {hp.sequence_parallel_size} "
                               "(every forward is one packed sequence split over the group)")

    def on_train_start(self) -> None:
        """``dynamic_sampling`` draws prompt batches through the fit loop's data fetcher (no public
        interface of Lightning's): check that this Lightning has it before the first step."""
        if self.settings.generation.dynamic_sampling:
            check_data_fetcher(self.trainer)

    def teardown(self, stage: str) -> None:
        if self.engine is not None:
            self.engine.close()  # before Lightning tears the process group down
        self.scorer.close()  # stop reward worker processes and the async-reward event loop
        if self.eval_scorer is not self.scorer:
            self.eval_scorer.close()

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Keep the weights' keys, the rewards' sources (:meth:`on_load_checkpoint`) and ``entropy_control``."""
        super().on_save_checkpoint(checkpoint)  # the hyperparameters without their secrets (RedactedSettings)
        checkpoint["state_dict_keys"] = sorted(checkpoint["state_dict"])
        checkpoint["policy_version"] = self.policy_version
        checkpoint["reward_packages"] = {spec.name: info.package for spec, info in zip(self.scorer.specs, self.scorer.infos)}
        if self.settings.entropy.use_adaptive_entropy:  # the controller's state (TRL's entropy_ctrl_state.json)
            checkpoint["entropy_control"] = self.logprobs.entropy_coefficient.state_dict()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """With LoRA, check that the checkpoint holds this policy's whole adapter and add the frozen
        base weights, already loaded from ``model_name_or_path`` by ``configure_model``.

        A sharded (FSDP2) checkpoint has already loaded the weights this module asks for (a missing
        one fails there, naming it); here the weights it holds that this module has no place for are
        an error (a resume with other ``model.lora`` targets would drop them). Restores ``entropy_control``."""
        check_python_rewards(checkpoint.get("reward_packages", {}), [spec.name for spec in self.scorer.specs])
        if self._trainer is not None:  # another number of processes mid-epoch: refused now, not at the first step
            check_resumed_partition(checkpoint, self.trainer.world_size, getattr(self.trainer.datamodule, "batch_size", None))
        self.policy_version = checkpoint.get("policy_version", checkpoint.get("global_step", 0))
        if self.settings.entropy.use_adaptive_entropy and "entropy_control" in checkpoint:  # older ones: a fresh state
            self.logprobs.entropy_coefficient.load_state_dict(checkpoint["entropy_control"])
        if self.hparams.lora is not None and "state_dict" in checkpoint:
            state_dict = checkpoint["state_dict"]
            checkpoint["state_dict"] = models.add_frozen_weights(state_dict, self.policy, prefix="policy.")
        if "state_dict" not in checkpoint and "state_dict_keys" in checkpoint:  # FSDP2's sharded checkpoint
            check_no_weight_left_behind(checkpoint["state_dict_keys"], self.state_dict())

    def configure_callbacks(self) -> list[pl.Callback]:
        """Every run, from the CLI or from Python (where it also gets the CLI's checkpointing), checkpoints
        its random states for exact resume and, on the CPU, fits its threads to the free cores; with
        ``sync_ref_model`` the reference follows the policy. A plain Trainer's default progress bar counts
        optimizer steps out of ``max_steps`` (``lit_grpo.run.callbacks.step_progress_bar_for``), as the CLI's does."""
        callbacks: list[pl.Callback] = [RNGStateCheckpoint(), CpuThreadsCallback(), *default_checkpointing_of(self.trainer),
                                        *step_progress_bar_for(self.trainer)]
        if self.hparams.validate_before_training:
            callbacks.append(ValidateBeforeTraining())
        if self.hparams.sync_ref_model:
            callbacks.append(ReferenceModelSync(self.hparams.ref_model_sync_steps, self.hparams.ref_model_mixup_alpha))
        if engine_class(self.hparams.generation_backend).can_lose_servers or self.rollout_pipeline is not None:
            callbacks.append(CheckpointWhenServerLost())  # a server lost or a background job failed: a checkpoint, then a stop
        if self.rollout_pipeline is not None:
            callbacks.append(self.rollout_pipeline)
        return callbacks

    def configure_optimizers(self):
        """The configured optimizer (AdamW at lr 1e-6 by default) over the trainable parameters.

        Built here, after ``configure_model`` has loaded the policy, rather than by LightningCLI at
        instantiation, when the policy does not exist yet.
        """
        params = [p for p in self.parameters() if p.requires_grad]
        optimizer = self.optimizer_factory(params) if self.optimizer_factory else torch.optim.AdamW(params, lr=1e-6)
        warning = models.check_trainable_dtype(self.policy, optimizer, self._precision())
        if warning is not None:  # not a torch.optim optimizer: it may handle half-precision weights
            rank_zero_warn(warning)
        self.logprobs.check_cast_lm_head_to_fp32(self.policy)  # refused now, not at the first pass after sampling
        self.logprobs.padding_free(self.policy)  # padding_free: true on a model that cannot pack: refused now too
        if self.lr_scheduler_factory is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": self.lr_scheduler_factory(optimizer)}

    # ------------------------------------------------------------------------------------------
    # The GRPO step
    # ------------------------------------------------------------------------------------------

    def training_step(self, batch: PromptBatch, batch_idx: int) -> None:
        step_start = time.perf_counter()
        generation, update = self.settings.generation, self.settings.update
        check_batch_sizes(len(batch.prompts), generation.num_generations, update.steps_per_generation, update.micro_batch_size)

        # 1-4. Sample, score, advantages, reference log-probs (and, below, old log-probs); with
        #      max_staleness, of an older batch (None while the pipeline fills: lit_grpo.rollout.async_pipeline).
        pipeline = self.rollout_pipeline
        scored, completions = self.generate_and_score(batch) if pipeline is None else pipeline.exchange(self, batch)
        if scored is None:
            return

        # 5. num_iterations passes of steps_per_generation optimizer steps each (lit_grpo.train.update).
        sequence_parallel = self.logprobs.sequence_parallel  # its group's ranks shuffle the same rows alike
        generator = sequence_parallel.shared_generator(self.device) if sequence_parallel is not None else None
        step_stats, grad_norm = update_policy(scored, self.logprobs, self.policy, self.parameters, self.optimizers(),
                                              self.lr_schedulers(), update, self._count_optimizer_step, generator)

        # 6. Metrics: the rollout statistics are already global; the update statistics are this
        #    rank's, averaged over ranks (every rank runs the same number of micro-batches).
        metrics = self._rollout_metrics(scored)
        metrics.update(update_metrics(step_stats, update.num_iterations, update.steps_per_generation, self._reduce))
        if grad_norm is not None:
            metrics["grad_norm"] = grad_norm
        metrics.update(timing_metrics(scored, time.perf_counter() - step_start, self._data_parallel_reduce()))
        metrics.update(pipeline.metrics if pipeline is not None else {})
        for name, value in (scored.dynamic_sampling or {}).items():
            metrics[f"dynamic_sampling/{name}"] = value
        for name, value in metrics.items():
            self.log(name, value.float(), on_step=True, prog_bar=name == "reward", batch_size=len(batch.prompts))
        self._log_completions(scored, completions)

    def _log_completions(self, scored: ScoredRollout, completions: list) -> None:
        """The step's completions to the loggers' table, ``completions.jsonl`` and the console (:mod:`lit_grpo.run.completions`)."""
        step = logged_step(self.trainer)  # the step of this batch's scalars
        prompts = [prompt for prompt in scored.prompts for _ in range(self.settings.generation.num_generations)]
        sequence_parallel = self.logprobs.sequence_parallel

        def make_records() -> list[dict[str, Any]]:  # only on a step that logs them
            if sequence_parallel is not None and sequence_parallel.rank != 0:  # sequence_parallel: its group's first rank has them
                return []
            return completion_records(step, prompts, completions, self.collector.reward_names, scored.rewards_per_func.tolist(),
                                      scored.rewards.tolist(), scored.group.advantages.tolist())

        log_step_completions(self.completion_log, self.loggers, step, self.trainer.is_global_zero, make_records)

    # bound methods, not lambdas, for the collector: a module that pickles (ddp_spawn, torch.save) still does
    def _current_weights(self) -> tuple[torch.nn.Module | None, int]:
        return self.policy, self.policy_version

    def _current_rank(self) -> int:
        return self.global_rank

    def _current_device(self) -> torch.device:
        return self.device

    def _count_optimizer_step(self) -> None:
        self.policy_version += 1  # the engine's weights are stale from here (engine.sync_weights)

    def _data_parallel_reduce(self):
        """``_reduce`` over the data-parallel ranks: with ``sequence_parallel_size`` k, a sum counts each group once."""
        sequence_parallel = self.logprobs.sequence_parallel
        return self._reduce if sequence_parallel is None else sequence_parallel.data_parallel_reduce(self._reduce)

    def _reduce(self, value: torch.Tensor, reduce_op: str) -> torch.Tensor:
        """``value`` reduced over every rank (``sum``, ``mean``, ``max``, ``min``); itself without a trainer."""
        return self.trainer.strategy.reduce(value, reduce_op=reduce_op) if self._trainer is not None else value

    def generate_and_score(self, batch: PromptBatch, training: bool = True) -> tuple[ScoredRollout, list]:
        """Steps 1-4 for one generation batch; ``training=False`` skips the log-prob passes.
        Returns the scored rollout and the completions as the rewards saw them."""
        timings = {"generate": 0.0, "rewards": 0.0}  # seconds per phase, logged as time/<phase>

        # 1-3. Sample G completions per prompt, score them, group-relative advantages; with dynamic
        #      sampling, drop groups without signal and sample more prompts to replace them.
        more_prompts = (lambda: next_prompt_batch(self.trainer)) if training and self.settings.generation.dynamic_sampling else None
        sampled, dynamic_sampling_stats = self.collector.collect(batch, timings, more_prompts)
        if training and self.logprobs.sequence_parallel is not None:  # sequence_parallel: the group's rows on each of its ranks
            sampled = self.logprobs.sequence_parallel.union(sampled, self.tokenizer.pad_token_id)

        # 4. Log-probs of the reference model (only with a KL penalty); those of the policy that
        #    sampled, where the update needs them, come in ``training_step``.
        scored = self.prepare_update(sampled, timings, with_reference=training)
        scored.dynamic_sampling = dynamic_sampling_stats
        return scored, sampled.completions

    def prepare_update(self, sampled: SampledGroups, timings: dict[str, float], with_reference: bool = True) -> ScoredRollout:
        """Step 4 for sampled groups (of this step, or of the asynchronous pipeline): the loss mask, the
        dapo normaliser and, with a KL penalty, the reference model's log-probs (``timings["logprobs"]``)."""
        update = self.settings.update
        rollout = sampled.rollout
        loss_mask = rollout.policy_token_mask  # with tools: the tokens the policy generated
        if update.mask_truncated_completions:
            loss_mask = loss_mask * (~rollout.is_truncated).unsqueeze(1).long()
        # dapo's (and cispo's) normaliser, as TRL 1.16 computes it: the real completion tokens of the
        # generation batch over all ranks, / world size (each rank's gradient is averaged), / the
        # steps_per_generation optimizer steps that share it, so each step takes about a token mean
        # of its own rows (not half of one with two steps per pass)
        # (sequence_parallel: over the W / k data-parallel groups, whose k ranks hold the same rows)
        all_tokens = float(self._data_parallel_reduce()(loss_mask.sum().float(), "sum"))
        sequence_parallel = self.logprobs.sequence_parallel
        data_parallel_size = self.trainer.world_size // (sequence_parallel.size if sequence_parallel is not None else 1)
        num_items_in_batch = algorithm.dapo_normaliser(all_tokens, data_parallel_size, update.steps_per_generation)
        start = time.perf_counter()
        ref_logps = self.logprobs.reference_logps(self.policy, self.ref_model, rollout) if with_reference and self.settings.loss.beta > 0 else None
        timings["logprobs"] = timings.get("logprobs", 0.0) + time.perf_counter() - start
        return ScoredRollout(
            rollout=rollout,
            loss_mask=loss_mask,
            rewards_per_func=sampled.rewards_per_func,
            rewards=sampled.rewards,
            group=sampled.group,
            old_logps=None,
            ref_logps=ref_logps,
            num_items_in_batch=num_items_in_batch,
            timings=timings,
            prompts=sampled.prompts,
        )

    def generate(self, prompts: list, num_generations: int | None = None, config: GenerationConfig | None = None,
                 columns: dict[str, list] | None = None) -> Rollout:
        """Sample completions for each prompt (strings or chat messages): ``num_generations`` (default
        G) with ``config`` (default the training sampling settings); with tools, multi-turn rollouts
        (``columns``: the prompts' dataset columns, which environments are built from)."""
        return self.collector.generate(prompts, num_generations, config, columns)

    @property
    def engine(self) -> GenerationEngine | None:
        """What samples (:mod:`lit_grpo.rollout.engines`), made by :meth:`configure_model`."""
        return self.collector.engine

    @property
    def generation_config(self) -> GenerationConfig | None:
        """The training sampling settings, made by :meth:`configure_model`."""
        return self.collector.generation_config

    def _grad_scaler_scale(self) -> float:
        """The loss scale of a ``16-mixed`` GradScaler (1 without one)."""
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        return float(scaler.get_scale()) if scaler is not None else 1.0

    def _backward(self, loss: torch.Tensor, sync: bool) -> None:
        """``manual_backward``; with ``sync=False`` DDP accumulates the gradient without all-reducing."""
        block_sync = getattr(self.trainer.strategy, "block_backward_sync", None)  # DDP only
        with nullcontext() if sync or block_sync is None else block_sync():
            self.manual_backward(loss)

    # ------------------------------------------------------------------------------------------
    # Validation: sample k completions per prompt, score them (lit_grpo.algorithm.evaluation)
    # ------------------------------------------------------------------------------------------

    def validation_step(self, batch: PromptBatch, batch_idx: int) -> None:
        """Sample k completions per validation prompt, score them with the evaluation rewards, and
        accumulate ``val/reward``, ``val/mean@k``, ``val/pass@k`` and (binary rewards) ``val/maj@k``. Every
        rank runs as many validation steps (their collectives pair up): Lightning's ``DistributedSampler``
        pads an uneven validation split with its first prompts, so each rank gets as many prompts."""
        evaluation = self.settings.evaluation
        k = evaluation.num_generations_eval
        num_prompts = len(batch.prompts)
        rollout = self.generate(batch.prompts, k, self.eval_generation_config, batch.columns)
        texts, _ = decode_completions(self.tokenizer, rollout)
        # a reward raising on one rank raises on every rank (not only in training's step 2)
        _, rewards_per_func = self.collector.score_on_every_rank(self.eval_scorer, batch, rollout, k)
        rewards = algorithm.combine_rewards(rewards_per_func, self.collector.reward_weights(self.eval_scorer)).view(num_prompts, k)  # [B, k]
        answers = [[" ".join(text.split()) for text in texts[b * k : (b + 1) * k]] for b in range(num_prompts)]
        self.val_metrics.add_batch(
            rewards, answers, evaluation.eval_success_threshold, lambda value: self.trainer.strategy.reduce(value, reduce_op="min")
        )
        for name, metric in self.val_metrics.to_log(k).items():
            self.log(name, metric, on_step=False, on_epoch=True, batch_size=num_prompts)

    # ------------------------------------------------------------------------------------------
    # Logging
    # ------------------------------------------------------------------------------------------

    def _rollout_metrics(self, scored: ScoredRollout) -> dict[str, torch.Tensor]:
        """Statistics of the generation batch over all ranks (identical on every rank), with how
        many samples each reward failed on (``rewards/<name>/errors``)."""
        metrics = rollout_statistics(scored, self.collector.reward_names, self.logprobs.all_gather)  # sequence_parallel: a group once
        if scored.rollout.conversations is not None:
            metrics.update(self.tool_use.metrics(scored.rollout.conversations,
                                                 lambda value: self.trainer.strategy.reduce(value.to(self.device), reduce_op="sum")))
        if metrics["prompts/truncated_frac"] > 0 and not self._warned_prompt_truncation:
            self._warned_prompt_truncation = True
            rank_zero_warn(
                f"model.max_prompt_length={self.settings.generation.max_prompt_length} cut {float(metrics['prompts/truncated_frac']):.0%} "
                "of this step's prompts to their last tokens (logged as prompts/truncated_frac; said once): raise it, or "
                "shorten the prompts"
            )
        for name in self.scorer.names:
            errors = torch.tensor(float(self.scorer.last_error_counts.get(name, 0)), device=self.device)
            metrics[f"rewards/{name}/errors"] = self.trainer.strategy.reduce(errors, reduce_op="sum")
        return metrics
