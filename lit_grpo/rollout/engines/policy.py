"""The ``lit`` and ``transformers`` backends: sampling with the policy itself.

:data:`SAMPLERS` maps each name to a function from left-padded prompt ids to completion ids:

* ``"lit"`` (default): the group sampler of :mod:`lit_grpo.rollout.engines.lit_sampler` (each prompt encoded
  once, KV cache written in place, finished completions leave the batch). For models or generation
  options it does not implement it falls back to ``generate``, with a warning.
* ``"transformers"``: Hugging Face ``generate`` on the prompts repeated G times.

Both give the same completions for the same settings (greedy decoding gives the same tokens;
sampling draws from the same distribution), and both stop at every EOS id of the generation config.
:func:`generate_completions` samples from prompt texts, :func:`generate_from_ids` from token ids;
:class:`PolicyEngine` is the run's engine with either (no copy of the weights: nothing to push).
CPU-only speed-ups around sampling live in :mod:`lit_grpo.cpu` (:func:`lit_grpo.cpu.sampling`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from lit_grpo import cpu
from lit_grpo.algorithm import completion_mask_from_ids
from lit_grpo.config import backend_generation_kwargs, optional_setting, warn_unrecomputed_arguments
from lit_grpo.distributed import gathered_for_generation
from lit_grpo.errors import ConfigError
from lit_grpo.rollout.engines.base import GenerationEngine
from lit_grpo.rollout.engines.lit_sampler import lit_sampler_unsupported, sample_groups
from lit_grpo.rollout.engines.requests import (
    check_generation_config_values,
    check_generation_kwargs,
    is_generation_config_field,
    tokenize_prompts,
    with_generation_kwargs,
)
from lit_grpo.rollout.records import Rollout

__all__ = ["SAMPLERS", "PolicyEngine", "generate_completions", "generate_from_ids", "weights_cast_once"]


def sample_with_generate(
    model: PreTrainedModel, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, num_generations: int, config: GenerationConfig
) -> torch.Tensor:
    """``[B * G, C]`` completion tokens from Hugging Face ``generate`` on the prompts repeated G times."""
    repeated_ids = prompt_ids.repeat_interleave(num_generations, dim=0)  # [N, P]
    repeated_mask = prompt_mask.repeat_interleave(num_generations, dim=0)  # [N, P]
    # synced_gpus=False: each rank decodes on its own (with FSDP2 the caller has gathered the
    # weights, see lit_grpo.distributed), so ranks that finish early do not run dummy steps.
    output = model.generate(input_ids=repeated_ids, attention_mask=repeated_mask, generation_config=config, synced_gpus=False)
    return output[:, repeated_ids.size(1) :]  # [N, C]


def sample_with_group_sampler(
    model: PreTrainedModel, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, num_generations: int, config: GenerationConfig
) -> torch.Tensor:
    """``[B * G, C]`` from the ``lit`` group sampler, or from ``generate`` (with a warning) for what
    it does not implement."""
    reason = lit_sampler_unsupported(model, config)
    if reason is not None:
        warnings.warn(
            f"model.generation_backend=lit does not implement {reason}; sampling with transformers' generate",
            stacklevel=4,
        )
        return sample_with_generate(model, prompt_ids, prompt_mask, num_generations, config)
    return sample_groups(model, prompt_ids, prompt_mask, num_generations, config)


# name -> (model, prompt_ids [B, P], prompt_mask [B, P], G, generation config) -> completion ids [B * G, C]
SAMPLERS: dict[str, Callable[..., torch.Tensor]] = {"lit": sample_with_group_sampler, "transformers": sample_with_generate}


@torch.no_grad()
def generate_completions(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompt_texts: list[str],
    num_generations: int,
    generation_config: GenerationConfig,
    max_prompt_length: int | None = None,
    backend: str = "lit",
) -> Rollout:
    """Sample ``num_generations`` completions for each prompt text with ``backend`` (see the module doc)."""
    device = next(model.parameters()).device
    prompt_ids, prompt_mask, prompt_truncated = tokenize_prompts(tokenizer, prompt_texts, max_prompt_length, device)  # [B, P]
    return generate_from_ids(
        model, prompt_ids, prompt_mask, prompt_truncated, num_generations, generation_config, tokenizer.pad_token_id, backend
    )


def generate_from_ids(
    model: PreTrainedModel,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    prompt_truncated: torch.Tensor,
    num_generations: int,
    generation_config: GenerationConfig,
    pad_token_id: int,
    backend: str = "lit",
) -> Rollout:
    """:func:`generate_completions` from left-padded prompt tokens ``[B, P]`` (a multi-turn rollout's
    contexts are tokens: decoding and re-encoding them would not give the same tokens back)."""
    if backend not in SAMPLERS:
        raise ConfigError(f"generate_completions samples with {tuple(SAMPLERS)}, got {backend!r} (vLLM: lit_grpo.rollout.engines)")
    device = prompt_ids.device
    # Sample in eval mode: no dropout, and gradient checkpointing (active in training mode only)
    # would turn the KV cache off.
    was_training = model.training
    model.eval()
    try:
        with weights_cast_once(device.type), cpu.sampling(model, device):
            completion_ids = SAMPLERS[backend](model, prompt_ids, prompt_mask, num_generations, generation_config)
    finally:
        model.train(was_training)
    completion_mask, is_truncated = completion_mask_from_ids(completion_ids, generation_config.eos_token_id)
    completion_ids = completion_ids.masked_fill(completion_mask == 0, pad_token_id)
    repeated_ids, repeated_mask, repeated_truncated = (
        tensor.repeat_interleave(num_generations, dim=0) for tensor in (prompt_ids, prompt_mask, prompt_truncated)
    )  # [N, P], [N, P], [N]
    rollout = Rollout(repeated_ids, repeated_mask, completion_ids, completion_mask, is_truncated, repeated_truncated)
    return rollout.trimmed()


@contextmanager
def weights_cast_once(device_type: str) -> Iterator[None]:
    """Under autocast every linear layer casts its float32 weight to the half dtype at each call,
    and Lightning turns autocast's cache of those casts off (its optimizer steps change the weights
    inside the autocast block). While a batch is sampled the weights do not change: within this
    block each trainable weight is cast once (autocast caches casts of leaf tensors that require
    grad), and the cache is emptied on exit so that no stale copy outlives the block."""
    if not torch.is_autocast_enabled(device_type):
        yield
        return
    with torch.autocast(device_type, dtype=torch.get_autocast_dtype(device_type), cache_enabled=True):
        try:
            yield
        finally:
            torch.clear_autocast_cache()


class PolicyEngine(GenerationEngine):
    """``model.generation_backend: lit`` or ``transformers``: the policy samples its own completions.

    :meth:`sync_weights` only takes the policy and its version (there is no copy to update); under
    FSDP2 the weights are gathered once for a whole call (a collective: a rank without prompts still
    joins it)."""

    @classmethod
    def check_run(cls, hp) -> None:
        """``model.generation_kwargs`` are ``GenerationConfig`` fields, with values transformers takes (one line
        otherwise), and a warning names those that change the sampled distribution; no vLLM-only setting."""
        if optional_setting(hp, "vllm_structured_outputs_regex") is not None:
            raise ConfigError(f"model.vllm_structured_outputs_regex needs a vLLM backend (vLLM's structured outputs): set "
                              f"model.generation_backend: vllm or vllm_server, got {hp.generation_backend}")
        arguments = backend_generation_kwargs(hp)
        check_generation_kwargs(arguments, is_generation_config_field, hp.generation_backend,
                                "transformers' GenerationConfig fields")
        check_generation_config_values(arguments)
        warn_unrecomputed_arguments(hp, engine_logprobs_corrected=False)  # no engine log-probs to compare with

    @classmethod
    def for_run(cls, hp, model_source: Any, precision: str, grows_with_tools: bool) -> PolicyEngine:
        return cls(hp.generation_backend, backend_generation_kwargs(hp))

    def __init__(self, backend: str, generation_kwargs: dict | None = None) -> None:
        if backend not in SAMPLERS:
            raise ConfigError(f"model.generation_backend: the policy samples with {tuple(SAMPLERS)}, got {backend!r}")
        self.backend = backend
        # model.generation_kwargs (GenerationConfig fields) set on every call's config; the lit sampler hands
        # those it does not implement to generate (SAMPLERS)
        self.generation_kwargs = dict(generation_kwargs or {})
        self.policy: torch.nn.Module | None = None
        self.version: int | None = None

    def sync_weights(self, policy: torch.nn.Module, version: int) -> float:
        self.policy, self.version = policy, version
        return 0.0

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, prompt_truncated: torch.Tensor,
                 num_generations: int, config: GenerationConfig, pad_token_id: int) -> Rollout | None:
        with gathered_for_generation(self.policy):  # FSDP2: gather the weights once, not per token
            if len(prompt_ids) == 0:
                return None
            rollout = generate_from_ids(self.policy, prompt_ids, prompt_mask, prompt_truncated, num_generations,
                                        with_generation_kwargs(config, self.generation_kwargs), pad_token_id, backend=self.backend)
        rollout.weight_versions = torch.full((len(rollout.completion_ids),), self.version or 0, device=prompt_ids.device)
        return rollout

    def max_sequence_length(self) -> int | None:
        return getattr(self.policy.config, "max_position_embeddings", None)
