"""The fused LM head (issue 53.1): log-probs, entropies and gradients equal the full-logits computation,
and no tensor of all the logits is ever built, on both paths: the custom backward of a plain weight
(:class:`LinearHead`) and the checkpointed tiles of any other head (a callable).

The reference is today's path: the head applied to every position at once (``[n, C, V]`` logits, the
model's scaling and soft-capping applied to them), then
:func:`lit_grpo.algorithm.sampling_filters.sampling_log_softmax`.
"""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lit_grpo.algorithm.fused_lm_head import (
    LinearHead,
    fused_token_logprobs,
    linear_head,
    sampling_transform,
    tokens_per_tile,
)
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


PATHS = ["custom backward", "checkpointed"]


def on_path(head: torch.nn.Module, path: str):
    """The head as :func:`fused_token_logprobs` gets it on ``path``: its plain weight, or the module to call."""
    if path == "checkpointed":
        return head
    linear = linear_head(head)
    assert isinstance(linear, LinearHead)
    return linear


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


def fused(hidden, head, tokens, filters, prompt_ids, prompt_mask, tile_bytes=TILE_OF_3, entropy_grad=False, **model_transform):
    transform = sampling_transform(filters, tokens, V, prompt_ids, prompt_mask, **model_transform)
    return fused_token_logprobs(hidden, head, tokens, V, transform, with_entropy=True, tile_bytes=tile_bytes,
                                entropy_grad=entropy_grad)


def values_and_gradients(compute, hidden, parameters, weights):
    """log-probs, entropy, and the gradients of ``sum(weights * logps)`` w.r.t. hidden and ``parameters``."""
    hidden = hidden.clone().requires_grad_()
    logps, entropy = compute(hidden)
    gradients = torch.autograd.grad((logps * weights).sum(), [hidden, *parameters])
    return logps.detach(), entropy, gradients


def assert_fused_equals_full(head, parameters, filters, rtol=1e-5, atol=1e-6, entropy_atol=1e-6, path="checkpointed",
                             **model_transform):
    hidden, tokens, prompt_ids, prompt_mask, weights = inputs()
    expected = values_and_gradients(
        lambda h: full_logits_reference(h, head, tokens, filters, prompt_ids, prompt_mask, **model_transform),
        hidden, parameters, weights,
    )
    fused_head = on_path(head, path)
    actual = values_and_gradients(
        lambda h: fused(h, fused_head, tokens, filters, prompt_ids, prompt_mask, **model_transform), hidden, parameters, weights
    )
    close(actual[0], expected[0], rtol, atol)  # log-probs
    close(actual[1], expected[1], rtol, entropy_atol)  # entropy
    for got, want in zip(actual[2], expected[2]):  # d/d hidden, d/d each parameter
        close(got, want, rtol, atol)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", list(FILTERS))
def test_log_probs_entropy_and_gradients_equal_the_full_logits_for_every_filter(name, path):
    """The gradients of the hidden states, the weight and the bias too."""
    torch.manual_seed(0)
    head = torch.nn.Linear(H, V)
    assert_fused_equals_full(head, list(head.parameters()), FILTERS[name], path=path)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("model_transform", [{"softcapping": 3.0}, {"logit_scale": 0.25}, {"logit_scale": 1 / 0.3}])
@pytest.mark.parametrize("name", ["temperature", "all, vLLM's order"])
def test_the_models_scaling_and_soft_capping(model_transform, name, path):
    """Gemma's soft-capping, Granite's logits_scaling (a divisor: 1 / 0.3) and Cohere's logit_scale."""
    torch.manual_seed(1)
    head = torch.nn.Linear(H, V, bias=False)
    with torch.no_grad():
        head.weight.mul_(4)  # logits beyond the cap, where tanh bends
    # logits up to ~40: the entropy (logsumexp(z) - E[z]) cancels down to a few float32 steps of z, and
    # gradients of order 1 differ by the tiles' float32 matrix products (1e-5 of their scale)
    assert_fused_equals_full(head, [head.weight], FILTERS[name], atol=1e-5, entropy_atol=5e-5, path=path, **model_transform)


@pytest.mark.parametrize("path", PATHS)
def test_a_tied_head_gets_the_gradient_of_both_uses(path):
    """A tied head is the input embedding's weight: its gradient from the head adds to the embedding's."""
    torch.manual_seed(2)
    embedding = torch.nn.Embedding(V, H)
    hidden, tokens, prompt_ids, prompt_mask, weights = inputs()

    def compute(log_softmax, head):
        embedding.zero_grad()
        body = hidden + embedding(tokens)  # the weight's first use: the input embedding
        logps, _ = log_softmax(body, head, tokens, FILTERS["temperature"], prompt_ids, prompt_mask)
        (logps * weights).sum().backward()
        return logps.detach(), embedding.weight.grad.clone()

    def call(h):
        return torch.nn.functional.linear(h, embedding.weight)

    expected = compute(full_logits_reference, call)
    actual = compute(fused, call if path == "checkpointed" else LinearHead(embedding.weight))
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
    assert linear_head(head) is None  # not a plain weight: the module is called, in checkpointed tiles
    adapter = [p for p in model.parameters() if p.requires_grad]
    assert len(adapter) == 2  # lora_A, lora_B: the base weight is frozen
    assert_fused_equals_full(head, adapter, FILTERS["all, transformers' order"])


@pytest.mark.parametrize("path", PATHS)
def test_tiles_that_do_not_divide_the_completion_and_any_tile_size(path):
    """Values and gradients with tiles of 1, 3, 5 (14 = 5 + 5 + 4), every token and more."""
    torch.manual_seed(4)
    head = torch.nn.Linear(H, V)
    hidden, tokens, prompt_ids, prompt_mask, weights = inputs()
    filters = FILTERS["penalty"]
    expected = values_and_gradients(
        lambda h: full_logits_reference(h, head, tokens, filters, prompt_ids, prompt_mask), hidden, list(head.parameters()),
        weights)
    for tokens_in_tile in (1, 3, 5, 14, 100):  # 14 = every token: one tile, no recompute
        assert tokens_per_tile(V, tokens_in_tile * 4 * V) == tokens_in_tile
        actual = values_and_gradients(
            lambda h, tile_bytes=tokens_in_tile * 4 * V: fused(h, on_path(head, path), tokens, filters, prompt_ids,
                                                              prompt_mask, tile_bytes),
            hidden, list(head.parameters()), weights)
        close(actual[0], expected[0])
        close(actual[1], expected[1])
        for got, want in zip(actual[2], expected[2]):
            close(got, want, atol=1e-5)


@pytest.mark.parametrize("path", PATHS)
def test_bf16_autocast_within_the_bf16_tolerance(path):
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
            lambda h: fused(h, on_path(head, path), tokens, filters, prompt_ids, prompt_mask), hidden, [head.weight], weights)
    float32 = values_and_gradients(
        lambda h: full_logits_reference(h, head, tokens, filters, prompt_ids, prompt_mask), hidden, [head.weight], weights)
    close(actual[0], expected[0], rtol=1e-3, atol=1e-3)
    close(actual[1], expected[1], rtol=1e-3, atol=1e-3)
    close(actual[0], float32[0], rtol=0.05, atol=0.05)  # bf16 rounding of the logits, as today's path
    for got, want in zip(actual[2], expected[2]):
        close(got.float(), want.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("path", PATHS)
def test_without_gradient_and_without_tokens(path):
    head = torch.nn.Linear(H, V)
    hidden, tokens, prompt_ids, prompt_mask, _ = inputs()
    with torch.no_grad():
        logps, entropy = fused(hidden, on_path(head, path), tokens, FILTERS["top_k"], prompt_ids, prompt_mask)
        expected = full_logits_reference(hidden, head, tokens, FILTERS["top_k"], prompt_ids, prompt_mask)
    close(logps, expected[0])
    close(entropy, expected[1])
    empty, empty_entropy = fused_token_logprobs(hidden[:, :0], on_path(head, path), tokens[:, :0], V, with_entropy=True)
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


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", ["temperature", "all, vLLM's order"])
def test_no_tensor_of_all_the_logits_exists_forward_or_backward(name, path):
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
        hidden, on_path(head, path), tokens, vocab, sampling_transform(filters, tokens, vocab, prompt_ids, prompt_mask), with_entropy=True, tile_bytes=tile_bytes))
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


@pytest.mark.parametrize("path", PATHS)
def test_the_backward_makes_the_hidden_states_gradient_once_not_once_per_tile(path):
    """With 40 tiles, the gradient of the hidden states ``[n * C, H]`` is assembled once (the backward of
    ``split``, or written tile by tile into one tensor); the backward of one slice per tile made a zero
    tensor of that size per tile."""
    vocab, rows, width, hidden_size = 64, 2, 40, 8  # the hidden states: 640 elements, the head's weight 512
    head = torch.nn.Linear(hidden_size, vocab, bias=False)
    hidden = torch.randn(rows, width, hidden_size, requires_grad=True)
    tokens = torch.randint(0, vocab, (rows, width))
    logps, _ = fused_token_logprobs(hidden, on_path(head, path), tokens, vocab, tile_bytes=2 * 4 * vocab)  # 2 tokens a tile: 40 tiles
    with TensorsOfSize(hidden.numel()) as mode:
        logps.sum().backward()
    assert mode.count <= 3, mode.count  # the assembled gradient, and its reshape/accumulation


def test_the_tile_budget_is_the_cpus_on_the_cpu_and_at_least_a_thousand_tokens_on_an_accelerator():
    from lit_grpo.algorithm.fused_lm_head import ACCELERATOR_TILE_TOKENS, LOGITS_TILE_BYTES, tile_bytes_for

    assert tile_bytes_for("cpu", 151_936) == LOGITS_TILE_BYTES == 2**26
    assert tokens_per_tile(151_936, tile_bytes_for("cuda", 151_936)) == ACCELERATOR_TILE_TOKENS == 1024
    assert tile_bytes_for("cuda", 1_000) == LOGITS_TILE_BYTES  # a small vocabulary: the CPU's budget is already larger


def full_entropy_with_gradient(hidden, head, tokens, filters, prompt_ids, prompt_mask):
    """The entropy ``[n, C]`` with its gradient from every position's scored logits at once: the head on all
    of them, the same transform as the log-probs, then ``-sum p log p`` (0 off the support)."""
    transform = sampling_transform(filters, tokens, V, prompt_ids, prompt_mask)
    z = transform(head(hidden).reshape(N * C, V), torch.arange(N * C))  # [n * C, V]
    probs, log_probs = z.softmax(-1), z.log_softmax(-1)
    return -(probs * torch.where(probs > 0, log_probs, 0.0)).sum(-1).reshape(N, C)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", ["plain", "temperature", "top_p", "all, vLLM's order"])
def test_the_entropy_with_its_gradient_equals_the_full_logits(name, path):
    """``entropy_grad``: the entropy's gradient (with the log-probs', as an entropy bonus adds them) w.r.t.
    hidden states, weight and bias equals the full logits' in float32; without it, no gradient."""
    torch.manual_seed(7)
    head = torch.nn.Linear(H, V)
    filters = FILTERS[name]
    hidden, tokens, prompt_ids, prompt_mask, weights = inputs()
    entropy_weights = torch.randn(N, C, generator=torch.Generator().manual_seed(8))
    parameters = list(head.parameters())

    def gradients(compute):
        leaf = hidden.clone().requires_grad_()
        logps, entropy = compute(leaf)
        loss = (logps * weights).sum() + (entropy * entropy_weights).sum()
        return entropy.detach(), torch.autograd.grad(loss, [leaf, *parameters])

    expected = gradients(lambda h: (
        full_logits_reference(h, head, tokens, filters, prompt_ids, prompt_mask)[0],
        full_entropy_with_gradient(h, head, tokens, filters, prompt_ids, prompt_mask),
    ))
    actual = gradients(lambda h: fused(h, on_path(head, path), tokens, filters, prompt_ids, prompt_mask, entropy_grad=True))
    close(actual[0], expected[0])
    for got, want in zip(actual[1], expected[1]):
        close(got, want)
    _, entropy = fused(hidden.clone().requires_grad_(), on_path(head, path), tokens, filters, prompt_ids, prompt_mask)
    assert not entropy.requires_grad  # a metric


def weight_gradient(head, hidden, tokens, tile_bytes=None, path="checkpointed"):
    """d sum(logps) / d weight: from the full logits (``tile_bytes`` None) or the fused head on ``path``."""
    head.zero_grad()
    if tile_bytes is None:
        logps = head(hidden).float().log_softmax(-1).gather(-1, tokens[..., None])
    else:
        logps, _ = fused_token_logprobs(hidden, on_path(head, path), tokens, head.out_features, tile_bytes=tile_bytes)
    logps.sum().backward()
    return head.weight.grad.float().clone()


def test_a_bf16_weight_gradient_over_many_tiles_is_summed_in_float32():
    """Under bf16 autocast, 128 tiles' weight gradients summed in float32 (one rounding) stay as close to
    the float32 gradient as the full logits' one bf16 product; summed in bf16 tile by tile (the
    checkpointed path, as before) the error grew with the tiles (measured: 4 times the full path's)."""
    vocab, tokens_count, hidden_size = 4096, 2048, 128
    generator = torch.Generator().manual_seed(9)
    head = torch.nn.Linear(hidden_size, vocab, bias=False)
    hidden = torch.randn(1, tokens_count, hidden_size, generator=generator)
    tokens = torch.randint(0, vocab, (1, tokens_count), generator=generator)
    sixteen_tokens = 16 * 4 * vocab
    reference = weight_gradient(head, hidden, tokens)  # float32

    def error(gradient):
        return float((gradient - reference).norm() / reference.norm())

    with torch.autocast("cpu", dtype=torch.bfloat16):
        full = error(weight_gradient(head, hidden, tokens))
        summed_in_float32 = error(weight_gradient(head, hidden, tokens, sixteen_tokens, "custom backward"))
        summed_in_bf16 = error(weight_gradient(head, hidden, tokens, sixteen_tokens))
    assert summed_in_float32 <= 1.2 * full, (summed_in_float32, full)
    assert summed_in_bf16 > 2 * summed_in_float32, (summed_in_bf16, summed_in_float32)


class NewTensorsOfSize(TorchDispatchMode):
    """How many tensors of exactly ``numel`` elements the operations allocate (not counting views and
    in-place results, whose memory is an input's)."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.count = numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = [arg for arg in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(arg, torch.Tensor)]
        memory = {tensor.untyped_storage().data_ptr() for tensor in inputs}
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor) and tensor.numel() == self.numel:
                self.count += tensor.untyped_storage().data_ptr() not in memory
        return out


def test_the_backward_makes_the_weight_gradient_once_not_once_per_tile():
    """One float32 weight gradient accumulated over 40 tiles; the checkpointed tiles make one ``[V, H]``
    gradient per tile and add them up."""
    vocab, rows, width, hidden_size = 64, 2, 40, 6  # the head's weight: 384 elements, the hidden states 480
    head = torch.nn.Linear(hidden_size, vocab, bias=False)
    hidden = torch.randn(rows, width, hidden_size, requires_grad=True)
    tokens = torch.randint(0, vocab, (rows, width))

    def weight_sized_tensors(fused_head) -> int:
        logps, _ = fused_token_logprobs(hidden, fused_head, tokens, vocab, tile_bytes=2 * 4 * vocab)  # 40 tiles
        with NewTensorsOfSize(head.weight.numel()) as mode:
            logps.sum().backward()
        return mode.count

    assert weight_sized_tensors(linear_head(head)) <= 2  # the float32 buffer (and an accumulation)
    assert weight_sized_tensors(head) >= 40


def test_a_head_in_float32_under_bf16_autocast_and_with_bf16_weights():
    """``LinearHead.float32`` (``model.cast_lm_head_to_fp32``): the head's product in float32 whatever
    the autocast and the weight's dtype. Under bf16 autocast the log-probs then equal float32's
    (without it they carry bf16's rounding); a bf16 weight gets its gradient in bf16, from a float32 sum."""
    torch.manual_seed(10)
    head = torch.nn.Linear(H, V)
    hidden, tokens, prompt_ids, prompt_mask, weights = inputs()
    filters = FILTERS["temperature"]
    float32 = values_and_gradients(
        lambda h: fused(h, linear_head(head), tokens, filters, prompt_ids, prompt_mask), hidden, [head.weight], weights)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast = values_and_gradients(lambda h: fused(h, linear_head(head, float32=True), tokens, filters, prompt_ids,
                                                    prompt_mask), hidden, [head.weight], weights)
        bf16 = values_and_gradients(
            lambda h: fused(h, linear_head(head), tokens, filters, prompt_ids, prompt_mask), hidden, [head.weight], weights)
    close(cast[0], float32[0])
    for got, want in zip(cast[2], float32[2]):
        close(got, want)
    assert (bf16[0] - float32[0]).abs().max() > 1e-3  # what the option is for
    bf16_head = torch.nn.Linear(H, V).to(torch.bfloat16)
    upcast = torch.nn.Linear(H, V)
    upcast.load_state_dict(bf16_head.state_dict())  # the same values in float32
    logps, _ = fused(hidden.bfloat16(), linear_head(bf16_head, float32=True), tokens, filters, prompt_ids, prompt_mask)
    expected, _ = fused(hidden.bfloat16().float(), linear_head(upcast), tokens, filters, prompt_ids, prompt_mask)
    close(logps, expected)
    (logps * weights).sum().backward()
    assert bf16_head.weight.grad.dtype == torch.bfloat16


def test_only_a_plain_linear_layer_of_plain_tensors_is_a_linear_head():
    head = torch.nn.Linear(H, V)
    linear = linear_head(head, float32=True)
    assert linear.weight is head.weight and linear.bias is head.bias and linear.float32

    class Quantised(torch.nn.Parameter):  # any other kind of weight (a DTensor, a quantised weight): the module is called
        pass

    head.weight = Quantised(head.weight.detach())
    assert linear_head(head) is None
    assert linear_head(torch.nn.Sequential(torch.nn.Linear(H, V))) is None


def test_a_frozen_head_gets_no_weight_sized_gradient():
    """A frozen head (``requires_grad_(False)``: LoRA elsewhere) allocates no ``[V, H]`` gradient in the
    backward: the custom backward asks ``needs_input_grad`` (float32, no autocast: no weight cast either)."""
    vocab, rows, width, hidden_size = 64, 2, 40, 6
    head = torch.nn.Linear(hidden_size, vocab, bias=True).requires_grad_(False)
    hidden = torch.randn(rows, width, hidden_size, requires_grad=True)
    tokens = torch.randint(0, vocab, (rows, width))
    logps, _ = fused_token_logprobs(hidden, linear_head(head), tokens, vocab, tile_bytes=2 * 4 * vocab)
    with NewTensorsOfSize(head.weight.numel()) as mode:
        logps.sum().backward()
    assert mode.count == 0 and head.weight.grad is None and hidden.grad is not None


def test_a_second_derivative_through_the_custom_backward_is_refused():
    """The custom backward is not itself differentiable: a double backward raises instead of
    silently returning a wrong (zero) second derivative."""
    head = torch.nn.Linear(H, V)
    hidden, tokens, *_ = inputs()
    hidden.requires_grad_(True)
    logps, _ = fused_token_logprobs(hidden, linear_head(head), tokens, V, tile_bytes=TILE_OF_3)
    weights = torch.ones_like(logps, requires_grad=True)  # the second derivative also w.r.t. the loss's weights
    (grad_hidden,) = torch.autograd.grad(logps, hidden, weights, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        grad_hidden.sum().backward()


class PeakLiveBytes(TorchDispatchMode):
    """The peak of the bytes that tensors made by the operations under this mode hold at once (each
    storage counted until it is freed)."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}
        self.now = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                key = storage.data_ptr()
                if key in self.live or storage.nbytes() == 0:
                    continue
                self.live[key] = storage.nbytes()
                self.now += storage.nbytes()
                self.peak = max(self.peak, self.now)
                weakref.finalize(storage, self.free, key)
        return out

    def free(self, key: int) -> None:
        self.now -= self.live.pop(key, 0)


@pytest.mark.parametrize("name", ["temperature", "top_k", "min_p"])  # top_p: level (+1.5 KB); the penalty: +1.5 tiles
def test_the_custom_backward_peaks_no_higher_than_the_checkpointed_tiles(name):
    """The custom backward's peak live bytes (the entropy's gradient on, 8 tiles) are at most the
    checkpointed path's: each tile's gradient is freed before the next tile is recomputed, and the
    gradient of the logits is made in place (before: one tile's gradients kept while the next was
    recomputed, and about six temporaries of a tile's logits)."""
    vocab, rows, width, hidden_size = 16_384, 2, 64, 8
    generator = torch.Generator().manual_seed(7)
    head = torch.nn.Linear(hidden_size, vocab, bias=False)
    tokens = torch.randint(0, vocab, (rows, width), generator=generator)
    prompt_ids, prompt_mask = tokens[:, :3], torch.ones(rows, 3, dtype=torch.long)
    transform = sampling_transform(FILTERS[name], tokens, vocab, prompt_ids, prompt_mask)
    hidden = torch.randn(rows, width, hidden_size, generator=generator)

    def backward_peak(fused_head) -> int:
        inputs = hidden.clone().requires_grad_(True)
        logps, entropy = fused_token_logprobs(inputs, fused_head, tokens, vocab, transform, with_entropy=True,
                                              tile_bytes=2**20, entropy_grad=True)  # 16 tokens a tile: 8 tiles
        with PeakLiveBytes() as mode:
            (logps.sum() + entropy.sum()).backward()
        head.zero_grad()
        return mode.peak

    custom, checkpointed = backward_peak(linear_head(head)), backward_peak(head)
    assert custom <= checkpointed, (custom, checkpointed)


def test_off_cuda_the_weight_gradient_is_taken_from_the_unrounded_logits_gradient():
    """Under bf16 autocast on the CPU the weight gradient's product is taken in float32 anyway, so it
    takes the logits' float32 gradient as it is (before: rounded to bf16 first, ~1e-3 relative off)."""
    vocab, tokens_count, hidden_size = 64, 12, 8
    generator = torch.Generator().manual_seed(11)
    head = torch.nn.Linear(hidden_size, vocab, bias=False)
    hidden = torch.randn(1, tokens_count, hidden_size, generator=generator)
    tokens = torch.randint(0, vocab, (1, tokens_count), generator=generator)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logps, _ = fused_token_logprobs(hidden, linear_head(head), tokens, vocab, tile_bytes=4 * 4 * vocab)  # 3 tiles
    logps.sum().backward()
    rows = hidden[0].bfloat16()  # [t, H] as the head's product takes them
    logits = (rows @ head.weight.detach().bfloat16().T).float()  # [t, V]
    grad_logits = torch.nn.functional.one_hot(tokens[0], vocab).float() - logits.softmax(-1)
    close(head.weight.grad, grad_logits.T @ rows.float(), rtol=1e-5, atol=1e-6)
