"""Several processes: FSDP2 sharding, generation with gathered weights, and statistics across ranks.

lit-grpo runs data-parallel: every rank draws its own prompts (Lightning's distributed sampler),
samples the whole group of G completions of each of its prompts and scores them itself, so a group
never straddles two ranks. What must be global is gathered explicitly:

- the rewards, so that ``scale_rewards: batch`` divides by the std of the *global* batch and the
  logged reward statistics describe the whole batch (:func:`gather_rows`);
- the number of real completion tokens that normalises the ``dapo`` loss (summed in the module);
- the gradients, averaged by DDP's all-reduce or FSDP2's reduce-scatter.

Under Lightning's ``ModelParallelStrategy`` the policy is sharded with FSDP2 (:func:`shard_model`):
each decoder layer is its own ``fully_shard`` unit and the root holds the rest (embeddings, final
norm, LM head). Decoding one token at a time through sharded layers would all-gather every layer's
weights at every step, and ranks whose completions end at different lengths would then wait for each
other in those collectives; :func:`gathered_for_generation` instead gathers the weights once, keeps
them gathered for the whole ``generate`` call, and reshards after it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.distributed.device_mesh import DeviceMesh

from lit_grpo.errors import ConfigError

__all__ = [
    "agreed_over_sharded_ranks",
    "clip_grad_norm",
    "data_parallel_mesh",
    "gather_objects",
    "gather_real_values",
    "gather_rows",
    "gathered_for_generation",
    "mixed_precision_policy",
    "reshard",
    "root_reshards_after_forward",
    "shard_model",
]


def data_parallel_mesh(device_mesh: DeviceMesh) -> DeviceMesh:
    """The mesh to shard over: the ``data_parallel`` dimension of Lightning's 2-D device mesh.

    lit-grpo does not implement tensor parallelism, so the ``tensor_parallel`` dimension must be 1.
    (``ModelParallelStrategy``'s defaults put every process of a node in ``tensor_parallel``.)
    """
    tensor_parallel = device_mesh["tensor_parallel"].size()
    if tensor_parallel != 1:
        data_parallel = device_mesh["data_parallel"].size()
        raise ConfigError(
            f"trainer.strategy ModelParallelStrategy has tensor_parallel_size={tensor_parallel}, but lit-grpo "
            "shards with FSDP2 only (no tensor parallelism). Set trainer.strategy.init_args.data_parallel_size "
            f"to the number of processes ({data_parallel * tensor_parallel}) and tensor_parallel_size to 1."
        )
    return device_mesh["data_parallel"]


def agreed_over_sharded_ranks(value: int, model: torch.nn.Module, reduce: str) -> int:
    """``value`` reduced (``"max"`` or ``"min"``) over the ranks where ``model`` is FSDP2-sharded;
    ``value`` itself otherwise.

    Every forward and backward of a sharded model is a collective (all-gather, reduce-scatter), so
    every rank must run as many as the others: how many chunks a micro-batch is split into, or
    whether prompts get their own forward, is agreed through this before it is acted on.
    """
    if not _fsdp_modules(model):
        return value
    import torch.distributed as dist

    op = {"max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[reduce]
    tensor = torch.tensor([value], dtype=torch.long, device=next(model.parameters()).device)
    dist.all_reduce(tensor, op=op)
    return int(tensor.item())


def decoder_layer_classes(model: torch.nn.Module) -> set[type]:
    """The transformer block classes of a Hugging Face model (its ``_no_split_modules``)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    classes = {type(module) for module in model.modules() if type(module).__name__ in names}
    if not classes:
        raise ConfigError(
            f"Cannot find the decoder layers of {type(model).__name__} to shard: it declares no "
            "_no_split_modules matching any of its modules"
        )
    return classes


def mixed_precision_policy(precision: str):
    """FSDP2's ``MixedPrecisionPolicy`` for a Lightning ``trainer.precision``: for ``bf16-mixed`` (or
    ``16-mixed``) the gathered weights and the forward and backward compute are in that half dtype,
    while the sharded master weights the optimizer updates and the gradient reduction stay float32.
    None (FSDP2's default: everything in the weights' dtype) for any other precision."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    precision = str(precision)
    half = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)
    if half is None:
        return None
    return MixedPrecisionPolicy(param_dtype=half, reduce_dtype=torch.float32)


def shard_model(model: torch.nn.Module, mesh: DeviceMesh, mp_policy=None) -> torch.nn.Module:
    """FSDP2: ``fully_shard`` every decoder layer, then the root (embeddings, norm and LM head), with
    ``mp_policy`` (:func:`mixed_precision_policy`) when given."""
    from torch.distributed.fsdp import fully_shard

    kwargs = {"mesh": mesh} if mp_policy is None else {"mesh": mesh, "mp_policy": mp_policy}
    layer_classes = tuple(decoder_layer_classes(model))
    for module in list(model.modules()):
        if isinstance(module, layer_classes):
            fully_shard(module, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _fsdp_modules(model: torch.nn.Module) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [module for module in model.modules() if isinstance(module, FSDPModule)]


def _reshards_after_forward(module, root: bool = False) -> bool:
    """Whether an FSDP2 unit frees its gathered weights after each forward (FSDP2 keeps this setting
    on the unit's parameter group; the ``root`` unit keeps its weights by default). Before the root's
    first forward FSDP2 has not yet applied the root's default (``reshard_after_forward=None``: its
    parameter group still says True), hence the state's flag of a setting left to FSDP2."""
    state = module._get_fsdp_state()
    group = state._fsdp_param_group
    if root and getattr(state, "_auto_reshard_after_forward", False):  # no public form in torch 2.13 (private: may go)
        return False
    return group is not None and group.post_forward_mesh_info is not None


def root_reshards_after_forward(model: torch.nn.Module) -> bool:
    """Whether ``model``'s outermost FSDP2 unit (the root: embeddings, norm, LM head) frees its gathered
    weights after each forward, so that its head called after the forward would meet its shards.
    False for a model not sharded (and for the root's default, which keeps them)."""
    units = _fsdp_modules(model)
    return bool(units) and _reshards_after_forward(units[0], root=True)


@contextmanager
def gathered_for_generation(model: torch.nn.Module) -> Iterator[None]:
    """Keep an FSDP2-sharded model's full weights gathered for a whole ``generate`` call.

    One all-gather per FSDP unit on entry and none per decoding step, so each rank decodes on its
    own and ranks that stop at different lengths never wait for one another. A model that is not
    sharded is left as it is.
    """
    units = _fsdp_modules(model)
    if not units:
        yield
        return
    # the root's default (keep) restored as such, also where this runs before the model's first forward
    settings = [_reshards_after_forward(unit, root=index == 0) for index, unit in enumerate(units)]
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield
    finally:
        for unit, reshard_after_forward in zip(units, settings):
            unit.reshard()
            unit.set_reshard_after_forward(reshard_after_forward, recurse=False)


def reshard(model: torch.nn.Module) -> None:
    """Free the gathered weights of every FSDP2 unit, so the module's parameters are its shards again
    (the root unit keeps its weights gathered after a forward without backward). No-op unsharded."""
    for unit in _fsdp_modules(model):
        unit.reshard()


def clip_grad_norm(parameters: Iterator[torch.nn.Parameter], max_norm: float | None) -> torch.Tensor | None:
    """Clip the gradients' norm to ``max_norm`` (None or 0: no clipping, as in Lightning and TRL); the
    norm before clipping, whole (FSDP2: that of sharded DTensor gradients is itself a DTensor)."""
    if not max_norm:
        return None
    grad_norm = torch.nn.utils.clip_grad_norm_([p for p in parameters if p.grad is not None], max_norm)
    return grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm


def gather_rows(tensor: torch.Tensor, all_gather) -> torch.Tensor:
    """Concatenate a per-rank tensor ``[n, ...]`` over ranks, in rank order: ``[world * n, ...]``.

    ``all_gather`` is ``LightningModule.all_gather`` (a no-op on one process). Every rank holds the
    same number of rows (the same number of prompts times G).
    """
    gathered = all_gather(tensor)  # [world, n, ...], or [n, ...] on a single process
    if gathered.dim() == tensor.dim():
        return gathered
    return gathered.reshape(-1, *tensor.shape[1:])


def gather_objects(items: list) -> list:
    """Concatenate a per-rank list of picklable objects over all ranks, in rank order (the list
    itself on one process). A collective: every rank must call it."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return items
    gathered: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, items)
    return [item for part in gathered for item in part]


def gather_real_values(values: torch.Tensor, mask: torch.Tensor, all_gather) -> torch.Tensor:
    """The entries of ``values`` where ``mask`` is 1, from every rank, as one flat tensor.

    Ranks hold different numbers of real entries, so each pads its own to the largest count with
    NaN before the (equal-shape) all-gather, and the padding is dropped after it.
    """
    local = values[mask.bool()].float()  # [k] this rank's real entries
    count = all_gather(torch.tensor([local.numel()], device=values.device)).max()
    padded = torch.full((int(count),), float("nan"), device=values.device)
    padded[: local.numel()] = local
    gathered = all_gather(padded).reshape(-1)
    return gathered[~torch.isnan(gathered)]


# Moved to lit_grpo.run.sharded_checkpoints (the files of a run); a saved config may name them here.
MOVED_TO_RUN = ("ModelParallelStrategy", "load_sharded_checkpoint", "recover_interrupted_replace", "replace_atomically")


def __getattr__(name: str):
    if name in MOVED_TO_RUN:
        from lit_grpo.run import sharded_checkpoints

        return getattr(sharded_checkpoints, name)
    raise AttributeError(f"module 'lit_grpo.distributed' has no attribute {name!r}")
