"""The runs users start, as they start them: the ``lit-grpo`` command, the shipped recipes, several processes.

- Two processes (``trainer.devices: 2``, launched by Lightning from ``lit-grpo fit``) under DDP and
  FSDP2 with every feature a user turns on: the default logger under ``trainer.default_root_dir``,
  completions saved, logged as a table and printed, validation with ``val/pass@k`` (also before
  training), a ``ModelCheckpoint`` every 2 steps and a ``LearningRateMonitor``; all of it in the run's
  one directory, without Lightning's noise, and (DDP) resumed there with ``--ckpt_path last``.
- Every file in ``configs/`` on CPU, with only what needs a hub or a GPU replaced: the model by a
  tiny random model of the recipe's architecture class (saved in bf16, as hub checkpoints are), the
  data by a few local rows in the real data set's format, the accelerator by the CPU (the FSDP
  recipe on 2 processes). So that a step takes seconds, the completions are shorter, the batch
  smaller and the run a few steps; rewards and their args, precision, logger, callbacks and
  scheduler are as shipped.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import yaml
from conftest import GSM8K_ROWS

REPO = Path(__file__).resolve().parents[2]
LIT_GRPO = str(Path(sys.executable).with_name("lit-grpo"))  # the console script of this environment
WORKER = Path(__file__).resolve().parents[1] / "distributed_worker.py"
FSDP2 = {
    "class_path": "lightning.pytorch.strategies.ModelParallelStrategy",
    "init_args": {"data_parallel_size": 2, "tensor_parallel_size": 1},
}


def run_command(command: list[str], cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)  # a hang fails here
    assert result.returncode == 0, f"{command} failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return result


def scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    values = {tag: [(event.step, event.value) for event in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}
    values["<text>"] = [(0, float(len(accumulator.Tensors(tag)))) for tag in accumulator.Tags()["tensors"] if "completions" in tag]
    return values


# ----------------------------------------------------------------------------------------------
# Two processes with everything on
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_process_fit_with_logger_completions_validation_and_checkpoints(tmp_path, tiny_model_dir, strategy):
    config = yaml.safe_load((REPO / "configs/quickstart.yaml").read_text())
    del config["trainer"]["logger"]  # the default logger, which goes under default_root_dir
    config["trainer"].update(
        {
            "devices": 2,
            "strategy": "ddp" if strategy == "ddp" else FSDP2,
            "max_steps": 4,
            "val_check_interval": 2,
            "default_root_dir": str(tmp_path / "run"),
            "callbacks": [
                {
                    "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                    "init_args": {"every_n_train_steps": 2, "save_top_k": -1, "save_last": True},
                },
                {"class_path": "lightning.pytorch.callbacks.LearningRateMonitor", "init_args": {"logging_interval": "step"}},
            ],
        }
    )
    config["model"].update(
        {
            "model_name_or_path": str(tiny_model_dir),
            "log_completions_every_n_steps": 1,
            "print_completions": 3,
            "save_completions": True,
            "num_generations_eval": 4,
            "eval_pass_k": [1, 2],
            "eval_success_threshold": 0.1,
            "validate_before_training": True,
        }
    )
    # an uneven validation split (issue 52, A2): 5 prompts would be 3 and 2 on two ranks, 2 batches and 1;
    # Lightning's DistributedSampler pads the split to 3 and 3, so both ranks run 2 validation batches and
    # neither waits in a collective the other never reaches (a hang fails in run_command's timeout)
    config["data"].update({"data_files": str(REPO / config["data"]["data_files"]), "batch_size": 2, "val_split": "train[:5]"})
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))

    result = run_command([LIT_GRPO, "fit", "--config", "config.yaml"], cwd=tmp_path)

    run = tmp_path / "run" / "lit-grpo"
    log_dir = run / "version_0"
    logged = scalars(log_dir)
    assert [step for step, _ in logged["reward"]] == [0, 1, 2, 3]
    assert all(math.isfinite(value) for _, value in logged["loss"])
    assert len(logged["lr-AdamW"]) >= 4
    for name in ["val/pass@1", "val/pass@2", "val/mean@4", "val/reward"]:
        assert len(logged[name]) == 3, name  # before training, after step 2 and after step 4
    assert logged["<text>"][0][1] == 4  # the completions table at every step
    # every logged step's completions from both ranks: 2 processes x 2 prompts x 8 completions
    records = [json.loads(line) for line in (log_dir / "completions.jsonl").read_text().splitlines()]
    assert sorted({record["step"] for record in records}) == [0, 1, 2, 3]
    assert all(sum(record["step"] == step for record in records) == 32 for step in range(4))
    assert len({record["prompt"] for record in records if record["step"] == 0}) == 4
    assert result.stdout.count("completions at step") == 4
    checkpoints = sorted(path.name for path in (log_dir / "checkpoints").iterdir())
    assert checkpoints == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "last.ckpt"]
    assert sorted(path.name for path in (tmp_path / "run").iterdir()) == ["lit-grpo"]  # nothing beside the run
    assert not (tmp_path / "runs").exists()  # nothing outside default_root_dir
    for noise in ("isinstance(treespec, LeafSpec)", "all_gather is deprecated", "💡 Tip"):  # Lightning's, on every rank
        assert noise not in result.stderr, noise
    if strategy != "ddp":
        return

    # resumed on 2 processes: every rank finds the same run, which goes on in its own directory
    resumed = run_command([LIT_GRPO, "fit", "--config", "config.yaml", "--ckpt_path", "last", "--trainer.max_steps", "6"],
                          cwd=tmp_path)
    assert "Restored all states from the checkpoint at " + str(log_dir / "checkpoints/last.ckpt") in resumed.stderr
    assert sorted(path.name for path in run.iterdir()) == ["version_0"]
    assert [step for step, _ in scalars(log_dir)["reward"]] == [0, 1, 2, 3, 4, 5]
    records = [json.loads(line) for line in (log_dir / "completions.jsonl").read_text().splitlines()]
    assert [sum(record["step"] == step for record in records) for step in range(6)] == [32] * 6
    checkpoints = sorted(path.name for path in (log_dir / "checkpoints").iterdir())
    assert checkpoints == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "epoch=0-step=6.ckpt", "last.ckpt"]
    assert (log_dir / "config-resume-1.yaml").is_file()


# ----------------------------------------------------------------------------------------------
# Every shipped recipe
# ----------------------------------------------------------------------------------------------

RECIPES = sorted(path.name for path in (REPO / "configs").glob("*.yaml"))
# the architecture class of each hub model a recipe names, for its tiny stand-in
HUB_ARCHITECTURES = {"Qwen/Qwen2.5-0.5B-Instruct": "qwen2", "Qwen/Qwen2.5-7B-Instruct": "qwen2"}
# the local stand-in for each hub data set a recipe names: rows in the same format
HUB_DATA = {"openai/gsm8k": GSM8K_ROWS}


def recipe_overrides(recipe: dict, tmp_path: Path, tiny_model_dir: Path, tiny_qwen2_dir: Path, request) -> dict:
    """What must change for a recipe to run here: hub model and data, GPU, 8 processes; and size."""
    model = recipe["model"]["model_name_or_path"]
    if model == "./tiny-model":
        model_dir = tiny_model_dir
    elif model == "./tiny-kv-model":  # the tools quickstart's warm-started model (examples/environment-plugin)
        model_dir = request.getfixturevalue("warm_tool_model")
    elif model == "./tiny-rg-model":  # init-tiny's model after a short fine-tune: the same architecture, for 2 steps
        model_dir = tiny_model_dir
    else:
        assert model in HUB_ARCHITECTURES, f"add the architecture of {model} to HUB_ARCHITECTURES"
        model_dir = {"qwen2": tiny_qwen2_dir}[HUB_ARCHITECTURES[model]]
    data = recipe["data"]
    if data["path"] in HUB_DATA:
        rows = HUB_DATA[data["path"]] * 4
        (tmp_path / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        data_overrides = {"path": "json", "data_files": str(tmp_path / "data.jsonl"), "name": None, "split": "train"}
    elif data.get("data_files"):
        data_overrides = {"data_files": str(REPO / data["data_files"])}
    else:  # a plugin's data set (data.path names it, data.args its arguments): generated, nothing to change
        data_overrides = {}
    trainer = {"accelerator": "cpu", "max_steps": 2 * recipe["model"].get("steps_per_generation", 1)}
    sharded = isinstance(recipe["trainer"].get("strategy"), dict)
    if sharded:
        trainer.update(devices=2, strategy={**recipe["trainer"]["strategy"], "init_args": {**recipe["trainer"]["strategy"]["init_args"], "data_parallel_size": 2}})
    # CPU time: short completions (not where tool calls need the room), 2 prompts per process
    uses_tools = recipe["model"].get("tools") or recipe["model"].get("environment")
    length = recipe["model"]["max_completion_length"] if uses_tools else min(recipe["model"]["max_completion_length"], 24)
    model_overrides = {"model_name_or_path": str(model_dir), "max_completion_length": length}
    return {"trainer": trainer, "model": model_overrides, "data": {**data_overrides, "batch_size": 2}}


def recipe_run(recipe_name: str, run_dir: Path, overrides: dict) -> tuple[Path, dict]:
    """The recipe with ``overrides`` through tests/distributed_worker.py in ``run_dir``, on as many processes as
    the overrides say: the directory (with the worker's ``result.pt``) and the overrides."""
    (run_dir / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    processes = overrides["trainer"].get("devices", 1)
    script = [str(WORKER), "--config", str(REPO / "configs" / recipe_name), "--config", "overrides.yaml",
              "--out", "result.pt", "--record-compute-dtype"]
    command = [sys.executable, *script]
    if processes > 1:  # as the recipe says: torchrun --nproc_per_node N -m lit_grpo.cli fit --config ...
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}", *script]
    run_command(command, cwd=run_dir)
    return run_dir, overrides


@pytest.fixture(scope="module")
def recipe_runs(request, tmp_path_factory, tiny_model_dir, tiny_qwen2_dir) -> dict:
    """The runs of the recipes this session tests, started two at a time side by side by the first test that
    asks (each process on one thread: on 2 cores they overlap); the recipe of the warm-started tool model
    last, so that the warm start (a session fixture) trains while the others run.
    ``recipe_runs[name].result()``: :func:`recipe_run`'s directory and overrides, or what failed in it."""
    selected = {item.callspec.params["recipe_name"] for item in request.session.items
                if getattr(item, "originalname", None) == "test_shipped_recipe_trains"}
    recipes = {name: yaml.safe_load((REPO / "configs" / name).read_text()) for name in sorted(selected)}
    warm_model_last = sorted(recipes, key=lambda name: recipes[name]["model"]["model_name_or_path"] == "./tiny-kv-model")
    with ThreadPoolExecutor(2) as beside:
        runs = {}
        for name in warm_model_last:
            run_dir = tmp_path_factory.mktemp(name)
            overrides = recipe_overrides(recipes[name], run_dir, tiny_model_dir, tiny_qwen2_dir, request)
            runs[name] = beside.submit(recipe_run, name, run_dir, overrides)
        yield runs


@pytest.mark.parametrize("recipe_name", RECIPES)
def test_shipped_recipe_trains(recipe_name, recipe_runs):
    recipe = yaml.safe_load((REPO / "configs" / recipe_name).read_text())
    run_dir, overrides = recipe_runs[recipe_name].result()
    processes = overrides["trainer"].get("devices", 1)
    result = torch.load(run_dir / "result.pt", weights_only=False)

    assert result["world_size"] == processes
    steps = result["steps"]
    assert len(steps) == 2 and all(math.isfinite(step["loss"]) for step in steps)
    for reward in recipe["model"]["rewards"]:
        assert f"rewards/{reward['name']}/mean" in steps[0]
    # logs under the recipe's logger, and a checkpoint
    log_dir = run_dir / result["log_dir"]  # relative to the working directory of the run
    logger = recipe["trainer"]["logger"]["init_args"]
    assert log_dir.parent == run_dir / logger["save_dir"] / logger["name"]
    assert (log_dir / "completions.jsonl").exists() and "reward" in scalars(log_dir)
    assert (log_dir / "checkpoints" / "last.ckpt").exists()
    # trainable weights are float32 (the tiny hub stand-in is saved in bf16) and they moved
    from transformers import AutoModelForCausalLM

    initial = AutoModelForCausalLM.from_pretrained(overrides["model"]["model_name_or_path"], dtype=torch.float32).state_dict()
    state = result["state"]
    assert {str(tensor.dtype) for tensor in state.values()} == {"torch.float32"}
    moved = max((state[name] - initial[name]).abs().max().item() for name in initial)
    if any(step["frac_reward_zero_std"] < 1 for step in steps):  # some group had a signal
        assert moved > 0
    else:  # no reward signal (a random model on GSM8K): advantages 0, no gradient; only AdamW's decay moves them
        optimizer = recipe["optimizer"]["init_args"]
        decay = 1 - optimizer["lr"] * optimizer.get("weight_decay", 0.01)  # torch.optim.AdamW's default decay
        for name in initial:
            torch.testing.assert_close(state[name], initial[name] * decay ** len(steps), rtol=1e-6, atol=1e-7)
    # bf16-mixed computes in bf16: FSDP2 gathers bf16 weights (MixedPrecisionPolicy); one process
    # keeps float32 weights and autocast casts in each matmul
    precision = recipe["trainer"].get("precision", "32-true")
    if precision == "bf16-mixed" and processes > 1:
        assert result["compute_dtypes"] == [("torch.bfloat16", "torch.bfloat16")]
    else:
        assert result["compute_dtypes"] == [("torch.float32", "torch.float32")]


@pytest.mark.parametrize("recipe_name", [name for name in RECIPES if "gsm8k" in name])
def test_gsm8k_recipe_rewards_score_a_correct_answer_1_and_a_wrong_one_0(tmp_path, recipe_name, fresh_cli, capsys,
                                                                        monkeypatch):
    """The recipe's rewards as the command parses them (``--print_config``, the command in this process), on
    hand-written completions in the format the recipe asks for, against a GSM8K reference ``... #### 72``."""
    from test_cli import print_config

    from lit_grpo.scoring import RewardScorer

    monkeypatch.chdir(tmp_path)
    specs = print_config(capsys, "--config", str(REPO / "configs" / recipe_name))["model"]["rewards"]
    scorer = RewardScorer(specs)
    try:
        row = GSM8K_ROWS[0]
        completions = [
            "<think>48 / 2 = 24 in May, 48 + 24 = 72 in all.</think>\n<answer>72</answer>",
            "<think>48 + 48 = 96.</think>\n<answer>96</answer>",
        ]
        scores = scorer([row["question"]] * 2, completions, [[1], [1]], {"answer": [row["answer"]] * 2})
        accuracy = scorer.names.index(specs[0]["name"])  # the first reward of each GSM8K recipe checks the answer
        assert scores[:, accuracy].tolist() == [1.0, 0.0]
    finally:
        scorer.close()
