"""Typed setting groups, built once from a run's hyperparameters at setup.

The YAML and Python surface is ``GRPOModule``'s parameters (``model.*`` in the config), checked by
:mod:`lit_grpo.config`; the code after setup reads these frozen records instead of the live
hyperparameters, so what a piece of code depends on is in its signature:

- :class:`LossSettings`: everything :func:`lit_grpo.algorithm.grpo_loss` reads;
- :class:`SamplingSettings`: the distribution the training completions were sampled from, as the
  trainer recomputes it (:class:`lit_grpo.algorithm.sampling_filters.SamplingFilters`);
- :class:`LogProbSettings`: how the log-prob passes run (:mod:`lit_grpo.train.logprob_passes`);
- :class:`RunSettings`: the three groups together.

Each record is made by ``from_hparams(hp)``, where ``hp`` is anything with the module's
hyperparameters as attributes. A setting changed afterwards takes effect once the record is made
again (``module.logprobs.settings = RunSettings.from_hparams(module.hparams)``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["LogProbSettings", "LossSettings", "RunSettings", "SamplingSettings"]


@dataclass(frozen=True, kw_only=True)
class LossSettings:
    """The GRPO loss of one micro-batch (``model.*`` keys; ``epsilon_low`` is ``model.epsilon``)."""

    loss_type: str = "dapo"  # a key of lit_grpo.algorithm.LOSS_TYPES
    max_completion_length: int  # dr_grpo's constant normaliser
    beta: float = 0.0  # weight of the KL penalty to the reference; 0 turns it off
    epsilon_low: float = 0.2  # the clip range [1 - epsilon_low, 1 + epsilon_high] of the ratio
    epsilon_high: float = 0.2  # also CISPO's bound of the importance weight
    delta: float | None = None  # two-sided clip of the PPO objective
    importance_sampling_level: str = "token"  # "token" (GRPO) or "sequence" (GSPO)
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    kl_estimator: str = "k3"  # "k1", "k2" or "k3"
    use_bias_correction_kl: bool = True  # the per-token KL times the importance ratio

    @classmethod
    def from_hparams(cls, hp: Any) -> LossSettings:
        return cls(
            loss_type=hp.loss_type,
            max_completion_length=hp.max_completion_length,
            beta=hp.beta,
            epsilon_low=hp.epsilon,
            epsilon_high=hp.epsilon if hp.epsilon_high is None else hp.epsilon_high,
            delta=hp.delta,
            importance_sampling_level=hp.importance_sampling_level,
            sapo_temperature_pos=hp.sapo_temperature_pos,
            sapo_temperature_neg=hp.sapo_temperature_neg,
            kl_estimator=hp.kl_estimator,
            use_bias_correction_kl=hp.use_bias_correction_kl,
        )


@dataclass(frozen=True)
class SamplingSettings:
    """How the training completions were sampled (``model.*`` keys of the same names): what the
    trainer needs to recompute the distribution their tokens were drawn from."""

    generation_backend: str = "lit"  # the order of the filters differs between backends
    temperature: float = 1.0
    top_k: int | None = 0  # 0 or None: off
    top_p: float | None = 1.0  # 1 or None: off
    min_p: float | None = None  # None or 0: off
    repetition_penalty: float | None = 1.0  # 1 or None: off

    @classmethod
    def from_hparams(cls, hp: Any) -> SamplingSettings:
        return cls(
            generation_backend=hp.generation_backend,
            temperature=hp.temperature,
            top_k=hp.top_k,
            top_p=hp.top_p,
            min_p=hp.min_p,
            repetition_penalty=hp.repetition_penalty,
        )


@dataclass(frozen=True)
class LogProbSettings:
    """How the forwards and backwards after sampling run (``model.*`` keys of the same names)."""

    forward_token_budget: int | str | None = "auto"  # "auto": chosen for the run's device at setup
    share_prompt_forward: bool | str = "auto"  # "auto" likewise
    group_by_length: bool = True
    skip_zero_gradient_rows: bool = True
    top_entropy_quantile: float = 1.0  # train only this fraction of highest-entropy tokens
    logprob_micro_batch_size: int | None = None  # rows per forward without gradient
    micro_batch_size: int | None = None
    # reweighting the samples of another engine (vLLM) towards the trainer's policy; the module has
    # resolved "auto" in its hyperparameters (lit_grpo.algorithm.sampling_correction.correction_settings)
    vllm_importance_sampling_correction: bool = True
    vllm_importance_sampling_mode: str = "sequence_mask"
    vllm_importance_sampling_clip_min: float | None = None
    vllm_importance_sampling_clip_max: float | None = 3.0

    @classmethod
    def from_hparams(cls, hp: Any) -> LogProbSettings:
        return cls(**{name: getattr(hp, name) for name in cls.__dataclass_fields__})


@dataclass(frozen=True)
class RunSettings:
    """The setting groups of a run that the log-prob passes and the loss read."""

    loss: LossSettings
    sampling: SamplingSettings
    logprobs: LogProbSettings

    @classmethod
    def from_hparams(cls, hp: Any) -> RunSettings:
        return cls(
            loss=LossSettings.from_hparams(hp),
            sampling=SamplingSettings.from_hparams(hp),
            logprobs=LogProbSettings.from_hparams(hp),
        )
