"""A generation server lost mid-run: a checkpoint that loses nothing, and one line that says so.

When a vLLM server dies or hangs, the server engine (:mod:`lit_grpo.rollout.engines.vllm_server`) waits up to
``model.vllm_server_timeout``, then every rank raises :class:`GenerationServerLost` at the same point.
Any other failure of a sampling call (a request the server refuses, an answer that is not what was
asked for) is agreed on every rank the same way, as :class:`GenerationFailed` (the class of both).
That happens while a training step samples (or validation does), before the step's first optimizer
step: the weights, the optimizer and the scheduler are still those of the end of the previous step.
:class:`CheckpointWhenServerLost` then writes the run's ``last.ckpt`` as the previous step left it
(through the ``ModelCheckpoint`` that keeps it, as :mod:`lit_grpo.run.preemption` does):

- the random number generators as they were when the step began (its seed draws undone);
- the step's batch given back to the data loader (:meth:`ResumableDataLoader.rewind`), and Lightning's
  count of logged steps one back, so that the resumed run starts the same step with the same batch
  and logs it at the same step;

and the run stops with one line: what was lost, where the checkpoint is, the command that resumes.
With the server restarted, ``--ckpt_path last`` goes on as if nothing had happened (the first push of
the resumed run gives the server the checkpoint's weights). A server lost during validation stops the
run likewise; the checkpoint then resumes after that step, whose validation is not repeated.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from lit_grpo.errors import CheckpointedError
from lit_grpo.run.checkpointing import ResumableDataLoader, capture_rng_states, restore_rng_states
from lit_grpo.run.completions import unlog_step
from lit_grpo.run.preemption import last_checkpoint_keeper, save_checkpoint_now

__all__ = ["CheckpointWhenServerLost", "GenerationFailed", "GenerationServerLost"]


class GenerationFailed(CheckpointedError):
    """A sampling call that failed on a generation server (a request it refused, an answer cut off or
    not what was asked for). Raised on every rank at the same point, with the failing rank's message;
    ``checkpoint``: the checkpoint written before the run stopped (None: none could be)."""

    fix = "once that is fixed, resume"  # what to do, before the command that resumes

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.checkpoint: str | None = None

    def describe(self, resume: str) -> str:
        """One line: what failed, the checkpoint, and ``resume``, the command that goes on."""
        if self.checkpoint is None:
            return f"{self}; no checkpoint written (no ModelCheckpoint keeps a last.ckpt)"
        return f"{self}; checkpoint: {self.checkpoint}; {self.fix}: {resume}"


class GenerationServerLost(GenerationFailed):
    """A generation server that died or hung for longer than ``model.vllm_server_timeout``."""

    fix = "restart the server, then resume"


class CheckpointWhenServerLost(Callback):
    """On :class:`GenerationFailed` (a lost server among them), write ``last.ckpt`` as the previous
    training step left it (see the module's docstring); every rank takes part, as the error reached
    them all together."""

    def __init__(self) -> None:
        self._random_states: dict[str, Any] | None = None  # at the start of the current step or validation
        self._loader_state: dict[str, Any] | None = None  # the data loader's, at the start of the current step
        self._in_training_step = False

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch, batch_idx: int) -> None:
        self._random_states, self._in_training_step = capture_rng_states(), True
        loader = trainer.train_dataloader
        self._loader_state = loader.state_dict() if isinstance(loader, ResumableDataLoader) else None

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx: int) -> None:
        self._in_training_step = False

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._random_states = capture_rng_states()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if not isinstance(exception, GenerationFailed) or self._random_states is None:
            return
        restore_rng_states(self._random_states)
        if self._in_training_step:
            if self._loader_state is not None:  # the step's batch (and any drawn since) was not trained on
                trainer.train_dataloader.rewind(self._loader_state, batches=1)
            # the checkpoint of the end of the previous step, written there, counts that step as not yet logged
            unlog_step(trainer)
        keeper = last_checkpoint_keeper(trainer)
        exception.checkpoint = save_checkpoint_now(trainer, keeper) if keeper is not None else None
