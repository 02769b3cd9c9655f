"""Attention in bf16/fp16 on the CPU as matrix products, for ``transformers`` models on ``sdpa``.

Under ``bf16-mixed`` on the CPU, PyTorch's SDPA kernels are slow in half precision: 1.6-2.4x slower
than two matrix products for one-token queries (the sampler's decode steps), and 1.7-6.5x slower
forward + backward for the sequences of GRPO's training chunks (``bench/attention.py`` at d59a9c4, 4M shapes).
:func:`cpu_half_attention` computes

    probs = softmax(q k^T * scaling + mask)        # in float32, as transformers' eager attention
    out = probs v

with the products in the half dtype (oneDNN accumulates in float32) and the softmax computed in
float32 by PyTorch's CPU kernel, rounded once to the half dtype. The ``heads // kv_heads`` query
heads that share a key/value head are one matrix of queries against it (no ``repeat_kv`` copy).
For the backward pass autograd keeps the half-precision probabilities (2 bytes per score), so
this path is taken only while the scores of one call stay below :data:`MAX_SCORES` elements;
longer sequences keep SDPA's memory-efficient kernel. Everything
else (float32, GPUs, dropout, soft-capping, attention sinks, per-head masks) is SDPA as before.

:func:`use_cpu_half_attention` switches a model on ``sdpa`` to it for a block (the sampler, the
log-prob forwards and each training micro-batch, whose chunked path calls the model directly);
the model's configuration is restored on exit, and nested blocks leave it to the outermost.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from lit_grpo.models import text_config

HALF_DTYPES = (torch.bfloat16, torch.float16)
MAX_SCORES = 2**24  # attention scores [n, heads, q, S] of one call: 32 MiB in half precision
NAME = "lit_cpu_half"


def cpu_half_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [n, heads, T, head_dim]
    key: torch.Tensor,  # [n, kv_heads, S, head_dim]
    value: torch.Tensor,  # [n, kv_heads, S, head_dim]
    attention_mask: torch.Tensor | None,  # [n, 1, T, S] bool (True = attend) or additive float; None = causal
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """A ``transformers`` attention function: SDPA, except in bf16/fp16 on the CPU (see the module
    doc). Returns ``[n, T, heads, head_dim]`` and no weights, as every ``transformers`` attention function."""
    half = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else key.dtype
    n, heads, q_length, head_dim = query.shape
    kv_heads, kv_length = key.shape[1], key.shape[2]
    if (
        query.device.type != "cpu" or half not in HALF_DTYPES or heads % kv_heads
        or (attention_mask is not None and attention_mask.shape[1] != 1)
        or dropout or kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None
        or kwargs.get("s_aux") is not None or n * heads * q_length * kv_length > MAX_SCORES
    ):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    scaling = head_dim**-0.5 if scaling is None else scaling
    group = heads // kv_heads
    keep = None
    if attention_mask is not None:
        keep = attention_mask[:, :, :, :kv_length]  # [n, 1, T, S], as SDPA slices it
        if keep.dtype != torch.bool:  # an additive float mask: 0 where attended, very negative elsewhere
            keep = keep == 0
        keep = keep.unsqueeze(2)  # [n, 1, 1, T, S]: the same for every head
    elif q_length > 1 and kwargs.get("is_causal", getattr(module, "is_causal", True)):
        # no mask means causal, aligned top-left as SDPA's is_causal (transformers crops the keys too)
        key, value, kv_length = key[:, :, :q_length], value[:, :, :q_length], min(kv_length, q_length)
        keep = torch.ones(q_length, kv_length, dtype=torch.bool, device=query.device).tril()
    # head h = kv_head * group + g reads kv head h // group, as repeat_kv: [n, kv_heads, group * T, D];
    # scaled before the product, as SDPA's math kernel does
    grouped = (query * scaling).to(half).reshape(n, kv_heads, group * q_length, head_dim)
    # the cache is often a view of the first S positions of a longer buffer: oneDNN multiplies such
    # strided half-precision operands more slowly than it copies them
    key, value = key.to(half).contiguous(), value.to(half).contiguous()
    scores = torch.matmul(grouped, key.transpose(-1, -2)).view(n, kv_heads, group, q_length, kv_length)
    if keep is not None:
        # a fully masked row (a padding query) gets uniform weights, as in eager attention: finite, never read
        scores = scores.masked_fill_(~keep, torch.finfo(half).min)
    # PyTorch's CPU softmax computes half-precision inputs in float32 and rounds the result once;
    # autograd keeps only these half-precision probabilities for the backward pass
    probs = torch.softmax(scores, dim=-1).view(n, kv_heads, group * q_length, kv_length)
    output = torch.matmul(probs, value)  # [n, kv_heads, group * T, D]
    return output.view(n, heads, q_length, head_dim).transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, cpu_half_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)  # the same masks as "sdpa"


def cpu_compute_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype ``model``'s matrix products run in on the CPU: autocast's when it is on, else its weights'."""
    if torch.is_autocast_enabled("cpu"):
        return torch.get_autocast_dtype("cpu")
    return next(model.parameters()).dtype


@contextmanager
def use_cpu_half_attention(model: torch.nn.Module) -> Iterator[None]:
    """Within the block, a model on ``sdpa`` attention uses :func:`cpu_half_attention` (SDPA for
    everything but half precision on the CPU); any other attention implementation is left alone.
    Restored on exit, exceptions included."""
    config = text_config(model)
    if getattr(config, "_attn_implementation", None) != "sdpa":
        yield
        return
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = "sdpa"
