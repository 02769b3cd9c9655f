"""The padding-free forward of a chunk of rows (``model.padding_free``).

The rows of one log-prob forward (prompt + completion, :mod:`lit_grpo.train.packing`) go through the
model as ONE sequence ``[1, T]`` with ``position_ids`` restarting at 0 per row and no attention
mask, which is how ``transformers`` (5.24, ``masking_utils.find_packed_sequence_indices``) recognises
packed sequences: ``sdpa``/``eager`` (and lit-grpo's CPU half-precision attention, which takes the
same masks) get a block-diagonal causal mask, ``flex_attention`` a block mask, and
``flash_attention_2/3`` the variable-length kernel, to which the rows' ``cu_seqlens`` are also
given (``cu_seq_lens_q/k``, ``max_length_q/k``): ``transformers`` would infer them from the position
ids (``_is_packed_sequence``, then ``prepare_fa_kwargs_from_position_ids``), but that reads the
position ids' values, a device synchronisation in every layer. Every token then attends to exactly what it
attended to in the padded forward, at the same position: the values and gradients are the padded
forward's. Only the positions that predict completion tokens come back, in the padded layout
``[n, C, ...]`` (0 at padding): the hidden states for the fused LM head, or the model's logits of
those positions only (``logits_to_keep`` as an index).

The flash-attention path is the code path on CUDA but is untested here (no GPU in the test suite).
"""

from __future__ import annotations

import torch
from lightning.pytorch.utilities import rank_zero_info

from lit_grpo import models
from lit_grpo.cpu.attention import NAME as CPU_HALF_ATTENTION
from lit_grpo.device_defaults import VARLEN_ATTENTION
from lit_grpo.errors import ConfigError
from lit_grpo.train.packing import PackedRows, pack_rows

__all__ = ["PACKED_ATTENTION", "PACKED_MODEL_TYPES", "check_packing", "packed_hidden_states", "packed_inputs", "packed_logits", "packing_unsupported"]

# attention implementations that keep packed rows apart given restarting position ids (the CPU's
# half-precision attention takes sdpa's masks)
PACKED_ATTENTION = frozenset({"sdpa", "eager", "flex_attention", CPU_HALF_ATTENTION}) | VARLEN_ATTENTION
# model types whose decoders build their masks from the position ids (``create_causal_mask(position_ids=...)``):
# today those whose head is known to be linear (checked in transformers 5.24), a separate fact all the same
PACKED_MODEL_TYPES = models.FUSED_HEAD_MODEL_TYPES


def attention_implementation(model: torch.nn.Module) -> str | None:
    """The model's attention implementation (``config._attn_implementation``), None if it has none."""
    return getattr(models.text_config(model), "_attn_implementation", None)


def packing_unsupported(model: torch.nn.Module) -> str | None:
    """Why the rows of ``model``'s forwards cannot be packed into one sequence (None when they can):
    an attention implementation not known to keep packed rows apart, a model type not known to build
    its mask from the position ids, or sliding-window/linear-attention layers (one line that names the
    model's attention implementation)."""
    implementation = attention_implementation(model)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    model_type = getattr(getattr(base, "config", None), "model_type", None)
    if implementation not in PACKED_ATTENTION:
        return f"the model's attention implementation {implementation!r} is not one of {sorted(PACKED_ATTENTION)}"
    if model_type not in PACKED_MODEL_TYPES:
        return f"{type(base).__name__} (model_type {model_type!r}, attention {implementation!r}) is not known to mask packed rows apart"
    partial = models.partial_kv_cache_reason(model)
    if partial is not None:
        return f"{type(base).__name__} (attention {implementation!r}) has {partial}, whose masks packing cannot guarantee per row"
    return None


def check_packing(model: torch.nn.Module) -> None:
    """ConfigError (one line) where ``model.padding_free: true`` cannot hold for ``model``."""
    reason = packing_unsupported(model)
    if reason is not None:
        raise ConfigError(f"model.padding_free: true packs rows into one sequence, which this model cannot do: {reason}; "
                          "set model.padding_free: false (or auto)")


_ANNOUNCED: set[str] = set()  # the attention implementations whose packed forwards were said in the log


def packed_inputs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[PackedRows, dict]:
    """The rows ``[n, L]`` packed, and the keyword arguments of the model's packed forward (said once
    per attention implementation)."""
    implementation = attention_implementation(model)
    if implementation not in _ANNOUNCED:
        _ANNOUNCED.add(implementation)
        kernel = "the variable-length kernel" if implementation in VARLEN_ATTENTION else "a block-diagonal causal mask"
        rank_zero_info(f"model.padding_free: the rows of each log-prob forward go through the model as one sequence "
                       f"(attention {implementation!r}: {kernel})")
    packed = pack_rows(input_ids, attention_mask)
    kwargs = {"input_ids": packed.input_ids, "position_ids": packed.position_ids, "attention_mask": None, "use_cache": False}
    if implementation in VARLEN_ATTENTION:  # flash attention's variable-length layout, given outright
        kwargs.update(cu_seq_lens_q=packed.cu_seqlens, cu_seq_lens_k=packed.cu_seqlens,
                      max_length_q=packed.max_length, max_length_k=packed.max_length)
    return packed, kwargs


def packed_hidden_states(
    model: torch.nn.Module, head: models.OutputHead, input_ids: torch.Tensor, attention_mask: torch.Tensor, columns: int
) -> torch.Tensor:
    """The last hidden states ``[n, columns, H]`` of the last ``columns`` padded positions of the rows
    ``input_ids [n, L]``, from one packed forward (0 at padding)."""
    packed, kwargs = packed_inputs(model, input_ids, attention_mask)
    hidden = models.decoder_hidden_states(model, head, **kwargs)  # [1, T, H]
    start = input_ids.size(1) - columns
    return packed.unpack(hidden[:, packed.positions_from(start)], column=start)  # [n, columns, H]


def packed_logits(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, columns: int) -> torch.Tensor:
    """The model's logits ``[n, columns, V]`` at the last ``columns`` padded positions of the rows
    ``input_ids [n, L]``, from one packed forward that makes logits only there (0 at padding)."""
    packed, kwargs = packed_inputs(model, input_ids, attention_mask)
    start = input_ids.size(1) - columns
    logits = model(**kwargs, logits_to_keep=packed.positions_from(start)).logits  # [1, K, V]
    return packed.unpack(logits, column=start)  # [n, columns, V]
