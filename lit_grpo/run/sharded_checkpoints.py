"""Sharded checkpoints that never replace a good one with a partial one: FSDP2's checkpoints written
atomically, and read back without running code.

Lightning's ``ModelParallelStrategy`` (FSDP2, :mod:`lit_grpo.distributed`) writes ``last.ckpt/`` in place;
:class:`ModelParallelStrategy` here writes every rank's shards aside and swaps them in once all are written.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.strategies import (
    ModelParallelStrategy as _LightningModelParallelStrategy,
)

from lit_grpo.run.checkpointing import fsync_directory
from lit_grpo.run.safe_loading import load_checkpoint_file, load_shards


def _partial_and_previous(path: Path) -> tuple[Path, Path]:
    return path.with_name(path.name + ".partial"), path.with_name(path.name + ".previous")


def recover_interrupted_replace(path: Path) -> None:
    """Undo a replacement that stopped between its two renames: ``path`` is gone and the previous
    checkpoint waits under ``<path>.previous``; put it back."""
    _, previous = _partial_and_previous(path)
    if not path.exists() and previous.exists():
        os.rename(previous, path)


def replace_atomically(path: Path, write: Callable[[Path], None], is_global_zero: bool, barrier: Callable[[], None]) -> None:
    """Write a checkpoint (a file or a sharded directory) with ``write(partial_path)`` on every rank,
    then, on rank 0, swap it in for ``path``.

    Until every rank has finished writing, ``path`` is untouched; the swap is two renames
    (``path -> path.previous``, ``path.partial -> path``) and a crash between them is undone by
    :func:`recover_interrupted_replace`, which runs before the next save and before a load. A
    ``path.partial`` left by a crash during writing is deleted by the next save.
    """
    partial, previous = _partial_and_previous(path)
    if is_global_zero:
        recover_interrupted_replace(path)
        _remove(partial)
    barrier()
    write(partial)
    barrier()
    if is_global_zero:
        if path.exists():
            _remove(previous)
            os.rename(path, previous)
        os.rename(partial, path)
        _remove(previous)
        fsync_directory(path.parent)
    barrier()


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


class ModelParallelStrategy(_LightningModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (FSDP2) whose checkpoints are replaced atomically.

    With ``save_distributed_checkpoint: true`` Lightning writes ``last.ckpt/`` (a directory of
    shards) in place, bypassing any ``CheckpointIO``, so a run killed while saving loses its last
    good checkpoint. Here every rank writes into ``last.ckpt.partial/`` and rank 0 swaps it in only
    when all shards are written (:func:`replace_atomically`). Same arguments as Lightning's class;
    ``lit-grpo fit`` uses it in place of Lightning's when the config names Lightning's.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        path = Path(self.broadcast(str(filepath)))
        replace_atomically(
            path,
            lambda partial: super(ModelParallelStrategy, self).save_checkpoint(checkpoint, partial, storage_options),
            self.is_global_zero,
            self.barrier,
        )

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(str(checkpoint_path)))
        if self.is_global_zero:
            recover_interrupted_replace(path)
        self.barrier()
        if not path.is_dir():  # a single file (save_distributed_checkpoint: false): torch.load, weights_only
            return super().load_checkpoint(path, weights_only=True)
        return load_sharded_checkpoint(path, self.model, self.optimizers, strict=self.lightning_module.strict_loading)


def load_sharded_checkpoint(path: Path, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer],
                            strict: bool = True) -> dict[str, Any]:
    """Lightning's resume from a directory of shards (``ModelParallelStrategy.load_checkpoint``), reading nothing
    that could run code: fills ``model`` and ``optimizers`` from the shards (:func:`load_shards`, whose
    non-tensor items, an optimizer's ``param_groups``, are read ``weights_only``, where DCP reads them with
    ``weights_only=False``) and returns the rest of the checkpoint, ``meta.pt``
    (:func:`load_checkpoint_file`). A crafted file is an ``UnsafeCheckpointError`` naming it, one line."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    model_state = {"state_dict": get_model_state_dict(model)}  # the keys Lightning saves under
    load_shards(model_state, path)
    model.load_state_dict(model_state["state_dict"], strict=strict)
    for index, optimizer in enumerate(optimizers):  # each loaded on its own, as Lightning does
        optimizer_state = {f"optimizer_{index}": get_optimizer_state_dict(model, optimizer)}
        load_shards(optimizer_state, path)
        set_optimizer_state_dict(model, optimizer, optim_state_dict=optimizer_state[f"optimizer_{index}"],
                                 options=StateDictOptions(cpu_offload=True))
    return load_checkpoint_file(path / "meta.pt")
