"""Sampling a group of G completions per prompt, with a choice of backends.

The policy model is a ``transformers`` causal LM; prompts are plain strings or chat message lists
(rendered with the tokenizer's chat template and a generation prompt, :func:`render_prompts`). Every
prompt is repeated G times so that rows ``g*G .. g*G+G-1`` of every tensor form the group of prompt
``g`` (:class:`lit_grpo.rollout.Rollout`).

Backends (``model.generation_backend``; :data:`SAMPLERS` maps each name to a function from left-padded
prompt ids to completion ids, so another backend is one more entry):

* ``"lit"`` (default): the group sampler of :mod:`lit_grpo.group_sampler` (each prompt encoded once,
  KV cache written in place, finished completions leave the batch). For models or generation options
  it does not implement it falls back to ``generate``, with a warning.
* ``"transformers"``: Hugging Face ``generate`` on the prompts repeated G times.
* ``"vllm"``: a colocated vLLM engine (:mod:`lit_grpo.vllm_backend`, an optional extra), which keeps
  state between calls (its own copy of the weights) and so is driven by the module.

Both give the same completions for the same settings (greedy decoding gives the same tokens;
sampling draws from the same distribution), and both stop at every EOS id of the generation config.
CPU-only speed-ups around sampling live in :mod:`lit_grpo.cpu` (:func:`lit_grpo.cpu.sampling`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from lit_grpo import cpu
from lit_grpo.algorithm import completion_mask_from_ids
from lit_grpo.errors import ConfigError
from lit_grpo.group_sampler import lit_sampler_unsupported, sample_groups
from lit_grpo.rollout import Rollout, is_conversational

__all__ = [
    "GENERATION_BACKENDS",
    "NO_CHAT_TEMPLATE",
    "SAMPLERS",
    "generate_completions",
    "generate_from_ids",
    "generation_config",
    "run_generation_configs",
    "render_prompts",
    "tokenize_prompts",
    "weights_cast_once",
]


NO_CHAT_TEMPLATE = (
    "the prompts are chat messages (a conversational prompt column, data.conversational or "
    "data.system_prompt) but the tokenizer of {model} has no chat template; give plain-string prompts "
    "without data.conversational/data.system_prompt, or use a tokenizer with a chat_template"
)


def render_prompts(
    tokenizer: PreTrainedTokenizerBase, prompts: list, chat_template_kwargs: dict | None = None
) -> list[str]:
    """Prompt texts as the model sees them: chat messages go through the chat template (with a
    generation prompt and ``chat_template_kwargs``); strings are given as they are."""
    texts = []
    for prompt in prompts:
        if is_conversational(prompt):
            if tokenizer.chat_template is None:
                raise ConfigError(NO_CHAT_TEMPLATE.format(model=repr(tokenizer.name_or_path)))
            texts.append(
                tokenizer.apply_chat_template(
                    prompt, tokenize=False, add_generation_prompt=True, **(chat_template_kwargs or {})
                )
            )
        else:
            texts.append(prompt)
    return texts


def tokenize_prompts(
    tokenizer: PreTrainedTokenizerBase, texts: list[str], max_prompt_length: int | None, device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-padded prompt ids and mask ``[B, P]``, and which prompts ``[B]`` were cut: prompts longer
    than ``max_prompt_length`` keep their last tokens (the end of a prompt is what the completion
    continues)."""
    encoded = tokenizer(
        texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False
    )
    prompt_ids, prompt_mask = encoded["input_ids"], encoded["attention_mask"]
    truncated = torch.zeros(prompt_ids.size(0), dtype=torch.bool)  # [B]
    if max_prompt_length is not None and prompt_ids.size(1) > max_prompt_length:
        truncated = prompt_mask.sum(dim=1) > max_prompt_length
        prompt_ids, prompt_mask = prompt_ids[:, -max_prompt_length:], prompt_mask[:, -max_prompt_length:]
    return prompt_ids.to(device), prompt_mask.to(device), truncated.to(device)


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
# and an engine with state of its own: ``vllm`` (lit_grpo.vllm_backend.VLLMSampler, the module drives it)
GENERATION_BACKENDS = (*SAMPLERS, "vllm")


def generation_config(
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float | None = None,
    repetition_penalty: float = 1.0,
    pad_token_id: int | None,
    eos_token_id: list[int],
    bos_token_id: int | None = None,
) -> GenerationConfig:
    """The sampling settings of a run; ``temperature`` 0 decodes greedily (validation's
    ``temperature_eval: 0``), where the sampling filters do not apply."""
    common = dict(
        max_new_tokens=max_new_tokens,
        repetition_penalty=repetition_penalty,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_id,  # every id that ends a turn: the model's and the tokenizer's
        bos_token_id=bos_token_id,
    )
    if temperature == 0:
        return GenerationConfig(do_sample=False, **common)
    return GenerationConfig(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, **common)


def run_generation_configs(hp, tokenizer: PreTrainedTokenizerBase, eos_token_ids: list[int]) -> tuple[GenerationConfig, GenerationConfig]:
    """The training and the validation sampling settings of a run (``hp``: the module's settings;
    validation samples at ``temperature_eval`` when set)."""
    sampling = dict(
        max_new_tokens=hp.max_completion_length,
        top_p=hp.top_p,
        top_k=hp.top_k,
        min_p=hp.min_p,
        repetition_penalty=hp.repetition_penalty,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=eos_token_ids,
        bos_token_id=tokenizer.bos_token_id,
    )
    eval_temperature = hp.temperature if hp.temperature_eval is None else hp.temperature_eval
    return generation_config(temperature=hp.temperature, **sampling), generation_config(temperature=eval_temperature, **sampling)


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
        raise ConfigError(f"generate_completions samples with {tuple(SAMPLERS)}, got {backend!r} (vllm: lit_grpo.vllm_backend)")
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
