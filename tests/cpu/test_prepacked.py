"""Prepacked bf16 linear weights while sampling on the CPU (``lit_grpo.prepacked``)."""

from contextlib import nullcontext

import pytest
import torch
from transformers import GenerationConfig

import lit_grpo.cpu as cpu
import lit_grpo.rollout.engines.policy as generation
from lit_grpo.cpu.prepacked import prepack_dtype, prepacked_linear_weights

CPU = torch.device("cpu")
needs_bf16_kernels = pytest.mark.skipif(
    not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()),
    reason="this CPU has no oneDNN bf16 kernels: nothing is prepacked (tested below)",
)
PROMPTS = ["hello there", "a", "say something long please", "12+7="]


def linear_layers(model) -> list[torch.nn.Linear]:
    return [module for module in model.modules() if type(module) is torch.nn.Linear]


@needs_bf16_kernels
def test_every_linear_layer_multiplies_by_its_packed_weight_with_the_same_bf16_outputs(chaotic_model, monkeypatch):
    model, _ = chaotic_model
    layers = linear_layers(model)
    inputs = {layer: torch.randn(3, 5, layer.in_features) for layer in layers}  # [rows, tokens, in]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = {layer: layer(x) for layer, x in inputs.items()}
        calls = []
        real = torch.ops.mkldnn._linear_pointwise

        def counting(*args):
            calls.append(args[0].shape)
            return real(*args)

        monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", counting)
        with prepacked_linear_weights(model, CPU) as packed:
            assert packed == len(layers) > 0
            assert all("forward" in layer.__dict__ for layer in layers)
            got = {layer: layer(x) for layer, x in inputs.items()}
    assert len(calls) == len(layers)  # every layer went through its packed weight
    for layer in layers:
        assert got[layer].dtype == torch.bfloat16 and got[layer].shape == expected[layer].shape
        assert torch.equal(got[layer], expected[layer])  # bit for bit
    assert not any("forward" in layer.__dict__ for layer in layers)  # restored


@needs_bf16_kernels
def test_bf16_sampling_draws_the_same_tokens_with_and_without_packed_weights(chaotic_model, monkeypatch):
    model, tokenizer = chaotic_model
    generation_config = GenerationConfig(
        max_new_tokens=20, do_sample=True, top_k=0, top_p=1.0, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    entered = []
    real = cpu.prepacked_linear_weights

    def recording(model, device):
        entered.append(device)
        return real(model, device)

    rollouts = []
    for prepack in (recording, lambda model, device: nullcontext(0)):
        monkeypatch.setattr(cpu, "prepacked_linear_weights", prepack)
        torch.manual_seed(0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            rollouts.append(generation.generate_completions(model, tokenizer, PROMPTS, 4, generation_config))
    assert entered == [CPU]
    assert rollouts[0].completion_mask.sum() > len(PROMPTS) * 4  # real completions, not only EOS
    assert torch.equal(rollouts[0].completion_ids, rollouts[1].completion_ids)
    assert torch.equal(rollouts[0].completion_mask, rollouts[1].completion_mask)


@needs_bf16_kernels
def test_layers_are_restored_when_the_block_raises(chaotic_model):
    model, _ = chaotic_model
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(RuntimeError, match="inside"):
            with prepacked_linear_weights(model, CPU):
                raise RuntimeError("inside")
    assert not any("forward" in layer.__dict__ for layer in linear_layers(model))


def test_nothing_is_packed_in_float32_under_autograd_off_the_cpu_or_without_bf16_kernels(chaotic_model, monkeypatch):
    model, _ = chaotic_model
    with torch.no_grad():
        assert prepack_dtype(model, CPU) is None  # float32 weights, no autocast
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert prepack_dtype(model, torch.device("cuda")) is None
            with prepacked_linear_weights(model, torch.device("meta")) as packed:
                assert packed == 0
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autograd recording: the weights may get gradients
        assert prepack_dtype(model, CPU) is None
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert prepack_dtype(model, CPU) is None
        with prepacked_linear_weights(model, CPU) as packed:
            assert packed == 0
            assert not any("forward" in layer.__dict__ for layer in linear_layers(model))


@needs_bf16_kernels
def test_only_plain_linear_layers_with_ordinary_weights_are_packed():
    class ScaledLinear(torch.nn.Linear):  # a subclass (as quantized linears are) computes its own way
        def forward(self, input):
            return super().forward(input) * 2

    plain, subclass, own_forward = torch.nn.Linear(8, 4), ScaledLinear(8, 4), torch.nn.Linear(8, 4)
    own_forward.forward = lambda input: torch.zeros(input.shape[:-1] + (4,))
    model = torch.nn.ModuleList([plain, subclass, own_forward])
    x = torch.randn(2, 8)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = [layer(x) for layer in model]
        with prepacked_linear_weights(model, CPU) as packed:
            assert packed == 1 and "forward" in plain.__dict__
            assert all(torch.equal(layer(x), out) for layer, out in zip(model, expected))
    assert own_forward.forward(x).abs().sum() == 0  # its own forward survives the block
    bf16 = torch.nn.Linear(8, 4).to(torch.bfloat16)  # bf16 weights without autocast are packed too
    with torch.no_grad(), prepacked_linear_weights(bf16, CPU) as packed:
        assert packed == 1 and torch.equal(bf16(x.bfloat16()), torch.nn.functional.linear(x.bfloat16(), bf16.weight, bf16.bias))
