"""Sampling a group of completions per prompt with Hugging Face ``generate``.

The policy model is a ``transformers`` causal LM; prompts are either plain strings or chat message
lists (rendered with the tokenizer's chat template and a generation prompt). Every prompt is
repeated G times so that rows ``g*G .. g*G+G-1`` of every tensor form the group of prompt ``g``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from lit_grpo.algorithm import completion_mask_from_ids


@dataclass
class Rollout:
    """The completions of one generation batch, as tensors on the policy's device. N = B * G."""

    prompt_ids: torch.Tensor  # [N, P] left-padded prompt tokens
    prompt_mask: torch.Tensor  # [N, P] 1 on real prompt tokens
    completion_ids: torch.Tensor  # [N, C] sampled tokens, padding after EOS
    completion_mask: torch.Tensor  # [N, C] 1 on real completion tokens (up to and including EOS)
    is_truncated: torch.Tensor  # [N] bool, True when the completion hit max_completion_length

    @property
    def completion_lengths(self) -> torch.Tensor:  # [N]
        return self.completion_mask.sum(dim=1)

    def select(self, rows: torch.Tensor) -> "Rollout":
        """The rollout restricted to ``rows`` (a micro-batch)."""
        return Rollout(
            prompt_ids=self.prompt_ids[rows],
            prompt_mask=self.prompt_mask[rows],
            completion_ids=self.completion_ids[rows],
            completion_mask=self.completion_mask[rows],
            is_truncated=self.is_truncated[rows],
        )

    def trimmed(self) -> "Rollout":
        """Drop the prompt columns that are padding in every row and completion columns after the
        longest completion, so a micro-batch costs only as much as its longest sequence."""
        first_prompt_col = int(self.prompt_mask.any(dim=0).int().argmax()) if self.prompt_mask.any() else 0
        completion_cols = int(self.completion_mask.any(dim=0).sum())
        return Rollout(
            prompt_ids=self.prompt_ids[:, first_prompt_col:],
            prompt_mask=self.prompt_mask[:, first_prompt_col:],
            completion_ids=self.completion_ids[:, :completion_cols],
            completion_mask=self.completion_mask[:, :completion_cols],
            is_truncated=self.is_truncated,
        )


def concat_rollouts(rollouts: list[Rollout], pad_token_id: int) -> Rollout:
    """Stack rollouts of different widths: prompts left-padded, completions right-padded."""
    prompt_width = max(r.prompt_ids.size(1) for r in rollouts)
    completion_width = max(r.completion_ids.size(1) for r in rollouts)

    def pad(tensor: torch.Tensor, width: int, value: int, left: bool) -> torch.Tensor:
        missing = width - tensor.size(1)
        return torch.nn.functional.pad(tensor, (missing, 0) if left else (0, missing), value=value)

    return Rollout(
        prompt_ids=torch.cat([pad(r.prompt_ids, prompt_width, pad_token_id, True) for r in rollouts]),
        prompt_mask=torch.cat([pad(r.prompt_mask, prompt_width, 0, True) for r in rollouts]),
        completion_ids=torch.cat([pad(r.completion_ids, completion_width, pad_token_id, False) for r in rollouts]),
        completion_mask=torch.cat([pad(r.completion_mask, completion_width, 0, False) for r in rollouts]),
        is_truncated=torch.cat([r.is_truncated for r in rollouts]),
    )


def is_conversational(prompt) -> bool:
    """A prompt is conversational when it is a list of chat messages."""
    return isinstance(prompt, list)


def render_prompts(tokenizer: PreTrainedTokenizerBase, prompts: list) -> list[str]:
    """Prompt texts as the model sees them: chat messages go through the chat template."""
    texts = []
    for prompt in prompts:
        if is_conversational(prompt):
            if tokenizer.chat_template is None:
                raise ValueError(
                    "The data has chat-message prompts but the tokenizer has no chat template; "
                    "use plain-string prompts or a tokenizer with a chat_template."
                )
            texts.append(tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True))
        else:
            texts.append(prompt)
    return texts


def tokenize_prompts(
    tokenizer: PreTrainedTokenizerBase, texts: list[str], max_prompt_length: int | None, device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompt ids and mask ``[B, P]``; prompts longer than ``max_prompt_length`` keep
    their last tokens (the end of a prompt is what the completion continues)."""
    encoded = tokenizer(
        texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False
    )
    prompt_ids, prompt_mask = encoded["input_ids"], encoded["attention_mask"]
    if max_prompt_length is not None and prompt_ids.size(1) > max_prompt_length:
        prompt_ids, prompt_mask = prompt_ids[:, -max_prompt_length:], prompt_mask[:, -max_prompt_length:]
    return prompt_ids.to(device), prompt_mask.to(device)


@torch.no_grad()
def generate_completions(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompt_texts: list[str],
    num_generations: int,
    generation_config: GenerationConfig,
    max_prompt_length: int | None = None,
) -> Rollout:
    """Sample ``num_generations`` completions for each prompt text (KV-cached ``generate``)."""
    device = next(model.parameters()).device
    prompt_ids, prompt_mask = tokenize_prompts(tokenizer, prompt_texts, max_prompt_length, device)
    prompt_ids = prompt_ids.repeat_interleave(num_generations, dim=0)  # [N, P]
    prompt_mask = prompt_mask.repeat_interleave(num_generations, dim=0)  # [N, P]
    # synced_gpus=False: each rank decodes on its own (with FSDP2 the caller has gathered the
    # weights, see lit_grpo.distributed), so ranks that finish early do not run dummy steps.
    # Sample in eval mode: no dropout, and gradient checkpointing (active in training mode only)
    # would turn the KV cache off.
    was_training = model.training
    model.eval()
    try:
        output = model.generate(
            input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=generation_config, synced_gpus=False
        )  # [N, P + C]
    finally:
        model.train(was_training)
    completion_ids = output[:, prompt_ids.size(1) :]  # [N, C]
    completion_mask, is_truncated = completion_mask_from_ids(completion_ids, generation_config.eos_token_id)
    completion_ids = completion_ids.masked_fill(completion_mask == 0, tokenizer.pad_token_id)
    return Rollout(prompt_ids, prompt_mask, completion_ids, completion_mask, is_truncated).trimmed()


def decode_completions(tokenizer: PreTrainedTokenizerBase, rollout: Rollout) -> tuple[list[str], list[list[int]]]:
    """Completion texts (special tokens removed) and their real token ids, one per completion."""
    completion_ids = [
        ids[mask.bool()].tolist() for ids, mask in zip(rollout.completion_ids, rollout.completion_mask)
    ]
    texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    return texts, completion_ids


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, as ``generate`` assigns them: ``[n, L] -> [n, L]``."""
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)
