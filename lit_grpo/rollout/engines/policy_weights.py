"""The policy's weights as a serving engine takes them: checkpoint names, adapters merged, shards gathered.

An engine that samples for the trainer (the colocated vLLM engine, a vLLM server) holds a plain
``transformers`` checkpoint's weights. :func:`hf_named_weights` yields the policy's as that
checkpoint would hold them, one tensor at a time (an FSDP2 shard gathered only when its turn comes):
without the wrappers' prefixes (peft, activation checkpointing, ``torch.compile``), and with every
LoRA adapter merged as ``merge_and_unload()`` would merge it, the policy itself never merged.
:func:`hf_weight_shapes` says what it will yield (names, dtypes, full shapes) without gathering or
merging anything: a receiver that sizes its buffers first (vLLM's weight transfer) needs that.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import torch

from lit_grpo.errors import ConfigError

__all__ = ["hf_named_weights", "hf_weight_shapes"]


def hf_named_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """A ``transformers`` model's weights under checkpoint names, detached.

    For a PEFT model, each adapter layer (LoRA of every kind peft has: plain, rsLoRA, DoRA's
    magnitude, ``lora_bias``, embedding and convolution adapters) is yielded as ``merge_and_unload()``
    would leave it: peft's own ``merge`` runs on a copy of that one layer (the policy is never merged,
    so repeated pushes cause no round-off drift), and its base layer's weights are yielded; the
    adapter weights themselves are not. A tuner layer that cannot merge is refused, naming it.
    DTensor (FSDP2) parameters are gathered one at a time with ``full_tensor()`` (a collective:
    every rank must iterate in the same order).
    """
    for name, parameter, adapter_layer in _weights_in_checkpoint_order(model):
        if adapter_layer is None:
            yield _checkpoint_name(name), _full(parameter.detach())
        else:
            for base_name, tensor in _merged_layer(name, adapter_layer):
                yield _checkpoint_name(base_name), tensor


def hf_weight_shapes(model: torch.nn.Module) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """``(name, dtype, full shape)`` of every tensor :func:`hf_named_weights` yields, in its order,
    without gathering a shard or merging an adapter (a merged layer has its base layer's shapes)."""
    shapes = []
    for name, parameter, adapter_layer in _weights_in_checkpoint_order(model):
        if adapter_layer is None:
            shapes.append((_checkpoint_name(name), parameter.dtype, tuple(parameter.shape)))
            continue
        base = adapter_layer.get_base_layer()
        prefix = name + ".base_layer" if base is not adapter_layer else name
        shapes += [(_checkpoint_name(f"{prefix}.{key}"), tensor.dtype, tuple(tensor.shape))
                   for key, tensor in base.named_parameters(recurse=True)]
    return shapes


def _weights_in_checkpoint_order(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor | None, torch.nn.Module | None]]:
    """``(name, parameter, None)`` for a plain parameter, ``(layer name, None, layer)`` once for each
    adapter layer (where its first parameter comes), in ``named_parameters`` order."""
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:  # pragma: no cover
        BaseTunerLayer = ()
    tuner_layers = {name: module for name, module in model.named_modules()
                    if BaseTunerLayer and isinstance(module, BaseTunerLayer)}
    done: set[str] = set()
    for name, parameter in model.named_parameters(remove_duplicate=True):
        owner = next((layer for layer in tuner_layers if name.startswith(layer + ".")), None)
        if owner is None:
            if "original_module" not in name:
                yield name, parameter, None
        elif owner not in done:
            done.add(owner)
            yield owner, None, tuner_layers[owner]


def _merged_layer(name: str, layer: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of the base layer of the adapter layer ``name`` with its active adapters
    merged by peft, computed on a full (gathered) copy of that layer."""
    if not callable(getattr(layer, "merge", None)) or not callable(getattr(layer, "get_base_layer", None)):
        raise ConfigError(f"model.lora: the adapter layer {name} ({type(layer).__name__}) cannot be merged into the "
                          "weights the vllm engine serves; use model.generation_backend: lit for it")
    if layer.merged:  # merged in place already: the base layer holds the weights
        base = layer.get_base_layer()
        for key, tensor in base.named_parameters(recurse=True):
            yield f"{name}.base_layer.{key}", _full(tensor.detach())
        return
    merged = copy.deepcopy(layer)
    with torch.no_grad():
        for module in merged.modules():
            for key, parameter in list(module._parameters.items()):
                if parameter is not None and hasattr(parameter, "full_tensor"):
                    module._parameters[key] = torch.nn.Parameter(parameter.full_tensor(), requires_grad=False)
        try:
            merged.merge(safe_merge=False, adapter_names=list(layer.active_adapters))
        except Exception as error:  # noqa: BLE001 - peft's own reason (a quantized base layer, ...)
            raise ConfigError(f"model.lora: peft cannot merge the adapter layer {name} ({type(layer).__name__}) "
                              f"for the vllm engine: {error}") from error
    base = merged.get_base_layer()
    prefix = name + ".base_layer" if base is not merged else name
    for key, tensor in base.named_parameters(recurse=True):
        yield f"{prefix}.{key}", tensor.detach()


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _checkpoint_name(name: str) -> str:
    name = name.removeprefix("base_model.model.")
    for part in (".base_layer", "_checkpoint_wrapped_module.", "_orig_mod.", ".modules_to_save.default"):
        name = name.replace(part, "")
    return name
