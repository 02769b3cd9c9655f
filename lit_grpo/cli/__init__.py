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

Each command imports what it needs when it runs: ``fit``/``validate`` (:mod:`lit_grpo.cli.lightning_cli`) and
``prompts`` Lightning and torch, ``completions``, ``rewards``, ``--help`` and a usage error neither.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

from lit_grpo import plugins
from lit_grpo.errors import ConfigError, UserError
from lit_grpo.plugins import RegistryEntry
from lit_grpo.redaction import redact_command, redact_message

# What `fit`/`validate` need (Lightning, torch: seconds to import) is in lit_grpo.cli.lightning_cli, imported
# by the commands that use it; these names of it are still found here.
FIT_NAMES = {"GRPOCLI", "PromptsCLI", "SaveRedactedConfig", "default_logger", "explain_parse_error", "redacted_config",
             "run_cli", "use_atomic_model_parallel_checkpoints", "use_step_progress_bar"}


def __getattr__(name: str):
    """``from lit_grpo.cli import run_cli`` (and the other :data:`FIT_NAMES`): from :mod:`lit_grpo.cli.lightning_cli`."""
    if name in FIT_NAMES:
        from lit_grpo.cli import lightning_cli

        return getattr(lightning_cli, name)
    raise AttributeError(f"module 'lit_grpo.cli' has no attribute {name!r}")



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


def _as_list(infos: Mapping[str, RegistryEntry] | Iterable[RegistryEntry]) -> list[RegistryEntry]:
    return list(infos.values()) if isinstance(infos, Mapping) else list(infos)


def format_rewards_table(infos: Mapping[str, RegistryEntry] | Iterable[RegistryEntry], what: str = "rewards") -> str:
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


def rewards_as_json(infos: Mapping[str, RegistryEntry] | Iterable[RegistryEntry]) -> str:
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
    from lit_grpo.cli.lightning_cli import PromptsCLI
    from lit_grpo.data import GRPODataModule
    from lit_grpo.rollout.engines.requests import render_prompts, tokenize_prompts
    from lit_grpo.train.module import GRPOModule

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

    from lit_grpo.run.export import export_checkpoint

    path = export_checkpoint(options.ckpt, options.dir, merge_lora=options.merge_lora, overwrite=options.overwrite)
    print(f"Exported the policy of {options.ckpt} to {path}")


def completions_main(argv: list[str]) -> None:
    from lit_grpo.run.completions import show_step

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
    from lit_grpo.rollout.engines.vllm_serve import serve_main as serve

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
    """The command that resumes a stopped ``lit-grpo fit WORDS``: the same, with ``--ckpt_path last``, as it may
    be shown (a secret on the command line as ``<redacted>``: :func:`lit_grpo.redaction.redact_command`)."""
    kept, skip = [], False
    for word in words:
        if skip or word.startswith("--ckpt_path="):
            skip = False
            continue
        if word == "--ckpt_path":
            skip = True
            continue
        kept.append(word)
    return shlex.join(["lit-grpo", *redact_command(kept), "--ckpt_path", "last"])


def fit_main(argv: list[str] | None) -> None:
    """``lit-grpo fit|validate ...`` (``argv`` None: LightningCLI reads ``sys.argv`` itself); a run stopped by a
    signal, checkpointed after the step it reached (:mod:`lit_grpo.run.preemption`), says how to resume it."""
    from lit_grpo.cli.lightning_cli import run_cli
    from lit_grpo.run.preemption import StoppedBySignal

    try:
        run_cli(argv)
    except StoppedBySignal as stop:
        if stop.announce:  # rank 0 says it
            print(redact_message(stop.describe(resume_command(sys.argv[1:] if argv is None else argv))), file=sys.stderr,
                  flush=True)
        sys.exit(stop.exit_status)


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
            fit_main(argv)
    except (UserError, argparse.ArgumentError) as error:
        if os.environ.get(TRACEBACK_ENV, "") not in ("", "0"):
            error.args = (redact_message(str(error)),)  # its message as the error: line shows it (not its frames')
            if isinstance(error, argparse.ArgumentError):
                error.argument_name, error.message = None, error.args[0]
            raise
        # an error that stopped a run after a checkpoint says how to resume it (a lost generation server)
        describe = getattr(error, "describe", None)
        # one write, so that two ranks' messages through one pipe do not interleave mid-line; a setting it quotes
        # may hold a secret (a server URL's password, a token): redacted, as in the files a run writes
        sys.stderr.write(f"error: {redact_message(describe(resume_command(words)) if describe else str(error))}\n")
        sys.stderr.flush()
        sys.exit(2)

