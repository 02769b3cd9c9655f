"""Typed setting groups, built once from a run's hyperparameters at setup.

The YAML and Python surface is ``GRPOModule``'s parameters (``model.*`` in the config), checked by
:mod:`lit_grpo.config`; the code after setup reads these frozen records instead of the live
hyperparameters, so what a piece of code depends on is in its signature:

- :class:`LossSettings`: everything :func:`lit_grpo.algorithm.grpo_loss` reads (TRL 1.16's newer loss
  options in its :class:`LossOptions`);
- :class:`SamplingSettings`: the distribution the training completions were sampled from, as the
  trainer recomputes it (:class:`lit_grpo.algorithm.sampling_filters.SamplingFilters`);
- :class:`LogProbSettings`: how the log-prob passes run (:mod:`lit_grpo.train.logprob_passes`);
- :class:`GenerationSettings`: how the rollout samples and groups, steps 1-3
  (:mod:`lit_grpo.rollout.collector`, dynamic sampling, the asynchronous pipeline);
- :class:`UpdateSettings`: the optimizer steps of one generation batch, step 5 (:mod:`lit_grpo.train.update`);
- :class:`ToolSettings`: the tools and environments of multi-turn rollouts (:mod:`lit_grpo.rollout.tools.tool_use`);
- :class:`EvaluationSettings`: validation's sampling and scoring (``GRPOModule.validation_step``);
- :class:`EntropyControlSettings`: the entropy bonus and its adaptive control (:mod:`lit_grpo.train.update`);
- :class:`RunSettings`: the groups together.

Each record is made by ``from_hparams(hp)``, where ``hp`` is the module's hyperparameters
(``module.hparams``) or anything with the same names as attributes (the groups after the loss's take
a plain mapping too: the settings as given); what this module may not know (it imports nothing of the
trainer's), the caller passes in: the order of the engine's sampling filters, its class's
``sampling_filter_order`` (:mod:`lit_grpo.rollout.engines`). A setting changed in ``module.hparams``
afterwards takes effect once the records are made again: ``module.apply_settings()``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

__all__ = ["EntropyControlSettings", "EvaluationSettings", "GenerationSettings", "LogProbSettings", "LossOptions", "LossSettings", "RunSettings",
           "SamplingSettings", "ToolSettings", "UpdateSettings"]


def read_setting(hp: Any, name: str) -> Any:
    """``hp``'s value of ``name``: a key of a mapping (the settings as given, Lightning's hparams), else an attribute."""
    return hp[name] if isinstance(hp, Mapping) else getattr(hp, name)


def same_names(record: type, hp: Any) -> dict[str, Any]:
    """The values of ``hp`` named as ``record``'s fields (a record whose fields are ``model.*`` keys)."""
    return {field.name: read_setting(hp, field.name) for field in fields(record)}


@dataclass(frozen=True)
class LossOptions:
    """TRL 1.16's options of the loss (``model.*`` keys of the same names, TRL's defaults), held in
    :attr:`LossSettings.options`: VESPO's Gamma weighting and DeepSeek-V3.2's off-policy sequence mask."""

    vespo_k_pos: float = 2.0  # VESPO's Gamma exponent for A >= 0 (low weights damped)
    vespo_lambda_pos: float = 3.0  # VESPO's Gamma decay for A >= 0 (high weights damped)
    vespo_k_neg: float = 3.0  # the same for A < 0
    vespo_lambda_neg: float = 2.0
    off_policy_mask_threshold: float | None = None  # DeepSeek-V3.2's off-policy sequence mask; None: off


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
    options: LossOptions = LossOptions()  # vespo_* and off_policy_mask_threshold

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
            options=LossOptions(**same_names(LossOptions, hp)),
        )


@dataclass(frozen=True)
class SamplingSettings:
    """How the training completions were sampled (``model.*`` keys of the same names, and the engine's
    ``filter_order``): what the trainer needs to recompute the distribution their tokens were drawn from."""

    filter_order: str = "transformers"  # the engine's sampling_filter_order: a key of sampling_filters.FILTER_ORDERS
    temperature: float = 1.0
    top_k: int | None = 0  # 0 or None: off
    top_p: float | None = 1.0  # 1 or None: off
    min_p: float | None = None  # None or 0: off
    repetition_penalty: float | None = 1.0  # 1 or None: off

    @classmethod
    def from_hparams(cls, hp: Any, filter_order: str) -> SamplingSettings:
        """``filter_order``: the order of the run's engine (``engine_class(backend).sampling_filter_order``)."""
        names = [field.name for field in fields(cls) if field.name != "filter_order"]
        return cls(filter_order=filter_order, **{name: read_setting(hp, name) for name in names})


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
    cast_lm_head_to_fp32: bool = False  # the fused LM head's product in float32 (TRL's option)
    padding_free: bool | str = "auto"  # rows packed into one sequence per forward; "auto": chosen for the device
    sequence_parallel_size: int = 1  # ranks that split each row's tokens (Ulysses); 1: off

    @classmethod
    def from_hparams(cls, hp: Any) -> LogProbSettings:
        return cls(**same_names(cls, hp))


@dataclass(frozen=True)
class GenerationSettings:
    """How the rollout makes a generation batch, steps 1-3 (``model.*`` keys of the same names)."""

    num_generations: int = 8  # G, completions per prompt
    max_prompt_length: int | None = None  # a longer prompt keeps its last tokens; None: all
    max_completion_length: int = 256  # new tokens per completion (with tools: over every turn)
    chat_template_kwargs: dict[str, Any] | None = None  # apply_chat_template's arguments
    scale_rewards: str = "group"  # a key of lit_grpo.algorithm.ADVANTAGE_ESTIMATORS
    multi_objective_aggregation: str = "sum_then_normalize"  # a key of lit_grpo.algorithm.MULTI_OBJECTIVE_AGGREGATIONS
    dynamic_sampling: bool = False  # DAPO's: replace groups whose rewards are all equal
    max_generation_rounds: int = 4  # at most this many rounds of sampling per step with dynamic sampling
    max_staleness: int = 0  # asynchronous GRPO's bound, in optimizer steps; 0: synchronous

    @classmethod
    def from_hparams(cls, hp: Any) -> GenerationSettings:
        return cls(**same_names(cls, hp))


@dataclass(frozen=True)
class UpdateSettings:
    """The optimizer steps of one generation batch, step 5 (``model.*`` keys of the same names)."""

    num_iterations: int = 1  # passes over the generation batch
    steps_per_generation: int = 1  # optimizer steps per pass, on equal mini-batches
    micro_batch_size: int | None = None  # completions per forward and backward; None: a whole mini-batch
    max_grad_norm: float | None = 1.0  # None or 0: no clipping
    mask_truncated_completions: bool = False  # completions that never ended leave the loss

    @classmethod
    def from_hparams(cls, hp: Any) -> UpdateSettings:
        return cls(**same_names(cls, hp))


@dataclass(frozen=True)
class ToolSettings:
    """Multi-turn rollouts with tools and environments (``model.*`` keys of the same names). Made from
    the settings as given, ``tools`` and ``environment`` may hold Python functions and classes; made
    from the hyperparameters a run saves, they hold their names."""

    tools: list[Any] | None = None  # functions the policy may call, or their names
    environment: Any = None  # {name, args, weight}, or a list of them
    max_tool_calling_iterations: int | None = None  # rounds of tool results per rollout; None: the completion budget's
    tool_timeout: float | None = 30.0  # seconds per call; None: no limit
    tool_call_parser: str | None = None  # None: the tokenizer's, else its chat template's format
    max_tool_result_length: int | None = 1024  # tokens of one result; None: no limit

    @classmethod
    def from_hparams(cls, hp: Any) -> ToolSettings:
        return cls(**same_names(cls, hp))

    @property
    def enabled(self) -> bool:
        """Whether rollouts are multi-turn (tools or an environment given)."""
        return bool(self.tools) or bool(self.environment)


@dataclass(frozen=True, kw_only=True)
class EvaluationSettings:
    """How validation samples and scores (``model.*`` keys of the same names, ``None`` resolved); its
    sampling settings are the module's ``eval_generation_config``."""

    num_generations_eval: int  # k, completions per validation prompt (model.num_generations_eval or num_generations)
    eval_pass_k: tuple[int, ...] = ()  # the k of val/pass@k (model.eval_pass_k or pass@1 and pass@k)
    eval_success_threshold: float = 1.0  # a completion is correct when its reward is at least this
    temperature_eval: float | None = None  # validation's temperature (0: greedy); None: the training temperature

    @classmethod
    def from_hparams(cls, hp: Any) -> EvaluationSettings:
        k = read_setting(hp, "num_generations_eval") or read_setting(hp, "num_generations")
        return cls(
            num_generations_eval=k,
            eval_pass_k=tuple(sorted(set(read_setting(hp, "eval_pass_k") or [1, k]))),
            eval_success_threshold=read_setting(hp, "eval_success_threshold"),
            temperature_eval=read_setting(hp, "temperature_eval"),
        )


@dataclass(frozen=True)
class EntropyControlSettings:
    """The entropy bonus and its adaptive control (``model.*`` keys of the same names, TRL 1.16's
    names and defaults), read by :class:`lit_grpo.algorithm.EntropyCoefficient` and the update."""

    entropy_coef: float = 0.0  # the bonus's coefficient; with adaptive control its first value
    use_adaptive_entropy: bool = False
    entropy_target: float = 0.2  # nats per token
    entropy_coef_min: float = 0.0
    entropy_coef_max: float = 1.0
    entropy_coef_delta: float = 0.005

    @classmethod
    def from_hparams(cls, hp: Any) -> EntropyControlSettings:
        return cls(**same_names(cls, hp))

    @property
    def enabled(self) -> bool:
        """Whether the bonus is in the loss at all (TRL's ``_entropy_bonus_enabled``): a non-zero
        coefficient, or adaptive control, which may raise a coefficient that starts at 0."""
        return self.entropy_coef != 0.0 or self.use_adaptive_entropy


@dataclass(frozen=True)
class RunSettings:
    """The setting groups of a run, built once at setup (``GRPOModule.apply_settings``)."""

    loss: LossSettings
    sampling: SamplingSettings
    logprobs: LogProbSettings
    generation: GenerationSettings
    update: UpdateSettings
    tools: ToolSettings
    evaluation: EvaluationSettings
    entropy: EntropyControlSettings = EntropyControlSettings()  # the entropy bonus (off by default)

    @classmethod
    def from_hparams(cls, hp: Any, filter_order: str) -> RunSettings:
        """``filter_order``: the order of the run's engine's sampling filters (``engine_class(backend).sampling_filter_order``)."""
        return cls(
            loss=LossSettings.from_hparams(hp),
            sampling=SamplingSettings.from_hparams(hp, filter_order),
            logprobs=LogProbSettings.from_hparams(hp),
            generation=GenerationSettings.from_hparams(hp),
            update=UpdateSettings.from_hparams(hp),
            tools=ToolSettings.from_hparams(hp),
            evaluation=EvaluationSettings.from_hparams(hp),
            entropy=EntropyControlSettings.from_hparams(hp),
        )
