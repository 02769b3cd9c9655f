"""Sequence parallelism (Ulysses, ``model.sequence_parallel_size: k``): one long row's tokens over k ranks.

The world's W ranks form W/k sequence-parallel (SP) groups of k consecutive ranks ([0..k-1],
[k..2k-1], ...). As in verl, the ranks of one group train on the SAME rows:

- steps 1-3 stay per rank (each rank samples and scores its own prompts, groups stay whole); then
  :meth:`SequenceParallel.union` gathers the group's sampled groups, so every rank of the group holds
  the union of its k ranks' rows in the same order, and steps 4-5 run on the union identically on
  each rank of the group. A group thus acts as ONE data-parallel rank: the dapo normaliser, the
  statistics and every gather over ranks count each group once (:meth:`~SequenceParallel.one_rank_per_group`,
  :meth:`~SequenceParallel.data_parallel_reduce`).
- every forward after sampling packs its rows into one sequence of T tokens
  (:func:`lit_grpo.train.packing.pack_rows`, positions restarting per row), padded to a multiple of k;
  each rank runs the model's body on its T/k tokens, whose attention (:func:`ulysses_attention`, a
  ``transformers`` attention function switched on for the forward) all-to-alls q, k, v from
  ``[T/k tokens, H heads]`` to ``[T tokens, H/k heads]``, attends causally within each packed row
  over the whole sequence, and all-to-alls the output back. The hidden states of the k slices are
  then all-gathered (:class:`GatherSequence`) and unpacked, and the fused LM head scores them on
  every rank of the group (the head's cost is repeated k times: a known cost).

Gradients: every rank of a group computes the same loss ``L`` on the same rows, and DDP/FSDP2
average the ranks' gradients over all W ranks. The head's gradient is ``dL/dhead`` on each of the k
ranks of a group, so their average over the group is exactly the k = 1 run's. The body's gradient
is split over the group (each rank's slice, the all-to-alls carrying gradients across ranks) and
sums to ``dL/dbody`` over the group's ranks when each rank's slice gets its local part of the
upstream gradient: :class:`GatherSequence`'s backward multiplies that part by k, so the average over
W ranks equals the average over the W/k data-parallel ranks of a k = 1 run.

Activation memory per rank falls about k-fold for the body (each rank holds T/k tokens' activations,
and H/k heads' attention over T); the hidden states ``[T, hidden]`` and the head's tiles are whole on
every rank.
"""

from __future__ import annotations

import contextvars
import functools
import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_info
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from lit_grpo import models
from lit_grpo.errors import ConfigError
from lit_grpo.rollout.records import SampledGroups
from lit_grpo.train.packing import pack_rows

__all__ = ["NAME", "SequenceParallel", "check_model", "check_settings", "ulysses_attention"]

NAME = "lit_ulysses"

# what a transformers attention layer may pass that ulysses_attention does not apply (a sliding window,
# soft-capped attention logits, attention sinks): refused, never ignored
UNSUPPORTED_ATTENTION_ARGUMENTS = ("sliding_window", "softcap", "s_aux")


@dataclass(frozen=True)
class _PackedAttention:
    """What the Ulysses attention of one forward needs: the SP group and the packed rows' segments."""

    group: Any  # torch.distributed ProcessGroup of the k ranks
    size: int  # k
    boundaries: list[int]  # [n + 2] where each packed row starts, then the padding to a multiple of k, then T'


_SAID: list[int] = []  # the first forward's packed tokens, once said in the log

_ACTIVE: contextvars.ContextVar[_PackedAttention | None] = contextvars.ContextVar("lit_grpo_ulysses", default=None)


class AllToAll(torch.autograd.Function):
    """``all_to_all_single`` over the group of a tensor ``[k, ...]``: block ``i`` goes to rank ``i``, and
    block ``i`` of the output came from rank ``i``. It is its own adjoint, so the backward is the same
    all-to-all of the gradient."""

    @staticmethod
    def forward(ctx, blocks: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        blocks = blocks.contiguous()  # the collective reads and writes flat memory: no strided views
        out = torch.empty_like(blocks)
        dist.all_to_all_single(out, blocks, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


class GatherSequence(torch.autograd.Function):
    """``[1, t, H]`` slices of the k ranks -> ``[1, k * t, H]`` in rank order. Backward: this rank's
    slice of the gradient times k (every rank of the group computes the same loss from the gathered
    states; see the module doc for why that factor makes the gradient the k = 1 run's)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group: Any, size: int, rank: int) -> torch.Tensor:
        ctx.size, ctx.rank, ctx.length = size, rank, local.size(1)
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(parts, local, group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        start = ctx.rank * ctx.length
        return grad[:, start : start + ctx.length] * ctx.size, None, None, None


def heads_to_sequence(x: torch.Tensor, group: Any, size: int) -> torch.Tensor:
    """``[1, heads, t, D]`` (all heads, this rank's t tokens) -> ``[1, heads / k, k * t, D]`` (this rank's
    block of heads, every token)."""
    _, heads, t, head_dim = x.shape
    blocks = AllToAll.apply(x[0].reshape(size, heads // size, t, head_dim), group)  # [k, heads/k, t, D], block i: rank i's tokens
    return blocks.permute(1, 0, 2, 3).reshape(1, heads // size, size * t, head_dim)


def sequence_to_heads(x: torch.Tensor, group: Any, size: int) -> torch.Tensor:
    """The inverse of :func:`heads_to_sequence`: ``[1, heads / k, k * t, D]`` -> ``[1, heads, t, D]``."""
    _, block, length, head_dim = x.shape
    t = length // size
    blocks = x[0].reshape(block, size, t, head_dim).permute(1, 0, 2, 3)  # [k, heads/k, t, D]: block i to rank i
    return AllToAll.apply(blocks, group).reshape(1, size * block, t, head_dim)


def ulysses_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, heads, t, D]: this rank's t tokens of the packed sequence
    key: torch.Tensor,  # [1, kv_heads, t, D]
    value: torch.Tensor,  # [1, kv_heads, t, D]
    attention_mask: torch.Tensor | None,  # ignored: the rows' segments come from the packed sequence
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """A ``transformers`` attention function: exact causal attention within each packed row over the
    whole sequence, with heads split over the SP group. Returns ``[1, t, heads, D]`` and no weights."""
    unsupported = [name for name in UNSUPPORTED_ATTENTION_ARGUMENTS if kwargs.get(name) is not None]
    if unsupported:  # check_model refuses such models at start: this attention would silently ignore them
        raise RuntimeError(f"attention implementation {NAME!r} cannot apply {', '.join(unsupported)}")
    state = _ACTIVE.get()
    if state is None:
        raise RuntimeError(f"attention implementation {NAME!r} runs only inside SequenceParallel.hidden_states")
    heads, kv_heads = query.size(1), key.size(1)
    if kv_heads % state.size:  # too few kv heads to split: each query head gets its own copy (verl's repeat)
        key, value = (tensor.repeat_interleave(heads // kv_heads, dim=1) for tensor in (key, value))
    query, key, value = (heads_to_sequence(tensor, state.group, state.size) for tensor in (query, key, value))
    if key.size(1) != query.size(1):  # grouped-query attention: block j of the query heads reads block j of the kv heads
        key, value = (tensor.repeat_interleave(query.size(1) // key.size(1), dim=1) for tensor in (key, value))
    # each packed row (and the padding after them) attends causally within itself: one SDPA call per row, so
    # no [T, T] mask exists and SDPA's fused kernel keeps no attention weights for the backward
    dropout = dropout if module.training else 0.0
    bounds = state.boundaries
    output = torch.cat([
        torch.nn.functional.scaled_dot_product_attention(
            query[:, :, start:end], key[:, :, start:end], value[:, :, start:end], is_causal=True, dropout_p=dropout, scale=scaling)
        for start, end in itertools.pairwise(bounds) if end > start
    ], dim=2)  # [1, heads/k, T, D]
    return sequence_to_heads(output, state.group, state.size).transpose(1, 2).contiguous(), None


def _no_mask(*args, **kwargs) -> None:
    """The mask function of :data:`NAME`: none (:func:`ulysses_attention` attends within each packed row)."""


AttentionInterface.register(NAME, ulysses_attention)
AttentionMaskInterface.register(NAME, _no_mask)


@contextmanager
def _ulysses_attention_on(model: torch.nn.Module, state: _PackedAttention) -> Iterator[None]:
    """Within the block, ``model``'s attention is :func:`ulysses_attention` over ``state``; restored on exit."""
    config = models.text_config(model)
    before = config._attn_implementation
    config._attn_implementation = NAME
    token = _ACTIVE.set(state)
    try:
        yield
    finally:
        _ACTIVE.reset(token)
        config._attn_implementation = before


@dataclass(frozen=True)
class SequenceParallel:
    """This rank's SP group: ``size`` (k) consecutive ranks, this one at ``rank`` within it."""

    size: int
    rank: int
    group: Any  # torch.distributed ProcessGroup

    @classmethod
    def of_world(cls, size: int) -> SequenceParallel | None:
        """The groups of ``size`` consecutive ranks (a collective: every rank calls it); None for 1."""
        if size == 1:
            return None
        group, _ = dist.new_subgroups(group_size=size)
        return cls(size=size, rank=dist.get_rank(group), group=group)

    def hidden_states(self, model: torch.nn.Module, head: models.OutputHead, *, input_ids: torch.Tensor,
                      attention_mask: torch.Tensor, **ignored: Any) -> torch.Tensor:
        """The last hidden states ``[n, L, H]`` of the rows ``input_ids [n, L]`` (real tokens where
        ``attention_mask`` is 1; 0 at padding), as :func:`lit_grpo.models.decoder_hidden_states` gives
        them, with this rank running the body on its slice of the packed rows (positions restart per
        row, as the padded forward's skip its padding)."""
        packed = pack_rows(input_ids, attention_mask)
        total = packed.num_tokens
        padded = -(-total // self.size) * self.size  # T rounded up to a multiple of k
        extra = padded - total
        ids = torch.nn.functional.pad(packed.input_ids, (0, extra))  # [1, T']
        positions = torch.nn.functional.pad(packed.position_ids, (0, extra))
        local = padded // self.size
        window = slice(self.rank * local, (self.rank + 1) * local)
        state = _PackedAttention(group=self.group, size=self.size, boundaries=[*packed.cu_seqlens.tolist(), padded])
        with _ulysses_attention_on(model, state):
            hidden = models.decoder_hidden_states(model, head, input_ids=ids[:, window], position_ids=positions[:, window],
                                                  use_cache=False)  # [1, T'/k, H]
        hidden = GatherSequence.apply(hidden, self.group, self.size, self.rank)[:, :total]  # [1, T, H]
        if not _SAID:
            _SAID.append(total)
            rank_zero_info(f"model.sequence_parallel_size {self.size}: the first forward's {total} packed tokens run "
                           f"{local} on each rank of the group (said once)")
        return packed.unpack(hidden)  # [n, L, H]

    def union(self, sampled: SampledGroups, pad_token_id: int) -> SampledGroups:
        """The sampled groups of the k ranks of this group, in rank order, on every one of them."""
        device = sampled.rewards.device
        parts: list = [None] * self.size
        dist.all_gather_object(parts, _to_device(sampled, torch.device("cpu")), group=self.group)
        return _to_device(SampledGroups.concat(parts, pad_token_id), device)

    def one_rank_per_group(self, all_gather: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
        """``all_gather`` (``[W, ...]`` over the world) keeping the first rank of each group: ``[W / k, ...]``,
        what a k = 1 run on W / k ranks gathers."""
        return functools.partial(_first_rank_of_each_group, all_gather, self.size)

    def data_parallel_reduce(self, reduce: Callable[[torch.Tensor, str], torch.Tensor]) -> Callable[[torch.Tensor, str], torch.Tensor]:
        """``reduce(value, op)`` over the world, a sum divided by k (each group's ranks hold the same rows)."""
        return functools.partial(_sum_over_groups, reduce, self.size)

    def shared_generator(self, device: torch.device) -> torch.Generator:
        """A generator seeded alike on the group's ranks (from the first one's random stream), so that
        the update shuffles the union's rows alike on each."""
        # on ``device``: on CUDA the group's backend (NCCL, as Lightning's process group) has no CPU tensors
        seed = torch.randint(0, 2**62, (1,), dtype=torch.long, device=device)
        dist.broadcast(seed, src=dist.get_global_rank(self.group, 0), group=self.group)
        return torch.Generator(device=device).manual_seed(int(seed.cpu()))


def _first_rank_of_each_group(all_gather: Callable, size: int, tensor: torch.Tensor) -> torch.Tensor:
    values = all_gather(tensor)  # [W, ...], or the tensor itself on one process
    return values[::size] if values.dim() > tensor.dim() else values


def _sum_over_groups(reduce: Callable, size: int, value: torch.Tensor, reduce_op: str) -> torch.Tensor:
    total = reduce(value, reduce_op)
    return total / size if reduce_op == "sum" else total


def _to_device(sampled: SampledGroups, device: torch.device) -> SampledGroups:
    """``sampled`` with every tensor (of its rollout and group statistics too) on ``device``."""
    def move(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.to(device)
        if hasattr(value, "__dataclass_fields__") and not isinstance(value, type):
            return type(value)(**{name: move(getattr(value, name)) for name in value.__dataclass_fields__})
        return value
    return move(sampled)


def check_settings(hparams: Any, world_size: int) -> None:
    """The settings that cannot run with ``sequence_parallel_size`` k > 1, refused in one line each."""
    k = hparams.sequence_parallel_size
    if k < 1:
        raise ConfigError(f"model.sequence_parallel_size must be at least 1, got {k}")
    if k == 1:
        return
    refusals = [  # (refused, why): every refusal that applies is named
        (world_size % k != 0, f"the number of processes ({world_size}) must be a multiple of model.sequence_parallel_size ({k})"),
        (hparams.max_staleness > 0, "model.max_staleness > 0 (asynchronous GRPO) does not run with it yet"),
        (bool(hparams.gradient_checkpointing), ("model.gradient_checkpointing does not run with it yet (the recomputed "
                                                "attention would leave its sequence-parallel group)")),
        (hparams.share_prompt_forward is True, "model.share_prompt_forward: true does not run with it (set auto or false)"),
        (bool(hparams.tools or hparams.environment), "model.tools and model.environment do not run with it yet"),
    ]
    reasons = [why for refused, why in refusals if refused]
    if reasons:
        raise ConfigError(f"model.sequence_parallel_size {k}: {'; '.join(reasons)}")


def check_model(model: torch.nn.Module, k: int) -> None:
    """A model sequence parallelism cannot split, refused in one line: no ``transformers`` attention
    interface, a head not known to be linear (no fused LM head), sliding-window, linear or soft-capped
    attention (attention sinks: at the first forward, by :func:`ulysses_attention`), or query heads
    that k does not divide."""
    head = models.output_head(model)
    if isinstance(head, str):
        raise ConfigError(f"model.sequence_parallel_size {k} needs the fused LM head: {head}")
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not getattr(base, "_supports_attention_backend", False):
        raise ConfigError(f"model.sequence_parallel_size {k}: {type(base).__name__} does not take a transformers "
                          "attention function (AttentionInterface)")
    config = models.text_config(model)
    partial = models.partial_kv_cache_reason(model)
    if partial is not None or getattr(config, "attn_logit_softcapping", None):
        why = partial if partial is not None else f"soft-capped attention logits (attn_logit_softcapping {config.attn_logit_softcapping})"
        raise ConfigError(f"model.sequence_parallel_size {k}: {type(base).__name__} has {why}, which the Ulysses attention "
                          "does not apply (full causal attention within each row only)")
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % k or heads % kv_heads:
        raise ConfigError(f"model.sequence_parallel_size {k} must divide the model's attention heads "
                          f"(num_attention_heads {heads}, num_key_value_heads {kv_heads})")
