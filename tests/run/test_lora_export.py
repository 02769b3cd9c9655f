"""LoRA through peft (``model.lora``) and exporting the trained policy (``lit-grpo export``,
``ExportOnFitEnd``).

LoRA: only the adapter trains, the KL reference is the policy with the adapter disabled (no second
copy of the weights), checkpoints hold only the adapter and load back, bad settings name their key.
Export: a 2-step fit with and without LoRA, exported merged or as an adapter, loads with
``from_pretrained`` and generates greedily exactly the tokens of the trained policy in memory,
with weights that differ from the base model's.
"""

from __future__ import annotations

import json
import string
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import test_module
import torch
import yaml
from conftest import cpu_trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from peft import AutoPeftModelForCausalLM, PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from lit_grpo import models
from lit_grpo.cli import main
from lit_grpo.data import GRPODataModule, PromptBatch
from lit_grpo.run.export import ExportOnFitEnd, export_checkpoint
from lit_grpo.train.module import GRPOModule

REPO = Path(__file__).resolve().parents[2]
# The fraction of lowercase letters varies between a random model's completions: non-zero advantages.
LOWERCASE = [{"name": "char_fraction", "args": {"chars": string.ascii_lowercase}}]
LORA = {"r": 4, "lora_alpha": 8}
# 2 decoder layers x 7 linear layers (q, k, v, o, gate, up, down) x (lora_A, lora_B)
NUM_ADAPTER_TENSORS = 2 * 7 * 2
GREEDY_PROMPTS = ["Say a:", "Say the letter b:", "x"]


def make_module(model_dir, **overrides) -> GRPOModule:
    """test_module's tiny GRPO module, rewarded for lowercase letters, with a learning rate that moves it."""
    optimizer = lambda params: torch.optim.AdamW(params, lr=0.02, weight_decay=0.0)  # noqa: E731
    return test_module.make_module(model_dir, **{"rewards": LOWERCASE, "optimizer": optimizer, **overrides})


def make_data(data_file) -> GRPODataModule:
    return GRPODataModule(path="json", data_files=str(data_file), batch_size=2)


def make_trainer(max_steps=2, **overrides) -> pl.Trainer:
    return cpu_trainer(max_steps=max_steps, **overrides)


def greedy_tokens(model, tokenizer, max_new_tokens=12) -> torch.Tensor:
    """Greedy continuations ``[3, max_new_tokens]`` of GREEDY_PROMPTS (left-padded batch)."""
    encoded = tokenizer(GREEDY_PROMPTS, return_tensors="pt", padding=True, add_special_tokens=False)
    model.eval()
    with torch.no_grad():
        output = model.generate(
            **encoded,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,  # compare every position, not only up to an EOS
            pad_token_id=tokenizer.pad_token_id,
        )
    return output[:, encoded["input_ids"].size(1) :]


def adapter_names(model) -> set[str]:
    return {name for name, p in model.named_parameters() if p.requires_grad}


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Say {c}:", "target": c}) + "\n" for c in "ab" * 8))
    return path


def fit_two_steps(lora, model_dir, data_file, run_dir) -> dict:
    """A 2-step fit with its last checkpoint and an ExportOnFitEnd export."""
    pl.seed_everything(0)
    module = make_module(model_dir, lora=lora)
    checkpoints = ModelCheckpoint(dirpath=run_dir / "checkpoints", save_last=True)
    on_fit_end = ExportOnFitEnd(dirpath=run_dir / "exported-on-fit-end")
    trainer = make_trainer(enable_checkpointing=True, callbacks=[checkpoints, on_fit_end])
    trainer.fit(module, make_data(data_file))
    assert trainer.global_step == 2
    return {
        "lora": lora,
        "module": module,
        "checkpoint": Path(checkpoints.last_model_path),
        "on_fit_end_dir": run_dir / "exported-on-fit-end",
    }


@pytest.fixture(scope="module")
def trained_full(tiny_model_dir, data_file, tmp_path_factory) -> dict:
    """Full fine-tuning, 2 steps."""
    return fit_two_steps(None, tiny_model_dir, data_file, tmp_path_factory.mktemp("run-full"))


@pytest.fixture(scope="module")
def trained_lora(tiny_model_dir, data_file, tmp_path_factory) -> dict:
    """LoRA (r 4), 2 steps."""
    return fit_two_steps(LORA, tiny_model_dir, data_file, tmp_path_factory.mktemp("run-lora"))


BOTH_RUNS = pytest.mark.parametrize("run", ["trained_full", "trained_lora"])


# --------------------------------------------------------------------------------------------------
# LoRA: what trains, the reference, checkpoints
# --------------------------------------------------------------------------------------------------


def test_lora_trains_only_the_adapter(trained_lora, tiny_model_dir):
    module = trained_lora["module"]
    policy = module.policy
    assert isinstance(policy, PeftModel)
    trainable = adapter_names(policy)
    assert len(trainable) == NUM_ADAPTER_TENSORS
    assert all(".lora_A." in name or ".lora_B." in name for name in trainable)
    optimized = {id(p) for group in module.trainer.optimizers[0].param_groups for p in group["params"]}
    assert optimized == {id(p) for p in policy.parameters() if p.requires_grad}

    # The adapter moved (lora_B starts at zero), the base weights did not.
    lora_b = [p for name, p in policy.named_parameters() if ".lora_B." in name]
    assert all(p.abs().max() > 0 for p in lora_b)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    for name, weight in base.state_dict().items():
        trained_name = name.replace(".weight", ".base_layer.weight") if "_proj" in name else name
        assert torch.equal(policy.base_model.model.state_dict()[trained_name], weight), name


def test_lora_reference_is_the_policy_with_its_adapter_disabled(tiny_model_dir, data_file, monkeypatch):
    loads = []
    load_causal_lm = models.load_causal_lm

    def counting_load(path, init_kwargs):
        loads.append(path)
        return load_causal_lm(path, init_kwargs)

    monkeypatch.setattr(models, "load_causal_lm", counting_load)
    pl.seed_everything(0)
    kl_per_step = []

    class RecordKL(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            kl_per_step.append(float(trainer.callback_metrics["kl"]))

    module = make_module(tiny_model_dir, lora=LORA, beta=0.1)
    trainer = make_trainer(max_steps=2, callbacks=[RecordKL()])
    trainer.fit(module, make_data(data_file))

    assert len(loads) == 1  # no second copy of the weights
    assert module.ref_model is None
    assert kl_per_step[0] == pytest.approx(0.0, abs=1e-6)  # lora_B = 0: the policy is the base model
    assert kl_per_step[1] > 1e-6  # after one update it is not

    # The reference log-probs are the base model's; the policy's own (adapter back on) differ.
    batch = PromptBatch(prompts=["Say a:", "Say b:"], columns={"target": ["a", "b"]})
    rollout = module.generate(batch.prompts)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).train()
    with torch.no_grad():
        base_logps, _ = module.logprobs.completion_logps(base, rollout)
    reference_logps = module.logprobs.reference_logps(module.policy, module.ref_model, rollout)
    policy_logps = module.logprobs.logps_no_grad(module.policy, rollout)
    mask = rollout.completion_mask.bool()
    torch.testing.assert_close(reference_logps[mask], base_logps[mask], atol=1e-5, rtol=0)
    assert (policy_logps[mask] - base_logps[mask]).abs().max() > 1e-4


def test_lora_checkpoint_holds_only_the_adapter_and_loads_back(trained_lora, tiny_model_dir, data_file):
    module = trained_lora["module"]
    checkpoint = torch.load(trained_lora["checkpoint"], map_location="cpu", weights_only=False)
    saved = checkpoint["state_dict"]
    assert set(saved) == {"policy." + name for name in adapter_names(module.policy)}
    assert len(checkpoint["optimizer_states"][0]["state"]) == NUM_ADAPTER_TENSORS  # AdamW moments

    # load_from_checkpoint: the adapter comes from the file, the base from model_name_or_path.
    loaded = GRPOModule.load_from_checkpoint(trained_lora["checkpoint"])
    trained_state = module.policy.state_dict()
    for name, value in loaded.policy.state_dict().items():
        torch.testing.assert_close(value, trained_state[name], atol=0, rtol=0, msg=name)

    # trainer.fit(ckpt_path=...) resumes from it (strict loading does not trip on the missing base).
    resumed = make_module(tiny_model_dir, lora=LORA)
    trainer = make_trainer(max_steps=3)
    trainer.fit(resumed, make_data(data_file), ckpt_path=trained_lora["checkpoint"])
    assert trainer.global_step == 3


def test_lora_checkpoint_missing_an_adapter_weight_is_refused(trained_lora, tmp_path):
    checkpoint = torch.load(trained_lora["checkpoint"], map_location="cpu", weights_only=False)
    dropped = sorted(checkpoint["state_dict"])[0]
    del checkpoint["state_dict"][dropped]
    broken = tmp_path / "broken.ckpt"
    torch.save(checkpoint, broken)
    with pytest.raises(ValueError, match="missing trainable weights") as error:
        GRPOModule.load_from_checkpoint(broken)
    assert dropped in str(error.value)


def test_full_fine_tuning_checkpoint_does_not_fit_a_lora_module(trained_full, tiny_model_dir):
    module = make_module(tiny_model_dir, lora=LORA)
    module.configure_model()
    checkpoint = torch.load(trained_full["checkpoint"], map_location="cpu", weights_only=False)
    with pytest.raises(ValueError, match="same model.lora settings"):
        module.on_load_checkpoint(checkpoint)


def test_unknown_lora_key_is_named(tiny_model_dir):
    with pytest.raises(ValueError, match=r"model\.lora\.rank is not a peft LoraConfig argument"):
        make_module(tiny_model_dir, lora={"rank": 4})


def test_lora_values_peft_rejects_are_named(tiny_model_dir):
    with pytest.raises(ValueError, match=r"model\.lora is not a valid peft LoraConfig: `layers_to_transform`"):
        make_module(tiny_model_dir, lora={"layers_to_transform": [0]})  # needs a list of target_modules
    module = make_module(tiny_model_dir, lora={"r": 0})  # peft checks r when it builds the layers
    with pytest.raises(ValueError, match=r"model\.lora could not be applied .* `r` should be a positive integer"):
        module.configure_model()


def test_lora_target_module_matching_nothing_is_named(tiny_model_dir):
    module = make_module(tiny_model_dir, lora={"target_modules": ["attention_projection"]})
    with pytest.raises(ValueError, match=r"model\.lora\.target_modules \['attention_projection'\] matches no module"):
        module.configure_model()


# --------------------------------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------------------------------


def assert_weights_differ_from_base(model, tiny_model_dir):
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    exported = model.state_dict()
    assert set(exported) == set(base)
    changed = [name for name in base if not torch.equal(exported[name], base[name])]
    assert any("q_proj" in name for name in changed), changed  # trained by both full and LoRA runs


@BOTH_RUNS
@pytest.mark.parametrize("source", ["checkpoint", "on_fit_end"])
def test_exported_model_generates_the_trained_policys_tokens(run, source, request, tiny_model_dir, tmp_path, capsys):
    trained = request.getfixturevalue(run)
    module = trained["module"]
    if source == "checkpoint":
        out = tmp_path / "exported"
        main(["export", str(trained["checkpoint"]), str(out)])
        assert f"to {out}" in capsys.readouterr().out
    else:
        out = trained["on_fit_end_dir"]
    assert not (out / "adapter_config.json").exists()  # LoRA merged by default: a plain model

    exported = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.get_vocab() == module.tokenizer.get_vocab()
    assert type(exported) is type(AutoModelForCausalLM.from_pretrained(tiny_model_dir))
    assert_weights_differ_from_base(exported, tiny_model_dir)
    expected = greedy_tokens(module.policy, module.tokenizer)
    assert torch.equal(greedy_tokens(exported, tokenizer), expected)
    module.policy.train()


def test_lora_exported_as_adapter_loads_with_peft(trained_lora, tiny_model_dir, tmp_path):
    module = trained_lora["module"]
    out = tmp_path / "adapter"
    main(["export", str(trained_lora["checkpoint"]), str(out), "--no-merge-lora"])
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(Path(tiny_model_dir).resolve())
    assert (config["r"], config["lora_alpha"]) == (4, 8)
    assert not (out / "model.safetensors").exists()  # the adapter only, not the base weights

    adapter = AutoPeftModelForCausalLM.from_pretrained(out)
    expected = greedy_tokens(module.policy, module.tokenizer)
    assert torch.equal(greedy_tokens(adapter, AutoTokenizer.from_pretrained(out)), expected)
    assert_weights_differ_from_base(adapter.merge_and_unload(), tiny_model_dir)
    module.policy.train()


@BOTH_RUNS
def test_export_errors_name_the_problem(run, request, tmp_path, capsys):
    trained = request.getfixturevalue(run)
    with pytest.raises(SystemExit) as exit_info:
        main(["export", str(tmp_path / "missing.ckpt"), str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert "missing.ckpt' does not exist" in capsys.readouterr().err

    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "adapter_config.json").write_text("{}")  # stale file of an earlier export
    with pytest.raises(SystemExit):
        main(["export", str(trained["checkpoint"]), str(occupied)])
    err = capsys.readouterr().err
    assert "is not empty" in err and "--overwrite" in err
    main(["export", str(trained["checkpoint"]), str(occupied), "--overwrite"])
    assert not (occupied / "adapter_config.json").exists()  # replaced, not merged into
    assert (occupied / "config.json").exists()

    if trained["lora"] is None:
        with pytest.raises(ValueError, match="no-merge-lora.*model.lora is null"):
            export_checkpoint(trained["checkpoint"], tmp_path / "adapter", merge_lora=False)


def test_export_on_fit_end_refuses_an_occupied_directory_before_training(tiny_model_dir, data_file, tmp_path):
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "keep.txt").write_text("not mine")
    module = make_module(tiny_model_dir)
    generate_calls = []
    module.generate = lambda prompts: generate_calls.append(prompts)
    trainer = make_trainer(callbacks=[ExportOnFitEnd(dirpath=occupied)])
    with pytest.raises(FileExistsError, match="ExportOnFitEnd.dirpath .* is not empty"):
        trainer.fit(module, make_data(data_file))
    assert generate_calls == []  # refused at setup, not after training
    assert (occupied / "keep.txt").read_text() == "not mine"


# --------------------------------------------------------------------------------------------------
# From YAML: lit-grpo fit with model.lora and the ExportOnFitEnd callback, then lit-grpo export
# --------------------------------------------------------------------------------------------------


def test_cli_fit_with_lora_and_export_callback_then_export_adapter(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["lit-grpo"])
    monkeypatch.chdir(REPO)  # the quickstart's data_files is relative to the repository root
    config = yaml.safe_load((REPO / "configs" / "quickstart.yaml").read_text())
    config["trainer"].update(
        max_steps=2,
        default_root_dir=str(tmp_path),  # where LightningCLI saves the resolved config.yaml
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
             "init_args": {"dirpath": str(tmp_path / "checkpoints"), "save_last": True}},
            {"class_path": "lit_grpo.run.export.ExportOnFitEnd",
             "init_args": {"dirpath": str(tmp_path / "merged")}},
        ],
    )
    config["model"].update(model_name_or_path=str(tiny_model_dir), lora={"r": 4, "lora_alpha": 8})
    config["data"]["batch_size"] = 2
    config_path = tmp_path / "config.yaml"
    config_path.write_text(yaml.safe_dump(config))

    main(["fit", "--config", str(config_path)])
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert torch.load(last, map_location="cpu", weights_only=False)["hyper_parameters"]["lora"] == {
        "r": 4, "lora_alpha": 8
    }
    main(["export", str(last), str(tmp_path / "adapter"), "--no-merge-lora"])

    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    adapter = AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapter")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "merged")
    assert torch.equal(greedy_tokens(merged, tokenizer), greedy_tokens(adapter, tokenizer))
    assert_weights_differ_from_base(merged, tiny_model_dir)


def test_export_refuses_a_directory_that_is_not_a_sharded_checkpoint(tmp_path):
    """A directory is read as FSDP2's shards only with their ``.metadata`` and Lightning's ``meta.pt``."""
    folder = tmp_path / "last.ckpt"
    folder.mkdir()
    (folder / "meta.pt").write_bytes(b"")
    with pytest.raises(ValueError, match=r"is a directory but not a sharded Lightning checkpoint \(it needs the shards' \.metadata"):
        export_checkpoint(folder, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_merged_export_of_an_adapted_tied_head_computes_what_the_trained_model_computes(tiny_model_dir, tmp_path):
    """configs/lora/quickstart-lora.yaml: an adapter on ``lm_head``, which the tiny model ties to its input
    embeddings. Merged into the one tied weight, the head's update would change the embeddings too; the
    export (from a checkpoint's weights, and from an adapter directory) must give the trained logits."""
    from lit_grpo.run.export import export_policy

    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "lm_head"]}
    policy = models.build_policy(str(tiny_model_dir), models.model_init_kwargs(None), lora=lora)
    torch.manual_seed(0)
    with torch.no_grad():  # a trained adapter: lora_B is zero at initialization, so the adapter would change nothing
        for name, weight in policy.named_parameters():
            if "lora_B" in name:
                weight.normal_(0.0, 0.5)
    input_ids = torch.tensor([[3, 5, 7, 9, 11, 13]])
    with torch.no_grad():
        trained_logits = policy.eval()(input_ids).logits  # [1, 6, vocab]
    adapter_state = {name: weight for name, weight in policy.state_dict().items() if "lora_" in name}
    hparams = {"model_name_or_path": str(tiny_model_dir), "lora": lora}

    merged = export_policy(hparams, adapter_state, tmp_path / "merged")
    adapter_dir = export_policy(hparams, adapter_state, tmp_path / "adapter", merge_lora=False)
    main(["export", str(adapter_dir), str(tmp_path / "merged-from-adapter")])
    for directory in (merged, tmp_path / "merged-from-adapter"):
        exported = AutoModelForCausalLM.from_pretrained(directory).eval()
        with torch.no_grad():
            torch.testing.assert_close(exported(input_ids).logits, trained_logits, rtol=1e-4, atol=1e-4)
        base_embeddings = AutoModelForCausalLM.from_pretrained(tiny_model_dir).get_input_embeddings().weight
        assert torch.equal(exported.get_input_embeddings().weight, base_embeddings)  # the head's update not in them
