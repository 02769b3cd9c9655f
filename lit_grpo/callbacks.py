"""Small Lightning callbacks the module adds to every run that asks for them."""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_warn

__all__ = ["ValidateBeforeTraining"]


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
