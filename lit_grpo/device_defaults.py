"""Settings whose best value depends on the device, resolved when a run knows its device.

Some defaults were tuned on 2-core CPUs, where a step runs close to the matrix-multiply floor and
every padded token or repeated prompt costs time. A GPU is the other way round: a forward of 1,024
tokens leaves an H100 mostly idle. The settings below take ``auto`` (their default), resolved here,
once, at the start of a run (``GRPOModule.setup``) and said in one line:

* ``forward_token_budget`` (padded tokens per log-prob forward, and per chunk of a training
  micro-batch's forward and backward): 1,024 on the CPU (measured: bench/README.md at d59a9c4). On CUDA, what
  a quarter of the free memory holds at the start of the run, given the bytes one token costs in a
  forward with gradient: its float32 logits three times over (logits, log-softmax, their gradient:
  ``vocab_size * 12``) and about 20 half-precision activations of ``hidden_size`` per layer; never
  below 1,024, in multiples of 256. Elsewhere (MPS, ...): no cap.
* ``share_prompt_forward`` (encode each distinct prompt once, its completions attending to its KV
  cache): on on the CPU, where it was measured to pay; off on other devices, where the fused
  attention kernels it replaces by its own path have not been measured against it.
* ``padding_free`` (the rows of each log-prob forward packed into one sequence,
  :mod:`lit_grpo.train.packed_forward`): off on the CPU, where packing in chunks of real tokens
  measured level with the length chunks (they already leave little padding; ``transformers``'
  packed path there is a block-diagonal mask over all ``T x T`` scores) and one packed sequence
  without a budget slower (measured: ``bench/padding_free.py``, bench/results/padding_free_cpu.md); on CUDA on where the
  model's attention is ``flash_attention_2``/``flash_attention_3`` (the variable-length kernel,
  no wasted scores), off otherwise.

The other CPU-era settings keep one default everywhere, for these reasons: ``group_by_length`` and
``skip_zero_gradient_rows`` skip work (padding, backward passes with a zero gradient) whatever the
device; ``generation_backend: lit`` is the sampler tested greedy-equal to ``generate`` on every
backend (``vllm`` is the fast one on GPUs, but an optional extra).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["AUTO", "CPU_DEFAULTS", "VARLEN_ATTENTION", "describe", "device_defaults", "for_run"]

AUTO = "auto"
CPU_DEFAULTS: dict[str, Any] = {"forward_token_budget": 1024, "share_prompt_forward": True, "padding_free": False}
# attention implementations with a variable-length kernel: padded rows packed waste no attention scores
VARLEN_ATTENTION = frozenset({"flash_attention_2", "flash_attention_3"})
MIN_GPU_TOKEN_BUDGET = 1024


def device_defaults(device: torch.device, model_config: Any = None, free_bytes: int | None = None) -> dict[str, Any]:
    """The value of every ``auto`` setting on ``device`` (``model_config``: the policy's config;
    ``free_bytes``: the device's free memory, read from CUDA when not given)."""
    if device.type == "cpu":
        return dict(CPU_DEFAULTS)
    budget = None
    if device.type == "cuda":
        if free_bytes is None:
            free_bytes, _ = torch.cuda.mem_get_info(device)
        budget = cuda_token_budget(free_bytes, model_config)
    config = getattr(model_config, "text_config", None) or model_config
    varlen = device.type == "cuda" and getattr(config, "_attn_implementation", None) in VARLEN_ATTENTION
    return {"forward_token_budget": budget, "share_prompt_forward": False, "padding_free": varlen}


def cuda_token_budget(free_bytes: int, model_config: Any) -> int:
    """Padded tokens whose forward with gradient fits a quarter of ``free_bytes`` (see the module doc)."""
    config = getattr(model_config, "text_config", None) or model_config
    vocab = getattr(config, "vocab_size", 32_000)
    layers, hidden = getattr(config, "num_hidden_layers", 32), getattr(config, "hidden_size", 4096)
    bytes_per_token = vocab * 4 * 3 + layers * hidden * 2 * 20
    tokens = int(free_bytes * 0.25 // bytes_per_token) // 256 * 256
    return max(MIN_GPU_TOKEN_BUDGET, tokens)


def describe(device: torch.device, settings: dict[str, Any], resolved: dict[str, Any]) -> str:
    """One line: the value each device-dependent setting has in this run, and where it came from."""
    parts = [f"{name}={resolved[name] if settings.get(name) == AUTO else settings.get(name)}"
             f"{' (auto)' if settings.get(name) == AUTO else ''}" for name in resolved]
    return f"settings for {device.type}: " + ", ".join(parts)


def for_run(device: torch.device, policy: torch.nn.Module | None, settings: dict[str, Any]) -> dict[str, Any]:
    """:func:`device_defaults` for a run's policy on ``device``, said once (rank 0) with :func:`describe`."""
    from lightning.pytorch.utilities import rank_zero_info

    resolved = device_defaults(device, getattr(policy, "config", None))
    rank_zero_info(describe(device, settings, resolved))
    return resolved
