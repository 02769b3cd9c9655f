"""Small Lightning callbacks the module adds to every run that asks for them, and the one place where
lit-grpo silences Lightning's messages that a user cannot act on."""

from __future__ import annotations

import logging
import warnings
from contextlib import ExitStack

import lightning.pytorch as pl
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from tqdm.contrib.logging import logging_redirect_tqdm

from lit_grpo import openmp
from lit_grpo.cpu.threads import CpuThreads

__all__ = ["CpuThreadsCallback", "StepProgressBar", "StepRichProgressBar", "ValidateBeforeTraining", "ignore_expected_lightning_warnings",
           "step_progress_bar_for"]


# What Lightning says on every run that a lit-grpo user can do nothing about: (category, the start
# of the message, why it is not actionable). Matched by message and category, so every other
# warning, and these same messages in another category, still show.
EXPECTED_LIGHTNING_WARNINGS = [
    (PossibleUserWarning, "You defined a `validation_step` but have no `val_dataloader`",
     "validation is optional (data.val_split): without it Lightning skips the loop, as intended"),
    (UserWarning, "Using ModelCheckpoint with manual optimization and every_n_train_steps",
     "GRPO optimizes manually; a checkpoint holds the weights after the step, which is what resuming needs"),
    (UserWarning, "The dirpath has changed from",
     "a run started from another run's checkpoint writes to a run directory of its own (lit_grpo.run.directory)"),
    (UserWarning, "Checkpoint directory .* exists and is not empty",
     "only a resumed run writes into a checkpoint directory that holds checkpoints (lit_grpo.run.directory)"),
    (UserWarning, "LightningCLI's args parameter is intended to run from within Python",
     "`lit-grpo prompts` parses the fit configuration with LightningCLI from its own arguments"),
    (FutureWarning, r"`isinstance\(treespec, LeafSpec\)` is deprecated",
     "Lightning's own use of torch.utils._pytree"),
    (FutureWarning, r"torch\.distributed\.nn\.functional\.all_gather is deprecated",
     "Lightning's own all_gather"),
]
# Lightning's advertisements for its cloud services, logged (not warned) at the start of a run.
LIGHTNING_TIPS = "💡 Tip: "
# Logged when a plain Trainer's default callbacks give way to lit-grpo's, which is the intent: its
# checkpoint callback to lit-grpo's (every 100 steps and 30 minutes:
# lit_grpo.run.checkpointing.default_checkpointing_of), its TQDMProgressBar to StepProgressBar
# (step_progress_bar_for). A callback of the user's own is kept, and then the message does not come.
DEFAULT_CALLBACKS_REPLACED = ("The following callbacks returned in `LightningModule.configure_callbacks` will override"
                              " existing callbacks passed to Trainer: ")
REPLACED_DEFAULTS = {"ModelCheckpoint", "RichProgressBar", "TQDMProgressBar"}


class _WithoutLightningTips(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        replaced = message.startswith(DEFAULT_CALLBACKS_REPLACED) and set(
            message.removeprefix(DEFAULT_CALLBACKS_REPLACED).split(", ")) <= REPLACED_DEFAULTS
        return not (message.startswith(LIGHTNING_TIPS) or replaced)


def ignore_expected_lightning_warnings() -> None:
    """Silence what Lightning says on every run that the user cannot act on
    (:data:`EXPECTED_LIGHTNING_WARNINGS`, and its tips about its cloud services): the one place
    where lit-grpo silences messages for a whole run. Every process of a run calls it (importing
    ``lit_grpo.train.module`` does), so it holds for every rank."""
    for category, message, _why in EXPECTED_LIGHTNING_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    rank_zero_logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")  # rank_zero_info's
    if not any(isinstance(f, _WithoutLightningTips) for f in rank_zero_logger.filters):
        rank_zero_logger.addFilter(_WithoutLightningTips())


class ValidateBeforeTraining(pl.Callback):
    """Run the validation loop once before the first training step (``model.validate_before_training``),
    so the untrained model's ``val/*`` metrics are logged at step 0 as the baseline of the curve.

    A resumed run (``global_step > 0``) does not repeat it. It uses the same loop as
    ``trainer.val_check_interval``, so its metrics are reduced over every rank like any validation.
    """

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.fit_loop.epoch_loop.val_loop._data_source.is_defined():  # said before any progress bar
            rank_zero_warn("model.validate_before_training is set but there is no validation data (data.val_split)")

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        val_loop = trainer.fit_loop.epoch_loop.val_loop
        if trainer.global_step > 0 or not val_loop._data_source.is_defined():
            return
        trainer.validating = True
        first_loop_iter = trainer._logger_connector._first_loop_iter
        val_loop.run()
        trainer.training = True
        trainer._logger_connector._first_loop_iter = first_loop_iter


class StepProgressBar(TQDMProgressBar):
    """The training bar counts optimizer steps out of ``trainer.max_steps`` (what a GRPO run is
    measured in; an epoch of prompts means little here) and shows the reward, without Lightning's
    ``Epoch N/-2`` and ``v_num``. ``lit-grpo fit`` uses it unless the config names a progress bar; a
    plain ``Trainer`` gets it in place of its default bar (:func:`step_progress_bar_for`).

    A resumed run's bar starts at the step it resumes and counts its speed from there. While the bar
    is shown, what lit-grpo and Lightning log (the CPU threads, a reward's failures) is written above
    it, each on a line of its own (tqdm's ``logging_redirect_tqdm``), not at the end of the bar."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._logs_above_the_bar = ExitStack()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        bar = self.train_progress_bar
        bar.reset(total=trainer.max_steps if trainer.max_steps > 0 else None)
        bar.n = bar.initial = trainer.global_step  # a resumed run starts where it stopped; its speed counts from there
        bar.set_description("steps")
        if not bar.disable:
            self._logs_above_the_bar.enter_context(logging_redirect_tqdm(_console_loggers()))

    def on_train_epoch_start(self, trainer: pl.Trainer, *_) -> None:
        """One bar for the whole run: nothing to reset when the prompts start over."""

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx: int) -> None:
        bar = self.train_progress_bar
        if bar is not None and not bar.disable:
            bar.n = trainer.global_step
            bar.set_postfix(self.get_metrics(trainer, pl_module), refresh=True)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.train_progress_bar.disable:
            self.train_progress_bar.set_postfix(self.get_metrics(trainer, pl_module))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        self._logs_above_the_bar.close()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """Close the bars still shown, each left on a line of its own, so that the error the run ends
        with starts on a fresh line rather than at the end of a bar."""
        self._logs_above_the_bar.close()
        for bar in (self._val_progress_bar, self._train_progress_bar):
            if bar is not None and not bar.disable:
                bar.leave = True
                bar.close()

    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict:
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        return metrics


def _console_loggers() -> list[logging.Logger]:
    """The loggers whose lines go to the console: Lightning's (its own handler, when the root logger has
    none), the root logger's handlers if it has any, else lit-grpo's (Python's last-resort handler)."""
    root = logging.getLogger()
    loggers = [logger for logger in (logging.getLogger("lightning.pytorch"), root) if logger.handlers]
    return loggers if root.handlers else [*loggers, logging.getLogger("lit_grpo")]


class StepRichProgressBar(RichProgressBar):
    """Lightning's rich progress bar (a plain ``Trainer``'s default when ``rich`` is installed) counting
    optimizer steps out of ``trainer.max_steps``, as :class:`StepProgressBar` does, for one bar for the run."""

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.is_disabled or self.progress is None or self.train_progress_bar_id is not None:
            return
        total = trainer.max_steps if trainer.max_steps > 0 else None
        self.train_progress_bar_id = self.progress.add_task("steps", total=total, completed=trainer.global_step)
        self.refresh()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx: int) -> None:
        if self.progress is not None and self.train_progress_bar_id is not None:
            self.progress.update(self.train_progress_bar_id, completed=trainer.global_step)
        self._update_metrics(trainer, pl_module)
        self.refresh()

    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict:
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        return metrics


def step_progress_bar_for(trainer: pl.Trainer) -> list[pl.Callback]:
    """A plain ``Trainer``'s default progress bar (Lightning's ``RichProgressBar`` or ``TQDMProgressBar``)
    as one counting optimizer steps out of ``max_steps`` (same refresh rate; ``GRPOModule.configure_callbacks``
    returns it in place of the default); ``[]`` when the bar is off or one of the user's own kind."""
    bar = trainer.progress_bar_callback
    if type(bar) is TQDMProgressBar:
        return [StepProgressBar(refresh_rate=bar.refresh_rate, process_position=bar.process_position)]
    if type(bar) is RichProgressBar:
        return [StepRichProgressBar(refresh_rate=bar.refresh_rate, leave=bar._leave, theme=bar.theme)]
    return []


class CpuThreadsCallback(pl.Callback):
    """On the CPU, the threads of each step follow the cores other processes leave free
    (:class:`lit_grpo.cpu.threads.CpuThreads`), logged as ``cpu/threads``; the choice and OpenMP's
    wait policy (:mod:`lit_grpo.openmp`) are said once when training starts."""

    def __init__(self) -> None:
        self.threads: CpuThreads | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if pl_module.device.type != "cpu":
            return
        self.threads = CpuThreads()
        from lightning.pytorch.utilities import rank_zero_info

        rank_zero_info(f"CPU: {self.threads.describe()}; OpenMP threads wait: {openmp.wait_policy()}")

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch, batch_idx: int) -> None:
        if self.threads is not None:
            pl_module.log("cpu/threads", float(self.threads.update()), on_step=True, on_epoch=False)
