"""Exporting a trained policy as a Hugging Face ``save_pretrained`` directory (model + tokenizer).

Two ways in, one way out:

- ``lit-grpo export CKPT DIR`` (:func:`export_checkpoint`) reads a Lightning checkpoint of
  :class:`~lit_grpo.train.module.GRPOModule`, a file or FSDP2's directory of shards (or merges a peft
  adapter directory into its base model, :func:`merge_adapter_directory`);
- the :class:`ExportOnFitEnd` callback exports the policy in memory when ``trainer.fit`` ends.

A checkpoint is read from a local file with ``weights_only=True``
(:func:`lit_grpo.run.safe_loading.load_checkpoint_file`): one holding other Python objects is refused.
Both rebuild the policy from the module's hyperparameters exactly as training built it
(:func:`lit_grpo.models.build_policy`: ``model_name_or_path``, ``model_init_kwargs``, ``lora``),
load the trained weights into it, and write it (:func:`export_policy`). A LoRA policy is written
either merged into the base weights (``merge_and_unload``, the default: a plain model that
``AutoModelForCausalLM.from_pretrained`` loads) or as a peft adapter directory (which
``peft.AutoPeftModelForCausalLM.from_pretrained`` loads, fetching the base model named in its
``adapter_config.json``). Merged, an output head tied to the input embeddings that has an adapter of its
own is written untied (:func:`untie_adapted_head`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from peft import PeftModel
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
)
from transformers import AutoTokenizer

from lit_grpo import models
from lit_grpo.errors import ConfigError, FileInTheWayError, MissingFileError, ModelLoadError
from lit_grpo.redaction import without_redacted
from lit_grpo.run.safe_loading import (
    UnsafeCheckpointError,
    check_local_checkpoint,
    check_shard_metadata,
    load_checkpoint_file,
    load_shards,
)

__all__ = ["ExportOnFitEnd", "export_checkpoint", "export_policy", "rebuild_policy"]

POLICY_PREFIX = "policy."  # GRPOModule keeps the policy in ``self.policy``


def export_checkpoint(
    checkpoint_path: str | os.PathLike, output_dir: str | os.PathLike, merge_lora: bool = True, overwrite: bool = False
) -> Path:
    """Write the policy of a GRPOModule checkpoint (a ``.ckpt`` file, or the directory of a sharded
    one: :func:`load_sharded_policy_checkpoint`) to ``output_dir``.

    Raises:
        FileNotFoundError: ``checkpoint_path`` does not exist.
        FileExistsError: ``output_dir`` exists and is not empty, and ``overwrite`` is False.
        ValueError: the file or directory is not a GRPOModule checkpoint, or ``merge_lora=False``
            without LoRA.
    """
    check_local_checkpoint(checkpoint_path, what="checkpoint")
    checkpoint_path = Path(checkpoint_path)
    if not checkpoint_path.exists():
        raise MissingFileError(f"checkpoint {str(checkpoint_path)!r} does not exist")
    check_output_dir(output_dir, overwrite)
    if (checkpoint_path / models.ADAPTER_CONFIG).is_file():
        if not merge_lora:
            raise ConfigError(f"{str(checkpoint_path)!r} is already a peft adapter: --no-merge-lora has nothing to do")
        return merge_adapter_directory(checkpoint_path, output_dir, overwrite)
    if checkpoint_path.is_dir():
        checkpoint = load_sharded_policy_checkpoint(checkpoint_path)
    else:
        try:  # weights_only: a file holding other objects than tensors and plain values is refused, not run
            if not zipfile.is_zipfile(checkpoint_path):  # what torch.save writes; weights_only's errors on others say little
                raise ValueError("not a zip archive, as torch.save writes")
            checkpoint = load_checkpoint_file(checkpoint_path)
        except UnsafeCheckpointError:
            raise
        except Exception as exc:  # zip and EOF errors alike: not a torch checkpoint
            raise ModelLoadError(
                f"{str(checkpoint_path)!r} is not a checkpoint: torch.load failed ({type(exc).__name__}: "
                f"{' '.join(str(exc).split())[:120]}); export takes a .ckpt file written by lit-grpo fit, its "
                "sharded checkpoint directory, or a peft adapter directory"
            ) from None
    hparams = checkpoint.get("hyper_parameters") or {} if isinstance(checkpoint, dict) else {}
    if "model_name_or_path" not in hparams or "state_dict" not in checkpoint:
        raise ConfigError(
            f"{str(checkpoint_path)!r} is not a checkpoint of lit_grpo's GRPOModule "
            "(no model_name_or_path hyperparameter or no state_dict)"
        )
    policy_state = {
        key.removeprefix(POLICY_PREFIX): value
        for key, value in checkpoint["state_dict"].items()
        if key.startswith(POLICY_PREFIX)
    }
    # a secret was redacted when the checkpoint was written (lit_grpo.redaction): left out here, so that the
    # library finds it itself (a gated model's token: huggingface_hub reads HF_TOKEN or the login's)
    return export_policy(without_redacted(hparams), policy_state, output_dir, merge_lora=merge_lora, overwrite=overwrite)


def merge_adapter_directory(adapter_dir: Path, output_dir: str | os.PathLike, overwrite: bool = False) -> Path:
    """A peft adapter directory (``lit-grpo export --no-merge-lora`` writes one) merged into its
    base model (``base_model_name_or_path`` of its ``adapter_config.json``), with its tokenizer: a
    model that training can start from."""
    base = models.adapter_base_model(adapter_dir)
    policy = models.load_causal_lm(base, models.model_init_kwargs(None))
    adapted = PeftModel.from_pretrained(policy, str(adapter_dir))
    untie_adapted_head(adapted)
    merged = adapted.merge_and_unload()
    tokenizer_dir = adapter_dir if (adapter_dir / "tokenizer_config.json").is_file() else base
    return _write_atomically(merged, AutoTokenizer.from_pretrained(str(tokenizer_dir)), Path(output_dir), overwrite)


def load_sharded_policy_checkpoint(path: Path) -> dict[str, Any]:
    """A sharded checkpoint of ``ModelParallelStrategy`` (a directory of
    ``torch.distributed.checkpoint`` shards and Lightning's ``meta.pt``) as one checkpoint dict, in
    this process, with only the policy's weights in its ``state_dict``: the optimizer state and a
    reference model are never read, so this needs the memory of the policy alone."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta_file = path / "meta.pt"
    if not meta_file.is_file() or not (path / ".metadata").is_file():
        raise ConfigError(
            f"checkpoint {str(path)!r} is a directory but not a sharded Lightning checkpoint "
            "(it needs the shards' .metadata and Lightning's meta.pt)"
        )
    check_shard_metadata(path)  # DCP unpickles it as it is: refused first if it holds other objects
    saved = FileSystemReader(str(path)).read_metadata().state_dict_metadata  # flattened keys
    prefix = "state_dict." + POLICY_PREFIX
    policy_state = {
        key.removeprefix("state_dict."): torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
        for key, entry in saved.items()
        if key.startswith(prefix) and isinstance(entry, TensorStorageMetadata)
    }
    shards = {"state_dict": policy_state}
    load_shards(shards, path)  # fills the tensors in place; non-tensor items would be read weights_only
    checkpoint = load_checkpoint_file(meta_file)  # weights_only, as above
    checkpoint["state_dict"] = shards["state_dict"]
    return checkpoint


def rebuild_policy(hparams: Mapping[str, Any], policy_state: Mapping[str, torch.Tensor]) -> torch.nn.Module:
    """The policy built as training built it, with ``policy_state``'s weights, in eval mode.

    ``policy_state`` holds at least every trainable weight (with LoRA: the adapter); the frozen
    ones are those of ``hparams["model_name_or_path"]``.
    """
    policy = models.build_policy(
        hparams["model_name_or_path"],
        models.model_init_kwargs(hparams.get("model_init_kwargs")),
        lora=hparams.get("lora"),
    )
    policy.load_state_dict(models.add_frozen_weights(dict(policy_state), policy))
    return policy.eval()


def export_policy(
    hparams: Mapping[str, Any],
    policy_state: Mapping[str, torch.Tensor],
    output_dir: str | os.PathLike,
    merge_lora: bool = True,
    overwrite: bool = False,
) -> Path:
    """Rebuild the policy (:func:`rebuild_policy`) and ``save_pretrained`` it with its tokenizer.

    The directory is written under a temporary name next to ``output_dir`` and renamed when
    complete, so an interrupted export never leaves a half-written model at ``output_dir``.
    """
    output_dir = Path(output_dir)
    check_output_dir(output_dir, overwrite)
    policy = rebuild_policy(hparams, policy_state)
    if isinstance(policy, PeftModel):
        if merge_lora:
            untie_adapted_head(policy)
            policy = policy.merge_and_unload()  # W + scale * B @ A, the adapter layers removed
        else:
            _point_adapter_at_base_model(policy, hparams["model_name_or_path"])
    elif not merge_lora:
        raise ConfigError(
            "merge_lora=False (--no-merge-lora) keeps a LoRA adapter, but this policy has none (model.lora is null)"
        )
    return _write_atomically(policy, models.load_tokenizer(hparams["model_name_or_path"]), output_dir, overwrite)


def untie_adapted_head(policy: PeftModel) -> None:
    """Before merging: an output head tied to the input embeddings (one weight, ``tie_word_embeddings``) with
    an adapter of its own gets a copy of that weight, and the model is marked untied. Merged into the tied
    weight, the head's update would change the embeddings too (the trained model embeds its inputs with the
    base weight); untied, the merged model computes what the trained one does, its head written apart."""
    model = policy.get_base_model()
    head, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    head_weights = getattr(head, "base_layer", None)  # peft's adapter layer wraps the head it adapts
    if head_weights is None or embeddings is None or head_weights.weight is not embeddings.weight:
        return
    head_weights.weight = torch.nn.Parameter(head_weights.weight.detach().clone(), requires_grad=False)
    model.config.tie_word_embeddings = False
    model.config.get_text_config().tie_word_embeddings = False  # the same config for a text-only model


def _write_atomically(policy, tokenizer, output_dir: Path, overwrite: bool) -> Path:
    """``save_pretrained`` the model and tokenizer into a temporary directory beside ``output_dir``,
    then rename it, so an interrupted export never leaves a half-written model there."""
    check_output_dir(output_dir, overwrite)
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.", dir=output_dir.parent))
    try:
        policy.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if output_dir.exists():
            shutil.rmtree(output_dir)  # empty, or overwrite was asked for
        os.replace(staging, output_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return output_dir


def check_output_dir(output_dir: str | os.PathLike, overwrite: bool, name: str = "DIR") -> None:
    """Refuse to write over a file, or over a non-empty directory unless ``overwrite``."""
    output_dir = Path(output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise FileInTheWayError(f"{name} {str(output_dir)!r} exists and is a file, not a directory")
    if output_dir.is_dir() and any(output_dir.iterdir()) and not overwrite:
        raise FileInTheWayError(
            f"{name} {str(output_dir)!r} exists and is not empty; choose another directory or pass "
            "--overwrite (overwrite: true) to replace it"
        )


def _point_adapter_at_base_model(policy: PeftModel, model_name_or_path: str) -> None:
    """Record a local base model by its absolute path in ``adapter_config.json``, so the adapter
    directory loads from any working directory (a hub id is kept as it is)."""
    local = os.path.expanduser(model_name_or_path)
    if os.path.isdir(local):
        for config in policy.peft_config.values():
            config.base_model_name_or_path = os.path.abspath(local)


class ExportOnFitEnd(pl.Callback):
    """Export the trained policy to ``dirpath`` when ``trainer.fit`` completes.

    In YAML::

        trainer:
          callbacks:
            - class_path: lit_grpo.run.export.ExportOnFitEnd
              init_args: {dirpath: runs/exported, merge_lora: true}

    ``dirpath`` is checked when fitting starts (it must be empty or missing, unless ``overwrite``),
    so a run is not lost to a bad path at its end. Under FSDP every rank takes part in gathering
    the weights and rank 0 writes.

    Args:
        dirpath: the ``save_pretrained`` directory to write.
        merge_lora: with LoRA, merge the adapter into the base weights (True) or write the adapter
            alone (False).
        overwrite: replace ``dirpath`` if it exists and is not empty.
    """

    def __init__(self, dirpath: str | os.PathLike, merge_lora: bool = True, overwrite: bool = False):
        self.dirpath = Path(dirpath)
        self.merge_lora = merge_lora
        self.overwrite = overwrite

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if not self.merge_lora and pl_module.hparams.get("lora") is None:
            raise ConfigError("ExportOnFitEnd.merge_lora=False keeps a LoRA adapter, but model.lora is null")
        if trainer.is_global_zero:
            check_output_dir(self.dirpath, self.overwrite, name="ExportOnFitEnd.dirpath")

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Collective under FSDP2: every rank contributes its shards; rank 0 receives the full
        # tensors on CPU. Frozen weights (a LoRA base) are left out: they are reloaded from disk.
        options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
        policy_state = get_model_state_dict(pl_module.policy, options=options)
        if trainer.is_global_zero:
            export_policy(pl_module.hparams, policy_state, self.dirpath, self.merge_lora, self.overwrite)
        trainer.strategy.barrier("ExportOnFitEnd")
