"""The ``model:`` settings: checks with errors that name the key, and values kept as written.

:func:`check_settings` rejects settings that cannot work before anything is loaded, naming the
config key; :func:`check_batch_sizes` checks that a generation batch splits into optimizer steps
and micro-batches.

Values kept as written:

LightningCLI parses the YAML file and the command line with jsonargparse, which reads a string again
as YAML wherever the type hint admits any value (``Any``): ``"####\\s*(.+)$"`` then becomes ``None``
(a YAML comment), ``"123"`` the int 123, ``"yes"`` True and ``"[ab]"`` a list. Free-form mappings
(reward ``args``, ``model_init_kwargs``, ``lora``) are therefore typed ``dict[str, AsWritten]``: the
YAML parser has already given each value its type (a quoted string stays a string, ``5`` is an int)
and jsonargparse leaves it alone.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

from jsonargparse.typing import register_type
from lightning.pytorch.utilities import rank_zero_warn

from lit_grpo import algorithm
from lit_grpo.algorithm.sampling_correction import SAMPLING_CORRECTION_SETTINGS, correction_settings
from lit_grpo.errors import ConfigError

__all__ = [
    "DISTRIBUTION_CHANGING_ARGUMENTS",
    "SAMPLING_DISTRIBUTION_ARGUMENTS",
    "AsWritten",
    "backend_generation_kwargs",
    "check_batch_sizes",
    "check_reference_sync",
    "check_settings",
    "check_trl_options",
    "named_settings_given_elsewhere",
    "optional_setting",
    "warn_trl_loss_settings",
    "warn_unrecomputed_arguments",
]


class AsWritten:
    """Type hint of a configuration value that is passed on as YAML/JSON wrote it (no second parse).

    Never instantiated: it only tells jsonargparse to keep the value (see the module doc).
    """


def _unchanged(value):
    return value


register_type(AsWritten, serializer=_unchanged, deserializer=_unchanged)


def check_reference_sync(sync_steps: int, alpha: float) -> None:
    """``model.ref_model_sync_steps`` and ``model.ref_model_mixup_alpha`` (``lit_grpo.train.reference``)."""
    if sync_steps < 1:
        raise ConfigError(f"model.ref_model_sync_steps must be at least 1, got {sync_steps}")
    if not 0.0 < alpha <= 1.0:
        raise ConfigError(f"model.ref_model_mixup_alpha must be in (0, 1], got {alpha}")


# Whole: one independent check per key, in the order of the keys, each its own one-line error.
def check_settings(hp, generation_backends: tuple[str, ...]) -> None:
    """Reject settings that cannot work, naming the config key, before anything is loaded
    (``generation_backends``: the names ``model.generation_backend`` may take)."""
    if hp.num_generations < 2:
        raise ConfigError(
            f"model.num_generations must be at least 2 (got {hp.num_generations}): GRPO's advantage "
            "is a completion's reward relative to the other completions of its group"
        )
    positive = ["max_completion_length", "num_iterations", "steps_per_generation", "max_generation_rounds"]
    for key in positive:
        if hp[key] < 1:
            raise ConfigError(f"model.{key} must be at least 1, got {hp[key]}")
    for key in ("micro_batch_size", "logprob_micro_batch_size", "forward_token_budget"):
        if hp[key] is not None and hp[key] != "auto" and hp[key] < 1:
            raise ConfigError(f"model.{key} must be at least 1 or null{' or auto' if key == 'forward_token_budget' else ''}, "
                              f"got {hp[key]}")
    if hp.get("max_tool_calling_iterations") is not None and hp.max_tool_calling_iterations < 0:
        raise ConfigError(f"model.max_tool_calling_iterations must be at least 0 or null, got {hp.max_tool_calling_iterations}")
    if hp.get("max_tool_result_length") is not None and hp.max_tool_result_length < 1:
        raise ConfigError(f"model.max_tool_result_length must be at least 1 token or null, got {hp.max_tool_result_length}")
    if hp.get("tool_timeout") is not None and hp.tool_timeout <= 0:
        raise ConfigError(f"model.tool_timeout must be above 0 seconds or null, got {hp.tool_timeout}")
    if hp.generation_backend not in generation_backends:
        raise ConfigError(f"model.generation_backend must be one of {generation_backends}, got {hp.generation_backend!r}")
    if hp.loss_type not in algorithm.LOSS_TYPES:
        raise ConfigError(f"model.loss_type must be one of {sorted(algorithm.LOSS_TYPES)}, got {hp.loss_type!r}")
    if hp.kl_estimator not in algorithm.KL_ESTIMATORS:
        raise ConfigError(f"model.kl_estimator must be one of {algorithm.KL_ESTIMATORS}, got {hp.kl_estimator!r}")
    if not 0.0 < hp.top_entropy_quantile <= 1.0:
        raise ConfigError(f"model.top_entropy_quantile must be in (0, 1], got {hp.top_entropy_quantile}")
    epsilon_high = hp.epsilon if hp.epsilon_high is None else hp.epsilon_high
    if hp.delta is not None and hp.delta <= 1 + epsilon_high:
        raise ConfigError(f"model.delta must be above 1 + epsilon_high = {1 + epsilon_high}, got {hp.delta}")
    if hp.sync_ref_model:
        check_reference_sync(hp.ref_model_sync_steps, hp.ref_model_mixup_alpha)
    if hp.sync_ref_model and (hp.beta == 0 or hp.lora is not None):
        raise ConfigError(
            "model.sync_ref_model needs a separate reference model: model.beta > 0 and no model.lora "
            f"(got beta={hp.beta}, lora={hp.lora}); with LoRA the reference is the base model itself"
        )
    if hp.loss_type == "cispo" and epsilon_high < 1.0:
        raise ConfigError(
            f"model.loss_type cispo uses model.epsilon_high as the upper bound of the importance weight "
            f"(e.g. 5.0, as in TRL), not as 1 + epsilon_high; got {epsilon_high}, which would scale every "
            "update down"
        )
    if hp.sapo_temperature_pos <= 0 or hp.sapo_temperature_neg <= 0:
        raise ConfigError(
            "model.sapo_temperature_pos and model.sapo_temperature_neg must be > 0, got "
            f"{hp.sapo_temperature_pos} and {hp.sapo_temperature_neg}"
        )
    if hp.scale_rewards not in algorithm.ADVANTAGE_ESTIMATORS:
        estimators = tuple(algorithm.ADVANTAGE_ESTIMATORS)  # the built-in ones and any registered
        raise ConfigError(f"model.scale_rewards must be one of {estimators}, got {hp.scale_rewards!r}")
    if hp.importance_sampling_level not in algorithm.IMPORTANCE_SAMPLING_LEVELS:
        raise ConfigError(
            f"model.importance_sampling_level must be one of {algorithm.IMPORTANCE_SAMPLING_LEVELS}, "
            f"got {hp.importance_sampling_level!r}"
        )
    if hp.temperature_eval is not None and hp.temperature_eval < 0:
        raise ConfigError(f"model.temperature_eval must be >= 0 (0 = greedy) or null, got {hp.temperature_eval}")
    n_eval = hp.num_generations_eval or hp.num_generations
    if hp.num_generations_eval is not None and hp.num_generations_eval < 1:
        raise ConfigError(f"model.num_generations_eval must be at least 1, got {hp.num_generations_eval}")
    for pass_k in hp.eval_pass_k or []:
        if not 1 <= pass_k <= n_eval:
            raise ConfigError(f"model.eval_pass_k value {pass_k} must be between 1 and num_generations_eval = {n_eval}")
    if hp.temperature <= 0:
        raise ConfigError(f"model.temperature must be > 0 (sampling), got {hp.temperature}")
    if hp.beta < 0:
        raise ConfigError(f"model.beta must be >= 0, got {hp.beta}")
    check_vllm_settings(hp)
    check_trl_options(hp)


def check_trl_options(hp) -> None:
    """TRL 1.16's ``multi_objective_aggregation``, ``vespo_*``, ``off_policy_mask_threshold`` and
    entropy-bonus keys (issue 54), each checked where the run's settings have it."""
    aggregation = hp.get("multi_objective_aggregation")
    if aggregation is not None and aggregation not in algorithm.MULTI_OBJECTIVE_AGGREGATIONS:
        raise ConfigError(
            f"model.multi_objective_aggregation must be one of {tuple(algorithm.MULTI_OBJECTIVE_AGGREGATIONS)}, "
            f"got {aggregation!r}"
        )
    for key in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg", "entropy_coef_delta"):
        if hp.get(key) is not None and not hp[key] >= 0:
            raise ConfigError(f"model.{key} must be >= 0, got {hp[key]}")
    threshold = hp.get("off_policy_mask_threshold")
    if threshold is not None and not threshold >= 0:
        raise ConfigError(f"model.off_policy_mask_threshold must be >= 0 (a KL in nats, e.g. 0.5) or null, got {threshold}")
    low, high = hp.get("entropy_coef_min"), hp.get("entropy_coef_max")
    if low is not None and high is not None and not low <= high:
        raise ConfigError(f"model.entropy_coef_min ({low}) must not be above model.entropy_coef_max ({high})")
    # the correction's weights reach the loss from a vLLM engine, and with staleness on every backend
    # (the async pipeline weighs stale samples by them and refuses the correction off)
    staleness = hp.get("max_staleness") or 0
    corrected = hp.get("vllm_importance_sampling_correction") and (
        hp.get("generation_backend") in ("vllm", "vllm_server") or staleness > 0
    )
    if hp.get("loss_type") == "vespo" and corrected:
        mode = correction_settings(hp.vllm_importance_sampling_mode, None, None, staleness).mode
        if not mode.startswith("token"):
            raise ConfigError(
                "model.loss_type vespo folds the correction's weights into its sequence weight token by token: "
                f"model.vllm_importance_sampling_mode must be token_truncate or token_mask (as in TRL), got {mode!r}"
            )
    warn_trl_loss_settings(hp)


def warn_trl_loss_settings(hp) -> None:
    """TRL 1.16's warnings (``GRPOTrainer.__init__``) for an ``importance_sampling_level`` that is not the
    one luspo's or vespo's paper uses: the run goes on."""
    loss_type, level = hp.get("loss_type"), hp.get("importance_sampling_level", "token")
    if loss_type == "luspo" and level != "sequence":
        rank_zero_warn(
            "When using 'luspo' loss, model.importance_sampling_level should be set to 'sequence' to mirror the "
            "paper's setup."
        )
    if loss_type == "vespo" and level != "token":
        rank_zero_warn(
            "VESPO computes sequence-level importance weights internally. model.importance_sampling_level should be "
            "set to 'token' (the default)."
        )


def check_vllm_settings(hp) -> None:
    """``model.vllm_*``: values the engine and the importance-sampling correction can use."""
    if not 0.0 < hp.vllm_gpu_memory_utilization <= 1.0:
        raise ConfigError(f"model.vllm_gpu_memory_utilization must be in (0, 1], got {hp.vllm_gpu_memory_utilization}")
    if hp.vllm_tensor_parallel_size != 1:
        raise ConfigError(
            f"model.vllm_tensor_parallel_size={hp.vllm_tensor_parallel_size}: the colocated engine runs one copy "
            "per training process (1); a tensor-parallel engine is not implemented yet"
        )
    if hp.vllm_max_model_length is not None and hp.vllm_max_model_length < 1:
        raise ConfigError(f"model.vllm_max_model_length must be at least 1 or null, got {hp.vllm_max_model_length}")
    if hp.vllm_importance_sampling_mode not in SAMPLING_CORRECTION_SETTINGS:
        raise ConfigError(
            f"model.vllm_importance_sampling_mode must be one of {SAMPLING_CORRECTION_SETTINGS}, "
            f"got {hp.vllm_importance_sampling_mode!r}"
        )
    resolved = correction_settings(hp.vllm_importance_sampling_mode, hp.vllm_importance_sampling_clip_min,
                                   hp.vllm_importance_sampling_clip_max, hp.max_staleness)
    for key, value in (("_clip_min", resolved.clip_min), ("_clip_max", resolved.clip_max)):
        if value is not None and not isinstance(value, (int, float)):
            raise ConfigError(f"model.vllm_importance_sampling{key} must be a number, null or auto, got {value!r}")
    low, high = resolved.clip_min, resolved.clip_max
    if low is not None and high is not None and not 0 <= low < high:
        raise ConfigError(
            f"model.vllm_importance_sampling_clip_min ({low}) and _clip_max ({high}) must satisfy 0 <= min < max"
        )


# generation_kwargs' arguments that change the distribution the completions are drawn from, which the trainer
# recomputes (lit_grpo.algorithm.sampling_filters): they become the named keys' values, everywhere
SAMPLING_DISTRIBUTION_ARGUMENTS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")

# generation_kwargs' arguments that change the distribution the completions are drawn from but that the trainer
# does not recompute (its log-probs are the policy's under SAMPLING_DISTRIBUTION_ARGUMENTS only): vLLM's
# SamplingParams fields, then transformers' GenerationConfig fields (:func:`warn_unrecomputed_arguments`)
DISTRIBUTION_CHANGING_ARGUMENTS = frozenset({
    "presence_penalty", "frequency_penalty", "logit_bias", "allowed_token_ids", "bad_words", "min_tokens",
    "structured_outputs", "thinking_token_budget", "watermarking", "extra_args",
    "typical_p", "epsilon_cutoff", "eta_cutoff", "top_h", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size",
    "bad_words_ids", "suppress_tokens", "begin_suppress_tokens", "sequence_bias", "min_new_tokens", "min_length",
    "forced_bos_token_id", "forced_eos_token_id", "exponential_decay_length_penalty", "encoder_repetition_penalty",
    "guidance_scale", "watermarking_config", "num_beams", "num_beam_groups", "diversity_penalty", "penalty_alpha",
    "dola_layers", "force_words_ids", "constraints",
})


def optional_setting(hp, name: str):
    """``hp``'s value of ``name`` (a mapping's key, or an attribute), None where it has none."""
    return hp.get(name) if isinstance(hp, Mapping) else getattr(hp, name, None)


def named_settings_given_elsewhere(hp) -> dict:
    """The named ``model.*`` settings that other keys set, to be put in ``hp`` before it is checked:
    ``generation_kwargs``' sampling-distribution arguments (TRL: they override the named keys), and TRL's
    deprecated ``vllm_importance_sampling_cap`` (``vllm_importance_sampling_clip_max``, with TRL's warning)."""
    generation_kwargs = optional_setting(hp, "generation_kwargs")
    if generation_kwargs is not None and not (isinstance(generation_kwargs, dict) and all(isinstance(key, str) for key in generation_kwargs)):
        raise ConfigError(f"model.generation_kwargs must be a mapping of argument names to values, got {generation_kwargs!r}")
    given = {}
    for name in SAMPLING_DISTRIBUTION_ARGUMENTS:
        value = (generation_kwargs or {}).get(name)
        if name in (generation_kwargs or {}) and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ConfigError(f"model.generation_kwargs.{name} must be a number, got {value!r}")
        if name == "top_k" and value is not None and not isinstance(value, int):
            raise ConfigError(f"model.generation_kwargs.top_k must be an integer, got {value!r}")
        if name == "temperature" and value is not None and value <= 0:
            raise ConfigError(f"model.generation_kwargs.temperature must be > 0 (sampling), got {value}")
        if value is not None:
            given[name] = 0 if name == "top_k" and value == -1 else value  # vLLM's top_k -1 is off, lit-grpo's 0
    cap = optional_setting(hp, "vllm_importance_sampling_cap")
    if cap is not None:
        clip_max = optional_setting(hp, "vllm_importance_sampling_clip_max")  # "auto" unless given
        if clip_max != "auto" and clip_max != cap:
            raise ConfigError(f"model.vllm_importance_sampling_cap ({cap}, deprecated) and model.vllm_importance_sampling_clip_max "
                              f"({clip_max}) differ: give only vllm_importance_sampling_clip_max")
        warnings.warn("The `vllm_importance_sampling_cap` argument is deprecated and will be removed in v2.0.0. "
                      "Use `vllm_importance_sampling_clip_max` instead.", FutureWarning, stacklevel=3)  # TRL 1.16's text
        given["vllm_importance_sampling_clip_max"] = cap
    return given


def backend_generation_kwargs(hp) -> dict:
    """``model.generation_kwargs`` less the sampling-distribution arguments (:func:`named_settings_given_elsewhere`):
    what goes to the backend as it is (``GenerationConfig`` fields, or vLLM's ``SamplingParams``)."""
    return {name: value for name, value in (optional_setting(hp, "generation_kwargs") or {}).items()
            if name not in SAMPLING_DISTRIBUTION_ARGUMENTS}


def warn_unrecomputed_arguments(hp, engine_logprobs_corrected: bool) -> None:
    """One warning at start naming every argument of ``model.generation_kwargs`` in
    :data:`DISTRIBUTION_CHANGING_ARGUMENTS` (and ``model.vllm_structured_outputs_regex``) that ``hp`` gives: the
    backend samples with it, the trainer's log-probs ignore it (as TRL's). ``engine_logprobs_corrected``: the
    backend scores its samples (vLLM's processed log-probs), so the importance-sampling correction and
    ``off_policy_mask_threshold`` measure that difference as if it were staleness, on-policy too."""
    given = [f"model.generation_kwargs.{name}" for name in backend_generation_kwargs(hp) if name in DISTRIBUTION_CHANGING_ARGUMENTS]
    if optional_setting(hp, "vllm_structured_outputs_regex") is not None:
        given.append("model.vllm_structured_outputs_regex")
    if not given:
        return
    changes, it = ("changes", "it") if len(given) == 1 else ("change", "them")
    if engine_logprobs_corrected:
        consequence = (f"the engine's log-probs follow {it}, so the importance-sampling correction's ratios (trainer / engine) "
                       "and off_policy_mask_threshold's KL measure that difference even on-policy: consider "
                       "model.vllm_importance_sampling_correction: false")
    else:
        consequence = "the completions are off-policy by that difference, which nothing corrects"
    rank_zero_warn(f"{', '.join(given)} {changes} the distribution the completions are sampled from, but the trainer's "
                   f"log-probs ignore {it} (as TRL's): {consequence}")


def check_batch_sizes(
    num_prompts: int, num_generations: int, steps_per_generation: int, micro_batch_size: int | None
) -> None:
    """The generation batch must split evenly into optimizer steps and micro-batches."""
    num_completions = num_prompts * num_generations
    if num_completions % steps_per_generation:
        raise ConfigError(
            f"data.batch_size * model.num_generations = {num_prompts} * {num_generations} = {num_completions} "
            f"completions do not split into model.steps_per_generation = {steps_per_generation} equal mini-batches"
        )
    mini_batch = num_completions // steps_per_generation
    if micro_batch_size is not None and mini_batch % micro_batch_size:
        raise ConfigError(
            f"a mini-batch of {mini_batch} completions (data.batch_size * model.num_generations / "
            f"model.steps_per_generation) does not split into model.micro_batch_size = {micro_batch_size}"
        )
