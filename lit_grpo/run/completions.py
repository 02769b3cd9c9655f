"""Completions you can read: every logged step's prompts, completions, rewards and advantages.

During ``fit`` the module appends one JSON object per completion to ``completions.jsonl`` in the
run's log directory (``runs/<name>/version_N/`` with the TensorBoard logger)::

    {"step": 3, "prompt": "Say a:", "completion": "aaab", "rewards": {"char_fraction": 0.75},
     "reward": 0.75, "advantage": 1.12}

(``model.save_completions``; every ``trainer.log_every_n_steps`` training steps, from every rank).
``lit-grpo completions RUN_DIR [--step N]`` prints one step of it as a table, and
``model.print_completions: K`` prints the first K rows of each logged step to the console.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from lit_grpo.errors import DataError, MissingFileError, writing

__all__ = [
    "COMPLETIONS_FILE",
    "CompletionLog",
    "append_records",
    "as_text",
    "completion_records",
    "format_table",
    "log_step_completions",
    "log_table",
    "logged_step",
    "read_records",
    "show_step",
    "table_rows",
    "unique_prompt_rows",
]

COMPLETIONS_FILE = "completions.jsonl"


def as_text(value: Any) -> str:
    """A prompt or completion as text: a single message's content, or for a conversation each
    message as ``role: content`` on its own line (so a system prompt shows), tool calls as
    ``name(arguments)``."""
    if isinstance(value, list) and value and all(isinstance(message, dict) for message in value):
        if len(value) == 1 and not value[0].get("tool_calls"):
            return str(value[0].get("content", ""))
        return "\n".join(_message_text(message) for message in value)
    return str(value)


def _message_text(message: dict) -> str:
    parts = [str(message.get("content") or "")]
    for call in message.get("tool_calls") or []:
        function = call.get("function", call)
        parts.append(f"[calls {function.get('name')}({json.dumps(function.get('arguments', {}), ensure_ascii=False)})]")
    return f"{message.get('role', '?')}: " + " ".join(part for part in parts if part)


def _number(value: float) -> float | None:
    return None if math.isnan(value) else value  # a reward that returned None stays null in JSON


def completion_records(
    step: int,
    prompts: list,
    completions: list,
    reward_names: list[str],
    rewards_per_func: list[list[float]],
    rewards: list[float],
    advantages: list[float],
) -> list[dict[str, Any]]:
    """One JSON-ready record per completion of a step (conversations keep their messages)."""
    return [
        {
            "step": step,
            "prompt": prompt,
            "completion": completion,
            "rewards": {name: _number(float(value)) for name, value in zip(reward_names, per_func)},
            "reward": _number(float(reward)),
            "advantage": float(advantage),
        }
        for prompt, completion, per_func, reward, advantage in zip(
            prompts, completions, rewards_per_func, rewards, advantages
        )
    ]


def append_records(path: Path, records: list[dict[str, Any]]) -> None:
    """Append records as JSON lines (the file and its directory are created when missing).

    All or nothing: a write that fails (a full disk) cuts the file back to the lines it had, so that
    it stays readable, and is a :class:`~lit_grpo.errors.WriteError` naming the file."""
    text = "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records)
    steps = sorted({record["step"] for record in records})
    with writing(f"the completions of step {', '.join(map(str, steps))}", path):
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "ab") as file:
            size_before = file.tell()
            try:
                file.write(text.encode("utf-8"))
                file.flush()
            except OSError:
                file.truncate(size_before)
                raise


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of a ``completions.jsonl``; a bad line is reported with its number."""
    records = []
    with open(path, encoding="utf-8") as file:
        for number, line in enumerate(file, start=1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{number} is not a JSON object: {exc}") from exc
    return records


def _cell(value: Any, width: int | None, keep: str = "start") -> str:
    """``value`` on one line, cut to ``width`` characters with ``…`` where it was cut: its ``start``
    kept (a completion), or its ``end`` (a prompt, whose task is usually at its end)."""
    text = as_text(value) if not isinstance(value, float) else f"{value:.3f}"
    text = text.replace("\n", "⏎").replace("|", "\\|")
    if width is None or len(text) <= width:
        return text
    return "…" + text[len(text) - width + 1:] if keep == "end" else text[: width - 1] + "…"


def format_table(records: list[dict[str, Any]], width: int | None = 40) -> str:
    """A Markdown table: prompt, completion, each reward, reward, advantage; text cells cut to
    ``width`` characters (None: whole), a prompt to its end (``…`` marks the cut), a completion to its
    start. The console, ``lit-grpo completions`` and the logger's completions table all show it."""
    if not records:
        return "(no completions)"
    names = list(records[0]["rewards"])
    header = ["prompt", "completion", *names, "reward", "advantage"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for record in records:
        scores = [record["rewards"].get(name) for name in names]
        cells = [
            _cell(record["prompt"], width, keep="end"),
            _cell(record["completion"], width),
            *("None" if score is None else f"{score:.3f}" for score in scores),
            "None" if record["reward"] is None else f"{record['reward']:.3f}",
            f"{record['advantage']:.3f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table_rows(records: list[dict[str, Any]]) -> tuple[list[str], list[list[Any]]]:
    """The columns and rows of the completions table (prompt, completion, each reward, reward,
    advantage), the texts whole, for loggers that take a table."""
    names = list(records[0]["rewards"]) if records else []
    columns = ["prompt", "completion", *names, "reward", "advantage"]
    rows = [
        [as_text(r["prompt"]), as_text(r["completion"]), *(r["rewards"].get(n) for n in names), r["reward"], r["advantage"]]
        for r in records
    ]
    return columns, rows


def log_table(logger: Any, records: list[dict[str, Any]], step: int) -> bool:
    """Send the completions table to ``logger`` in the form it has one: TensorBoard text (Markdown),
    a Weights & Biases table, an MLflow text artifact per step. False for a logger without one
    (CSV and others: ``completions.jsonl`` holds the completions). Rank 0 only."""
    kind = type(logger).__name__
    if kind == "TensorBoardLogger" or hasattr(getattr(logger, "experiment", None), "add_text"):
        logger.experiment.add_text("completions", format_table(records, width=None), global_step=step)
    elif kind == "WandbLogger":
        columns, rows = table_rows(records)
        logger.log_table(key="completions", columns=columns, data=rows, step=step)
    elif kind == "MLFlowLogger":
        logger.experiment.log_text(logger.run_id, format_table(records, width=None), f"completions/step_{step:07d}.md")
    else:
        return False
    return True


def find_completions_file(path: Path) -> Path:
    """``path`` itself, or the most recently written ``completions.jsonl`` below it."""
    if path.is_file():
        return path
    if not path.exists():
        raise MissingFileError(f"{path} does not exist")
    candidates = sorted(path.rglob(COMPLETIONS_FILE), key=lambda candidate: candidate.stat().st_mtime)
    if not candidates:
        raise MissingFileError(
            f"no {COMPLETIONS_FILE} under {path}: a run writes it in its log directory "
            "(model.save_completions, every trainer.log_every_n_steps steps)"
        )
    return candidates[-1]


def show_step(path: Path, step: int | None = None, limit: int = 16, width: int = 40, as_json: bool = False) -> str:
    """What ``lit-grpo completions PATH`` prints: the records of one logged ``step`` (the last by
    default) of the ``completions.jsonl`` at or below ``path``, as a table or as JSON lines."""
    path = find_completions_file(Path(path))
    records = read_records(path)
    steps = sorted({record["step"] for record in records})
    if not steps:
        raise DataError(f"{path} holds no completions")
    step = steps[-1] if step is None else step
    if step not in steps:
        shown = ", ".join(map(str, steps[:20])) + (" ..." if len(steps) > 20 else "")
        raise DataError(f"step {step} was not logged; logged steps: {shown} ({path})")
    selected = [record for record in records if record["step"] == step]
    if limit:
        selected = selected[:limit]
    if as_json:
        return "\n".join(json.dumps(record, ensure_ascii=False) for record in selected)
    header = f"{path}, step {step} ({len(selected)} of {sum(r['step'] == step for r in records)} completions)"
    return header + "\n" + format_table(selected, width=width)


def logged_step(trainer: Any) -> int:
    """The step the trainer logs this batch's scalars at: Lightning's public ``global_step`` counts
    optimizer steps (several per batch here), so this reads the fit loop's private count of logged batches."""
    return trainer.fit_loop.epoch_loop._batches_that_stepped


def unlog_step(trainer: Any) -> None:
    """Count the last logged batch as not logged (a step stopped before its end, checkpointed as the
    end of the step before): the other side of :func:`logged_step`'s private count."""
    trainer.fit_loop.epoch_loop._batches_that_stepped -= 1


@dataclass
class CompletionLog:
    """Where and how often a run logs the completions of its training steps: a table in every logger
    every ``table_every`` steps (``model.log_completions_every_n_steps``; 0: never) with ``table_rows`` rows
    (``model.num_completions_to_log``); every ``file_every`` steps (``trainer.log_every_n_steps``) all
    ranks' appended to ``completions.jsonl`` in ``log_dir`` (``model.save_completions``; None: no logger,
    nowhere to write) and the first ``print_rows`` printed (``model.print_completions``). With
    ``unique_prompts`` the table shows only the first completion of each distinct prompt
    (:func:`unique_prompt_rows`)."""

    table_every: int
    table_rows: int
    file_every: int
    save: bool
    print_rows: int
    log_dir: Path | None
    unique_prompts: bool = False  # model.log_unique_prompts: the table keeps one row per distinct prompt (TRL's)
    loggers_told: set[type] = field(default_factory=set)  # loggers without a completions table, said once

    def wanted(self, step: int, is_global_zero: bool, has_loggers: bool) -> tuple[bool, bool]:
        """Whether ``step``'s completions go to the loggers' table (rank 0) and to the file or console."""
        to_table = bool(self.table_every) and step % self.table_every == 0 and is_global_zero and has_loggers
        to_file = bool(self.save or self.print_rows) and step % max(self.file_every, 1) == 0
        return to_table, to_file


def unique_prompt_rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The first record of each distinct prompt, in order (TRL's ``log_unique_prompts``, which compares
    prompts by their text: a conversation by its ``str``)."""
    firsts: dict[str, dict[str, Any]] = {}
    for record in records:
        firsts.setdefault(str(record["prompt"]), record)
    return list(firsts.values())


def log_step_completions(log: CompletionLog, loggers: list, step: int, is_global_zero: bool,
                         make_records: Callable[[], list[dict[str, Any]]]) -> None:
    """The completions of a training step (``make_records``: this rank's :func:`completion_records`,
    made only on a step that logs them): this rank's first rows as every logger's completions table,
    every rank's appended to ``completions.jsonl`` (rank 0 writes) and printed if asked (see :class:`CompletionLog`)."""
    from lightning.pytorch.utilities import rank_zero_info

    from lit_grpo.distributed import gather_objects

    to_table, to_file = log.wanted(step, is_global_zero, bool(loggers))
    if not (to_table or to_file):
        return
    records = make_records()
    table = unique_prompt_rows(records) if log.unique_prompts else records
    for logger in loggers if to_table else []:
        where = logger.log_dir or logger.save_dir  # rank 0 only: the directory the logger writes to
        with writing(f"the completions table of step {step} ({type(logger).__name__})", where):
            shown = log_table(logger, table[: log.table_rows], step)
        if not shown and type(logger) not in log.loggers_told:
            log.loggers_told.add(type(logger))
            rank_zero_info(
                f"{type(logger).__name__} has no table or text form for the completions table; "
                f"completions.jsonl in the run's log directory holds them (model.save_completions)"
            )
    if not to_file:
        return
    records = gather_objects(records)  # a collective: every rank takes part
    if not is_global_zero:  # no collective below this line: rank 0 only
        return
    if log.save and log.log_dir is not None:  # without a logger there is nowhere to write
        append_records(log.log_dir / COMPLETIONS_FILE, records)
    if log.print_rows:  # above the progress bar, if one is shown, not at its end
        tqdm.write(f"completions at step {step}:\n{format_table(records[: log.print_rows])}")
        sys.stdout.flush()
