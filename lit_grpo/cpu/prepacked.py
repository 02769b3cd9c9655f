"""Linear layers with prepacked bf16 weights while sampling on the CPU.

A bf16 matrix product on the CPU (oneDNN) first reorders the weight into the blocked layout its
kernels read (on CPUs with AMX, the tile layout), at every call. While a generation batch is
sampled the weights do not change, so :func:`prepacked_linear_weights` reorders each
``torch.nn.Linear`` weight once for the batch (``torch.ops.mkldnn._reorder_linear_weight``, the
packing ``torch.compile``'s CPU backend uses for frozen weights) and runs the layer as
``torch.ops.mkldnn._linear_pointwise`` on it. The outputs are the same bf16 values bit for bit:
the same kernels multiply the same operands, only the weight's reorder is hoisted out of the
decode loop. What it buys was measured with ``bench/ablation.py --against-commit`` (in git history:
``git show d59a9c4:bench/README.md``).

Taken only where it is exact and safe: on the CPU, without autograd, when the layer computes in
bf16 (bf16 autocast, or bf16 weights without autocast) and oneDNN has bf16 kernels on this CPU;
for plain ``torch.nn.Linear`` modules (LoRA's base and adapter layers included; not subclasses such
as quantized linears) whose weight is an ordinary tensor (not a sharded ``DTensor``). Every
other layer, and everything on other devices or in float32, runs as before.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from lit_grpo.cpu.attention import cpu_compute_dtype


def prepack_dtype(model: torch.nn.Module, device: torch.device) -> torch.dtype | None:
    """The dtype to prepack ``model``'s linear weights in on ``device`` (bf16), or None where the
    layers would not run through oneDNN's bf16 kernels or autograd is recording."""
    if device.type != "cpu" or torch.is_grad_enabled() or not torch.backends.mkldnn.is_available():
        return None
    dtype = cpu_compute_dtype(model)
    if dtype != torch.bfloat16 or not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return None
    return dtype


def packable(module: torch.nn.Module) -> bool:
    """A plain ``torch.nn.Linear`` with an ordinary CPU weight and no forward of its own."""
    return (
        type(module) is torch.nn.Linear
        and "forward" not in module.__dict__
        and type(module.weight.detach()) is torch.Tensor
        and module.weight.device.type == "cpu"
    )


@contextmanager
def prepacked_linear_weights(model: torch.nn.Module, device: torch.device) -> Iterator[int]:
    """Within the block every packable linear layer of ``model`` multiplies by a weight reordered
    once (see the module doc); yields how many layers that is (0 where :func:`prepack_dtype` says
    no). The layers are restored on exit, exceptions included; the weights must not change inside."""
    dtype = prepack_dtype(model, device)
    layers = [module for module in model.modules() if packable(module)] if dtype is not None else []
    for layer in layers:
        weight = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach().to(dtype), None)  # [out, in], blocked
        bias = layer.bias.detach().to(dtype) if layer.bias is not None else None

        def forward(input: torch.Tensor, weight: torch.Tensor = weight, bias: torch.Tensor | None = bias) -> torch.Tensor:
            return torch.ops.mkldnn._linear_pointwise(input.to(dtype), weight, bias, "none", [], "")  # [..., out]

        layer.forward = forward
    try:
        yield len(layers)
    finally:
        for layer in layers:
            del layer.forward
