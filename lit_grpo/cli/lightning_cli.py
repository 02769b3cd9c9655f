"""``lit-grpo fit`` and ``lit-grpo validate``: :class:`GRPOCLI`, LightningCLI over :class:`GRPOModule` and
:class:`GRPODataModule` (``--print_config`` shows the full resolved configuration), the parse errors it
explains in one line, and the configuration ``lit-grpo prompts`` parses as ``fit`` does.

Apart from :mod:`lit_grpo.cli` so that the commands that need neither Lightning nor torch (``completions``,
``rewards``, ``environments``, ``--help``, every usage error) start without importing them:
``lit_grpo.cli`` imports this module when a command needs it.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib
import inspect
import re
import sys
from pathlib import Path
from typing import Any

import torch
from jsonargparse import Namespace
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.cli import LightningCLI, LRSchedulerTypeTuple, SaveConfigCallback

from lit_grpo.cli.config_files import (
    COMMAND_LINE,
    config_files,
    find_duplicate_key,
    find_key,
    find_syntax_error,
    value_origin,
)
from lit_grpo.cli.trl_names import trl_hint
from lit_grpo.errors import ConfigError
from lit_grpo.redaction import REDACTED, is_secret_name, redact_secrets, restore_redacted
from lit_grpo.run.checkpointing import (
    check_local_checkpoint,
    configure_checkpointing,
    is_class_config,
    load_checkpoint_file,
)
from lit_grpo.run.directory import place_run, resume_config_name

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
    directory, which a resumed run continues in (``lit_grpo.run.directory.place_run``); ``fit`` checkpoints there,
    writes atomically and keeps the random and data state (``lit_grpo.run.checkpointing.configure_checkpointing``
    and the ``RNGStateCheckpoint`` callback that ``GRPOModule.configure_callbacks`` always adds).
    Lightning's ``ModelParallelStrategy`` runs as ``lit_grpo.run.sharded_checkpoints.ModelParallelStrategy``,
    whose sharded checkpoints are replaced atomically too.

    What a run writes holds no secret (:mod:`lit_grpo.redaction`): ``config.yaml`` is saved redacted
    (:class:`SaveRedactedConfig`), as are the module's hyperparameters in checkpoints and logs. A checkpoint
    is read from a local file with ``weights_only=True`` only (:func:`lit_grpo.run.checkpointing.load_checkpoint_file`).
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
    """Show :class:`lit_grpo.run.callbacks.StepProgressBar` (optimizer steps out of ``max_steps``, the
    reward) unless the progress bar is off or the config names one of its own."""
    callbacks = list(trainer_config.get("callbacks") or [])
    if trainer_config.get("enable_progress_bar") is False or any(is_class_config(c, ProgressBar) for c in callbacks):
        return
    trainer_config.callbacks = [*callbacks, Namespace(class_path="lit_grpo.run.callbacks.StepProgressBar")]


def explain_parse_error(message: str, parser, args: list[str] | None) -> str:
    """A parse error as one line that names the key and where it is (``file:line``), and for an
    unknown key what was meant: TRL's name for a lit-grpo setting (:mod:`lit_grpo.cli.trl_names`),
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
    """Run Lightning's ``ModelParallelStrategy`` as :class:`lit_grpo.run.sharded_checkpoints.ModelParallelStrategy`,
    the same strategy whose sharded checkpoints replace the previous ones atomically."""
    strategy = trainer_config.get("strategy")
    if getattr(strategy, "class_path", None) in LIGHTNING_MODEL_PARALLEL:
        strategy.class_path = "lit_grpo.run.sharded_checkpoints.ModelParallelStrategy"


def run_cli(args: list[str] | None = None, run: bool = True) -> GRPOCLI:
    """``lit-grpo fit|validate ...`` as the command runs it; ``run=False`` only builds the trainer,
    module and data module from ``args`` (a subcommand is then not given)."""
    from lit_grpo.data import GRPODataModule
    from lit_grpo.train.module import GRPOModule

    return GRPOCLI(GRPOModule, GRPODataModule, save_config_callback=SaveRedactedConfig,
                   save_config_kwargs={"overwrite": True}, args=args, run=run)


class PromptsCLI(GRPOCLI):
    """The ``fit`` configuration parsed as ``lit-grpo fit`` parses it; only the data module and the
    tokenizer are built (no model weights are loaded)."""

    def instantiate_classes(self) -> None:
        from lit_grpo.data import GRPODataModule
        from lit_grpo.models import load_tokenizer
        from lit_grpo.rollout.tools.tool_use import ToolUse

        self.datamodule = GRPODataModule(**self.config.data.as_dict())
        self.tool_use = ToolUse.from_settings(self.config.model.as_dict())  # a misspelt tool fails here
        self.tokenizer = load_tokenizer(self.config.model.model_name_or_path)
        self.max_prompt_length = self.config.model.max_prompt_length
