"""GRPO as a LightningModule: ``training_step`` reads as the numbered steps of the algorithm.

One call of ``training_step`` handles one *generation batch* (B prompts from the data module):

1. sample G completions per prompt with the current policy;
2. score every completion with the configured reward functions;
3. turn rewards into group-relative advantages;
4. compute, without gradient, the log-probs the update needs besides the policy's own: the
   sampling policy's (``old_logps``, only when the policy changes between sampling and an update,
   i.e. ``num_iterations > 1`` or ``steps_per_generation > 1``, and only for the rows trained after
   the first optimizer step: the others take theirs from their own forward in that step, before the
   policy has moved) and the reference model's (only when ``beta > 0``; with LoRA the reference is
   the policy with its adapter disabled);
5. run ``num_iterations`` passes over the generation batch; each pass is ``steps_per_generation``
   optimizer steps on mini-batches of ``B * G / steps_per_generation`` completions, and each
   mini-batch is processed in micro-batches of ``micro_batch_size`` completions (gradient
   accumulation) to bound memory, a micro-batch above ``forward_token_budget`` tokens in chunks of
   rows, each chunk's forward followed by its own backward;
6. log the metrics (TRL's names) and, every few steps, a table of completions.

So one ``training_step`` makes ``num_iterations * steps_per_generation`` optimizer steps and
``trainer.max_steps`` counts optimizer steps, as in TRL. Optimization is manual
(``automatic_optimization = False``) because one batch drives several optimizer steps.
"""

from __future__ import annotations

import copy
import os
import time
import warnings
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torchmetrics
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from transformers import AutoTokenizer, GenerationConfig

from lit_grpo import algorithm, evaluation, models
from lit_grpo.allocator import keep_freed_memory
from lit_grpo.attention import use_cpu_half_attention
from lit_grpo.callbacks import ValidateBeforeTraining
from lit_grpo.checkpointing import RNGStateCheckpoint
from lit_grpo.config import AsWritten
from lit_grpo.completions import COMPLETIONS_FILE, append_records, as_text, completion_records, format_table
from lit_grpo.data import PromptBatch
from lit_grpo.distributed import (
    agreed_over_sharded_ranks,
    data_parallel_mesh,
    gather_real_values,
    gather_rows,
    gathered_for_generation,
    mixed_precision_policy,
    shard_model,
)
from lit_grpo.generation import (
    FORWARD_OVERHEAD_TOKENS,
    GENERATION_BACKENDS,
    NO_CHAT_TEMPLATE,
    Rollout,
    concat_rollouts,
    decode_completions,
    generate_completions,
    is_conversational,
    length_chunks,
    position_ids_from_mask,
    render_prompts,
    split_chunks,
)
from lit_grpo.reference import ReferenceModelSync
from lit_grpo.scoring import RewardScorer, RewardSpec
from lit_grpo.shared_prompt import (
    PromptGroups,
    PromptPrefix,
    completion_logits,
    distinct_prompts,
    encode_prompts,
    shared_prompt_unsupported,
)



def _without_frozen_policy_weights(module: "GRPOModule", state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """State-dict post-hook of a LoRA module: drops the policy's frozen base weights."""
    if module.policy is not None:
        models.drop_frozen_weights(state_dict, module.policy, prefix=prefix + "policy.")


def ignore_expected_lightning_warnings() -> None:
    """Validation is optional (``data.val_split``): without it Lightning skips the loop, as intended,
    so its warning about a ``validation_step`` without a ``val_dataloader`` is noise."""
    warnings.filterwarnings("ignore", message=r"You defined a `validation_step` but have no `val_dataloader`")


ignore_expected_lightning_warnings()


@dataclass
class ScoredRollout:
    """A rollout with everything the update needs. N = B * G completions, C completion tokens."""

    rollout: Rollout
    loss_mask: torch.Tensor  # [N, C] completion tokens that count in the loss
    rewards_per_func: torch.Tensor  # [N, K] NaN where a reward returned None
    rewards: torch.Tensor  # [N] weighted sum, NaN where every reward returned None
    group: algorithm.GroupAdvantages  # advantages [N] and the group statistics behind them
    # [N, C] sampling policy, None when it equals the current policy; the rows of the first optimizer
    # step fill theirs during that step (``training_step``)
    old_logps: torch.Tensor | None
    ref_logps: torch.Tensor | None  # [N, C] reference model, None when beta == 0
    num_items_in_batch: float  # generation batch's real completion tokens, all ranks, / world size / steps_per_generation
    timings: dict[str, float]  # seconds spent in each phase of the step (generate, rewards, logprobs, train)
    prompts: list  # [B] the prompts of the groups (with dynamic sampling, not only the step's batch)
    dynamic_sampling: dict[str, torch.Tensor] | None = None  # dropped_frac and rounds, when enabled


@dataclass
class SampledGroups:
    """Steps 1-3 for some prompts: their groups of G completions, rewards and advantages. N = B * G."""

    prompts: list  # [B] one entry per group
    rollout: Rollout
    completions: list  # [N] as the rewards saw them (text, or assistant messages)
    rewards_per_func: torch.Tensor  # [N, K]
    rewards: torch.Tensor  # [N]
    group: algorithm.GroupAdvantages

    def informative_groups(self, G: int) -> torch.Tensor:
        """``[B]`` True where the group's rewards differ (advantages not all zero)."""
        return ~self.group.zero_std.view(-1, G).all(dim=1)

    def group_slice(self, g: int, G: int) -> "SampledGroups":
        rows = torch.arange(g * G, (g + 1) * G, device=self.rewards.device)
        return SampledGroups(
            prompts=[self.prompts[g]],
            rollout=self.rollout.select(rows),
            completions=self.completions[g * G : (g + 1) * G],
            rewards_per_func=self.rewards_per_func[rows],
            rewards=self.rewards[rows],
            group=self.group.rows(rows),
        )

    @staticmethod
    def concat(parts: list["SampledGroups"], pad_token_id: int) -> "SampledGroups":
        return SampledGroups(
            prompts=[prompt for part in parts for prompt in part.prompts],
            rollout=concat_rollouts([part.rollout for part in parts], pad_token_id).trimmed(),
            completions=[c for part in parts for c in part.completions],
            rewards_per_func=torch.cat([part.rewards_per_func for part in parts]),
            rewards=torch.cat([part.rewards for part in parts]),
            group=algorithm.GroupAdvantages(
                *(torch.cat([getattr(part.group, field) for part in parts]) for field in ("advantages", "group_mean", "group_std", "zero_std"))
            ),
        )


class GRPOModule(pl.LightningModule):
    """Group Relative Policy Optimization (Shao et al. 2024, arXiv:2402.03300) for a causal LM.

    Args:
        model_name_or_path: Hugging Face hub id or local directory of the policy (and tokenizer).
        rewards: reward functions by registered name, e.g. ``[{name: char_fraction, weight: 1.0,
            args: {chars: "a"}}]``; ``lit-grpo rewards`` lists the installed ones.
        num_generations: G, completions sampled per prompt (at least 2: advantages are relative
            to the group).
        max_prompt_length: prompts longer than this keep their last tokens; None keeps all.
        max_completion_length: maximum new tokens per completion.
        temperature: sampling temperature (log-probs are computed at the same temperature).
        top_p: nucleus sampling threshold (1.0 disables).
        top_k: top-k sampling (0 disables).
        min_p: min-p sampling (None disables).
        repetition_penalty: generation repetition penalty (1.0 disables).
        num_iterations: mu, passes over each generation batch.
        steps_per_generation: optimizer steps per pass; the generation batch is split into this
            many mini-batches of equal size.
        micro_batch_size: completions per forward/backward pass (gradient accumulation within an
            optimizer step); None processes a whole mini-batch at once.
        loss_type: ``grpo`` | ``bnpo`` | ``dr_grpo`` | ``dapo`` | ``cispo`` | ``sapo`` (see
            ``lit_grpo.algorithm.LOSS_TYPES``; for ``cispo`` ``epsilon_high`` is the absolute bound of
            the importance weight, e.g. 5.0, as in TRL).
        beta: weight of the k3 KL penalty to the reference model; 0 loads no reference model.
        epsilon: lower clip range, ratio >= 1 - epsilon.
        epsilon_high: upper clip range, ratio <= 1 + epsilon_high; None uses ``epsilon``.
        scale_rewards: ``group`` | ``batch`` | ``none``, the std that divides advantages.
        importance_sampling_level: ``token`` (GRPO) or ``sequence`` (GSPO).
        mask_truncated_completions: leave completions that never emitted EOS out of the loss.
        max_grad_norm: clip the gradient norm to this before each optimizer step; None or 0 disables.
        log_completions_every_n_steps: write a table of completions to TensorBoard every this many
            training steps (generation batches); 0 disables.
        num_completions_to_log: rows of that table.
        model_init_kwargs: extra keyword arguments for ``from_pretrained`` (e.g. ``{dtype: bfloat16}``).
        delta: two-sided clipping (INTELLECT-2): the unclipped ratio is capped at ``delta`` (> 1 +
            epsilon_high) for the PPO-style loss types; None disables.
        sapo_temperature_pos: SAPO's gate temperature for positive advantages (``loss_type: sapo``).
        sapo_temperature_neg: SAPO's gate temperature for negative advantages.
        kl_estimator: ``k1`` | ``k2`` | ``k3`` estimator of the KL penalty (``beta > 0``).
        top_entropy_quantile: train the policy term only on this fraction of the tokens with the
            highest entropy (over the micro-batch on all ranks); 1.0 trains every token.
        num_generations_eval: completions sampled per validation prompt (k); None uses
            ``num_generations``.
        temperature_eval: sampling temperature for validation; 0 decodes greedily; None uses
            ``temperature``.
        eval_rewards: rewards for validation (same form as ``rewards``); None uses the training ones.
        eval_pass_k: the k values of ``val/pass@k`` (each at most ``num_generations_eval``); None logs
            pass@1 and pass@n.
        eval_success_threshold: a validation completion counts as correct (pass@k, maj@n) when its
            total reward is at least this.
        dynamic_sampling: DAPO's dynamic sampling: drop groups whose rewards are all equal and sample
            the next prompts of the data until the step holds ``batch_size`` informative groups.
        max_generation_rounds: at most this many generation rounds per step with dynamic sampling
            (then the batch is topped up with uninformative groups).
        validate_before_training: run the validation loop once before the first training step (the
            untrained model's ``val/*`` metrics at step 0); needs ``data.val_split``.
        save_completions: append every logged step's completions (prompt, completion, each reward,
            reward, advantage) to ``completions.jsonl`` in the run's log directory (with a logger)
            (``lit-grpo completions RUN_DIR`` shows them).
        print_completions: print this many rows of each logged step's completions to the console.
        sync_ref_model: every ``ref_model_sync_steps`` optimizer steps move the reference towards the
            policy, ``ref <- alpha * policy + (1 - alpha) * ref`` (TR-DPO; ``lit_grpo.reference``).
        ref_model_mixup_alpha: alpha of that update.
        ref_model_sync_steps: optimizer steps between two updates.
        lora: train a LoRA adapter (peft) instead of every weight: ``peft.LoraConfig`` arguments,
            e.g. ``{r: 16, lora_alpha: 32, lora_dropout: 0.05}``; ``target_modules`` defaults to
            ``all-linear``. With ``beta > 0`` the reference is the policy with the adapter disabled
            (no second copy of the weights), and checkpoints hold only the adapter. None trains
            every weight.
        gradient_checkpointing: recompute each decoder layer's activations in the backward pass
            (Hugging Face gradient checkpointing, non-reentrant) to save activation memory.
        logprob_micro_batch_size: completions per forward of the no-gradient log-prob passes (old
            and reference log-probs); None uses ``micro_batch_size``.
        group_by_length: run the log-prob forwards (training and no-gradient) in chunks of rows of
            similar length where that saves padding (``lit_grpo.generation.length_chunks``); the values
            and the loss, taken over the whole micro-batch, are unchanged. False runs each
            micro-batch in one forward, padded to its longest row.
        forward_token_budget: with ``group_by_length``, at most this many padded tokens (rows x
            longest sequence) per forward of several rows; a training micro-batch above it goes
            forward and backward in chunks within it (the same gradient), so it bounds activation
            memory. None sets no limit. The default suits CPUs (smaller peaks for 2-4 % of the
            step time, README Performance); GPUs, where a forward has more fixed cost, may want more.
        share_prompt_forward: in the log-prob forwards, encode each distinct prompt once and let its
            completions attend to its KV cache (``lit_grpo.shared_prompt``) where that saves more
            than a forward's overhead; the values and gradients are those of full forwards. Not used
            with gradient checkpointing or sliding-window / linear-attention layers.
        skip_zero_gradient_rows: rows whose loss terms have exactly zero gradient (advantage 0, as in
            a group of equal rewards, with ``beta = 0``; or no token that counts) go forward without
            autograd, for the statistics only, and skip the backward pass (and, when the policy moves
            within a generation batch, the old-log-prob pass); the update and every logged value are
            unchanged (``lit_grpo.algorithm.rows_without_gradient``).
        generation_backend: ``lit`` (default): the group sampler of ``lit_grpo.generation`` (each
            prompt encoded once, preallocated KV cache, finished completions leave the batch);
            ``transformers``: Hugging Face ``generate``. ``lit`` falls back to ``generate`` (with a
            warning) for models or generation options it does not implement.
        chat_template_kwargs: extra keyword arguments of ``apply_chat_template`` when chat prompts are
            rendered; ``lit-grpo fit`` sets them from ``data.chat_template_kwargs``.
        optimizer: built lazily from the YAML top-level ``optimizer:`` block (linked here by the
            CLI); None means AdamW at TRL's default learning rate 1e-6.
        lr_scheduler: built from the top-level ``lr_scheduler:`` block; stepped after every
            optimizer step.
    """

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
        forward_token_budget: int | None = 1024,
        share_prompt_forward: bool = True,
        skip_zero_gradient_rows: bool = True,
        generation_backend: str = "lit",
        chat_template_kwargs: dict[str, AsWritten] | None = None,
        optimizer: OptimizerCallable | None = None,
        lr_scheduler: LRSchedulerCallable | None = None,
    ):
        super().__init__()
        self.save_hyperparameters(ignore=["optimizer", "lr_scheduler"])
        self.optimizer_factory = optimizer
        self.lr_scheduler_factory = lr_scheduler
        self.automatic_optimization = False
        _check_settings(self.hparams)
        self.epsilon_high = epsilon if epsilon_high is None else epsilon_high
        if lora is not None:
            models.lora_config(lora)  # a bad model.lora fails before any model is loaded
            # The module's state dict, so every checkpoint (FSDP2's sharded ones too), holds only the
            # adapter: the base weights are model_name_or_path's. on_load_checkpoint checks a full
            # checkpoint and adds them back; a sharded one loads the keys the state dict has.
            self.register_state_dict_post_hook(_without_frozen_policy_weights)
            self.strict_loading = False

        # Rewards are resolved now, so a misspelt name fails before any model is loaded.
        self.scorer = RewardScorer(rewards)
        self.eval_scorer = RewardScorer(eval_rewards) if eval_rewards else self.scorer
        # validation metrics, reduced over every rank's prompts at the end of the validation epoch
        n_eval = num_generations_eval or num_generations
        self.eval_pass_k = sorted(set(eval_pass_k or [1, n_eval]))
        self.val_metrics = torch.nn.ModuleDict(
            {name: torchmetrics.MeanMetric() for name in ["reward", "mean", "maj", *(f"pass{k}" for k in self.eval_pass_k)]}
        )
        self.tokenizer = load_tokenizer(model_name_or_path)
        self.policy: torch.nn.Module | None = None
        self.ref_model: torch.nn.Module | None = None
        self._prompt_sharing_notes: set[str] = set()  # reasons share_prompt_forward was not used, said once
        self.run_log_dir: Path | None = None  # the logger's directory of this run, set in setup

    # ------------------------------------------------------------------------------------------
    # Setup
    # ------------------------------------------------------------------------------------------

    def configure_model(self) -> None:
        """Build the policy (``lit_grpo.models.build_policy``: LoRA, gradient checkpointing) and load
        the frozen reference model only when ``beta > 0`` without LoRA."""
        if self.policy is not None:
            return
        init_kwargs = models.model_init_kwargs(self.hparams.model_init_kwargs)
        self.policy = models.build_policy(
            self.hparams.model_name_or_path,
            init_kwargs,
            lora=self.hparams.lora,
            gradient_checkpointing=self.hparams.gradient_checkpointing,
        )
        precision = self._precision()
        if self.hparams.beta > 0 and self.hparams.lora is None:  # with LoRA: the policy, adapter disabled
            ref_kwargs = models.reference_init_kwargs(self.hparams.model_init_kwargs, precision)
            self.ref_model = models.load_causal_lm(self.hparams.model_name_or_path, ref_kwargs)
            self.ref_model.requires_grad_(False).eval()
        eos_token_ids = models.eos_token_ids(self.policy, self.tokenizer)
        if self.device_mesh is not None:  # Lightning's ModelParallelStrategy: shard with FSDP2
            mesh = data_parallel_mesh(self.device_mesh)
            mp_policy = mixed_precision_policy(precision)  # float32 shards, half-precision compute
            for model in (self.policy, self.ref_model):
                if model is not None:
                    shard_model(model, mesh, mp_policy)
        self.generation_config = GenerationConfig(
            do_sample=True,
            max_new_tokens=self.hparams.max_completion_length,
            temperature=self.hparams.temperature,
            top_p=self.hparams.top_p,
            top_k=self.hparams.top_k,
            min_p=self.hparams.min_p,
            repetition_penalty=self.hparams.repetition_penalty,
            pad_token_id=self.tokenizer.pad_token_id,
            eos_token_id=eos_token_ids,  # every id that ends a turn: the model's and the tokenizer's
            bos_token_id=self.tokenizer.bos_token_id,
        )
        self.eval_generation_config = eval_generation_config(self.generation_config, self.hparams.temperature_eval)

    def _precision(self) -> str:
        """Lightning's ``trainer.precision`` (``32-true`` when no trainer is attached)."""
        return str(self._trainer.precision) if self._trainer is not None else "32-true"

    def setup(self, stage: str) -> None:
        # The run's log directory, resolved now, on every rank: ``trainer.log_dir`` is a collective
        # (rank 0 broadcasts the logger's version directory), so asking for it later on rank 0 alone,
        # where completions are written, would pair with another collective of the other ranks.
        self.run_log_dir = Path(self.trainer.log_dir) if self.trainer.logger is not None else None
        self._warn_if_bf16_is_emulated()
        if self.trainer.strategy.root_device.type == "cpu":
            keep_freed_memory()  # no page faults for memory freed by the previous step (lit_grpo.allocator)
        datamodule = getattr(self.trainer, "datamodule", None)
        prompt_format = getattr(datamodule, "prompt_format", None)
        if prompt_format is not None and prompt_format.makes_conversations and self.tokenizer.chat_template is None:
            raise ValueError(NO_CHAT_TEMPLATE.format(model=f"model.model_name_or_path {self.hparams.model_name_or_path!r}"))
        if stage == "fit" and datamodule is not None and hasattr(datamodule, "batch_size"):
            check_batch_sizes(
                datamodule.batch_size,
                self.hparams.num_generations,
                self.hparams.steps_per_generation,
                self.hparams.micro_batch_size,
            )

    def on_train_start(self) -> None:
        """``dynamic_sampling`` draws further prompt batches through the fit loop's data fetcher
        (:meth:`_next_prompt_batch`), a part of Lightning with no public interface: check before the
        first step that this Lightning has it, rather than fail after the first generation batch."""
        fetcher = getattr(self.trainer.fit_loop, "_data_fetcher", None)
        if self.hparams.dynamic_sampling and not (hasattr(fetcher, "__next__") and hasattr(fetcher, "done")):
            raise RuntimeError(
                "model.dynamic_sampling draws further prompt batches through Lightning's "
                f"`trainer.fit_loop._data_fetcher`, which Lightning {pl.__version__} does not provide "
                "(lit-grpo is tested with Lightning 2.6); set model.dynamic_sampling: false or use that Lightning"
            )

    def _warn_if_bf16_is_emulated(self) -> None:
        """bf16 on a CPU without bf16 matmul instructions is emulated, and slower than float32."""
        precision = str(getattr(self.trainer, "precision", ""))
        bf16_weights = self.policy is not None and any(p.dtype == torch.bfloat16 for p in self.policy.parameters())
        on_cpu = self.trainer.strategy.root_device.type == "cpu"
        if on_cpu and (precision.startswith("bf16") or bf16_weights) and models.cpu_multiplies_bf16() is False:
            rank_zero_warn(
                f"bf16 on this CPU (trainer.precision={precision}, bf16 weights: {bf16_weights}) is emulated: it has no "
                "avx512_bf16/amx_bf16 instructions, so bf16 matmuls run several to tens of times slower than float32; "
                "use trainer.precision: 32-true here"
            )

    def teardown(self, stage: str) -> None:
        self.scorer.close()  # stop reward worker processes and the async-reward event loop
        if self.eval_scorer is not self.scorer:
            self.eval_scorer.close()

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Keep the weights' keys beside them: a sharded checkpoint is loaded by this module's keys
        only, so :meth:`on_load_checkpoint` checks that none of the saved ones was left behind."""
        checkpoint["state_dict_keys"] = sorted(checkpoint["state_dict"])

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """With LoRA, check that the checkpoint holds this policy's whole adapter and add the frozen
        base weights, already loaded from ``model_name_or_path`` by ``configure_model``.

        A sharded (FSDP2) checkpoint has already loaded the weights this module asks for (a missing
        one fails there, naming it); here the weights it holds that this module has no place for are
        an error (a resume with other ``model.lora`` target modules would otherwise drop them)."""
        if self.hparams.lora is not None and "state_dict" in checkpoint:
            state_dict = checkpoint["state_dict"]
            checkpoint["state_dict"] = models.add_frozen_weights(state_dict, self.policy, prefix="policy.")
        if "state_dict" not in checkpoint and "state_dict_keys" in checkpoint:
            left_behind = sorted(set(checkpoint["state_dict_keys"]) - set(self.state_dict()))
            if left_behind:
                raise ValueError(
                    f"The sharded checkpoint holds {len(left_behind)} weights this module does not have "
                    f"({', '.join(left_behind[:3])}{' ...' if len(left_behind) > 3 else ''}): was it saved "
                    "with the same model.model_name_or_path and model.lora settings?"
                )

    def configure_callbacks(self) -> list[pl.Callback]:
        """Every run, from the CLI or from Python, checkpoints its random states for exact resume;
        with ``sync_ref_model`` the reference follows the policy."""
        callbacks: list[pl.Callback] = [RNGStateCheckpoint()]
        if self.hparams.validate_before_training:
            callbacks.append(ValidateBeforeTraining())
        if self.hparams.sync_ref_model:
            callbacks.append(ReferenceModelSync(self.hparams.ref_model_sync_steps, self.hparams.ref_model_mixup_alpha))
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
        if self.lr_scheduler_factory is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": self.lr_scheduler_factory(optimizer)}

    # ------------------------------------------------------------------------------------------
    # The GRPO step
    # ------------------------------------------------------------------------------------------

    def training_step(self, batch: PromptBatch, batch_idx: int) -> None:
        step_start = time.perf_counter()
        hp = self.hparams
        check_batch_sizes(len(batch.prompts), hp.num_generations, hp.steps_per_generation, hp.micro_batch_size)

        # 1-4. Sample, score, advantages, old and reference log-probs.
        scored, completions = self._generate_and_score(batch)
        rollout = scored.rollout

        # 5. num_iterations passes of steps_per_generation optimizer steps each.
        num_completions = rollout.completion_ids.size(0)
        mini_batch_size = num_completions // hp.steps_per_generation
        micro_batch_size = hp.micro_batch_size or mini_batch_size
        micro_batches_per_step = mini_batch_size // micro_batch_size
        first_order = torch.randperm(num_completions, device=self.device) if hp.steps_per_generation > 1 else None
        policy_moves = hp.num_iterations > 1 or hp.steps_per_generation > 1
        if policy_moves:  # step 4's old_logps, for the rows that are trained after the policy has moved
            start = time.perf_counter()
            first_step_rows = first_order if first_order is not None else torch.arange(num_completions, device=self.device)
            scored.old_logps = self._sampling_policy_logps(scored, later_rows=first_step_rows[mini_batch_size:])
            scored.timings["logprobs"] += time.perf_counter() - start
        train_start = time.perf_counter()
        optimizer = self.optimizers()
        scheduler = self.lr_schedulers()
        step_stats: list[dict[str, torch.Tensor]] = []
        for iteration in range(hp.num_iterations):
            # the mini-batches' rows: in order with one optimizer step per pass, else shuffled each pass
            order = first_order if iteration == 0 or first_order is None else torch.randperm(num_completions, device=self.device)
            for mini_start in range(0, num_completions, mini_batch_size):
                # Before the first optimizer step the policy is the sampling policy: its rows' own
                # forward gives their old_logps (ratio exactly 1, as without a move), kept for later.
                fills_old_logps = policy_moves and iteration == 0 and mini_start == 0
                step_scored = replace(scored, old_logps=None) if fills_old_logps else scored
                # the gradients are None here: set so after every optimizer step (below)
                for micro_start in range(mini_start, mini_start + mini_batch_size, micro_batch_size):
                    rows = torch.arange(micro_start, micro_start + micro_batch_size, device=self.device)
                    rows = order[rows] if order is not None else rows
                    scale = 1 / micro_batches_per_step if algorithm.LOSS_TYPES[hp.loss_type].accumulates_by_mean else 1.0
                    # DDP all-reduces the accumulated gradient once, after the last micro-batch
                    is_last = micro_start + micro_batch_size == mini_start + mini_batch_size
                    with use_cpu_half_attention(self.policy):  # bf16/fp16 on the CPU: attention as matrix products
                        stats, logps = self._micro_batch_backward(step_scored, rows, scale, sync=is_last)  # logps [n, c]
                    step_stats.append(stats)
                    if fills_old_logps:
                        scored.old_logps[rows, : logps.size(1)] = logps
                grad_norm = self._clip_gradients()
                optimizer.step()
                # free the gradients now (set to None), which also starts the next mini-batch's
                # accumulation from nothing: kept, they would stay allocated through the next
                # generation batch and forward pass, one float32 copy of the trainable weights
                optimizer.zero_grad()
                if scheduler is not None:
                    scheduler.step()

        scored.timings["train"] = time.perf_counter() - train_start

        # 6. Metrics: the rollout statistics are already global; the update statistics are this
        #    rank's, averaged over ranks (every rank runs the same number of micro-batches).
        metrics = self._rollout_metrics(scored)
        for key in step_stats[0]:
            values = torch.stack([stats[key] for stats in step_stats])
            value = values.sum() / hp.num_iterations / hp.steps_per_generation if key == "loss" else values.mean()
            metrics[key] = self.trainer.strategy.reduce(value, reduce_op="mean")
        if grad_norm is not None:
            metrics["grad_norm"] = grad_norm
        step_time = time.perf_counter() - step_start
        metrics["step_time"] = torch.tensor(step_time)
        for phase, seconds in scored.timings.items():
            metrics[f"time/{phase}"] = torch.tensor(seconds)
        # completion tokens sampled by all ranks per second of this step
        completion_tokens = self.trainer.strategy.reduce(rollout.completion_lengths.sum().float(), reduce_op="sum")
        metrics["tokens_per_second"] = completion_tokens / step_time
        for name, value in (scored.dynamic_sampling or {}).items():
            metrics[f"dynamic_sampling/{name}"] = value
        for name, value in metrics.items():
            self.log(name, value.float(), on_step=True, prog_bar=name == "reward", batch_size=len(batch.prompts))
        self._maybe_log_completions(batch, scored, completions)
        self._save_completions(batch, scored, completions)

    def _generate_and_score(self, batch: PromptBatch, training: bool = True) -> tuple[ScoredRollout, list]:
        """Steps 1-4 for one generation batch; ``training=False`` skips the log-prob passes."""
        hp = self.hparams
        timings = {"generate": 0.0, "rewards": 0.0}  # seconds per phase, logged as time/<phase>

        # 1-3. Sample G completions per prompt, score them, group-relative advantages; with dynamic
        #      sampling, drop groups without signal and sample more prompts to replace them.
        sampled = self._sample_and_score(batch, timings)
        dynamic_sampling_stats = None
        if training and hp.dynamic_sampling:
            sampled, dynamic_sampling_stats = self._dynamic_sampling(sampled, timings)
        rollout = sampled.rollout

        loss_mask = rollout.completion_mask
        if hp.mask_truncated_completions:
            loss_mask = loss_mask * (~rollout.is_truncated).unsqueeze(1).long()
        # dapo's (and cispo's) normaliser, as TRL 1.16 computes it: the real completion tokens of the
        # generation batch over all ranks, / world size (each rank's gradient is averaged), / the
        # steps_per_generation optimizer steps that share it, so each step takes about a token mean
        # of its own rows (not half of one with two steps per pass)
        local_tokens = loss_mask.sum().float()
        num_items_in_batch = float(self.trainer.strategy.reduce(local_tokens, reduce_op="sum")) / max(
            self.trainer.world_size, 1
        ) / hp.steps_per_generation

        # 4. Log-probs of the reference model (only with a KL penalty); those of the policy that
        #    sampled, where the update needs them, come in ``training_step``.
        start = time.perf_counter()
        ref_logps = self._reference_logps(rollout) if training and hp.beta > 0 else None
        timings["logprobs"] = time.perf_counter() - start

        scored = ScoredRollout(
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
            dynamic_sampling=dynamic_sampling_stats,
        )
        return scored, sampled.completions

    def _sample_and_score(self, batch: PromptBatch, timings: dict[str, float]) -> "SampledGroups":
        """Steps 1-3 for one batch of prompts: sample, score, group-relative advantages."""
        hp = self.hparams
        G = hp.num_generations

        # 1. Sample G completions per prompt.
        start = time.perf_counter()
        rollout = self.generate(batch.prompts)
        completion_texts, completion_ids = decode_completions(self.tokenizer, rollout)
        timings["generate"] += time.perf_counter() - start

        # 2. Score them: every reward sees one prompt, one completion and one value of each column.
        prompts = [prompt for prompt in batch.prompts for _ in range(G)]
        completions = [
            [{"role": "assistant", "content": text}] if is_conversational(prompt) else text
            for prompt, text in zip(prompts, completion_texts)
        ]
        columns = {name: [value for value in values for _ in range(G)] for name, values in batch.columns.items()}
        start = time.perf_counter()
        rewards_per_func = self.scorer(prompts, completions, completion_ids, columns).to(self.device)  # [N, K]
        timings["rewards"] += time.perf_counter() - start

        # 3. Group-relative advantages. Groups never straddle ranks, but the rewards of every rank
        #    are gathered so that batch-level statistics (scale_rewards: batch, the logged reward
        #    metrics) describe the global batch; this rank keeps its own rows.
        all_rewards_per_func = gather_rows(rewards_per_func, self.all_gather)  # [world * N, K]
        all_rewards = algorithm.combine_rewards(all_rewards_per_func, self.scorer.weights)  # [world * N]
        all_group = algorithm.group_advantages(all_rewards, G, hp.scale_rewards)
        N = rewards_per_func.size(0)
        local_rows = slice(self.global_rank * N, (self.global_rank + 1) * N)
        return SampledGroups(
            prompts=list(batch.prompts),
            rollout=rollout,
            completions=completions,
            rewards_per_func=rewards_per_func,
            rewards=all_rewards[local_rows],
            group=all_group.rows(local_rows),
        )

    def _dynamic_sampling(self, sampled: "SampledGroups", timings: dict[str, float]) -> tuple["SampledGroups", dict]:
        """DAPO's dynamic sampling (Yu et al. 2025, arXiv:2503.14476): drop the groups whose rewards are
        all equal (advantage 0, no gradient) and sample the next prompts of the data stream until this
        batch holds ``batch_size`` informative groups on every rank, or ``max_generation_rounds``.

        Every rank runs the same number of rounds (the stop decision is reduced over ranks) and keeps
        exactly ``batch_size`` groups, topped up with uninformative ones when the rounds run out, so
        every rank makes the same number of micro-batches and optimizer steps.
        """
        hp = self.hparams
        G = hp.num_generations
        wanted = len(sampled.prompts)
        parts = [sampled]
        rounds, seen, dropped = 1, len(sampled.prompts), int(sampled.informative_groups(G).logical_not().sum())
        while True:
            informative = sum(int(part.informative_groups(G).sum()) for part in parts)
            done = torch.tensor(float(informative >= wanted or rounds >= hp.max_generation_rounds), device=self.device)
            if float(self.trainer.strategy.reduce(done, reduce_op="min")) == 1.0:
                break
            batch = self._next_prompt_batch()
            exhausted = torch.tensor(float(batch is None), device=self.device)
            if float(self.trainer.strategy.reduce(exhausted, reduce_op="max")) == 1.0:
                break  # the epoch's data ran out on some rank: train on what there is
            part = self._sample_and_score(batch, timings)
            parts.append(part)
            rounds += 1
            seen += len(part.prompts)
            dropped += int(part.informative_groups(G).logical_not().sum())
        # informative groups first (in sampling order), then uninformative ones to fill the batch
        order = [(p, g) for p, part in enumerate(parts) for g in range(len(part.prompts)) if part.informative_groups(G)[g]]
        order += [(p, g) for p, part in enumerate(parts) for g in range(len(part.prompts)) if not part.informative_groups(G)[g]]
        selected = SampledGroups.concat([parts[p].group_slice(g, G) for p, g in order[:wanted]], self.tokenizer.pad_token_id)
        totals = self.trainer.strategy.reduce(torch.tensor([float(dropped), float(seen)], device=self.device), reduce_op="sum")
        stats = {"dropped_frac": totals[0] / totals[1].clamp(min=1.0), "rounds": torch.tensor(float(rounds))}
        return selected, stats

    def _next_prompt_batch(self) -> PromptBatch | None:
        """The next batch of the training stream (what the next training step would have received),
        or None at the end of the epoch. Consumed batches count in the data position saved in checkpoints."""
        fetcher = self.trainer.fit_loop._data_fetcher
        try:
            batch, _, _ = next(fetcher)
        except StopIteration:
            return None
        finally:
            self.trainer.fit_loop.epoch_loop.batch_progress.is_last_batch = fetcher.done
        return batch

    def _micro_batch_backward(
        self, scored: ScoredRollout, rows: torch.Tensor, scale: float, sync: bool
    ) -> tuple[dict, torch.Tensor]:
        """Forward, loss and backward of the micro-batch ``rows``, its loss multiplied by ``scale``
        (gradient accumulation); ``sync=False`` keeps DDP from all-reducing. Returns its statistics
        and its rows' log-probs ``[n, c]`` (detached; c up to its longest completion).

        A micro-batch above ``forward_token_budget`` goes forward and backward in length chunks of
        rows (:meth:`_backward_chunks`), so only one chunk's activations are alive at a time. Chunk k
        backpropagates the micro-batch loss with every other row's log-probs held constant: the loss
        is a sum of per-row terms (``rows_independent``), so that is exactly the part of the
        micro-batch gradient that flows through chunk k's rows, and the chunks add up to all of it.
        Shared prompts are encoded once for all chunks: the chunks' backward passes stop at the
        prompts' keys and values, and one last backward carries what they collected through the
        prompt forward. Rows whose loss terms have no gradient (:meth:`_rows_without_gradient`) go
        forward without autograd, for the statistics only, and into no chunk.
        """
        micro = scored.rollout.select(rows)
        frozen = self._rows_without_gradient(scored, rows)  # [f] positions in the micro-batch, or None
        trained = torch.arange(len(rows), device=rows.device)  # [n - f] positions with a backward
        if frozen is not None:
            trained = trained[~torch.isin(trained, frozen)]
        learner = micro.select(trained) if frozen is not None else micro  # the rows that go backward
        may_chunk = self._may_chunk_backward() or frozen is not None
        groups = self._prompt_groups_worth_sharing(self.policy, learner) if may_chunk else None
        chunks = self._backward_chunks(learner, groups)  # positions in ``learner``
        if frozen is None and len(chunks) == 1:
            loss, stats, logps = self._micro_batch_loss(scored, rows)
            self._backward(loss * scale, sync)
            stats["loss"] = (loss * scale).detach()
            return stats, logps.detach()

        prefix = leaves = None
        if groups is not None:
            learner = learner.trimmed()
            prefix = encode_prompts(self.policy, learner.prompt_ids, learner.prompt_mask, groups)
            leaves = prefix.detached()
        width = int(micro.completion_mask.any(dim=0).sum())  # the micro-batch's longest completion
        # [n, C] each row's log-probs: constants (the sampling policy's) until its chunk has run
        if scored.old_logps is not None:
            logps = scored.old_logps[rows, :width].clone()
        else:
            logps = torch.zeros(len(rows), width, device=self.device)
        entropy = torch.zeros_like(logps)
        if frozen is not None:  # their values for the loss and statistics; their gradient is 0
            with torch.no_grad():
                frozen_logps, frozen_entropy = self.completion_logps(self.policy, micro.select(frozen), with_entropy=True)
            padding = (0, width - frozen_logps.size(1))
            logps[frozen] = torch.nn.functional.pad(frozen_logps, padding)
            entropy[frozen] = torch.nn.functional.pad(frozen_entropy, padding)
        for index, chunk in enumerate(chunks):
            positions = trained[chunk]  # the chunk's rows in the micro-batch
            chunk_logps, chunk_entropy = self._chunk_logps(
                self.policy,
                learner.select(chunk).trimmed(prompts=prefix is None),
                True,
                leaves.select(chunk) if leaves is not None else None,
            )
            padding = (0, width - chunk_logps.size(1))  # [k, c] -> [k, C]
            chunk_logps = torch.nn.functional.pad(chunk_logps, padding)
            chunk_loss, _ = self._policy_loss(scored, rows, logps.index_put((positions,), chunk_logps))
            last = index == len(chunks) - 1 and prefix is None
            self._backward(chunk_loss * scale, sync and last)
            logps[positions] = chunk_logps.detach()
            entropy[positions] = torch.nn.functional.pad(chunk_entropy, padding).detach()
        if prefix is not None:
            # the collected gradient already carries the loss scale (and a GradScaler's, divided out here)
            self._backward(prefix.gradient_surrogate(leaves) / self._grad_scaler_scale(), sync)
        with torch.no_grad():  # the loss and statistics of the whole micro-batch, as one pass reports them
            loss, stats = self._policy_loss(scored, rows, logps, entropy)
        stats["loss"] = (loss * scale).detach()
        return stats, logps

    def _rows_without_gradient(self, scored: ScoredRollout, rows: torch.Tensor) -> torch.Tensor | None:
        """Positions in the micro-batch ``rows`` that need no backward pass, or None.

        ``skip_zero_gradient_rows``: rows whose loss terms have exactly zero gradient
        (:func:`lit_grpo.algorithm.rows_without_gradient`: advantage 0 with ``beta = 0``, or no token
        that counts), where their backward would cost more than the extra forward they then get
        (``FORWARD_OVERHEAD_TOKENS``; a backward costs about two forwards). Not with
        ``top_entropy_quantile < 1`` (:meth:`_skips_rows_without_gradient`). One row always goes
        backward, so the optimizer steps on a zero gradient where no row has any (AdamW's momentum
        and weight decay still move the weights, as after training every row) and DDP all-reduces
        on every rank. Sharded (FSDP2) ranks leave out the same number of rows, so they keep running
        as many forwards and backwards as each other.
        """
        hp = self.hparams
        if not self._skips_rows_without_gradient():
            return None
        inert = algorithm.rows_without_gradient(scored.group.advantages[rows], scored.loss_mask[rows], hp.loss_type, hp.beta)
        positions = inert.nonzero().squeeze(1)[: len(rows) - 1]  # [f]
        left_out = rows[positions]
        backward_tokens = 2 * int(scored.rollout.prompt_mask[left_out].sum() + scored.rollout.completion_mask[left_out].sum())
        count = len(positions) if backward_tokens > FORWARD_OVERHEAD_TOKENS else 0
        count = agreed_over_sharded_ranks(count, self.policy, "min")
        return positions[:count] if count else None

    def _skips_rows_without_gradient(self) -> bool:
        """``skip_zero_gradient_rows``, unless ``top_entropy_quantile < 1``, whose threshold is taken
        over every row's entropy in the loss."""
        return self.hparams.skip_zero_gradient_rows and self.hparams.top_entropy_quantile >= 1.0

    def _may_chunk_backward(self) -> bool:
        """Whether the settings let a micro-batch go backward in chunks: ``group_by_length`` with a
        ``forward_token_budget``, and a loss that is a sum of per-row terms (``rows_independent``; not
        ``top_entropy_quantile``, whose threshold needs every row)."""
        hp = self.hparams
        if not hp.group_by_length or hp.forward_token_budget is None or hp.top_entropy_quantile < 1.0:
            return False
        return algorithm.LOSS_TYPES[hp.loss_type].rows_independent

    def _backward_chunks(self, micro: Rollout, groups: PromptGroups | None) -> list[torch.Tensor]:
        """The row chunks of a micro-batch for separate forward and backward passes: length chunks
        within ``forward_token_budget`` where the micro-batch's padded tokens exceed it (rows x
        (longest prompt + longest completion), or with shared prompts (``groups``) the distinct
        prompts' tokens plus rows x longest completion), else one chunk."""
        every_row = [torch.arange(micro.completion_ids.size(0), device=micro.completion_ids.device)]
        if not self._may_chunk_backward():
            return every_row
        trimmed = micro.trimmed()
        if groups is None:
            tokens, prompt_mask = trimmed.prompt_ids.numel() + trimmed.completion_ids.numel(), micro.prompt_mask
        else:  # a shared prompt costs nothing per row
            tokens = groups.first_row.numel() * trimmed.prompt_ids.size(1) + trimmed.completion_ids.numel()
            prompt_mask = micro.prompt_mask[:, :0]
        if tokens <= self.hparams.forward_token_budget:
            chunks = every_row
        else:
            chunks = length_chunks(prompt_mask, micro.completion_mask, self.hparams.forward_token_budget)
        return split_chunks(chunks, agreed_over_sharded_ranks(len(chunks), self.policy, "max"))

    def _grad_scaler_scale(self) -> float:
        """The loss scale of a ``16-mixed`` GradScaler (1 without one)."""
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        return float(scaler.get_scale()) if scaler is not None else 1.0

    def _backward(self, loss: torch.Tensor, sync: bool) -> None:
        """``manual_backward``; with ``sync=False`` DDP accumulates the gradient without all-reducing."""
        block_sync = getattr(self.trainer.strategy, "block_backward_sync", None)  # DDP only
        with nullcontext() if sync or block_sync is None else block_sync():
            self.manual_backward(loss)

    def _micro_batch_loss(self, scored: ScoredRollout, rows: torch.Tensor) -> tuple[torch.Tensor, dict, torch.Tensor]:
        """The loss of the micro-batch ``rows`` from one pass (all its chunks' graphs kept), its
        statistics and its log-probs ``[n, C]``."""
        micro = scored.rollout.select(rows)
        logps, entropy = self.completion_logps(self.policy, micro, with_entropy=True)  # [n, C] each
        return *self._policy_loss(scored, rows, logps, entropy), logps

    def _policy_loss(
        self, scored: ScoredRollout, rows: torch.Tensor, logps: torch.Tensor, entropy: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, dict]:
        """The GRPO loss of the rows ``rows`` given their log-probs ``[n, C]`` (and entropy, for the
        statistics and ``top_entropy_quantile``; None skips both)."""
        hp = self.hparams
        micro = scored.rollout.select(rows)
        width = logps.size(1)
        loss_mask = scored.loss_mask[rows, :width]
        old_logps = scored.old_logps[rows, :width] if scored.old_logps is not None else logps.detach()
        ref_logps = scored.ref_logps[rows, :width] if scored.ref_logps is not None else None
        policy_mask = None
        if hp.top_entropy_quantile < 1.0:  # the threshold is over this micro-batch's tokens on all ranks
            all_entropies = gather_real_values(entropy.detach(), loss_mask, self.all_gather)
            policy_mask = algorithm.high_entropy_mask(entropy, loss_mask, hp.top_entropy_quantile, all_entropies)
        out = algorithm.grpo_loss(
            logps,
            old_logps,
            scored.group.advantages[rows],
            loss_mask,
            loss_type=hp.loss_type,
            epsilon_low=hp.epsilon,
            epsilon_high=self.epsilon_high,
            beta=hp.beta,
            ref_logps=ref_logps,
            importance_sampling_level=hp.importance_sampling_level,
            max_completion_length=hp.max_completion_length,
            num_items_in_batch=scored.num_items_in_batch,
            delta=hp.delta,
            sapo_temperature_pos=hp.sapo_temperature_pos,
            sapo_temperature_neg=hp.sapo_temperature_neg,
            kl_estimator=hp.kl_estimator,
            policy_mask=policy_mask,
        )
        if entropy is None:
            return out.loss, {}
        stats = {
            "entropy": algorithm.masked_mean(entropy, micro.completion_mask[:, :width]),
            "clip_ratio/low_mean": out.clip.low,
            "clip_ratio/high_mean": out.clip.high,
            "clip_ratio/region_mean": out.clip.region,
        }
        if out.kl is not None:
            stats["kl"] = out.kl
        return out.loss, stats

    # ------------------------------------------------------------------------------------------
    # Generation and log-probs
    # ------------------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, prompts: list) -> Rollout:
        """Sample ``num_generations`` completions for each prompt (strings or chat messages)."""
        texts = render_prompts(self.tokenizer, prompts, self.hparams.chat_template_kwargs)
        with gathered_for_generation(self.policy):  # FSDP2: gather the weights once, not per token
            return generate_completions(
                self.policy,
                self.tokenizer,
                texts,
                self.hparams.num_generations,
                self.generation_config,
                self.hparams.max_prompt_length,
                backend=self.hparams.generation_backend,
            )

    def completion_logps(
        self, model: torch.nn.Module, rollout: Rollout, with_entropy: bool = False, group_by_length: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs ``[n, C]`` of the completion tokens (and their entropy) at the sampling temperature.

        With ``share_prompt_forward`` each distinct prompt goes through the model once and its rows'
        completions attend to its KV cache. With ``group_by_length`` (the setting, unless the
        argument turns it off for rows that are already a length chunk) the rows go through the model
        in chunks of similar length, each trimmed to its longest sequence, and come back in their
        original order, padded with 0 to the longest completion ``C`` of the rollout. Either way the
        values are those of one forward over all rows, without the cost of their padding or of
        repeated prompts. Under FSDP2 the ranks agree on both choices (the same number of forwards).
        """
        with use_cpu_half_attention(model):  # bf16/fp16 on the CPU: attention as matrix products
            return self._completion_logps(model, rollout, with_entropy, group_by_length)

    def _completion_logps(
        self, model: torch.nn.Module, rollout: Rollout, with_entropy: bool, group_by_length: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        hp = self.hparams
        prefix = None
        groups = self._prompt_groups_worth_sharing(model, rollout)
        if groups is not None:
            rollout = rollout.trimmed()  # the prompt columns are fixed here; chunks trim only completions
            prefix = encode_prompts(model, rollout.prompt_ids, rollout.prompt_mask, groups)
        if hp.group_by_length and group_by_length:
            # a shared prompt costs nothing per row: chunk by completion length alone
            prompt_mask = rollout.prompt_mask if prefix is None else rollout.prompt_mask[:, :0]
            chunks = length_chunks(prompt_mask, rollout.completion_mask, hp.forward_token_budget)
            chunks = split_chunks(chunks, agreed_over_sharded_ranks(len(chunks), model, "max"))
        else:
            chunks = [torch.arange(rollout.completion_ids.size(0), device=rollout.completion_ids.device)]
        if len(chunks) == 1:
            return self._chunk_logps(model, rollout.trimmed(prompts=prefix is None), with_entropy, prefix)
        width = int(rollout.completion_mask.any(dim=0).sum())
        outputs = [
            self._chunk_logps(
                model,
                rollout.select(rows).trimmed(prompts=prefix is None),
                with_entropy,
                prefix.select(rows) if prefix is not None else None,
            )
            for rows in chunks
        ]
        inverse = torch.argsort(torch.cat(chunks))  # position of each original row in the chunk order

        def reassemble(parts: list[torch.Tensor]) -> torch.Tensor:  # [n_chunk, c_chunk] each -> [n, C]
            padded = [torch.nn.functional.pad(part, (0, width - part.size(1))) for part in parts]
            return torch.cat(padded)[inverse]

        logps = reassemble([logps for logps, _ in outputs])
        entropy = reassemble([entropy for _, entropy in outputs]) if with_entropy else None
        return logps, entropy

    def _prompt_groups_worth_sharing(self, model: torch.nn.Module, rollout: Rollout) -> PromptGroups | None:
        """The rows' distinct prompts when ``share_prompt_forward`` applies to this model and saves
        more prompt tokens than the extra forward costs (``FORWARD_OVERHEAD_TOKENS``); else None."""
        if not self.hparams.share_prompt_forward:
            return None
        reason = shared_prompt_unsupported(model)
        if reason is not None:
            if reason not in self._prompt_sharing_notes:
                self._prompt_sharing_notes.add(reason)
                rank_zero_info(f"model.share_prompt_forward: prompts are encoded with every completion ({reason})")
            return None
        prompt_width = int(rollout.prompt_mask.any(dim=0).sum())  # the trimmed prompt
        groups = distinct_prompts(rollout.prompt_ids, rollout.prompt_mask)
        worth_it = groups.saved_tokens(prompt_width) > FORWARD_OVERHEAD_TOKENS
        # the prompt forward is one more forward: sharded ranks share only if every rank does
        return groups if agreed_over_sharded_ranks(int(worth_it), model, "min") else None

    def _chunk_logps(
        self, model: torch.nn.Module, rollout: Rollout, with_entropy: bool, prefix: PromptPrefix | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One forward of a trimmed rollout (after its shared prompt's forward, given ``prefix``).
        Only the ``C`` positions that predict completion tokens get logits (``logits_to_keep``);
        positions skip left padding exactly as in generation."""
        if prefix is not None:
            logits = completion_logits(model, prefix, rollout.completion_ids, rollout.completion_mask)  # [n, C, V]
        else:
            # the last completion token predicts nothing that is scored: it is not part of the input
            input_ids = torch.cat([rollout.prompt_ids, rollout.completion_ids[:, :-1]], dim=1)  # [n, P + C - 1]
            attention_mask = torch.cat([rollout.prompt_mask, rollout.completion_mask[:, :-1]], dim=1)
            logits = model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids_from_mask(attention_mask),
                logits_to_keep=rollout.completion_ids.size(1),
                use_cache=False,
            ).logits  # [n, C, V]: the last C positions, position P - 1 + t predicts completion token t
        temperature = self.hparams.temperature
        logps = algorithm.selective_log_softmax(logits, rollout.completion_ids, temperature)
        entropy = algorithm.entropy_from_logits(logits, temperature) if with_entropy else None
        return logps, entropy

    def _sampling_policy_logps(self, scored: ScoredRollout, later_rows: torch.Tensor) -> torch.Tensor:
        """``old_logps [N, C]``: the sampling policy's log-probs of ``later_rows`` (the rows trained
        after the first optimizer step), computed now without gradient; 0 for the other rows until
        the first optimizer step's forward fills them (``training_step``).

        With ``skip_zero_gradient_rows``, rows whose loss terms have no gradient
        (:func:`lit_grpo.algorithm.rows_without_gradient`: advantage 0 with ``beta = 0``, or no token
        that counts) get no pass and keep 0: their old log-probs only enter a ratio that is multiplied
        by a zero advantage or a zero mask, and the clip fractions count no token of theirs, so the
        update and every statistic are the same whatever the value. Sharded (FSDP2) ranks compute as
        many rows as the rank that needs most, so they run as many forwards as each other.
        """
        old_logps = torch.zeros(scored.rollout.completion_ids.shape, device=scored.rollout.completion_ids.device)
        needed = later_rows
        if self._skips_rows_without_gradient():
            hp = self.hparams
            inert = algorithm.rows_without_gradient(
                scored.group.advantages[later_rows], scored.loss_mask[later_rows], hp.loss_type, hp.beta
            )  # [n]
            count = agreed_over_sharded_ranks(int((~inert).sum()), self.policy, "max")  # every rank has n rows
            needed = torch.cat([later_rows[~inert], later_rows[inert]])[:count]
        if len(needed):
            old_logps[needed] = self._logps_no_grad(self.policy, scored.rollout.select(needed))
        return old_logps

    @torch.no_grad()
    def _logps_no_grad(self, model: torch.nn.Module, rollout: Rollout) -> torch.Tensor:
        """Log-probs ``[N, C]`` without gradient, padded back to the full width, in forwards of
        ``logprob_micro_batch_size`` rows (default ``micro_batch_size``; no backward, so it can be larger)."""
        hp = self.hparams
        size = hp.logprob_micro_batch_size or hp.micro_batch_size or rollout.completion_ids.size(0)
        full = torch.zeros(rollout.completion_ids.shape, device=rollout.completion_ids.device)
        for start in range(0, rollout.completion_ids.size(0), size):
            rows = torch.arange(start, min(start + size, rollout.completion_ids.size(0)), device=full.device)
            logps, _ = self.completion_logps(model, rollout.select(rows))
            full[rows, : logps.size(1)] = logps
        return full

    def _reference_logps(self, rollout: Rollout) -> torch.Tensor:
        """Log-probs ``[N, C]`` of the KL reference: the frozen reference model, or with LoRA the
        policy with its adapter disabled (no second copy of the weights)."""
        with models.reference_model(self.policy, self.ref_model) as reference:
            return self._logps_no_grad(reference, rollout)

    def _clip_gradients(self) -> torch.Tensor | None:
        if not self.hparams.max_grad_norm:  # None or 0: no clipping, as in Lightning and TRL
            return None
        params = [p for p in self.parameters() if p.grad is not None]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, self.hparams.max_grad_norm)
        # FSDP2: the norm of sharded (DTensor) gradients is itself a DTensor; log its full value
        return grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm

    # ------------------------------------------------------------------------------------------
    # Validation: sample G completions per prompt and report their mean reward
    # ------------------------------------------------------------------------------------------

    def validation_step(self, batch: PromptBatch, batch_idx: int) -> None:
        """Sample k completions per validation prompt, score them with the evaluation rewards, and
        accumulate ``val/reward``, ``val/mean@k``, ``val/pass@k`` and (binary rewards) ``val/maj@k``."""
        hp = self.hparams
        k = hp.num_generations_eval or hp.num_generations
        num_prompts = len(batch.prompts)
        with torch.no_grad(), gathered_for_generation(self.policy):
            rollout = generate_completions(
                self.policy,
                self.tokenizer,
                render_prompts(self.tokenizer, batch.prompts, hp.chat_template_kwargs),
                k,
                self.eval_generation_config,
                hp.max_prompt_length,
                backend=hp.generation_backend,
            )
        texts, completion_ids = decode_completions(self.tokenizer, rollout)
        prompts = [prompt for prompt in batch.prompts for _ in range(k)]
        completions = [
            [{"role": "assistant", "content": text}] if is_conversational(prompt) else text
            for prompt, text in zip(prompts, texts)
        ]
        columns = {name: [value for value in values for _ in range(k)] for name, values in batch.columns.items()}
        rewards_per_func = self.eval_scorer(prompts, completions, completion_ids, columns).to(self.device)
        rewards = algorithm.combine_rewards(rewards_per_func, self.eval_scorer.weights).view(num_prompts, k)  # [B, k]

        valid = ~torch.isnan(rewards)
        correct = valid & (rewards >= hp.eval_success_threshold)  # [B, k]
        metrics = self.val_metrics
        metrics["reward"].update(rewards[valid])
        per_prompt_mean = rewards.nanmean(dim=1)  # [B], NaN for a prompt no reward applied to
        metrics["mean"].update(per_prompt_mean[~torch.isnan(per_prompt_mean)])
        for pass_k in self.eval_pass_k:
            metrics[f"pass{pass_k}"].update(evaluation.pass_at_k(correct.sum(dim=1), k, pass_k).to(self.device))
        # maj@k only where the reward is binary on every rank's batch
        binary = torch.tensor(float(bool(((rewards[valid] == 0) | (rewards[valid] == 1)).all())), device=self.device)
        if float(self.trainer.strategy.reduce(binary, reduce_op="min")) == 1.0:
            answers = [[" ".join(text.split()) for text in texts[b * k : (b + 1) * k]] for b in range(num_prompts)]
            metrics["maj"].update(evaluation.majority_correct(answers, correct.cpu()).to(self.device))
        log = dict(on_step=False, on_epoch=True, batch_size=num_prompts)
        self.log("val/reward", metrics["reward"], **log)
        self.log(f"val/mean@{k}", metrics["mean"], **log)
        for pass_k in self.eval_pass_k:
            self.log(f"val/pass@{pass_k}", metrics[f"pass{pass_k}"], **log)
        if metrics["maj"].weight > 0:
            self.log(f"val/maj@{k}", metrics["maj"], **log)

    # ------------------------------------------------------------------------------------------
    # Logging
    # ------------------------------------------------------------------------------------------

    def _rollout_metrics(self, scored: ScoredRollout) -> dict[str, torch.Tensor]:
        """Statistics of the generation batch over all ranks (identical on every rank)."""
        per_completion = torch.stack(
            [
                scored.rewards,
                scored.group.group_std,
                scored.group.zero_std.float(),
                scored.rollout.completion_lengths.float(),
                scored.rollout.is_truncated.float(),
            ],
            dim=1,
        )  # [N, 5]
        rewards, group_std, zero_std, lengths, is_truncated = gather_rows(per_completion, self.all_gather).unbind(1)
        rewards_per_func = gather_rows(scored.rewards_per_func, self.all_gather)  # [world * N, K]
        metrics = {
            "reward": rewards.nanmean(),
            "reward_std": group_std.mean(),
            "frac_reward_zero_std": zero_std.mean(),
            "completions/mean_length": lengths.mean(),
            "completions/min_length": lengths.min(),
            "completions/max_length": lengths.max(),
            "completions/clipped_ratio": is_truncated.mean(),
        }
        for k, name in enumerate(self.scorer.names):
            values = rewards_per_func[:, k]
            valid = values[~torch.isnan(values)]
            metrics[f"rewards/{name}/mean"] = valid.mean() if valid.numel() else torch.tensor(float("nan"))
            metrics[f"rewards/{name}/std"] = valid.std() if valid.numel() > 1 else torch.tensor(0.0)
            errors = torch.tensor(float(self.scorer.last_error_counts.get(name, 0)), device=self.device)
            metrics[f"rewards/{name}/errors"] = self.trainer.strategy.reduce(errors, reduce_op="sum")
        return metrics

    def _save_completions(self, batch: PromptBatch, scored: ScoredRollout, completions: list) -> None:
        """Every ``trainer.log_every_n_steps`` steps: all ranks' completions to ``completions.jsonl``
        in the run's log directory (rank 0 writes), and the first rows to the console if asked."""
        hp = self.hparams
        step = batch_idx_of(self)
        if not (hp.save_completions or hp.print_completions) or step % max(self.trainer.log_every_n_steps, 1):
            return
        records = completion_records(
            step,
            [p for p in scored.prompts for _ in range(hp.num_generations)],
            completions,
            self.scorer.names,
            scored.rewards_per_func.tolist(),
            scored.rewards.tolist(),
            scored.group.advantages.tolist(),
        )
        records = _gather_objects(records)
        if not self.trainer.is_global_zero:  # no collective below this line: rank 0 only
            return
        if hp.save_completions and self.run_log_dir is not None:  # without a logger there is nowhere to write
            append_records(self.run_log_dir / COMPLETIONS_FILE, records)
        if hp.print_completions:
            print(f"completions at step {step}:\n{format_table(records[: hp.print_completions])}", flush=True)

    def _maybe_log_completions(self, batch: PromptBatch, scored: ScoredRollout, completions: list) -> None:
        every = self.hparams.log_completions_every_n_steps
        experiment = getattr(self.logger, "experiment", None)
        if not every or batch_idx_of(self) % every != 0 or not hasattr(experiment, "add_text"):
            return
        prompts = [p for p in scored.prompts for _ in range(self.hparams.num_generations)]
        header = ["prompt", "completion", *self.scorer.names, "reward", "advantage"]
        rows = []
        for i in range(min(self.hparams.num_completions_to_log, len(completions))):
            scores = [f"{float(v):.3f}" for v in scored.rewards_per_func[i]]
            rows.append(
                [_cell(prompts[i]), _cell(completions[i]), *scores,
                 f"{float(scored.rewards[i]):.3f}", f"{float(scored.group.advantages[i]):.3f}"]
            )
        table = "\n".join(
            ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            + ["| " + " | ".join(row) + " |" for row in rows]
        )
        # the step of this batch's scalars (Lightning logs them at the batch counter)
        experiment.add_text("completions", table, global_step=batch_idx_of(self))


# ----------------------------------------------------------------------------------------------
# Helpers: loading and validation with errors that name the offending setting
# ----------------------------------------------------------------------------------------------


def eval_generation_config(training: GenerationConfig, temperature: float | None) -> GenerationConfig:
    """Validation's sampling: the training settings at ``temperature``; 0 decodes greedily."""
    config = copy.deepcopy(training)
    if temperature is None:
        return config
    if temperature == 0:
        return GenerationConfig(
            do_sample=False,
            max_new_tokens=training.max_new_tokens,
            repetition_penalty=training.repetition_penalty,
            pad_token_id=training.pad_token_id,
            eos_token_id=training.eos_token_id,
            bos_token_id=training.bos_token_id,
        )
    config.temperature = temperature
    return config


def _gather_objects(items: list) -> list:
    """Concatenate a per-rank list over all ranks, in rank order (the list itself on one process)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return items
    gathered: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, items)
    return [item for part in gathered for item in part]


def batch_idx_of(module: pl.LightningModule) -> int:
    """Number of training steps (generation batches) completed so far."""
    return module.trainer.fit_loop.epoch_loop._batches_that_stepped


def _cell(value) -> str:
    return as_text(value).replace("|", "\\|").replace("\n", "⏎")


def _check_settings(hp) -> None:
    """Reject settings that cannot work, naming the config key, before anything is loaded."""
    if hp.num_generations < 2:
        raise ValueError(
            f"model.num_generations must be at least 2 (got {hp.num_generations}): GRPO's advantage "
            "is a completion's reward relative to the other completions of its group"
        )
    positive = ["max_completion_length", "num_iterations", "steps_per_generation", "max_generation_rounds"]
    for key in positive:
        if hp[key] < 1:
            raise ValueError(f"model.{key} must be at least 1, got {hp[key]}")
    for key in ("micro_batch_size", "logprob_micro_batch_size", "forward_token_budget"):
        if hp[key] is not None and hp[key] < 1:
            raise ValueError(f"model.{key} must be at least 1 or null, got {hp[key]}")
    if hp.generation_backend not in GENERATION_BACKENDS:
        raise ValueError(f"model.generation_backend must be one of {GENERATION_BACKENDS}, got {hp.generation_backend!r}")
    if hp.loss_type not in algorithm.LOSS_TYPES:
        raise ValueError(f"model.loss_type must be one of {sorted(algorithm.LOSS_TYPES)}, got {hp.loss_type!r}")
    if hp.kl_estimator not in algorithm.KL_ESTIMATORS:
        raise ValueError(f"model.kl_estimator must be one of {algorithm.KL_ESTIMATORS}, got {hp.kl_estimator!r}")
    if not 0.0 < hp.top_entropy_quantile <= 1.0:
        raise ValueError(f"model.top_entropy_quantile must be in (0, 1], got {hp.top_entropy_quantile}")
    epsilon_high = hp.epsilon if hp.epsilon_high is None else hp.epsilon_high
    if hp.delta is not None and hp.delta <= 1 + epsilon_high:
        raise ValueError(f"model.delta must be above 1 + epsilon_high = {1 + epsilon_high}, got {hp.delta}")
    if hp.sync_ref_model:
        ReferenceModelSync(hp.ref_model_sync_steps, hp.ref_model_mixup_alpha)  # checks both values
    if hp.sync_ref_model and (hp.beta == 0 or hp.lora is not None):
        raise ValueError(
            "model.sync_ref_model needs a separate reference model: model.beta > 0 and no model.lora "
            f"(got beta={hp.beta}, lora={hp.lora}); with LoRA the reference is the base model itself"
        )
    if hp.loss_type == "cispo" and epsilon_high < 1.0:
        raise ValueError(
            f"model.loss_type cispo uses model.epsilon_high as the upper bound of the importance weight "
            f"(e.g. 5.0, as in TRL), not as 1 + epsilon_high; got {epsilon_high}, which would scale every "
            "update down"
        )
    if hp.sapo_temperature_pos <= 0 or hp.sapo_temperature_neg <= 0:
        raise ValueError(
            "model.sapo_temperature_pos and model.sapo_temperature_neg must be > 0, got "
            f"{hp.sapo_temperature_pos} and {hp.sapo_temperature_neg}"
        )
    if hp.scale_rewards not in algorithm.SCALE_REWARDS:
        raise ValueError(f"model.scale_rewards must be one of {algorithm.SCALE_REWARDS}, got {hp.scale_rewards!r}")
    if hp.importance_sampling_level not in algorithm.IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(
            f"model.importance_sampling_level must be one of {algorithm.IMPORTANCE_SAMPLING_LEVELS}, "
            f"got {hp.importance_sampling_level!r}"
        )
    if hp.temperature_eval is not None and hp.temperature_eval < 0:
        raise ValueError(f"model.temperature_eval must be >= 0 (0 = greedy) or null, got {hp.temperature_eval}")
    n_eval = hp.num_generations_eval or hp.num_generations
    if hp.num_generations_eval is not None and hp.num_generations_eval < 1:
        raise ValueError(f"model.num_generations_eval must be at least 1, got {hp.num_generations_eval}")
    for pass_k in hp.eval_pass_k or []:
        if not 1 <= pass_k <= n_eval:
            raise ValueError(f"model.eval_pass_k value {pass_k} must be between 1 and num_generations_eval = {n_eval}")
    if hp.temperature <= 0:
        raise ValueError(f"model.temperature must be > 0 (sampling), got {hp.temperature}")
    if hp.beta < 0:
        raise ValueError(f"model.beta must be >= 0, got {hp.beta}")


def check_batch_sizes(
    num_prompts: int, num_generations: int, steps_per_generation: int, micro_batch_size: int | None
) -> None:
    """The generation batch must split evenly into optimizer steps and micro-batches."""
    num_completions = num_prompts * num_generations
    if num_completions % steps_per_generation:
        raise ValueError(
            f"data.batch_size * model.num_generations = {num_prompts} * {num_generations} = {num_completions} "
            f"completions do not split into model.steps_per_generation = {steps_per_generation} equal mini-batches"
        )
    mini_batch = num_completions // steps_per_generation
    if micro_batch_size is not None and mini_batch % micro_batch_size:
        raise ValueError(
            f"a mini-batch of {mini_batch} completions (data.batch_size * model.num_generations / "
            f"model.steps_per_generation) does not split into model.micro_batch_size = {micro_batch_size}"
        )


def _looks_like_local_path(path: str) -> bool:
    """Hub ids are ``name`` or ``org/name``; anything else that does not exist is a missing directory."""
    return path.startswith((".", "/", "~")) or path.count("/") > 1 or (os.sep != "/" and os.sep in path)


def _check_model_path(path: str) -> None:
    if not os.path.exists(os.path.expanduser(path)) and _looks_like_local_path(path):
        raise FileNotFoundError(
            f"model.model_name_or_path {path!r} does not exist. Give a local directory written by "
            "save_pretrained (e.g. one made by `lit-grpo init-tiny DIR`) or a Hugging Face hub id."
        )


def load_tokenizer(path: str):
    """The tokenizer, with a pad token (EOS when it has none, with a warning)."""
    _check_model_path(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(os.path.expanduser(path))
    except OSError as exc:
        raise OSError(
            f"Could not load the tokenizer of model.model_name_or_path {path!r}: {exc}"
        ) from exc
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"The tokenizer of {path!r} has neither a pad token nor an EOS token")
        warnings.warn(
            f"The tokenizer of {path!r} has no pad token; using its EOS token {tokenizer.eos_token!r} for padding",
            stacklevel=2,
        )
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


__all__ = ["GRPOModule", "ScoredRollout", "check_batch_sizes", "load_tokenizer"]
