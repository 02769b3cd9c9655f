"""Small Lightning callbacks the module adds to every run that asks for them."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.utilities import rank_zero_warn

__all__ = ["StepProgressBar", "ValidateBeforeTraining", "ignore_expected_lightning_warnings"]


def ignore_expected_lightning_warnings() -> None:
    """Validation is optional (``data.val_split``): without it Lightning skips the loop, as intended,
    so its warning about a ``validation_step`` without a ``val_dataloader`` is noise."""
    warnings.filterwarnings("ignore", message=r"You defined a `validation_step` but have no `val_dataloader`")


class ValidateBeforeTraining(pl.Callback):
    """Run the validation loop once before the first training step (``model.validate_before_training``),
    so the untrained model's ``val/*`` metrics are logged at step 0 as the baseline of the curve.

    A resumed run (``global_step > 0``) does not repeat it. It uses the same loop as
    ``trainer.val_check_interval``, so its metrics are reduced over every rank like any validation.
    """

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        val_loop = trainer.fit_loop.epoch_loop.val_loop
        if trainer.global_step > 0:
            return
        if not val_loop._data_source.is_defined():
            rank_zero_warn("model.validate_before_training is set but there is no validation data (data.val_split)")
            return
        trainer.validating = True
        first_loop_iter = trainer._logger_connector._first_loop_iter
        val_loop.run()
        trainer.training = True
        trainer._logger_connector._first_loop_iter = first_loop_iter


class StepProgressBar(TQDMProgressBar):
    """The training bar counts optimizer steps out of ``trainer.max_steps`` (what a GRPO run is
    measured in; an epoch of prompts means little here) and shows the reward, without Lightning's
    ``Epoch N/-2`` and ``v_num``. ``lit-grpo fit`` uses it unless the config names a progress bar."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self.train_progress_bar.reset(total=trainer.max_steps if trainer.max_steps > 0 else None)
        self.train_progress_bar.n = trainer.global_step  # a resumed run starts where it stopped
        self.train_progress_bar.set_description("steps")

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

    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict:
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        return metrics
