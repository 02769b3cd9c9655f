"""The files of a run (lit_grpo/run/directory.py): one directory holds a run's config, checkpoints,
completions and logs; a rerun gets a directory of its own; ``--ckpt_path last`` resumes the newest
run in its directory; a missing checkpoint or a directory that would mix two runs is one ``error:``
line. The two-process run and its resume are in tests/cli/test_user_runs.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from lit_grpo.cli import main

REPO = Path(__file__).resolve().parents[2]
TENSORBOARD = {"class_path": "lightning.pytorch.loggers.TensorBoardLogger", "init_args": {"save_dir": "runs", "name": "t"}}
CSV = {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": "runs", "name": "c"}}
WANDB = {"class_path": "lightning.pytorch.loggers.WandbLogger", "init_args": {"save_dir": "runs", "project": "w", "offline": True}}

pytestmark = pytest.mark.usefixtures("fresh_cli")  # tests/conftest.py


@pytest.fixture
def fit(tmp_path, tiny_model_dir, monkeypatch):
    """``fit(*args, logger=..., **trainer)``: ``lit-grpo fit`` in this process, in ``tmp_path``,
    with a small quickstart (2 prompts x 2 completions a step, every step's completions saved)."""
    monkeypatch.chdir(tmp_path)

    def run(*args: str, logger=TENSORBOARD, **trainer) -> None:
        config = yaml.safe_load((REPO / "configs/quickstart.yaml").read_text())
        config["trainer"].update(logger=logger, enable_progress_bar=False, enable_model_summary=False, **trainer)
        config["model"].update(model_name_or_path=str(tiny_model_dir), num_generations=2, max_completion_length=4)
        config["data"].update(data_files=str(REPO / config["data"]["data_files"]), batch_size=2)
        Path("config.yaml").write_text(yaml.safe_dump(config))
        main(["fit", "--config", "config.yaml", *args])

    return run


def error_line(capsys, run, *args, **trainer) -> str:
    """``run(*args, **trainer)`` must end the command with status 2 and one ``error:`` line."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        run(*args, **trainer)
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("error: ") and sum(line.startswith("error:") for line in lines) == 1, lines
    return lines[-1].removeprefix("error: ")


def files(directory: Path) -> list[str]:
    return sorted(str(path.relative_to(directory)) for path in directory.rglob("*") if path.is_file())


def logged_steps(run: Path) -> list[int]:
    """The step of every ``completions.jsonl`` record of ``run``, once per step, in the order written."""
    steps = [json.loads(line)["step"] for line in (run / "completions.jsonl").read_text().splitlines()]
    return [step for index, step in enumerate(steps) if index == 0 or steps[index - 1] != step]


def reward_steps(run: Path) -> list[int]:
    """The steps of every ``reward`` scalar in the TensorBoard events of ``run``, all event files."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    steps = []
    for events in sorted(run.glob("events.out.tfevents.*")):
        for event in EventFileLoader(str(events)).Load():
            steps += [event.step for value in event.summary.value if value.tag == "reward"]
    return steps


def global_step(checkpoint: Path) -> int:
    return torch.load(checkpoint, weights_only=True)["global_step"]


def test_rerun_gets_a_new_run_directory_and_ckpt_path_last_resumes_the_newest_in_it(fit, tmp_path):
    fit(max_steps=2)
    first = tmp_path / "runs/t/version_0"
    assert [name for name in files(first) if not name.startswith("events")] == [
        "checkpoints/last.ckpt", "completions.jsonl", "config.yaml", "hparams.yaml",
    ]
    first_checkpoint = (first / "checkpoints/last.ckpt").read_bytes()

    # a rerun: a run directory of its own, the first run's checkpoint untouched
    fit(max_steps=2)
    second = tmp_path / "runs/t/version_1"
    assert sorted(path.name for path in (tmp_path / "runs/t").iterdir()) == ["version_0", "version_1"]
    assert (first / "checkpoints/last.ckpt").read_bytes() == first_checkpoint
    assert files(first / "checkpoints") == files(second / "checkpoints") == ["last.ckpt"]  # no last-v1.ckpt

    # --ckpt_path last: the newest run goes on in its own directory, its logs appended to
    fit("--ckpt_path", "last", max_steps=4)
    assert sorted(path.name for path in (tmp_path / "runs/t").iterdir()) == ["version_0", "version_1"]
    assert global_step(second / "checkpoints/last.ckpt") == 4 and global_step(first / "checkpoints/last.ckpt") == 2
    assert files(second / "checkpoints") == ["last.ckpt"]
    assert logged_steps(second) == [0, 1, 2, 3]  # completions.jsonl appended to
    assert reward_steps(second) == [0, 1, 2, 3] and len(list(second.glob("events.out.tfevents.*"))) == 2
    assert yaml.safe_load((second / "config.yaml").read_text())["trainer"]["max_steps"] == 2  # as started
    resumed = yaml.safe_load((second / "config-resume-1.yaml").read_text())
    assert resumed["trainer"]["max_steps"] == 4 and resumed["ckpt_path"] == "runs/t/version_1/checkpoints/last.ckpt"

    # the last checkpoint of an older run, by its path: that run goes on in its directory
    fit("--ckpt_path", "runs/t/version_0/checkpoints/last.ckpt", max_steps=3)
    assert sorted(path.name for path in (tmp_path / "runs/t").iterdir()) == ["version_0", "version_1"]
    assert logged_steps(first) == [0, 1, 2] and global_step(first / "checkpoints/last.ckpt") == 3


def test_a_run_from_a_checkpoint_that_is_not_a_runs_last_starts_a_run_of_its_own(fit, tmp_path):
    callback = {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                "init_args": {"every_n_train_steps": 1, "save_top_k": -1, "save_last": True}}
    fit(max_steps=3, callbacks=[callback])
    first = tmp_path / "runs/t/version_0/checkpoints"
    written = files(first)
    assert written == ["epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt", "epoch=0-step=3.ckpt", "last.ckpt"]
    fit("--ckpt_path", str(first / "epoch=0-step=1.ckpt"), max_steps=2, callbacks=[callback])
    assert files(first) == written and global_step(first / "last.ckpt") == 3  # the later checkpoints are kept
    branch = tmp_path / "runs/t/version_1"
    assert files(branch / "checkpoints") == ["epoch=0-step=2.ckpt", "last.ckpt"] and logged_steps(branch) == [1]


def test_csv_logger_resumed_appends_to_its_metrics_csv(fit, tmp_path):
    fit(max_steps=2, logger=CSV)
    fit("--ckpt_path", "last", max_steps=3, logger=CSV)
    run = tmp_path / "runs/c/version_0"
    assert sorted(path.name for path in run.parent.iterdir()) == ["version_0"]
    rows = (run / "metrics.csv").read_text().splitlines()
    step = rows[0].split(",").index("step")
    assert [int(row.split(",")[step]) for row in rows[1:]] == [0, 1, 2]  # the first run's rows are kept
    assert logged_steps(run) == [0, 1, 2] and global_step(run / "checkpoints/last.ckpt") == 3


def test_wandb_run_keeps_its_checkpoints_completions_and_wandb_files_in_one_directory(fit, tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    fit(max_steps=2, logger=WANDB)
    wandb.finish()
    (run,) = (tmp_path / "runs/w").iterdir()  # runs/<project>/<run id>
    assert sorted(path.name for path in tmp_path.iterdir()) == ["config.yaml", "runs"]  # nothing beside it
    assert sorted(path.name for path in run.iterdir()) == ["checkpoints", "completions.jsonl", "config.yaml", "wandb"]
    assert [run.name in path.name for path in run.glob("wandb/offline-run-*")] == [True]  # offline-run-<time>-<id>

    fit("--ckpt_path", "last", max_steps=3, logger=WANDB)
    wandb.finish()
    assert [path.name for path in (tmp_path / "runs/w").iterdir()] == [run.name]  # the same W&B run
    assert logged_steps(run) == [0, 1, 2] and global_step(run / "checkpoints/last.ckpt") == 3
    assert [run.name in path.name for path in run.glob("wandb/offline-run-*")] == [True, True]

    fit(max_steps=1, logger=WANDB)  # a rerun: a W&B run and directory of its own
    wandb.finish()
    assert len(list((tmp_path / "runs/w").iterdir())) == 2 and global_step(run / "checkpoints/last.ckpt") == 3


# ----------------------------------------------------------------------------------------------
# One-line errors (none of these starts training)
# ----------------------------------------------------------------------------------------------


def test_ckpt_path_last_without_a_run_says_where_it_looked(fit, capsys):
    assert error_line(capsys, fit, "--ckpt_path", "last") == (
        "--ckpt_path last: there is no run to resume in runs/t; start the run without --ckpt_path"
    )


def test_ckpt_path_last_when_the_newest_run_has_no_checkpoint_names_the_newest_that_has_one(fit, capsys, tmp_path):
    (tmp_path / "runs/t/version_0/checkpoints").mkdir(parents=True)
    (tmp_path / "runs/t/version_0/checkpoints/last.ckpt").write_bytes(b"")
    (tmp_path / "runs/t/version_1").mkdir()  # stopped before its first checkpoint
    assert error_line(capsys, fit, "--ckpt_path", "last") == (
        "--ckpt_path last: the newest run, runs/t/version_1, has no checkpoint (runs/t/version_1/checkpoints/last.ckpt "
        "is missing; it stopped before its first or is a validation); to resume the newest run that has one: "
        "--ckpt_path runs/t/version_0/checkpoints/last.ckpt"
    )


def test_ckpt_path_last_without_save_last_and_a_missing_checkpoint_file_are_one_line(fit, capsys):
    keeps_no_last = {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": {"every_n_train_steps": 5}}
    assert error_line(capsys, fit, "--ckpt_path", "last", callbacks=[keeps_no_last]) == (
        "--ckpt_path last: no ModelCheckpoint in trainer.callbacks keeps a last.ckpt; add save_last: true to one "
        "(the next run can then resume), or give --ckpt_path a checkpoint file"
    )
    assert error_line(capsys, fit, "--ckpt_path", "runs/t/version_0/checkpoints/last.ckpt") == (
        "--ckpt_path runs/t/version_0/checkpoints/last.ckpt does not exist"
    )


def test_a_run_into_a_checkpoint_directory_of_another_run_is_refused(fit, capsys, tmp_path):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints/last.ckpt").write_bytes(b"")
    # no logger: the run's directory is trainer.default_root_dir
    assert error_line(capsys, fit, logger=False, default_root_dir=str(tmp_path)) == (
        f"{tmp_path}/checkpoints holds the checkpoints of another run (last.ckpt); resume that run with "
        "--ckpt_path last, or give this run a directory of its own (trainer.default_root_dir)"
    )
    # a logger version set in the config
    pinned = {**TENSORBOARD, "init_args": {**TENSORBOARD["init_args"], "version": 3}}
    (tmp_path / "runs/t/version_3/checkpoints").mkdir(parents=True)
    (tmp_path / "runs/t/version_3/checkpoints/epoch=0-step=5.ckpt").write_bytes(b"")
    assert error_line(capsys, fit, logger=pinned).startswith(
        "runs/t/version_3/checkpoints holds the checkpoints of another run (epoch=0-step=5.ckpt); resume that run "
        "with --ckpt_path last, or give this run a directory of its own (leave the logger's version"
    )
    # a ModelCheckpoint's own dirpath
    own = {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": {"dirpath": "checkpoints", "save_last": True}}
    assert error_line(capsys, fit, callbacks=[own]) == (
        "checkpoints holds the checkpoints of another run (last.ckpt); resume that run with --ckpt_path last, "
        "or give this run a directory of its own (another dirpath for its ModelCheckpoint)"
    )
