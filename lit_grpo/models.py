"""Building the policy: loading a causal LM, gradient checkpointing, and LoRA adapters through peft.

:class:`~lit_grpo.train.module.GRPOModule` calls :func:`build_policy` from ``configure_model`` and the
export (:mod:`lit_grpo.run.export`) calls it to rebuild the same policy from a checkpoint's
hyperparameters, so a trained policy is assembled the same way wherever it is used.

With LoRA (``model.lora``) the base weights are frozen and only the adapter trains. That gives two
savings this module implements:

* the KL reference needs no second copy of the weights: it is the policy itself with its adapter
  switched off (:func:`reference_model`, peft's ``disable_adapter``);
* a checkpoint needs only the adapter: the frozen base weights are those of
  ``model.model_name_or_path`` and are loaded from there again (:func:`drop_frozen_weights` from
  the module's state dict, so from every checkpoint, sharded or not; :func:`add_frozen_weights` on
  load).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import os
import re
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.tuners_utils import BaseTunerLayer
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from lit_grpo.algorithm.fused_lm_head import LinearHead, linear_head
from lit_grpo.errors import ConfigError, MissingFileError, ModelLoadError

__all__ = [
    "HALF_DTYPES",
    "ADAPTER_CONFIG",
    "LORA_DEFAULTS",
    "adapter_base_model",
    "check_trainable_dtype",
    "compute_dtype",
    "half_precision_trainable_weights",
    "reference_init_kwargs",
    "add_frozen_weights",
    "build_policy",
    "build_reference",
    "model_label",
    "cache_argument",
    "FUSED_HEAD_MODEL_TYPES",
    "OutputHead",
    "decoder_hidden_states",
    "output_head",
    "disable_dropout",
    "drop_frozen_weights",
    "enable_gradient_checkpointing",
    "completion_end_token_ids",
    "load_causal_lm",
    "load_tokenizer",
    "lora_config",
    "model_init_kwargs",
    "partial_kv_cache_reason",
    "reference_model",
    "text_config",
    "without_frozen_policy_weights",
]

# What ``model.lora`` adds to peft's own LoraConfig defaults (r 8, lora_alpha 8, lora_dropout 0):
# adapters on every linear layer except the output head, for a causal LM.
LORA_DEFAULTS: dict[str, Any] = {"target_modules": "all-linear", "task_type": "CAUSAL_LM"}


# ----------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------


HALF_DTYPES = (torch.bfloat16, torch.float16)


def model_init_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """``model.model_init_kwargs`` for ``from_pretrained``, with a dtype name turned into a torch dtype.

    Without a dtype the weights load in float32, whatever dtype the checkpoint was saved in
    (transformers 5 would keep a bf16 checkpoint in bf16): trainable weights and their optimizer
    state are float32, as in TRL, and bf16 compute comes from ``trainer.precision: bf16-mixed``
    (under FSDP2 from a ``MixedPrecisionPolicy``, :func:`lit_grpo.distributed.shard_model`). In
    bf16, weights near 0.02 are about 1e-4 apart, so AdamW updates of a learning rate of 1e-6 would
    round away.
    """
    kwargs = dict(kwargs or {})
    key = "torch_dtype" if "torch_dtype" in kwargs and "dtype" not in kwargs else "dtype"
    dtype = kwargs.get(key)
    if dtype is None:
        kwargs[key] = torch.float32
    elif isinstance(dtype, str) and dtype != "auto":
        resolved = getattr(torch, dtype, None)
        if not isinstance(resolved, torch.dtype):
            raise ConfigError(f"model.model_init_kwargs.dtype {dtype!r} is not a torch dtype (e.g. bfloat16, float32)")
        kwargs[key] = resolved
    return kwargs


def reference_init_kwargs(settings: dict[str, Any] | None, precision: str) -> dict[str, Any]:
    """``from_pretrained`` keyword arguments of the frozen KL reference model.

    It has no optimizer, so where the run computes in half precision (``trainer.precision``
    ``bf16-mixed``/``16-mixed``) and ``model.model_init_kwargs`` names no dtype, it loads in that
    half dtype: the same compute at half the memory. Otherwise as the policy (:func:`model_init_kwargs`).
    """
    kwargs = model_init_kwargs(settings)
    explicit = settings is not None and any(settings.get(key) is not None for key in ("dtype", "torch_dtype"))
    half = compute_dtype(precision)
    if not explicit and half is not None:
        kwargs["torch_dtype" if "torch_dtype" in kwargs else "dtype"] = half
    return kwargs


def compute_dtype(precision: str) -> torch.dtype | None:
    """The half dtype a Lightning ``trainer.precision`` computes in (``bf16-mixed`` -> bfloat16), or None."""
    precision = str(precision)
    if precision.startswith("bf16"):
        return torch.bfloat16
    if precision.startswith("16"):
        return torch.float16
    return None


def half_precision_trainable_weights(model: torch.nn.Module) -> list[tuple[str, torch.dtype]]:
    """The trainable parameters of ``model`` stored in bf16/fp16, with their dtype."""
    return [(name, p.dtype) for name, p in model.named_parameters() if p.requires_grad and p.dtype in HALF_DTYPES]


def check_trainable_dtype(model: torch.nn.Module, optimizer: torch.optim.Optimizer, precision: str) -> str | None:
    """Refuse half-precision trainable weights under a plain ``torch.optim`` optimizer.

    Raises ``ValueError`` naming the setting that made them half (``trainer.precision: bf16-true`` or
    ``model.model_init_kwargs.dtype``) and the fix; for another optimizer (which may round
    stochastically or keep float32 master weights itself) returns the same text as a warning to
    show; None when every trainable weight is float32.
    """
    half = half_precision_trainable_weights(model)
    if not half:
        return None
    name, dtype = half[0]
    dtype_name = str(dtype).removeprefix("torch.")
    if compute_dtype(precision) is not None and str(precision).endswith("-true"):
        cause = f"trainer.precision: {precision} casts the trainable weights to {dtype_name}"
        fix = f"use trainer.precision: {str(precision).replace('-true', '-mixed')} (float32 weights, {dtype_name} compute)"
    else:
        cause = f"model.model_init_kwargs.dtype loads the trainable weights in {dtype_name}"
        fix = (
            "remove model.model_init_kwargs.dtype (trainable weights then load in float32) and set "
            f"trainer.precision: {'bf16' if dtype == torch.bfloat16 else '16'}-mixed for {dtype_name} compute, "
            "or train a LoRA adapter (model.lora: its weights stay float32 over a frozen half-precision base)"
        )
    message = (
        f"{cause} ({len(half)} tensors, e.g. {name}): {type(optimizer).__name__} keeps its state in that dtype "
        f"and small updates round away (near 0.02, {dtype_name} values are about "
        f"{torch.finfo(dtype).eps * 0.02:.0e} apart; an update of lr 1e-6 vanishes). To fix: {fix}."
    )
    if type(optimizer).__module__.startswith("torch.optim"):
        raise ConfigError(message)
    return message


def completion_end_token_ids(model: torch.nn.Module, tokenizer) -> list[int]:
    """Every token id that ends a completion: the model's ``generation_config.eos_token_id`` (a
    list for chat models: Qwen2.5 ends a turn with ``<|im_end|>`` or ``<|endoftext|>``) and the
    tokenizer's EOS, in that order, without repeats."""
    config = getattr(model, "generation_config", None)
    configured = getattr(config, "eos_token_id", None)
    ids = [] if configured is None else [configured] if isinstance(configured, int) else list(configured)
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return list(dict.fromkeys(int(i) for i in ids))


def text_config(model: torch.nn.Module):
    """The configuration that holds the attention settings (the text part of a multimodal model)."""
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def partial_kv_cache_reason(model: torch.nn.Module) -> str | None:
    """Why a KV cache of this model may not hold the whole prompt, or the model is not a plain
    decoder (sliding-window or linear-attention layers, encoder-decoder); None for full attention."""
    config = text_config(model)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and any(kind != "full_attention" for kind in layer_types):
        return f"layer types {sorted(set(layer_types))}"
    if layer_types is None and getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "sliding-window attention"
    if getattr(config, "is_encoder_decoder", False):
        return "an encoder-decoder model"
    return None


def cache_argument(model: torch.nn.Module, cache) -> dict:
    """``{name: cache}`` for a forward call of ``model``: ``transformers`` 5.24 renamed the forward
    argument ``past_key_values`` to ``cache`` (the old name is deprecated, to be removed in 5.40).
    The name is the one the model's forward declares (behind a ``peft`` wrapper, its base model's),
    so models written for either version get their cache: a remote-code model that only knows
    ``past_key_values`` would silently ignore a ``cache`` keyword."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return {"cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values": cache}


# ----------------------------------------------------------------------------------------------
# The body and the output head apart (the fused LM head, lit_grpo.algorithm.fused_lm_head)
# ----------------------------------------------------------------------------------------------


# The causal LMs whose forward makes its logits as ``lm_head(last hidden state)``, then at most a
# multiplier (Cohere's ``logit_scale``, Granite's ``1 / logits_scaling``) or Gemma 2/3's soft-capping,
# which :class:`OutputHead` records (read from transformers 5.24's ``*ForCausalLM.forward``). For
# any other model the passes keep asking it for its logits (its head may do more).
FUSED_HEAD_MODEL_TYPES = frozenset({
    "llama", "mistral", "ministral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2",
    "gemma3_text", "granite", "granitemoe", "cohere", "cohere2", "phi", "phi3", "olmo2", "smollm3", "glm4",
    "deepseek_v3", "starcoder2",
})


@dataclasses.dataclass(frozen=True)
class OutputHead:
    """A causal LM's body and output head apart: ``logits = softcap(logit_scale * head(decoder(...)))``."""

    decoder: torch.nn.Module  # get_decoder(): its output's first field is the last hidden state [n, T, H]
    head: torch.nn.Module  # get_output_embeddings(): [.., H] -> [.., V] (a LoRA wrapper where the adapter is on it)
    vocab_size: int
    logit_scale: float = 1.0  # Cohere's logit_scale, 1 / Granite's logits_scaling
    softcapping: float | None = None  # Gemma 2/3's final_logit_softcapping: s * tanh(z / s)

    @property
    def is_linear_layer(self) -> bool:
        """Whether the head is a plain ``nn.Linear`` (not a LoRA wrapper or any other module)."""
        return isinstance(self.head, torch.nn.Linear)

    def description(self) -> str:
        """What the head is, for a message: a LoRA adapter on it, or its class's qualified name (and
        its weight's, where that is not a plain tensor)."""
        kind = f"{type(self.head).__module__}.{type(self.head).__qualname__}"
        if isinstance(self.head, BaseTunerLayer):
            return f"a LoRA adapter on lm_head ({kind})"
        weight = getattr(self.head, "weight", None)
        if isinstance(weight, torch.Tensor) and type(weight) not in (torch.Tensor, torch.nn.Parameter):
            return f"a {kind} whose weight is a {type(weight).__module__}.{type(weight).__qualname__}"
        return f"a {kind}"

    def fused(self, float32: bool = False) -> LinearHead | torch.nn.Module:
        """The head as :func:`~lit_grpo.algorithm.fused_lm_head.fused_token_logprobs` takes it, read now
        (after the model's forward, which gathers an FSDP2 head): its plain weight (and bias) for the
        custom backward, in float32 with ``float32`` (``model.cast_lm_head_to_fp32``); else the module
        itself, whose tiles are checkpointed (a LoRA wrapper, a weight that is still a DTensor, a
        quantised weight), which ``float32`` refuses (ConfigError) rather than dropping the cast."""
        linear = linear_head(self.head, float32)
        if linear is None and float32:
            raise ConfigError("model.cast_lm_head_to_fp32 needs the fused LM head on a torch.nn.Linear of plain "
                              f"tensors; the head is {self.description()}")
        return linear or self.head


def output_head(model: torch.nn.Module) -> OutputHead | str:
    """The body and head of ``model`` (behind a ``peft`` wrapper, its base model's) with the logit
    scaling and soft-capping read from its configuration, or why its logits cannot be made from its
    hidden states here (one line: the model type is not in :data:`FUSED_HEAD_MODEL_TYPES`)."""
    base = model.get_base_model() if isinstance(model, PeftModel) else model
    config = getattr(base, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in FUSED_HEAD_MODEL_TYPES:
        return f"{type(base).__name__} (model_type {model_type!r}) is not one whose head is known to be a linear layer"
    decoder, head = base.get_decoder(), base.get_output_embeddings()
    if decoder is base or head is None:
        return f"{type(base).__name__} has no separate decoder and output head"
    scale = 1.0
    if getattr(config, "logits_scaling", None):
        scale = 1.0 / config.logits_scaling
    elif getattr(config, "logit_scale", None) is not None:
        scale = float(config.logit_scale)
    vocab_size = getattr(head, "out_features", None) or config.vocab_size
    return OutputHead(decoder, head, int(vocab_size), scale, getattr(config, "final_logit_softcapping", None))


def decoder_hidden_states(model: torch.nn.Module, parts: OutputHead, **forward_kwargs: Any) -> torch.Tensor:
    """The last hidden states ``[n, T, H]`` of one forward of ``model`` that makes no logits.

    The model itself is called (not its decoder alone), with ``logits_to_keep`` an empty index
    (logits ``[n, 0, V]``), so everything around its forward still holds: a ``peft`` wrapper, FSDP2's
    hooks on the root unit (which gather the embeddings and the head), a cache in ``forward_kwargs``.
    The hidden states are the decoder's output, taken by a forward hook."""
    captured: list[torch.Tensor] = []

    def keep_hidden_states(module: torch.nn.Module, args: Any, output: Any) -> None:
        captured.append(output[0])  # a ModelOutput's or a tuple's first field: last_hidden_state

    device = forward_kwargs["input_ids"].device
    handle = parts.decoder.register_forward_hook(keep_hidden_states)
    try:
        model(**forward_kwargs, logits_to_keep=torch.zeros(0, dtype=torch.long, device=device))
    finally:
        handle.remove()
    return captured[-1]


def load_causal_lm(path: str, init_kwargs: dict[str, Any]) -> PreTrainedModel:
    """``AutoModelForCausalLM.from_pretrained`` with an error that names ``model.model_name_or_path``."""
    try:
        return AutoModelForCausalLM.from_pretrained(os.path.expanduser(path), **init_kwargs)
    except OSError as exc:
        raise ModelLoadError(f"Could not load model.model_name_or_path {path!r}: {exc}") from exc
    except TypeError as exc:  # a key of model.model_init_kwargs the model's class does not take
        unknown = re.search(r"unexpected keyword argument '([^']+)'", str(exc))
        if unknown is None:
            raise
        raise ConfigError(f"model.model_init_kwargs has {unknown.group(1)!r}, which the model class of {path!r} does not take "
                          f"({exc}): remove it (from_pretrained's own arguments: dtype, device_map, revision, "
                          "attn_implementation, trust_remote_code, ...)") from exc


def build_policy(
    path: str | PreTrainedModel,
    init_kwargs: dict[str, Any],
    lora: Mapping[str, Any] | None = None,
    gradient_checkpointing: bool = False,
) -> torch.nn.Module:
    """The trainable policy, in training mode.

    Args:
        path: ``model.model_name_or_path``, a hub id or a ``save_pretrained`` directory; in Python also
            a model already built (a ``PreTrainedModel``, or a ``PeftModel`` with its own adapter),
            which is trained as it is, in place.
        init_kwargs: keyword arguments for ``from_pretrained`` (see :func:`model_init_kwargs`).
        lora: ``model.lora``, :class:`peft.LoraConfig` keyword arguments on top of
            :data:`LORA_DEFAULTS`; ``None`` trains every weight.
        gradient_checkpointing: recompute each decoder layer's activations in the backward pass
            instead of keeping them (less memory, one more forward per layer).

    Returns:
        The ``transformers`` model, or a :class:`peft.PeftModel` around it when ``lora`` is given
        (its base weights frozen, only the adapter trainable).
    """
    given = isinstance(path, torch.nn.Module)
    if given and lora is not None and isinstance(path, PeftModel):
        raise ConfigError("model.lora is set, but the model given in Python already has a peft adapter: "
                          "give the base model with model.lora, or the PeftModel without it")
    policy = path if given else load_causal_lm(path, init_kwargs)
    if gradient_checkpointing:
        enable_gradient_checkpointing(policy)
    if lora is not None:
        policy = _add_lora_adapter(policy, lora, model_label(path))
    return policy.train()


def build_reference(path: str | PreTrainedModel, settings: dict[str, Any] | None, precision: str) -> torch.nn.Module:
    """The frozen KL reference: loaded from ``path`` (:func:`reference_init_kwargs`), or, for a model
    given in Python, a copy of it taken before training changes it (as TRL's ``create_reference_model``)."""
    if isinstance(path, torch.nn.Module):
        reference = copy.deepcopy(path)
    else:
        reference = load_causal_lm(path, reference_init_kwargs(settings, precision))
    return reference.requires_grad_(False).eval()


def model_label(path: str | torch.nn.Module) -> str:
    """How messages name the model: its path, or for a model object its class and ``name_or_path``."""
    if isinstance(path, torch.nn.Module):
        return f"the {type(path).__name__} given in Python ({getattr(path, 'name_or_path', '') or 'no name_or_path'})"
    return str(path)


def enable_gradient_checkpointing(model: PreTrainedModel) -> None:
    """Checkpoint every decoder layer (non-reentrant ``torch.utils.checkpoint``).

    Hugging Face models checkpoint only in training mode, and a checkpointed layer drops the KV
    cache, which is why generation runs the policy in eval mode (see ``generate_completions``).
    """
    if not model.supports_gradient_checkpointing:
        raise ConfigError(
            f"model.gradient_checkpointing: {type(model).__name__} does not support gradient checkpointing"
        )
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5 renamed it
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def disable_dropout(*models: torch.nn.Module | None) -> None:
    """Dropout off in each model given (None skipped), in training mode too (``model.disable_dropout``):
    every ``torch.nn.Dropout``'s probability 0 (TRL's ``disable_dropout_in_model``; LoRA's dropout too), and the
    dropout rates that attention and some decoder layers read from their config or an attribute at each
    forward instead (every float attribute named ``*dropout*`` or ``*pdrop``: ``attention_dropout``, Falcon's
    ``hidden_dropout``, ...) 0. The config's rates too, since
    Falcon's and GPT-Neo's attention read ``config.attention_dropout`` at each forward: a model saved from the run
    (``save_pretrained``) therefore carries dropout 0 in its config (TRL's keeps the original rates)."""
    for model in models:
        if model is None:
            continue
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
            config = getattr(module, "config", None)
            # the module's own rates (Llama's attention_dropout, Falcon's hidden_dropout, CLIP's dropout: read at each
            # forward), then its config's
            for holder in (module, config, getattr(config, "text_config", None)):
                for name, value in list(getattr(holder, "__dict__", {}).items()):
                    if ("dropout" in name or name.endswith("pdrop")) and isinstance(value, float):
                        setattr(holder, name, 0.0)


# ----------------------------------------------------------------------------------------------
# LoRA
# ----------------------------------------------------------------------------------------------


def lora_config(settings: Mapping[str, Any]) -> LoraConfig:
    """A :class:`peft.LoraConfig` from ``model.lora`` (on top of :data:`LORA_DEFAULTS`).

    Every key is a ``LoraConfig`` field (``r``, ``lora_alpha``, ``lora_dropout``, ``target_modules``,
    ``modules_to_save``, ``use_rslora``, ...); an unknown key or a value peft rejects is a
    ``ValueError`` naming ``model.lora``.
    """
    if not isinstance(settings, Mapping):
        raise ConfigError(f"model.lora must be a mapping of peft LoraConfig arguments or null, got {settings!r}")
    fields = {field.name for field in dataclasses.fields(LoraConfig) if field.init}
    unknown = sorted(set(settings) - fields)
    if unknown:
        common = ["r", "lora_alpha", "lora_dropout", "target_modules", "modules_to_save", "use_rslora"]
        raise ConfigError(
            f"model.lora.{unknown[0]} is not a peft LoraConfig argument (unknown: {unknown}); "
            f"common ones are {common}"
        )
    try:
        return LoraConfig(**{**LORA_DEFAULTS, **settings})
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"model.lora is not a valid peft LoraConfig: {exc}") from exc


def _add_lora_adapter(model: PreTrainedModel, settings: Mapping[str, Any], path: str) -> PeftModel:
    config = lora_config(settings)
    try:
        with warnings.catch_warnings():
            # peft asks transformers >= 5 for the old name of a property; nothing a user can change
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
            return get_peft_model(model, config)
    except ValueError as exc:
        if "not found in the base model" in str(exc):
            target_modules = {**LORA_DEFAULTS, **settings}["target_modules"]
            linear = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
            raise ConfigError(
                f"model.lora.target_modules {target_modules!r} matches no module of {path!r}; "
                f"its linear layers are named {sorted(linear)}"
            ) from exc
        raise ConfigError(f"model.lora could not be applied to {path!r}: {exc}") from exc


@contextlib.contextmanager
def reference_model(policy: torch.nn.Module, ref_model: torch.nn.Module | None) -> Iterator[torch.nn.Module]:
    """The model whose log-probs are the KL reference.

    The separate frozen copy when there is one; otherwise the LoRA policy with its adapter
    disabled, which computes exactly the frozen base model without a second copy of the weights.
    """
    if ref_model is not None:
        yield ref_model
    elif isinstance(policy, PeftModel):
        with policy.disable_adapter():
            yield policy
    else:
        raise RuntimeError("model.beta > 0 needs a reference: a frozen reference model or a LoRA policy")


# ----------------------------------------------------------------------------------------------
# Checkpoints that hold only the trainable weights
# ----------------------------------------------------------------------------------------------


def _frozen_parameter_names(model: torch.nn.Module, prefix: str) -> set[str]:
    # remove_duplicate=False: a tied weight (lm_head = embed_tokens) has a state-dict key per name
    return {prefix + name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}


def _trainable_parameter_names(model: torch.nn.Module, prefix: str) -> set[str]:
    return {prefix + name for name, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}


def without_frozen_policy_weights(module: Any, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """State-dict post-hook of a LoRA-trained module: drops its policy's frozen base weights."""
    if module.policy is not None:
        drop_frozen_weights(state_dict, module.policy, prefix=prefix + "policy.")


def drop_frozen_weights(state_dict: dict[str, Any], model: torch.nn.Module, prefix: str = "") -> None:
    """Remove ``model``'s frozen parameters (keys ``prefix + name``) from ``state_dict``, in place:
    with LoRA, the base weights, which :func:`add_frozen_weights` takes back from
    ``model.model_name_or_path``."""
    for key in _frozen_parameter_names(model, prefix) & state_dict.keys():
        del state_dict[key]


def add_frozen_weights(state_dict: dict[str, Any], model: torch.nn.Module, prefix: str = "") -> dict[str, Any]:
    """``state_dict`` completed with ``model``'s current frozen weights, after checking it is one of
    ``model``'s checkpoints: it must hold every trainable parameter (the adapter) and nothing the
    model does not have.

    ``model`` has just been built by :func:`build_policy`, so its frozen weights are those of
    ``model.model_name_or_path``, which is what training froze.
    """
    model_state = model.state_dict()
    expected = {prefix + key for key in model_state}
    saved = {key for key in state_dict if key.startswith(prefix)}
    missing = sorted(_trainable_parameter_names(model, prefix) - saved)
    unexpected = sorted(saved - expected)
    if missing or unexpected:
        raise ConfigError(
            "The checkpoint's weights do not fit the policy built from model.model_name_or_path and "
            f"model.lora: missing trainable weights {missing[:5]}{' ...' if len(missing) > 5 else ''}, "
            f"unexpected weights {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}. "
            "Was it saved with the same model.lora settings?"
        )
    frozen = {prefix + key: value for key, value in model_state.items() if prefix + key not in state_dict}
    return {**frozen, **state_dict}


# ----------------------------------------------------------------------------------------------
# The tokenizer
# ----------------------------------------------------------------------------------------------


ADAPTER_CONFIG = "adapter_config.json"  # what marks a peft adapter directory


def _looks_like_local_path(path: str) -> bool:
    """Hub ids are ``name`` or ``org/name``; anything else that does not exist is a missing directory."""
    return path.startswith((".", "/", "~")) or path.count("/") > 1 or (os.sep != "/" and os.sep in path)


def adapter_base_model(adapter_dir: str | os.PathLike) -> str:
    """``base_model_name_or_path`` of a peft adapter directory's ``adapter_config.json``."""
    import json

    config = json.loads((Path(adapter_dir) / ADAPTER_CONFIG).read_text())
    base = config.get("base_model_name_or_path")
    if not base:
        raise ModelLoadError(f"{ADAPTER_CONFIG} of {str(adapter_dir)!r} names no base_model_name_or_path")
    return base


def _check_model_path(path: str) -> None:
    """A local ``model.model_name_or_path`` must be a ``save_pretrained`` directory; say what is
    missing, and for a peft adapter directory how to train from it."""
    local = os.path.expanduser(path)
    if not os.path.exists(local):
        if _looks_like_local_path(path):
            raise MissingFileError(
                f"model.model_name_or_path {path!r} does not exist. Give a local directory written by "
                "save_pretrained (e.g. one made by `lit-grpo init-tiny DIR`) or a Hugging Face hub id."
            )
        return
    if not os.path.isdir(local):
        raise ModelLoadError(f"model.model_name_or_path {path!r} is a file; it must be a save_pretrained directory")
    if os.path.isfile(os.path.join(local, "config.json")):
        return
    if os.path.isfile(os.path.join(local, ADAPTER_CONFIG)):
        raise ModelLoadError(
            f"model.model_name_or_path {path!r} is a peft adapter ({ADAPTER_CONFIG}, no config.json), not a model: "
            f"merge it into its base model with `lit-grpo export {path} MERGED_DIR` and train from MERGED_DIR "
            "(model.lora trains a new adapter on it)"
        )
    found = ", ".join(sorted(os.listdir(local))[:6]) or "nothing"
    raise ModelLoadError(
        f"model.model_name_or_path {path!r} is a directory without a model: no config.json (it holds {found}); "
        "a save_pretrained directory has config.json, the weights and the tokenizer files"
    )


def load_tokenizer(path: str | torch.nn.Module, tokenizer=None):
    """The tokenizer, with a pad token (EOS when it has none, with a warning): ``tokenizer`` when given
    (Python), else loaded from ``path`` (a model object's ``name_or_path``)."""
    if tokenizer is None and isinstance(path, torch.nn.Module):
        name = getattr(path, "name_or_path", None)
        if not name:
            raise ConfigError(f"{model_label(path)} has no name_or_path to load its tokenizer from: pass tokenizer=")
        path = name
    if tokenizer is None:
        tokenizer = _load_tokenizer_files(path)
    label = getattr(tokenizer, "name_or_path", None) or model_label(path)
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ConfigError(f"The tokenizer of {label!r} has neither a pad token nor an EOS token")
        warnings.warn(
            f"The tokenizer of {label!r} has no pad token; using its EOS token {tokenizer.eos_token!r} for padding",
            stacklevel=2,
        )
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _load_tokenizer_files(path: str):
    _check_model_path(path)
    local = os.path.expanduser(path)
    tokenizer_files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if os.path.isdir(local) and not any(os.path.isfile(os.path.join(local, name)) for name in tokenizer_files):
        raise ModelLoadError(
            f"model.model_name_or_path {path!r} has no tokenizer (none of {', '.join(tokenizer_files)}): "
            "save it beside the model with tokenizer.save_pretrained(DIR)"
        )
    try:
        return AutoTokenizer.from_pretrained(local)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"could not load the tokenizer of model.model_name_or_path {path!r}: {exc}") from exc
