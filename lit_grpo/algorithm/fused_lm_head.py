"""A fused LM head: token log-probs (and entropy) from a model body's hidden states, a tile of tokens at a time.

A log-prob pass that asks the model for its logits holds ``[n, C, V]`` of them at once: at Qwen's
vocabulary (151,936) 1.2 GiB per 2,048-token row in float32, and the log-softmax and its backward
hold as much again. :func:`fused_token_logprobs` instead takes the hidden states ``[n, C, H]`` that
predict the completion tokens and the output head as a callable (an ``nn.Linear``, a tied embedding's
linear, a LoRA-wrapped head, a head in an FSDP2 unit: calling the module keeps each of them right),
and runs head, logit transform and log-softmax over tiles of tokens. Each tile's forward is wrapped
in non-reentrant :func:`torch.utils.checkpoint.checkpoint`, so autograd keeps only the tile's hidden
states and recomputes the tile's logits in the backward: no tensor of the size of all the logits
exists, forward or backward.

Tile size: a byte budget of float32 logits per tile (``tile_bytes``, :data:`LOGITS_TILE_BYTES`, 64
MiB: 110 tokens at 151,936 entries, 2,048 at 8,192); a tile's temporaries (its logits, the transformed
logits, and in the backward their gradient) are a few times that. Where every token fits in one tile
the head runs once without checkpointing, as a plain forward would (nothing to save; no recompute).
The vocabulary is not split: at these budgets a tile's ``[t, V]`` logits are already small, and a
whole row of the vocabulary is what top-k/top-p/min-p need.

The transform of a tile's logits (:func:`sampling_transform`) is what turns the head's output into
the distribution the tokens were sampled from: the model's own logit scaling and soft-capping
(Cohere's ``logit_scale``, Granite's ``logits_scaling``, Gemma 2/3's ``final_logit_softcapping``),
the repetition penalty, the temperature, and top-k/top-p/min-p
(:mod:`lit_grpo.algorithm.sampling_filters`, in the backend's order), exactly as
:func:`~lit_grpo.algorithm.sampling_filters.sampling_log_softmax` applies them to full logits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

from lit_grpo.algorithm.sampling_filters import SamplingFilters, kept_tokens, penalised, seen_before, token_first_positions

__all__ = ["ACCELERATOR_TILE_TOKENS", "LOGITS_TILE_BYTES", "LogitsTransform", "fused_token_logprobs", "sampling_transform",
           "tile_bytes_for", "tokens_per_tile"]

# float32 logits of one tile: 64 MiB, above glibc's largest mmap threshold (32 MiB), so on the CPU a tile's
# [t, V] temporaries are mapped and handed back when freed; at 32 MiB they stayed in the heap (measured: one
# step at 4 x 1,024 tokens, vocabulary 151,936, peaked at 3.2-5.8 GiB with 32 MiB tiles, 2.1 GiB with 64 MiB)
LOGITS_TILE_BYTES = 2**26

# (logits [t, V] float32, flat positions [t] in the [n, C] grid) -> the scored logits [t, V] float32,
# -inf on the tokens outside the support
LogitsTransform = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


ACCELERATOR_TILE_TOKENS = 1024  # on a GPU: tiles of at least this many tokens keep the head's matmuls compute-bound


def tile_bytes_for(device_type: str, vocab_size: int) -> int:
    """The tile budget on a device: :data:`LOGITS_TILE_BYTES` on the CPU; on an accelerator, whose
    caching allocator reuses freed tiles, at least :data:`ACCELERATOR_TILE_TOKENS` tokens' logits."""
    if device_type == "cpu":
        return LOGITS_TILE_BYTES
    return max(LOGITS_TILE_BYTES, ACCELERATOR_TILE_TOKENS * 4 * vocab_size)


def tokens_per_tile(vocab_size: int, tile_bytes: int = LOGITS_TILE_BYTES) -> int:
    """How many tokens' float32 logits ``[t, V]`` fit in ``tile_bytes`` (at least one)."""
    return max(1, tile_bytes // (4 * vocab_size))


def fused_token_logprobs(
    hidden: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    tokens: torch.Tensor,
    vocab_size: int,
    transform: LogitsTransform | None = None,
    with_entropy: bool = False,
    tile_bytes: int = LOGITS_TILE_BYTES,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs ``[n, C]`` float32 of ``tokens [n, C]`` (and the entropy ``[n, C]`` of their
    distribution with ``with_entropy``, without gradient) under ``transform(head(hidden))``.

    Args:
        hidden: ``[n, C, H]`` hidden states; position ``t`` predicts ``tokens[:, t]``.
        head: the output head, ``[t, H] -> [t, V]`` logits (any dtype; scored in float32).
        tokens: ``[n, C]`` token ids.
        vocab_size: ``V``, for the tile size.
        transform: what the tile's float32 logits become before the log-softmax
            (:func:`sampling_transform`); None: the logits as they are.
        tile_bytes: the budget of float32 logits per tile (:func:`tokens_per_tile`).

    ``logp = z[token] - logsumexp(z)`` and ``entropy = logsumexp(z) - sum softmax(z) * z`` with
    ``z = transform(head(hidden))``, the values :func:`~lit_grpo.algorithm.selective_log_softmax` and
    :func:`~lit_grpo.algorithm.entropy_from_logits` give on the full logits.
    """
    n, C, H = hidden.shape
    flat_hidden = hidden.reshape(n * C, H)
    flat_tokens = tokens.reshape(n * C, 1)
    size = tokens_per_tile(vocab_size, tile_bytes)
    recomputing = False  # set once every tile went forward: a recomputed tile skips the entropy (no gradient)

    def tile(tile_hidden: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor | None]:  # [t, H] -> [t] each
        positions = torch.arange(start, start + tile_hidden.size(0), device=tile_hidden.device)  # [t]
        z = head(tile_hidden).float()  # [t, V]
        if transform is not None:
            z = transform(z, positions)
        log_normaliser = torch.logsumexp(z, dim=-1)  # [t]
        logps = z.gather(-1, flat_tokens[start : start + z.size(0)]).squeeze(-1) - log_normaliser
        if not with_entropy or recomputing:
            return logps, None
        with torch.no_grad():
            probs = torch.exp(z - log_normaliser[:, None])
            # a token outside the support (-inf) has probability 0 and adds 0, not 0 * -inf = NaN
            weighted = torch.where(probs > 0, probs * z, torch.zeros_like(z))
            return logps, log_normaliser - weighted.sum(-1)

    one_tile = n * C <= size
    outputs = []
    # split, not slices: the backward of a slice adds a zero gradient the size of all the hidden states per tile
    for start, tile_hidden in zip(range(0, n * C, size), flat_hidden.split(size)):
        if one_tile or not torch.is_grad_enabled():
            outputs.append(tile(tile_hidden, start))
        else:  # the backward recomputes the tile's logits instead of keeping them
            outputs.append(checkpoint(tile, tile_hidden, start, use_reentrant=False))
    recomputing = True
    if not outputs:  # no token at all
        empty = hidden.new_zeros(n, C, dtype=torch.float32)
        return empty, empty.clone() if with_entropy else None
    logps = torch.cat([logps for logps, _ in outputs]).reshape(n, C)
    return logps, torch.cat([entropy for _, entropy in outputs]).reshape(n, C) if with_entropy else None


def sampling_transform(
    filters: SamplingFilters,
    tokens: torch.Tensor,
    vocab_size: int,
    prompt_ids: torch.Tensor | None = None,
    prompt_mask: torch.Tensor | None = None,
    logit_scale: float = 1.0,
    softcapping: float | None = None,
) -> LogitsTransform:
    """The transform of a tile's head output into the logits the tokens ``[n, C]`` were sampled from.

    In order: the model's ``logit_scale`` (a multiplier) and ``softcapping`` (``s * tanh(z / s)``),
    as its forward applies them after the head; the repetition penalty (which needs the rows' prompts
    ``prompt_ids/prompt_mask [n, P]``); the temperature; top-k/top-p/min-p in ``filters``' order,
    whose support (plus the sampled token) keeps its logits and the rest become ``-inf``, a constant
    for autograd (see :mod:`lit_grpo.algorithm.sampling_filters`).
    """
    C = tokens.size(1)
    flat_tokens = tokens.reshape(-1, 1)
    first_positions = None
    if filters.penalises:
        if prompt_ids is None or prompt_mask is None:
            raise ValueError("the repetition penalty needs the prompts the completions continue")
        first_positions = token_first_positions(prompt_ids, prompt_mask, tokens, vocab_size, filters.penalise_padding)  # [n, V]

    def transform(logits: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # [t, V], [t] -> [t, V]
        z = logits * logit_scale if logit_scale != 1.0 else logits
        if softcapping is not None:
            z = softcapping * torch.tanh(z / softcapping)
        if first_positions is not None:
            z = penalised(z, seen_before(first_positions, positions // C, positions % C), filters.repetition_penalty)
        z = z / filters.temperature
        if not filters.truncates:
            return z
        kept = kept_tokens(z, filters).scatter_(-1, flat_tokens[positions], True)  # never without the sampled token
        # z plus 0 on the support and -inf off it: the addition keeps nothing for backward (a masked_fill would keep the mask)
        return z + torch.zeros_like(z).masked_fill_(~kept, float("-inf"))

    return transform
