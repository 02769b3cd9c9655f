"""Log-prob forwards that encode each distinct prompt once.

Every log-prob pass of a GRPO step (the training forward, the old policy's and the reference model's)
sees G completions of each prompt. A causal model computes the same keys and values for the prompt
tokens in all G rows, so the prompt can go through the model once per *distinct* prompt and each
completion attend to a copy of its prompt's KV cache:

    prompt forward     [U, P]         -> KV cache [U, heads, P, head_dim], logits at position P - 1
    completion forward [n, C - 1]     -> logits at positions P .. P + C - 2, attending to the cache
                                         rows of its prompt (index ``row_prompt``)

Together these are the logits of one forward over ``[prompt, completion]``: position ``P - 1``
predicts completion token 0 and position ``P + t`` predicts token ``t + 1``. With the fused LM head
(:mod:`lit_grpo.algorithm.fused_lm_head`; ``head`` given) both forwards return hidden states instead
(the prompt's last position ``[U, H]``, the completion's ``[n, C - 1, H]``) and no logits at all. The copy is an index, so
in the backward pass the G rows' gradients with respect to the prompt's keys and values add up in the
shared prompt activations, as they would in G separate forwards. The prompt part costs ``U x P``
tokens instead of ``n x P`` (U distinct prompts among n rows), forward and backward.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, DynamicLayer

from lit_grpo.models import OutputHead, cache_argument, decoder_hidden_states, partial_kv_cache_reason, text_config
from lit_grpo.rollout.records import position_ids_from_mask

__all__ = [
    "PromptGroups",
    "PromptPrefix",
    "completion_hidden_states",
    "completion_logits",
    "distinct_prompts",
    "encode_prompts",
    "shared_prompt_unsupported",
]


@dataclass
class PromptPrefix:
    """The distinct prompts of some rows, encoded once."""

    keys: list[torch.Tensor]  # per decoder layer [U, kv_heads, P, head_dim]
    values: list[torch.Tensor]  # per decoder layer [U, kv_heads, P, head_dim]
    last_logits: torch.Tensor | None  # [U, V] logits at the last prompt position (they predict completion token 0)
    row_prompt: torch.Tensor  # [n] index of each row's prompt among the U
    prompt_mask: torch.Tensor  # [U, P] the distinct prompts' attention masks
    last_hidden: torch.Tensor | None = None  # [U, H] instead of last_logits: that position's hidden state (fused head)

    @property
    def last_position(self) -> torch.Tensor:
        """What the last prompt position gives: its logits ``[U, V]`` or its hidden state ``[U, H]``."""
        return self.last_logits if self.last_logits is not None else self.last_hidden

    def select(self, rows: torch.Tensor) -> "PromptPrefix":
        """The prefix of a subset of the rows (the shared tensors are not copied)."""
        return dataclasses.replace(self, row_prompt=self.row_prompt[rows])

    def tensors(self) -> list[torch.Tensor]:
        return [*self.keys, *self.values, self.last_position]

    def detached(self) -> "PromptPrefix":
        """The same prefix as leaf tensors (no copy) that collect the gradient flowing into it, so that
        several backward passes through completions stop there (see :meth:`gradient_surrogate`)."""
        keys, values = ([t.detach().requires_grad_(t.requires_grad) for t in ts] for ts in (self.keys, self.values))
        last = self.last_position.detach().requires_grad_(self.last_position.requires_grad)
        fused = self.last_logits is None
        return PromptPrefix(keys, values, None if fused else last, self.row_prompt, self.prompt_mask, last if fused else None)

    def gradient_surrogate(self, leaves: "PromptPrefix") -> torch.Tensor:
        """A scalar whose gradient with respect to this prefix's tensors is what ``leaves`` (its
        :meth:`detached` copy) collected: one backward of it runs the prompt forward's backward once
        for all the completion backward passes before it."""
        total = self.last_position.sum() * 0.0  # connected to the prompt forward even if nothing reached it
        for tensor, leaf in zip(self.tensors(), leaves.tensors()):
            if leaf.grad is not None:
                total = total + (tensor * leaf.grad).sum()
        return total


def shared_prompt_unsupported(model: torch.nn.Module) -> str | None:
    """Why the prompt of this model cannot be encoded apart from its completions (None when it can).

    Gradient checkpointing drops the KV cache in training (the recomputed layer would append to it a
    second time); caches of sliding-window and linear-attention layers keep only part of the prompt.
    """
    checkpointing = getattr(model, "is_activation_checkpointing", None)  # transformers >= 5.x
    if checkpointing is None:
        checkpointing = getattr(model, "is_gradient_checkpointing", False)
    if checkpointing:
        return "gradient checkpointing"
    return partial_kv_cache_reason(model)


@dataclass
class PromptGroups:
    """Which rows share a prompt."""

    first_row: torch.Tensor  # [U] one row of each distinct prompt
    row_prompt: torch.Tensor  # [n] index of each row's prompt among the U

    def saved_tokens(self, prompt_width: int) -> int:
        """Prompt tokens a shared forward does not run: ``(n - U) x P``."""
        return (self.row_prompt.numel() - self.first_row.numel()) * prompt_width


def distinct_prompts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> PromptGroups:
    """The distinct prompts (ids and mask equal) among the rows ``[n, P]``, in order of first appearance."""
    n = prompt_ids.size(0)
    rows = torch.cat([prompt_ids, prompt_mask.to(prompt_ids.dtype)], dim=1)  # [n, 2P]
    _, sorted_index = torch.unique(rows, dim=0, return_inverse=True)  # [n] in 0 .. U - 1 (sorted order)
    arange = torch.arange(n, device=rows.device)
    first_row = torch.full((int(sorted_index.max()) + 1,), n, device=rows.device, dtype=torch.long)
    first_row = first_row.scatter_reduce(0, sorted_index, arange, "amin")  # [U]
    order = torch.argsort(first_row)  # renumber by first appearance
    row_prompt = torch.argsort(order)[sorted_index]
    return PromptGroups(first_row[order], row_prompt)


def encode_prompts(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    groups: PromptGroups,
    head: OutputHead | None = None,
) -> PromptPrefix:
    """One forward over the distinct prompts among the left-padded rows ``prompt_ids [n, P]``; with
    ``head`` (the fused LM head) the prefix keeps the last position's hidden state, not its logits."""
    unique_ids, unique_mask = prompt_ids[groups.first_row], prompt_mask[groups.first_row]  # [U, P]
    cache = Cache(layers=[DynamicLayer() for _ in range(text_config(model).num_hidden_layers)])
    inputs = dict(
        input_ids=unique_ids,
        attention_mask=unique_mask,
        position_ids=position_ids_from_mask(unique_mask),
        **cache_argument(model, cache),
        use_cache=True,
    )
    logits = hidden = None
    if head is None:
        logits = model(**inputs, logits_to_keep=1).logits[:, -1]  # [U, V]
    else:
        hidden = decoder_hidden_states(model, head, **inputs)[:, -1]  # [U, H]
    return PromptPrefix(
        keys=[layer.keys for layer in cache.layers],
        values=[layer.values for layer in cache.layers],
        last_logits=logits,
        row_prompt=groups.row_prompt,
        prompt_mask=unique_mask,
        last_hidden=hidden,
    )


def completion_inputs(
    model: torch.nn.Module, prefix: PromptPrefix, completion_ids: torch.Tensor, completion_mask: torch.Tensor
) -> dict:
    """The forward arguments of the completions ``[n, C]`` (but their last token, which predicts
    nothing that is scored) after their prompts' KV cache, with positions that skip left padding."""
    cache = Cache(layers=[DynamicLayer() for _ in prefix.keys])
    for layer_idx, (keys, values) in enumerate(zip(prefix.keys, prefix.values)):
        cache.update(keys[prefix.row_prompt], values[prefix.row_prompt], layer_idx)  # [n, kv_heads, P, head_dim]
    prompt_mask = prefix.prompt_mask[prefix.row_prompt]  # [n, P]
    attention_mask = torch.cat([prompt_mask, completion_mask[:, :-1]], dim=1)  # [n, P + C - 1]
    P = prefix.prompt_mask.size(1)
    return dict(
        input_ids=completion_ids[:, :-1],
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask)[:, P:],
        **cache_argument(model, cache),
        use_cache=True,
    )


def completion_logits(
    model: torch.nn.Module, prefix: PromptPrefix, completion_ids: torch.Tensor, completion_mask: torch.Tensor
) -> torch.Tensor:
    """Logits ``[n, C, V]`` predicting each of the completion tokens ``[n, C]`` of the prefix's rows.

    The same values as the last ``C`` positions' logits of one forward over ``[prompt, completion]``
    with positions that skip left padding."""
    first = prefix.last_logits[prefix.row_prompt].unsqueeze(1)  # [n, 1, V] predicts token 0
    if completion_ids.size(1) == 1:
        return first
    rest = model(**completion_inputs(model, prefix, completion_ids, completion_mask)).logits  # [n, C - 1, V]: tokens 1 .. C - 1
    return torch.cat([first.to(rest.dtype), rest], dim=1)


def completion_hidden_states(
    model: torch.nn.Module,
    head: OutputHead,
    prefix: PromptPrefix,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
) -> torch.Tensor:
    """Hidden states ``[n, C, H]`` predicting each of the completion tokens ``[n, C]`` (the fused LM
    head's input; the prefix encoded with ``head``): :func:`completion_logits` before the head."""
    first = prefix.last_hidden[prefix.row_prompt].unsqueeze(1)  # [n, 1, H] predicts token 0
    if completion_ids.size(1) == 1:
        return first
    rest = decoder_hidden_states(model, head, **completion_inputs(model, prefix, completion_ids, completion_mask))
    return torch.cat([first.to(rest.dtype), rest], dim=1)  # rest [n, C - 1, H]: tokens 1 .. C - 1
