"""What a generation engine is given: prompts as token ids, and the sampling settings of a run.

The policy model is a ``transformers`` causal LM; prompts are plain strings or chat message lists
(rendered with the tokenizer's chat template and a generation prompt, :func:`render_prompts`), then
tokenized, left-padded (:func:`tokenize_prompts`). The engines that sample from them are in
:mod:`lit_grpo.rollout.engines`; every prompt gets G completions, and rows ``g*G .. g*G+G-1`` of every tensor
form the group of prompt ``g`` (:class:`lit_grpo.rollout.records.Rollout`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from transformers import GenerationConfig, PreTrainedTokenizerBase

from lit_grpo.errors import ConfigError
from lit_grpo.rollout.records import is_conversational
from lit_grpo.settings import EvaluationSettings, GenerationSettings, SamplingSettings

__all__ = [
    "ENGINE_SET_ARGUMENTS",
    "NO_CHAT_TEMPLATE",
    "check_arguments_build",
    "check_generation_config_values",
    "check_generation_kwargs",
    "generation_config",
    "is_generation_config_field",
    "run_generation_configs",
    "render_prompts",
    "tokenize_prompts",
    "with_generation_kwargs",
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


def run_generation_configs(
    sampling: SamplingSettings,
    generation: GenerationSettings,
    evaluation: EvaluationSettings,
    tokenizer: PreTrainedTokenizerBase,
    eos_token_ids: list[int],
) -> tuple[GenerationConfig, GenerationConfig]:
    """The training and the validation sampling settings of a run, from its setting records (validation
    samples at ``evaluation.temperature_eval`` when set, else at the training temperature)."""
    common = dict(
        max_new_tokens=generation.max_completion_length,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        min_p=sampling.min_p,
        repetition_penalty=sampling.repetition_penalty,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=eos_token_ids,
        bos_token_id=tokenizer.bos_token_id,
    )
    eval_temperature = sampling.temperature if evaluation.temperature_eval is None else evaluation.temperature_eval
    return (generation_config(temperature=sampling.temperature, **common),
            generation_config(temperature=eval_temperature, **common))


# What the engines set themselves, whatever model.generation_kwargs says, and how (after "lit-grpo sets it ")
ENGINE_SET_ARGUMENTS = {
    "max_new_tokens": "from model.max_completion_length", "max_length": "from model.max_completion_length",
    "max_tokens": "from model.max_completion_length", "n": "from model.num_generations",
    "num_return_sequences": "from model.num_generations",
    "do_sample": "(training samples; model.temperature_eval: 0 decodes validation greedily)",
    "pad_token_id": "from the tokenizer", "bos_token_id": "from the tokenizer",
    "eos_token_id": "to every EOS id of the model and the tokenizer",
    "stop_token_ids": "to every EOS id of the model and the tokenizer",
    "return_dict_in_generate": "(it reads the token ids)", "seed": "(each call's, from the run's checkpointed generator)",
    "logprobs": "(the sampled tokens' log-probs)", "flat_logprobs": "(the engine's)",
    "detokenize": "(token ids in, token ids out)", "output_kind": "(the engine's)",
}


def check_generation_kwargs(arguments: dict, known: Callable[[str], bool], backend: str, takes: str) -> None:
    """One line naming the first argument of ``model.generation_kwargs`` (less its sampling-distribution ones,
    :func:`lit_grpo.config.backend_generation_kwargs`) that an engine sets itself, or that ``backend`` does
    not take (``known``: whether it does; ``takes``: what it takes, for the message)."""
    for name in arguments:
        if name in ENGINE_SET_ARGUMENTS:
            raise ConfigError(f"model.generation_kwargs.{name}: lit-grpo sets it {ENGINE_SET_ARGUMENTS[name]}")
        if not known(name):
            raise ConfigError(f"model.generation_kwargs.{name}: model.generation_backend {backend} takes {takes}, "
                              f"which have no {name!r}")


def is_generation_config_field(name: str) -> bool:
    """Whether ``name`` is a field of ``transformers``' ``GenerationConfig`` (one of its ``to_dict`` keys: not a
    method such as ``validate``, which ``update`` would overwrite)."""
    return name in GenerationConfig().to_dict()


def check_generation_config_values(arguments: dict) -> None:
    """One line naming what ``transformers`` refuses in ``arguments`` (``GenerationConfig`` fields, checked by
    :func:`check_generation_kwargs`), at start instead of in ``generate``: a sampling config with them set,
    validated strictly (a value of the wrong kind, or a flag that has no effect when sampling)."""
    def build(values: dict) -> None:
        config = GenerationConfig(do_sample=True)
        config.update(**values)
        config.validate(strict=True)

    check_arguments_build(build, arguments, (ValueError, TypeError))


def check_arguments_build(build: Callable[[dict], object], arguments: dict, refusals: tuple[type[Exception], ...]) -> None:
    """One line where ``build`` (the backend's object of ``arguments``) refuses them with one of ``refusals``,
    naming the argument that it refuses alone too (``model.generation_kwargs`` where only their combination is)."""
    try:
        build(arguments)
        return
    except refusals as error:
        refused = ("model.generation_kwargs", error)
    for name, value in arguments.items():  # arguments valid only together (length_penalty with num_beams) pass above
        try:
            build({name: value})
        except refusals as error:
            refused = (f"model.generation_kwargs.{name}", error)
            break
    raise ConfigError(f"{refused[0]}: {' '.join(str(refused[1]).split())}")


def with_generation_kwargs(config: GenerationConfig, arguments: dict) -> GenerationConfig:
    """A copy of ``config`` with ``arguments`` (``GenerationConfig`` fields, checked) set: ``config`` itself without any."""
    if not arguments:
        return config
    config = copy.deepcopy(config)
    config.update(**arguments)
    return config
