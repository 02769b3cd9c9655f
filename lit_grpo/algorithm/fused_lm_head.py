"""A fused LM head: token log-probs (and entropy) from a model body's hidden states, a tile of tokens at a time.

A log-prob pass that asks the model for its logits holds ``[n, C, V]`` of them at once: at Qwen's
vocabulary (151,936) 1.2 GiB per 2,048-token row in float32, and the log-softmax and its backward
hold as much again. :func:`fused_token_logprobs` instead takes the hidden states ``[n, C, H]`` that
predict the completion tokens and the output head, and runs head, logit transform and log-softmax
over tiles of tokens: no tensor of the size of all the logits exists, forward or backward.

Two paths, chosen once per head by what it is:

- A plain weight (:class:`LinearHead`: an ``nn.Linear``, a tied embedding's weight, FSDP2's head
  once the model's forward gathered it): :class:`LinearHeadLogProbs`, a ``torch.autograd.Function``
  as TRL 1.16's ``trl/kernels/chunked_logprob.py``. Its forward keeps only the hidden states and each
  token's log-normaliser ``[N]`` (and entropy); its backward recomputes each tile's logits, takes the
  gradient of the tile's logits through the transform with autograd, and writes ``grad_hidden =
  grad_z @ W`` tile by tile and ONE float32 weight gradient accumulated with ``addmm_`` over the
  tiles (cast to the weight's dtype once at the end: bf16 weights are not summed in bf16 tile by tile).
- Any other head (a callable: a LoRA-wrapped head, an FSDP2 head whose weight is still a DTensor):
  each tile's forward in non-reentrant :func:`torch.utils.checkpoint.checkpoint`, calling the module
  (which keeps each of them right); autograd keeps the tile's hidden states and recomputes its logits.

The head's matrix product runs in the surrounding autocast's dtype (bf16 under ``bf16-mixed``) or the
weights' dtype; with ``LinearHead.float32`` (``model.cast_lm_head_to_fp32``, TRL's) in float32, the
hidden states and the weight cast and autocast off. The transform, log-softmax and entropy always run
in float32 (the model's own forward applies scaling and soft-capping to its bf16 logits: here they
are a little more exact).

Tile size: a byte budget of float32 logits per tile (``tile_bytes``, :data:`LOGITS_TILE_BYTES`, 64
MiB: 110 tokens at 151,936 entries, 2,048 at 8,192); a tile's temporaries (its logits, the transformed
logits, and in the backward their gradient) are a few times that. Where every token fits in one tile,
or nothing needs a gradient, the tiles run in plain autograd (nothing to recompute). The vocabulary is
not split: at these budgets a tile's ``[t, V]`` logits are already small, and a whole row of the
vocabulary is what top-k/top-p/min-p need.

The transform of a tile's logits (:func:`sampling_transform`) is what turns the head's output into
the distribution the tokens were sampled from: the model's own logit scaling and soft-capping
(Cohere's ``logit_scale``, Granite's ``logits_scaling``, Gemma 2/3's ``final_logit_softcapping``),
the repetition penalty, the temperature, and top-k/top-p/min-p
(:mod:`lit_grpo.algorithm.sampling_filters`, in the backend's order), exactly as
:func:`~lit_grpo.algorithm.sampling_filters.sampling_log_softmax` applies them to full logits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

from lit_grpo.algorithm.sampling_filters import (
    SamplingFilters,
    kept_tokens,
    penalised,
    seen_before,
    token_first_positions,
)

__all__ = ["ACCELERATOR_TILE_TOKENS", "LOGITS_TILE_BYTES", "LinearHead", "LinearHeadLogProbs", "LogitsTransform",
           "fused_token_logprobs", "linear_head", "sampling_transform", "tile_bytes_for", "tokens_per_tile"]

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


@dataclasses.dataclass(frozen=True)
class LinearHead:
    """An output head that is a plain weight: ``logits = hidden @ weight.T + bias``."""

    weight: torch.Tensor  # [V, H]
    bias: torch.Tensor | None = None  # [V]
    float32: bool = False  # cast_lm_head_to_fp32: hidden states and weight in float32 for the head, autocast off

    def compute_dtype(self, hidden: torch.Tensor) -> torch.dtype:
        """The dtype of the head's matrix product: float32 when asked, else the surrounding autocast's
        (as ``nn.Linear`` under autocast), else that of the hidden states and weight together."""
        if self.float32:
            return torch.float32
        if torch.is_autocast_enabled(hidden.device.type):
            return torch.get_autocast_dtype(hidden.device.type)
        return torch.promote_types(hidden.dtype, self.weight.dtype)

    def logits(self, hidden: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # [t, H] -> [t, V] float32
        """The tile's logits from the head's product in ``dtype`` (autocast off: the dtype is explicit)."""
        bias = None if self.bias is None else self.bias.to(dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            return torch.nn.functional.linear(hidden.to(dtype), self.weight.to(dtype), bias).float()


def linear_head(module: torch.nn.Module, float32: bool = False) -> LinearHead | None:
    """``module``'s weight and bias as they are now where it is a plain ``nn.Linear`` of plain tensors;
    None for anything else (a LoRA wrapper, an FSDP2 weight still sharded as a DTensor, a quantised
    weight): those run through the module itself (:func:`fused_token_logprobs`' checkpointed path)."""
    if not isinstance(module, torch.nn.Linear):
        return None
    plain = (torch.Tensor, torch.nn.Parameter)
    if type(module.weight) not in plain or (module.bias is not None and type(module.bias) not in plain):
        return None
    return LinearHead(module.weight, module.bias, float32)


def tile_scores(
    z: torch.Tensor, tile_tokens: torch.Tensor, with_entropy: bool, entropy_grad: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Of a tile's scored logits ``z [t, V]`` and its tokens ``[t, 1]``: the log-probs ``[t]``, the
    log-normaliser ``logsumexp(z) [t]`` and (``with_entropy``) the entropy ``[t]``, which has a
    gradient only with ``entropy_grad``."""
    log_normaliser = torch.logsumexp(z, dim=-1)  # [t]
    logps = z.gather(-1, tile_tokens).squeeze(-1) - log_normaliser
    if not with_entropy:
        return logps, log_normaliser, None
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        probs = torch.exp(z - log_normaliser[:, None])
        # a token outside the support (-inf) has probability 0 and adds 0, not 0 * -inf = NaN (nor a NaN gradient)
        finite = torch.where(probs > 0, z, 0.0)
        return logps, log_normaliser, log_normaliser - (probs * finite).sum(-1)


def logits_gradient(
    z: torch.Tensor, tile_tokens: torch.Tensor, log_normaliser: torch.Tensor, entropy: torch.Tensor | None,
    grad_logps: torch.Tensor | None, grad_entropy: torch.Tensor | None,
) -> torch.Tensor:
    """The gradient ``[t, V]`` of the loss w.r.t. the scored logits ``z [t, V]``, given its gradients
    w.r.t. the log-probs and the entropy ``[t]`` (None: no gradient): ``d logp / dz_j = 1[j = token] -
    p_j`` and ``d entropy / dz_j = -p_j (log p_j + entropy)`` (0 off the support, where ``p_j = 0``)."""
    # in place in ``log_probs``: two [t, V] tensors live at once (log_probs -> grad, and probs)
    log_probs = z - log_normaliser[:, None]
    probs = torch.exp(log_probs)
    if grad_entropy is not None:
        spread = log_probs.add_(entropy[:, None]).masked_fill_(probs == 0, 0.0)  # log p + H, 0 off the support
        grad = spread.mul_(probs).mul_(-grad_entropy[:, None])
    else:
        grad = log_probs.zero_()
    if grad_logps is not None:
        grad.sub_(probs.mul_(grad_logps[:, None])).scatter_add_(-1, tile_tokens, grad_logps[:, None])
    return grad


def add_product_in_float32(total: torch.Tensor, left: torch.Tensor, right: torch.Tensor) -> None:
    """``total += left @ right`` for a float32 ``total``, without rounding the product to the inputs'
    dtype first (on CUDA from bf16/fp16 inputs directly, elsewhere from float32 copies of them)."""
    if total.device.type == "cuda" and left.dtype in (torch.float16, torch.bfloat16):
        torch.addmm(total, left, right, out_dtype=torch.float32, out=total)
    else:
        total.addmm_(left.float(), right.float())


class LinearHeadLogProbs(torch.autograd.Function):
    """Log-probs ``[N]`` (and entropy ``[N]``) of ``tokens`` under ``transform(hidden @ weight.T + bias)``
    over tiles of ``tile_size`` tokens, keeping only ``hidden`` and the log-normaliser for the backward.

    ``apply(hidden [N, H], weight [V, H], bias [V] | None, tokens [N, 1], transform | None,
    tile_size, with_entropy, entropy_grad, compute_dtype)``; the entropy is None without
    ``with_entropy`` and has a gradient only with ``entropy_grad``."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, tokens, transform, tile_size, with_entropy, entropy_grad, compute_dtype):
        ctx.set_materialize_grads(False)  # an entropy without gradient gets None, not zeros
        # the weight cast once per forward (and once per backward), not per tile
        head = LinearHead(weight.to(compute_dtype), None if bias is None else bias.to(compute_dtype))
        outputs = []
        for start, tile_hidden in zip(range(0, hidden.size(0), tile_size), hidden.split(tile_size)):
            z = head.logits(tile_hidden, compute_dtype)  # [t, V]
            if transform is not None:
                z = transform(z, torch.arange(start, start + z.size(0), device=z.device))
            outputs.append(tile_scores(z, tokens[start : start + z.size(0)], with_entropy, False))
            del z  # freed before the next tile's logits are made
        logps, log_normaliser = (torch.cat([output[i] for output in outputs]) for i in (0, 1))
        entropy = torch.cat([output[2] for output in outputs]) if with_entropy else None
        ctx.save_for_backward(hidden, weight, bias, tokens, log_normaliser, entropy if entropy_grad else None)
        ctx.transform, ctx.tile_size, ctx.compute_dtype = transform, tile_size, compute_dtype
        if entropy is not None and not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logps, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logps, grad_entropy):
        hidden, weight, bias, tokens, log_normaliser, entropy = ctx.saved_tensors
        needs_hidden, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        dtype, size = ctx.compute_dtype, ctx.tile_size
        grad_hidden = torch.empty_like(hidden) if needs_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if needs_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if needs_bias else None
        head = LinearHead(weight.to(dtype), None if bias is None else bias.to(dtype))
        for start, tile_hidden in zip(range(0, hidden.size(0), size), hidden.split(size)):
            tile = slice(start, start + tile_hidden.size(0))
            grad_z = recomputed_tile_gradient(
                head, dtype, ctx.transform, tile_hidden, tile, tokens[tile], log_normaliser[tile],
                None if entropy is None else entropy[tile],
                None if grad_logps is None else grad_logps[tile].float(),
                None if grad_entropy is None else grad_entropy[tile].float(),
            )
            grad_z_c = grad_z.to(dtype)  # [t, V]: as the head's product's backward would get it
            with torch.autocast(hidden.device.type, enabled=False):
                if grad_hidden is not None:
                    grad_hidden[tile] = grad_z_c @ head.weight  # [t, H]
                if grad_weight is not None:  # off CUDA the product is taken in float32: from the unrounded gradient
                    add_product_in_float32(
                        grad_weight, (grad_z_c if grad_z.device.type == "cuda" else grad_z).T, tile_hidden.to(dtype))  # [V, H]
            if grad_bias is not None:
                grad_bias += grad_z.sum(0)
            del grad_z, grad_z_c  # freed before the next tile's logits are recomputed
        return (grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype),
                None if grad_bias is None else grad_bias.to(bias.dtype), None, None, None, None, None, None)


def recomputed_tile_gradient(
    head: LinearHead, dtype: torch.dtype, transform: LogitsTransform | None, tile_hidden: torch.Tensor, tile: slice,
    tile_tokens: torch.Tensor, log_normaliser: torch.Tensor, entropy: torch.Tensor | None,
    grad_logps: torch.Tensor | None, grad_entropy: torch.Tensor | None,
) -> torch.Tensor:
    """The gradient ``[t, V]`` float32 w.r.t. one tile's head output, its logits recomputed from
    ``tile_hidden [t, H]``; through ``transform`` by autograd (temperature, scaling, soft-capping,
    the penalty; the filters' -inf is a constant)."""
    raw = head.logits(tile_hidden, dtype)  # [t, V]
    if transform is None:
        return logits_gradient(raw, tile_tokens, log_normaliser, entropy, grad_logps, grad_entropy)
    raw.requires_grad_()
    with torch.enable_grad():
        z = transform(raw, torch.arange(tile.start, tile.stop, device=raw.device))
    grad_z = logits_gradient(z.detach(), tile_tokens, log_normaliser, entropy, grad_logps, grad_entropy)
    return torch.autograd.grad(z, raw, grad_z)[0]


def fused_token_logprobs(
    hidden: torch.Tensor,
    head: LinearHead | Callable[[torch.Tensor], torch.Tensor],
    tokens: torch.Tensor,
    vocab_size: int,
    transform: LogitsTransform | None = None,
    with_entropy: bool = False,
    tile_bytes: int = LOGITS_TILE_BYTES,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs ``[n, C]`` float32 of ``tokens [n, C]`` (and the entropy ``[n, C]`` of their
    distribution with ``with_entropy``, with its gradient only with ``entropy_grad``) under
    ``transform(head(hidden))``.

    Args:
        hidden: ``[n, C, H]`` hidden states; position ``t`` predicts ``tokens[:, t]``.
        head: the output head: a :class:`LinearHead` (:func:`linear_head`; the custom backward), or
            any callable ``[t, H] -> [t, V]`` logits (each tile checkpointed; any dtype, scored in float32).
        tokens: ``[n, C]`` token ids.
        vocab_size: ``V``, for the tile size.
        transform: what the tile's float32 logits become before the log-softmax
            (:func:`sampling_transform`); None: the logits as they are.
        tile_bytes: the budget of float32 logits per tile (:func:`tokens_per_tile`).
        entropy_grad: the entropy is differentiable (an entropy bonus in the loss); without, a metric.

    ``logp = z[token] - logsumexp(z)`` and ``entropy = logsumexp(z) - sum softmax(z) * z`` with
    ``z = transform(head(hidden))``, the values :func:`~lit_grpo.algorithm.selective_log_softmax` and
    :func:`~lit_grpo.algorithm.entropy_from_logits` give on the full logits.
    """
    n, C, H = hidden.shape
    if n * C == 0:  # no token at all
        empty = hidden.new_zeros(n, C, dtype=torch.float32)
        return empty, empty.clone() if with_entropy else None
    flat_hidden, flat_tokens = hidden.reshape(n * C, H), tokens.reshape(n * C, 1)
    size = tokens_per_tile(vocab_size, tile_bytes)
    tiled = n * C > size and torch.is_grad_enabled()  # else nothing to recompute: the tiles in plain autograd
    if isinstance(head, LinearHead) and tiled:
        logps, entropy = LinearHeadLogProbs.apply(
            flat_hidden, head.weight, head.bias, flat_tokens, transform, size, with_entropy, entropy_grad,
            head.compute_dtype(hidden),
        )
    else:
        logps, entropy = autograd_tiles(flat_hidden, head, flat_tokens, size, transform, with_entropy, entropy_grad, tiled)
    return logps.reshape(n, C), entropy.reshape(n, C) if with_entropy else None


def autograd_tiles(
    hidden: torch.Tensor, head: LinearHead | Callable[[torch.Tensor], torch.Tensor], tokens: torch.Tensor, size: int,
    transform: LogitsTransform | None, with_entropy: bool, entropy_grad: bool, checkpointed: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`fused_token_logprobs` of ``hidden [N, H]`` and ``tokens [N, 1]`` in tiles of ``size``
    tokens, in autograd: each tile in non-reentrant checkpoint (``checkpointed``), whose backward
    recomputes the tile's logits instead of keeping them; else as a plain forward."""
    if isinstance(head, LinearHead):
        dtype = head.compute_dtype(hidden)
        cast = LinearHead(head.weight.to(dtype), None if head.bias is None else head.bias.to(dtype))  # once, not per tile
        logits_of = lambda tile_hidden: cast.logits(tile_hidden, dtype)
    else:
        logits_of = lambda tile_hidden: head(tile_hidden).float()
    recomputing = False  # set once every tile went forward: a recomputed tile skips an entropy without gradient

    def tile(tile_hidden: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor | None]:  # [t, H] -> [t] each
        z = logits_of(tile_hidden)  # [t, V]
        if transform is not None:
            z = transform(z, torch.arange(start, start + z.size(0), device=z.device))
        scored_entropy = with_entropy and (entropy_grad or not recomputing)
        logps, _, entropy = tile_scores(z, tokens[start : start + z.size(0)], scored_entropy, entropy_grad)
        return logps, entropy

    # split, not slices: the backward of a slice adds a zero gradient the size of all the hidden states per tile
    tiles = zip(range(0, hidden.size(0), size), hidden.split(size))
    outputs = [checkpoint(tile, part, start, use_reentrant=False) if checkpointed else tile(part, start)
               for start, part in tiles]
    recomputing = True
    logps = torch.cat([logps for logps, _ in outputs])
    return logps, torch.cat([entropy for _, entropy in outputs]) if with_entropy else None


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
