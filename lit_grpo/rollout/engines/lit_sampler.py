"""The ``lit`` sampler: a decode loop made for groups of completions of the same prompt.

1. Prefill: each prompt goes through the model once; its KV cache is copied to its G completions.
2. Decode: one token per running completion per step, chosen by ``transformers``' own logits
   processors in the order ``generate`` applies them (so greedy decoding gives ``generate``'s tokens
   and sampling draws from the same distribution). Keys and values are written in place into a
   buffer (:class:`PreallocatedKVLayer`) instead of being concatenated at every token.
3. Completions that have emitted an EOS leave the batch (and the cache), so the cost of a step
   follows the completions still running.

:func:`lit_sampler_unsupported` says when it cannot serve a model or generation option; the caller
(:mod:`lit_grpo.rollout.engines.policy`) then samples with ``generate``.
"""

from __future__ import annotations

import functools

import torch
from transformers import GenerationConfig, PreTrainedModel
from transformers.cache_utils import Cache, DynamicLayer
from transformers.generation import (
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from lit_grpo import cpu
from lit_grpo.models import cache_argument, partial_kv_cache_reason, text_config

__all__ = ["LIT_SAMPLER_OPTIONS", "PreallocatedKVLayer", "generation_config_eos_ids", "lit_sampler_unsupported", "penalty_skips_left_padding",
           "sample_groups"]

# GenerationConfig fields the "lit" sampler implements; any other non-default field goes to generate
LIT_SAMPLER_OPTIONS = frozenset(
    {
        "max_new_tokens", "min_new_tokens", "do_sample", "temperature", "top_k", "top_p", "min_p",
        "repetition_penalty", "sequence_bias", "pad_token_id", "bos_token_id", "eos_token_id",
        "transformers_version",
    }
)


def lit_sampler_unsupported(model: torch.nn.Module, generation_config: GenerationConfig) -> str | None:
    """Why :func:`sample_groups` cannot serve this model and config (None when it can)."""
    options = set(generation_config.to_diff_dict()) - LIT_SAMPLER_OPTIONS
    if options:
        return f"generation options {sorted(options)}"
    return partial_kv_cache_reason(model)


class PreallocatedKVLayer(DynamicLayer):
    """One decoder layer's KV cache, written in place into a buffer instead of concatenated.

    ``transformers``' ``DynamicLayer`` concatenates every new token's keys and values onto copies of
    the whole cache (quadratic copying over a completion). This layer writes each token into a
    buffer ``[n, heads, size, head_dim]`` and hands attention

    * without ``block``: views of the filled part of one buffer of ``capacity`` positions,
      allocated at the first update;
    * with ``block`` (the sampler's choice on the CPU in half precision): the whole buffer, which
      grows by ``block`` positions at a time (a copy every ``block`` tokens). Attention there
      multiplies the keys and values as matrices (:mod:`lit_grpo.cpu.attention`) and has to copy a view
      of the first S positions of a longer buffer (not contiguous) first: the whole cache, at every
      step and layer. The positions not yet written hold zeros and the attention mask
      covers the whole buffer (:meth:`get_mask_sizes`; the 2D mask is padded with zeros, as for
      ``transformers``' ``StaticCache``), so they get zero weight.

    Under autocast the buffer holds the autocast dtype: attention would cast the whole cache to it
    at every step anyway (rotary embeddings hand over float32 keys), so storing it cast once gives
    the same attention inputs with half the memory traffic.
    """

    def __init__(self, capacity: int, block: int | None = None):
        super().__init__()
        self.capacity = capacity
        self.block = block
        self.length = 0

    @property
    def grows(self) -> bool:
        """Whether the buffer grows by blocks and attention gets all of it (see the class doc)."""
        return self.block is not None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        autocast = torch.is_autocast_enabled(self.device.type)
        self.dtype = torch.get_autocast_dtype(self.device.type) if autocast else key_states.dtype
        n, size = key_states.size(0), 0 if self.grows else self.capacity
        self.key_buffer = key_states.new_zeros(n, key_states.size(1), size, key_states.size(-1), dtype=self.dtype)
        self.value_buffer = value_states.new_zeros(n, value_states.size(1), size, value_states.size(-1), dtype=self.dtype)
        self.is_initialized = True

    def buffer_size(self, length: int) -> int:
        """Positions the buffer has once it holds ``length``: ``length`` rounded up to whole blocks
        when it grows, else the capacity."""
        if not self.grows:
            return self.capacity
        return min(self.capacity, -(-length // self.block) * self.block)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.size(-2)
        if end > self.capacity:
            raise RuntimeError(f"KV cache of {self.capacity} positions cannot hold {end}")
        if end > self.key_buffer.size(2):  # only when it grows: by whole blocks, zeros not yet written
            size = self.buffer_size(end)
            self.key_buffer, self.value_buffer = (
                torch.cat([buffer, buffer.new_zeros(*buffer.shape[:2], size - buffer.size(2), buffer.size(3))], dim=2)
                for buffer in (self.key_buffer, self.value_buffer)
            )
        self.key_buffer[:, :, self.length : end] = key_states
        self.value_buffer[:, :, self.length : end] = value_states
        self.length = end
        self._refresh_views()
        return self.keys, self.values

    def _refresh_views(self) -> None:
        visible = self.key_buffer.size(2) if self.grows else self.length
        self.keys = self.key_buffer[:, :, :visible]  # [n, heads, visible, head_dim]
        self.values = self.value_buffer[:, :, :visible]

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, *args, **kwargs) -> tuple[int, int]:
        """The mask spans the keys :meth:`update` will return: the whole buffer when it grows."""
        kv_length, kv_offset = super().get_mask_sizes(*args, **kwargs)
        return (self.buffer_size(kv_length) if self.grows else kv_length), kv_offset

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Copy every row ``repeats`` times (a prompt's cache to its G completions)."""
        if self.is_initialized:
            self.key_buffer = self.key_buffer.repeat_interleave(repeats, dim=0)
            self.value_buffer = self.value_buffer.repeat_interleave(repeats, dim=0)
            self._refresh_views()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the rows ``indices`` (finished completions leave the batch); copies only the filled part."""
        if self.is_initialized:
            for name in ("key_buffer", "value_buffer"):
                old = getattr(self, name)
                new = old.new_zeros(len(indices), *old.shape[1:])
                new[:, :, : self.length] = old[indices, :, : self.length]
                setattr(self, name, new)
            self._refresh_views()


def logits_processors(generation_config: GenerationConfig, prompt_mask: torch.Tensor) -> LogitsProcessorList:
    """``transformers``' processors for the options of :data:`LIT_SAMPLER_OPTIONS`, in ``generate``'s order
    (processors, then the sampling warpers), for the rows of the left-padded ``prompt_mask`` ``[N, P]``."""
    config, device = generation_config, prompt_mask.device
    prompt_length = prompt_mask.size(1)
    eos = torch.tensor(generation_config_eos_ids(config), device=device)
    processors = LogitsProcessorList()
    if config.sequence_bias is not None:
        processors.append(SequenceBiasLogitsProcessor(sequence_bias=config.sequence_bias))
    if config.repetition_penalty is not None and config.repetition_penalty != 1.0:
        # as generate: the left padding of each row is not penalised (a per-row tensor, see select_rows)
        padding_lengths = (prompt_mask != 0).int().argmax(dim=1)  # [N]
        try:
            penalty = RepetitionPenaltyLogitsProcessor(config.repetition_penalty, prompt_ignore_length=padding_lengths)
        except ValueError:  # transformers < 5.23 takes no per-row length, and its generate penalises padding too
            penalty = RepetitionPenaltyLogitsProcessor(config.repetition_penalty)
        processors.append(penalty)
    if config.min_new_tokens is not None and config.min_new_tokens > 0:
        processors.append(MinNewTokensLengthLogitsProcessor(prompt_length, config.min_new_tokens, eos, device=device))
    if config.do_sample:
        if config.temperature is not None and config.temperature != 1.0:
            processors.append(TemperatureLogitsWarper(config.temperature))
        if config.top_k is not None and config.top_k != 0:
            processors.append(TopKLogitsWarper(top_k=config.top_k))
        if config.top_p is not None and config.top_p < 1.0:
            processors.append(TopPLogitsWarper(top_p=config.top_p))
        if config.min_p is not None:
            processors.append(MinPLogitsWarper(min_p=config.min_p))
    return processors


@functools.cache
def penalty_skips_left_padding() -> bool:
    """Whether this ``transformers``' repetition penalty leaves each row's left padding out (>= 5.23:
    ``generate`` and :func:`logits_processors` do); older versions penalise the pad id of padded rows."""
    try:
        RepetitionPenaltyLogitsProcessor(1.5, prompt_ignore_length=torch.zeros(1, dtype=torch.long))
    except (TypeError, ValueError):
        return False
    return True


def select_rows(processors: LogitsProcessorList, keep: torch.Tensor) -> None:
    """Keep the per-row state of ``processors`` for the rows ``keep`` only."""
    for processor in processors:
        if isinstance(getattr(processor, "prompt_ignore_length", None), torch.Tensor):
            processor.prompt_ignore_length = processor.prompt_ignore_length[keep]


def generation_config_eos_ids(generation_config: GenerationConfig) -> list[int]:
    """``generation_config.eos_token_id`` as a list (it may be None, one id or several)."""
    eos = generation_config.eos_token_id
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def prefill(model: PreTrainedModel, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, num_generations: int,
            max_new_tokens: int) -> tuple[Cache, torch.Tensor, torch.Tensor]:
    """Step 1 of :func:`sample_groups`: the left-padded prompts ``[B, P]`` go through the model once,
    into a cache of ``P + max_new_tokens`` positions, of which each of a prompt's G completions then
    gets a copy. Returns that cache, the logits of each completion's first token ``[B * G, V]`` and
    the position of its next token ``[B * G]``."""
    P, G = prompt_ids.size(1), num_generations
    block = cpu.kv_cache_block(model, prompt_ids.device)  # see PreallocatedKVLayer
    layers = text_config(model).num_hidden_layers
    cache = Cache(layers=[PreallocatedKVLayer(P + max_new_tokens, block) for _ in range(layers)])
    with_cache = cache_argument(model, cache)
    positions = (prompt_mask.long().cumsum(dim=-1) - 1).clamp(min=0)  # [B, P]
    logits = model(
        input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=positions, **with_cache,
        use_cache=True, logits_to_keep=1,
    ).logits[:, -1].float()  # [B, V]
    for layer in cache.layers:
        layer.batch_repeat_interleave(G)
    next_position = positions[:, -1] + 1  # [B]
    return cache, logits.repeat_interleave(G, dim=0), next_position.repeat_interleave(G)


def draw_tokens(scores: torch.Tensor, do_sample: bool) -> torch.Tensor:
    """One token per row of the processed ``scores`` ``[n, V]``: drawn from their softmax, or the
    argmax without ``do_sample``; ``[n]``."""
    if do_sample:
        return torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
    return scores.argmax(dim=-1)


@torch.no_grad()
def sample_groups(model: PreTrainedModel, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, num_generations: int,
                  generation_config: GenerationConfig, compact_fraction: float = 0.125,
                  return_logprobs: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``[B * G, C]`` completion tokens for the left-padded prompts ``[B, P]``, G per prompt (pad after EOS),
    and with ``return_logprobs`` the log-probs ``[B * G, C]`` of the distribution each token was drawn
    from (``log_softmax`` of the processed scores: what vLLM calls ``processed_logprobs``; 0 after EOS).

    1. Prefill: the B prompts go through the model once; their KV caches are copied G times.
    2. Decode: one token per running completion per step, chosen by the logits processors
       (multinomial sampling, or argmax without ``do_sample``).
    3. A completion that emits EOS stops; once finished rows make up ``compact_fraction`` of the
       batch they are removed from it (and from the cache), so later steps cost less.
    """
    (B, P), G, max_new = prompt_ids.shape, num_generations, generation_config.max_new_tokens
    N, device = B * G, prompt_ids.device
    pad_token_id = generation_config.pad_token_id if generation_config.pad_token_id is not None else 0
    eos = torch.tensor(generation_config_eos_ids(generation_config), device=device, dtype=torch.long)
    repeated_mask = prompt_mask.repeat_interleave(G, dim=0)  # [N, P]
    processors = logits_processors(generation_config, repeated_mask)

    # 1. Prefill once per prompt, then give each completion its own copy of the prompt's cache.
    cache, logits, next_position = prefill(model, prompt_ids, prompt_mask, G, max_new)  # [N, V], [N]
    with_cache = cache_argument(model, cache)
    # every completion's tokens so far (prompt, then sampled) and attention mask, for all steps
    token_ids = torch.cat([prompt_ids.repeat_interleave(G, dim=0), prompt_ids.new_full((N, max_new), pad_token_id)], dim=1)
    attention_mask = torch.cat([repeated_mask, prompt_mask.new_ones(N, max_new)], dim=1)
    completions = prompt_ids.new_full((N, max_new), pad_token_id)  # [N, C] the result
    completion_logps = torch.zeros(N, max_new, device=device)  # [N, C] with return_logprobs
    running_logps = torch.zeros(N, max_new, device=device)  # [n, C] the rows in the batch
    rows = torch.arange(N, device=device)  # the completions still in the batch (indices into N)
    finished = torch.zeros(N, dtype=torch.bool, device=device)  # per row in the batch

    # 2-3. Decode.
    for t in range(max_new):
        scores = processors(token_ids[:, : P + t], logits)  # [n, V]
        next_tokens = draw_tokens(scores, generation_config.do_sample).masked_fill(finished, pad_token_id)  # [n]
        token_ids[:, P + t] = next_tokens
        if return_logprobs:
            step_logps = torch.log_softmax(scores, dim=-1).gather(1, next_tokens[:, None]).squeeze(1)  # [n]
            running_logps[:, t] = step_logps.masked_fill(finished, 0.0)
        finished = finished | torch.isin(next_tokens, eos)
        if t == max_new - 1 or bool(finished.all()):
            break
        if int(finished.sum()) >= max(1, compact_fraction * len(rows)):
            keep = (~finished).nonzero().squeeze(1)
            completions[rows] = token_ids[:, P:]  # the leaving rows' tokens are final
            completion_logps[rows] = running_logps
            rows, token_ids, attention_mask, running_logps = rows[keep], token_ids[keep], attention_mask[keep], running_logps[keep]
            next_tokens, next_position, finished = next_tokens[keep], next_position[keep], finished[keep]
            for layer in cache.layers:
                layer.batch_select_indices(keep)
            select_rows(processors, keep)
        step = model(input_ids=next_tokens[:, None], attention_mask=attention_mask[:, : P + t + 1],
                     position_ids=next_position[:, None], **with_cache, use_cache=True)
        logits = step.logits[:, -1].float()  # [n, V]
        next_position = next_position + 1
    completions[rows], completion_logps[rows] = token_ids[:, P:], running_logps
    return (completions, completion_logps) if return_logprobs else completions
