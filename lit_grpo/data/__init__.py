"""Prompt data for GRPO: a ``LightningDataModule`` over a Hugging Face ``datasets`` dataset.

GRPO needs only prompts; the completions are sampled by the policy during training. Each row of the
dataset holds one prompt, either a plain string or a conversation (a list of chat messages
``{"role": ..., "content": ...}``), and any number of other columns (a reference answer, test cases,
...). Those other columns travel with their prompt in a :class:`PromptBatch` and reach every reward
function as keyword arguments: ``reward(prompts=..., completions=..., completion_ids=..., **columns)``.

Everything that can be checked about the data is checked in :meth:`GRPODataModule.setup`, before the
first training step, and reported as a ``ValueError`` that names the offending column, row or file.
Loading one split from its source (a file, a builder, the Hub, a plugin's data set, data given in
Python) and the checks on that source: :mod:`lit_grpo.data.loading`.
"""

from __future__ import annotations

import difflib
import functools
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import lightning.pytorch as pl
import torch
from datasets.packaged_modules import _PACKAGED_DATASETS_MODULES
from torch.utils.data import DataLoader, DistributedSampler

from lit_grpo import plugins
from lit_grpo.config import AsWritten
from lit_grpo.data.loading import (  # noqa: F401
    BUILDER_BY_EXTENSION,
    DataFiles,
    describe_source,
    in_memory_split,
    load_split,
    make_plugin_split,
)
from lit_grpo.errors import DataError
from lit_grpo.hookspecs import RESERVED_ARGS
from lit_grpo.run.checkpointing import ResumableDataLoader

__all__ = ["RESERVED_COLUMNS", "GRPODataModule", "PromptBatch", "PromptFormat", "PromptSampler", "collate_prompt_batch"]

# Keyword arguments that reward functions receive from the trainer; a dataset column with one of
# these names would collide with them when the columns are forwarded as ``**columns``.
RESERVED_COLUMNS = RESERVED_ARGS

IN_MEMORY = "<data given in Python>"  # the path of a data module made by GRPODataModule.from_data


@dataclass
class PromptBatch:
    """One batch of prompts with the other dataset columns aligned to them.

    Attributes:
        prompts: One prompt per row: a string, or a list of chat messages
            ``[{"role": ..., "content": ...}, ...]``.
        columns: Every other dataset column, keyed by column name; ``columns[name][i]`` belongs to
            ``prompts[i]``.
    """

    prompts: list[str | list[dict[str, Any]]]
    columns: dict[str, list[Any]]

    def __len__(self) -> int:
        return len(self.prompts)


@dataclass(frozen=True)
class PromptFormat:
    """How a dataset row becomes the prompt the model is given (``data.prompt_column``,
    ``data.prompt_template``, ``data.system_prompt``, ``data.conversational``).

    1. The text: ``prompt_template`` filled from the row's columns (``"Solve: {question}"``; ``{{``
       and ``}}`` are literal braces), else the row's ``prompt_column`` (a string, or chat messages).
    2. A string becomes a user message when ``conversational`` is set or a ``system_prompt`` is given,
       so the tokenizer's chat template is applied; otherwise it stays raw text, as in TRL.
    3. ``system_prompt`` is put first in every conversation that does not already start with a
       system message.
    """

    prompt_column: str = "prompt"
    prompt_template: str | None = None
    system_prompt: str | None = None
    conversational: bool = False

    def template_columns(self) -> list[str]:
        """The columns ``prompt_template`` names (a malformed template is a ``ValueError``)."""
        if self.prompt_template is None:
            return []
        try:
            fields = [field for _, field, _, _ in string.Formatter().parse(self.prompt_template) if field is not None]
        except ValueError as exc:
            raise DataError(f"data.prompt_template {self.prompt_template!r} is not a valid template: {exc}") from None
        for field in fields:
            if not field.isidentifier():
                raise DataError(
                    f"data.prompt_template field {{{field}}} must be a plain column name (write {{{{ and }}}} for literal braces)"
                )
        return list(dict.fromkeys(fields))

    def passed_columns(self, column_names: list[str]) -> list[str]:
        """The columns that travel with each prompt to the rewards and environments: all but the
        prompt column (with a template, all of them)."""
        prompt_column = self.prompt_column if self.prompt_template is None else None
        return [column for column in column_names if column != prompt_column]

    @property
    def makes_conversations(self) -> bool:
        return self.conversational or self.system_prompt is not None

    def __call__(self, row: dict[str, Any]) -> str | list[dict[str, Any]]:
        prompt = self.prompt_template.format_map(row) if self.prompt_template is not None else row[self.prompt_column]
        if isinstance(prompt, str) and self.makes_conversations:
            prompt = [{"role": "user", "content": prompt}]
        if self.system_prompt is not None and isinstance(prompt, list) and not (prompt and prompt[0].get("role") == "system"):
            prompt = [{"role": "system", "content": self.system_prompt}, *prompt]
        return prompt

    def check(self, dataset: datasets.Dataset, source: str) -> None:
        """Raise ``ValueError`` naming the setting and the column when a row cannot become a prompt."""
        missing = [column for column in self.template_columns() if column not in dataset.column_names]
        if missing:
            raise DataError(
                f"data.prompt_template names column {missing[0]!r}, which the {source} does not have; "
                f"its columns are {dataset.column_names}"
            )
        if self.prompt_template is None:
            _check_prompts(dataset, self.prompt_column, source)


class PromptSampler(DistributedSampler):
    """The order of the training prompts, the same for any number of processes.

    Each epoch is one permutation of the dataset (seeded by ``seed + epoch``; dataset order when
    ``shuffle`` is off) cut into *global* batches of ``batch_size * num_replicas`` prompts; rank
    ``r`` takes the ``r``-th slice of ``batch_size`` prompts of every global batch. So the prompts of
    global step ``k`` are the same whether one process or eight run it, and ``data.shuffle`` and
    ``data.seed`` keep their meaning under DDP/FSDP (Lightning's own distributed sampler would
    reshuffle with the global seed). Prompts that do not fill a last global batch are skipped.

    A ``DistributedSampler`` so that Lightning keeps it and calls ``set_epoch`` every epoch.
    """

    def __init__(
        self, dataset_size: int, batch_size: int, shuffle: bool, seed: int, num_replicas: int = 1, rank: int = 0
    ) -> None:
        # DistributedSampler.__init__ would query torch.distributed; the fields are set directly.
        self.dataset_size = dataset_size
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.num_replicas = num_replicas
        self.rank = rank
        self.epoch = 0
        self.drop_last = True
        global_batch = batch_size * num_replicas
        self.num_batches = dataset_size // global_batch
        if self.num_batches == 0:
            raise DataError(
                f"the training split has {dataset_size} prompts, fewer than one global batch of "
                f"data.batch_size * processes = {batch_size} * {num_replicas} = {global_batch}"
            )
        self.num_samples = self.num_batches * batch_size  # this rank's prompts per epoch
        self.total_size = self.num_samples * num_replicas

    def __iter__(self):
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.dataset_size, generator=generator).tolist()
        else:
            order = list(range(self.dataset_size))
        global_batch = self.batch_size * self.num_replicas
        for batch in range(self.num_batches):
            start = batch * global_batch + self.rank * self.batch_size
            yield from order[start : start + self.batch_size]

    def __len__(self) -> int:
        return self.num_samples


class GRPODataModule(pl.LightningDataModule):
    """Prompts for GRPO training, loaded with ``datasets.load_dataset``.

    Each training batch is a :class:`PromptBatch` of ``batch_size`` prompts; the model samples a group
    of completions for every prompt. Every column other than the prompt column is passed to the reward
    functions as a keyword argument, one value per completion.

    Examples of sources::

        path: json                       # a datasets builder with local files
        data_files: prompts.jsonl

        path: prompts.parquet            # a single local .json/.jsonl/.parquet/.csv file

        path: openai/gsm8k               # a dataset on the Hugging Face Hub
        name: main

        path: reasoning_gym              # a data set a plugin makes (`lit-grpo environments` lists them)
        args: {datasets: [{name: basic_arithmetic}], size: 1000}

    Args:
        path: Hugging Face Hub dataset id (``openai/gsm8k``), ``datasets`` builder name (``json``,
            ``parquet``, ``csv``, ...) or local directory, exactly as for ``datasets.load_dataset``.
            A single local ``.json``, ``.jsonl``, ``.parquet`` or ``.csv`` file may also be given
            here directly, in which case ``data_files`` must be left unset. The name of a data set
            that an installed plugin registers (``register_datasets``; ``lit-grpo environments``
            lists them) loads that one instead, made with ``args``.
        data_files: Data file(s) for a builder: a path, a list of paths (globs allowed), or a mapping
            from split name to path(s). Files given without a split name form the split ``train``.
        name: Dataset configuration name (the ``name`` argument of ``datasets.load_dataset``).
        split: Split to train on; slicing syntax such as ``train[:1000]`` is allowed.
        prompt_column: Column holding the prompts: non-empty strings, or lists of chat messages
            ``{"role": ..., "content": ...}`` (then the model's chat template is applied).
        prompt_template: A prompt built from the row's columns instead of ``prompt_column``:
            ``"Solve: {question}\nAnswer in <answer></answer> tags."`` (Python format fields; ``{{``
            and ``}}`` for literal braces). A column it names that the data lacks is an error.
        system_prompt: A system message put first in every prompt (implies ``conversational``);
            conversations that already start with a system message keep theirs.
        conversational: Turn plain-string prompts into a user message, so that the tokenizer's chat
            template is applied (false: the text is given to the model as it is, as in TRL).
        chat_template_kwargs: Extra keyword arguments of ``apply_chat_template``, e.g.
            ``{enable_thinking: false}`` for Qwen3-style templates (TRL's ``chat_template_kwargs``);
            ``lit-grpo fit`` hands them to the module, which renders the prompts.
        batch_size: Number of prompts per training step; each yields a group of completions. Rows
            that do not fill a last complete batch are skipped in each epoch.
        shuffle: Whether to shuffle the training prompts every epoch (see :class:`PromptSampler`).
        seed: Seed of the shuffling order, so that a run sees its prompts in a reproducible order.
        val_split: Split to validate on, from the same source as training unless ``val_data_files``
            is given. Validation is skipped when this is unset.
        val_data_files: Data file(s) for validation, in the same forms as ``data_files``; requires
            ``val_split`` (``train`` for files given without a split name).
        num_workers: Number of ``DataLoader`` worker processes (0 loads in the main process).
        args: The arguments of the plugin data set ``path`` names (each split is
            ``function(split=..., **args)``); only for such a data set.
    """

    def __init__(
        self,
        path: str,
        data_files: DataFiles | None = None,
        name: str | None = None,
        split: str = "train",
        prompt_column: str = "prompt",
        prompt_template: str | None = None,
        system_prompt: str | None = None,
        conversational: bool = False,
        chat_template_kwargs: dict[str, AsWritten] | None = None,
        batch_size: int = 4,
        shuffle: bool = True,
        seed: int = 0,
        val_split: str | None = None,
        val_data_files: DataFiles | None = None,
        num_workers: int = 0,
        args: dict[str, AsWritten] | None = None,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise DataError(f"batch_size must be at least 1, got {batch_size}")
        if val_data_files is not None and val_split is None:
            raise DataError(
                f"val_data_files={val_data_files!r} is set but val_split is not; set val_split to "
                "the split to validate on ('train' for files given without a split name)"
            )
        self.path = path
        self.data_files = data_files
        self.name = name
        self.split = split
        self.prompt_column = prompt_column
        self.prompt_format = PromptFormat(prompt_column, prompt_template, system_prompt, conversational)
        self.prompt_format.template_columns()  # a malformed template fails now
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.val_split = val_split
        self.val_data_files = val_data_files
        self.num_workers = num_workers
        self.args = dict(args or {})
        self.train_dataset: datasets.Dataset | None = None
        self.val_dataset: datasets.Dataset | None = None
        self.in_memory: dict[str, datasets.Dataset] | None = None  # splits given in Python (from_data)
        if val_split is None:
            # Lightning runs validation only if `val_dataloader` is overridden; putting the base
            # class's method back on the instance makes it skip validation without a warning. (A
            # partial rather than a bound method, which would unpickle as this class's method.)
            self.val_dataloader = functools.partial(pl.LightningDataModule.val_dataloader, self)

    def prepare_data(self) -> None:
        """Download and cache the data once per node, before :meth:`setup` runs on every process."""
        self._load_train()
        if self.val_split is not None:
            self._load_val()

    def setup(self, stage: str | None = None) -> None:
        """Load the training (and validation) split and check it; raises ``ValueError`` on bad data."""
        if stage in (None, "fit") and self.train_dataset is None:
            dataset = self._load_train()
            source = self._source("train")
            _check_dataset(dataset, self.prompt_format, source=source)
            if dataset.num_rows < self.batch_size:
                raise DataError(
                    f"the {source} has {dataset.num_rows} rows, fewer than batch_size={self.batch_size}, "
                    "so not one complete training batch can be formed"
                )
            self.train_dataset = dataset
        if stage in (None, "fit", "validate") and self.val_split is not None and self.val_dataset is None:
            dataset = self._load_val()
            source = self._source("val")
            _check_dataset(dataset, self.prompt_format, source=source)
            self.val_dataset = dataset

    def train_dataloader(self) -> DataLoader:
        """Batches of ``batch_size`` prompts, in an order fixed by ``seed``; incomplete batches dropped."""
        if self.train_dataset is None:
            raise RuntimeError("GRPODataModule.setup() must run before train_dataloader()")
        trainer = getattr(self, "trainer", None)
        replicas = (trainer.distributed_sampler_kwargs if trainer is not None else None) or {}
        sampler = PromptSampler(
            len(self.train_dataset),
            self.batch_size,
            shuffle=self.shuffle,
            seed=self.seed,
            num_replicas=replicas.get("num_replicas", 1),
            rank=replicas.get("rank", 0),
        )
        # Stateful, so that a resumed run continues with the next batch of the epoch (checkpointing.py).
        return ResumableDataLoader(
            self.train_dataset,
            batch_size=self.batch_size,
            sampler=sampler,
            generator=torch.Generator().manual_seed(self.seed),  # worker seeds; never the global RNG
            drop_last=True,
            num_workers=self.num_workers,
            collate_fn=functools.partial(collate_prompt_batch, prompt_format=self.prompt_format),
        )

    def val_dataloader(self) -> DataLoader:
        """Validation batches in dataset order; only defined when ``val_split`` is set."""
        if self.val_dataset is None:
            raise RuntimeError("GRPODataModule.setup() must run before val_dataloader()")
        return DataLoader(
            self.val_dataset,
            batch_size=self.batch_size,
            shuffle=False,
            num_workers=self.num_workers,
            collate_fn=functools.partial(collate_prompt_batch, prompt_format=self.prompt_format),
        )

    def passed_columns(self, split: str) -> tuple[str, list[str]] | None:
        """``(source, columns)`` of the ``train`` or ``val`` split: how messages name it, and the
        columns its prompts carry to the rewards and environments; None until :meth:`setup` loads it."""
        if split == "train" and self.train_dataset is not None:
            return self._source("train"), self.prompt_format.passed_columns(self.train_dataset.column_names)
        if split == "val" and self.val_dataset is not None:
            return self._source("val"), self.prompt_format.passed_columns(self.val_dataset.column_names)
        return None

    @classmethod
    def from_data(cls, train: Any, val: Any = None, **options: Any) -> "GRPODataModule":
        """The data module of prompts given in Python: ``train`` (and ``val``) a ``datasets.Dataset``, a
        list of row dicts, or a ``DatasetDict`` whose splits ``split`` and ``val_split`` name (default
        ``train``; ``val_split`` then as given, else ``val`` when ``val`` is given). ``options`` are any
        other argument of the data module (``prompt_column``, ``prompt_template``, ``system_prompt``,
        ``conversational``, ``batch_size``, ...): every row is checked and formatted as from a file."""
        if val is not None:
            options.setdefault("val_split", "val")
        split, val_split = options.get("split", "train"), options.get("val_split")
        module = cls(path=IN_MEMORY, **options)
        module.in_memory = {split: in_memory_split(train, split, "train")}
        if val_split is not None:
            module.in_memory[val_split] = in_memory_split(val if val is not None else train, val_split, "val")
        return module

    def _source(self, split: str) -> str:
        """How messages name the ``train`` or ``val`` data."""
        name = self.split if split == "train" else self.val_split
        if self.in_memory is not None:
            return f"{'training' if split == 'train' else 'validation'} data given in Python (split {name!r})"
        files = self.data_files if split == "train" else self._val_source_files()
        return describe_source(self.path, self.name, files, name)

    def _load_train(self) -> datasets.Dataset:
        if self.in_memory is not None:
            return self.in_memory[self.split]
        make = self._plugin_dataset()
        if make is not None:
            return make_plugin_split(self.path, make, self.args, self.split)
        return self._with_plugin_hint(load_split, self.path, name=self.name, data_files=self.data_files,
                                      split=self.split)

    def _load_val(self) -> datasets.Dataset:
        if self.in_memory is not None:
            return self.in_memory[self.val_split]
        make = self._plugin_dataset()
        if make is not None:
            return make_plugin_split(self.path, make, self.args, self.val_split)
        return self._with_plugin_hint(load_split, self.path, name=self.name, data_files=self._val_source_files(),
                                      split=self.val_split)

    def _plugin_dataset(self):
        """The function of the plugin data set ``path`` names, or None when ``datasets.load_dataset``
        loads ``path`` (a local path always does). ``args`` without such a data set are an error."""
        if self.path in _PACKAGED_DATASETS_MODULES or "/" in self.path or Path(self.path).exists():
            registered = None  # a builder (json, csv, ...), a hub id or a local path
        else:
            registered = plugins.get_datasets().get(self.path)
        if registered is not None:
            return registered.obj
        if self.args:
            raise DataError(f"data.args are the arguments of a data set a plugin makes, and data.path={self.path!r} "
                            f"names none: {plugins.unknown_dataset_message(self.path)}")
        return None

    def _with_plugin_hint(self, load, *args, **kwargs) -> datasets.Dataset:
        """``load(*args, **kwargs)``; a failure for a ``path`` close to a plugin data set's name says so."""
        try:
            return load(*args, **kwargs)
        except DataError as error:
            close = difflib.get_close_matches(self.path, list(plugins.get_datasets()), n=1)
            if not close:
                raise
            raise DataError(f"{error} (did you mean data.path: {close[0]}, the data set of plugin "
                            f"{plugins.get_datasets()[close[0]].label}?)") from error

    def _val_source_files(self) -> DataFiles | None:
        return self.val_data_files if self.val_data_files is not None else self.data_files


def collate_prompt_batch(rows: list[dict[str, Any]], prompt_format: PromptFormat | str) -> PromptBatch:
    """Turn dataset rows into a :class:`PromptBatch`: each row's prompt (:class:`PromptFormat`; a
    column name means that column as it is), and every other column as aligned lists (with a
    template, every column: the ones it uses too)."""
    if isinstance(prompt_format, str):
        prompt_format = PromptFormat(prompt_column=prompt_format)
    other_columns = prompt_format.passed_columns(list(rows[0]))
    return PromptBatch(
        prompts=[prompt_format(row) for row in rows],
        columns={column: [row[column] for row in rows] for column in other_columns},
    )


def _check_dataset(dataset: datasets.Dataset, prompt_format: PromptFormat, *, source: str) -> None:
    """Raise ``ValueError`` naming the problem if ``dataset`` cannot feed GRPO training."""
    if dataset.num_rows == 0:
        raise DataError(f"the {source} has no rows")
    prompt_column = prompt_format.prompt_column if prompt_format.prompt_template is None else None
    reserved = [
        column for column in dataset.column_names if column in RESERVED_COLUMNS and column != prompt_column
    ]
    if reserved:
        raise DataError(
            f"the {source} has column(s) {reserved} whose names are reserved: every column other than "
            f"the prompt column is passed to reward functions as a keyword argument, next to "
            f"{list(RESERVED_COLUMNS)}; rename the column(s) in the data"
        )
    prompt_format.check(dataset, source)


def _check_prompts(dataset: datasets.Dataset, prompt_column: str, source: str) -> None:
    """Every row of ``prompt_column`` must be a non-empty string or a list of chat messages."""
    if prompt_column not in dataset.column_names:
        raise DataError(
            f"prompt_column={prompt_column!r} is not a column of the {source}; "
            f"its columns are {dataset.column_names}"
        )
    for row_index, prompt in enumerate(dataset[prompt_column]):
        if not _is_valid_prompt(prompt):
            shown = repr(prompt)
            if len(shown) > 200:
                shown = shown[:200] + "..."
            raise DataError(
                f"row {row_index} of the {source}: column {prompt_column!r} must hold a non-empty "
                f"string or a non-empty list of chat messages {{'role': str, 'content': str}}, got {shown}"
            )


def _is_valid_prompt(prompt: Any) -> bool:
    """A non-empty string, or a non-empty list of ``{"role": str, "content": str}`` messages."""
    if isinstance(prompt, str):
        return prompt != ""
    return (
        isinstance(prompt, list)
        and len(prompt) > 0
        and all(
            isinstance(message, dict)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
            for message in prompt
        )
    )
