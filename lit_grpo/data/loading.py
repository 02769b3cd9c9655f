"""Loading one split of the prompt data (used by :class:`lit_grpo.data.GRPODataModule`): from a data
file, a ``datasets`` builder or the Hugging Face Hub (:func:`load_split`), from a plugin's data set
(:func:`make_plugin_split`) or from data given in Python (:func:`in_memory_split`).

What can be told about a source before ``datasets`` reads it is told first, as a :class:`DataError`
naming the file, line or byte and the fix: a missing path, an empty or blank file, a file that is not
UTF-8, a JSON Lines line that is not an object.
"""

from __future__ import annotations

import codecs
import difflib
import inspect
import itertools
import json
import re
import shlex
from pathlib import Path
from typing import Any

import datasets
from datasets.exceptions import DatasetGenerationError
from datasets.packaged_modules import _PACKAGED_DATASETS_MODULES

from lit_grpo.errors import DataError, MissingFileError

__all__ = ["BUILDER_BY_EXTENSION", "DataFiles", "describe_source", "in_memory_split", "load_split", "make_plugin_split"]

# ``datasets`` builder for a data file given directly as ``path``, by file extension.
BUILDER_BY_EXTENSION = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}

DataFiles = str | list[str] | dict[str, str | list[str]]


def make_plugin_split(name: str, make, args: dict[str, Any], split: str) -> datasets.Dataset:
    """Split ``split`` of the plugin data set ``name``: ``make(split=split, **args)``, checked."""
    try:
        inspect.signature(make).bind(split=split, **args)
    except TypeError as error:
        parameters = [p for p in inspect.signature(make).parameters if p != "split"]
        unknown = [key for key in args if key not in parameters]
        close = difflib.get_close_matches(unknown[0], parameters, n=1) if unknown else []
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise DataError(f"data.args of data set {name!r}: {error}{hint} (its arguments: {', '.join(parameters)})") from None
    dataset = make(split=split, **args)
    if not isinstance(dataset, datasets.Dataset):
        raise DataError(f"data set {name!r} made {type(dataset).__name__} for split {split!r}; a plugin's data set "
                        "function returns a datasets.Dataset")
    return dataset


def in_memory_split(data: Any, split: str, role: str) -> datasets.Dataset:
    """``data`` given in Python for the ``role`` (train/val) split named ``split``, as a ``Dataset``."""
    if isinstance(data, datasets.DatasetDict):
        if split not in data:
            raise DataError(f"the DatasetDict given for {role} has no split {split!r}; its splits are {sorted(data)} "
                            f"(set {'split' if role == 'train' else 'val_split'})")
        return data[split]
    if isinstance(data, datasets.Dataset):
        return data
    if isinstance(data, list) and all(isinstance(row, dict) for row in data):
        try:
            return datasets.Dataset.from_list(data)
        except Exception as error:  # pyarrow's errors for rows whose columns do not agree
            raise DataError(f"the rows given for {role} do not form a table: {type(error).__name__}: {error}") from error
    raise DataError(f"the {role} data given in Python must be a datasets.Dataset, a DatasetDict or a list of row dicts, "
                    f"got {type(data).__name__}")


def load_split(
    path: str, *, name: str | None, data_files: DataFiles | None, split: str
) -> datasets.Dataset:
    """``datasets.load_dataset`` for one split, with errors that say which source failed."""
    source = describe_source(path, name, data_files, split)
    builder = BUILDER_BY_EXTENSION.get(Path(path).suffix.lower())
    if builder is not None:
        if data_files is not None:
            raise DataError(
                f"path={path!r} is a data file, so data_files={data_files!r} must be unset; to use "
                f"data_files, set path to a builder name such as {builder!r}"
            )
        path, data_files = builder, path
    _check_path_exists(path, data_files, source)
    for data_file in _local_files(data_files):
        if data_file.stat().st_size == 0:
            raise DataError(f"data file {str(data_file)!r} of the {source} is empty")
        if path in TEXT_BUILDERS and not _is_compressed(data_file):
            _check_text_file(data_file, source)
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its errors are reported below, once
    try:
        return datasets.load_dataset(path, name=name, data_files=data_files, split=split)
    except Exception as error:  # datasets raises many types, even a bare StopIteration
        if path == "json":  # say which row of which file it could not read
            for data_file in _local_files(data_files):
                problem = _json_problem(data_file)
                if problem is not None:
                    raise DataError(problem) from error
        cause = error.__cause__ if isinstance(error, DatasetGenerationError) else None  # the reader's own error
        why = f"{type(cause).__name__}: {' '.join(str(cause).split())}" if cause is not None else f"{type(error).__name__}: {error}"
        raise DataError(f"could not load the {source}: {why}{_hub_hint(path, error)}") from error
    finally:
        datasets.logging.set_verbosity(verbosity)


# --------------------------------------------------------------------------------------------------
# What can be told about a source before datasets reads it
# --------------------------------------------------------------------------------------------------

# builders that read their files as UTF-8 text
TEXT_BUILDERS = ("json", "csv", "text")
# a Hugging Face Hub id: ``name`` or ``owner/name``, each part starting and ending with a letter or digit
HUB_ID = re.compile(r"\w(?:[\w.-]*\w)?(?:/\w(?:[\w.-]*\w)?)?")
SOURCE_FORMS = ("data.path is a local data file or directory, a datasets builder (json, csv, parquet) with "
                "data.data_files, a Hugging Face Hub id (owner/name) or a plugin's data set (`lit-grpo environments`)")


def _check_path_exists(path: str, data_files: DataFiles | None, source: str) -> None:
    """A ``path`` that can only be a local one (``./dir``, ``/abs``, ``a/b/c``) and the plain local
    ``data_files`` of a builder must exist: else an error naming it (a :class:`MissingFileError` for
    ``path``), not the Hub's complaint about a repository id."""
    if path not in _PACKAGED_DATASETS_MODULES and not Path(path).exists() and not HUB_ID.fullmatch(path):
        raise MissingFileError(f"data.path {path!r}: no such file or directory (looked for in {Path.cwd()}); "
                               f"{SOURCE_FORMS}")
    if path in _PACKAGED_DATASETS_MODULES:
        for entry in _entries(data_files):
            if "://" not in entry and not any(c in entry for c in "*?[") and not Path(entry).exists():
                raise DataError(f"could not load the {source}: no such data file {entry!r} (looked for in {Path.cwd()})")


def _hub_hint(path: str, error: Exception) -> str:
    """For a ``path`` that is no local path and was not found on the Hub (``error``): that it is no
    local path, and that the Hub is off (``HF_HUB_OFFLINE``, ``HF_DATASETS_OFFLINE``) where it is."""
    not_found = isinstance(error, FileNotFoundError | ConnectionError) or type(error).__name__ == "HFValidationError"
    if path in _PACKAGED_DATASETS_MODULES or Path(path).exists() or not not_found:
        return ""
    offline = datasets.config.HF_HUB_OFFLINE
    hub = ("the Hugging Face Hub is not reachable offline (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE is set)" if offline
           else "the Hugging Face Hub has no such dataset or is not reachable")
    return f"; no local path {path!r} exists and {hub}"


# the first bytes of the compressed files datasets reads: gzip, bz2, xz, zstd, zip, lz4
COMPRESSED_MAGIC = (b"\x1f\x8b", b"BZh", b"\xfd7zXZ\x00", b"\x28\xb5\x2f\xfd", b"PK\x03\x04", b"\x04\x22\x4d\x18")


def _is_compressed(path: Path) -> bool:
    with path.open("rb") as file:
        return file.read(6).startswith(COMPRESSED_MAGIC)


def _check_text_file(path: Path, source: str) -> None:
    """A JSON, CSV or text data file must be UTF-8 (as ``datasets`` reads it) and hold more than blank
    lines: else a :class:`DataError` naming the file, the first byte that is not UTF-8 and the fix."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    read, blank = 0, True
    with path.open("rb") as file:
        for chunk in itertools.chain(iter(lambda: file.read(1 << 20), b""), [None]):  # None: the end (a cut character fails)
            pending = len(decoder.getstate()[0])  # bytes of a character cut by the previous chunk
            try:
                text = decoder.decode(chunk or b"", final=chunk is None)
            except UnicodeDecodeError as error:
                raise DataError(_not_utf8(path, read - pending + error.start)) from None
            blank = blank and not text.strip()
            read += len(chunk or b"")
    if blank:
        raise DataError(f"data file {str(path)!r} of the {source} holds only blank lines: no rows to train on "
                        "(a JSON Lines file holds one JSON object per line; a CSV file a header line, then rows)")


def _not_utf8(path: Path, offset: int) -> str:
    """The message for a data file whose byte at ``offset`` is not UTF-8."""
    with path.open("rb") as file:
        before = file.read(offset + 1)
    line = before.count(b"\n") + 1
    utf16 = before[:2] in (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)
    encoding = "utf-16" if utf16 else "cp1252"
    guess = "it is UTF-16 (it starts with a UTF-16 byte-order mark)" if utf16 else "for a Latin-1 / Windows-1252 file"
    fixed = f"{path.stem}.utf8{path.suffix}"
    return (f"data file {str(path)!r} is not UTF-8: byte 0x{before[offset]:02x} at byte offset {offset} (line {line}) "
            f"is not valid UTF-8, the encoding datasets reads JSON, CSV and text files in; re-encode it to UTF-8 "
            f"({guess}: iconv -f {encoding} -t utf-8 {shlex.quote(str(path))} > {shlex.quote(fixed)})")


def _json_problem(path: Path) -> str | None:
    """What makes a local JSON / JSON Lines file unreadable as rows, with ``file:line``; None if
    nothing does (a whole-file JSON document, or one JSON object per line)."""
    text = path.read_text(encoding="utf-8", errors="replace")
    try:
        json.loads(text)
        return None  # one JSON document: a list of rows or an object of columns
    except json.JSONDecodeError:
        pass
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            return f"line {number} is not valid JSON: {exc.msg} at column {exc.colno} ({path}:{number})"
        if not isinstance(row, dict):
            return f"line {number} is a JSON {type(row).__name__}, not an object of columns ({path}:{number})"
    return None


def _entries(data_files: DataFiles | None) -> list[str]:
    """Every path or pattern of ``data_files``, of all splits."""
    if data_files is None:
        return []
    if isinstance(data_files, str):
        return [data_files]
    if isinstance(data_files, dict):
        entries = []
        for split_files in data_files.values():
            entries.extend([split_files] if isinstance(split_files, str) else split_files)
        return entries
    return list(data_files)


def _local_files(data_files: DataFiles | None) -> list[Path]:
    """The entries of ``data_files`` that name existing local files (globs and URLs are skipped)."""
    return [Path(entry) for entry in _entries(data_files) if Path(entry).is_file()]


def describe_source(path: str, name: str | None, data_files: DataFiles | None, split: str) -> str:
    """How error messages name a dataset: ``dataset path='json' (data_files=..., split='train')``."""
    optional = {"name": name, "data_files": data_files}
    details = [f"{key}={value!r}" for key, value in optional.items() if value is not None]
    details.append(f"split={split!r}")
    return f"dataset path={path!r} ({', '.join(details)})"
