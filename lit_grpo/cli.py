"""The ``lit-grpo`` command.

- ``lit-grpo fit|validate --config FILE [--key value ...]``: LightningCLI over :class:`GRPOModule`
  and :class:`GRPODataModule` (``--print_config`` shows the full resolved configuration).
- ``lit-grpo rewards [--json]``: every installed reward with its package and version.
- ``lit-grpo environments [--json]``: every installed environment, likewise, and the data sets and rewards
  of the plugin packages that bring them.
- ``lit-grpo init-tiny DIR``: a tiny random Llama model and character tokenizer for offline runs.
- ``lit-grpo export CKPT DIR [--no-merge-lora] [--overwrite]``: a checkpoint's policy as a Hugging Face
  ``save_pretrained`` directory (LoRA merged, or as a peft adapter), with its tokenizer; given a peft
  adapter directory, the adapter merged into its base model.
- ``lit-grpo completions RUN_DIR [--step N]``: the completions a run logged at a step, as a table.
- ``lit-grpo prompts --config FILE [-n N]``: the first prompts exactly as the model sees them.
- ``lit-grpo serve MODEL [...]``: a vLLM server for ``model.generation_backend: vllm_server``.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib
import inspect
import json
import os
import re
import shlex
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from jsonargparse import Namespace
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.cli import LightningCLI, LRSchedulerTypeTuple, SaveConfigCallback

from lit_grpo import plugins
from lit_grpo.checkpointing import (
    check_local_checkpoint,
    configure_checkpointing,
    is_class_config,
    load_checkpoint_file,
)
from lit_grpo.config_files import COMMAND_LINE, config_files, find_duplicate_key, find_key, find_syntax_error, value_origin
from lit_grpo.errors import ConfigError, UserError
from lit_grpo.plugins import RewardInfo
from lit_grpo.preemption import StoppedBySignal
from lit_grpo.redaction import REDACTED, is_secret_name, redact_secrets, restore_redacted
from lit_grpo.runs import place_run, resume_config_name
from lit_grpo.trl_names import trl_hint

# Where a run without a logger of its own logs: ``<trainer.default_root_dir or runs>/lit-grpo/version_N``.
DEFAULT_LOG_ROOT = "runs"
DEFAULT_LOGGER_NAME = "lit-grpo"


def default_logger(default_root_dir: str | None) -> Namespace:
    """The TensorBoard logger of a run that names none: under ``trainer.default_root_dir`` when it
    is set, as Lightning's own default logger is, else under ``runs/``."""
    save_dir = str(default_root_dir) if default_root_dir else DEFAULT_LOG_ROOT
    return Namespace(
        class_path="lightning.pytorch.loggers.TensorBoardLogger",
        init_args=Namespace(save_dir=save_dir, name=DEFAULT_LOGGER_NAME),
    )


def redacted_config(value: Any, secret: bool = False) -> Any:
    """A copy of a parsed configuration (jsonargparse ``Namespace``s, lists, dicts, values) with its secrets
    redacted (:func:`lit_grpo.redaction.redact_secrets`; ``secret``: ``value`` is under a secret name)."""
    if isinstance(value, Namespace):
        copy = value.clone()
        for name, item in vars(value).items():
            setattr(copy, name, redacted_config(item, secret or is_secret_name(name)))
        return copy
    if isinstance(value, list):
        return [redacted_config(item, secret) for item in value]
    return redact_secrets(value, secret)


class SaveRedactedConfig(SaveConfigCallback):
    """Lightning's ``SaveConfigCallback`` (the run's ``config.yaml``), writing the configuration with its
    secrets redacted (:mod:`lit_grpo.redaction`); the run itself keeps the real values."""

    def __init__(self, parser, config: Namespace, *args, **kwargs) -> None:
        super().__init__(parser, redacted_config(config), *args, **kwargs)


class GRPOCLI(LightningCLI):
    """LightningCLI with two adaptations for GRPO.

    The ``optimizer:`` and ``lr_scheduler:`` blocks are linked to the module's lazy factories.

    ``trainer.gradient_clip_val``: Lightning refuses it under manual optimization, which GRPO needs (one batch
    drives several optimizer steps), so the usual Trainer setting is handed to the module, which
    clips before every optimizer step (``model.max_grad_norm``).

    One directory per run, and exact resume (``--ckpt_path last``): every file of a run goes to its run
    directory, which a resumed run continues in (``lit_grpo.runs.place_run``); ``fit`` checkpoints there,
    writes atomically and keeps the random and data state (``lit_grpo.checkpointing.configure_checkpointing``
    and the ``RNGStateCheckpoint`` callback that ``GRPOModule.configure_callbacks`` always adds).
    Lightning's ``ModelParallelStrategy`` runs as ``lit_grpo.distributed.ModelParallelStrategy``,
    whose sharded checkpoints are replaced atomically too.

    What a run writes holds no secret (:mod:`lit_grpo.redaction`): ``config.yaml`` is saved redacted
    (:class:`SaveRedactedConfig`), as are the module's hyperparameters in checkpoints and logs. A checkpoint
    is read from a local file with ``weights_only=True`` only (:func:`lit_grpo.checkpointing.load_checkpoint_file`).
    """

    def __init__(self, *args, parser_kwargs: dict | None = None, **kwargs) -> None:
        # parse errors raise (main prints them in one line) and an abbreviated option is refused
        # (``--model.max_compl 4`` would silently set max_completion_length)
        strict = {"exit_on_error": False, "allow_abbrev": False}
        parser_kwargs = {**strict, "fit": strict, "validate": strict, **(parser_kwargs or {})}
        super().__init__(*args, parser_kwargs=parser_kwargs, **kwargs)

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """``fit`` and ``validate``: GRPO has nothing to ``test`` or ``predict``."""
        return {name: skip for name, skip in LightningCLI.subcommands().items() if name in ("fit", "validate")}

    def parse_arguments(self, parser, args) -> None:
        self.command_line = list(sys.argv[1:] if args is None else args)  # where each value was given
        duplicate = find_duplicate_key(config_files(self.command_line))
        if duplicate:
            raise ConfigError(duplicate)
        try:
            super().parse_arguments(parser, args)
        except argparse.ArgumentError as error:
            raise ConfigError(explain_parse_error(str(error), parser, args)) from error

    def _parse_ckpt_path(self) -> None:
        """Lightning's: a checkpoint file's hyperparameters over the parsed ``model:`` configuration; except
        that the file is read as every checkpoint is (local, ``weights_only``: one line for any other) and
        that a value redacted when it was written (a secret) is the one the configuration gives now."""
        subcommand = self.config.get("subcommand")
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if ckpt_path is None:
            return
        check_local_checkpoint(ckpt_path)
        if not Path(ckpt_path).is_file():  # "last", or a sharded checkpoint's directory: as Lightning
            return
        hparams = load_checkpoint_file(ckpt_path).get("hyper_parameters", {})
        hparams.pop("_instantiator", None)
        if not hparams:
            return
        given = self.config[subcommand].model.as_dict()
        try:
            hparams = restore_redacted(hparams, given)
        except LookupError as missing:
            raise ConfigError(
                f"--ckpt_path {ckpt_path}: the checkpoint's model.{missing} was written {REDACTED} (a secret is never "
                "written); give it in the configuration, as when the run started"
            ) from None
        if "_class_path" in hparams:
            hparams = {"class_path": hparams.pop("_class_path"), "dict_kwargs": hparams}
        self.config = self.parser.parse_object({subcommand: {"model": hparams}}, self.config)

    def add_arguments_to_parser(self, parser) -> None:
        # The top-level optimizer:/lr_scheduler: blocks are handed to the module as factories, so
        # the optimizer is created in configure_optimizers, after the policy has been loaded.
        parser.add_optimizer_args((torch.optim.Optimizer,), link_to="model.optimizer")
        parser.add_lr_scheduler_args(LRSchedulerTypeTuple, link_to="model.lr_scheduler")
        # the data describes how its prompts are rendered; the module renders them
        parser.link_arguments("data.chat_template_kwargs", "model.chat_template_kwargs")

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        if config.trainer.get("logger") in (None, True):  # no logger given: ours, not Lightning's
            config.trainer.logger = default_logger(config.trainer.get("default_root_dir"))
        config_dirs = [Path(str(path.absolute)).parent for path in config.get("config") or []]
        for key in ("rewards", "eval_rewards"):
            for spec in config.model.get(key) or []:
                if isinstance(spec, Namespace | dict):
                    spec["name"] = reward_file_beside_config(spec["name"], config_dirs)
        if config.model.get("tools"):  # tools are named like rewards
            config.model.tools = [reward_file_beside_config(tool, config_dirs) for tool in config.model.tools]
        check_optimizer_arguments(config.get("optimizer"), getattr(self, "command_line", []))
        if self.subcommand in (None, "fit"):
            configure_checkpointing(config.trainer)
            use_step_progress_bar(config.trainer)
        load_weights_only(config)
        resumed_run = place_run(config, self.subcommand)  # the run's directory; --ckpt_path last
        if resumed_run is not None:  # config.yaml keeps how the run started
            self.save_config_kwargs["config_filename"] = resume_config_name(resumed_run)
        use_atomic_model_parallel_checkpoints(config.trainer)
        clip_value = config.trainer.get("gradient_clip_val")
        if clip_value is None:
            return
        algorithm = config.trainer.get("gradient_clip_algorithm") or "norm"
        if algorithm != "norm":
            raise ConfigError(
                f"trainer.gradient_clip_algorithm={algorithm!r} is not supported; GRPO clips the gradient norm "
                "(use gradient_clip_algorithm: norm or model.max_grad_norm)"
            )
        config.model.max_grad_norm = float(clip_value)
        config.trainer.gradient_clip_val = None
        config.trainer.gradient_clip_algorithm = None


def load_weights_only(config) -> None:
    """``weights_only: true`` for the checkpoint a ``fit``/``validate`` resumes from (Lightning's default, None,
    follows ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD``): tensors and plain values, as lit-grpo writes them, and
    no code run by loading; ``false`` is refused."""
    if "weights_only" not in config:
        return
    if config.weights_only is False:
        raise ConfigError("--weights_only false would let a checkpoint run code as it loads; lit-grpo's checkpoints "
                          "load with weights_only: true (leave it unset)")
    config.weights_only = True


def check_optimizer_arguments(optimizer, words: list[str]) -> None:
    """The ``optimizer:`` block's ``init_args`` given to its class with a stand-in parameter, before any
    model loads: a value the optimizer refuses (torch's ``Invalid learning rate: -0.003``) is a
    :class:`ConfigError` naming the key and where it was given (``file:line`` or the command line)."""
    class_path = getattr(optimizer, "class_path", None)
    if class_path is None:  # no optimizer: block (the module's AdamW at 1e-6)
        return
    module_name, _, name = class_path.rpartition(".")
    init_args = dict(optimizer.get("init_args") or {})
    try:  # a matrix: some optimizers (Muon) take only those
        getattr(importlib.import_module(module_name), name)([torch.zeros(2, 2, requires_grad=True)], **init_args)
    except ValueError as error:  # the argument it names by its value, else the run's own parameters will tell
        values = {k: v if isinstance(v, list | tuple) else [v] for k, v in init_args.items()}
        key = next((k for k, v in values.items() if any(_named_in(item, str(error)) for item in v)), None)
        if key is None:
            return
        origin = value_origin(words, f"optimizer.init_args.{key}") or "a config file"
        raise ConfigError(f"optimizer.init_args.{key} = {init_args[key]} ({origin}): {class_path} refuses it: {error}"
                          + ("; a learning rate is a number >= 0, such as 3e-3" if key == "lr" else "")) from None


def _named_in(value: Any, message: str) -> bool:
    """Whether a number ``value`` is written in ``message`` (``-0.003`` in "Invalid learning rate: -0.003")."""
    return isinstance(value, int | float) and not isinstance(value, bool) and re.search(rf"(?<![\w.-]){re.escape(str(value))}(?![\w.])", message) is not None


def reward_file_beside_config(name: str, config_dirs: list[Path]) -> str:
    """A reward named ``relative/file.py:function`` whose file is not in the working directory but
    beside a config file: that file, by its absolute path (so the saved config still finds it)."""
    where, colon, function = name.rpartition(":")
    if not colon or not where.endswith(".py") or Path(where).is_absolute() or Path(where).exists():
        return name
    for directory in config_dirs:
        if (directory / where).is_file():
            return f"{directory / where}:{function}"
    return name


def use_step_progress_bar(trainer_config) -> None:
    """Show :class:`lit_grpo.callbacks.StepProgressBar` (optimizer steps out of ``max_steps``, the
    reward) unless the progress bar is off or the config names one of its own."""
    callbacks = list(trainer_config.get("callbacks") or [])
    if trainer_config.get("enable_progress_bar") is False or any(is_class_config(c, ProgressBar) for c in callbacks):
        return
    trainer_config.callbacks = [*callbacks, Namespace(class_path="lit_grpo.callbacks.StepProgressBar")]


def explain_parse_error(message: str, parser, args: list[str] | None) -> str:
    """A parse error as one line that names the key and where it is (``file:line``), and for an
    unknown key what was meant: TRL's name for a lit-grpo setting (:mod:`lit_grpo.trl_names`),
    else the closest real key."""
    words = list(args or sys.argv[1:])
    files = config_files(words)
    negative = negative_value_read_as_option(words)
    if negative:
        return negative
    subcommand = next((word for word in words if word in ("fit", "validate")), None)
    action = getattr(parser, "_subcommands_action", None)
    keys_parser = action._name_parser_map.get(subcommand, parser) if action is not None and subcommand else parser
    keys = [a.dest for a in keys_parser._actions if not a.dest.endswith(".help") and "." in a.dest]
    if '"<unicode string>"' in message:  # jsonargparse read a text that is not YAML
        return find_syntax_error(files) or " ".join(message.replace('"<unicode string>"', "the command line").split())
    unknown = re.match(r"(?:Subcommand '\w+' does not accept option|Option) '([^']+)'", message)  # in a config file
    if unknown:
        key = unknown.group(1)
        found = find_key(files, key)
        return f"unknown key {key}{what_was_meant(key, keys)} ({found.where if found else 'a config file'})"
    unknown = re.match(r"unrecognized arguments: (--\S+)", message)  # an option on the command line
    if unknown:
        key = unknown.group(1).removeprefix("--").split("=", 1)[0]
        meant = what_was_meant(key, keys, prefix="--")
        return f"unknown option --{key}{meant} (command line; options are never abbreviated)"
    keyed = re.match(r'Parser key "([^"]+)":\s*(.*)', message, re.DOTALL)
    if keyed:
        return explain_entry_error(keyed.group(1), keyed.group(2), files, words)
    return " ".join(message.split())


def negative_value_read_as_option(words: list[str]) -> str | None:
    """``--key -3e-3``: argparse reads a negative number it does not take for one (``-3e-3``, unlike
    ``-3`` or ``-0.003``) as an option; the line that says to write ``--key=-3e-3``."""
    for option, value in zip(words, words[1:]):
        if not option.startswith("--") or "=" in option or not value.startswith("-") or re.fullmatch(r"-\d+|-\d*\.\d+", value):
            continue
        try:
            float(value)
        except ValueError:
            continue
        return (f"{option} {value}: the value {value} reads as an option; write {option}={value} "
                "(command line; a negative number needs the =)")
    return None


def explain_entry_error(key: str, problem: str, files: list[str], words: list[str] = ()) -> str:
    """jsonargparse's ``problem`` with the value of ``key``; for an entry of a class or dataclass
    (a ``model.rewards`` entry, an ``optimizer``'s ``init_args``), the key inside it at fault and
    where its value was given (``file:line``, or the command line ``words``)."""
    unknown = re.search(r"class_path '([\w.]+)':\s*Option '(\w+)' is not accepted", problem)
    if unknown:
        class_path, name = unknown.groups()
        found = find_key(files, key, inside=name)
        full_key, where = (found.key, found.where) if found else (f"{name} in {key}", "command line")
        return f"unknown key {full_key}{what_was_meant(name, parameter_names(class_path))} ({where})"
    invalid = re.search(r"class_path '[\w.]+':\s*Parser key \"(\w+)\":\s*(.+?)(?:\n\s*- |\Z)", problem, re.DOTALL)
    if invalid:
        name, detail = invalid.groups()
        tried = problem[invalid.start(2):].split("Given value:", 1)  # a Union's types, each tried
        if "Union subtypes" in tried[0] and len(tried) > 1 and re.findall(r"Expected a <class '(\w+)'>", tried[0]):
            types = " or ".join(dict.fromkeys(re.findall(r"Expected a <class '(\w+)'>", tried[0])))
            detail = f"expected a {types}, got {tried[1].splitlines()[0].strip()!r}"
        if value_origin(list(words), f"{key}.init_args.{name}") == COMMAND_LINE:
            return f"{detail} ({key}.init_args.{name}, {COMMAND_LINE})"
        value = re.search(r"Got value: (.+)", detail)
        found = find_key(files, key, inside=name, value=value.group(1).strip() if value else None)
        found = found or find_key(files, key, inside=name)
        if found:
            return f"{' '.join(detail.split())} ({found.key}, {found.where})"
    return f"{' '.join(problem.split())} ({key})"


def what_was_meant(key: str, keys: list[str], prefix: str = "") -> str:
    """``"; TRL's X is Y"`` for one of TRL's names, else ``"; did you mean X?"`` (:func:`closest`)."""
    hint = trl_hint(key)
    return f"; {hint}" if hint else closest(key, keys, prefix)


def closest(key: str, keys: list[str], prefix: str = "") -> str:
    """``"; did you mean X?"`` for the real key ``key`` abbreviates or is closest to (same section
    first), else ``""``."""
    section = key.rsplit(".", 1)[0] + "." if "." in key else ""
    candidates = [k for k in keys if k.startswith(section)] or keys
    abbreviated = [k for k in candidates if k.startswith(key)]
    match = abbreviated[:1] if len(abbreviated) == 1 else difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    return f"; did you mean {prefix}{match[0]}?" if match else ""


def parameter_names(class_path: str) -> list[str]:
    """The keys an entry of ``class_path`` takes: a dataclass's fields, else its constructor's
    parameters (``[]`` when it cannot be imported)."""
    module_name, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError):
        return []
    if dataclasses.is_dataclass(cls):
        return [field.name for field in dataclasses.fields(cls)]
    parameters = inspect.signature(cls).parameters.values()
    return [p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


LIGHTNING_MODEL_PARALLEL = {
    "lightning.pytorch.strategies.ModelParallelStrategy",
    "lightning.pytorch.strategies.model_parallel.ModelParallelStrategy",
}


def use_atomic_model_parallel_checkpoints(trainer_config) -> None:
    """Run Lightning's ``ModelParallelStrategy`` as :class:`lit_grpo.distributed.ModelParallelStrategy`,
    the same strategy whose sharded checkpoints replace the previous ones atomically."""
    strategy = trainer_config.get("strategy")
    if getattr(strategy, "class_path", None) in LIGHTNING_MODEL_PARALLEL:
        strategy.class_path = "lit_grpo.distributed.ModelParallelStrategy"


def run_cli(args: list[str] | None = None, run: bool = True) -> GRPOCLI:
    """``lit-grpo fit|validate ...`` as the command runs it; ``run=False`` only builds the trainer,
    module and data module from ``args`` (a subcommand is then not given)."""
    from lit_grpo.data import GRPODataModule
    from lit_grpo.module import GRPOModule

    return GRPOCLI(GRPOModule, GRPODataModule, save_config_callback=SaveRedactedConfig,
                   save_config_kwargs={"overwrite": True}, args=args, run=run)


class CommandParser(argparse.ArgumentParser):
    """The parser of a ``lit-grpo`` command other than fit/validate: a usage mistake is a
    :class:`~lit_grpo.errors.ConfigError` that :func:`main` prints in one line, not a usage dump."""

    def error(self, message: str):
        raise ConfigError(f"{message} ({self.prog}; `{self.prog} --help` describes it)")


def init_tiny_main(argv: list[str]) -> None:
    from lit_grpo.tiny import ARCHITECTURES, build_tiny_model

    parser = CommandParser(
        prog="lit-grpo init-tiny",
        description="Write a tiny random-weight Llama model and a character-level tokenizer to DIR "
        "(loadable with AutoModelForCausalLM/AutoTokenizer.from_pretrained), for offline runs and tests.",
    )
    parser.add_argument("dir", help="output directory")
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--intermediate-size", type=int, default=256)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--architecture", choices=ARCHITECTURES, default="llama",
        help="llama (default), or qwen2: Qwen2.5-Instruct's model class, special tokens, chat template and EOS ids",
    )
    parser.add_argument("--dtype", default=None, help="dtype to save the weights in, e.g. bfloat16 (default float32)")
    options = parser.parse_args(argv)
    path = build_tiny_model(
        options.dir,
        architecture=options.architecture,
        dtype=options.dtype,
        hidden_size=options.hidden_size,
        intermediate_size=options.intermediate_size,
        num_hidden_layers=options.num_layers,
        num_attention_heads=options.num_heads,
        seed=options.seed,
    )
    print(f"Wrote a tiny {options.architecture} model and character tokenizer to {path}")


def _as_list(infos: Mapping[str, RewardInfo] | Iterable[RewardInfo]) -> list[RewardInfo]:
    return list(infos.values()) if isinstance(infos, Mapping) else list(infos)


def format_rewards_table(infos: Mapping[str, RewardInfo] | Iterable[RewardInfo], what: str = "rewards") -> str:
    """An aligned plain-text table with columns NAME, PACKAGE, VERSION, DESCRIPTION."""
    rows = [(i.name, i.package, i.version, i.doc) for i in _as_list(infos)]
    if not rows:
        if what == "environments":
            return ("No environments installed. Environments come from plugin packages' register_environments hook: "
                    "install one (e.g. `pip install -e examples/environment-plugin` from a lit-grpo checkout).")
        return "No rewards installed. " + plugins.INSTALL_HINT
    header = ("NAME", "PACKAGE", "VERSION", "DESCRIPTION")
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(3)]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row[:3], widths)) + "  " + row[3]
        for row in [header, *rows]
    ]
    return "\n".join(line.rstrip() for line in lines)


def rewards_as_json(infos: Mapping[str, RewardInfo] | Iterable[RewardInfo]) -> str:
    """A JSON list of ``{name, package, version, description, kind, object}``."""
    return json.dumps(
        [
            {
                "name": i.name,
                "package": i.package,
                "version": i.version,
                "description": i.doc,
                "kind": i.kind,
                "object": i.source,
            }
            for i in _as_list(infos)
        ],
        indent=2,
    )


def rewards_main(argv: list[str]) -> None:
    parser = CommandParser(prog="lit-grpo rewards", description="List the installed reward functions.")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    options = parser.parse_args(argv)
    infos = list(plugins.get_rewards().values())
    print(rewards_as_json(infos) if options.json else format_rewards_table(infos))


def environments_main(argv: list[str]) -> None:
    parser = CommandParser(prog="lit-grpo environments",
                           description="List the installed environments (multi-turn tool use: model.environment), "
                           "the data sets plugins make (data.path) and the rewards of those plugins (model.rewards).")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    options = parser.parse_args(argv)
    infos = list(plugins.get_environments().values())
    datasets = list(plugins.get_datasets().values())
    # the rewards of those packages, so that each package's line-up shows whole (lit-grpo rewards lists all)
    packages = {info.package for info in infos + datasets}
    rewards = [info for info in plugins.get_rewards().values() if info.package in packages]
    if options.json:
        listed = [{**entry, "provides": "environment"} for entry in json.loads(rewards_as_json(infos))]
        listed += [{**entry, "provides": "data set"} for entry in json.loads(rewards_as_json(datasets))]
        listed += [{**entry, "provides": "reward"} for entry in json.loads(rewards_as_json(rewards))]
        print(json.dumps(listed, indent=2))
        return
    print(format_rewards_table(infos, "environments"))
    if datasets:  # what a plugin brings beside its environments: prompts to train on
        print("\nData sets (data.path: NAME, data.args: its arguments):")
        print(format_rewards_table(datasets))
    if rewards:
        print("\nRewards of these packages (model.rewards; all installed rewards: lit-grpo rewards):")
        print(format_rewards_table(rewards))


class PromptsCLI(GRPOCLI):
    """The ``fit`` configuration parsed as ``lit-grpo fit`` parses it; only the data module and the
    tokenizer are built (no model weights are loaded)."""

    def instantiate_classes(self) -> None:
        from lit_grpo.agent import ToolUse
        from lit_grpo.data import GRPODataModule
        from lit_grpo.models import load_tokenizer

        self.datamodule = GRPODataModule(**self.config.data.as_dict())
        self.tool_use = ToolUse.from_settings(self.config.model.as_dict())  # a misspelt tool fails here
        self.tokenizer = load_tokenizer(self.config.model.model_name_or_path)
        self.max_prompt_length = self.config.model.max_prompt_length


def prompts_main(argv: list[str]) -> None:
    parser = CommandParser(
        prog="lit-grpo prompts",
        description="Print the first prompts of a run's data exactly as the model sees them: the prompt "
        "template, system prompt, the tools' schemas (model.tools, model.environment) and chat template applied, "
        "special tokens included, cut to "
        "model.max_prompt_length. Takes the same --config files and --key value overrides as `lit-grpo fit`; "
        "loads the tokenizer and the data, not the model.",
    )
    parser.add_argument("-n", "--num", type=int, default=3, help="how many prompts (default 3)")
    parser.add_argument("--split", choices=["train", "val"], default="train", help="data.split or data.val_split")
    options, config_args = parser.parse_known_args(argv)
    if not config_args:
        parser.error("give the run's configuration: --config FILE [--key value ...]")
    from lit_grpo.data import GRPODataModule
    from lit_grpo.generation import render_prompts, tokenize_prompts
    from lit_grpo.module import GRPOModule

    cli = PromptsCLI(GRPOModule, GRPODataModule, save_config_callback=None, run=False, args=config_args)
    data = cli.datamodule
    data.setup("fit" if options.split == "train" else "validate")
    dataset = data.train_dataset if options.split == "train" else data.val_dataset
    if dataset is None:
        parser.error("--split val needs data.val_split")
    for index in range(min(options.num, dataset.num_rows)):
        prompt = data.prompt_format(dataset[index])
        if cli.tool_use is not None:  # the tools' schemas are part of what the model sees
            text = cli.tool_use.render_prompt(prompt, dataset[index], cli.tokenizer, data.chat_template_kwargs)
        else:
            text = render_prompts(cli.tokenizer, [prompt], data.chat_template_kwargs)[0]
        prompt_ids, prompt_mask, _ = tokenize_prompts(cli.tokenizer, [text], cli.max_prompt_length, "cpu")
        ids = prompt_ids[0][prompt_mask[0].bool()].tolist()
        full = len(cli.tokenizer(text, add_special_tokens=False).input_ids)
        cut = f", the last {len(ids)} of {full} kept (model.max_prompt_length)" if full > len(ids) else ""
        print(f"----- {options.split} row {index}: {len(ids)} tokens{cut} -----")
        print(cli.tokenizer.decode(ids, skip_special_tokens=False))
    sys.stdout.flush()


def export_main(argv: list[str]) -> None:
    parser = CommandParser(
        prog="lit-grpo export",
        description="Write the policy of a lit-grpo checkpoint as a Hugging Face save_pretrained directory "
        "(model and tokenizer), loadable with AutoModelForCausalLM.from_pretrained.",
    )
    parser.add_argument(
        "ckpt", help="a checkpoint written by `lit-grpo fit` (a .ckpt file or a sharded directory), or a peft adapter directory"
    )
    parser.add_argument("dir", help="output directory (must be missing or empty unless --overwrite)")
    parser.add_argument(
        "--merge-lora",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with LoRA: merge the adapter into the base weights (default), or --no-merge-lora to write "
        "a peft adapter directory",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace DIR if it exists and is not empty")
    options = parser.parse_args(argv)

    from lit_grpo.export import export_checkpoint

    path = export_checkpoint(options.ckpt, options.dir, merge_lora=options.merge_lora, overwrite=options.overwrite)
    print(f"Exported the policy of {options.ckpt} to {path}")


def completions_main(argv: list[str]) -> None:
    from lit_grpo.completions import show_step

    parser = CommandParser(
        prog="lit-grpo completions",
        description="Show the completions a run logged at one step (from its completions.jsonl).",
    )
    parser.add_argument("path", help="a run's log directory (e.g. runs/quickstart), or a completions.jsonl")
    parser.add_argument("--step", type=int, default=None, help="training step to show (default: the last logged)")
    parser.add_argument("--limit", type=int, default=16, help="rows to show (default 16; 0 shows all)")
    parser.add_argument("--width", type=int, default=40, help="characters per text cell")
    parser.add_argument("--json", action="store_true", help="print the step's records as JSON lines")
    options = parser.parse_args(argv)
    print(show_step(Path(options.path), options.step, options.limit, options.width, options.json), flush=True)


def serve_main(argv: list[str]) -> None:
    from lit_grpo.engines.vllm_serve import serve_main as serve

    serve(argv)


SUBCOMMANDS = {
    "init-tiny": init_tiny_main,
    "rewards": rewards_main,
    "environments": environments_main,
    "export": export_main,
    "completions": completions_main,
    "prompts": prompts_main,
    "serve": serve_main,
}


HELP = """usage: lit-grpo COMMAND [...]

GRPO (Group Relative Policy Optimization) for causal language models on PyTorch Lightning.

commands:
  fit          train: lit-grpo fit --config configs/quickstart.yaml [--key value ...]
  validate     sample and score the validation split: val/reward, val/pass@k, ...
  rewards      list the installed reward functions with their packages
  environments list the installed environments (stateful tools for multi-turn rollouts)
  prompts      print the first prompts of a config exactly as the model sees them
  completions  show the completions a run logged at a step
  export       write a checkpoint's policy as a Hugging Face save_pretrained directory
  init-tiny    write a tiny random model and tokenizer for offline runs
  serve        start a vLLM server for model.generation_backend: vllm_server

`lit-grpo COMMAND --help` describes a command; `lit-grpo fit --help` lists every config key.
Errors in the input end with one line `error: ...`; LIT_GRPO_TRACEBACK=1 shows the traceback."""

TRACEBACK_ENV = "LIT_GRPO_TRACEBACK"


def resume_command(words: list[str]) -> str:
    """The command that resumes a stopped ``lit-grpo fit WORDS``: the same, with ``--ckpt_path last``."""
    kept, skip = [], False
    for word in words:
        if skip or word.startswith("--ckpt_path="):
            skip = False
            continue
        if word == "--ckpt_path":
            skip = True
            continue
        kept.append(word)
    return shlex.join(["lit-grpo", *kept, "--ckpt_path", "last"])


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``lit-grpo`` command; ``argv`` defaults to the command line.

    A mistake in the input (:class:`lit_grpo.errors.UserError`, a parse error) ends the command
    with one line ``error: ...`` on stderr and exit status 2; ``LIT_GRPO_TRACEBACK=1`` raises it
    with its traceback instead. Anything else is a bug and shows its traceback.
    """
    words = sys.argv[1:] if argv is None else argv
    try:
        if words and words[0] in SUBCOMMANDS:
            SUBCOMMANDS[words[0]](words[1:])
        elif not words or words[0] in ("-h", "--help"):
            print(HELP)
        else:
            run_cli(argv)  # None: LightningCLI reads sys.argv itself
    except StoppedBySignal as stop:  # checkpointed after the step it reached (lit_grpo.preemption)
        if stop.announce:  # rank 0 says it
            print(stop.describe(resume_command(words)), file=sys.stderr, flush=True)
        sys.exit(stop.exit_status)
    except (UserError, argparse.ArgumentError) as error:
        if os.environ.get(TRACEBACK_ENV, "") not in ("", "0"):
            raise
        # an error that stopped a run after a checkpoint says how to resume it (a lost generation server)
        describe = getattr(error, "describe", None)
        print(f"error: {describe(resume_command(words)) if describe else error}", file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
