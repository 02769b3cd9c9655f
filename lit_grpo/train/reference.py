"""Reference-model synchronisation (TR-DPO; Gorbatovski et al. 2024, "Learn Your Reference Model for
Real Good Alignment", arXiv:2404.09656), as in TRL's ``sync_ref_model``.

With ``model.sync_ref_model: true``, every ``ref_model_sync_steps`` optimizer steps the KL reference
moves towards the policy: ``ref <- alpha * policy + (1 - alpha) * ref`` (``ref_model_mixup_alpha``;
``alpha = 1`` copies the policy). The KL penalty then keeps the policy near a recent version of itself
instead of the initial model.

- Sharded: under FSDP2 the reference and the policy are sharded the same way, so each rank mixes its
  own shards; no gathering is needed.
- Exact resume: the reference's weights are part of the module's ``state_dict``, hence of every
  checkpoint, and when to sync next is derived from ``trainer.global_step``, so nothing else needs saving.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch

from lit_grpo.config import check_reference_sync
from lit_grpo.distributed import reshard

__all__ = ["ReferenceModelSync", "mix_into_reference"]


@torch.no_grad()
def mix_into_reference(reference: torch.nn.Module, policy: torch.nn.Module, alpha: float) -> None:
    """``ref <- alpha * policy + (1 - alpha) * ref``, parameter by parameter (same architecture)."""
    for model in (reference, policy):  # FSDP2: mix shard by shard (the root may still be gathered)
        reshard(model)
    ref_params = dict(reference.named_parameters())
    policy_params = dict(policy.named_parameters())
    if ref_params.keys() != policy_params.keys():
        missing = sorted(set(ref_params) ^ set(policy_params))[:5]
        raise ValueError(f"the reference and the policy have different parameters, e.g. {missing}")
    for name, ref in ref_params.items():
        ref.lerp_(policy_params[name].to(ref.dtype), alpha)


class ReferenceModelSync(pl.Callback):
    """Mix the policy into the reference every ``sync_steps`` optimizer steps (added by the module)."""

    def __init__(self, sync_steps: int, alpha: float) -> None:
        check_reference_sync(sync_steps, alpha)
        self.sync_steps = sync_steps
        self.alpha = alpha
        self.num_syncs = 0  # this process's count, for logging

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._synced_up_to = trainer.global_step // self.sync_steps  # a resumed run continues the schedule

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # One training step makes num_iterations * steps_per_generation optimizer steps, so the step
        # counter may jump over a multiple of sync_steps: sync once per multiple passed.
        due = trainer.global_step // self.sync_steps
        if due > self._synced_up_to:
            mix_into_reference(pl_module.ref_model, pl_module.policy, self.alpha)
            self._synced_up_to = due
            self.num_syncs += 1
