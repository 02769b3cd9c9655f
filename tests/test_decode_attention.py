"""The group sampler's decode attention (``lit_grpo.generation.decode_attention``): one-token
queries in bf16 on the CPU as two grouped matrix products instead of PyTorch's SDPA kernel."""

import contextlib
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import lit_grpo.generation as generation
from lit_grpo.generation import DECODE_ATTENTION, decode_attention, fast_decode_attention, generate_completions

GQA_MODULE = SimpleNamespace(num_key_value_groups=2, is_causal=True)  # 4 query heads on 2 key/value heads


def attention_inputs(dtype, q_length=1, n=5, kv_length=9):
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(n, 4, q_length, 16, generator=generator).to(dtype)
    key = torch.randn(n, 2, kv_length, 16, generator=generator).to(dtype)
    value = torch.randn(n, 2, kv_length, 16, generator=generator).to(dtype)
    # left padding: row r attends to its last kv_length - r positions
    mask = torch.ones(n, 1, q_length, kv_length, dtype=torch.bool)
    for row in range(n):
        mask[row, :, :, :row] = False
    return query, key, value, mask


def float32_reference(query, key, value, mask):
    """Attention by hand in float32 on the same (rounded) inputs: kv head h // 2 for query head h."""
    key, value = (t.float().repeat_interleave(2, dim=1) for t in (key, value))  # [n, 4, S, D]
    scores = query.float() @ key.transpose(-1, -2) / 4.0  # scaling 16 ** -0.5
    probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
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
    output, weights = decode_attention(GQA_MODULE, query, key, value, mask, scaling=0.25)
    assert weights is None and output.shape == (5, 1, 4, 16) and output.dtype == dtype
    expected = float32_reference(query, key, value, mask)
    torch.testing.assert_close(output.float(), expected, atol=2e-2, rtol=2e-2)
    # every row really attends to its own unpadded positions only (row 4 sees positions 4..8)
    assert not torch.allclose(output[4].float(), float32_reference(query, key, value, torch.ones_like(mask))[4], atol=2e-2)


def test_half_precision_decode_under_autocast_takes_float32_queries(no_sdpa_kernel):
    """Under autocast the rotary embedding hands over float32 queries and keys while the cache holds
    bf16: the products still run in bf16."""
    query, key, value, mask = attention_inputs(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        output, _ = decode_attention(GQA_MODULE, query.float(), key, value, mask, scaling=0.25)
    assert output.dtype == torch.bfloat16
    torch.testing.assert_close(output.float(), float32_reference(query, key, value, mask), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(
    "dtype,q_length", [(torch.float32, 1), (torch.bfloat16, 3)], ids=["float32 decode", "bf16 prefill"]
)
def test_everything_else_is_transformers_sdpa(dtype, q_length):
    query, key, value, mask = attention_inputs(dtype, q_length=q_length)
    output, _ = decode_attention(GQA_MODULE, query, key, value, mask, scaling=0.25)
    expected, _ = sdpa_attention_forward(GQA_MODULE, query, key, value, mask, scaling=0.25)
    assert torch.equal(output, expected)


def test_fast_decode_attention_switches_sdpa_models_only_and_restores(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert model.config._attn_implementation == "sdpa"
    with fast_decode_attention(model):
        assert model.config._attn_implementation == DECODE_ATTENTION
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(RuntimeError, match="boom"), fast_decode_attention(model):
        raise RuntimeError("boom")
    assert model.config._attn_implementation == "sdpa"
    eager = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="eager")
    with fast_decode_attention(eager):
        assert eager.config._attn_implementation == "eager"


def test_bf16_group_sampler_decodes_without_sdpa_and_keeps_its_tokens(chaotic_model, monkeypatch):
    """Under bf16 autocast only the prefill (several query tokens) reaches PyTorch's SDPA kernel;
    greedy completions equal those of the sampler with SDPA for every step."""
    model, tokenizer = chaotic_model
    config = GenerationConfig(
        max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id
    )
    prompts = ["hello there", "a", "say something long please"]  # left padding of different widths

    query_lengths = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording_sdpa(query, *args, **kwargs):
        query_lengths.append(query.shape[2])
        return sdpa(query, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording_sdpa)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fast = generate_completions(model, tokenizer, prompts, 2, config, backend="lit")
    num_layers = model.config.num_hidden_layers
    assert len(query_lengths) == num_layers and min(query_lengths) > 1  # one prefill, no decode step

    query_lengths.clear()
    monkeypatch.setattr(generation, "fast_decode_attention", lambda model: contextlib.nullcontext())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = generate_completions(model, tokenizer, prompts, 2, config, backend="lit")
    assert len(query_lengths) > num_layers  # the plain sampler decodes with SDPA too
    assert fast.completion_ids.shape[1] > 1
    assert torch.equal(fast.completion_ids, plain.completion_ids)
    assert torch.equal(fast.completion_mask, plain.completion_mask)


@pytest.mark.parametrize("preset,expected", [(None, "16"), ("99", "99")], ids=["default", "user's value"])
def test_import_caps_onednn_primitive_cache_unless_the_user_set_it(preset, expected):
    """bf16 matmuls of ever-changing shapes fill oneDNN's primitive cache (1024 entries by default);
    importing lit_grpo caps it before the first matmul, and a value in the environment wins."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "ONEDNN_PRIMITIVE_CACHE_CAPACITY"}
    if preset is not None:
        env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = preset
    code = "import os, lit_grpo; print(os.environ['ONEDNN_PRIMITIVE_CACHE_CAPACITY'])"
    output = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert output.strip() == expected
