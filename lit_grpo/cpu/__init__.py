"""CPU-only tuning, behind a few entry points that do nothing on other devices.

Everything here only makes CPU runs faster or lighter; the values computed are those of the plain
PyTorch path (the measurements behind each piece: ``git show d59a9c4:bench/README.md``):

- :func:`prepare` (``GRPOModule.setup``, once per run on the CPU): glibc keeps freed memory for the
  next step (:mod:`lit_grpo.cpu.allocator`), and a warning where bf16 matmuls are emulated;
- :func:`sampling` (around each generation batch): bf16 linear weights reordered once for oneDNN
  (:mod:`lit_grpo.cpu.prepacked`) and attention in bf16/fp16 as matrix products
  (:mod:`lit_grpo.cpu.attention`);
- :func:`half_attention` (around the log-prob forwards and each training micro-batch): that attention;
- :func:`kv_cache_block`: how the sampler's KV cache grows in CPU half precision.

Importing this package caps oneDNN's primitive cache (below), before the first bf16 matmul.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from lit_grpo.cpu.allocator import keep_freed_memory
from lit_grpo.cpu.attention import (
    HALF_DTYPES,
    cpu_compute_dtype,
    use_cpu_half_attention,
)
from lit_grpo.cpu.prepacked import prepacked_linear_weights

__all__ = ["KV_CACHE_BLOCK", "cpu_multiplies_bf16", "half_attention", "kv_cache_block", "prepare", "sampling"]

# oneDNN (PyTorch's CPU kernels for bf16 matmuls) keeps a compiled primitive for each of the last
# 1024 distinct shapes by default; GRPO's shapes change at every decode step and micro-batch chunk,
# so under bf16 that cache alone grew a 4M-parameter run's peak memory by about 385 MiB. 128 entries
# hold one step's training shapes: on a CPU with AMX, whose kernels are costly to compile, 16 (the
# earlier cap) made steps 9-13 % slower. Read by oneDNN at its first bf16 matmul; a value the user
# has set wins.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "128")

KV_CACHE_BLOCK = 32  # positions by which a CPU half-precision KV cache grows (generation.PreallocatedKVLayer)


def cpu_multiplies_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool | None:
    """Whether this CPU multiplies bf16 in hardware (the ``avx512_bf16`` or ``amx_bf16`` flag of Linux's
    ``/proc/cpuinfo``); None where that cannot be read. Without them PyTorch emulates bf16 matmuls,
    several to tens of times slower than float32 (1 thread: 31 vs 115 GFLOP/s on an AVX-512 Xeon; on an
    AMD EPYC with AVX2 only, 1.3-2.3 vs 70-78 GFLOP/s for ``torch.matmul`` and 10x slower linear
    layers, ``bench/results/fused_projections_zen3.md`` at d59a9c4)."""
    try:
        with open(cpuinfo) as file:
            flags = next((line.split(":", 1)[1].split() for line in file if line.startswith("flags")), None)
    except OSError:
        return None
    if flags is None:
        return None
    return "avx512_bf16" in flags or "amx_bf16" in flags


def prepare(device: torch.device, precision: str, model: torch.nn.Module | None) -> None:
    """Once per run, before the first step: on the CPU, keep freed memory in the process and warn
    where bf16 would be emulated; nothing on other devices."""
    if device.type != "cpu":
        return
    keep_freed_memory()  # no page faults for memory freed by the previous step
    bf16_weights = model is not None and any(p.dtype == torch.bfloat16 for p in model.parameters())
    if (str(precision).startswith("bf16") or bf16_weights) and cpu_multiplies_bf16() is False:
        from lightning.pytorch.utilities import rank_zero_warn

        rank_zero_warn(
            f"bf16 on this CPU (trainer.precision={precision}, bf16 weights: {bf16_weights}) is emulated: it has no "
            "avx512_bf16/amx_bf16 instructions, so bf16 matmuls run several to tens of times slower than float32; "
            "use trainer.precision: 32-true here"
        )


@contextmanager
def sampling(model: torch.nn.Module, device: torch.device) -> Iterator[None]:
    """Around one generation batch: prepacked bf16 weights and half-precision attention as matrix
    products, where each applies (on the CPU in bf16/fp16); otherwise nothing changes."""
    with prepacked_linear_weights(model, device), use_cpu_half_attention(model):
        yield


def half_attention(model: torch.nn.Module):
    """Around forwards (log-probs, training): half-precision attention as matrix products on the CPU."""
    return use_cpu_half_attention(model)


def kv_cache_block(model: torch.nn.Module, device: torch.device) -> int | None:
    """The block by which the sampler's KV cache grows when ``model`` computes in bf16/fp16 on the
    CPU (its attention then reads the whole buffer, :mod:`lit_grpo.cpu.attention`); None elsewhere:
    one buffer of the full length."""
    half = device.type == "cpu" and cpu_compute_dtype(model) in HALF_DTYPES
    return KV_CACHE_BLOCK if half else None
