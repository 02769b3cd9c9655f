"""The fused LM head (issue 53.1): log-probs, entropies and gradients equal the full-logits computation,
and no tensor of all the logits is ever built.

The reference is today's path: the head applied to every position at once (``[n, C, V]`` logits, the
model's scaling and soft-capping applied to them), then
:func:`lit_grpo.algorithm.sampling_filters.sampling_log_softmax`.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lit_grpo.algorithm.fused_lm_head import fused_token_logprobs, sampling_transform, tokens_per_tile
from lit_grpo.algorithm.sampling_filters import SamplingFilters, sampling_log_softmax

N, C, H, V = 2, 7, 16, 50
TILE_OF_3 = 3 * 4 * V  # three tokens' float32 logits: 14 tokens in tiles of 3, 3, 3, 3, 2

FILTERS = {
    "plain": SamplingFilters(),
    "temperature": SamplingFilters(temperature=0.7),
    "top_k": SamplingFilters(temperature=0.9, top_k=5),
    "top_p": SamplingFilters(top_p=0.8),
    "min_p": SamplingFilters(temperature=1.3, min_p=0.1),
    "penalty": SamplingFilters(temperature=0.8, repetition_penalty=1.4),
    "all, transformers' order": SamplingFilters(temperature=0.9, top_k=12, top_p=0.85, min_p=0.05, repetition_penalty=1.2),
    "all, vLLM's order": SamplingFilters(
        temperature=0.9, top_k=12, top_p=0.85, min_p=0.05, repetition_penalty=1.2, min_p_first=True
    ),
}


def close(actual: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


def inputs(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, C, H, generator=generator)
    tokens = torch.randint(0, V, (N, C), generator=generator)
    prompt_ids = torch.randint(0, V, (N, 4), generator=generator)
    prompt_mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    weights = torch.randn(N, C, generator=generator)  # d loss / d logps
    return hidden, tokens, prompt_ids, prompt_mask, weights


def full_logits_reference(hidden, head, tokens, filters, prompt_ids, prompt_mask, logit_scale=1.0, softcapping=None):
    """Today's path: every position's logits at once, then the sampling log-softmax."""
    logits = head(hidden) * logit_scale  # [n, C, V]
    if softcapping is not None:
        logits = softcapping * torch.tanh(logits / softcapping)
    return sampling_log_softmax(logits, tokens, filters, prompt_ids, prompt_mask, with_entropy=True)


def fused(hidden, head, tokens, filters, prompt_ids, prompt_mask, tile_bytes=TILE_OF_3, **model_transform):
    transform = sampling_transform(filters, tokens, V, prompt_ids, prompt_mask, **model_transform)
    return fused_token_logprobs(hidden, head, tokens, V, transform, with_entropy=True, tile_bytes=tile_bytes)


def values_and_gradients(compute, hidden, parameters, weights):
    """log-probs, entropy, and the gradients of ``sum(weights * logps)`` w.r.t. hidden and ``parameters``."""
    hidden = hidden.clone().requires_grad_()
    logps, entropy = compute(hidden)
    gradients = torch.autograd.grad((logps * weights).sum(), [hidden, *parameters])
    return logps.detach(), entropy, gradients


def assert_fused_equals_full(head, parameters, filters, rtol=1e-5, atol=1e-6, entropy_atol=1e-6, **model_transform):
    hidden, tokens, prompt_ids, prompt_mask, weights = inputs()
    expected = values_and_gradients(
        lambda h: full_logits_reference(h, head, tokens, filters, prompt_ids, prompt_mask, **model_transform),
        hidden, parameters, weights,
    )
    actual = values_and_gradients(
        lambda h: fused(h, head, tokens, filters, prompt_ids, prompt_mask, **model_transform), hidden, parameters, weights
    )
    close(actual[0], expected[0], rtol, atol)  # log-probs
    close(actual[1], expected[1], rtol, entropy_atol)  # entropy
    for got, want in zip(actual[2], expected[2]):  # d/d hidden, d/d each parameter
        close(got, want, rtol, atol)


@pytest.mark.parametrize("name", list(FILTERS))
def test_log_probs_entropy_and_gradients_equal_the_full_logits_for_every_filter(name):
    torch.manual_seed(0)
    head = torch.nn.Linear(H, V)
    assert_fused_equals_full(head, list(head.parameters()), FILTERS[name])


@pytest.mark.parametrize("model_transform", [{"softcapping": 3.0}, {"logit_scale": 0.25}, {"logit_scale": 1 / 0.3}])
@pytest.mark.parametrize("name", ["temperature", "all, vLLM's order"])
def test_the_models_scaling_and_soft_capping(model_transform, name):
    """Gemma's soft-capping, Granite's logits_scaling (a divisor: 1 / 0.3) and Cohere's logit_scale."""
    torch.manual_seed(1)
    head = torch.nn.Linear(H, V, bias=False)
    with torch.no_grad():
        head.weight.mul_(4)  # logits beyond the cap, where tanh bends
    # logits up to ~40: the entropy (logsumexp(z) - E[z]) cancels down to a few float32 steps of z, and
    # gradients of order 1 differ by the tiles' float32 matrix products (1e-5 of their scale)
    assert_fused_equals_full(head, [head.weight], FILTERS[name], atol=1e-5, entropy_atol=5e-5, **model_transform)


def test_a_tied_head_gets_the_gradient_of_both_uses():
    """A tied head is the input embedding's weight: its gradient from the head adds to the embedding's."""
    torch.manual_seed(2)
    embedding = torch.nn.Embedding(V, H)
    hidden, tokens, prompt_ids, prompt_mask, weights = inputs()

    def compute(log_softmax):
        embedding.zero_grad()
        body = hidden + embedding(tokens)  # the weight's first use: the input embedding
        logps, _ = log_softmax(body, lambda h: torch.nn.functional.linear(h, embedding.weight), tokens,
                               FILTERS["temperature"], prompt_ids, prompt_mask)
        (logps * weights).sum().backward()
        return logps.detach(), embedding.weight.grad.clone()

    expected, actual = compute(full_logits_reference), compute(fused)
    close(actual[0], expected[0])
    close(actual[1], expected[1], atol=1e-5)  # sums over every position: 1e-5 of its scale


def test_a_lora_adapter_on_the_head():
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(3)

    class Body(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = torch.nn.Linear(H, V, bias=False)

    model = get_peft_model(Body(), LoraConfig(r=4, lora_alpha=8, target_modules=["lm_head"], init_lora_weights=False))
    head = model.base_model.model.lm_head
    adapter = [p for p in model.parameters() if p.requires_grad]
    assert len(adapter) == 2  # lora_A, lora_B: the base weight is frozen
    assert_fused_equals_full(head, adapter, FILTERS["all, transformers' order"])


def test_tiles_that_do_not_divide_the_completion_and_any_tile_size():
    torch.manual_seed(4)
    head = torch.nn.Linear(H, V)
    hidden, tokens, prompt_ids, prompt_mask, _ = inputs()
    expected = full_logits_reference(hidden, head, tokens, FILTERS["penalty"], prompt_ids, prompt_mask)
    for tokens_in_tile in (1, 3, 5, 14, 100):  # 14 = every token: one tile, no recompute
        assert tokens_per_tile(V, tokens_in_tile * 4 * V) == tokens_in_tile
        logps, entropy = fused(hidden, head, tokens, FILTERS["penalty"], prompt_ids, prompt_mask, tokens_in_tile * 4 * V)
        close(logps, expected[0])
        close(entropy, expected[1])


def test_bf16_autocast_within_the_bf16_tolerance():
    """Under bf16 autocast the head's logits are bf16 in both paths; log-probs agree as closely as
    the full path agrees with itself on float32 weights (the same bf16 matrix products per row)."""
    torch.manual_seed(5)
    head = torch.nn.Linear(H, V)
    filters = FILTERS["all, vLLM's order"]
    hidden, tokens, prompt_ids, prompt_mask, weights = inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = values_and_gradients(
            lambda h: full_logits_reference(h, head, tokens, filters, prompt_ids, prompt_mask), hidden, [head.weight], weights)
        actual = values_and_gradients(
            lambda h: fused(h, head, tokens, filters, prompt_ids, prompt_mask), hidden, [head.weight], weights)
    float32 = values_and_gradients(
        lambda h: full_logits_reference(h, head, tokens, filters, prompt_ids, prompt_mask), hidden, [head.weight], weights)
    close(actual[0], expected[0], rtol=1e-3, atol=1e-3)
    close(actual[1], expected[1], rtol=1e-3, atol=1e-3)
    close(actual[0], float32[0], rtol=0.05, atol=0.05)  # bf16 rounding of the logits, as today's path
    for got, want in zip(actual[2], expected[2]):
        close(got.float(), want.float(), rtol=1e-2, atol=1e-2)


def test_without_gradient_and_without_tokens():
    head = torch.nn.Linear(H, V)
    hidden, tokens, prompt_ids, prompt_mask, _ = inputs()
    with torch.no_grad():
        logps, entropy = fused(hidden, head, tokens, FILTERS["top_k"], prompt_ids, prompt_mask)
        expected = full_logits_reference(hidden, head, tokens, FILTERS["top_k"], prompt_ids, prompt_mask)
    close(logps, expected[0])
    close(entropy, expected[1])
    empty, empty_entropy = fused_token_logprobs(hidden[:, :0], head, tokens[:, :0], V, with_entropy=True)
    assert empty.shape == empty_entropy.shape == (N, 0)


class LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an operation makes (forward, recompute and backward: on the
    CPU autograd runs the backward in the calling thread, under this mode)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor):
                self.largest = max(self.largest, tensor.numel())
        return out


@pytest.mark.parametrize("name", ["temperature", "all, vLLM's order"])
def test_no_tensor_of_all_the_logits_exists_forward_or_backward(name):
    """At a vocabulary of 16,384 and 2 x 64 tokens all the logits are 2 M elements (8 MiB in float32);
    with tiles of 1 MiB no operation, forward or backward, makes a tensor of more than a tile's
    logits. The full-logits path makes several of all of them."""
    vocab, rows, width, hidden_size = 16_384, 2, 64, 8
    generator = torch.Generator().manual_seed(6)
    head = torch.nn.Linear(hidden_size, vocab, bias=False)
    hidden = torch.randn(rows, width, hidden_size, generator=generator, requires_grad=True)
    tokens = torch.randint(0, vocab, (rows, width), generator=generator)
    prompt_ids, prompt_mask = tokens[:, :3], torch.ones(rows, 3, dtype=torch.long)
    filters = FILTERS[name]
    tile_bytes = 2**20  # 16 tokens' logits
    full = rows * width * vocab

    def largest(compute) -> int:
        with LargestTensor() as mode:
            logps, _ = compute()
            logps.sum().backward()
        return mode.largest

    fused_largest = largest(lambda: fused_token_logprobs(
        hidden, head, tokens, vocab, sampling_transform(filters, tokens, vocab, prompt_ids, prompt_mask), with_entropy=True, tile_bytes=tile_bytes))
    assert fused_largest <= tile_bytes // 4, (fused_largest, full)
    full_largest = largest(lambda: sampling_log_softmax(head(hidden), tokens, filters, prompt_ids, prompt_mask, with_entropy=True))
    assert full_largest >= full


class TensorsOfSize(TorchDispatchMode):
    """How many tensors of exactly ``numel`` elements the operations make."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.count = numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor) and tensor.numel() == self.numel:
                self.count += 1
        return out


def test_the_backward_makes_the_hidden_states_gradient_once_not_once_per_tile():
    """With 40 tiles, the gradient of the hidden states ``[n * C, H]`` is assembled once (the backward of
    ``split``); the backward of one slice per tile made a zero tensor of that size per tile."""
    vocab, rows, width, hidden_size = 64, 2, 40, 8  # the hidden states: 640 elements, the head's weight 512
    head = torch.nn.Linear(hidden_size, vocab, bias=False)
    hidden = torch.randn(rows, width, hidden_size, requires_grad=True)
    tokens = torch.randint(0, vocab, (rows, width))
    logps, _ = fused_token_logprobs(hidden, head, tokens, vocab, tile_bytes=2 * 4 * vocab)  # 2 tokens a tile: 40 tiles
    with TensorsOfSize(hidden.numel()) as mode:
        logps.sum().backward()
    assert mode.count <= 3, mode.count  # the assembled gradient, and its reshape/accumulation


def test_the_tile_budget_is_the_cpus_on_the_cpu_and_at_least_a_thousand_tokens_on_an_accelerator():
    from lit_grpo.algorithm.fused_lm_head import ACCELERATOR_TILE_TOKENS, LOGITS_TILE_BYTES, tile_bytes_for

    assert tile_bytes_for("cpu", 151_936) == LOGITS_TILE_BYTES == 2**26
    assert tokens_per_tile(151_936, tile_bytes_for("cuda", 151_936)) == ACCELERATOR_TILE_TOKENS == 1024
    assert tile_bytes_for("cuda", 1_000) == LOGITS_TILE_BYTES  # a small vocabulary: the CPU's budget is already larger
