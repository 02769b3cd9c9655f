"""Secrets kept out of what a run writes: its ``config.yaml``, ``hparams.yaml``, checkpoints, logger
hyperparameters (TensorBoard, W&B, ...).

What is a secret (:func:`is_secret_name`, case-insensitive, on the words of a setting's name: split
at ``_``, ``-``, ``.``, spaces and lower-to-upper case changes, so ``apiKey`` is ``api key``):

- a name with the word ``secret``, ``password``, ``passwd``, ``passphrase``, ``credential(s)``,
  ``apikey`` or ``authorization`` in it (``client_secret``, ``db_password``, ``credentials``);
- a name whose last word is ``token`` (``token``, ``hf_token``, ``access_token``, as Hugging Face's
  ``TrainingArguments`` masks ``*_token``), except a tokenizer's special tokens (``pad_token``,
  ``eos_token``, ... :data:`SPECIAL_TOKENS`); ``max_tokens``, ``tokenizer``, ``token_ids`` are kept;
- a name whose last word is ``key`` after another word (``api_key``, ``access_key``, ``private_key``);
  a bare ``key`` (a lookup key, a column) is kept;

and in any string, wherever it is: the credentials of a URL (``scheme://user:PASSWORD@host``, or a
user alone, which may be a token: ``https://TOKEN@host``) and URL query parameters with a secret
name (``?api_key=...``).

Under a secret name every string is redacted (a dict of credentials, a list of keys); other values
(``use_auth_token: true``, a number) are kept. Redacted values read :data:`REDACTED`. Only what is
written is redacted: the run keeps the real values. No framework imports here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

__all__ = ["REDACTED", "SPECIAL_TOKENS", "is_secret_name", "redact_secrets", "redact_text", "restore_redacted", "without_redacted"]

REDACTED = "<redacted>"

SECRET_WORDS = frozenset({"secret", "secrets", "password", "passwd", "passphrase", "credential", "credentials",
                          "apikey", "authorization"})
# the words before ``token`` of a tokenizer's special tokens (transformers' SPECIAL_TOKENS_ATTRIBUTES and the
# media placeholders of multimodal processors): settings, not secrets
SPECIAL_TOKENS = frozenset({"bos", "eos", "unk", "sep", "pad", "cls", "mask", "image", "video", "audio"})

_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+")  # HFToken -> HF, Token; api_key -> api, key
_URL_CREDENTIALS = re.compile(r"(?P<scheme>\b[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<user>[^\s:/?#@]*)(?::(?P<password>[^\s/?#@]*))?@")
_QUERY_PARAMETER = re.compile(r"(?P<before>[?&;])(?P<name>[^\s=&;#]+)=(?P<value>[^\s&;#]*)")


def name_words(name: str) -> list[str]:
    """The words of a setting's name, lower case: ``"openaiApiKey"`` -> ``["openai", "api", "key"]``."""
    return [word.lower() for word in _WORD.findall(name)]


def is_secret_name(name: str) -> bool:
    """Whether a setting called ``name`` holds a secret (the rule of the module's docstring)."""
    words = name_words(name)
    if not words:
        return False
    if SECRET_WORDS.intersection(words):
        return True
    if words[-1] == "token":
        return len(words) == 1 or words[-2] not in SPECIAL_TOKENS
    return words[-1] == "key" and len(words) > 1


def redact_text(text: str) -> str:
    """``text`` with the credentials of every URL in it and the values of secret-named query parameters
    replaced by :data:`REDACTED`; any other text unchanged."""

    def credentials(match: re.Match) -> str:
        if match.group("password") is None:  # a user alone: often a token (https://TOKEN@github.com)
            return f"{match.group('scheme')}{REDACTED}@" if match.group("user") else match.group(0)
        return f"{match.group('scheme')}{match.group('user')}:{REDACTED}@"

    def parameter(match: re.Match) -> str:
        if not is_secret_name(match.group("name")) or not match.group("value"):
            return match.group(0)
        return f"{match.group('before')}{match.group('name')}={REDACTED}"

    if "://" not in text and "=" not in text:
        return text
    return _QUERY_PARAMETER.sub(parameter, _URL_CREDENTIALS.sub(credentials, text))


def redact_secrets(value: Any, secret: bool = False) -> Any:
    """A copy of ``value`` (settings: mappings, lists, tuples, strings, numbers) with every string under a
    secret name (:func:`is_secret_name`; ``secret``: ``value`` itself is under one) replaced by
    :data:`REDACTED` and every other string passed through :func:`redact_text`. Mappings come back as
    dicts; anything else is returned as it is."""
    if isinstance(value, str):
        return REDACTED if secret and value else redact_text(value)
    if isinstance(value, Mapping):
        return {key: redact_secrets(item, secret or is_secret_name(str(key))) for key, item in value.items()}
    if isinstance(value, list):
        return [redact_secrets(item, secret) for item in value]
    if isinstance(value, tuple):
        return tuple(redact_secrets(item, secret) for item in value)
    return value


def without_redacted(value: Any) -> Any:
    """A copy of ``value`` without the mapping entries whose value is :data:`REDACTED`: settings read back
    from a redacted file, for a caller whose library finds the secret itself when it is not given (a
    ``token`` of ``from_pretrained``: ``huggingface_hub`` reads ``HF_TOKEN``)."""
    if isinstance(value, Mapping):
        return {key: without_redacted(item) for key, item in value.items() if item != REDACTED}
    if isinstance(value, list):
        return [without_redacted(item) for item in value]
    return value


def restore_redacted(written: Any, given: Any, where: str = "") -> Any:
    """``written`` (settings read back from a redacted file) with every value that was redacted taken from
    ``given`` (the same settings as the user gives them now) at the same place: where ``given``'s value,
    redacted, is what was written. Raises ``LookupError(where)`` for a redacted value that ``given``
    does not have (``where``: its place, ``rewards[0].args.api_key``)."""
    if isinstance(written, str) and REDACTED in written:
        if isinstance(given, str) and redact_text(given) == written or written == REDACTED and given is not None:
            return given
        raise LookupError(where)
    if isinstance(written, Mapping):
        given = given if isinstance(given, Mapping) else {}
        return {key: restore_redacted(item, given.get(key), f"{where}.{key}" if where else str(key))
                for key, item in written.items()}
    if isinstance(written, list):
        given = given if isinstance(given, list) else []
        return [restore_redacted(item, given[index] if index < len(given) else None, f"{where}[{index}]")
                for index, item in enumerate(written)]
    return written
