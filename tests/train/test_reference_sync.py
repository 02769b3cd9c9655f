"""Reference-model sync (TR-DPO): ref <- alpha * policy + (1 - alpha) * ref every N optimizer steps."""

import lightning.pytorch as pl
import pytest
import torch
from test_module import LOWERCASE, adamw, make_data, make_module

from lit_grpo.train.reference import ReferenceModelSync, mix_into_reference


def test_mix_into_reference_by_hand():
    policy, reference = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
    with torch.no_grad():
        policy.weight.copy_(torch.tensor([[1.0, 2.0]]))
        reference.weight.copy_(torch.tensor([[3.0, -2.0]]))
        policy.bias.fill_(1.0)
        reference.bias.fill_(0.0)
    mix_into_reference(reference, policy, alpha=0.25)
    assert reference.weight.tolist() == [[2.5, -1.0]]  # 0.25 * policy + 0.75 * ref
    assert reference.bias.tolist() == [0.25]
    with pytest.raises(ValueError, match="different parameters"):
        mix_into_reference(torch.nn.Linear(2, 2, bias=False), policy, 0.5)


def test_reference_follows_the_policy_every_n_optimizer_steps(tiny_model_dir, say_a_or_b_file, fast_trainer):
    pl.seed_everything(0)
    # 2 optimizer steps per training step, a sync every 3: due after steps 3 and 6 -> at the end of
    # training steps 2 (global step 4) and 3 (global step 6)
    module = make_module(
        tiny_model_dir, rewards=LOWERCASE, optimizer=adamw(1e-2), beta=0.04, steps_per_generation=2,
        sync_ref_model=True, ref_model_sync_steps=3, ref_model_mixup_alpha=0.5,
    )
    policies, refs_before_step = [], []

    class Snapshot(pl.Callback):  # runs before the sync callback (configure_callbacks come last)
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            refs_before_step.append({n: p.detach().clone() for n, p in pl_module.ref_model.named_parameters()})

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            policies.append((trainer.global_step, {n: p.detach().clone() for n, p in pl_module.policy.named_parameters()}))

    module.configure_model()
    initial_ref = {n: p.detach().clone() for n, p in module.ref_model.named_parameters()}
    trainer = fast_trainer(max_steps=6, callbacks=[Snapshot()])
    trainer.fit(module, make_data(say_a_or_b_file))
    sync = next(c for c in trainer.callbacks if isinstance(c, ReferenceModelSync))
    assert sync.num_syncs == 2

    assert [step for step, _ in policies] == [2, 4, 6]
    final_ref = {n: p.detach() for n, p in module.ref_model.named_parameters()}
    policy_at_4, policy_at_6 = policies[1][1], policies[2][1]
    for name in initial_ref:
        torch.testing.assert_close(refs_before_step[1][name], initial_ref[name])  # no sync after step 2
        expected_after_4 = 0.5 * policy_at_4[name] + 0.5 * initial_ref[name]
        torch.testing.assert_close(refs_before_step[2][name], expected_after_4)
        torch.testing.assert_close(final_ref[name], 0.5 * policy_at_6[name] + 0.5 * expected_after_4)
    assert not torch.equal(final_ref["model.embed_tokens.weight"], initial_ref["model.embed_tokens.weight"])
    # the reference is part of the checkpointed state, so a resumed run has the synced reference
    assert any(key.startswith("ref_model.") for key in module.state_dict())


def test_sync_ref_model_needs_a_separate_reference(tiny_model_dir):
    with pytest.raises(ValueError, match=r"model\.sync_ref_model needs a separate reference model: model\.beta > 0"):
        make_module(tiny_model_dir, sync_ref_model=True, beta=0.0)
    with pytest.raises(ValueError, match=r"model\.ref_model_mixup_alpha must be in \(0, 1\], got 1\.5"):
        make_module(tiny_model_dir, sync_ref_model=True, beta=0.1, ref_model_mixup_alpha=1.5)


def test_synced_reference_resumes_exactly(tiny_model_dir, say_a_or_b_file, fast_trainer, tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    settings = dict(rewards=LOWERCASE, optimizer=adamw(1e-2), beta=0.04, sync_ref_model=True,
                    ref_model_sync_steps=1, ref_model_mixup_alpha=0.5)

    def run(max_steps, ckpt_path=None, directory=None):
        pl.seed_everything(0)
        module = make_module(tiny_model_dir, **settings)
        # a checkpoint after each training step, mid-epoch (as a long run has it)
        callbacks = [ModelCheckpoint(dirpath=directory, save_last=True, save_top_k=0, every_n_train_steps=1)] if directory else []
        trainer = fast_trainer(max_steps=max_steps, enable_checkpointing=bool(directory), callbacks=callbacks)
        trainer.fit(module, make_data(say_a_or_b_file), ckpt_path=ckpt_path)
        return {n: p.detach().clone() for n, p in module.ref_model.named_parameters()}

    straight = run(4)
    run(2, directory=tmp_path / "checkpoints")
    resumed = run(4, ckpt_path=str(tmp_path / "checkpoints" / "last.ckpt"))
    for name, value in straight.items():
        torch.testing.assert_close(resumed[name], value, rtol=0, atol=0, msg=name)
