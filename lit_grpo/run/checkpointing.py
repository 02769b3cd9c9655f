"""Exact resume: what a checkpoint must hold so that a killed run continues as if it had never stopped.

A GRPO step draws random numbers (sampling the completions, shuffling the mini-batches), so the
weights and the optimizer are not enough to continue a run exactly. A lit-grpo checkpoint holds:

- the weights, the optimizer, the learning-rate scheduler and the loop counters (``global_step``,
  epoch, batches done): Lightning's own checkpoint content;
- the state of every random number generator, per rank: :class:`RNGStateCheckpoint` (torch CPU and
  CUDA, numpy, python ``random``; sampling and the mini-batch shuffle draw from these);
- the position in the data: :class:`ResumableDataLoader` (the batches of the current epoch already
  consumed; the order of an epoch is a function of the data seed and the epoch, see
  :class:`lit_grpo.data.PromptSampler`). Lightning's fit loop saves the ``state_dict`` of every
  training dataloader that has one and restores it on resume;
- the reference model: its weights are part of the module's ``state_dict`` (``ref_model`` is a
  submodule). The reference sync (``model.sync_ref_model``, :mod:`lit_grpo.train.reference`) depends only on
  those weights and ``global_step``, so it saves nothing of its own.

Checkpoints are written by :class:`AtomicCheckpointIO`, so a crash while writing leaves the previous
checkpoint intact, and a write that fails (a full disk) ends the run with one line naming the file.
Checkpoints are read only from local files and with ``weights_only=True`` (:mod:`lit_grpo.run.safe_loading`;
``AtomicCheckpointIO.load_checkpoint`` for a resume): a checkpoint is a pickle, and one that holds
anything but tensors and plain values (which is all a lit-grpo checkpoint holds) could run code as it
loads, so it is refused, in one line naming the file.
:func:`configure_checkpointing` gives the ``lit-grpo`` command these by default, together with a
``ModelCheckpoint`` that keeps a rolling ``last.ckpt`` in the run's directory, which ``lit-grpo fit
--config ... --ckpt_path last`` resumes in (:mod:`lit_grpo.run.directory`), and the checkpoints between its
steps of :mod:`lit_grpo.run.preemption` (every 30 minutes; on SIGTERM, SIGINT, SIGUSR1);
:func:`default_checkpointing_of` gives a plain ``lightning.Trainer`` the same.
"""

from __future__ import annotations

import importlib
import os
import random
import tempfile
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from fsspec.implementations.local import LocalFileSystem
from jsonargparse import Namespace
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader

from lit_grpo.errors import ConfigError, WriteError, os_error_in
from lit_grpo.run.preemption import (
    DEFAULT_CHECKPOINT_EVERY_N_MINUTES,
    DEFAULT_STOP_SIGNALS,
    CheckpointEveryNMinutes,
    CheckpointOnSignal,
)
from lit_grpo.run.safe_loading import (  # the names of reading checkpoints safely, found here too
    UnsafeCheckpointError,
    check_local_checkpoint,
    load_checkpoint_file,
    refusing_unsafe_checkpoints,
)

__all__ = [
    "DEFAULT_CHECKPOINT_EVERY_N_TRAIN_STEPS",
    "AtomicCheckpointIO",
    "RNGStateCheckpoint",
    "ResumableDataLoader",
    "UnsafeCheckpointError",
    "capture_rng_states",
    "check_local_checkpoint",
    "check_no_weight_left_behind",
    "check_resumed_partition",
    "check_same_partition",
    "configure_checkpointing",
    "is_class_config",
    "load_checkpoint_file",
    "restore_rng_states",
]

# Interval of the default ModelCheckpoint of the `lit-grpo` command, in optimizer steps.
DEFAULT_CHECKPOINT_EVERY_N_TRAIN_STEPS = 100

# ----------------------------------------------------------------------------------------------
# Random number generators
# ----------------------------------------------------------------------------------------------


def capture_rng_states() -> dict[str, Any]:
    """The states of the global random number generators of this process.

    Only tensors and plain Python values, so that ``torch.load(weights_only=True)`` (the default of
    ``torch.load`` and hence of Lightning's resume) accepts a checkpoint holding them.
    """
    numpy_state = np.random.get_state(legacy=False)  # {"bit_generator", "state": {"key", "pos"}, ...}
    states: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "bit_generator": numpy_state["bit_generator"],
            "key": torch.from_numpy(numpy_state["state"]["key"].astype(np.int64)),
            "pos": int(numpy_state["state"]["pos"]),
            "has_gauss": int(numpy_state["has_gauss"]),
            "gauss": float(numpy_state["gauss"]),
        },
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()  # one state per visible device
    return states


def restore_rng_states(states: dict[str, Any]) -> None:
    """Set the global random number generators to ``states`` from :func:`capture_rng_states`."""
    torch.set_rng_state(states["torch"])
    numpy_state = states["numpy"]
    np.random.set_state(
        (
            numpy_state["bit_generator"],
            numpy_state["key"].numpy().astype(np.uint32),
            numpy_state["pos"],
            numpy_state["has_gauss"],
            numpy_state["gauss"],
        )
    )
    random.setstate(states["python"])
    if "cuda" in states and torch.cuda.is_available():
        for device, state in enumerate(states["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(state, device)


class RNGStateCheckpoint(Callback):
    """Puts the state of every global random number generator into each checkpoint and restores it
    when training resumes from one.

    When the state is captured: while Lightning writes the checkpoint. ``ModelCheckpoint`` writes in
    ``on_train_batch_end`` (or at the end of validation or of an epoch), after the last random draw
    of a training step and before the first of the next: nothing in between draws from the global
    generators (the training dataloader has its own generator, see :class:`ResumableDataLoader`, and
    a dataloader with a length is not prefetched by Lightning), so the next step starts from exactly
    the saved states.

    When it is restored: in ``on_train_start``, the last hook before the first training batch.
    (``load_state_dict`` runs earlier, before the optimizers and the sanity check are set up.)

    Validation samples completions too. Its draws are kept out of the training stream: the states
    are saved in ``on_validation_start`` and put back in ``on_validation_end``. So training does not
    depend on how often validation runs, and a run resumed from a checkpoint written just before a
    validation (which Lightning does not repeat on resume) continues identically.

    Every process has its own generators: :meth:`state_dict` gathers the states of all ranks (it is
    called on every rank while a checkpoint is dumped) and each rank restores its own. A checkpoint
    written by a different number of processes restores nothing, with a warning.
    """

    def __init__(self) -> None:
        self._states_to_restore: list[dict[str, Any]] | None = None  # one entry per rank
        self._states_before_validation: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        states = capture_rng_states()
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            per_rank: list[Any] = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(per_rank, states)
        else:
            per_rank = [states]
        return {"per_rank": per_rank}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._states_to_restore = state_dict["per_rank"]

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        per_rank, self._states_to_restore = self._states_to_restore, None
        if per_rank is None:
            return
        if len(per_rank) != trainer.world_size:
            warnings.warn(
                f"The checkpoint holds the random number generator states of {len(per_rank)} processes but "
                f"this run has {trainer.world_size}; they are not restored, so sampling after the resume "
                "differs from the interrupted run's",
                stacklevel=2,
            )
            return
        restore_rng_states(per_rank[trainer.global_rank])

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._states_before_validation = capture_rng_states()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._states_before_validation is not None:
            restore_rng_states(self._states_before_validation)
            self._states_before_validation = None


# ----------------------------------------------------------------------------------------------
# Position in the data
# ----------------------------------------------------------------------------------------------


def check_same_partition(state: dict[str, Any], partition: dict[str, int]) -> None:
    """Refuse to resume in the middle of an epoch with another cut of it: the loader ``state`` (of
    :meth:`ResumableDataLoader.state_dict`) counts the batches handed out, which with another number of
    processes or ``data.batch_size`` would be other prompts (the resumed run would skip some of the
    epoch's prompts and repeat others). At an epoch's end, or from a checkpoint without the partition
    (written before it was saved), anything goes."""
    written = state.get("partition")
    if written is None or state.get("epoch") is None or not 0 < state["batches_yielded"] < written["batches_in_epoch"]:
        return
    if (written["processes"], written["batch_size"]) == (partition["processes"], partition["batch_size"]):
        return
    prompts = state["batches_yielded"] * written["batch_size"] * written["processes"]
    raise ConfigError(
        f"the checkpoint stopped {prompts} prompts into epoch {state['epoch']} with {written['processes']} process(es) x "
        f"data.batch_size {written['batch_size']}, and this run has {partition['processes']} x {partition['batch_size']}: "
        f"its batches of that epoch would skip some prompts and repeat others. Resume with {written['processes']} "
        f"process(es) and data.batch_size {written['batch_size']} (a checkpoint written at an epoch's end resumes with any)")


def check_resumed_partition(checkpoint: dict[str, Any], processes: int, batch_size: int | None) -> None:
    """:func:`check_same_partition` of every training loader state in ``checkpoint``, at the start of a
    resumed run (before validation or any step), for a run of ``processes`` x ``batch_size``."""
    if batch_size is None:
        return
    states = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {}).get("combined_loader", [])
    for state in states:
        if isinstance(state, dict):
            check_same_partition(state, {"processes": processes, "batch_size": batch_size})


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` that resumes in the middle of an epoch.

    Lightning's fit loop puts :meth:`state_dict` of every training dataloader that has one into each
    checkpoint and hands it back to :meth:`load_state_dict` on resume. The state says how far the
    current epoch got: its epoch (the sampler's ``epoch``, which Lightning sets through ``set_epoch``
    before every epoch) and the number of batches already handed to the training loop, counted as
    they are yielded (batches that worker processes have prefetched do not count). The first
    iterator after :meth:`load_state_dict` skips that many batches if it iterates the same epoch, and
    none if a new epoch has begun. The order of an epoch must therefore be a function of the
    sampler's epoch, as with :class:`lit_grpo.data.PromptSampler` or ``DistributedSampler``. The
    skipped batches are loaded and collated (cheap for prompts), not trained on.

    Iterators start lazily, at the first ``next()``: Lightning creates the iterator of a resumed
    epoch before it calls ``set_epoch``.

    The loader also owns the ``torch.Generator`` from which every iterator draws the base seed of
    its worker processes (``generator``; a fresh generator seeded with 0 when not given). A plain
    ``DataLoader`` without one draws that seed from the global torch generator at the start of every
    epoch, which would shift the training's random stream (:class:`RNGStateCheckpoint`) by one draw
    in a resumed run, whose iterator is created before that stream is restored.
    """

    def __init__(self, *args: Any, generator: torch.Generator | None = None, **kwargs: Any) -> None:
        if generator is None:
            generator = torch.Generator().manual_seed(0)
        super().__init__(*args, generator=generator, **kwargs)
        self._epoch: int | None = None  # the sampler's epoch of the current iterator
        self._batches_yielded = 0  # batches of the current epoch handed out
        self._generator_at_epoch_start = self.generator.get_state()
        self._state_to_resume: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self._epoch,
            "batches_yielded": self._batches_yielded,
            "generator_at_epoch_start": self._generator_at_epoch_start,
            "generator": self.generator.get_state(),
            "partition": self.partition(),
        }

    def partition(self) -> dict[str, int]:
        """How the epoch is cut: processes, prompts per process and step, and batches per process."""
        return {"processes": getattr(self.sampler, "num_replicas", 1), "batch_size": self.batch_size or 1,
                "batches_in_epoch": len(self)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        check_same_partition(state_dict, self.partition())
        self._state_to_resume = state_dict

    def rewind(self, state: dict[str, Any], batches: int) -> None:
        """Go back to ``state`` (a :meth:`state_dict` of this loader) less its last ``batches`` batches:
        they were handed out but not trained on (a step that stopped before its update), so a
        checkpoint written now resumes with them."""
        self._epoch, self._batches_yielded = state["epoch"], state["batches_yielded"] - batches
        self._generator_at_epoch_start = state["generator_at_epoch_start"]
        self.generator.set_state(state["generator"])

    def __iter__(self):
        return self._iterate_epoch()

    def _iterate_epoch(self):
        epoch = getattr(self.sampler, "epoch", None)
        batches_to_skip = 0
        if self._state_to_resume is not None:
            state, self._state_to_resume = self._state_to_resume, None
            if state["epoch"] == epoch and state["batches_yielded"] < len(self):  # the same, unfinished epoch
                self.generator.set_state(state["generator_at_epoch_start"])
                batches_to_skip = state["batches_yielded"]
            else:  # the interrupted run had finished that epoch
                self.generator.set_state(state["generator"])
        self._epoch, self._batches_yielded = epoch, 0
        self._generator_at_epoch_start = self.generator.get_state()
        for batch in super().__iter__():
            self._batches_yielded += 1
            if self._batches_yielded > batches_to_skip:
                yield batch


# ----------------------------------------------------------------------------------------------
# Writing checkpoints atomically
# ----------------------------------------------------------------------------------------------


class AtomicCheckpointIO(TorchCheckpointIO):
    """``torch.save`` to a temporary file next to the destination, ``fsync``, then ``os.replace``.

    A checkpoint interrupted while being written (a kill, a full disk, a power cut) never replaces
    the previous good one: until the rename, the destination still holds the previous file, and the
    rename is atomic. The data is flushed to disk before the rename and the directory entry after it.

    Lightning's ``TorchCheckpointIO`` serialises the whole checkpoint into memory, writes it to a
    temporary file in the system temporary directory and moves that into place. When the temporary
    directory is on another file system than the checkpoints (``/tmp`` on tmpfs, checkpoints on a
    network or scratch file system) the move is a copy that first truncates the destination, so a
    crash during it destroys the previous ``last.ckpt``; nothing is fsynced either. Remote paths
    (``s3://``, ...) still go through Lightning's implementation: an object store publishes an object
    only once it is completely uploaded.

    A temporary file left behind by a crash (``.NAME.*.tmp``) is removed by the next save of ``NAME``.
    A write that fails (a full disk, a quota, a lost mount) removes its temporary file and raises a
    :class:`~lit_grpo.errors.WriteError` naming the checkpoint: one line from ``lit-grpo``.

    A resume reads a local file only, with ``weights_only=True`` whatever the caller asked for
    (``None``, the default, would follow ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD``); ``weights_only=False``
    is refused (:func:`load_checkpoint_file`).
    """

    def load_checkpoint(self, path, map_location: Any | None = None, weights_only: bool | None = None) -> dict[str, Any]:
        if weights_only is False:
            raise ConfigError(
                f"weights_only=False would let the checkpoint {path} run code as it loads; lit-grpo's checkpoints "
                "load with weights_only=True (leave it unset)"
            )
        check_local_checkpoint(path)
        with refusing_unsafe_checkpoints(path):
            return super().load_checkpoint(path, map_location=map_location, weights_only=True)

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if not isinstance(get_filesystem(path), LocalFileSystem):
            return super().save_checkpoint(checkpoint, path, storage_options=storage_options)
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint does not take storage_options")
        destination = Path(path)
        try:
            self._write_and_replace(checkpoint, destination)
        except Exception as error:
            cause = os_error_in(error)
            if cause is None:
                raise
            kept = "the previous one is kept" if destination.exists() else "there is no earlier one"
            raise WriteError(f"could not write the checkpoint {destination}: {cause.strerror or cause}; {kept}") from error

    @staticmethod
    def _write_and_replace(checkpoint: dict[str, Any], destination: Path) -> None:
        directory = destination.parent
        directory.mkdir(parents=True, exist_ok=True)
        for stale in directory.glob(f".{destination.name}.*.tmp"):
            stale.unlink(missing_ok=True)
        with tempfile.NamedTemporaryFile(
            dir=directory, prefix=f".{destination.name}.", suffix=".tmp", delete=False
        ) as temporary:
            try:
                torch.save(checkpoint, temporary)
                temporary.flush()
                os.fsync(temporary.fileno())
            except BaseException:
                os.unlink(temporary.name)
                raise
        os.replace(temporary.name, destination)
        fsync_directory(directory)


def fsync_directory(directory: Path) -> None:
    """Make a rename in ``directory`` durable (POSIX; a no-op where directories cannot be opened)."""
    try:
        descriptor = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


# ----------------------------------------------------------------------------------------------
# Defaults of the `lit-grpo` command
# ----------------------------------------------------------------------------------------------


def check_no_weight_left_behind(saved_keys: list[str], state_dict: dict) -> None:
    """A sharded checkpoint loads only the weights the module asks for: refuse one that holds weights
    this module has no place for (a resume with other ``model.lora`` target modules would drop them)."""
    left_behind = sorted(set(saved_keys) - set(state_dict))
    if left_behind:
        raise ConfigError(
            f"The sharded checkpoint holds {len(left_behind)} weights this module does not have "
            f"({', '.join(left_behind[:3])}{' ...' if len(left_behind) > 3 else ''}): was it saved "
            "with the same model.model_name_or_path and model.lora settings?"
        )


def default_checkpointing_of(trainer: pl.Trainer) -> list[Callback]:
    """What a plain ``lightning.Trainer`` (a run from Python) needs to get ``lit-grpo fit``'s
    checkpointing: where its only ``ModelCheckpoint`` is Lightning's default (one checkpoint at the
    end of each epoch, which a GRPO run of ``max_steps`` may never reach), the one
    :func:`configure_checkpointing` adds (returned from ``configure_callbacks``, it replaces
    Lightning's); a ``ModelCheckpoint`` of the user's own is kept. With checkpointing on, a
    :class:`~lit_grpo.run.preemption.CheckpointEveryNMinutes` and a :class:`~lit_grpo.run.preemption.CheckpointOnSignal`
    unless the Trainer has its own. Atomic writes (:class:`AtomicCheckpointIO`) replace plain
    ``torch.save`` ones."""
    if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:
        trainer.strategy.checkpoint_io = AtomicCheckpointIO()
    if not trainer.checkpoint_callbacks:  # trainer.enable_checkpointing is false
        return []
    callbacks: list[Callback] = []
    checkpoints = [callback for callback in trainer.callbacks if isinstance(callback, ModelCheckpoint)]
    lightning_default = len(checkpoints) == 1 and type(checkpoints[0]) is ModelCheckpoint and _is_lightning_default(checkpoints[0])
    if lightning_default or not checkpoints:
        callbacks.append(ModelCheckpoint(save_last=True, save_top_k=0, every_n_train_steps=DEFAULT_CHECKPOINT_EVERY_N_TRAIN_STEPS))
    for kind in (CheckpointEveryNMinutes, CheckpointOnSignal):
        if not any(isinstance(callback, kind) for callback in trainer.callbacks):
            callbacks.append(kind())
    return callbacks


def _is_lightning_default(checkpoint: ModelCheckpoint) -> bool:
    """The ``ModelCheckpoint()`` Lightning adds when a Trainer is given none. Its intervals are private
    attributes; ``state_key`` (public: the identity Lightning saves a callback's state under) holds them, with
    the monitor and its mode."""
    return (checkpoint.dirpath is None and checkpoint.filename is None and not checkpoint.save_last
            and checkpoint.save_top_k == 1 and checkpoint.state_key == ModelCheckpoint().state_key)


def check_python_rewards(saved: dict[str, str], current: list[str]) -> None:
    """On resume: every reward the checkpoint's run got as a Python object (``saved``: name ->
    package, ``python`` for those) is given again under the same ``module:qualname``."""
    missing = [name for name, package in saved.items() if package == "python" and name not in current]
    if missing:
        raise ConfigError(
            f"the checkpoint was trained with the reward(s) {missing} given in Python, which this run does not have "
            f"(its rewards: {current}); pass the same functions again (a renamed or moved function is another reward)"
        )


def configure_checkpointing(trainer_config) -> None:
    """Give the ``trainer:`` config of ``lit-grpo fit`` what ``--ckpt_path last`` needs (in place).

    Unless ``trainer.enable_checkpointing`` is false:

    - without any ``ModelCheckpoint`` in ``trainer.callbacks``, one is added that keeps only
      ``last.ckpt``, rewritten every :data:`DEFAULT_CHECKPOINT_EVERY_N_TRAIN_STEPS` optimizer steps
      (and at the end of a run that wrote none). Like any ``ModelCheckpoint`` without a ``dirpath``,
      it writes to ``checkpoints/`` in the run's directory (:mod:`lit_grpo.run.directory`), where
      ``--ckpt_path last`` finds it;
    - without a :class:`~lit_grpo.run.preemption.CheckpointEveryNMinutes`, one every
      :data:`~lit_grpo.run.preemption.DEFAULT_CHECKPOINT_EVERY_N_MINUTES` minutes, and without a
      :class:`~lit_grpo.run.preemption.CheckpointOnSignal`, one for SIGTERM, SIGINT and SIGUSR1: both have
      the ``ModelCheckpoint`` that keeps ``last.ckpt`` write it between its steps;
    - without a ``CheckpointIO`` in ``trainer.plugins``, :class:`AtomicCheckpointIO` is added.

    ``trainer_config`` is the parsed ``trainer`` namespace of LightningCLI; what is added appears in
    the ``config.yaml`` that the run saves.
    """
    if trainer_config.get("enable_checkpointing") is False:
        return
    callbacks = _as_list(trainer_config.get("callbacks"))
    if not any(is_class_config(c, ModelCheckpoint) for c in callbacks):
        callbacks.insert(  # first: Lightning's trainer.checkpoint_callback is the first checkpoint callback
            0,
            Namespace(
                class_path="lightning.pytorch.callbacks.ModelCheckpoint",
                init_args=Namespace(
                    save_last=True,
                    save_top_k=0,
                    every_n_train_steps=DEFAULT_CHECKPOINT_EVERY_N_TRAIN_STEPS,
                ),
            )
        )
    if not any(is_class_config(c, CheckpointEveryNMinutes) for c in callbacks):
        callbacks.append(Namespace(class_path="lit_grpo.run.preemption.CheckpointEveryNMinutes",
                                   init_args=Namespace(minutes=DEFAULT_CHECKPOINT_EVERY_N_MINUTES)))
    if not any(is_class_config(c, CheckpointOnSignal) for c in callbacks):
        callbacks.append(Namespace(class_path="lit_grpo.run.preemption.CheckpointOnSignal",
                                   init_args=Namespace(signals=list(DEFAULT_STOP_SIGNALS))))
    trainer_config.callbacks = callbacks

    plugins = _as_list(trainer_config.get("plugins"))
    if not any(is_class_config(p, CheckpointIO) or isinstance(p, CheckpointIO) for p in plugins):
        plugins.append(Namespace(class_path=f"{__name__}.AtomicCheckpointIO"))
        trainer_config.plugins = plugins


def _as_list(value) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, list) else [value]


def is_class_config(value, base: type) -> bool:
    """Whether ``value`` is a ``{class_path, init_args}`` config of a subclass of ``base``."""
    class_path = value.get("class_path") if hasattr(value, "get") else None
    if not isinstance(class_path, str) or "." not in class_path:
        return False
    module_name, _, class_name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError):
        return False
    return isinstance(cls, type) and issubclass(cls, base)
