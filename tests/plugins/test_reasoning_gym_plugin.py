"""examples/reasoning-gym-plugin (lit-grpo-reasoning-gym), installed as the README's test command installs
it: its data set generates reasoning-gym's own problems, its reward scores them as reasoning-gym does,
and a run on them trains and resumes exactly. reasoning-gym is the real package (pinned), not a stand-in."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import lit_grpo_reasoning_gym
import pytest
import reasoning_gym
import torch
import yaml
from reasoning_gym.composite import DatasetSpec
from reasoning_gym.utils import extract_answer

from lit_grpo import GRPODataModule, GRPOModule, plugins
from lit_grpo.errors import UserError

REPO = Path(__file__).resolve().parents[2]
SPELL = {"name": "spell_backward", "weight": 3, "config": {"min_word_len": 3, "max_word_len": 5}}
MIX = [SPELL, {"name": "basic_arithmetic", "weight": 1, "config": {"max_terms": 3}}, {"name": "letter_counting"}]


def data(args: dict, **options) -> GRPODataModule:
    module = GRPODataModule(path="reasoning_gym", args=args, prompt_column="question", val_split="validation", **options)
    module.setup("fit")
    return module


def test_one_task_is_the_package_s_own_data_set():
    train = data({"datasets": [SPELL], "size": 40, "seed": 5}).train_dataset
    own = reasoning_gym.create_dataset("spell_backward", seed=5, size=40, min_word_len=3, max_word_len=5)
    assert train["question"] == [entry["question"] for entry in own]
    assert train["answer"] == [entry["answer"] for entry in own]


def test_a_weighted_mix_is_the_package_s_composite_and_the_validation_split_is_held_out():
    module = data({"datasets": MIX, "size": 60, "seed": 3, "val_size": 30})
    own = reasoning_gym.create_dataset("composite", seed=3, size=60,
                                       datasets=[DatasetSpec(t["name"], t.get("weight", 1), t.get("config", {})) for t in MIX])
    assert module.train_dataset["question"] == [entry["question"] for entry in own]
    assert module.train_dataset["source_dataset"] == [entry["metadata"]["source_dataset"] for entry in own]
    assert set(module.train_dataset["source_dataset"]) == {"spell_backward", "basic_arithmetic", "letter_counting"}
    validation = module.val_dataset["question"]
    assert len(validation) > 20 and not set(validation) & set(module.train_dataset["question"])
    assert validation == data({"datasets": MIX, "size": 60, "seed": 3, "val_size": 30}).val_dataset["question"]  # seeded


def test_the_reward_is_the_task_s_own_score_answer():
    rows = data({"datasets": MIX, "size": 30, "seed": 1}).train_dataset
    own = reasoning_gym.create_dataset("composite", seed=1, size=30,
                                       datasets=[DatasetSpec(t["name"], t.get("weight", 1), t.get("config", {})) for t in MIX])
    completions = []
    for index, entry in enumerate(own):  # right, partly right, wrong, untagged and empty answers
        answer = entry["answer"]
        completions.append([f"<answer>{answer}</answer>", f"I think <answer>{answer[:-1]}x</answer>", "<answer>7</answer>",
                            answer, ""][index % 5])
    scores = lit_grpo_reasoning_gym.reasoning_gym_score(completions, rows["reasoning_gym_spec"], rows["reasoning_gym_index"])
    expected = [own.score_answer(extract_answer(text), entry) for text, entry in zip(completions, own)]
    assert scores == expected and 0.0 < sum(scores) < len(scores)
    assert any(0.0 < score < 1.0 for score in scores)  # spell_backward's partial credit, from the package
    untagged = lit_grpo_reasoning_gym.reasoning_gym_score([entry["answer"] for entry in own], rows["reasoning_gym_spec"],
                                                          rows["reasoning_gym_index"], answer_tag=None)
    assert untagged == [1.0] * len(own)
    chat = [[{"role": "assistant", "content": text}] for text in completions]  # conversational completions
    assert lit_grpo_reasoning_gym.reasoning_gym_score(chat, rows["reasoning_gym_spec"], rows["reasoning_gym_index"]) == expected


@pytest.mark.parametrize("path, args, message", [
    ("reasoning_gym", {"datasets": [{"name": "spell_backwards"}]}, r"no task 'spell_backwards'; did you mean 'spell_backward'\?"),
    ("reasoning_gym", {"datasets": [{"name": "spell_backward", "config": {"min_word_length": 3}}]},
     r"task 'spell_backward' has no setting 'min_word_length'; did you mean 'min_word_len'\?"),
    ("reasoning_gym", {"datasets": [SPELL], "sizes": 10}, r"data.args of data set 'reasoning_gym'.*'sizes'.*did you mean 'size'\?"),
    ("reasoning_gim", {"datasets": [SPELL]}, r"Unknown data set 'reasoning_gim'. Did you mean 'reasoning_gym'\?"),
    ("reasoning_gym", {"datasets": [{"name": "basic_arithmetic", "config": {"min_terms": 5, "max_terms": 2}}]},
     r"reasoning-gym refused the settings of basic_arithmetic"),
])
def test_bad_names_and_arguments_are_one_line_errors(path, args, message):
    with pytest.raises(UserError, match=message) as error:
        GRPODataModule(path=path, args=args, prompt_column="question").setup("fit")
    assert "\n" not in str(error.value)


def test_lit_grpo_environments_lists_the_data_set_with_its_package(fresh_cli, capsys):
    from lit_grpo.cli import main

    main(["environments"])
    out = capsys.readouterr().out
    datasets, rewards = out.split("Data sets", 1)[1].split("Rewards of these packages", 1)
    assert any(line.split()[:2] == ["reasoning_gym", "lit-grpo-reasoning-gym"] for line in datasets.splitlines())
    # what the package brings, its reward too; not the rewards of packages that bring no environment or data set
    listed = [line.split()[:2] for line in rewards.splitlines()[2:]]
    assert ["reasoning_gym_score", "lit-grpo-reasoning-gym"] in listed and "lit-grpo-rewards" not in {row[1] for row in listed}
    assert plugins.get_rewards()["reasoning_gym_score"].package == "lit-grpo-reasoning-gym"


def fit(model_dir, root: Path, steps: int, ckpt_path=None) -> pl.Trainer:
    pl.seed_everything(0)
    module = GRPOModule(str(model_dir), rewards=[{"name": "reasoning_gym_score", "args": {"answer_tag": None}}],
                        num_generations=4, max_completion_length=4, log_completions_every_n_steps=0,
                        optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3))
    module_data = GRPODataModule(path="reasoning_gym", args={"datasets": MIX, "size": 64, "seed": 0}, prompt_column="question",
                                 batch_size=4)
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, log_every_n_steps=1, default_root_dir=str(root),
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[pl.callbacks.ModelCheckpoint(save_last=True, save_top_k=0, every_n_train_steps=2)])
    trainer.fit(module, datamodule=module_data, ckpt_path=ckpt_path)
    return trainer


def completions(trainer: pl.Trainer) -> list[tuple]:
    rows = [json.loads(line) for line in (Path(trainer.log_dir) / "completions.jsonl").read_text().splitlines()]
    return [(row["step"], row["prompt"], row["completion"], row["reward"]) for row in rows]


def test_a_run_on_a_mix_resumes_exactly(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # bit for bit on one thread (README: Resuming a run)
    try:
        whole = fit(tiny_model_dir, tmp_path / "whole", 4)
        first = fit(tiny_model_dir, tmp_path / "parts", 2)
        rest = fit(tiny_model_dir, tmp_path / "parts", 4, ckpt_path=str(Path(first.log_dir) / "checkpoints/last.ckpt"))
    finally:
        torch.set_num_threads(threads)
    resumed = [row for row in completions(rest) if row[0] >= 2]
    assert resumed and resumed == [row for row in completions(whole) if row[0] >= 2]


def test_the_shipped_config_trains_on_a_mix(tmp_path, tiny_model_dir):
    config = yaml.safe_load((REPO / "configs/reasoning-gym-quickstart.yaml").read_text())
    assert len(config["data"]["args"]["datasets"]) > 1  # a mix
    command = [str(Path(sys.executable).with_name("lit-grpo")), "fit", "--config", str(REPO / "configs/reasoning-gym-quickstart.yaml"),
               "--model.model_name_or_path", str(tiny_model_dir), "--trainer.max_steps", "2", "--trainer.val_check_interval", "1",
               "--data.args.size", "32", "--data.args.val_size", "8"]
    result = subprocess.run(command, check=False, cwd=tmp_path, capture_output=True, text=True, timeout=600,
                            env={"HF_HUB_OFFLINE": "1", "PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr[-3000:]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "runs/reasoning-gym-quickstart/version_0"))
    events.Reload()
    assert len(events.Scalars("rewards/reasoning_gym_score/mean")) == 2 and events.Scalars("val/reward")
