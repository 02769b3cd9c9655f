"""Sampling a group of completions per prompt.

The policy model is a ``transformers`` causal LM; prompts are either plain strings or chat message
lists (rendered with the tokenizer's chat template and a generation prompt). Every prompt is
repeated G times so that rows ``g*G .. g*G+G-1`` of every tensor form the group of prompt ``g``.

Two samplers give the same completions for the same settings (greedy decoding gives the same
tokens; sampling draws from the same distribution):

* ``"lit"`` (default), :func:`sample_groups`: a decode loop made for groups. Each prompt is
  encoded once and its KV cache copied to its G completions; keys and values are written in place
  into a buffer (:class:`PreallocatedKVLayer`) instead of concatenated every token; rows that
  have emitted EOS leave the batch, so the cost of a step follows the completions still running.
  The tokens are chosen by ``transformers``' own logits processors, in the order ``generate``
  applies them. Under bf16/fp16 autocast on the CPU, attention is two grouped matrix products
  (:mod:`lit_grpo.attention`) instead of PyTorch's SDPA kernel, which is slower there, and every
  weight is cast to the half dtype once per generation batch instead of at every token; in bf16
  the linear layers' weights are also reordered once per batch into oneDNN's blocked layout
  (:mod:`lit_grpo.prepacked`).
* ``"transformers"``: Hugging Face ``generate`` on the prompts repeated G times; used for models
  with sliding-window or linear-attention layers and generation options the loop does not implement.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase
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

from lit_grpo.algorithm import completion_mask_from_ids
from lit_grpo.attention import (
    HALF_DTYPES,
    cpu_compute_dtype,
    text_config,
    use_cpu_half_attention,
)
from lit_grpo.prepacked import prepacked_linear_weights


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

    def trimmed(self, prompts: bool = True) -> "Rollout":
        """Drop the prompt columns that are padding in every row (unless ``prompts=False``) and
        completion columns after the longest completion, so a micro-batch costs only as much as its
        longest sequence."""
        first_prompt_col = int(self.prompt_mask.any(dim=0).int().argmax()) if prompts and self.prompt_mask.any() else 0
        completion_cols = int(self.completion_mask.any(dim=0).sum())
        return Rollout(
            prompt_ids=self.prompt_ids[:, first_prompt_col:],
            prompt_mask=self.prompt_mask[:, first_prompt_col:],
            completion_ids=self.completion_ids[:, :completion_cols],
            completion_mask=self.completion_mask[:, :completion_cols],
            is_truncated=self.is_truncated,
        )


# a forward pass costs about this many padded tokens' work on top of its tokens (kernel launches,
# Python, small-matmul inefficiency): a chunk is split off only where it saves more padding than that
FORWARD_OVERHEAD_TOKENS = 256


def length_chunks(
    prompt_mask: torch.Tensor,
    completion_mask: torch.Tensor,
    token_budget: int | None = None,
    overhead_tokens: int = FORWARD_OVERHEAD_TOKENS,
) -> list[torch.Tensor]:
    """Split rows into chunks of similar length for separate forward passes, so that little is spent
    on padding: each chunk is trimmed to its longest prompt plus its longest completion.

    Rows are sorted longest completion first and cut into consecutive runs minimising
    ``sum(rows x (longest prompt + longest completion)) + overhead_tokens x chunks`` (dynamic
    programming, exact): equal lengths stay in one forward, a tail of much shorter rows gets its own.
    With ``token_budget`` no chunk of several rows exceeds that many padded tokens.
    Returns row indices ``[n_chunk]`` per chunk, together a permutation of the rows.
    """
    n = completion_mask.size(0)
    prompt_lengths = prompt_mask.sum(dim=1).tolist()
    completion_lengths = completion_mask.sum(dim=1).tolist()
    order = sorted(range(n), key=lambda r: (completion_lengths[r], prompt_lengths[r]), reverse=True)
    p = [prompt_lengths[r] for r in order]
    c = [completion_lengths[r] for r in order]  # non-increasing
    best = [0.0] + [float("inf")] * n  # best[j]: cost of the first j sorted rows
    start_of = [0] * (n + 1)  # start_of[j]: where the last chunk of that best split starts
    for j in range(1, n + 1):
        longest_prompt = 0
        for i in range(j - 1, -1, -1):  # the last chunk is rows i .. j-1
            longest_prompt = max(longest_prompt, p[i])
            padded = (j - i) * (longest_prompt + c[i])
            if token_budget is not None and padded > token_budget and j - i > 1:
                break  # wider and longer for every smaller i
            cost = best[i] + padded + overhead_tokens
            if cost < best[j]:
                best[j], start_of[j] = cost, i
    chunks, end = [], n
    while end > 0:
        chunks.append(order[start_of[end] : end])
        end = start_of[end]
    return [torch.tensor(chunk, device=completion_mask.device) for chunk in reversed(chunks)]


def split_chunks(chunks: list[torch.Tensor], count: int) -> list[torch.Tensor]:
    """``chunks`` (row indices) split further until there are ``count`` of them, the largest chunk
    in halves first (sharded ranks must run the same number of forwards, see
    ``lit_grpo.distributed.agreed_over_sharded_ranks``)."""
    chunks = list(chunks)
    while len(chunks) < count:
        largest = max(range(len(chunks)), key=lambda i: chunks[i].numel())
        chunk = chunks[largest]
        if chunk.numel() < 2:
            raise ValueError(f"cannot split {sum(c.numel() for c in chunks)} rows into {count} chunks")
        half = (chunk.numel() + 1) // 2
        chunks[largest : largest + 1] = [chunk[:half], chunk[half:]]
    return chunks


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
                raise ValueError(NO_CHAT_TEMPLATE.format(model=repr(tokenizer.name_or_path)))
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


GENERATION_BACKENDS = ("lit", "transformers")

# GenerationConfig fields the "lit" sampler implements; any other non-default field goes to generate
LIT_SAMPLER_OPTIONS = frozenset(
    {
        "max_new_tokens", "min_new_tokens", "do_sample", "temperature", "top_k", "top_p", "min_p",
        "repetition_penalty", "sequence_bias", "pad_token_id", "bos_token_id", "eos_token_id",
        "transformers_version",
    }
)


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
    if backend not in GENERATION_BACKENDS:
        raise ValueError(f"generation_backend must be one of {GENERATION_BACKENDS}, got {backend!r}")
    reason = lit_sampler_unsupported(model, generation_config) if backend == "lit" else None
    if reason is not None:
        warnings.warn(
            f"model.generation_backend=lit does not implement {reason}; sampling with transformers' generate",
            stacklevel=3,
        )
    device = next(model.parameters()).device
    prompt_ids, prompt_mask = tokenize_prompts(tokenizer, prompt_texts, max_prompt_length, device)  # [B, P]
    # Sample in eval mode: no dropout, and gradient checkpointing (active in training mode only)
    # would turn the KV cache off.
    was_training = model.training
    model.eval()
    repeated_ids = prompt_ids.repeat_interleave(num_generations, dim=0)  # [N, P]
    repeated_mask = prompt_mask.repeat_interleave(num_generations, dim=0)  # [N, P]
    try:
        with weights_cast_once(device.type), prepacked_linear_weights(model, device), use_cpu_half_attention(model):
            if backend == "lit" and reason is None:
                completion_ids = sample_groups(model, prompt_ids, prompt_mask, num_generations, generation_config)
            else:
                # synced_gpus=False: each rank decodes on its own (with FSDP2 the caller has gathered the
                # weights, see lit_grpo.distributed), so ranks that finish early do not run dummy steps.
                output = model.generate(
                    input_ids=repeated_ids, attention_mask=repeated_mask, generation_config=generation_config, synced_gpus=False
                )  # [N, P + C]
                completion_ids = output[:, repeated_ids.size(1) :]  # [N, C]
    finally:
        model.train(was_training)
    completion_mask, is_truncated = completion_mask_from_ids(completion_ids, generation_config.eos_token_id)
    completion_ids = completion_ids.masked_fill(completion_mask == 0, tokenizer.pad_token_id)
    return Rollout(repeated_ids, repeated_mask, completion_ids, completion_mask, is_truncated).trimmed()


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


def lit_sampler_unsupported(model: torch.nn.Module, generation_config: GenerationConfig) -> str | None:
    """Why :func:`sample_groups` cannot serve this model and config (None when it can)."""
    options = set(generation_config.to_diff_dict()) - LIT_SAMPLER_OPTIONS
    if options:
        return f"generation options {sorted(options)}"
    return partial_kv_cache_reason(model)


def partial_kv_cache_reason(model: torch.nn.Module) -> str | None:
    """Why a KV cache of this model may not hold the whole prompt, or the model is not a plain
    decoder (sliding-window or linear-attention layers, encoder-decoder); None for full attention."""
    config = text_config(model)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and any(kind != "full_attention" for kind in layer_types):
        return f"layer types {sorted(set(layer_types))}"
    if layer_types is None and getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "sliding-window attention"
    if getattr(config, "is_encoder_decoder", False):
        return "an encoder-decoder model"
    return None


def cache_argument(model: torch.nn.Module, cache: Cache) -> dict[str, Cache]:
    """``{name: cache}`` for a forward call of ``model``: ``transformers`` 5.24 renamed the forward
    argument ``past_key_values`` to ``cache`` (the old name is deprecated, to be removed in 5.40).
    The name is the one the model's forward declares (behind a ``peft`` wrapper, its base model's),
    so models written for either version get their cache: a remote-code model that only knows
    ``past_key_values`` would silently ignore a ``cache`` keyword."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return {"cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values": cache}


KV_CACHE_BLOCK = 32  # positions by which a CPU half-precision KV cache grows (PreallocatedKVLayer)


class PreallocatedKVLayer(DynamicLayer):
    """One decoder layer's KV cache, written in place into a buffer instead of concatenated.

    ``transformers``' ``DynamicLayer`` concatenates every new token's keys and values onto copies of
    the whole cache (quadratic copying over a completion). This layer writes each token into a
    buffer ``[n, heads, size, head_dim]`` and hands attention

    * without ``block``: views of the filled part of one buffer of ``capacity`` positions,
      allocated at the first update;
    * with ``block`` (the sampler's choice on the CPU in half precision): the whole buffer, which
      grows by ``block`` positions at a time (a copy every ``block`` tokens). Attention there
      multiplies the keys and values as matrices (:mod:`lit_grpo.attention`) and has to copy a view
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
    eos = torch.tensor(eos_token_ids(config), device=device)
    processors = LogitsProcessorList()
    if config.sequence_bias is not None:
        processors.append(SequenceBiasLogitsProcessor(sequence_bias=config.sequence_bias))
    if config.repetition_penalty is not None and config.repetition_penalty != 1.0:
        # as generate: the left padding of each row is not penalised (a per-row tensor, see select_rows)
        padding_lengths = (prompt_mask != 0).int().argmax(dim=1)  # [N]
        processors.append(RepetitionPenaltyLogitsProcessor(config.repetition_penalty, prompt_ignore_length=padding_lengths))
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


def select_rows(processors: LogitsProcessorList, keep: torch.Tensor) -> None:
    """Keep the per-row state of ``processors`` for the rows ``keep`` only."""
    for processor in processors:
        if isinstance(getattr(processor, "prompt_ignore_length", None), torch.Tensor):
            processor.prompt_ignore_length = processor.prompt_ignore_length[keep]


def cpu_half_precision(model: torch.nn.Module, device: torch.device) -> bool:
    """Whether ``model`` computes in bf16/fp16 (autocast's dtype, else its weights') on the CPU."""
    return device.type == "cpu" and cpu_compute_dtype(model) in HALF_DTYPES


def eos_token_ids(generation_config: GenerationConfig) -> list[int]:
    eos = generation_config.eos_token_id
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


@torch.no_grad()
def sample_groups(
    model: PreTrainedModel,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    num_generations: int,
    generation_config: GenerationConfig,
    compact_fraction: float = 0.125,
) -> torch.Tensor:
    """``[B * G, C]`` completion tokens for the left-padded prompts ``[B, P]``, G per prompt (pad after EOS).

    1. Prefill: the B prompts go through the model once; their KV caches are copied G times.
    2. Decode: one token per running completion per step, chosen by the logits processors
       (multinomial sampling, or argmax without ``do_sample``).
    3. A completion that emits EOS stops; once finished rows make up ``compact_fraction`` of the
       batch they are removed from it (and from the cache), so later steps cost less.
    """
    G, max_new = num_generations, generation_config.max_new_tokens
    B, P = prompt_ids.shape
    N, device = B * G, prompt_ids.device
    pad_token_id = generation_config.pad_token_id if generation_config.pad_token_id is not None else 0
    eos = torch.tensor(eos_token_ids(generation_config), device=device, dtype=torch.long)
    repeated_mask = prompt_mask.repeat_interleave(G, dim=0)  # [N, P]
    processors = logits_processors(generation_config, repeated_mask)
    block = KV_CACHE_BLOCK if cpu_half_precision(model, device) else None  # see PreallocatedKVLayer
    cache = Cache(layers=[PreallocatedKVLayer(P + max_new, block) for _ in range(text_config(model).num_hidden_layers)])

    # 1. Prefill once per prompt, then give each completion its own copy of the prompt's cache.
    positions = (prompt_mask.long().cumsum(dim=-1) - 1).clamp(min=0)  # [B, P]
    with_cache = cache_argument(model, cache)
    logits = model(
        input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=positions, **with_cache,
        use_cache=True, logits_to_keep=1,
    ).logits[:, -1].float()  # [B, V]
    for layer in cache.layers:
        layer.batch_repeat_interleave(G)
    logits = logits.repeat_interleave(G, dim=0)  # [N, V]
    # every completion's tokens so far (prompt, then sampled) and attention mask, for all steps
    token_ids = torch.cat([prompt_ids.repeat_interleave(G, dim=0), prompt_ids.new_full((N, max_new), pad_token_id)], dim=1)
    attention_mask = torch.cat([repeated_mask, prompt_mask.new_ones(N, max_new)], dim=1)
    next_position = positions[:, -1].repeat_interleave(G) + 1  # [N]
    completions = prompt_ids.new_full((N, max_new), pad_token_id)  # [N, C] the result
    rows = torch.arange(N, device=device)  # the completions still in the batch (indices into N)
    finished = torch.zeros(N, dtype=torch.bool, device=device)  # per row in the batch

    # 2-3. Decode.
    for t in range(max_new):
        scores = processors(token_ids[:, : P + t], logits)  # [n, V]
        if generation_config.do_sample:
            next_tokens = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)  # [n]
        else:
            next_tokens = scores.argmax(dim=-1)
        next_tokens = next_tokens.masked_fill(finished, pad_token_id)
        token_ids[:, P + t] = next_tokens
        finished = finished | torch.isin(next_tokens, eos)
        if t == max_new - 1 or bool(finished.all()):
            break
        if int(finished.sum()) >= max(1, compact_fraction * len(rows)):
            keep = (~finished).nonzero().squeeze(1)
            completions[rows] = token_ids[:, P:]  # the leaving rows' tokens are final
            rows, token_ids, attention_mask = rows[keep], token_ids[keep], attention_mask[keep]
            next_tokens, next_position, finished = next_tokens[keep], next_position[keep], finished[keep]
            for layer in cache.layers:
                layer.batch_select_indices(keep)
            select_rows(processors, keep)
        logits = model(
            input_ids=next_tokens[:, None],
            attention_mask=attention_mask[:, : P + t + 1],
            position_ids=next_position[:, None],
            **with_cache,
            use_cache=True,
        ).logits[:, -1].float()  # [n, V]
        next_position = next_position + 1
    completions[rows] = token_ids[:, P:]
    return completions


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
