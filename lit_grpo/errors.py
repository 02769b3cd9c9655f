"""Errors in what the user gave (a setting, the data, a model path, a reward), as opposed to bugs.

``lit-grpo`` ends a run that raises a :class:`UserError` with its message alone, one short
``error: ...`` line on stderr and exit status 2, without a traceback (``LIT_GRPO_TRACEBACK=1`` shows
it); any other exception is an internal error and shows its traceback. Each class also derives
from the built-in exception it has always been (``ValueError``, ``FileNotFoundError``, ...), so code
that catches those keeps working.
"""

from __future__ import annotations

__all__ = ["ConfigError", "DataError", "FileInTheWayError", "MissingFileError", "ModelLoadError", "UserError"]


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
