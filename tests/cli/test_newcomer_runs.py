"""What a newcomer's failed tries leave behind, and what a run shows while it goes (issue 51): a run
that fails before its first step leaves no run directory that ``--ckpt_path last`` would trip on."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import yaml

from lit_grpo.cli import main

REPO = Path(__file__).resolve().parents[2]
TENSORBOARD = {"class_path": "lightning.pytorch.loggers.TensorBoardLogger", "init_args": {"save_dir": "runs", "name": "t"}}

pytestmark = pytest.mark.usefixtures("fresh_cli")  # tests/conftest.py


@pytest.fixture
def fit(tmp_path, tiny_model_dir, monkeypatch):
    """``fit(*args, **model)``: ``lit-grpo fit`` in this process, in ``tmp_path``, on a small quickstart."""
    monkeypatch.chdir(tmp_path)

    def run(*args: str, **model) -> None:
        config = yaml.safe_load((REPO / "configs/quickstart.yaml").read_text())
        config["trainer"].update(logger=TENSORBOARD, enable_progress_bar=False, enable_model_summary=False)
        config["model"].update(model_name_or_path=str(tiny_model_dir), num_generations=2, max_completion_length=4, **model)
        config["data"].update(data_files=str(REPO / config["data"]["data_files"]), batch_size=2)
        Path("config.yaml").write_text(yaml.safe_dump(config))
        main(["fit", "--config", "config.yaml", *args])

    return run


def test_a_run_that_fails_before_its_first_step_leaves_no_run_behind_and_last_resumes_the_real_one(fit, tmp_path, capsys):
    fit("--trainer.max_steps=2")
    real = tmp_path / "runs/t/version_0"
    assert (real / "checkpoints/last.ckpt").exists()
    (tmp_path / "broken.py").write_text("def reward(completions, **kwargs):\n    raise ValueError('not yet written')\n")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        fit("--trainer.max_steps=2", rewards=[{"name": "broken.py:reward"}])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "not yet written" in err and "runs/t/version_1 removed: the run failed before its first step" in err
    assert sorted(path.name for path in (tmp_path / "runs/t").iterdir()) == ["version_0"]

    fit("--trainer.max_steps=3", "--ckpt_path", "last")  # the real run, resumed in its own directory
    assert torch.load(real / "checkpoints/last.ckpt", weights_only=True)["global_step"] == 3
    assert sorted(path.name for path in (tmp_path / "runs/t").iterdir()) == ["version_0"]


def test_completions_keeps_the_end_of_a_long_prompt_and_the_start_of_a_completion(tmp_path):
    from lit_grpo.run.completions import show_step

    prompt = "Solve the following task. " * 5 + "Reverse the word: lantern"
    record = {"step": 1, "prompt": prompt, "completion": "nretnal and then some more words", "rewards": {"r": 1.0},
              "reward": 1.0, "advantage": 0.0}
    (tmp_path / "completions.jsonl").write_text(json.dumps(record) + "\n")
    row = show_step(tmp_path, width=20).splitlines()[-1]
    assert row.startswith("| …e the word: lantern | nretnal and then so… | 1.000 |"), row


def test_what_a_run_says_while_its_bar_is_shown_starts_on_a_line_of_its_own(tmp_path, tiny_model_dir):
    """The CPU threads, a reward that keeps failing (said in full once) and the printed completions
    each start on a fresh line of the console, stdout and stderr together, not at the end of the bar."""
    config = yaml.safe_load((REPO / "configs/quickstart.yaml").read_text())
    config["trainer"].update(logger=TENSORBOARD, enable_model_summary=False, max_steps=3)
    config["model"].update(model_name_or_path=str(tiny_model_dir), num_generations=2, max_completion_length=4,
                           print_completions=1, rewards=[{"name": "char_fraction"},
                                                         {"name": "flaky.py:reward", "on_error": "none"}])
    config["data"].update(data_files=str(REPO / config["data"]["data_files"]), batch_size=2)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    (tmp_path / "flaky.py").write_text("def reward(completions, **kwargs):\n    raise ValueError('no parse')\n")
    console = subprocess.run([sys.executable, "-m", "lit_grpo.cli", "fit", "--config", "config.yaml"], cwd=tmp_path,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300,
                             env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert console.returncode == 0, console.stdout[-3000:]
    for said in ("CPU: up to", "completions at step 0:", "Reward 'flaky.py:reward' ("):
        assert said in console.stdout, said
        before = [console.stdout[at - 1] for at in range(len(console.stdout)) if console.stdout.startswith(said, at)]
        assert set(before) <= {"\n", "\r"}, (said, console.stdout[console.stdout.index(said) - 80:][:200])
    assert console.stdout.count("failed on 4 of 4 samples") == 1  # then counted in rewards/reward/errors


def test_a_resumed_runs_bar_counts_its_speed_from_the_step_it_resumed(tmp_path):
    from lightning.pytorch.demos.boring_classes import BoringModel
    from tqdm import tqdm

    from lit_grpo.run.callbacks import StepProgressBar

    def fit(steps: int, ckpt_path=None) -> StepProgressBar:
        bar = StepProgressBar()
        trainer = pl.Trainer(max_steps=steps, default_root_dir=tmp_path, callbacks=[bar], logger=False,
                             enable_model_summary=False, limit_val_batches=0, accelerator="cpu")
        trainer.fit(BoringModel(), ckpt_path=ckpt_path)
        return bar

    fit(60)
    resumed = fit(62, ckpt_path=str(next(tmp_path.glob("checkpoints/*.ckpt")))).train_progress_bar
    shown = resumed.format_dict
    assert (shown["n"], shown["total"]) == (62, 62)
    rate = re.search(r"([\d.]+)(it/s|s/it)", tqdm.format_meter(**shown))
    per_second = float(rate.group(1)) if rate.group(2) == "it/s" else 1 / float(rate.group(1))
    assert per_second * shown["elapsed"] == pytest.approx(2, rel=0.3)  # 2 steps in this run, not 62


@pytest.mark.parametrize("default_bar", ["RichProgressBar", "TQDMProgressBar"])
def test_a_plain_trainer_counts_steps_out_of_max_steps_as_the_command_does(tiny_model_dir, tmp_path, default_bar):
    """Lightning's default bar (rich when installed) shows ``Epoch 0/-2`` and the batches of an epoch; a
    GRPOModule's run shows optimizer steps out of max_steps instead."""
    from lightning.pytorch import callbacks

    from lit_grpo import GRPODataModule, GRPOModule

    module = GRPOModule(str(tiny_model_dir), rewards=[{"name": "char_fraction"}], num_generations=2, max_completion_length=4)
    data = GRPODataModule.from_data([{"prompt": "Say a:", "target": "a"}] * 4, batch_size=2)
    trainer = pl.Trainer(max_steps=3, accelerator="cpu", default_root_dir=tmp_path, logger=False, enable_checkpointing=False,
                         enable_model_summary=False, callbacks=[getattr(callbacks, default_bar)()])
    trainer.fit(module, datamodule=data)
    bar = trainer.progress_bar_callback
    if default_bar == "TQDMProgressBar":
        shown = bar.train_progress_bar
        assert (shown.desc, shown.n, shown.total) == ("steps: ", 3, 3)
    else:
        (shown,) = bar.progress.tasks
        assert (shown.description, shown.completed, shown.total) == ("steps", 3, 3)


def test_the_readme_python_snippet_imports_lit_grpo_before_torch():
    """``import lit_grpo`` chooses how OpenMP's threads wait before torch loads (lit_grpo.openmp);
    the snippet a newcomer copies must do it in that order, as examples/python_api.py does."""
    readme = (REPO / "README.md").read_text()
    snippet = readme.split("## From Python", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    imports = [line.split("#")[0] for line in snippet.splitlines() if line.startswith(("import ", "from "))]
    first_torch = next(i for i, line in enumerate(imports) if re.search(r"\b(torch|lightning)\b", line))
    first_lit_grpo = next(i for i, line in enumerate(imports) if re.search(r"\blit_grpo\b", line))
    assert first_lit_grpo < first_torch, imports


def test_the_lora_recipe_learns_the_quickstart(tmp_path, tiny_model_dir, monkeypatch):
    """configs/lora/quickstart-lora.yaml on the quickstart, its first half (150 of 300 steps, about
    25 s): the reward rises as the full fine-tune's does (tests/train/test_module.py), where an adapter on
    peft's default targets ("all-linear": the head left out) stays at about 0.02 (bench/results/lora_quickstart.md)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.chdir(tmp_path)
    main(["fit", "--config", str(REPO / "configs/quickstart.yaml"), "--config", str(REPO / "configs/lora/quickstart-lora.yaml"),
          f"--model.model_name_or_path={tiny_model_dir}", f"--data.data_files={REPO / 'configs/data/quickstart.jsonl'}",
          "--trainer.max_steps=150", "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"])
    events = EventAccumulator(str(tmp_path / "runs/quickstart-lora/version_0"), size_guidance={"scalars": 0})
    events.Reload()
    per_step = [event.value for event in events.Scalars("reward")]
    assert len(per_step) == 150
    first, last = sum(per_step[:10]) / 10, sum(per_step[-10:]) / 10
    assert last > first + 0.2, f"reward went from {first:.3f} to {last:.3f}"
    checkpoint = torch.load(tmp_path / "runs/quickstart-lora/version_0/checkpoints/last.ckpt", weights_only=True)
    assert any("lm_head.lora_B" in name for name in checkpoint["state_dict"])  # the head has an adapter of its own


@pytest.mark.parametrize("command", [["--help"], ["completions", "--help"], ["completions", "no-such-run"], ["rewards"],
                                     ["export", "--help"]])
def test_a_command_that_trains_nothing_imports_neither_torch_nor_lightning(command):
    """``import lit_grpo.cli`` took 6.5 s (Lightning, torch, transformers) before every command and every
    error; a command that does not train imports none of them (well under a second)."""
    script = ("import sys\nfrom lit_grpo.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
              "print(sorted(name for name in ('torch', 'lightning', 'transformers') if name in sys.modules))")
    shown = subprocess.run([sys.executable, "-c", script, *command], capture_output=True, text=True, timeout=60)
    assert shown.stdout.strip().splitlines()[-1] == "[]", shown.stdout[-500:] + shown.stderr[-500:]


def test_a_run_stopping_on_an_error_that_writes_its_checkpoint_keeps_its_directory(tmp_path):
    """A failed generation server's error (a CheckpointedError) gets its last.ckpt from a callback that
    Lightning may call after RemoveRunWithoutSteps: the run directory, still without a .ckpt, stays
    (removing it lost the asynchronous pipeline's checkpoint on 2 processes); any other error before
    the first step still removes it."""
    from types import SimpleNamespace

    from lit_grpo.rollout.engines.server_lost import GenerationFailed
    from lit_grpo.run.directory import RemoveRunWithoutSteps

    run = tmp_path / "runs" / "quickstart" / "version_0"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("seed_everything: 0\n")
    logger = SimpleNamespace(log_dir=str(run), finalize=lambda status: None)
    trainer = SimpleNamespace(global_step=0, is_global_zero=True, logger=logger, loggers=[logger])
    RemoveRunWithoutSteps().on_exception(trainer, None, GenerationFailed("the server at http://127.0.0.1:8000 refused"))
    assert run.is_dir()
    RemoveRunWithoutSteps().on_exception(trainer, None, ValueError("a reward broke"))
    assert not run.exists()
