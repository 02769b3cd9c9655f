"""The ``lit-grpo`` command: LightningCLI fit/--print_config, config overrides, the optimizer and
gradient-clipping adaptations, ``lit-grpo rewards`` and ``lit-grpo init-tiny``."""

from __future__ import annotations

import importlib.metadata
import json
import math
from pathlib import Path

import pytest
import torch
import yaml

from lit_grpo.cli import GRPOCLI, main, run_cli

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "configs" / "quickstart.yaml"
GSM8K = REPO / "configs" / "qwen2.5-0.5b-gsm8k.yaml"

# DESIGN.md 3.2: keys `lit-grpo fit --config ...` must accept.
DESIGN_MODEL_KEYS = [
    "model_name_or_path",
    "num_generations",
    "max_completion_length",
    "temperature",
    "top_p",
    "top_k",
    "num_iterations",
    "loss_type",
    "beta",
    "epsilon",
    "epsilon_high",
    "scale_rewards",
    "mask_truncated_completions",
    "rewards",
]
DESIGN_DATA_KEYS = ["path", "data_files", "prompt_column", "batch_size"]


pytestmark = pytest.mark.usefixtures("fresh_cli")  # tests/conftest.py


@pytest.fixture
def in_repo(monkeypatch):
    """The quickstart's data_files is relative to the repository root."""
    monkeypatch.chdir(REPO)
    return REPO


def print_config(capsys, *args) -> dict:
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", *args, "--print_config"])
    assert exit_info.value.code in (0, None)
    return yaml.safe_load(capsys.readouterr().out)


def quickstart_config(tmp_path, **changes) -> Path:
    """A copy of configs/quickstart.yaml with top-level sections replaced (None deletes one)."""
    config = yaml.safe_load(QUICKSTART.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def instantiate(args) -> GRPOCLI:
    """The CLI's objects without running a subcommand."""
    return run_cli(args, run=False)


# --------------------------------------------------------------------------------------------------
# fit
# --------------------------------------------------------------------------------------------------


def test_quickstart_fit_writes_tensorboard_scalars(tiny_model_dir, tmp_path, in_repo):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    save_dir = tmp_path / "runs"
    main(
        [
            "fit",
            "--config", str(QUICKSTART.relative_to(REPO)),
            "--model.model_name_or_path", str(tiny_model_dir),
            "--trainer.max_steps", "3",
            "--trainer.logger.init_args.save_dir", str(save_dir),
            "--trainer.enable_checkpointing", "false",
            "--trainer.enable_progress_bar", "false",
            "--trainer.enable_model_summary", "false",
        ]
    )
    event_dirs = sorted({path.parent for path in save_dir.rglob("events.out.tfevents.*")})
    assert len(event_dirs) == 1, event_dirs
    assert event_dirs[0].relative_to(save_dir).parts[0] == "quickstart"  # logger name from the YAML
    accumulator = EventAccumulator(str(event_dirs[0]), size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    scalar_tags = accumulator.Tags()["scalars"]
    rewards = accumulator.Scalars("reward")
    assert [event.step for event in rewards] == [0, 1, 2]
    assert all(0.0 <= event.value <= 1.0 for event in rewards)
    for tag in ("loss", "rewards/char_fraction/mean", "entropy", "completions/mean_length"):
        assert tag in scalar_tags, scalar_tags
        assert len(accumulator.Scalars(tag)) == 3
        assert all(math.isfinite(event.value) for event in accumulator.Scalars(tag))
    # log_completions_every_n_steps: 20 in the YAML -> the table of the first step only.
    text_tags = [tag for tag in accumulator.Tags()["tensors"] if tag.startswith("completions")]
    assert len(text_tags) == 1 and len(accumulator.Tensors(text_tags[0])) == 1
    # LightningCLI saves the resolved config next to the events.
    saved = yaml.safe_load((event_dirs[0] / "config.yaml").read_text())
    assert saved["model"]["model_name_or_path"] == str(tiny_model_dir)
    assert saved["trainer"]["max_steps"] == 3


# --------------------------------------------------------------------------------------------------
# --print_config and overrides
# --------------------------------------------------------------------------------------------------


def test_print_config_shows_quickstart_settings(capsys, in_repo):
    config = print_config(capsys, "--config", str(QUICKSTART))
    model, data = config["model"], config["data"]
    for key in DESIGN_MODEL_KEYS:
        assert key in model, key
    for key in DESIGN_DATA_KEYS:
        assert key in data, key
    assert config["seed_everything"] == 0
    assert config["trainer"]["max_steps"] == 300
    assert config["trainer"]["accelerator"] == "cpu"
    assert model["num_generations"] == 8
    assert model["max_completion_length"] == 16
    assert model["loss_type"] == "dapo"
    assert model["epsilon_high"] == 0.28
    assert model["rewards"][0]["name"] == "char_fraction"
    assert data["path"] == "json" and data["data_files"] == "configs/data/quickstart.jsonl"
    assert data["batch_size"] == 8
    assert config["optimizer"]["class_path"] == "torch.optim.AdamW"
    assert config["optimizer"]["init_args"]["lr"] == 0.003


def test_print_config_of_gsm8k_recipe(capsys, in_repo):
    if not GSM8K.exists():
        pytest.skip(f"{GSM8K.relative_to(REPO)} not written yet")
    config = print_config(capsys, "--config", str(GSM8K))
    for key in DESIGN_MODEL_KEYS:
        assert key in config["model"], key
    for key in DESIGN_DATA_KEYS:
        assert key in config["data"], key
    assert config["model"]["rewards"], "the recipe configures rewards"
    assert config["trainer"]["max_steps"] > 0


def test_print_config_of_fsdp_recipe(capsys, in_repo):
    config = print_config(capsys, "--config", str(REPO / "configs" / "qwen2.5-7b-gsm8k-fsdp.yaml"))
    strategy = config["trainer"]["strategy"]
    assert strategy["class_path"] == "lightning.pytorch.strategies.ModelParallelStrategy"
    # lit-grpo shards over the data-parallel dimension only: every process is a data-parallel rank
    devices = config["trainer"]["devices"] * config["trainer"]["num_nodes"]
    assert strategy["init_args"]["data_parallel_size"] == devices
    assert strategy["init_args"]["tensor_parallel_size"] == 1


def test_command_line_overrides_show_in_printed_config(capsys, in_repo):
    config = print_config(
        capsys,
        "--config", str(QUICKSTART),
        "--model.num_generations", "4",
        "--model.loss_type", "grpo",
        "--data.batch_size", "2",
        "--optimizer.init_args.lr", "0.01",
    )
    assert config["model"]["num_generations"] == 4
    assert config["model"]["loss_type"] == "grpo"
    assert config["data"]["batch_size"] == 2
    assert config["optimizer"]["init_args"]["lr"] == 0.01
    assert config["model"]["max_completion_length"] == 16  # untouched keys keep the YAML's values


# --------------------------------------------------------------------------------------------------
# Adaptations of LightningCLI: gradient clipping and the optimizer blocks
# --------------------------------------------------------------------------------------------------


def test_trainer_gradient_clip_val_becomes_model_max_grad_norm(tiny_model_dir, tmp_path, in_repo):
    trainer = {"max_steps": 1, "accelerator": "cpu", "logger": False, "gradient_clip_val": 0.5}
    config = quickstart_config(tmp_path, trainer=trainer)
    cli = instantiate(["--config", str(config), "--model.model_name_or_path", str(tiny_model_dir)])
    assert cli.model.hparams.max_grad_norm == 0.5
    assert cli.trainer.gradient_clip_val is None  # Lightning refuses it under manual optimization

    # And without it, the module's own default stays.
    trainer.pop("gradient_clip_val")
    config = quickstart_config(tmp_path, trainer=trainer)
    cli = instantiate(["--config", str(config), "--model.model_name_or_path", str(tiny_model_dir)])
    assert cli.model.hparams.max_grad_norm == 1.0


def test_gradient_clip_algorithm_value_is_refused(tiny_model_dir, tmp_path, in_repo):
    trainer = {"max_steps": 1, "logger": False, "gradient_clip_val": 0.5, "gradient_clip_algorithm": "value"}
    config = quickstart_config(tmp_path, trainer=trainer)
    with pytest.raises(ValueError, match="gradient_clip_algorithm") as error:
        instantiate(["--config", str(config), "--model.model_name_or_path", str(tiny_model_dir)])
    assert "'value'" in str(error.value) and "max_grad_norm" in str(error.value)


def built_optimizer(cli):
    cli.model.configure_model()
    built = cli.model.configure_optimizers()
    return built if isinstance(built, dict) else {"optimizer": built}


def test_optimizer_defaults_to_adamw_1e6_without_optimizer_block(tiny_model_dir, tmp_path, in_repo):
    config = quickstart_config(tmp_path, optimizer=None, trainer={"max_steps": 1, "logger": False})
    cli = instantiate(["--config", str(config), "--model.model_name_or_path", str(tiny_model_dir)])
    built = built_optimizer(cli)
    optimizer = built["optimizer"]
    assert type(optimizer) is torch.optim.AdamW
    assert optimizer.param_groups[0]["lr"] == 1e-6
    assert "lr_scheduler" not in built
    policy_params = {id(p) for p in cli.model.policy.parameters()}
    assert {id(p) for group in optimizer.param_groups for p in group["params"]} == policy_params


def test_optimizer_and_scheduler_blocks_are_used(tiny_model_dir, tmp_path, in_repo):
    config = quickstart_config(tmp_path, trainer={"max_steps": 1, "logger": False})
    cli = instantiate(["--config", str(config), "--model.model_name_or_path", str(tiny_model_dir)])
    optimizer = built_optimizer(cli)["optimizer"]
    assert type(optimizer) is torch.optim.AdamW
    assert optimizer.param_groups[0]["lr"] == 0.003
    assert optimizer.param_groups[0]["weight_decay"] == 0.01  # AdamW's default, from the YAML class

    cli = instantiate(
        [
            "--config", str(config),
            "--model.model_name_or_path", str(tiny_model_dir),
            "--optimizer", "torch.optim.SGD",
            "--optimizer.lr", "0.25",
            "--lr_scheduler", "torch.optim.lr_scheduler.StepLR",
            "--lr_scheduler.step_size", "3",
        ]
    )
    built = built_optimizer(cli)
    assert type(built["optimizer"]) is torch.optim.SGD
    assert built["optimizer"].param_groups[0]["lr"] == 0.25
    scheduler = built["lr_scheduler"]
    assert type(scheduler) is torch.optim.lr_scheduler.StepLR
    assert scheduler.optimizer is built["optimizer"] and scheduler.step_size == 3


def test_one_step_fit_uses_configured_optimizer(tiny_model_dir, tmp_path, in_repo):
    trainer = {
        "max_steps": 1,
        "accelerator": "cpu",
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "default_root_dir": str(tmp_path),  # LightningCLI writes config.yaml there without a logger
    }
    config = quickstart_config(tmp_path, trainer=trainer)
    from lit_grpo.cli import run_cli

    cli = run_cli(
        ["fit", "--config", str(config), "--model.model_name_or_path", str(tiny_model_dir),
         "--model.num_generations", "2", "--data.batch_size", "2", "--model.max_completion_length", "8"]
    )
    assert cli.trainer.global_step == 1
    (optimizer,) = cli.trainer.optimizers
    assert type(optimizer) is torch.optim.AdamW
    assert optimizer.param_groups[0]["lr"] == 0.003
    assert optimizer.state, "the optimizer took a step"
    assert (tmp_path / "config.yaml").exists()


# --------------------------------------------------------------------------------------------------
# lit-grpo rewards / init-tiny
# --------------------------------------------------------------------------------------------------


def test_rewards_table_lists_installed_rewards_with_packages(capsys):
    main(["rewards"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["NAME", "PACKAGE", "VERSION"]
    by_name = {line.split()[0]: line.split() for line in lines[1:] if line.strip()}
    rewards_version = importlib.metadata.version("lit-grpo-rewards")
    plugin_version = importlib.metadata.version("lit-grpo-test-plugin")
    for name in ("char_fraction", "exact_match", "think_format"):
        assert by_name[name][1:3] == ["lit-grpo-rewards", rewards_version]
    for name in ("shouts", "contains_word"):
        assert by_name[name][1:3] == ["lit-grpo-test-plugin", plugin_version]
    assert "upper case" in " ".join(by_name["shouts"])  # the docstring's first line


def test_rewards_json(capsys):
    main(["rewards", "--json"])
    entries = {entry["name"]: entry for entry in json.loads(capsys.readouterr().out)}
    assert entries["char_fraction"]["package"] == "lit-grpo-rewards"
    assert entries["char_fraction"]["version"] == importlib.metadata.version("lit-grpo-rewards")
    assert entries["char_fraction"]["kind"] == "function"
    assert entries["shouts"]["package"] == "lit-grpo-test-plugin"
    assert entries["shouts"]["version"] == importlib.metadata.version("lit-grpo-test-plugin")
    assert entries["contains_word"]["kind"] == "class"
    assert entries["contains_word"]["object"] == "lit_grpo_test_plugin:ContainsWord"


def test_init_tiny_writes_a_loadable_model(tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = tmp_path / "tiny"
    main(["init-tiny", str(target), "--hidden-size", "32", "--num-layers", "1", "--num-heads", "2"])
    assert str(target) in capsys.readouterr().out
    tokenizer = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target)
    assert model.config.hidden_size == 32 and model.config.num_hidden_layers == 1
    assert model.config.vocab_size == len(tokenizer)
    ids = tokenizer("Say a:", add_special_tokens=False)["input_ids"]
    assert len(ids) == 6 and tokenizer.decode(ids) == "Say a:"  # one token per character
    assert tokenizer.padding_side == "left" and tokenizer.pad_token is not None
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, 6, len(tokenizer))


# --------------------------------------------------------------------------------------------------
# Values reach rewards as written; where a run without a logger of its own logs
# --------------------------------------------------------------------------------------------------

# strings that YAML would read as something else if parsed a second time
AS_WRITTEN = {
    "answer_pattern": "####\\s*(.+)$",  # a '#' starts a YAML comment: None
    "number": "123",  # an int
    "flag": "yes",  # True
    "brackets": "[ab]",  # a list
}


@pytest.fixture
def recorded_reward_args(reward_plugin):
    """``recorded_reward_args(args) -> dict``: the keyword arguments the reward ``record`` receives
    in a run configured by ``args``."""
    seen = {}

    def record(completions, **kwargs):
        seen.update({key: kwargs[key] for key in AS_WRITTEN})
        return [0.0] * len(completions)

    reward_plugin(record=record)

    def run(args: list[str]) -> dict:
        seen.clear()
        cli = instantiate(args)
        cli.model.scorer(["p"], ["c"], [[1]], {})
        cli.model.scorer.close()
        return dict(seen)

    return run


def test_reward_args_from_yaml_reach_the_reward_as_written(recorded_reward_args, tiny_model_dir, tmp_path, in_repo):
    config = yaml.safe_load(QUICKSTART.read_text())
    config["model"]["rewards"] = [{"name": "record", "args": AS_WRITTEN}]
    config["trainer"]["logger"] = False
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))  # quotes each of those strings
    assert "'123'" in (tmp_path / "config.yaml").read_text()
    seen = recorded_reward_args(["--config", str(tmp_path / "config.yaml"), "--model.model_name_or_path", str(tiny_model_dir)])
    assert seen == AS_WRITTEN


def test_reward_args_on_the_command_line_reach_the_reward_as_written(recorded_reward_args, tiny_model_dir, in_repo):
    args = ["--config", str(QUICKSTART), "--trainer.logger", "false", "--model.model_name_or_path", str(tiny_model_dir)]
    as_json = json.dumps([{"name": "record", "args": AS_WRITTEN}])
    assert recorded_reward_args([*args, "--model.rewards", as_json]) == AS_WRITTEN
    # the same in YAML flow style, as people type it in a shell
    flow = '[{name: record, args: {answer_pattern: "####\\\\s*(.+)$", number: "123", flag: "yes", brackets: "[ab]"}}]'
    assert recorded_reward_args([*args, "--model.rewards", flow]) == AS_WRITTEN


def test_saved_config_keeps_reward_args_as_written(capsys, in_repo):
    rewards = json.dumps([{"name": "exact_match", "args": {"answer_pattern": AS_WRITTEN["answer_pattern"], "other": "123"}}])
    config = print_config(capsys, "--config", str(QUICKSTART), "--model.rewards", rewards)
    assert config["model"]["rewards"][0]["args"] == {"answer_pattern": "####\\s*(.+)$", "other": "123"}


def test_default_logger_and_checkpoints_go_under_default_root_dir(tmp_path, tiny_model_dir, in_repo):
    base = ["--config", str(quickstart_config(tmp_path)), "--model.model_name_or_path", str(tiny_model_dir)]
    base += ["--trainer.logger", "null"]  # the quickstart names its own logger: a run without one

    cli = instantiate([*base, "--trainer.default_root_dir", str(tmp_path / "root")])
    logger = cli.trainer.logger
    assert type(logger).__name__ == "TensorBoardLogger"
    assert Path(logger.save_dir) == tmp_path / "root" and logger.name == "lit-grpo"
    checkpoint = next(c for c in cli.trainer.callbacks if type(c).__name__ == "ModelCheckpoint")
    assert checkpoint.dirpath is None  # Lightning's: <the logger's version directory>/checkpoints

    # neither a logger nor default_root_dir: runs/
    cli = instantiate(base)
    assert Path(cli.trainer.logger.save_dir) == Path("runs")


def test_init_tiny_qwen2_in_bf16(tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2ForCausalLM

    target = tmp_path / "tiny-qwen2"
    main(["init-tiny", str(target), "--architecture", "qwen2", "--dtype", "bfloat16"])
    model = AutoModelForCausalLM.from_pretrained(target)
    assert isinstance(model, Qwen2ForCausalLM) and model.dtype == torch.bfloat16
    tokenizer = AutoTokenizer.from_pretrained(target)
    assert model.generation_config.eos_token_id == [tokenizer.eos_token_id, tokenizer.pad_token_id]
