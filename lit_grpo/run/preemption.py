"""Preemption loses nothing: checkpoints between the step-based ones, every N minutes and on a signal.

A run's ``last.ckpt`` is written by Lightning's ``ModelCheckpoint`` with ``save_last`` (``lit-grpo fit``
adds one that writes every 100 optimizer steps; :mod:`lit_grpo.run.checkpointing`). On a cluster or a spot
machine that is not enough: a signal before the time limit or the reclaim would lose every step since
the last multiple of the interval, and slow steps stretch that to hours. Two callbacks close the gap.
Neither writes a file itself: each has that ``ModelCheckpoint`` save as it does at one of its own
steps (:func:`save_checkpoint_now`), so there is one writer of ``last.ckpt`` and its bookkeeping stays
its own.

- :class:`CheckpointEveryNMinutes`: a checkpoint once ``minutes`` have passed since the last one
  (Lightning's ``train_time_interval`` cannot be combined with ``every_n_train_steps`` in one
  ``ModelCheckpoint``, and is not applied under manual optimization, which GRPO uses).
- :class:`CheckpointOnSignal`: on SIGTERM, SIGINT or SIGUSR1 (configurable) the run finishes the
  training step in progress (its optimizer steps, its logging), checkpoints it and stops with
  :class:`StoppedBySignal`; ``--ckpt_path last`` then continues exactly as if it had never stopped.
  The checkpoint waits a few seconds at most for the asynchronous pipeline's work in flight; a batch not
  sampled or scored by then is sampled or scored after the resume.

Several processes: a signal may reach one rank first (``kill`` to one process, Lightning's launcher
forwarding it later). At the end of every training step the ranks all-reduce what they received, so
every rank checkpoints and stops after the same step.

Lightning's own handlers are chained, not replaced: the handlers are installed in ``on_train_start``,
after Lightning's signal connector has set its own, and the handler each one replaced (Lightning's
SIGTERM notifier; under SLURM with ``auto_requeue`` its SIGUSR1 handler, which saves an
``hpc_ckpt_N.ckpt`` and requeues the job with ``scontrol requeue``; a handler of the user's) runs when
the run stops, after the checkpoint, on every rank at the same point, so that collectives in it pair
up. Python's own defaults are not chained: a second Ctrl-C raises ``KeyboardInterrupt`` at once
(Lightning then stops without a checkpoint; the previous one stays).
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Sequence
from contextlib import ExitStack
from time import monotonic
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Checkpoint, ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_warn

from lit_grpo.errors import ConfigError

__all__ = [
    "DEFAULT_CHECKPOINT_EVERY_N_MINUTES",
    "DEFAULT_SIGNAL_WAIT_SECONDS",
    "DEFAULT_STOP_SIGNALS",
    "CheckpointEveryNMinutes",
    "CheckpointOnSignal",
    "StoppedBySignal",
    "last_checkpoint_keeper",
    "save_checkpoint_now",
]

DEFAULT_CHECKPOINT_EVERY_N_MINUTES = 30.0
DEFAULT_STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1")
DEFAULT_SIGNAL_WAIT_SECONDS = 5.0  # for work in flight (the asynchronous pipeline's), within a 30 s grace


def last_checkpoint_keeper(trainer: pl.Trainer) -> ModelCheckpoint | None:
    """The ``ModelCheckpoint`` that keeps the run's ``last.ckpt``: the first with ``save_last``."""
    return next((c for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint) and c.save_last), None)


def save_checkpoint_now(trainer: pl.Trainer, keeper: ModelCheckpoint) -> str:
    """Have ``keeper`` save now as it does at one of its own steps (its top-k checkpoint where it keeps
    any, then ``last.ckpt``), unless it has saved at this step already; the path of its ``last.ckpt``.

    Called at the end of a training step, where ``ModelCheckpoint`` itself saves, so the checkpoint
    resumes exactly. The methods are Lightning's own steps of ``ModelCheckpoint.on_train_batch_end``
    (private, checked by tests/run/test_preemption.py): its ``last_model_path``, the step it saved last and
    its version counter stay consistent, so ``last.ckpt`` is never written as ``last-v1.ckpt``.
    """
    # Not already saved at this step; or no checkpoint yet at step 0, where the steps of the asynchronous
    # pipeline's fill (lit_grpo.rollout.async_pipeline) took and sampled batches without an optimizer step.
    no_checkpoint_yet = trainer.global_step == 0 and not keeper.last_model_path and not trainer.sanity_checking
    # private: Lightning 2.6 has no public "save now as at your own step" (trainer.save_checkpoint leaves the
    # callback's last_model_path, top-k and version counter behind); test_preemption fails if they are renamed
    if not keeper._should_skip_saving_checkpoint(trainer) or no_checkpoint_yet:
        candidates = keeper._monitor_candidates(trainer)
        if keeper.monitor is None or keeper.monitor in candidates:
            keeper._save_topk_checkpoint(trainer, candidates)
        keeper._save_last_checkpoint(trainer, candidates)
    return keeper.last_model_path


def _any_rank(trainer: pl.Trainer, flags: list[bool]) -> list[bool]:
    """``flags`` or-ed over every rank (one all-reduce; every rank must call it at the same point)."""
    local = torch.tensor(flags, dtype=torch.int32, device=trainer.strategy.root_device)
    return [bool(flag) for flag in trainer.strategy.reduce(local, reduce_op="max").tolist()]


class CheckpointEveryNMinutes(Checkpoint):
    """A checkpoint (the run's ``last.ckpt``) once ``minutes`` have passed since the last one, beside
    the step-based interval of the ``ModelCheckpoint`` that keeps it: whichever comes first.

    Checked at the end of every training step; the clock restarts whenever that ``ModelCheckpoint``
    saves, by its steps or by this interval. The ranks decide together (rank clocks differ slightly).
    """

    def __init__(self, minutes: float = DEFAULT_CHECKPOINT_EVERY_N_MINUTES) -> None:
        if not minutes > 0:
            raise ConfigError(f"CheckpointEveryNMinutes(minutes={minutes}): the interval must be more than 0 minutes")
        self.minutes = minutes
        self._last_saved_at = 0.0

    @property
    def state_key(self) -> str:
        return self._generate_state_key(minutes=self.minutes)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_saved_at = monotonic()
        if last_checkpoint_keeper(trainer) is None:
            rank_zero_warn(f"CheckpointEveryNMinutes(minutes={self.minutes}) does nothing: no ModelCheckpoint in "
                           "trainer.callbacks keeps a last.ckpt (save_last: true)")

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx: int) -> None:
        keeper = last_checkpoint_keeper(trainer)
        if keeper is None:
            return
        # it saved at this step, by its own interval (private: no public record of the step; see save_checkpoint_now)
        if keeper._last_global_step_saved == trainer.global_step:
            self._last_saved_at = monotonic()
            return
        (due,) = _any_rank(trainer, [monotonic() - self._last_saved_at >= 60 * self.minutes])
        if due:
            save_checkpoint_now(trainer, keeper)
            self._last_saved_at = monotonic()


class StoppedBySignal(SystemExit):
    """The run stopped on a signal after checkpointing the training step it had reached.

    Raised by :class:`CheckpointOnSignal` on every rank, through ``trainer.fit``. A ``SystemExit``: a
    Python script that does not catch it ends with its message (rank 0) and no traceback; ``lit-grpo``
    prints one line with the command that resumes the run and exits with ``exit_status``, 128 + the
    signal's number, as a shell reports a process that a signal ended.
    """

    def __init__(self, signal_name: str, step: int, checkpoint: str | None, announce: bool = True) -> None:
        self.signal_name, self.step, self.checkpoint, self.announce = signal_name, step, checkpoint, announce
        self.exit_status = 128 + signal.Signals[signal_name].value
        super().__init__(self.describe(f"trainer.fit(..., ckpt_path={checkpoint!r})") if announce else self.exit_status)

    def describe(self, resume: str) -> str:
        """One line: what stopped the run, after which step, where its checkpoint is, and ``resume``."""
        if self.checkpoint is None:
            return (f"stopped by {self.signal_name} after optimizer step {self.step}, without a checkpoint: no "
                    "ModelCheckpoint in trainer.callbacks keeps a last.ckpt (save_last: true)")
        return f"stopped by {self.signal_name} after optimizer step {self.step}; checkpoint: {self.checkpoint}; resume: {resume}"


class CheckpointOnSignal(Checkpoint):
    """On one of ``signals`` the run finishes the training step in progress, checkpoints it (the run's
    ``last.ckpt``) and stops with :class:`StoppedBySignal`.

    The signal is noted by the handler and acted on at the end of the training step: its optimizer
    steps and its logging complete, then the ranks agree (an all-reduce) and every rank has the
    ``ModelCheckpoint`` that keeps ``last.ckpt`` save (:func:`save_checkpoint_now`). The run stops
    before the next step or validation starts: the handlers replaced are run on every rank (see the
    module's docstring), then :class:`StoppedBySignal` is raised. A run that reaches ``max_steps``
    with that step ends as usual.

    Handlers are set in ``on_train_start`` (a signal before then ends the run as without lit-grpo),
    from the main thread only, and put back when training ends. A signal during a validation is acted
    on at the end of the next training step. A second Ctrl-C stops at once (``KeyboardInterrupt``).

    The checkpoint waits at most ``in_flight_wait_seconds`` for work in flight in the background (the
    asynchronous pipeline's sampling and scoring, ``model.max_staleness``: a callback with a
    ``checkpoint_waiting_at_most(seconds)`` context), so that it is written within the grace a cluster
    or a spot VM gives before the kill (30 s for torchrun, SLURM and most clouds); what is not done by
    then is saved as what is left to do, and done after the resume.
    """

    def __init__(self, signals: Sequence[str] = DEFAULT_STOP_SIGNALS,
                 in_flight_wait_seconds: float = DEFAULT_SIGNAL_WAIT_SECONDS) -> None:
        if not in_flight_wait_seconds >= 0:
            raise ConfigError(f"CheckpointOnSignal(in_flight_wait_seconds={in_flight_wait_seconds}): must be at least 0 seconds")
        self.in_flight_wait_seconds = in_flight_wait_seconds
        self.signals = [_signal_named(name) for name in signals]
        self._replaced: dict[signal.Signals, Any] = {}  # signal -> the handler it had before
        self._received: set[signal.Signals] = set()  # on this rank, not yet acted on
        self._stop: StoppedBySignal | None = None  # checkpointed; raised when the next step or validation starts
        self._stopping: list[signal.Signals] = []  # the signals received on any rank, once agreed on
        self._announce = True

    @property
    def state_key(self) -> str:
        return self._generate_state_key(signals=[s.name for s in self.signals])

    # -- the handlers ----------------------------------------------------------------------------

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._received, self._stop, self._stopping = set(), None, []
        self._announce = trainer.is_global_zero
        if threading.current_thread() is not threading.main_thread():
            rank_zero_warn("CheckpointOnSignal: training runs outside the main thread, where signal handlers cannot be "
                           "set; a signal ends the run as it would without lit-grpo")
            return
        for signum in self.signals:
            self._replaced[signum] = signal.getsignal(signum)
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        signum = signal.Signals(signum)
        if self._stopping:  # already checkpointing and stopping: nothing more to do
            return
        if signum == signal.SIGINT and signal.SIGINT in self._received:  # Ctrl-C twice: stop now
            raise KeyboardInterrupt
        if not self._received and self._announce:  # os.write to stderr: safe inside a handler, unlike print
            again = " (Ctrl-C again: stop at once, without it)" if signum == signal.SIGINT else ""
            os.write(2, f"\n{signum.name}: stopping after the step in progress, with a checkpoint{again}\n".encode())
        self._received.add(signum)

    def _put_back_handlers(self) -> None:
        for signum, handler in self._replaced.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._replaced = {}

    # -- acting on a signal ----------------------------------------------------------------------

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx: int) -> None:
        if not self.signals:
            return
        received_anywhere = _any_rank(trainer, [signum in self._received for signum in self.signals])
        self._stopping = [signum for signum, received in zip(self.signals, received_anywhere) if received]
        if not self._stopping:
            return
        keeper = last_checkpoint_keeper(trainer)
        with ExitStack() as bounded:  # work in flight: waited for at most in_flight_wait_seconds
            for callback in trainer.callbacks:
                waiting_at_most = getattr(callback, "checkpoint_waiting_at_most", None)
                if callable(waiting_at_most):
                    bounded.enter_context(waiting_at_most(self.in_flight_wait_seconds))
            checkpoint = save_checkpoint_now(trainer, keeper) if keeper is not None else None
        self._stop = StoppedBySignal(self._stopping[0].name, trainer.global_step, checkpoint, announce=trainer.is_global_zero)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch, batch_idx: int) -> None:
        self._stop_if_checkpointed()

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stop_if_checkpointed()

    def _stop_if_checkpointed(self) -> None:
        if self._stop is None:
            return
        replaced = self._replaced
        for signum in self._stopping:  # the handlers this one replaced, now, on every rank
            handler = replaced.get(signum)
            if callable(handler) and handler is not signal.default_int_handler:
                handler(signum, None)
        stop, self._stop = self._stop, None
        raise stop

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._put_back_handlers()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._put_back_handlers()


def _signal_named(name: str) -> signal.Signals:
    """``SIGTERM`` (or ``TERM``, any case) as a signal this process can handle; else a one-line error."""
    key = name.upper() if name.upper().startswith("SIG") else f"SIG{name.upper()}"
    found = getattr(signal.Signals, key, None) if key in signal.Signals.__members__ else None
    if found is None or found in (signal.SIGKILL, signal.SIGSTOP):
        raise ConfigError(
            f"CheckpointOnSignal signals: {name!r} is not a signal a process can catch "
            f"(for example {', '.join(DEFAULT_STOP_SIGNALS)})"
        )
    return found
