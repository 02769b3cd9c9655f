"""Exact resume (lit_grpo/run/checkpointing.py).

The main test kills `lit-grpo fit` with SIGKILL twice (in the middle of an epoch, then at an epoch
boundary), resumes it each time with `--ckpt_path last`, and checks that everything logged after each
resume and the final weights equal those of a run that was never interrupted. The other tests check
the pieces one by one: random number generator states, the position in the data, atomic checkpoint
writes, and the checkpointing defaults of the `lit-grpo` command.
"""

from __future__ import annotations

import json
import os
import random
import signal
import string
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml
from lightning.pytorch.callbacks import ModelCheckpoint

from lit_grpo import plugins
from lit_grpo.cli import run_cli
from lit_grpo.data import GRPODataModule
from lit_grpo.errors import ConfigError
from lit_grpo.run.checkpointing import (
    DEFAULT_CHECKPOINT_EVERY_N_TRAIN_STEPS,
    AtomicCheckpointIO,
    ResumableDataLoader,
    RNGStateCheckpoint,
    check_same_partition,
)
from lit_grpo.run.preemption import CheckpointEveryNMinutes, CheckpointOnSignal

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent

# 6 prompts in batches of 2: 3 training steps per epoch. Each prompt rewards its own 16 characters
# (a random model scores about 16/97), so the rewards depend on which prompts a step gets and on
# the sampled completions.
CHARACTERS = string.ascii_letters + string.digits + string.punctuation
PROMPTS = [{"prompt": f"Say {CHARACTERS[i:i + 16]}:", "target": CHARACTERS[i : i + 16]} for i in range(0, 96, 16)]


def fit_config(tiny_model_dir, data_file) -> dict:
    """5 training steps (10 optimizer steps: steps_per_generation 2 shuffles the completions into
    mini-batches with torch.randperm) with temperature sampling and a checkpoint after every step."""
    return {
        "seed_everything": 0,
        "trainer": {
            "max_steps": 10,
            "accelerator": "cpu",
            "devices": 1,
            "log_every_n_steps": 1,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "logger": {
                "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                "init_args": {"save_dir": "runs", "name": "resume"},
            },
            # No dirpath: it writes to the run's directory, runs/resume/version_0/checkpoints, where
            # --ckpt_path last finds it and the resumed runs go on.
            "callbacks": [
                {
                    "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                    "init_args": {"every_n_train_steps": 1, "save_last": True, "save_top_k": 0},
                }
            ],
        },
        "model": {
            "model_name_or_path": str(tiny_model_dir),
            "num_generations": 4,
            "max_completion_length": 8,
            "temperature": 1.0,
            "steps_per_generation": 2,
            "log_completions_every_n_steps": 0,
            "rewards": [{"name": "char_fraction"}],
        },
        "data": {"path": "json", "data_files": str(data_file), "batch_size": 2},
        "optimizer": {"class_path": "torch.optim.AdamW", "init_args": {"lr": 0.01}},
    }


def lit_grpo_fit(run_dir: Path, config: dict, *args: str, threads: int | None = None) -> subprocess.CompletedProcess:
    """`lit-grpo fit --config config.yaml ARGS` in ``run_dir``, as a separate process."""
    config_file = run_dir / f"config-{len(list(run_dir.glob('config-*.yaml')))}.yaml"
    config_file.write_text(yaml.safe_dump(config))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])),
        "HF_HUB_OFFLINE": "1",
        **({"OMP_NUM_THREADS": str(threads)} if threads else {}),
    }
    command = [sys.executable, "-m", "lit_grpo.cli", "fit", "--config", str(config_file), *args]
    return subprocess.run(command, cwd=run_dir, env=env, capture_output=True, text=True, timeout=600)


def killed_during_step_after(config: dict, step: int) -> dict:
    """``config`` plus a callback that SIGKILLs the process once the checkpoint of ``step`` is written."""
    config = json.loads(json.dumps(config))
    callback = {"class_path": "resume_helpers.SigkillDuringStep", "init_args": {"after_step": step}}
    config["trainer"]["callbacks"].append(callback)
    return config


WALL_CLOCK_TAGS = ("step_time", "tokens_per_second", "hp_metric", "cpu/threads")


def logged_scalars(log_dir: Path) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} of the TensorBoard events in ``log_dir``, without the measurements of the
    machine (``step_time``, ``time/*``, ``tokens_per_second``, the CPU threads other jobs left free)
    and the logger's ``hp_metric``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {
        tag: {event.step: event.value for event in accumulator.Scalars(tag)}
        for tag in accumulator.Tags()["scalars"]
        if tag not in WALL_CLOCK_TAGS and not tag.startswith("time/")
    }


def reward_steps(log_dir: Path) -> list[int]:
    """The step of every ``reward`` event in ``log_dir``, in the order written (all its event files)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    return [event.step for event in accumulator.Scalars("reward")]


def checkpoint_at(run_dir: Path) -> dict:
    return torch.load(run_dir / "runs/resume/version_0/checkpoints/last.ckpt", weights_only=True)


def test_sigkilled_run_resumed_with_ckpt_path_last_matches_uninterrupted_run(tiny_model_dir, tmp_path):
    data_file = tmp_path / "prompts.jsonl"
    data_file.write_text("".join(json.dumps(row) + "\n" for row in PROMPTS))
    check_resumes_exactly(fit_config(tiny_model_dir, data_file), tmp_path)


def test_sigkilled_multi_turn_tool_run_resumes_exactly(warm_tool_model, tmp_path):
    """The same with multi-turn rollouts: the example environment's lookup tool, called by a tiny
    model fine-tuned on lookup transcripts (tests/conftest.py), sampled at temperature 1."""
    rows = [json.loads(line) for line in (REPO / "configs/data/kv_lookup.jsonl").read_text().splitlines()[:6]]
    data_file = tmp_path / "kv.jsonl"
    data_file.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = fit_config(warm_tool_model, data_file)
    config["model"].update(max_completion_length=96, rewards=[{"name": "kv_answer"}], environment={"name": "kv_lookup"},
                           max_tool_calling_iterations=2)
    config["data"]["conversational"] = True
    config["optimizer"]["init_args"]["lr"] = 3e-4  # at 0.01 the tiny model unlearns calling the tool within 3 steps
    # One thread: with two, the gradient of the embedding over these 800-token prompts is summed in
    # an order that varies from run to run (weights differ by ~1e-8 between two uninterrupted runs
    # as well; every logged value still agrees).
    reference = check_resumes_exactly(config, tmp_path, threads=1)
    assert min(reference["tools/calls_per_rollout"].values()) > 0.3  # the rollouts really are multi-turn


def check_resumes_exactly(config: dict, tmp_path: Path, threads: int | None = None) -> dict[str, dict[int, float]]:
    """Run ``config`` uninterrupted, and killed twice and resumed; everything logged after each
    resume, the final weights and the optimizer state must equal the uninterrupted run's (which runs
    at the same time, in a process of its own)."""
    reference_dir = tmp_path / "reference"
    reference_dir.mkdir()
    with ThreadPoolExecutor(1) as beside:  # the uninterrupted run beside the interrupted ones: their imports overlap
        uninterrupted = beside.submit(lit_grpo_fit, reference_dir, config, threads=threads)
        run_dir = interrupted_twice_and_resumed(config, tmp_path, threads)
        finished = uninterrupted.result()
    assert finished.returncode == 0, finished.stderr[-5000:]
    reference = logged_scalars(reference_dir / "runs/resume/version_0")
    assert sorted(reference["reward"]) == [0, 1, 2, 3, 4]  # one point per training step
    assert len(set(reference["reward"].values())) > 1

    # Each resumed run went on in the killed run's directory and logged exactly the steps after its
    # checkpoint: every step once, with the reference's values (every metric: rewards, loss, entropy,
    # completion lengths, clip ratios, grad norm, ...).
    assert sorted(path.name for path in (run_dir / "runs/resume").iterdir()) == ["version_0"]
    log_dir = run_dir / "runs/resume/version_0"
    assert len(list(log_dir.glob("events.out.tfevents.*"))) == 3  # one per start, in the same directory
    assert reward_steps(log_dir) == [0, 1, 2, 3, 4]
    logged = logged_scalars(log_dir)
    assert set(logged) == set(reference)
    for tag, values in logged.items():
        assert values == reference[tag], tag

    final, expected = checkpoint_at(run_dir), checkpoint_at(reference_dir)
    assert final["global_step"] == expected["global_step"] == 10
    assert final["state_dict"].keys() == expected["state_dict"].keys()
    for name, weight in expected["state_dict"].items():
        assert torch.equal(final["state_dict"][name], weight), (name, float((final["state_dict"][name] - weight).abs().max()))
    final_adam, expected_adam = final["optimizer_states"][0]["state"], expected["optimizer_states"][0]["state"]
    for index, state in expected_adam.items():
        assert torch.equal(final_adam[index]["exp_avg_sq"], state["exp_avg_sq"]), index
    return reference


def interrupted_twice_and_resumed(config: dict, tmp_path: Path, threads: int | None) -> Path:
    """``config`` killed mid-epoch, then resumed and killed at the epoch's end, then resumed to its end: its directory."""
    run_dir = tmp_path / "interrupted"
    run_dir.mkdir()
    # Killed in training step 2 (optimizer steps 5-6), after the checkpoint of step 4: mid-epoch,
    # 2 of the epoch's 3 batches consumed.
    killed = lit_grpo_fit(run_dir, killed_during_step_after(config, 4), threads=threads)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-5000:]
    assert checkpoint_at(run_dir)["global_step"] == 4

    # Resumed, then killed in training step 3 after the checkpoint of step 6: at the epoch boundary.
    resumed_then_killed = lit_grpo_fit(run_dir, killed_during_step_after(config, 6), "--ckpt_path", "last", threads=threads)
    assert resumed_then_killed.returncode == -signal.SIGKILL, resumed_then_killed.stderr[-5000:]
    assert checkpoint_at(run_dir)["global_step"] == 6

    resumed = lit_grpo_fit(run_dir, config, "--ckpt_path", "last", threads=threads)
    assert resumed.returncode == 0, resumed.stderr[-5000:]
    return run_dir


# --------------------------------------------------------------------------------------------------
# Random number generators
# --------------------------------------------------------------------------------------------------


def random_draws() -> list:
    """Numbers from every stream the callback keeps, including a multinomial draw as sampling does."""
    return [
        torch.rand(3).tolist(),
        torch.multinomial(torch.ones(50), 4, replacement=True).tolist(),
        np.random.rand(3).tolist(),
        np.random.randn(1).tolist(),  # numpy's cached Gaussian is part of the state
        random.random(),
    ]


def fake_trainer(world_size: int = 1, global_rank: int = 0) -> SimpleNamespace:
    return SimpleNamespace(world_size=world_size, global_rank=global_rank)


def test_rng_states_round_trip_through_a_weights_only_checkpoint(tmp_path):
    np.random.randn(1)  # leave a cached Gaussian in numpy's state
    saved = RNGStateCheckpoint().state_dict()
    expected = random_draws()
    random_draws()  # the run goes on and is killed

    path = tmp_path / "rng.pt"
    torch.save(saved, path)
    resumed = RNGStateCheckpoint()
    resumed.load_state_dict(torch.load(path, weights_only=True))  # as Lightning loads checkpoints
    assert random_draws() != expected  # nothing is restored before training starts
    resumed.on_train_start(fake_trainer(), None)
    assert random_draws() == expected


def test_each_rank_restores_its_own_rng_states():
    torch.manual_seed(1)
    rank_0 = RNGStateCheckpoint().state_dict()["per_rank"][0]
    torch.manual_seed(2)
    rank_1 = RNGStateCheckpoint().state_dict()["per_rank"][0]
    expected_rank_1 = torch.rand(4)

    resumed = RNGStateCheckpoint()
    resumed.load_state_dict({"per_rank": [rank_0, rank_1]})
    resumed.on_train_start(fake_trainer(world_size=2, global_rank=1), None)
    assert torch.equal(torch.rand(4), expected_rank_1)


def test_rng_states_are_gathered_from_every_rank(tmp_path):
    from resume_helpers import gather_rng_states_on_rank

    torch.multiprocessing.spawn(
        gather_rng_states_on_rank, args=(str(tmp_path / "init"), str(tmp_path / "states.pt")), nprocs=2
    )
    per_rank = torch.load(tmp_path / "states.pt", weights_only=True)
    assert len(per_rank) == 2
    for rank, states in enumerate(per_rank):
        torch.manual_seed(100 + rank)
        assert torch.equal(states["torch"], torch.get_rng_state())


def test_rng_states_of_another_world_size_are_not_restored():
    torch.manual_seed(1)
    saved = RNGStateCheckpoint().state_dict()
    torch.manual_seed(2)
    expected = torch.rand(4)
    torch.manual_seed(2)

    resumed = RNGStateCheckpoint()
    resumed.load_state_dict(saved)
    with pytest.warns(UserWarning, match="1 processes but this run has 2"):
        resumed.on_train_start(fake_trainer(world_size=2, global_rank=0), None)
    assert torch.equal(torch.rand(4), expected)


def test_validation_does_not_consume_the_training_random_streams():
    callback = RNGStateCheckpoint()
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    without_validation = random_draws()

    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    callback.on_validation_start(fake_trainer(), None)
    random_draws()  # validation samples completions
    callback.on_validation_end(fake_trainer(), None)
    assert random_draws() == without_validation


# --------------------------------------------------------------------------------------------------
# Position in the data
# --------------------------------------------------------------------------------------------------


def prompt_loader(tmp_path, batch_size: int = 3) -> ResumableDataLoader:
    data_file = tmp_path / "prompts.jsonl"
    data_file.write_text("".join(json.dumps({"prompt": f"prompt {i}"}) + "\n" for i in range(12)))
    datamodule = GRPODataModule(path="json", data_files=str(data_file), batch_size=batch_size, shuffle=True, seed=7)
    datamodule.setup("fit")
    loader = datamodule.train_dataloader()
    assert isinstance(loader, ResumableDataLoader)
    return loader


def epoch_batches(loader, epoch: int) -> list[list[str]]:
    loader.sampler.set_epoch(epoch)  # as Lightning does before every epoch
    return [batch.prompts for batch in loader]


def test_loader_resumes_mid_epoch_with_the_next_batch(tmp_path):
    loader = prompt_loader(tmp_path)
    epoch_batches(loader, 0)
    loader.sampler.set_epoch(1)
    iterator = iter(loader)
    consumed = [next(iterator).prompts for _ in range(2)]
    state = loader.state_dict()  # a checkpoint after 2 of the epoch's 4 batches
    remaining = [batch.prompts for batch in iterator]
    assert len(remaining) == 2

    resumed = prompt_loader(tmp_path)
    resumed.load_state_dict(state)
    resumed_iterator = iter(resumed)  # Lightning creates the iterator before it calls set_epoch
    resumed.sampler.set_epoch(1)
    assert [batch.prompts for batch in resumed_iterator] == remaining
    assert consumed + remaining == epoch_batches(prompt_loader(tmp_path), 1)
    # Both continue with the same next epoch and the same worker seed generator.
    assert torch.equal(resumed.generator.get_state(), loader.generator.get_state())
    assert epoch_batches(resumed, 2) == epoch_batches(loader, 2)


def test_loader_resumed_after_a_finished_epoch_starts_the_next_one(tmp_path):
    loader = prompt_loader(tmp_path)
    epoch_batches(loader, 0)
    state = loader.state_dict()  # a checkpoint after the epoch's last batch

    resumed = prompt_loader(tmp_path)
    resumed.load_state_dict(state)
    next_epoch = epoch_batches(resumed, 1)
    assert len(next_epoch) == 4
    assert next_epoch == epoch_batches(loader, 1)
    assert torch.equal(resumed.generator.get_state(), loader.generator.get_state())


def test_starting_an_epoch_does_not_draw_from_the_global_torch_generator(tmp_path):
    loader = prompt_loader(tmp_path)
    torch.manual_seed(0)
    expected = torch.rand(2)
    torch.manual_seed(0)
    epoch_batches(loader, 0)
    assert torch.equal(torch.rand(2), expected)


# --------------------------------------------------------------------------------------------------
# Atomic checkpoint writes
# --------------------------------------------------------------------------------------------------


def test_checkpoint_killed_while_being_written_leaves_the_previous_one_intact(tmp_path):
    path = tmp_path / "checkpoints" / "last.ckpt"
    previous = {"global_step": 1, "weight": torch.arange(50_000.0)}
    AtomicCheckpointIO().save_checkpoint(previous, path)

    # Another process starts writing the next checkpoint and dies half-way through (os._exit: no
    # exception handling, no cleanup), as under SIGKILL or the OOM killer.
    script = textwrap.dedent(
        f"""
        import io, os, torch
        from lit_grpo.run.checkpointing import AtomicCheckpointIO

        real_save = torch.save

        def save_half_then_die(obj, file):
            buffer = io.BytesIO()
            real_save(obj, buffer)
            data = buffer.getvalue()
            file.write(data[: len(data) // 2])
            file.flush()
            os._exit(17)

        torch.save = save_half_then_die
        AtomicCheckpointIO().save_checkpoint({{"global_step": 2, "weight": torch.zeros(50_000)}}, {str(path)!r})
        """
    )
    crashed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert crashed.returncode == 17, crashed.stderr

    (partial,) = path.parent.glob(".last.ckpt.*.tmp")  # the half-written file went beside it
    assert 0 < partial.stat().st_size < path.stat().st_size
    loaded = torch.load(path, weights_only=True)
    assert loaded["global_step"] == 1 and torch.equal(loaded["weight"], previous["weight"])

    # The next save replaces the checkpoint and removes the leftover.
    AtomicCheckpointIO().save_checkpoint({"global_step": 3, "weight": torch.ones(3)}, path)
    assert torch.load(path, weights_only=True)["global_step"] == 3
    assert sorted(p.name for p in path.parent.iterdir()) == ["last.ckpt"]


def test_checkpoint_that_fails_to_serialise_leaves_the_previous_one_and_no_temporary_file(tmp_path):
    path = tmp_path / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint({"global_step": 1}, path)
    with pytest.raises(Exception):
        AtomicCheckpointIO().save_checkpoint({"global_step": 2, "unpicklable": lambda: None}, path)
    assert torch.load(path, weights_only=True) == {"global_step": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


# --------------------------------------------------------------------------------------------------
# Checkpointing defaults of the `lit-grpo` command
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def quickstart_with(tmp_path, monkeypatch, tiny_model_dir):
    """``quickstart_with(**trainer_changes) -> GRPOCLI``: the quickstart config instantiated (not run)."""
    monkeypatch.setattr(sys, "argv", ["lit-grpo"])
    monkeypatch.chdir(REPO)  # the quickstart's data_files is relative to the repository
    plugins.reset_plugins()

    def instantiate(**trainer_changes):
        config = yaml.safe_load((REPO / "configs/quickstart.yaml").read_text())
        config["trainer"]["logger"]["init_args"]["save_dir"] = str(tmp_path / "runs")
        config["trainer"].update(trainer_changes)
        config_file = tmp_path / "config.yaml"
        config_file.write_text(yaml.safe_dump(config))
        args = ["--config", str(config_file), "--model.model_name_or_path", str(tiny_model_dir)]
        return run_cli(args, run=False)

    yield instantiate
    plugins.reset_plugins()


def test_fit_checkpoints_last_ckpt_atomically_into_the_runs_directory(quickstart_with, tmp_path):
    trainer = quickstart_with().trainer
    checkpoint, every_n_minutes, on_signal = trainer.checkpoint_callbacks
    assert checkpoint.dirpath is None  # Lightning's: <the run's version directory>/checkpoints (tests/run/test_runs.py)
    assert checkpoint.save_last is True and checkpoint.save_top_k == 0
    assert checkpoint._every_n_train_steps == DEFAULT_CHECKPOINT_EVERY_N_TRAIN_STEPS
    # between its steps: every 30 minutes, and on a signal (tests/run/test_preemption.py)
    assert isinstance(every_n_minutes, CheckpointEveryNMinutes) and every_n_minutes.minutes == 30
    assert isinstance(on_signal, CheckpointOnSignal)
    assert [s.name for s in on_signal.signals] == ["SIGTERM", "SIGINT", "SIGUSR1"]
    assert isinstance(trainer.strategy.checkpoint_io, AtomicCheckpointIO)


def test_configured_preemption_callbacks_are_kept(quickstart_with):
    callbacks = [
        {"class_path": "lit_grpo.run.preemption.CheckpointEveryNMinutes", "init_args": {"minutes": 5}},
        {"class_path": "lit_grpo.run.preemption.CheckpointOnSignal", "init_args": {"signals": ["SIGUSR2"]}},
    ]
    trainer = quickstart_with(callbacks=callbacks).trainer
    checkpoint, every_n_minutes, on_signal = trainer.checkpoint_callbacks
    assert every_n_minutes.minutes == 5 and [s.name for s in on_signal.signals] == ["SIGUSR2"]
    assert checkpoint._every_n_train_steps == DEFAULT_CHECKPOINT_EVERY_N_TRAIN_STEPS  # still added, and first:
    assert trainer.checkpoint_callback is checkpoint  # Lightning's "best" and "last" look at the first


def test_configured_model_checkpoint_is_kept_and_gets_the_run_directory(quickstart_with, tmp_path):
    callbacks = [
        {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": {"every_n_train_steps": 7}},
        {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": {"dirpath": str(tmp_path / "best")}},
    ]
    trainer = quickstart_with(callbacks=callbacks).trainer
    first, second = [c for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint)]
    assert first._every_n_train_steps == 7 and first.save_last is None  # the user's settings stay
    assert first.dirpath is None  # the run's directory, as Lightning places it
    assert second.dirpath == str(tmp_path / "best")


def test_enable_checkpointing_false_adds_no_checkpoint(quickstart_with):
    trainer = quickstart_with(enable_checkpointing=False).trainer
    assert not [c for c in trainer.callbacks if isinstance(c, ModelCheckpoint)]


def test_a_mid_epoch_checkpoint_resumed_with_another_cut_of_the_epoch_is_refused(tmp_path):
    """Issue 49.10: the loader counts the batches handed out; with another number of processes or batch size
    those would be other prompts (some skipped, some repeated). Refused in one line, naming both cuts."""
    loader = prompt_loader(tmp_path)  # 1 process x 3 prompts, 4 batches an epoch
    loader.sampler.set_epoch(0)
    iterator = iter(loader)
    next(iterator)
    mid_epoch = loader.state_dict()
    two_processes = {"processes": 2, "batch_size": 3, "batches_in_epoch": 2}
    with pytest.raises(ConfigError, match=r"stopped 3 prompts into epoch 0 with 1 process\(es\) x data.batch_size 3, and "
                                          r"this run has 2 x 3: .* Resume with 1 process\(es\) and data.batch_size 3"):
        check_same_partition(mid_epoch, two_processes)
    with pytest.raises(ConfigError, match="this run has 1 x 4"):
        prompt_loader(tmp_path, batch_size=4).load_state_dict(mid_epoch)
    check_same_partition(mid_epoch, {"processes": 1, "batch_size": 3})  # the same cut resumes
    list(iterator)
    check_same_partition(loader.state_dict(), two_processes)  # at the epoch's end: any cut
    legacy = {key: value for key, value in mid_epoch.items() if key != "partition"}
    check_same_partition(legacy, two_processes)  # written before the partition was saved: as before


def test_a_one_process_checkpoint_resumed_on_two_processes_mid_epoch_stops_before_any_step(tiny_model_dir, tmp_path):
    """The refusal comes at the start of the resumed run (not at its first step), on both ranks, in one line."""
    data_file = tmp_path / "prompts.jsonl"
    data_file.write_text("".join(json.dumps(row) + "\n" for row in PROMPTS))
    config = fit_config(tiny_model_dir, data_file)
    config["trainer"]["max_steps"] = 2  # one training step: 1 of the epoch's 3 batches
    first = lit_grpo_fit(tmp_path, config, threads=1)
    assert first.returncode == 0, first.stderr[-3000:]
    config["trainer"].update(max_steps=10, devices=2, strategy="ddp")
    resumed = lit_grpo_fit(tmp_path, config, "--ckpt_path", "last", threads=1)
    assert resumed.returncode == 2, resumed.stderr[-3000:]
    assert "Traceback" not in resumed.stderr
    assert resumed.stderr.strip().splitlines()[-1].startswith(
        "error: the checkpoint stopped 2 prompts into epoch 0 with 1 process(es) x data.batch_size 2, and this run has 2 x 2")
    assert checkpoint_at(tmp_path)["global_step"] == 2  # nothing trained, nothing overwritten
    assert reward_steps(tmp_path / "runs/resume/version_0") == [0]
