"""Coming from TRL: the table of docs/configuration.md, row by row. Each TRL name, written where a
TRL user writes it, gets the message its row promises, and each lit-grpo key a row names exists.
With the table after it, "Every field of TRL 1.16's GRPOConfig", every field of TRL 1.16's
``GRPOConfig`` has one row (``tests/fixtures/trl_1_16_grpo_config_fields.txt``, TRL 1.16.0 with transformers
5.24.0; the installed TRL's fields are checked against it where those two are installed, and have a row each
where other releases are)."""

from __future__ import annotations

import dataclasses
import inspect
import re
import shlex
from pathlib import Path

import pytest
import torch
import yaml

from lit_grpo.cli.trl_names import TRL_NAMES
from test_errors import error_line

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("fresh_cli")  # tests/conftest.py

# The names a TRL user sets most (issue 38): each must have a row.
MOST_SET = """learning_rate per_device_train_batch_size gradient_accumulation_steps num_train_epochs max_steps
logging_steps save_steps output_dir bf16 gradient_checkpointing max_prompt_length max_completion_length
num_generations beta epsilon loss_type use_vllm vllm_mode temperature top_p reward_funcs reward_weights
report_to seed warmup_ratio lr_scheduler_type max_grad_norm num_iterations scale_rewards
mask_truncated_completions log_completions""".split()

# Roots of lit-grpo's keys; a backticked word of a row starting with one of them is a key.
ROOTS = ("model", "data", "trainer", "optimizer", "lr_scheduler", "seed_everything")


def table_rows(heading: str = "## Coming from TRL") -> dict[str, str]:
    """TRL name -> the lit-grpo cell, as the table under ``heading`` writes them."""
    section = (REPO / "docs" / "configuration.md").read_text().split(heading, 1)[1].split("\n## ", 1)[0]
    rows = [line.split(" | ", 1) for line in section.splitlines() if line.startswith("| `")]
    return {name.removeprefix("| `").removesuffix("`"): cell.removesuffix(" |") for name, cell in rows}


ROWS = table_rows()
EVERY_FIELD_ROWS = table_rows("## Every field of TRL 1.16's GRPOConfig")  # the fields ROWS does not answer
TRL_1_16_FIELDS = [line for line in (REPO / "tests/fixtures/trl_1_16_grpo_config_fields.txt").read_text().splitlines()
                   if line and not line.startswith("#")]  # dataclasses.fields(trl.GRPOConfig), TRL 1.16.0


def model_keys() -> set[str]:
    from lit_grpo.train.module import GRPOModule

    return set(inspect.signature(GRPOModule).parameters)


MODEL_KEYS = model_keys()


def test_the_table_has_every_name_trl_users_set_most_and_no_other_than_the_code():
    assert [name for name in MOST_SET if name not in ROWS] == []
    assert list(ROWS) == list(TRL_NAMES)


@pytest.fixture(scope="module")
def base_config(tmp_path_factory, tiny_model_dir):
    """The quickstart with the tiny model."""
    config = yaml.safe_load((REPO / "configs/quickstart.yaml").read_text())
    config["model"]["model_name_or_path"] = str(tiny_model_dir)
    config["data"]["data_files"] = str(REPO / config["data"]["data_files"])
    config["trainer"].update(max_steps=1, logger=False, enable_checkpointing=False)
    path = tmp_path_factory.mktemp("trl") / "base.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


@pytest.mark.parametrize("name", list(ROWS))
def test_a_trl_name_gets_the_message_of_its_row(name, base_config, tmp_path, capsys):
    promised = f"TRL's {name} is {ROWS[name].replace('`', '')}"
    flat = tmp_path / "trl.yaml"  # a TRL config is flat
    flat.write_text(f"seed_everything: 0\n{name}: 1\n")
    assert error_line(capsys, "fit", "--config", str(base_config), "--config", str(flat)) == (
        f"unknown key {name}; {promised} ({flat}:2)"
    )
    if name not in MODEL_KEYS:  # a TRL setting that is no model key keeps its answer under model:
        nested = tmp_path / "nested.yaml"
        nested.write_text(f"model:\n  {name}: 1\n")
        assert error_line(capsys, "fit", "--config", str(base_config), "--config", str(nested)) == (
            f"unknown key model.{name}; {promised} ({nested}:2)"
        )


@pytest.mark.parametrize("name", ["learning_rate", "per_device_train_batch_size", "bf16"])
def test_a_trl_name_on_the_command_line_gets_the_same_answer(name, base_config, capsys):
    promised = f"TRL's {name} is {ROWS[name].replace('`', '')}"
    assert error_line(capsys, "fit", "--config", str(base_config), f"--{name}", "1") == (
        f"unknown option --{name}; {promised} (command line; options are never abbreviated)"
    )


def test_a_trl_name_inside_the_optimizer_block_is_answered_too(base_config, tmp_path, capsys):
    optimizer = tmp_path / "optimizer.yaml"
    optimizer.write_text("optimizer:\n  class_path: torch.optim.AdamW\n  init_args:\n    learning_rate: 1.0e-6\n")
    assert error_line(capsys, "fit", "--config", str(base_config), "--config", str(optimizer)) == (
        f"unknown key optimizer.init_args.learning_rate; TRL's learning_rate is {ROWS['learning_rate'].replace('`', '')} "
        f"({optimizer}:4)"
    )


def test_the_two_tables_have_one_row_for_each_field_of_trl_1_16s_grpo_config():
    assert len(TRL_1_16_FIELDS) == len(set(TRL_1_16_FIELDS)) == 191
    # the second table: exactly the fields the first does not answer, in GRPOConfig's order
    assert list(EVERY_FIELD_ROWS) == [name for name in TRL_1_16_FIELDS if name not in ROWS]
    # the first answers TRL names that are no 1.16 field too (earlier releases', GRPOTrainer's argument)
    assert [name for name in ROWS if name not in TRL_1_16_FIELDS] == ["warmup_ratio", "reward_funcs", "max_prompt_length"]
    # every model key named as TRL names it is in the first table, so its one-line error answers it
    assert [name for name in TRL_1_16_FIELDS if name in MODEL_KEYS and name not in ROWS] == []
    assert all(cell.strip() for cell in EVERY_FIELD_ROWS.values())


def test_the_installed_trls_grpo_config_has_no_field_without_a_row():
    trl = pytest.importorskip("trl")
    import transformers  # GRPOConfig's fields include TrainingArguments' (the fixture's: transformers 5.24.0)

    fields = [field.name for field in dataclasses.fields(trl.GRPOConfig)]
    if trl.__version__.startswith("1.16.") and transformers.__version__.startswith("5.24."):
        assert fields == TRL_1_16_FIELDS
    else:  # another release of either: a field it adds needs a row (and, once it is checked, a fixture of its own)
        assert [name for name in fields if name not in ROWS and name not in EVERY_FIELD_ROWS] == []


def named_keys() -> list[str]:
    """Every lit-grpo key the two tables name, as written (``trainer.precision: bf16-mixed`` with its value)."""
    cells = [*ROWS.values(), *EVERY_FIELD_ROWS.values()]
    words = {word for cell in cells for word in re.findall(r"`([^`]+)`", cell)}
    return sorted(word for word in words if re.match(rf"({'|'.join(ROOTS)})\b(\.\w+)*(: \S+)?$", word))


def test_the_table_names_lit_grpo_keys():
    assert {"optimizer.init_args.lr", "data.batch_size", "trainer.precision: bf16-mixed", "seed_everything"} <= set(named_keys())


@pytest.fixture(scope="module")
def parser(base_config):
    """The parser of ``lit-grpo fit``'s configuration."""
    import sys

    from lit_grpo.cli import run_cli

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "argv", ["lit-grpo"])
        return run_cli(["--config", str(base_config)], run=False).parser


@pytest.mark.parametrize("key", named_keys())
def test_each_lit_grpo_key_of_the_table_exists(key, parser, base_config):
    key, _, value = key.partition(": ")
    if key.startswith("optimizer.init_args."):  # an argument of the optimizer, AdamW when none is given
        assert key.removeprefix("optimizer.init_args.") in inspect.signature(torch.optim.AdamW).parameters
        return
    assert key in {action.dest for action in parser._actions}
    if value:  # the value the row gives parses
        parsed = parser.parse_args(["--config", str(base_config), f"--{key}", *shlex.split(value)])
        assert str(parsed[key]) == value
