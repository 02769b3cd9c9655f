"""GRPO as a LightningModule: ``training_step`` reads as the numbered steps of the algorithm.

One call of ``training_step`` handles one *generation batch* (B prompts from the data module):

1. sample G completions per prompt with the current policy;
2. score every completion with the configured reward functions;
3. turn rewards into group-relative advantages;
4. compute, without gradient, the log-probs the update needs besides the policy's own: the
   sampling policy's (``old_logps``, only when the policy changes between sampling and an update,
   i.e. ``num_iterations > 1`` or ``steps_per_generation > 1``) and the reference model's (only when
   ``beta > 0``);
5. run ``num_iterations`` passes over the generation batch; each pass is ``steps_per_generation``
   optimizer steps on mini-batches of ``B * G / steps_per_generation`` completions, and each
   mini-batch is processed in micro-batches of ``micro_batch_size`` completions (gradient
   accumulation) to bound memory;
6. log the metrics (TRL's names) and, every few steps, a table of completions.

So one ``training_step`` makes ``num_iterations * steps_per_generation`` optimizer steps and
``trainer.max_steps`` counts optimizer steps, as in TRL. Optimization is manual
(``automatic_optimization = False``) because one batch drives several optimizer steps.
"""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from lit_grpo import algorithm
from lit_grpo.data import PromptBatch
from lit_grpo.generation import (
    Rollout,
    decode_completions,
    generate_completions,
    is_conversational,
    position_ids_from_mask,
    render_prompts,
)
from lit_grpo.scoring import RewardScorer, RewardSpec



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
    old_logps: torch.Tensor | None  # [N, C] sampling policy, None when it equals the current policy
    ref_logps: torch.Tensor | None  # [N, C] reference model, None when beta == 0
    num_items_in_batch: float  # real completion tokens of the generation batch, over all ranks, / world size


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
        loss_type: ``grpo`` | ``bnpo`` | ``dr_grpo`` | ``dapo`` (see ``lit_grpo.algorithm``).
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
        model_init_kwargs: dict[str, Any] | None = None,
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

        # Rewards are resolved now, so a misspelt name fails before any model is loaded.
        self.scorer = RewardScorer(rewards)
        self.tokenizer = load_tokenizer(model_name_or_path)
        self.policy: torch.nn.Module | None = None
        self.ref_model: torch.nn.Module | None = None

    # ------------------------------------------------------------------------------------------
    # Setup
    # ------------------------------------------------------------------------------------------

    def configure_model(self) -> None:
        """Load the policy, and the frozen reference model only when ``beta > 0``."""
        if self.policy is not None:
            return
        init_kwargs = _model_init_kwargs(self.hparams.model_init_kwargs)
        self.policy = load_causal_lm(self.hparams.model_name_or_path, init_kwargs).train()
        if self.hparams.beta > 0:
            self.ref_model = load_causal_lm(self.hparams.model_name_or_path, init_kwargs)
            self.ref_model.requires_grad_(False).eval()
        self.generation_config = GenerationConfig(
            do_sample=True,
            max_new_tokens=self.hparams.max_completion_length,
            temperature=self.hparams.temperature,
            top_p=self.hparams.top_p,
            top_k=self.hparams.top_k,
            min_p=self.hparams.min_p,
            repetition_penalty=self.hparams.repetition_penalty,
            pad_token_id=self.tokenizer.pad_token_id,
            eos_token_id=self.tokenizer.eos_token_id,
            bos_token_id=self.tokenizer.bos_token_id,
        )

    def setup(self, stage: str) -> None:
        datamodule = getattr(self.trainer, "datamodule", None)
        if stage == "fit" and datamodule is not None and hasattr(datamodule, "batch_size"):
            check_batch_sizes(
                datamodule.batch_size,
                self.hparams.num_generations,
                self.hparams.steps_per_generation,
                self.hparams.micro_batch_size,
            )

    def teardown(self, stage: str) -> None:
        self.scorer.close()  # stop reward worker processes and the async-reward event loop

    def configure_optimizers(self):
        """The configured optimizer (AdamW at lr 1e-6 by default) over the trainable parameters.

        Built here, after ``configure_model`` has loaded the policy, rather than by LightningCLI at
        instantiation, when the policy does not exist yet.
        """
        params = [p for p in self.parameters() if p.requires_grad]
        optimizer = self.optimizer_factory(params) if self.optimizer_factory else torch.optim.AdamW(params, lr=1e-6)
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
        optimizer = self.optimizers()
        scheduler = self.lr_schedulers()
        num_completions = rollout.completion_ids.size(0)
        mini_batch_size = num_completions // hp.steps_per_generation
        micro_batch_size = hp.micro_batch_size or mini_batch_size
        micro_batches_per_step = mini_batch_size // micro_batch_size
        step_stats: list[dict[str, torch.Tensor]] = []
        for _ in range(hp.num_iterations):
            order = torch.randperm(num_completions, device=self.device) if hp.steps_per_generation > 1 else None
            for mini_start in range(0, num_completions, mini_batch_size):
                optimizer.zero_grad()
                for micro_start in range(mini_start, mini_start + mini_batch_size, micro_batch_size):
                    rows = torch.arange(micro_start, micro_start + micro_batch_size, device=self.device)
                    rows = order[rows] if order is not None else rows
                    loss, stats = self._micro_batch_loss(scored, rows)
                    if hp.loss_type in algorithm.ACCUMULATES_BY_MEAN:
                        loss = loss / micro_batches_per_step
                    self.manual_backward(loss)
                    stats["loss"] = loss.detach()
                    step_stats.append(stats)
                grad_norm = self._clip_gradients()
                optimizer.step()
                if scheduler is not None:
                    scheduler.step()

        # 6. Metrics.
        metrics = self._rollout_metrics(scored)
        for key in step_stats[0]:
            values = torch.stack([stats[key] for stats in step_stats])
            metrics[key] = values.sum() / hp.num_iterations / hp.steps_per_generation if key == "loss" else values.mean()
        if grad_norm is not None:
            metrics["grad_norm"] = grad_norm
        metrics["step_time"] = torch.tensor(time.perf_counter() - step_start)
        for name, value in metrics.items():
            self.log(name, value.float(), on_step=True, prog_bar=name == "reward", batch_size=len(batch.prompts))
        self._maybe_log_completions(batch, scored, completions)

    def _generate_and_score(self, batch: PromptBatch, training: bool = True) -> tuple[ScoredRollout, list]:
        """Steps 1-4 for one generation batch; ``training=False`` skips the log-prob passes."""
        hp = self.hparams
        G = hp.num_generations

        # 1. Sample G completions per prompt.
        rollout = self.generate(batch.prompts)
        completion_texts, completion_ids = decode_completions(self.tokenizer, rollout)

        # 2. Score them: every reward sees one prompt, one completion and one value of each column.
        prompts = [prompt for prompt in batch.prompts for _ in range(G)]
        completions = [
            [{"role": "assistant", "content": text}] if is_conversational(prompt) else text
            for prompt, text in zip(prompts, completion_texts)
        ]
        columns = {name: [value for value in values for _ in range(G)] for name, values in batch.columns.items()}
        rewards_per_func = self.scorer(prompts, completions, completion_ids, columns).to(self.device)  # [N, K]

        # 3. Group-relative advantages.
        rewards = algorithm.combine_rewards(rewards_per_func, self.scorer.weights)  # [N]
        group = algorithm.group_advantages(rewards, G, hp.scale_rewards)

        loss_mask = rollout.completion_mask
        if hp.mask_truncated_completions:
            loss_mask = loss_mask * (~rollout.is_truncated).unsqueeze(1).long()
        local_tokens = loss_mask.sum().float()
        num_items_in_batch = float(self.trainer.strategy.reduce(local_tokens, reduce_op="sum")) / max(
            self.trainer.world_size, 1
        )

        # 4. Log-probs of the policy that sampled (only if the policy moves before it is used) and
        #    of the reference model (only with a KL penalty).
        needs_old_logps = training and (hp.num_iterations > 1 or hp.steps_per_generation > 1)
        old_logps = self._logps_no_grad(self.policy, rollout) if needs_old_logps else None
        ref_logps = self._logps_no_grad(self.ref_model, rollout) if training and hp.beta > 0 else None

        scored = ScoredRollout(
            rollout=rollout,
            loss_mask=loss_mask,
            rewards_per_func=rewards_per_func,
            rewards=rewards,
            group=group,
            old_logps=old_logps,
            ref_logps=ref_logps,
            num_items_in_batch=num_items_in_batch,
        )
        return scored, completions

    def _micro_batch_loss(self, scored: ScoredRollout, rows: torch.Tensor) -> tuple[torch.Tensor, dict]:
        hp = self.hparams
        micro = scored.rollout.select(rows)
        logps, entropy = self.completion_logps(self.policy, micro, with_entropy=True)  # [n, C] each
        width = logps.size(1)
        loss_mask = scored.loss_mask[rows, :width]
        old_logps = scored.old_logps[rows, :width] if scored.old_logps is not None else logps.detach()
        ref_logps = scored.ref_logps[rows, :width] if scored.ref_logps is not None else None
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
        )
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
        texts = render_prompts(self.tokenizer, prompts)
        return generate_completions(
            self.policy,
            self.tokenizer,
            texts,
            self.hparams.num_generations,
            self.generation_config,
            self.hparams.max_prompt_length,
        )

    def completion_logps(
        self, model: torch.nn.Module, rollout: Rollout, with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs ``[n, C]`` of the completion tokens (and their entropy) at the sampling temperature.

        Only the last ``C + 1`` positions' logits are computed (``logits_to_keep``); padding columns
        shared by every row are trimmed first. Positions skip left padding exactly as in ``generate``.
        """
        rollout = rollout.trimmed()
        input_ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], dim=1)  # [n, P + C]
        attention_mask = torch.cat([rollout.prompt_mask, rollout.completion_mask], dim=1)  # [n, P + C]
        num_completion_tokens = rollout.completion_ids.size(1)
        logits = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids_from_mask(attention_mask),
            logits_to_keep=num_completion_tokens + 1,
            use_cache=False,
        ).logits  # [n, C + 1, V]
        logits = logits[:, :-1]  # [n, C, V]: position t predicts completion token t
        temperature = self.hparams.temperature
        logps = algorithm.selective_log_softmax(logits, rollout.completion_ids, temperature)
        entropy = algorithm.entropy_from_logits(logits, temperature) if with_entropy else None
        return logps, entropy

    @torch.no_grad()
    def _logps_no_grad(self, model: torch.nn.Module, rollout: Rollout) -> torch.Tensor:
        """Log-probs ``[N, C]`` without gradient, in micro-batches, padded back to the full width."""
        size = self.hparams.micro_batch_size or rollout.completion_ids.size(0)
        full = torch.zeros(rollout.completion_ids.shape, device=rollout.completion_ids.device)
        for start in range(0, rollout.completion_ids.size(0), size):
            rows = torch.arange(start, min(start + size, rollout.completion_ids.size(0)), device=full.device)
            logps, _ = self.completion_logps(model, rollout.select(rows))
            full[rows, : logps.size(1)] = logps
        return full

    def _clip_gradients(self) -> torch.Tensor | None:
        if not self.hparams.max_grad_norm:  # None or 0: no clipping, as in Lightning and TRL
            return None
        params = [p for p in self.parameters() if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, self.hparams.max_grad_norm)

    # ------------------------------------------------------------------------------------------
    # Validation: sample G completions per prompt and report their mean reward
    # ------------------------------------------------------------------------------------------

    def validation_step(self, batch: PromptBatch, batch_idx: int) -> None:
        scored, _ = self._generate_and_score(batch, training=False)
        self.log("val/reward", scored.rewards.nanmean(), batch_size=len(batch.prompts), sync_dist=True)

    # ------------------------------------------------------------------------------------------
    # Logging
    # ------------------------------------------------------------------------------------------

    def _rollout_metrics(self, scored: ScoredRollout) -> dict[str, torch.Tensor]:
        group = scored.group
        lengths = scored.rollout.completion_lengths.float()
        metrics = {
            "reward": scored.rewards.nanmean(),
            "reward_std": group.group_std.mean(),
            "frac_reward_zero_std": group.zero_std.float().mean(),
            "completions/mean_length": lengths.mean(),
            "completions/min_length": lengths.min(),
            "completions/max_length": lengths.max(),
            "completions/clipped_ratio": scored.rollout.is_truncated.float().mean(),
        }
        for k, name in enumerate(self.scorer.names):
            values = scored.rewards_per_func[:, k]
            valid = values[~torch.isnan(values)]
            metrics[f"rewards/{name}/mean"] = valid.mean() if valid.numel() else torch.tensor(float("nan"))
            metrics[f"rewards/{name}/std"] = valid.std() if valid.numel() > 1 else torch.tensor(0.0)
            metrics[f"rewards/{name}/errors"] = torch.tensor(float(self.scorer.last_error_counts.get(name, 0)))
        return metrics

    def _maybe_log_completions(self, batch: PromptBatch, scored: ScoredRollout, completions: list) -> None:
        every = self.hparams.log_completions_every_n_steps
        experiment = getattr(self.logger, "experiment", None)
        if not every or batch_idx_of(self) % every != 0 or not hasattr(experiment, "add_text"):
            return
        prompts = [p for p in batch.prompts for _ in range(self.hparams.num_generations)]
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


def batch_idx_of(module: pl.LightningModule) -> int:
    """Number of training steps (generation batches) completed so far."""
    return module.trainer.fit_loop.epoch_loop._batches_that_stepped


def _cell(value) -> str:
    if isinstance(value, list):
        value = value[-1]["content"] if value and isinstance(value[-1], dict) else str(value)
    return str(value).replace("|", "\\|").replace("\n", "⏎")


def _check_settings(hp) -> None:
    """Reject settings that cannot work, naming the config key, before anything is loaded."""
    if hp.num_generations < 2:
        raise ValueError(
            f"model.num_generations must be at least 2 (got {hp.num_generations}): GRPO's advantage "
            "is a completion's reward relative to the other completions of its group"
        )
    positive = ["max_completion_length", "num_iterations", "steps_per_generation"]
    for key in positive:
        if hp[key] < 1:
            raise ValueError(f"model.{key} must be at least 1, got {hp[key]}")
    if hp.micro_batch_size is not None and hp.micro_batch_size < 1:
        raise ValueError(f"model.micro_batch_size must be at least 1 or null, got {hp.micro_batch_size}")
    if hp.loss_type not in algorithm.LOSS_AGGREGATIONS:
        raise ValueError(f"model.loss_type must be one of {sorted(algorithm.LOSS_AGGREGATIONS)}, got {hp.loss_type!r}")
    if hp.scale_rewards not in algorithm.SCALE_REWARDS:
        raise ValueError(f"model.scale_rewards must be one of {algorithm.SCALE_REWARDS}, got {hp.scale_rewards!r}")
    if hp.importance_sampling_level not in algorithm.IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(
            f"model.importance_sampling_level must be one of {algorithm.IMPORTANCE_SAMPLING_LEVELS}, "
            f"got {hp.importance_sampling_level!r}"
        )
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


def load_causal_lm(path: str, init_kwargs: dict[str, Any]):
    try:
        return AutoModelForCausalLM.from_pretrained(os.path.expanduser(path), **init_kwargs)
    except OSError as exc:
        raise OSError(f"Could not load model.model_name_or_path {path!r}: {exc}") from exc


def _model_init_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    kwargs = dict(kwargs or {})
    dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
    if isinstance(dtype, str) and dtype != "auto":
        resolved = getattr(torch, dtype, None)
        if not isinstance(resolved, torch.dtype):
            raise ValueError(f"model.model_init_kwargs.dtype {dtype!r} is not a torch dtype (e.g. bfloat16, float32)")
        kwargs["dtype" if "dtype" in kwargs else "torch_dtype"] = resolved
    return kwargs


__all__ = ["GRPOModule", "ScoredRollout", "check_batch_sizes", "load_tokenizer"]
