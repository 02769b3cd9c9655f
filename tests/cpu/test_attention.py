"""``lit_grpo.attention``: attention in bf16/fp16 on the CPU as grouped matrix products (decode
steps, prefills and training forwards) instead of PyTorch's SDPA kernel, SDPA for everything else;
and the sampler's weights cast to bf16 once per generation batch."""

import contextlib
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, GenerationConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import lit_grpo.cpu
import lit_grpo.cpu.attention as attention
import lit_grpo.train.logprob_passes
import lit_grpo.train.module
from lit_grpo.cpu.attention import NAME, cpu_half_attention, use_cpu_half_attention
from lit_grpo.rollout.engines.policy import generate_completions

GQA_MODULE = SimpleNamespace(num_key_value_groups=2, is_causal=True)  # 4 query heads on 2 key/value heads


def attention_inputs(dtype, q_length=1, n=5, kv_length=9, causal=False):
    """Random queries, keys and values and a left-padding mask: row r's first r positions are padding
    (with ``causal``, query t of the last ``q_length`` positions also sees no later key)."""
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(n, 4, q_length, 16, generator=generator).to(dtype)
    key = torch.randn(n, 2, kv_length, 16, generator=generator).to(dtype)
    value = torch.randn(n, 2, kv_length, 16, generator=generator).to(dtype)
    mask = torch.ones(n, 1, q_length, kv_length, dtype=torch.bool)
    if causal:
        mask = mask & torch.ones(q_length, kv_length, dtype=torch.bool).tril(kv_length - q_length)
    for row in range(n):
        mask[row, :, :, :row] = False
    return query, key, value, mask


def float32_reference(query, key, value, mask):
    """Attention by hand in float32 on the same inputs: kv head h // 2 for query head h."""
    key, value = (t.float().repeat_interleave(2, dim=1) for t in (key, value))  # [n, 4, S, D]
    scores = query.float() @ key.transpose(-1, -2) / 4.0  # scaling 16 ** -0.5
    probs = scores.masked_fill(~mask, torch.finfo(torch.float32).min).softmax(dim=-1)  # fully masked rows: uniform
    return (probs @ value).transpose(1, 2)  # [n, q, heads, D]


@pytest.fixture
def no_sdpa_kernel(monkeypatch):
    """Makes PyTorch's SDPA kernel raise: proves a path does not use it."""

    def refuse(*args, **kwargs):
        raise AssertionError("scaled_dot_product_attention was called")

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", refuse)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_decode_step_is_grouped_matmul_attention(dtype, no_sdpa_kernel):
    query, key, value, mask = attention_inputs(dtype)
    output, weights = cpu_half_attention(GQA_MODULE, query, key, value, mask, scaling=0.25)
    assert weights is None and output.shape == (5, 1, 4, 16) and output.dtype == dtype
    expected = float32_reference(query, key, value, mask)
    torch.testing.assert_close(output.float(), expected, atol=2e-2, rtol=2e-2)
    # every row really attends to its own unpadded positions only (row 4 sees positions 4..8)
    assert not torch.allclose(output[4].float(), float32_reference(query, key, value, torch.ones_like(mask))[4], atol=2e-2)


def test_half_precision_under_autocast_takes_float32_queries(no_sdpa_kernel):
    """Under autocast the rotary embedding hands over float32 queries and keys while the cache holds
    bf16: the products still run in bf16."""
    query, key, value, mask = attention_inputs(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        output, _ = cpu_half_attention(GQA_MODULE, query.float(), key, value, mask, scaling=0.25)
    assert output.dtype == torch.bfloat16
    torch.testing.assert_close(output.float(), float32_reference(query, key, value, mask), atol=2e-2, rtol=2e-2)


def test_several_query_tokens_with_left_padding_and_causal_mask(no_sdpa_kernel):
    """A prefill or training forward: 6 query tokens against 8 keys (2 cached), per-row left padding.
    The real query positions match float32 attention; padding queries (no key to attend to) stay finite."""
    query, key, value, mask = attention_inputs(torch.bfloat16, q_length=6, n=5, kv_length=8, causal=True)
    output, _ = cpu_half_attention(GQA_MODULE, query, key, value, mask, scaling=0.25)
    assert output.shape == (5, 6, 4, 16)
    real = mask[:, 0].any(dim=-1)  # [n, q] queries that see at least one key
    assert not real.all()  # row 4: its first query sees only padding
    expected = float32_reference(query, key, value, mask)
    torch.testing.assert_close(output.float()[real], expected[real], atol=2e-2, rtol=2e-2)
    assert torch.isfinite(output).all()


@pytest.mark.parametrize("kv_length", [5, 7], ids=["square", "more keys than queries"])
def test_no_mask_means_causal_from_the_top_left_as_sdpa(kv_length, no_sdpa_kernel):
    """transformers passes no mask where SDPA's ``is_causal`` applies: query t sees keys 0..t."""
    query, key, value, _ = attention_inputs(torch.bfloat16, q_length=5, n=2, kv_length=kv_length)
    output, _ = cpu_half_attention(GQA_MODULE, query, key, value, None, scaling=0.25)
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    expected = float32_reference(query, key[:, :, :5], value[:, :, :5], causal)
    torch.testing.assert_close(output.float(), expected, atol=2e-2, rtol=2e-2)


def test_gradients_match_float32_attention_and_only_half_precision_scores_are_saved():
    query, key, value, mask = attention_inputs(torch.bfloat16, q_length=6, n=5, kv_length=6, causal=True)
    real = mask[:, 0].any(dim=-1)  # [n, q]
    weights = torch.randn(5, 6, 4, 16, generator=torch.Generator().manual_seed(1)) * real[:, :, None, None]

    def gradients(function):
        leaves = [t.float().requires_grad_() for t in (query, key, value)]
        output = function(*leaves)
        (output.float() * weights).sum().backward()
        return [leaf.grad for leaf in leaves]

    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        ours = gradients(lambda q, k, v: cpu_half_attention_under_autocast(q, k, v, mask))
    expected = gradients(lambda q, k, v: float32_reference(q, k, v, mask))
    for got, want in zip(ours, expected):
        torch.testing.assert_close(got, want, atol=5e-2, rtol=5e-2)
    scores = 5 * 4 * 6 * 6
    saved_scores = [t for t in saved if t.numel() == scores]
    assert saved_scores and all(t.dtype == torch.bfloat16 for t in saved_scores)  # 2 bytes per score


def cpu_half_attention_under_autocast(query, key, value, mask):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        output, _ = cpu_half_attention(GQA_MODULE, query, key, value, mask, scaling=0.25)
    return output


@pytest.mark.parametrize(
    "dtype,q_length,max_scores",
    [(torch.float32, 1, attention.MAX_SCORES), (torch.float32, 3, attention.MAX_SCORES), (torch.bfloat16, 3, 5 * 4 * 3 * 9 - 1)],
    ids=["float32 decode", "float32 prefill", "bf16 scores above MAX_SCORES"],
)
def test_everything_else_is_transformers_sdpa(dtype, q_length, max_scores, monkeypatch):
    monkeypatch.setattr(attention, "MAX_SCORES", max_scores)
    query, key, value, mask = attention_inputs(dtype, q_length=q_length)
    output, _ = cpu_half_attention(GQA_MODULE, query, key, value, mask, scaling=0.25)
    expected, _ = sdpa_attention_forward(GQA_MODULE, query, key, value, mask, scaling=0.25)
    assert torch.equal(output, expected)


def test_use_cpu_half_attention_switches_sdpa_models_only_and_restores(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert model.config._attn_implementation == "sdpa"
    with use_cpu_half_attention(model):
        assert model.config._attn_implementation == NAME
        with use_cpu_half_attention(model):  # nested: left as it is, restored by the outer block only
            assert model.config._attn_implementation == NAME
        assert model.config._attn_implementation == NAME
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(RuntimeError, match="boom"), use_cpu_half_attention(model):
        raise RuntimeError("boom")
    assert model.config._attn_implementation == "sdpa"
    eager = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="eager")
    with use_cpu_half_attention(eager):
        assert eager.config._attn_implementation == "eager"


GREEDY_PROMPTS = ["hello there", "a", "say something long please"]  # left padding of different widths


def greedy_config(tokenizer, max_new_tokens=12):
    return GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )


def test_bf16_group_sampler_never_calls_sdpa_and_decodes_as_float32_attention(chaotic_model, monkeypatch):
    """Under bf16 autocast neither the prefill nor a decode step reaches PyTorch's SDPA kernel, and the
    greedy completions are those of the sampler with float32 attention (SDPA outside autocast's
    reach), every other product in bf16 alike."""
    model, tokenizer = chaotic_model
    config = greedy_config(tokenizer)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    calls = []

    def recording_sdpa(*args, **kwargs):
        calls.append(args[0].shape)
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording_sdpa)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fast = generate_completions(model, tokenizer, GREEDY_PROMPTS, 2, config, backend="lit")
    assert calls == []

    def float32_sdpa(query, key, value, *args, **kwargs):
        with torch.autocast("cpu", enabled=False):
            return sdpa(query.float(), key.float(), value.float(), *args, **kwargs).to(query.dtype)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", float32_sdpa)
    monkeypatch.setattr(lit_grpo.cpu, "use_cpu_half_attention", lambda model: contextlib.nullcontext())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference = generate_completions(model, tokenizer, GREEDY_PROMPTS, 2, config, backend="lit")
    assert fast.completion_ids.shape[1] > 1
    assert torch.equal(fast.completion_ids, reference.completion_ids)
    assert torch.equal(fast.completion_mask, reference.completion_mask)


class WeightCastCounter(TorchDispatchMode):
    """Counts float32 -> bf16 casts (below autocast) of tensors shaped like ``shapes``."""

    def __init__(self, shapes):
        super().__init__()
        self.shapes, self.casts = set(shapes), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and kwargs.get("dtype") == torch.bfloat16:
            if args[0].dtype == torch.float32 and tuple(args[0].shape) in self.shapes:
                self.casts += 1
        return func(*args, **kwargs)


def test_sampler_casts_each_weight_once_and_drops_the_casts_afterwards(chaotic_model):
    """Lightning's autocast caches no casts, so every layer would cast its float32 weight at every
    token; the sampler casts each once per batch, and the cast copies do not outlive it: after an
    in-place weight update under the same autocast block, sampling follows the new weights."""
    model, tokenizer = chaotic_model
    config = greedy_config(tokenizer, max_new_tokens=8)
    weight = model.model.layers[0].mlp.gate_proj.weight
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):  # as Lightning's bf16-mixed
        with WeightCastCounter([tuple(weight.shape)]) as counter:
            before = generate_completions(model, tokenizer, GREEDY_PROMPTS, 2, config)
        same_shape = sum(p.shape == weight.shape for p in model.parameters())
        assert before.completion_ids.size(1) > 2  # several decode steps ran
        assert counter.casts == same_shape  # once per weight, not once per token
        original = weight.detach().clone()
        try:
            with torch.no_grad():
                weight.mul_(-3.0)  # an optimizer step inside the same autocast block
            after = generate_completions(model, tokenizer, GREEDY_PROMPTS, 2, config)
        finally:
            with torch.no_grad():
                weight.copy_(original)
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        with torch.no_grad():
            weight.mul_(-3.0)
        try:
            fresh = generate_completions(model, tokenizer, GREEDY_PROMPTS, 2, config)  # a new block: no cache
        finally:
            with torch.no_grad():
                weight.copy_(original)
    assert not torch.equal(after.completion_ids, before.completion_ids)
    assert torch.equal(after.completion_ids, fresh.completion_ids)


def test_bf16_training_step_runs_no_sdpa_kernel(tiny_model_dir, say_a_or_b_file, fast_trainer, no_sdpa_kernel, monkeypatch):
    """A bf16-mixed training step (sampling, then a backward in chunks after one shared prompt
    forward) takes the matmul attention everywhere, and its update moves the weights by finite amounts."""
    import lightning.pytorch as pl
    import test_module

    pl.seed_everything(0)
    monkeypatch.setattr(lit_grpo.train.logprob_passes, "FORWARD_OVERHEAD_TOKENS", 0)  # share even these short prompts
    module = test_module.make_module(
        tiny_model_dir, max_completion_length=6, forward_token_budget=12, optimizer=test_module.adamw(1e-2)
    )
    module.configure_model()
    before = [p.detach().clone() for p in module.policy.parameters()]
    forwards_with_grad = []
    module.policy.register_forward_pre_hook(lambda m, args: forwards_with_grad.append(torch.is_grad_enabled()))
    fast_trainer(precision="bf16-mixed").fit(module, datamodule=test_module.make_data(say_a_or_b_file))
    assert sum(forwards_with_grad) >= 3  # a shared prompt forward and at least two chunks
    changed = [not torch.equal(b, p) for b, p in zip(before, module.policy.parameters())]
    assert any(changed) and all(torch.isfinite(p).all() for p in module.policy.parameters())


PRIMITIVE_CACHE_PRESETS = [None, "99"]  # the environment's ONEDNN_PRIMITIVE_CACHE_CAPACITY: unset, the user's value


def capacity_after_import(preset: str | None) -> str:
    """ONEDNN_PRIMITIVE_CACHE_CAPACITY in a fresh process once it imported lit_grpo.cpu, with ``preset`` in its environment."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "ONEDNN_PRIMITIVE_CACHE_CAPACITY"}
    if preset is not None:
        env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = preset
    code = "import os, lit_grpo.cpu; print(os.environ['ONEDNN_PRIMITIVE_CACHE_CAPACITY'])"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout


@pytest.fixture(scope="module")
def capacities_after_import():
    """Each preset's process, started side by side by the first test that asks (each imports torch on one
    thread: on 2 cores they overlap). ``capacities_after_import[preset].result()``."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(PRIMITIVE_CACHE_PRESETS)) as beside:
        yield {preset: beside.submit(capacity_after_import, preset) for preset in PRIMITIVE_CACHE_PRESETS}


@pytest.mark.parametrize("preset,expected", [(None, "128"), ("99", "99")], ids=["default", "user's value"])
def test_import_caps_onednn_primitive_cache_unless_the_user_set_it(preset, expected, capacities_after_import):
    """bf16 matmuls of ever-changing shapes fill oneDNN's primitive cache (1024 entries by default);
    importing lit_grpo caps it before the first matmul, and a value in the environment wins."""
    output = capacities_after_import[preset].result()
    assert output.strip() == expected
