"""Reading checkpoints safely (used by :mod:`lit_grpo.run.checkpointing`, ``lit-grpo export`` and the
sharded checkpoints): a checkpoint is a pickle, and one that holds anything but tensors and plain values
could run code as it loads. So checkpoints are read from local files only (:func:`check_local_checkpoint`),
with ``weights_only=True`` (:func:`load_checkpoint_file`), a sharded checkpoint's ``.metadata`` with an
unpickler that builds only DCP's records (:func:`check_shard_metadata`) and its shards' other items
``weights_only`` too (:func:`load_shards`); a crafted file is an :class:`UnsafeCheckpointError` naming it,
in one line.
"""

from __future__ import annotations

import io
import pickle
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from lit_grpo.errors import ConfigError, ModelLoadError

__all__ = [
    "ShardMetadataUnpickler",
    "UnsafeCheckpointError",
    "WeightsOnlyLoadPlanner",
    "check_local_checkpoint",
    "check_shard_metadata",
    "load_checkpoint_file",
    "load_shards",
    "refusing_unsafe_checkpoints",
    "unsafe_checkpoint_error",
]


def check_local_checkpoint(path, what: str = "--ckpt_path") -> None:
    """Refuse a checkpoint named by a URL or a remote file system path (``https://``, ``s3://``): checkpoints
    are read from local files only, before anything is downloaded or loaded."""
    if "://" in str(path):
        raise ConfigError(
            f"{what} {path}: lit-grpo reads checkpoints from local files only (a checkpoint is a pickle, and one "
            "fetched from elsewhere as it loads is not one to trust); download it, check where it comes from, and "
            "give the local file"
        )


def load_checkpoint_file(path, map_location: Any = "cpu") -> dict[str, Any]:
    """``torch.load(path, weights_only=True)``: tensors and plain Python values, all that a lit-grpo
    checkpoint holds. A file holding other objects (which unpickling could run as code) is refused with
    an :class:`UnsafeCheckpointError` naming the file and the object."""
    with refusing_unsafe_checkpoints(path):
        return torch.load(path, map_location=map_location, weights_only=True)


class UnsafeCheckpointError(ModelLoadError):
    """A checkpoint that holds Python objects other than tensors and plain values."""


@contextmanager
def refusing_unsafe_checkpoints(path) -> Iterator[None]:
    """Turn the ``pickle.UnpicklingError`` of a ``weights_only`` load into an :class:`UnsafeCheckpointError`:
    one line naming the checkpoint and the object it would have built."""
    try:
        yield
    except pickle.UnpicklingError as error:
        raise unsafe_checkpoint_error(path, error) from None
    except CheckpointException as error:  # torch.distributed.checkpoint's wrapper of every rank's failure
        refused = [failure for failure, _ in error.failures.values() if isinstance(failure, pickle.UnpicklingError)]
        if not refused:
            raise
        raise unsafe_checkpoint_error(path, refused[0]) from None


def unsafe_checkpoint_error(path, error: pickle.UnpicklingError) -> UnsafeCheckpointError:
    """One line naming the checkpoint and the object whose unpickling ``weights_only`` refused."""
    found = re.search(r"GLOBAL (\S+)", str(error))
    what = f"a Python object ({found.group(1)})" if found else "Python objects"
    return UnsafeCheckpointError(
        f"{path} holds {what} that loading would run as code, not only tensors and plain values as lit-grpo's "
        "checkpoints do; refused (it was not loaded). Use a checkpoint written by lit-grpo fit"
    )


class ShardMetadataUnpickler(pickle.Unpickler):
    """Reads the ``.metadata`` of a sharded checkpoint (``torch.distributed.checkpoint``) building only the
    objects it holds: DCP's metadata records, torch dtypes and sizes, paths."""

    MODULES = frozenset({"torch.distributed.checkpoint.metadata"})  # DCP's records (dataclasses)
    GLOBALS = frozenset({("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
                         ("pathlib", "WindowsPath"), ("collections", "OrderedDict"),
                         ("torch.distributed.checkpoint.filesystem", "_StorageInfo")})

    def find_class(self, module: str, name: str) -> Any:
        is_dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if module in self.MODULES or (module, name) in self.GLOBALS or is_dtype:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"Unsupported GLOBAL {module}.{name}")


def check_shard_metadata(directory: Path) -> None:
    """``torch.distributed.checkpoint`` reads a sharded checkpoint's ``.metadata`` with a plain ``pickle.load``,
    which runs whatever code a crafted file names: read it first with :class:`ShardMetadataUnpickler`, so
    that such a file is refused (:class:`UnsafeCheckpointError`) before it is loaded."""
    metadata = Path(directory) / ".metadata"
    if metadata.is_file():
        with refusing_unsafe_checkpoints(metadata), metadata.open("rb") as file:
            ShardMetadataUnpickler(file).load()


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """``torch.distributed.checkpoint``'s default load planner, except that the items of a shard that are
    not tensors (an optimizer's ``param_groups``: learning rates, betas) are read with
    ``torch.load(weights_only=True)``: DCP's own planner reads them with ``weights_only=False``, which
    runs whatever code a crafted ``.distcp`` file names."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        torch.load(value, weights_only=True)  # refuses (pickle.UnpicklingError) any object but tensors and plain values
        value.seek(0)
        super().load_bytes(read_item, value)  # the same bytes, now known to build only those


def load_shards(state_dict: dict[str, Any], directory: Path) -> None:
    """``torch.distributed.checkpoint.load`` of ``state_dict`` (filled in place) from the sharded checkpoint
    ``directory``, reading nothing that could run code: its ``.metadata`` is checked first
    (:func:`check_shard_metadata`) and the shards' other items are read ``weights_only``
    (:class:`WeightsOnlyLoadPlanner`). A crafted file is an :class:`UnsafeCheckpointError`, one line.
    In a process without ``torch.distributed`` (``lit-grpo export``) this process reads every shard."""
    from torch.distributed.checkpoint import load

    check_shard_metadata(directory)
    with refusing_unsafe_checkpoints(directory):
        load(state_dict, checkpoint_id=str(directory), planner=WeightsOnlyLoadPlanner(),
             no_dist=not torch.distributed.is_initialized())
