"""Secrets kept out of what a run writes: its ``config.yaml``, ``hparams.yaml``, checkpoints, logger
hyperparameters (TensorBoard, W&B, ...).

What is a secret (:func:`is_secret_name`, case-insensitive, on the words of a setting's name: split
at ``_``, ``-``, ``.``, spaces and lower-to-upper case changes, so ``apiKey`` is ``api key``):

- a name with the word ``secret``, ``password``, ``passwd``, ``passphrase``, ``credential(s)``,
  ``apikey`` or ``authorization`` in it (``client_secret``, ``db_password``, ``credentials``);
- a name whose last word is ``token`` (``token``, ``hf_token``, ``access_token``, ``refresh_token``, as
  Hugging Face's ``TrainingArguments`` masks ``*_token``; a bare ``token`` is the Hub token of
  ``from_pretrained``), except a tokenizer's special tokens and a chat template's markers (``pad_token``,
  ``eos_token``, ``think_token``, ``im_start_token``, ``tool_call_token``, ... :data:`SPECIAL_TOKENS`);
  counts and positions (``bytes_per_token``, ``first_token``, :data:`COUNTING_TOKEN_WORDS`), ``max_tokens``,
  ``tokenizer``, ``token_ids`` are kept;
- a name whose last word is ``key`` or ``keys`` after a word that says it is a credential (``api_key``,
  ``api_keys``, ``access_key``, ``private_key``, ``ssh_key``, ... :data:`CREDENTIAL_KEY_WORDS`); a bare
  ``key`` and a column's or a sort's key (``answer_key``, ``prompt_key``, ``sort_key``) are kept;

and in any string, wherever it is: the credentials of a URL (``scheme://user:PASSWORD@host``, or a
user alone, which may be a token: ``https://TOKEN@host``), URL query parameters with a secret name or
a signature's (``?api_key=...``, ``key=``, ``sig=``, ``signature=``, ``X-Amz-Signature=``), and the
credentials of an HTTP authorization (``Authorization: Basic ...``, ``Bearer ...``).

Under a secret name every string is redacted (a dict of credentials, a list of keys), and so is a number
right under one (``api_key: 123456``); other values (``use_auth_token: true``) are kept. Dataclasses
(a ``RewardSpec`` given in Python) are written as the mappings YAML gives, ``argparse`` namespaces as
namespaces. Redacted values read :data:`REDACTED`. Only what is
written is redacted: the run keeps the real values. No framework imports here.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import re
from collections.abc import Mapping
from typing import Any

__all__ = ["CREDENTIAL_KEY_WORDS", "REDACTED", "SPECIAL_TOKENS", "is_secret_name", "redact_command", "redact_message",
           "redact_secrets", "redact_text", "restore_redacted", "without_redacted"]

REDACTED = "<redacted>"

SECRET_WORDS = frozenset({"secret", "secrets", "password", "passwd", "passphrase", "credential", "credentials",
                          "apikey", "authorization"})
# the words before ``token`` of a tokenizer's special tokens (transformers' SPECIAL_TOKENS_ATTRIBUTES, the media
# placeholders of multimodal processors) and of a chat template's markers (think_token, im_start_token,
# tool_call_token): settings, not secrets
SPECIAL_TOKENS = frozenset({"bos", "eos", "unk", "sep", "pad", "cls", "mask", "image", "video", "audio", "think",
                            "thinking", "reasoning", "answer", "stop", "end", "start", "begin", "eot", "eom",
                            "call", "response", "placeholder", "separator", "newline", "vision"})
# the words before ``token`` that make it a count, a rate or a position (bytes_per_token, first_token, num_token,
# reward_token, target_token): settings, not secrets
COUNTING_TOKEN_WORDS = frozenset({"per", "first", "last", "next", "target", "reward", "num"})
# the words before ``key``/``keys`` that make it a credential (api_key, ssh_key); others are a column's or a
# lookup's key (answer_key, sort_key): settings, not secrets
CREDENTIAL_KEY_WORDS = frozenset({"api", "access", "secret", "private", "signing", "encryption", "decryption", "auth",
                                  "client", "ssh", "session", "master", "license", "subscription", "service", "app",
                                  "account", "developer", "shared", "storage", "sas", "hmac", "openai", "anthropic",
                                  "hf", "wandb", "aws", "azure", "gcp", "google", "github", "stripe"})
# URL query parameters that hold a secret beside the secret names: a key (Google's ``key=``), a signed URL's
# signature (Azure's ``sig=``, S3's ``X-Amz-Signature=``, ``signature=``)
QUERY_SECRET_NAMES = frozenset({"key", "sig", "signature"})

_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+")  # HFToken -> HF, Token; api_key -> api, key
_URL_CREDENTIALS = re.compile(r"(?P<scheme>\b[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<user>[^\s:/?#@]*)(?::(?P<password>[^\s/?#@]*))?@")
_QUERY_PARAMETER = re.compile(r"(?P<before>[?&;])(?P<name>[^\s=&;#]+)=(?P<value>[^\s&;#]*)")
# an HTTP authorization: "Authorization: Basic CREDENTIALS", "Authorization: CREDENTIALS", "Bearer TOKEN"
# a setting written in a message: NAME=VALUE, NAME: VALUE, 'NAME': 'VALUE' (a dict's repr); its value is read only
# after a secret name, so that a setting's value never swallows the secret assignment after it (a: token=x)
_NAME = re.compile(r"""(?P<name>\b[A-Za-z_][\w.-]*)(?P<separator>['"]?\s*[:=]\s*)""")
# the value of a secret written in a message, quoted or bare ({...} and [...] are taken whole: _bracketed_end)
_VALUE = re.compile(r"""'(?P<single>[^']*)'|"(?P<double>[^"]*)"|(?P<bare>[^\s'",;(){}\[\]]+)""")
_NUMBER = re.compile(r"^-?\d+(?:\.\d+)?$")
_AUTHORIZATION_SCHEMES = frozenset({"basic", "bearer", "digest", "token"})
# what a hint writes in a secret's place (export VLLM_API_KEY=KEY, =$(python -c ...), =${HF_TOKEN}, =...): no secret
_PLACEHOLDER = re.compile(r"^(?:[A-Z_]+|\$.*|\.\.\.|<[^>]*>?)$")
_AUTHORIZATION = re.compile(r"(?P<before>\b(?:proxy-)?authorization\s*[:=]\s*(?:(?:basic|bearer|digest|token)\s+)?"
                            r"|\bbearer\s+)(?P<value>[A-Za-z0-9\-._~+/]+=*)", re.IGNORECASE)


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
        return len(words) == 1 or words[-2] not in SPECIAL_TOKENS | COUNTING_TOKEN_WORDS
    return words[-1] in ("key", "keys") and len(words) > 1 and words[-2] in CREDENTIAL_KEY_WORDS


def redact_text(text: str) -> str:
    """``text`` with the credentials of every URL in it and the values of secret-named query parameters
    replaced by :data:`REDACTED`; any other text unchanged."""

    def credentials(match: re.Match) -> str:
        if match.group("password") is None:  # a user alone: often a token (https://TOKEN@github.com)
            return f"{match.group('scheme')}{REDACTED}@" if match.group("user") else match.group(0)
        return f"{match.group('scheme')}{match.group('user')}:{REDACTED}@"

    def parameter(match: re.Match) -> str:
        name = match.group("name")
        secret = is_secret_name(name) or name.lower() in QUERY_SECRET_NAMES or name_words(name)[-1:] == ["signature"]
        if not secret or not match.group("value"):
            return match.group(0)
        return f"{match.group('before')}{name}={REDACTED}"

    if "://" in text or "=" in text:
        text = _QUERY_PARAMETER.sub(parameter, _URL_CREDENTIALS.sub(credentials, text))
    return _AUTHORIZATION.sub(lambda match: f"{match.group('before')}{REDACTED}", text)


def redact_message(text: str) -> str:
    """A message that may quote settings (an ``error:`` line, a warning, a command line) as it may be shown or
    logged: :func:`redact_text`, and the value of every setting with a secret name written in it
    (``token=hf_...``, ``api_key: sk-...``, ``{'password': '...'}``, ``{'credentials': {...}}``,
    ``--model.model_init_kwargs.token=hf_...``) as :data:`REDACTED`; a list or a dict under a secret name whole.
    A plain number is kept unless the name says key, secret or password (``first_token=12``). Only for
    messages: a setting's own text (a prompt, a template) goes through :func:`redact_text` alone, so that
    prose like ``token = x`` in it is written as given."""
    text = redact_text(text)
    shown, position = [], 0
    for name in _NAME.finditer(text):
        if name.start() < position or not is_secret_name(name.group("name")):
            continue
        start = name.end()
        if text[start:start + 1] in ("{", "["):
            end, replacement = _bracketed_end(text, start), REDACTED
        else:
            value = _VALUE.match(text, start)
            if value is None or shown_as_is(name.group("name"), value.group("bare") or ""):
                continue
            quote = "'" if value.group("single") is not None else '"' if value.group("double") is not None else ""
            end, replacement = value.end(), f"{quote}{REDACTED}{quote}"
        shown += [text[position:start], replacement]
        position = end
    return "".join(shown) + text[position:]


def shown_as_is(name: str, bare: str) -> bool:
    """Whether the unquoted value ``bare`` written after the secret name ``name`` in a message is no secret:
    "Authorization: Bearer TOKEN" (the token is :func:`redact_text`'s), a hint's ``KEY`` or ``$(...)``, a
    count (``first_token=12``; a number under a key, secret or password is one)."""
    if bare.lower() in _AUTHORIZATION_SCHEMES or _PLACEHOLDER.match(bare):
        return True
    return bool(_NUMBER.match(bare)) and not {"key", "keys", "apikey", "secret", "password"}.intersection(name_words(name))


def _bracketed_end(text: str, start: int) -> int:
    """The end of the {...} or [...] that starts at ``text[start]`` (brackets in quotes counted too: a
    message is no parser's input), or the end of ``text`` where it is not closed."""
    depth = 0
    for index in range(start, len(text)):
        if text[index] in "{[":
            depth += 1
        elif text[index] in "}]":
            depth -= 1
            if depth == 0:
                return index + 1
    return len(text)


def redact_command(words: list[str]) -> list[str]:
    """A command line as it may be shown: :func:`redact_message` on every word, and the word after an option
    with a secret name (``--model.model_init_kwargs.token hf_...``, ``--api-key KEY``) as :data:`REDACTED`."""
    shown, after_secret_option = [], False
    for word in words:
        if after_secret_option and not word.startswith("--"):
            shown.append(REDACTED)
        else:
            shown.append(redact_message(word))
        after_secret_option = word.startswith("--") and "=" not in word and is_secret_name(word)
    return shown


def redact_secrets(value: Any, secret: bool = False) -> Any:
    """A copy of ``value`` (settings: mappings, lists, tuples, strings, numbers) with every string under a
    secret name (:func:`is_secret_name`; ``secret``: ``value`` itself is under one) replaced by
    :data:`REDACTED` and every other string passed through :func:`redact_text`. Mappings come back as
    dicts; anything else is returned as it is."""
    if isinstance(value, str):
        return REDACTED if secret and value else redact_text(value)
    if isinstance(value, Mapping):
        return {key: redacted_entry(str(key), item, secret) for key, item in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):  # written as YAML gives it: a mapping
        return {field.name: redacted_entry(field.name, getattr(value, field.name), secret)
                for field in dataclasses.fields(value)}
    if isinstance(value, argparse.Namespace):  # jsonargparse's too: the same type back
        namespace = copy.copy(value)
        for name, item in vars(value).items():
            setattr(namespace, name, redacted_entry(name, item, secret))
        return namespace
    if isinstance(value, list):
        return [redact_secrets(item, secret) for item in value]
    if isinstance(value, tuple):
        return tuple(redact_secrets(item, secret) for item in value)
    return value


def redacted_entry(name: str, value: Any, secret: bool) -> Any:
    """The value of the setting ``name`` (under a secret name already if ``secret``), redacted: a number right
    under a secret name too (``api_key: 123456``)."""
    if is_secret_name(name) and isinstance(value, (int, float)) and not isinstance(value, bool):
        return REDACTED
    return redact_secrets(value, secret or is_secret_name(name))


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
    if dataclasses.is_dataclass(given) and not isinstance(given, type):  # written as a mapping
        given = {field.name: getattr(given, field.name) for field in dataclasses.fields(given)}
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
