"""The checks of GRPOModule's settings as given, before any model loads, and the rewards and tools they name.

Plain functions of the module's settings (moved out of :mod:`lit_grpo.train.module`, unchanged):
:func:`check_settings_as_given` checks them and resolves what is given elsewhere or left at ``auto``;
:func:`resolve_rewards_and_tools` builds the training and evaluation scorers and the tool use.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from lit_grpo import models
from lit_grpo.algorithm.sampling_correction import correction_settings
from lit_grpo.config import check_settings, named_settings_given_elsewhere
from lit_grpo.errors import ConfigError
from lit_grpo.rollout.engines import ENGINES
from lit_grpo.rollout.tools.tool_use import ToolUse
from lit_grpo.scoring import RewardScorer
from lit_grpo.settings import ToolSettings

__all__ = ["check_settings_as_given", "resolve_rewards_and_tools"]


def check_settings_as_given(module: pl.LightningModule, settings: dict[str, Any]) -> None:
    """The checks of the settings as given that need no model; the importance-sampling correction's
    ``auto`` values resolved (in ``module.hparams`` and ``settings``); with LoRA, a state dict of the
    adapter only."""
    given_elsewhere = named_settings_given_elsewhere(module.hparams)  # generation_kwargs' temperature..., the deprecated cap
    module.hparams.update(given_elsewhere)
    settings.update(given_elsewhere)
    check_settings(module.hparams, tuple(ENGINES))  # the backends registered now
    # "auto": the correction of this run's staleness, in the hparams the loss reads (lit_grpo.train.logprob_passes)
    module.hparams.update(correction_settings(settings["vllm_importance_sampling_mode"], settings["vllm_importance_sampling_clip_min"],
                                              settings["vllm_importance_sampling_clip_max"], settings["max_staleness"]).as_hparams())
    if settings["lora"] is not None:
        models.lora_config(settings["lora"])  # a bad model.lora fails before any model is loaded
        # The module's state dict, so every checkpoint (FSDP2's sharded ones too), holds only the
        # adapter: the base weights are model_name_or_path's. on_load_checkpoint checks a full
        # checkpoint and adds them back; a sharded one loads the keys the state dict has.
        module.register_state_dict_post_hook(models.without_frozen_policy_weights)
        module.strict_loading = False


def resolve_rewards_and_tools(settings: dict[str, Any]) -> tuple[RewardScorer, RewardScorer, ToolUse | None]:
    """The training and evaluation rewards (``scorer``, ``eval_scorer``) and the tool use (None
    without tools), from the settings as given (in Python, functions and classes too)."""
    # what the run knows that a reward may ask for by name (DAPO's soft_overlong_punishment)
    run_settings = {"max_completion_len": settings["max_completion_length"]}
    scorer = RewardScorer(settings["rewards"], run_settings)
    eval_rewards = settings["eval_rewards"]
    eval_scorer = RewardScorer(eval_rewards, run_settings, key="model.eval_rewards") if eval_rewards else scorer
    tool_use = ToolUse.from_settings(ToolSettings.from_hparams(settings))  # multi-turn rollouts with tools, or None
    clash = set(tool_use.reward_names if tool_use else []) & set(scorer.names)
    if clash:
        raise ConfigError(f"model.environment and model.rewards both name {sorted(clash)}: rename one")
    return scorer, eval_scorer, tool_use
