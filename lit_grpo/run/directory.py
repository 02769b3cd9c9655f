"""The files of a run: one directory per run, which a resumed run continues.

Everything a ``lit-grpo fit`` run writes is in its run directory:

- a TensorBoard or CSV logger's version directory, ``<save_dir>/<name>/version_N`` (the events,
  or ``metrics.csv``, and ``hparams.yaml``);
- for Weights & Biases, ``<save_dir>/<project>/<run id>`` (W&B's own files in its ``wandb/``);
- for any other logger, ``<save_dir or default_root_dir>/<name>/<version>`` (with MLflow and a
  local tracking URI, MLflow's own directory of the run);
- without a logger (``trainer.logger: false``), ``trainer.default_root_dir``;

and in it ``config.yaml`` (the configuration as started; ``config-resume-K.yaml`` as resumed the
K-th time), ``checkpoints/`` (Lightning's ``ModelCheckpoint`` writes there when it has no ``dirpath``
of its own) and ``completions.jsonl``.

Which directory a run gets (:func:`place_run`, on the parsed configuration; every process of a
multi-process run resolves the same one from the same files, before any of them writes):

- without ``--ckpt_path``: a new one, the next ``version_N`` (a new W&B run id). So a rerun never
  mixes its checkpoints or logs with an earlier run's, and ``--ckpt_path last`` means the newest
  run's last checkpoint;
- ``--ckpt_path last``: the newest run (the highest ``version_N``; for W&B, whose runs are named by
  their id, the one started or resumed last), whose ``checkpoints/last.ckpt`` it resumes, in the
  same directory: the logger's version is set to it, so the events, ``metrics.csv``, the W&B run
  and ``completions.jsonl`` go on where they stopped. A newest run without a checkpoint is an
  error that names the newest checkpoint there is;
- ``--ckpt_path <a run>/checkpoints/last.ckpt``: that run, likewise. Any other checkpoint file
  (an older one, another project's) starts a new run from it, so the later checkpoints of the run
  it comes from are kept;
- a checkpoint directory that does not change from run to run (no logger, a ``ModelCheckpoint``
  with its own ``dirpath``, a logger version set in the config) is written only by the run that
  resumes its ``last.ckpt``: another run there is refused, naming the checkpoints it would mix with;
- a ``--ckpt_path`` naming a URL or remote storage (``https://``, ``s3://``) is refused, before anything is
  fetched: checkpoints are read from local files only (:func:`lit_grpo.run.safe_loading.check_local_checkpoint`).

A new TensorBoard or CSV run that fails before its first optimizer step (a reward that raises on the
first batch, a setting refused as the model loads, Ctrl-C) takes its ``version_N`` directory away
again (:class:`RemoveRunWithoutSteps`): it holds nothing to resume, and left behind it would be the
newest run, which ``--ckpt_path last`` could not resume.
"""

from __future__ import annotations

import csv
import os
import re
import secrets
import shutil
import string
import sys
import threading
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from jsonargparse import Namespace
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger as LightningCSVLogger
from lightning.pytorch.loggers import TensorBoardLogger as LightningTensorBoardLogger
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment

from lit_grpo.errors import CheckpointedError, ConfigError, FileInTheWayError, MissingFileError, WriteError, writing
from lit_grpo.redaction import redact_message
from lit_grpo.run.checkpointing import is_class_config
from lit_grpo.run.safe_loading import check_local_checkpoint

__all__ = ["CSVLogger", "RemoveRunWithoutSteps", "Runs", "TensorBoardLogger", "find_last_checkpoint", "place_run", "resume_config_name", "run_directory"]

LAST_CHECKPOINT = ModelCheckpoint.CHECKPOINT_NAME_LAST + ModelCheckpoint.FILE_EXTENSION  # last.ckpt
CHECKPOINTS = "checkpoints"
CONFIG_FILE = "config.yaml"
LIGHTNING_CSV_LOGGER = {"lightning.pytorch.loggers.CSVLogger", "lightning.pytorch.loggers.csv_logs.CSVLogger"}
LIGHTNING_TENSORBOARD_LOGGER = {"lightning.pytorch.loggers.TensorBoardLogger", "lightning.pytorch.loggers.tensorboard.TensorBoardLogger"}
# ckpt_path values that name no file: Lightning resolves them itself
LIGHTNING_CKPT_NAMES = {"best", "hpc", "registry"}


class Runs:
    """The runs of one logger's configuration: one directory each below ``root`` (``<save_dir>/<name>``),
    ``version_N`` for TensorBoard and CSV (``numbered``), the run id for W&B; ``pinned``: the one
    directory of a config that sets the logger's version."""

    def __init__(self, root: Path, numbered: bool, pinned: Path | None = None) -> None:
        self.root, self.numbered, self.pinned = root, numbered, pinned

    def all(self) -> list[Path]:
        """Every run directory, oldest first."""
        if not self.root.is_dir():
            return []
        if self.numbered:
            versions = [(int(match.group(1)), path) for path in self.root.iterdir()
                        if path.is_dir() and (match := re.fullmatch(r"version_(\d+)", path.name))]
            return [path for _, path in sorted(versions)]
        return sorted((path for path in self.root.iterdir() if path.is_dir()), key=lambda path: path.stat().st_mtime)

    def newest(self) -> Path | None:
        runs = [self.pinned] if self.pinned is not None else self.all()
        return runs[-1] if runs else None

    def newest_checkpoint(self) -> Path | None:
        """The ``last.ckpt`` of the newest run that has one."""
        found = [run / CHECKPOINTS / LAST_CHECKPOINT for run in self.all()]
        found = [checkpoint for checkpoint in found if checkpoint.exists()]
        return found[-1] if found else None

    def run_of(self, checkpoint: Path) -> Path | None:
        """The run directory whose ``checkpoints/last.ckpt`` is ``checkpoint``, else None."""
        if checkpoint.name != LAST_CHECKPOINT or checkpoint.parent.name != CHECKPOINTS:
            return None
        run = checkpoint.parent.parent
        return run if run.parent.resolve() == self.root.resolve() else None

    def version(self, run: Path) -> int | str:
        """The logger's ``version`` (W&B: ``id``) that logs to ``run``."""
        match = re.fullmatch(r"version_(\d+)", run.name)
        return int(match.group(1)) if self.numbered and match else run.name


def first_logger(logger_config: Any) -> Any:
    """The logger whose directory holds the run (Lightning's ``trainer.loggers[0]``); False for none."""
    if isinstance(logger_config, list):
        return logger_config[0] if logger_config else False
    return logger_config if logger_config not in (None, True) else False


def runs_of(logger: Any, default_root_dir: str | None) -> Runs | None:
    """Where the runs of ``logger`` (a ``{class_path, init_args}`` config) are; None for a logger
    whose directories lit-grpo does not know (or none)."""
    if logger is False:
        return None
    init_args = logger.get("init_args") or {}
    if is_class_config(logger, LightningTensorBoardLogger) or is_class_config(logger, LightningCSVLogger):
        root = Path(init_args["save_dir"]) / str(init_args.get("name", "lightning_logs") or "")
        version = init_args.get("version")
        pinned = None if version is None else root / (f"version_{version}" if isinstance(version, int) else str(version))
        return Runs(root, numbered=True, pinned=pinned)
    if is_class_config(logger, WandbLogger):
        save_dir = init_args.get("save_dir") or init_args.get("dir")
        if save_dir in (None, ".") and default_root_dir:
            save_dir = default_root_dir
        root = Path(save_dir or ".") / str(init_args.get("project") or os.environ.get("WANDB_PROJECT", "lightning_logs"))
        run_id = init_args.get("version") or init_args.get("id")
        return Runs(root, numbered=False, pinned=None if run_id is None else root / str(run_id))
    return None


def last_checkpoint_dirpath(trainer_config: Any) -> Path | None:
    """The ``dirpath`` of the ``ModelCheckpoint`` that keeps ``last.ckpt``, when it has one of its own."""
    for callback in _as_list(trainer_config.get("callbacks")):
        if is_class_config(callback, ModelCheckpoint) and callback.init_args.get("save_last"):
            dirpath = callback.init_args.get("dirpath")
            return Path(dirpath) if dirpath is not None else None
    return None


def find_last_checkpoint(trainer_config: Any, subcommand: str | None) -> Path:
    """What ``--ckpt_path last`` resumes; a :class:`MissingFileError` saying where it looked and what to do."""
    logger = first_logger(trainer_config.get("logger"))
    runs = runs_of(logger, trainer_config.get("default_root_dir"))
    own_dirpath = last_checkpoint_dirpath(trainer_config)
    if subcommand == "fit" and trainer_config.get("enable_checkpointing") is not False:
        checkpoints = [c for c in _as_list(trainer_config.get("callbacks")) if is_class_config(c, ModelCheckpoint)]
        if checkpoints and not any(c.init_args.get("save_last") for c in checkpoints):
            raise ConfigError(
                "--ckpt_path last: no ModelCheckpoint in trainer.callbacks keeps a last.ckpt; add save_last: true "
                "to one (the next run can then resume), or give --ckpt_path a checkpoint file"
            )
    if own_dirpath is not None or logger is False:
        directory = own_dirpath or Path(trainer_config.get("default_root_dir") or ".") / CHECKPOINTS
        checkpoint = directory / LAST_CHECKPOINT
        if not checkpoint.exists():
            raise MissingFileError(f"--ckpt_path last: there is no {checkpoint} to resume; start the run without --ckpt_path")
        return checkpoint
    if runs is None:
        raise ConfigError(
            f"--ckpt_path last finds the runs of TensorBoard, CSV and W&B loggers; with {logger.get('class_path')} "
            "give the checkpoint file: --ckpt_path <the run's directory>/checkpoints/last.ckpt"
        )
    newest = runs.newest()
    if newest is None:
        raise MissingFileError(f"--ckpt_path last: there is no run to resume in {runs.root}; start the run without --ckpt_path")
    checkpoint = newest / CHECKPOINTS / LAST_CHECKPOINT
    if not checkpoint.exists():
        older = runs.newest_checkpoint()
        what_to_do = f"to resume the newest run that has one: --ckpt_path {older}" if older else "start the run without --ckpt_path"
        raise MissingFileError(
            f"--ckpt_path last: the newest run, {newest}, has no checkpoint ({checkpoint} is missing; it stopped "
            f"before its first or is a validation); {what_to_do}"
        )
    return checkpoint


def place_run(config: Any, subcommand: str | None) -> Path | None:
    """Give the parsed ``fit``/``validate`` configuration its run directory (in place; see the module's
    docstring): resolve ``--ckpt_path last``, set the logger's version of a resumed run, give a W&B run
    its directory, refuse to mix checkpoints. Returns the run directory a resumed run continues in."""
    trainer = config.trainer
    for each_logger in _as_list(trainer.get("logger")):  # lit-grpo's own, which report failed writes in one line
        class_path = each_logger.get("class_path") if hasattr(each_logger, "get") else None
        if class_path in LIGHTNING_CSV_LOGGER:
            each_logger.class_path = f"{__name__}.CSVLogger"
        elif class_path in LIGHTNING_TENSORBOARD_LOGGER:
            each_logger.class_path = f"{__name__}.TensorBoardLogger"
    logger = first_logger(trainer.get("logger"))
    ckpt_path = config.get("ckpt_path")
    if ckpt_path is not None:
        check_local_checkpoint(ckpt_path)  # a URL is refused before anything is fetched or loaded
    if ckpt_path == "last":
        ckpt_path = config.ckpt_path = str(find_last_checkpoint(trainer, subcommand))
    elif ckpt_path not in (None, *LIGHTNING_CKPT_NAMES) and not Path(ckpt_path).exists():
        raise MissingFileError(f"--ckpt_path {ckpt_path} does not exist")
    if subcommand == "validate":  # a validation logs to a directory of its own
        return None

    runs = runs_of(logger, trainer.get("default_root_dir"))
    checkpoint = Path(ckpt_path) if ckpt_path not in (None, *LIGHTNING_CKPT_NAMES) else None
    run = resumed = None  # the run's directory where it is known now; the one a resumed run goes on in
    if runs is not None:
        resumed = runs.run_of(checkpoint) if checkpoint is not None else None
        if resumed is not None:
            _set_version(logger, runs.version(resumed))
        run = resumed or runs.pinned
        if not runs.numbered:  # W&B: its save_dir becomes the run's directory
            run = run or runs.root / _new_wandb_id()
            _set_version(logger, run.name)
            logger.init_args.save_dir = str(run)
            for callback in _as_list(trainer.get("callbacks")):
                if is_class_config(callback, ModelCheckpoint) and callback.init_args.get("dirpath") is None:
                    callback.init_args.dirpath = str(run / CHECKPOINTS)
    elif logger is False:
        run = Path(trainer.get("default_root_dir") or ".")
        if checkpoint is not None and checkpoint.resolve() == (run / CHECKPOINTS / LAST_CHECKPOINT).resolve():
            resumed = run
    if trainer.get("enable_checkpointing") is not False:
        _refuse_to_mix(trainer, run, checkpoint, logger)
    if runs is not None and runs.numbered and resumed is None and (run is None or not run.exists()):
        # a new version directory: this run makes it, and takes it away if it fails before its first step
        trainer.callbacks = [*_as_list(trainer.get("callbacks")), Namespace(class_path=f"{__name__}.RemoveRunWithoutSteps")]
    return resumed


def _set_version(logger: Any, version: int | str) -> None:
    if is_class_config(logger, WandbLogger):
        logger.init_args.id, logger.init_args.version = str(version), None
    else:
        logger.init_args.version = version


def _new_wandb_id() -> str:
    """A run id as W&B makes one: 8 lowercase letters and digits."""
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


def _refuse_to_mix(trainer_config: Any, run: Path | None, checkpoint: Path | None, logger: Any) -> None:
    """A run writes into a checkpoint directory that holds checkpoints only by resuming its ``last.ckpt``."""
    own_dirpaths = [Path(c.init_args.dirpath) for c in _as_list(trainer_config.get("callbacks"))
                    if is_class_config(c, ModelCheckpoint) and c.init_args.get("dirpath") is not None]
    directories = [  # (directory, what gives this run one of its own)
        (dirpath, "another dirpath for its ModelCheckpoint") for dirpath in own_dirpaths if run is None or dirpath != run / CHECKPOINTS
    ]
    if run is not None:
        how = "trainer.default_root_dir" if logger is False else "leave the logger's version (W&B: id) unset for a new run"
        directories.append((run / CHECKPOINTS, how))
    for directory, how in directories:
        held = sorted(path.name for path in directory.glob("*.ckpt")) if directory.is_dir() else []
        if held and (checkpoint is None or checkpoint.resolve() != (directory / LAST_CHECKPOINT).resolve()):
            shown = ", ".join(held[:3]) + (" ..." if len(held) > 3 else "")
            raise FileInTheWayError(
                f"{directory} holds the checkpoints of another run ({shown}); resume that run with --ckpt_path last, "
                f"or give this run a directory of its own ({how})"
            )


class RemoveRunWithoutSteps(pl.Callback):
    """A new run's directory (the logger's ``log_dir``) is removed when the run fails before its first
    optimizer step and holds no checkpoint: nothing in it can be resumed. :func:`place_run` adds this
    callback to a run that gets a new ``version_N``, never to a resumed one. Rank 0 removes it,
    after the loggers have written their last (Lightning finalizes them again: nothing is left to write)."""

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # the logger's own log_dir: the trainer's is a collective, which ranks that did not fail would never join
        if trainer.global_step > 0 or not trainer.is_global_zero or trainer.logger is None or trainer.logger.log_dir is None:
            return
        if isinstance(exception, CheckpointedError):  # its checkpoint is written by a callback that may come after this one
            return
        run = Path(trainer.logger.log_dir)
        if not run.is_dir() or any(run.rglob("*.ckpt")):
            return
        for logger in trainer.loggers:
            logger.finalize("failed")
        shutil.rmtree(run, ignore_errors=True)
        print(f"{run} removed: the run failed before its first step", file=sys.stderr, flush=True)


def resume_config_name(run: Path) -> str:
    """The name a resumed run saves its configuration under: ``config.yaml`` keeps the first start's."""
    if not (run / CONFIG_FILE).exists():
        return CONFIG_FILE
    number = 1
    while (run / f"config-resume-{number}.yaml").exists():
        number += 1
    return f"config-resume-{number}.yaml"


def run_directory(logger: Any, log_dir: str | None, default_root_dir: str) -> Path | None:
    """The directory of this run's own files (``completions.jsonl``), from the trainer's logger:
    TensorBoard's and CSV's version directory; a ``save_dir`` that is the run's own already
    (``.../<name>/<version>``, as :func:`place_run` makes W&B's); else
    ``<save_dir or default_root_dir>/<name>/<version>``; None without a logger."""
    if logger is None:
        return None
    if isinstance(logger, (LightningTensorBoardLogger, LightningCSVLogger)) and log_dir is not None:
        return Path(log_dir)
    root = Path(log_dir or default_root_dir)
    name, version = str(logger.name or "lit-grpo"), str(logger.version)
    return root if root.parts[-2:] == (name, version) else root / name / version


class ReportsFailedWrites:
    """For a logger class that writes its files from this process (TensorBoard, CSV): a write that fails
    (a full disk) is a :class:`~lit_grpo.errors.WriteError` naming the logger's directory, one line from
    ``lit-grpo``. Finalizing a run that already ends on an error or a signal only says that its last
    writes failed, so that the message of what ended it is the one that stays."""

    what = "the logs"

    def log_metrics(self, metrics, step=None) -> None:
        with writing(self.what, lambda: self.log_dir):
            super().log_metrics(metrics, step)

    def log_hyperparams(self, *args, **kwargs) -> None:
        with writing(self.what, lambda: self.log_dir):
            super().log_hyperparams(*args, **kwargs)

    def save(self) -> None:
        with writing(self.what, lambda: self.log_dir):
            super().save()

    def finalize(self, status: str) -> None:
        try:
            with writing(self.what, lambda: self.log_dir):
                super().finalize(status)
        except WriteError as error:
            if status == "success":
                raise
            print(f"warning: {redact_message(str(error))}", file=sys.stderr, flush=True)  # a path's URL may hold a password


class TensorBoardLogger(ReportsFailedWrites, LightningTensorBoardLogger):
    """Lightning's ``TensorBoardLogger`` (``lit-grpo fit`` runs it in its place), except that a failed
    write is one line (:class:`ReportsFailedWrites`).

    TensorBoard writes its events from a thread: when a write fails there, the next write from the
    run raises the same error, which is reported; the thread itself is kept from printing its
    traceback (:func:`_quiet_failed_event_writes`)."""

    what = "the TensorBoard events"

    @property
    @rank_zero_experiment
    def experiment(self):
        if self._experiment is None:
            _quiet_failed_event_writes()
        return super().experiment


def _quiet_failed_event_writes() -> None:
    """Keep TensorBoard's event writer thread from printing the traceback of a write that failed with an
    ``OSError`` (the run reports it in one line when it next writes); any other thread error prints."""
    previous = threading.excepthook
    if getattr(previous, "quiet_failed_event_writes", False):
        return

    def excepthook(args) -> None:
        if not (issubclass(args.exc_type, OSError) and type(args.thread).__name__ == "_AsyncWriterThread"):
            previous(args)

    excepthook.quiet_failed_event_writes = True
    threading.excepthook = excepthook


class AppendingExperimentWriter(ExperimentWriter):
    """Lightning's CSV writer, except that it continues an existing ``metrics.csv`` (a resumed run's)
    instead of deleting it."""

    def _check_log_dir_exists(self) -> None:
        if self._fs.isfile(self.metrics_file_path):
            with self._fs.open(self.metrics_file_path, "r", newline="") as file:
                self.metrics_keys = next(csv.reader(file), [])  # new columns rewrite the header, rows kept


class CSVLogger(ReportsFailedWrites, LightningCSVLogger):
    """Lightning's ``CSVLogger`` (``lit-grpo fit`` runs it in its place), except that a run resumed
    in its version directory appends to its ``metrics.csv``, and a failed write is one line
    (:class:`ReportsFailedWrites`)."""

    what = "metrics.csv"

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = AppendingExperimentWriter(log_dir=self.log_dir)
        return self._experiment


def _as_list(value) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, list) else [value]
