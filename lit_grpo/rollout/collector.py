"""Steps 1-3 of a GRPO step, for every path that makes generation batches: the synchronous step,
DAPO's dynamic sampling (:mod:`lit_grpo.rollout.dynamic_sampling`) and the asynchronous pipeline
(:mod:`lit_grpo.rollout.async_pipeline`).

1. sample G completions per prompt with the run's engine (:mod:`lit_grpo.rollout.engines`), which gets
   the policy's current weights first; with tools, multi-turn rollouts (:mod:`lit_grpo.rollout.tools.tool_use`);
2. score every completion with the reward functions (:mod:`lit_grpo.scoring`), then the environments';
3. turn the rewards of every rank into group-relative advantages (:func:`lit_grpo.algorithm.multi_objective_advantages`).

The collector owns the engine, the scorer and the tool use; of the trainer it gets only the policy
and its version (:class:`CurrentWeights`) and the collectives over ranks (:class:`Collectives`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig

from lit_grpo import algorithm
from lit_grpo.data import PromptBatch
from lit_grpo.distributed import gather_rows
from lit_grpo.rollout.dynamic_sampling import dynamic_sampling
from lit_grpo.rollout.engines.base import GenerationEngine, agreeing_on_failure
from lit_grpo.rollout.engines.requests import render_prompts, tokenize_prompts
from lit_grpo.rollout.records import Rollout, SampledGroups, decode_completions, score_groups
from lit_grpo.rollout.tools.tool_use import ToolUse
from lit_grpo.scoring import RewardScorer
from lit_grpo.settings import GenerationSettings

__all__ = ["Collectives", "CurrentWeights", "RolloutCollector"]

CurrentWeights = Callable[[], tuple[torch.nn.Module, int]]  # the policy and its version (its optimizer steps)


@dataclass(frozen=True)
class Collectives:
    """The run's processes as the collector sees them (the trainer's, read at each call: they exist once
    it is attached). On one process each is the identity."""

    all_gather: Callable[[torch.Tensor], torch.Tensor]  # [n, ...] -> [world, n, ...] (LightningModule.all_gather)
    reduce: Callable[[torch.Tensor, str], torch.Tensor]  # (value, "sum" | "mean" | "max" | "min") over ranks
    rank: Callable[[], int]  # this process's global rank
    device: Callable[[], torch.device]  # the trainer's device, where rollouts and rewards go


class RolloutCollector:
    """Samples, scores and groups the completions of prompt batches (steps 1-3).

    Args:
        scorer: the training rewards (validation passes its own scorer to :meth:`score`).
        tool_use: multi-turn rollouts with tools and environments, or None.
        tokenizer: the policy's.
        settings: how the rollout samples and groups (:class:`~lit_grpo.settings.GenerationSettings`,
            built once at setup; the module hands it new ones when its settings are applied again).
        weights: the policy and its version, handed to the engine before it samples.
        collectives: gathers and reductions over ranks.
    """

    def __init__(self, scorer: RewardScorer, tool_use: ToolUse | None, tokenizer: Any, settings: GenerationSettings,
                 weights: CurrentWeights, collectives: Collectives) -> None:
        self.scorer = scorer
        self.tool_use = tool_use
        self.tokenizer = tokenizer
        self.settings = settings
        self.weights = weights
        self.collectives = collectives
        self.engine: GenerationEngine | None = None  # what samples, made once the trainer knows its precision
        self.generation_config: GenerationConfig | None = None  # the training sampling settings, once the policy exists

    def sync_weights(self) -> float:
        """Hand the engine the policy's current weights; the seconds it took (0 when it had them)."""
        policy, version = self.weights()
        return self.engine.sync_weights(policy, version)

    # ------------------------------------------------------------------------------------------
    # Steps 1-3
    # ------------------------------------------------------------------------------------------

    def collect(self, batch: PromptBatch, timings: dict[str, float],
                more_prompts: Callable[[], PromptBatch | None] | None = None) -> tuple[SampledGroups, dict | None]:
        """Steps 1-3 for one generation batch; with ``more_prompts`` (dynamic sampling: the next prompt
        batch of the data stream, None at its end) the groups without signal are replaced by groups of
        further prompts. The groups, and dynamic sampling's statistics (None without it)."""
        sampled = self.sample_and_score(batch, timings)
        if more_prompts is None:
            return sampled, None
        return dynamic_sampling(self, sampled, timings, more_prompts)

    def sample_and_score(self, batch: PromptBatch, timings: dict[str, float]) -> SampledGroups:
        """Steps 1-3 for one batch of prompts: sample, score, group-relative advantages (``timings``
        gets the seconds of ``generate``, ``rewards`` and, for an engine with weights of its own, ``weight_sync``)."""
        # 1. Sample G completions per prompt (an engine with weights of its own gets the current ones first).
        if self.engine.holds_weights:
            timings["weight_sync"] = timings.get("weight_sync", 0.0) + self.sync_weights()
        start = time.perf_counter()
        rollout = self.generate(batch.prompts, columns=batch.columns)
        timings["generate"] += time.perf_counter() - start

        # 2. Score them: every reward sees one prompt, one completion and one value of each column.
        start = time.perf_counter()
        completions, rewards_per_func = self.score_on_every_rank(self.scorer, batch, rollout, self.settings.num_generations)  # [N, K]
        timings["rewards"] += time.perf_counter() - start

        # 3. Group-relative advantages.
        return self.groups(batch, rollout, completions, rewards_per_func)

    def groups(self, batch: PromptBatch, rollout: Rollout, completions: list, rewards_per_func: torch.Tensor) -> SampledGroups:
        """Step 3 for a sampled and scored batch (``rewards_per_func [N, K]`` on the trainer's device):
        advantages by ``model.multi_objective_aggregation`` (:func:`lit_grpo.algorithm.multi_objective_advantages`:
        the weighted sum then group advantages, or GDPO's rewards normalised one by one), and the weighted
        sum as the reward (logged under both, as TRL does). Groups never straddle ranks, but the rewards of
        every rank are gathered so that batch-level statistics (``scale_rewards: batch``, GDPO's batch
        normalisation, the logged reward metrics) describe the global batch; this rank keeps its own rows."""
        settings, weights = self.settings, self.reward_weights(self.scorer)  # weights [K]
        all_rewards_per_func = gather_rows(rewards_per_func, self.collectives.all_gather)  # [world * N, K]
        all_rewards = algorithm.combine_rewards(all_rewards_per_func, weights)  # [world * N], the logged reward
        all_group = algorithm.multi_objective_advantages(all_rewards_per_func, weights, settings.num_generations,
                                                         settings.scale_rewards, settings.multi_objective_aggregation)
        N = rewards_per_func.size(0)
        rank = self.collectives.rank()
        local_rows = slice(rank * N, (rank + 1) * N)
        return SampledGroups(
            prompts=list(batch.prompts),
            rollout=rollout,
            completions=completions,
            rewards_per_func=rewards_per_func,
            rewards=all_rewards[local_rows],
            group=all_group.rows(local_rows),
        )

    # ------------------------------------------------------------------------------------------
    # Step 1: sampling
    # ------------------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, prompts: list, num_generations: int | None = None, config: GenerationConfig | None = None,
                 columns: dict[str, list] | None = None) -> Rollout:
        """Sample completions for each prompt (strings or chat messages): ``num_generations`` (default
        G) with ``config`` (default the training sampling settings); with tools, multi-turn rollouts
        (``columns``: the prompts' dataset columns, which environments are built from)."""
        with self.engine.generation_phase():  # an engine that sleeps between generations sleeps once, after it
            return self._generate(prompts, num_generations or self.settings.num_generations, config or self.generation_config,
                                  columns)

    def _generate(self, prompts: list, G: int, config: GenerationConfig, columns: dict[str, list] | None) -> Rollout:
        settings, device = self.settings, self.collectives.device()
        if self.tool_use is not None:
            conversations = self.tool_use.start(prompts, columns or {}, G, self.tokenizer, settings.max_prompt_length,
                                                settings.chat_template_kwargs)
            any_rank_active = lambda local: bool(self.collectives.reduce(
                torch.tensor(float(local), device=device), "max"))
            self.sync_weights()  # then the engine knows its longest sequence
            return self.tool_use.rollout(conversations, self.generate_ids, self.tokenizer, config, settings.max_completion_length,
                                         settings.chat_template_kwargs, any_rank_active, device, self.engine.max_sequence_length())
        texts = render_prompts(self.tokenizer, prompts, settings.chat_template_kwargs)
        ids, mask, cut = tokenize_prompts(self.tokenizer, texts, settings.max_prompt_length, device)
        return self.generate_ids(ids, mask, config, G, cut)

    def generate_ids(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, config: GenerationConfig,
                     num_generations: int = 1, prompt_truncated: torch.Tensor | None = None) -> Rollout | None:
        """G completions of each left-padded prompt ``[B, P]`` with the run's engine, which gets this
        step's weights first (None for no prompts: the engine's collectives are still joined)."""
        if prompt_truncated is None:
            prompt_truncated = torch.zeros(len(prompt_ids), dtype=torch.bool, device=self.collectives.device())
        self.sync_weights()  # nothing to do when the engine has them already
        return self.engine.generate(prompt_ids, prompt_mask, prompt_truncated, num_generations, config, self.tokenizer.pad_token_id)

    def background_sampler(self, batch: PromptBatch) -> Callable:
        """For an engine that samples elsewhere (:attr:`GenerationEngine.samples_elsewhere`): its
        :meth:`~GenerationEngine.sampler` of ``batch`` with the training settings, prompts on the CPU
        (the seed drawn now; the call returned may run in another thread)."""
        settings = self.settings
        texts = render_prompts(self.tokenizer, batch.prompts, settings.chat_template_kwargs)
        ids, mask, cut = tokenize_prompts(self.tokenizer, texts, settings.max_prompt_length, torch.device("cpu"))
        return self.engine.sampler(ids, mask, cut, settings.num_generations, self.generation_config, self.tokenizer.pad_token_id)

    # ------------------------------------------------------------------------------------------
    # Step 2: rewards
    # ------------------------------------------------------------------------------------------

    def score(self, scorer: RewardScorer, batch: PromptBatch, rollout: Rollout, k: int,
              device: torch.device | None = None) -> tuple[list, torch.Tensor]:
        """The completions as the rewards saw them and ``[B * k, K]`` rewards on ``device`` (default the
        trainer's; the async pipeline's scoring thread keeps them on the CPU): ``scorer``'s, then the
        environments' (multi-turn rollouts). This rank's alone, with no collective (that thread's too);
        where every rank scores at once, :meth:`score_on_every_rank`."""
        texts, completion_ids = decode_completions(self.tokenizer, rollout)
        completions, rewards_per_func = score_groups(scorer, batch.prompts, batch.columns, texts, completion_ids, k,
                                                     rollout.conversations)
        if self.tool_use is not None and self.tool_use.reward_names:
            rewards_per_func = torch.cat([rewards_per_func, self.tool_use.environment_rewards(rollout.conversations)], dim=1)
        return completions, rewards_per_func.to(device or self.collectives.device())

    def score_on_every_rank(self, scorer: RewardScorer, batch: PromptBatch, rollout: Rollout, k: int) -> tuple[list, torch.Tensor]:
        """:meth:`score` where every rank scores at once (training's step 2, validation), agreeing on how it
        ended: a reward raising on one rank raises on every rank, with its message, instead of leaving the
        others in the next collective (:func:`~lit_grpo.rollout.engines.base.agreeing_on_failure`)."""
        with agreeing_on_failure(self.collectives.device()):
            return self.score(scorer, batch, rollout, k)

    def reward_weights(self, scorer: RewardScorer) -> torch.Tensor:  # [K + environments]
        """The weights of ``scorer``'s rewards, then the environments'."""
        extra = self.tool_use.reward_weights if self.tool_use is not None else []
        return torch.cat([scorer.weights, torch.tensor(extra, dtype=scorer.weights.dtype)]) if extra else scorer.weights

    @property
    def reward_names(self) -> list[str]:
        """The columns of the training ``rewards_per_func``: the rewards', then the environments' (logged
        even at weight 0)."""
        return self.scorer.names + (self.tool_use.reward_names if self.tool_use is not None else [])
