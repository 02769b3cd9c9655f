"""Preemption loses nothing (lit_grpo/run/preemption.py, lit_grpo/run/checkpointing.py, lit_grpo/run/directory.py).

- A signal in the middle of a step (SIGTERM, SIGUSR1, SIGINT) to a ``lit-grpo fit`` process: the step
  is finished and checkpointed (not the last multiple of the checkpoint interval), the run ends with one
  line saying where the checkpoint is and how to resume, and ``--ckpt_path last`` continues exactly as a
  run that was never stopped (tests/run/test_resume.py's standard: every logged value and the final weights).
- Two processes where only rank 0 gets SIGTERM: both stop after the same step, and the resume is exact.
- Under SLURM, Lightning's requeue handler still runs (after the checkpoint).
- The time-based interval, in a run from Python with a plain ``lightning.Trainer`` and a fake clock.
- A log directory on a small tmpfs that fills up mid-run: one ``error:`` line naming the file and what was
  being written, and the earlier checkpoint loads; each writer (checkpoint, completions, TensorBoard, CSV)
  on a full disk.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from test_resume import PROMPTS, checkpoint_at, fit_config, lit_grpo_fit, logged_scalars, reward_steps

from lit_grpo.errors import ConfigError
from lit_grpo.run.checkpointing import AtomicCheckpointIO, default_checkpointing_of
from lit_grpo.run.completions import append_records, read_records

CHECKPOINT_INTERVAL = 4  # optimizer steps; the signal comes in the step of optimizer steps 5-6


def interval_config(tiny_model_dir: Path, data_file: Path, devices: int = 1) -> dict:
    """tests/run/test_resume.py's run (training steps of 2 optimizer steps each, 3 per epoch), 6 steps long, its
    ``last.ckpt`` every 4 optimizer steps instead of every step (so the final one is of the last step)."""
    config = fit_config(tiny_model_dir, data_file)
    config["trainer"]["max_steps"] = 12
    config["trainer"]["callbacks"][0]["init_args"]["every_n_train_steps"] = CHECKPOINT_INTERVAL
    if devices > 1:
        config["trainer"].update(devices=devices, strategy="ddp")
    return config


def with_signal(config: dict, signal_name: str, after_step: int = 4, rank: int = 0) -> dict:
    """``config`` plus a callback that sends ``signal_name`` to rank ``rank`` during the optimizer step after ``after_step``."""
    config = json.loads(json.dumps(config))
    helper = {"class_path": "resume_helpers.SignalDuringStep",
              "init_args": {"signal_name": signal_name, "after_step": after_step, "rank": rank}}
    config["trainer"]["callbacks"].append(helper)
    return config


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "prompts.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in PROMPTS))
    return path


def uninterrupted(tmp_path_factory, tiny_model_dir, data_file, devices: int) -> Path:
    run_dir = tmp_path_factory.mktemp(f"uninterrupted-{devices}")
    finished = lit_grpo_fit(run_dir, interval_config(tiny_model_dir, data_file, devices), threads=1)
    assert finished.returncode == 0, finished.stderr[-5000:]
    return run_dir


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, tiny_model_dir, data_file):
    """The uninterrupted one-process run, started when first asked for and run beside the first test's own
    runs (their imports overlap on CI's 2 cores): ``.result()`` is its directory."""
    with ThreadPoolExecutor(1) as beside:
        yield beside.submit(uninterrupted, tmp_path_factory, tiny_model_dir, data_file, devices=1)


def last_line(stderr: str) -> str:
    return stderr.strip().splitlines()[-1]


def assert_resumed_exactly(run_dir: Path, reference_dir: Path) -> None:
    """Every step logged once with the uninterrupted run's values, and the same final weights and optimizer."""
    log_dir = run_dir / "runs/resume/version_0"
    assert sorted(path.name for path in (run_dir / "runs/resume").iterdir()) == ["version_0"]
    assert reward_steps(log_dir) == [0, 1, 2, 3, 4, 5]  # the stopped step's metrics were logged before it stopped
    reference = logged_scalars(reference_dir / "runs/resume/version_0")
    logged = logged_scalars(log_dir)
    assert set(logged) == set(reference)
    for tag, values in logged.items():
        assert values == reference[tag], tag
    final, expected = checkpoint_at(run_dir), checkpoint_at(reference_dir)
    assert final["global_step"] == expected["global_step"] == 12
    for name, weight in expected["state_dict"].items():
        assert torch.equal(final["state_dict"][name], weight), name
    for index, state in expected["optimizer_states"][0]["state"].items():
        assert torch.equal(final["optimizer_states"][0]["state"][index]["exp_avg_sq"], state["exp_avg_sq"]), index


def check_stopped_after_step_6(stopped: subprocess.CompletedProcess, run_dir: Path, signal_name: str) -> None:
    assert stopped.returncode == 128 + getattr(signal, signal_name), stopped.stderr[-5000:]
    assert "Traceback" not in stopped.stderr
    # the step in progress (optimizer steps 5-6) finished and was checkpointed: not step 4, the last multiple of 4
    assert checkpoint_at(run_dir)["global_step"] == 6
    checkpoint = "runs/resume/version_0/checkpoints/last.ckpt"
    assert last_line(stopped.stderr) == (
        f"stopped by {signal_name} after optimizer step 6; checkpoint: {checkpoint}; "
        f"resume: lit-grpo fit --config {run_dir / 'config-0.yaml'} --ckpt_path last"
    )


MID_STEP_SIGNALS = ["SIGTERM", "SIGUSR1", "SIGINT"]


def stopped_by_signal_and_resumed(run_dir: Path, config: dict, signal_name: str) -> Path:
    """A run stopped by ``signal_name`` in the step of optimizer steps 5-6, then resumed: its directory."""
    stopped = lit_grpo_fit(run_dir, with_signal(config, signal_name), threads=1)
    check_stopped_after_step_6(stopped, run_dir, signal_name)

    resumed = lit_grpo_fit(run_dir, config, "--ckpt_path", "last", threads=1)
    assert resumed.returncode == 0, resumed.stderr[-5000:]
    return run_dir


@pytest.fixture(scope="module")
def signalled_runs(tmp_path_factory, tiny_model_dir, data_file, reference_run):
    """Each signal's stopped and resumed run, all started side by side (and beside the reference run) by the
    first test that asks: each is a process of one thread, so on CI's 2 cores they overlap. ``.result()`` of
    a signal's run is its directory, or re-raises what failed in it."""
    config = interval_config(tiny_model_dir, data_file)
    with ThreadPoolExecutor(len(MID_STEP_SIGNALS)) as beside:
        yield {name: beside.submit(stopped_by_signal_and_resumed, tmp_path_factory.mktemp(name), config, name)
               for name in MID_STEP_SIGNALS}


@pytest.mark.parametrize("signal_name", MID_STEP_SIGNALS)
def test_signal_mid_step_checkpoints_the_step_reached_and_the_resume_is_exact(signal_name, signalled_runs, reference_run):
    run_dir = signalled_runs[signal_name].result()
    assert_resumed_exactly(run_dir, reference_run.result())


def test_two_processes_stop_after_the_same_step_when_only_rank_0_gets_sigterm(
    tmp_path_factory, tiny_model_dir, data_file, tmp_path
):
    config = interval_config(tiny_model_dir, data_file, devices=2)
    with ThreadPoolExecutor(1) as beside:  # the uninterrupted run beside the stopped one: their imports overlap
        reference_dir = beside.submit(uninterrupted, tmp_path_factory, tiny_model_dir, data_file, devices=2)
        stopped = lit_grpo_fit(tmp_path, with_signal(config, "SIGTERM", rank=0), threads=1)
        check_stopped_after_step_6(stopped, tmp_path, "SIGTERM")
        # rank 1 agreed: its random states are in the checkpoint of step 6 (gathered from both ranks)
        assert len(checkpoint_at(tmp_path)["callbacks"]["RNGStateCheckpoint"]["per_rank"]) == 2

        resumed = lit_grpo_fit(tmp_path, config, "--ckpt_path", "last", threads=1)
        assert resumed.returncode == 0, resumed.stderr[-5000:]
        assert_resumed_exactly(tmp_path, reference_dir.result())


def test_under_slurm_lightnings_requeue_runs_after_the_checkpoint(tiny_model_dir, data_file, tmp_path):
    """SLURM's ``--signal=USR1@N``: the step is finished and checkpointed, then Lightning's own handler
    (``SLURMEnvironment(auto_requeue=True)``, Lightning's default under SLURM) saves its ``hpc_ckpt_1.ckpt``
    and requeues the job with ``scontrol requeue`` (a fake one here, which records its arguments)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'scontrol.log'}\n")
    scontrol.chmod(0o755)
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "grpo", "SLURM_NTASKS": "1", "SLURM_PROCID": "0",
             "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    config = with_signal(interval_config(tiny_model_dir, data_file), "SIGUSR1")
    config["trainer"]["default_root_dir"] = str(tmp_path)
    with _environment(slurm):
        stopped = lit_grpo_fit(tmp_path, config, threads=1)
    check_stopped_after_step_6(stopped, tmp_path, "SIGUSR1")
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n"
    hpc = torch.load(tmp_path / "hpc_ckpt_1.ckpt", weights_only=True)
    assert hpc["global_step"] == 6  # Lightning's checkpoint too is of the finished step


@contextlib.contextmanager
def _environment(variables: dict[str, str]):
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def test_an_unknown_or_uncatchable_signal_or_a_negative_wait_is_one_error_line():
    from lit_grpo.run.preemption import CheckpointOnSignal

    assert [s.name for s in CheckpointOnSignal(["term", "SIGUSR2"]).signals] == ["SIGTERM", "SIGUSR2"]
    with pytest.raises(ConfigError, match=r"^CheckpointOnSignal signals: 'SIGKILL' is not a signal a process can catch"):
        CheckpointOnSignal(["SIGKILL"])
    with pytest.raises(ConfigError, match="'SIGFOO' is not a signal"):
        CheckpointOnSignal(["SIGFOO"])
    with pytest.raises(ConfigError, match=r"^CheckpointOnSignal\(in_flight_wait_seconds=-1\): must be at least 0 seconds"):
        CheckpointOnSignal(in_flight_wait_seconds=-1)


# ----------------------------------------------------------------------------------------------
# Every N minutes, beside every N steps
# ----------------------------------------------------------------------------------------------


class SavedSteps(pl.Callback):
    """The ``global_step`` of every checkpoint the run writes."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self.steps.append(trainer.global_step)


def test_time_interval_checkpoints_between_the_step_based_ones_in_a_plain_trainer_run(
    tiny_model_dir, say_a_or_b_file, tmp_path, monkeypatch
):
    """A run from Python with a plain ``lightning.Trainer`` gets both intervals (``default_checkpointing_of``):
    with a clock that moves 7 minutes per optimizer step, the 30-minute interval writes ``last.ckpt`` at
    steps 5 and 10, the step interval (every 100) never; the clock restarts at each checkpoint."""
    from lit_grpo import GRPODataModule, GRPOModule
    from lit_grpo.run import preemption

    saved = SavedSteps()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=12, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=tmp_path, callbacks=[saved])
    monkeypatch.setattr(preemption, "monotonic", lambda: trainer.global_step * 7 * 60.0)
    module = GRPOModule(model_name_or_path=str(tiny_model_dir), num_generations=2, max_completion_length=4,
                        rewards=[{"name": "char_fraction"}], log_completions_every_n_steps=0)
    data = GRPODataModule(path="json", data_files=str(say_a_or_b_file), batch_size=2)
    trainer.fit(module, data)

    assert saved.steps == [5, 10]  # 35 minutes after the start, 35 after the checkpoint of step 5
    assert torch.load(tmp_path / "checkpoints/last.ckpt", weights_only=True)["global_step"] == 10
    kinds = [type(callback).__name__ for callback in trainer.checkpoint_callbacks]
    assert kinds == ["ModelCheckpoint", "CheckpointEveryNMinutes", "CheckpointOnSignal"]


def test_the_clock_restarts_when_the_step_interval_checkpoints(tiny_model_dir, say_a_or_b_file, tmp_path, monkeypatch):
    from lit_grpo import GRPODataModule, GRPOModule
    from lit_grpo.run import preemption

    saved = SavedSteps()
    every_4_steps = ModelCheckpoint(save_last=True, save_top_k=0, every_n_train_steps=4)
    callbacks = [saved, every_4_steps, preemption.CheckpointEveryNMinutes(minutes=20)]
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=11, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=tmp_path, callbacks=callbacks)
    monkeypatch.setattr(preemption, "monotonic", lambda: trainer.global_step * 7 * 60.0)
    module = GRPOModule(model_name_or_path=str(tiny_model_dir), num_generations=2, max_completion_length=4,
                        rewards=[{"name": "char_fraction"}], log_completions_every_n_steps=0)
    trainer.fit(module, GRPODataModule(path="json", data_files=str(say_a_or_b_file), batch_size=2))
    # 20 minutes (3 steps) after the start, then by steps at 4; 21 minutes after step 4 is step 7, then
    # by steps at 8, then 11: each checkpoint, by steps or by time, restarts the clock, and none is written twice
    assert saved.steps == [3, 4, 7, 8, 11]
    # the user's own interval is kept, and the signal callback added beside it
    assert trainer.checkpoint_callbacks[:2] == [every_4_steps, callbacks[2]]
    assert type(trainer.checkpoint_callbacks[2]).__name__ == "CheckpointOnSignal"
    assert sorted(path.name for path in (tmp_path / "checkpoints").iterdir()) == ["last.ckpt"]  # never last-v1.ckpt


def test_a_plain_trainer_gets_both_callbacks_with_checkpointing_on_and_none_with_it_off(tmp_path):
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, default_root_dir=tmp_path)
    kinds = [type(callback).__name__ for callback in default_checkpointing_of(trainer)]
    assert kinds == ["ModelCheckpoint", "CheckpointEveryNMinutes", "CheckpointOnSignal"]
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    assert default_checkpointing_of(trainer) == []
    # a ModelCheckpoint of the user's own is kept, even one that differs from Lightning's only in its interval
    for own in (ModelCheckpoint(every_n_epochs=2), ModelCheckpoint(every_n_train_steps=7), ModelCheckpoint(monitor="x")):
        trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, default_root_dir=tmp_path, callbacks=[own])
        kinds = [type(callback).__name__ for callback in default_checkpointing_of(trainer)]
        assert kinds == ["CheckpointEveryNMinutes", "CheckpointOnSignal"], own.state_key


def test_the_private_steps_of_model_checkpoint_that_a_checkpoint_now_takes_still_exist():
    """save_checkpoint_now and CheckpointEveryNMinutes take ModelCheckpoint's own steps, which Lightning 2.6 keeps
    private (it has no public "save now as at your own step"): a Lightning that renames or changes them fails
    here, naming the member, rather than in the middle of a run that is being preempted."""
    import inspect

    keeper = ModelCheckpoint(save_last=True)
    steps = {"_should_skip_saving_checkpoint": ["trainer"], "_monitor_candidates": ["trainer"],
             "_save_topk_checkpoint": ["trainer", "monitor_candidates"],
             "_save_last_checkpoint": ["trainer", "monitor_candidates"]}
    for name, parameters in steps.items():
        assert callable(getattr(keeper, name, None)), f"ModelCheckpoint.{name} is gone"
        assert list(inspect.signature(getattr(keeper, name)).parameters) == parameters, name
    assert keeper._last_global_step_saved == 0, "ModelCheckpoint._last_global_step_saved is gone"


# ----------------------------------------------------------------------------------------------
# A full disk
# ----------------------------------------------------------------------------------------------


@contextlib.contextmanager
def small_tmpfs(directory: Path, size: str):
    """A tmpfs of ``size`` mounted on ``directory``, unmounted afterwards; skips where mounting is not permitted."""
    directory.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)],
                             check=False, capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (root in a namespace that allows it): {mounted.stderr.strip()}")
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", str(directory)], check=True)


def fill(directory: Path, leave: int = 0) -> None:
    """Fill the file system of ``directory`` until at most ``leave`` bytes are free."""
    with open(directory / "filler", "wb") as file, contextlib.suppress(OSError):
        while os.statvfs(directory).f_bavail * os.statvfs(directory).f_frsize > leave:
            file.write(b"\0" * 4096)
            file.flush()


def test_full_log_disk_mid_run_ends_with_one_error_line_and_the_earlier_checkpoint_loads(
    tiny_model_dir, data_file, tmp_path
):
    """tests/run/test_resume.py's run with its run directory on a 3 MB tmpfs: the checkpoint of the first step
    (optimizer step 2, 1.6 MB) fits, the next one does not (it is written beside the previous before
    replacing it)."""
    config = fit_config(tiny_model_dir, data_file)  # last.ckpt every optimizer step, completions saved
    config["model"]["save_completions"] = True
    with small_tmpfs(tmp_path / "runs", "3m"):
        failed = lit_grpo_fit(tmp_path, config, threads=1)
        assert failed.returncode == 2, failed.stderr[-5000:]
        assert "Traceback" not in failed.stderr
        line = last_line(failed.stderr)
        assert sum(text.startswith("error:") for text in failed.stderr.splitlines()) == 1
        checkpoint = tmp_path / "runs/resume/version_0/checkpoints/last.ckpt"
        assert line == ("error: could not write the checkpoint runs/resume/version_0/checkpoints/last.ckpt: "
                        "No space left on device; the previous one is kept")
        assert torch.load(checkpoint, weights_only=True)["global_step"] == 2  # the last good one loads
        assert not list(checkpoint.parent.glob(".*.tmp"))  # the partial write was removed
        read_records(tmp_path / "runs/resume/version_0/completions.jsonl")  # every line whole


def test_checkpoint_write_on_a_full_disk_is_a_write_error_and_keeps_the_previous_one(tmp_path):
    from lit_grpo.errors import WriteError, os_error_in

    with small_tmpfs(tmp_path / "disk", "1m") as disk:
        path = disk / "checkpoints/last.ckpt"
        AtomicCheckpointIO().save_checkpoint({"global_step": 1, "weight": torch.ones(1000)}, path)
        fill(disk, leave=64 * 1024)
        with pytest.raises(WriteError) as failed:
            AtomicCheckpointIO().save_checkpoint({"global_step": 2, "weight": torch.zeros(200_000)}, path)
        assert str(failed.value) == f"could not write the checkpoint {path}: No space left on device; the previous one is kept"
        assert os_error_in(failed.value.__cause__).errno == errno.ENOSPC
        assert torch.load(path, weights_only=True)["global_step"] == 1
        assert sorted(p.name for p in path.parent.iterdir()) == ["last.ckpt"]


def test_completions_on_a_full_disk_are_a_write_error_and_the_file_stays_readable(tmp_path):
    from lit_grpo.errors import WriteError

    record = {"step": 0, "prompt": "p", "completion": "c" * 200, "rewards": {}, "reward": 1.0, "advantage": 0.0}
    with small_tmpfs(tmp_path / "disk", "1m") as disk:
        path = disk / "run/completions.jsonl"
        append_records(path, [record] * 3)
        fill(disk, leave=0)
        size = path.stat().st_size
        with pytest.raises(WriteError, match=rf"^could not write the completions of step 7 to {path}: No space left on device$"):
            append_records(path, [{**record, "step": 7}] * 100)
        assert path.stat().st_size == size  # the lines written in part were cut off again
        assert [r["step"] for r in read_records(path)] == [0, 0, 0]


@pytest.mark.parametrize("kind", ["TensorBoardLogger", "CSVLogger"])
def test_logger_writes_on_a_full_disk_are_a_write_error_naming_the_logs(kind, tmp_path, capfd):
    from lit_grpo.errors import WriteError
    from lit_grpo.run import directory as runs

    with small_tmpfs(tmp_path / "disk", "256k") as disk:
        logger = getattr(runs, kind)(save_dir=str(disk), name="run")
        logger.log_hyperparams({"lr": 0.1})
        logger.log_metrics({"reward": 0.5}, step=0)
        logger.save()
        fill(disk, leave=0)
        with pytest.raises(WriteError) as failed:
            for step in range(1, 10_000):
                logger.log_metrics({"reward": 0.5, "x" * 200: float(step)}, step=step)
                logger.save()
        what = {"TensorBoardLogger": "the TensorBoard events", "CSVLogger": "metrics.csv"}[kind]
        assert str(failed.value) == f"could not write {what} to {logger.log_dir}: No space left on device"
        logger.finalize("failed")  # a run already ending on an error: its last writes failing is a warning
        assert "Traceback" not in capfd.readouterr().err  # TensorBoard's writer thread stays quiet
