"""Errors in what the user gave (a setting, the data, a model path, a reward) or in the machine a run
writes to (a full disk), as opposed to bugs.

``lit-grpo`` ends a run that raises a :class:`UserError` with its message alone, one short
``error: ...`` line on stderr and exit status 2, without a traceback (``LIT_GRPO_TRACEBACK=1`` shows
it); any other exception is an internal error and shows its traceback. Each class also derives
from the built-in exception it has always been (``ValueError``, ``FileNotFoundError``, ...), so code
that catches those keeps working.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["CheckpointedError", "ConfigError", "DataError", "FileInTheWayError", "MissingFileError", "ModelLoadError", "UserError", "WriteError",
           "os_error_in", "writing"]


class UserError(Exception):
    """A mistake in the input; its message says what is wrong and names the key, file or reward."""


class ConfigError(UserError, ValueError):
    """A setting that cannot work (``model.*``, ``data.*``, ``trainer.*``, a reward's ``args``)."""


class DataError(UserError, ValueError):
    """Data that cannot feed training: a malformed file, a missing column, an invalid prompt."""


class MissingFileError(UserError, FileNotFoundError):
    """A file or directory the user named does not exist."""


class FileInTheWayError(UserError, FileExistsError):
    """An output path the user named is taken (and overwriting was not asked for)."""


class ModelLoadError(UserError, OSError):
    """A model, tokenizer or checkpoint path that exists but does not hold what is needed."""


class CheckpointedError(UserError):
    """An error the run stops on after writing a checkpoint to resume from, in an ``on_exception`` callback
    (a failed or lost generation server: :mod:`lit_grpo.rollout.engines.server_lost`); ``checkpoint``: its path."""

    checkpoint: str | None = None


class WriteError(UserError, OSError):
    """A file of the run (a checkpoint, the logs, ``completions.jsonl``) could not be written: a full disk,
    a quota, a lost mount. The message names the file and what was being written; the run's last good
    checkpoint stays as it was."""


@contextmanager
def writing(what: str, path: object) -> Iterator[None]:
    """Inside, a failed write (an ``OSError``, or an error a library raised because of one, as Lightning's
    TensorBoard logger does) becomes a :class:`WriteError`: ``could not write <what> to <path>: <why>``.
    ``path`` may be a function that returns it, called only when a write failed."""
    try:
        yield
    except WriteError:
        raise
    except Exception as error:
        cause = os_error_in(error)
        if cause is None:
            raise
        where = path() if callable(path) else path
        raise WriteError(f"could not write {what} to {where}: {cause.strerror or cause}") from error


def os_error_in(error: BaseException) -> OSError | None:
    """``error`` if it is an ``OSError``, else the ``OSError`` it was raised from or while handling
    (``torch.save`` reports a failed write as a ``RuntimeError`` raised during the ``OSError``), else None."""
    seen: BaseException | None = error
    while seen is not None and not isinstance(seen, OSError):
        seen = seen.__cause__ or seen.__context__
    return seen
