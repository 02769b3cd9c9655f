"""The group sampler (``generation_backend: lit``) against Hugging Face ``generate``, and the
length-chunked log-prob forwards (``group_by_length``, ``forward_token_budget``)."""

import inspect
import warnings

import pytest
import torch
from conftest import logps_entropy_grads
from transformers import AutoModelForCausalLM, GenerationConfig

from lit_grpo.models import cache_argument
from lit_grpo.rollout.engines.base import GenerationEngine
from lit_grpo.rollout.engines.lit_sampler import PreallocatedKVLayer, lit_sampler_unsupported
from lit_grpo.rollout.engines.policy import generate_completions
from lit_grpo.rollout.records import length_chunks
from lit_grpo.train.module import GRPOModule

PROMPTS = ["hello there", "a", "say something long please", "xyz", "12+7=", "q"]  # very different lengths


def config(tokenizer, eos_token_id, **options) -> GenerationConfig:
    return GenerationConfig(
        **{"max_new_tokens": 30, **options},
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=eos_token_id,
    )


def frequent_token(model, tokenizer) -> int:
    """A token that greedy decoding emits at different steps in different prompts: used as EOS so
    that completions finish at different lengths."""
    rollout = generate_completions(model, tokenizer, PROMPTS, 1, config(tokenizer, tokenizer.eos_token_id, do_sample=False), backend="transformers")
    values, counts = rollout.completion_ids.unique(return_counts=True)
    return int(values[counts.argmax()])


@pytest.mark.parametrize(
    "options",
    [{}, {"repetition_penalty": 1.3}, {"min_new_tokens": 5}, {"sequence_bias": {(7,): 2.0}}],
    ids=["plain", "repetition_penalty", "min_new_tokens", "sequence_bias"],
)
def test_greedy_lit_sampler_gives_generates_tokens(chaotic_model, options):
    """Same tokens as ``generate`` (left padding, shared prompt cache, finished rows removed)."""
    model, tokenizer = chaotic_model
    eos = [frequent_token(model, tokenizer), tokenizer.eos_token_id]
    generation_config = config(tokenizer, eos, do_sample=False, **options)
    expected = generate_completions(model, tokenizer, PROMPTS, 3, generation_config, backend="transformers")
    rollout = generate_completions(model, tokenizer, PROMPTS, 3, generation_config, backend="lit")
    lengths = expected.completion_lengths
    assert len(set(lengths.tolist())) >= 4, "completions must end at different steps for this test to bite"
    assert (lengths < 30).any() and (lengths == 30).any() or len(set(lengths.tolist())) >= 4
    for field in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "is_truncated"):
        assert torch.equal(getattr(rollout, field), getattr(expected, field)), field


def test_lit_sampler_draws_from_generates_distribution(chaotic_model):
    """First tokens of 4000 samples follow the probabilities ``generate`` samples from (after
    temperature, top-k, top-p and min-p); the second tokens match ``generate``'s samples."""
    model, tokenizer = chaotic_model
    options = dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.95, min_p=0.02, max_new_tokens=2)
    generation_config = config(tokenizer, tokenizer.eos_token_id, **options)
    prompt = ["say something:"]
    inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    out = model.generate(
        **inputs, generation_config=config(tokenizer, tokenizer.eos_token_id, **{**options, "max_new_tokens": 1}),
        output_scores=True, return_dict_in_generate=True,
    )
    expected_probs = torch.softmax(out.scores[0][0].float(), dim=-1)  # [V]
    vocab = expected_probs.numel()

    torch.manual_seed(0)
    lit = generate_completions(model, tokenizer, prompt, 4000, generation_config, backend="lit").completion_ids
    torch.manual_seed(1)
    hf = generate_completions(model, tokenizer, prompt, 4000, generation_config, backend="transformers").completion_ids
    first = torch.bincount(lit[:, 0], minlength=vocab).float() / lit.size(0)
    assert (first[expected_probs == 0] == 0).all()  # nothing outside top-k / top-p / min-p
    assert 0.5 * (first - expected_probs).abs().sum() < 0.05  # total variation distance
    second_lit = torch.bincount(lit[:, 1], minlength=vocab).float() / lit.size(0)
    second_hf = torch.bincount(hf[:, 1], minlength=vocab).float() / hf.size(0)
    assert 0.5 * (second_lit - second_hf).abs().sum() < 0.08


def test_lit_sampler_encodes_each_prompt_once_and_drops_finished_rows(chaotic_model):
    model, tokenizer = chaotic_model
    eos = [frequent_token(model, tokenizer), tokenizer.eos_token_id]
    rows_per_forward = []
    hook = model.register_forward_pre_hook(lambda m, args, kwargs: rows_per_forward.append(kwargs["input_ids"].shape), with_kwargs=True)
    try:
        rollout = generate_completions(model, tokenizer, PROMPTS, 4, config(tokenizer, eos, do_sample=False), backend="lit")
    finally:
        hook.remove()
    prefill, *decode = rows_per_forward
    assert prefill[0] == len(PROMPTS)  # B prompts, not B * G rows
    assert all(shape[1] == 1 for shape in decode)
    # every decode step runs only completions that had not finished at the last compaction
    lengths = rollout.completion_lengths
    assert decode[0][0] == 4 * len(PROMPTS) - int((lengths == 1).sum()) or decode[0][0] == 4 * len(PROMPTS)
    assert decode[-1][0] < 4 * len(PROMPTS)
    assert sum(shape[0] for shape in decode) < 4 * len(PROMPTS) * len(decode)
    # ... and never fewer rows than completions still running at that step
    for step, shape in enumerate(decode, start=1):
        assert shape[0] >= int((lengths > step).sum())


class _NewStyle(torch.nn.Module):  # transformers >= 5.24
    def forward(self, input_ids, attention_mask=None, cache=None, use_cache=None, **kwargs): ...


class _OldStyle(torch.nn.Module):  # transformers < 5.24, or a remote-code model written for it
    def forward(self, input_ids, attention_mask=None, past_key_values=None, use_cache=None, **kwargs): ...


class _Wrapper(torch.nn.Module):  # a peft model: forward(*args, **kwargs), the real one behind it
    def __init__(self, base):
        super().__init__()
        self.base = base

    def get_base_model(self):
        return self.base

    def forward(self, *args, **kwargs): ...


def test_the_kv_cache_goes_under_the_name_the_forward_declares(tiny_model_dir):
    cache = object()
    assert cache_argument(_NewStyle(), cache) == {"cache": cache}
    assert cache_argument(_OldStyle(), cache) == {"past_key_values": cache}
    assert cache_argument(_Wrapper(_NewStyle()), cache) == {"cache": cache}
    assert cache_argument(_Wrapper(_OldStyle()), cache) == {"past_key_values": cache}
    # the installed transformers: a real model and the same model behind a LoRA adapter
    from peft import LoraConfig, get_peft_model

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    (name,) = cache_argument(model, cache)
    assert name in inspect.signature(model.forward).parameters
    assert cache_argument(get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"])), cache) == {name: cache}


def test_sampling_passes_the_cache_without_deprecation_warnings(chaotic_model):
    """``past_key_values`` is deprecated from transformers 5.24 (removed in 5.40): the sampler and
    the shared-prompt forwards use the name the model declares."""
    from lit_grpo.train.shared_prompt import (
        completion_logits,
        distinct_prompts,
        encode_prompts,
    )

    model, tokenizer = chaotic_model
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        rollout = generate_completions(model, tokenizer, PROMPTS, 2, config(tokenizer, tokenizer.eos_token_id, do_sample=False))
        groups = distinct_prompts(rollout.prompt_ids, rollout.prompt_mask)
        prefix = encode_prompts(model, rollout.prompt_ids, rollout.prompt_mask, groups)
        logits = completion_logits(model, prefix, rollout.completion_ids, rollout.completion_mask)
    assert logits.shape[:2] == rollout.completion_ids.shape


def test_preallocated_kv_layer_writes_in_place_and_selects_rows():
    layer = PreallocatedKVLayer(capacity=5)
    keys = torch.arange(2 * 1 * 3 * 2, dtype=torch.float32).view(2, 1, 3, 2)  # [n, heads, t, d]
    k, v = layer.update(keys, -keys)
    assert torch.equal(k, keys) and torch.equal(v, -keys) and layer.get_seq_length() == 3
    step = torch.full((2, 1, 1, 2), 100.0)
    buffer = layer.key_buffer
    k, _ = layer.update(step, step)
    assert layer.key_buffer is buffer  # written in place, no new tensor per token
    assert k.shape == (2, 1, 4, 2) and torch.equal(k[:, :, 3], step[:, :, 0])
    layer.batch_repeat_interleave(2)
    assert torch.equal(layer.keys[1], layer.keys[0]) and layer.keys.size(0) == 4
    layer.batch_select_indices(torch.tensor([3]))
    assert torch.equal(layer.keys[0, :, :3], keys[1]) and layer.keys.shape == (1, 1, 4, 2)
    with pytest.raises(RuntimeError, match="5 positions cannot hold 6"):
        layer.update(torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2))


def test_preallocated_kv_layer_stores_the_autocast_dtype():
    layer = PreallocatedKVLayer(capacity=4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        k, _ = layer.update(torch.ones(1, 1, 2, 2), torch.ones(1, 1, 2, 2))
    assert k.dtype == torch.bfloat16


def test_growing_kv_layer_hands_over_its_whole_buffer_with_zeros_where_nothing_is_written():
    """With ``block`` (the CPU half-precision layout) attention gets the whole, contiguous buffer,
    which grows by whole blocks up to the capacity; the mask sizes announced before each update are
    the key lengths that update returns."""
    layer = PreallocatedKVLayer(capacity=10, block=4)
    keys = torch.arange(2 * 1 * 3 * 2, dtype=torch.float32).view(2, 1, 3, 2) + 1  # [n, heads, t, d], no zeros
    assert layer.get_mask_sizes(3) == (4, 0)  # before the prefill: 3 positions round up to one block
    k, v = layer.update(keys, -keys)
    assert k.shape == (2, 1, 4, 2) and k.is_contiguous() and v.is_contiguous()
    assert torch.equal(k[:, :, :3], keys) and torch.equal(v[:, :, :3], -keys)
    assert not k[:, :, 3].any() and not v[:, :, 3].any() and layer.get_seq_length() == 3
    buffer = layer.key_buffer
    assert layer.get_mask_sizes(1) == (4, 0)
    k, _ = layer.update(torch.full((2, 1, 1, 2), 7.0), torch.full((2, 1, 1, 2), 7.0))
    assert layer.key_buffer is buffer and k.shape[2] == 4 and (k[:, :, 3] == 7).all()  # in place while it fits
    assert layer.get_mask_sizes(1) == (8, 0)
    k, v = layer.update(torch.full((2, 1, 1, 2), 9.0), torch.full((2, 1, 1, 2), 9.0))  # grows by one block
    assert k.shape == (2, 1, 8, 2) and k.is_contiguous() and torch.equal(k[:, :, :3], keys)
    assert (k[:, :, 4] == 9).all() and not k[:, :, 5:].any() and not v[:, :, 5:].any()
    layer.batch_select_indices(torch.tensor([1]))
    assert layer.keys.shape == (1, 1, 8, 2) and torch.equal(layer.keys[0, :, :3], keys[1]) and not layer.keys[:, :, 5:].any()
    assert layer.get_mask_sizes(4) == (10, 0)  # 9 positions: two more blocks would pass the capacity
    k, _ = layer.update(torch.ones(1, 1, 4, 2), torch.ones(1, 1, 4, 2))
    assert k.shape == (1, 1, 10, 2) and not k[:, :, 9].any()
    with pytest.raises(RuntimeError, match="10 positions cannot hold 11"):
        layer.update(torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2))


def test_bf16_sampler_grows_contiguous_caches_and_samples_the_tokens_of_the_prefix_views(chaotic_model, monkeypatch):
    """Under bf16 autocast on the CPU the sampler's caches grow by blocks (4 here, so they grow
    several times) and attention only ever receives contiguous keys and values (no copy per step);
    greedy completions, with left padding and rows leaving the batch at different steps, are those
    of the layout that hands attention views of the filled positions."""
    import lit_grpo.cpu
    import lit_grpo.cpu.attention as attention

    model, tokenizer = chaotic_model
    eos = frequent_token(model, tokenizer)
    generation_config = config(tokenizer, eos, do_sample=False)
    key_layouts = []

    def recording_attention(module, query, key, value, *args, **kwargs):
        key_layouts.append((key.size(2), key.is_contiguous() and value.is_contiguous()))
        return attention.cpu_half_attention(module, query, key, value, *args, **kwargs)

    monkeypatch.setattr(lit_grpo.cpu, "KV_CACHE_BLOCK", 4)
    monkeypatch.setitem(attention.AttentionInterface._global_mapping, attention.NAME, recording_attention)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        grown = generate_completions(model, tokenizer, PROMPTS, 3, generation_config)
        capacity = grown.prompt_ids.size(1) + generation_config.max_new_tokens
        assert key_layouts and all(contiguous for _, contiguous in key_layouts)
        assert all(length % 4 == 0 or length == capacity for length, _ in key_layouts)
        assert len({length for length, _ in key_layouts}) > 3  # grew several times
        monkeypatch.setattr(lit_grpo.cpu, "kv_cache_block", lambda model, device: None)
        key_layouts.clear()
        viewed = generate_completions(model, tokenizer, PROMPTS, 3, generation_config)
        assert not all(contiguous for _, contiguous in key_layouts)  # the other layout: prefix views
    lengths = grown.completion_mask.sum(dim=1)
    assert len(set(lengths.tolist())) > 2  # rows finished at different steps and left the batch
    assert torch.equal(grown.completion_ids, viewed.completion_ids)
    assert torch.equal(grown.completion_mask, viewed.completion_mask)


def test_unsupported_options_and_models_fall_back_to_generate(chaotic_model, tiny_model_dir):
    model, tokenizer = chaotic_model
    generation_config = config(tokenizer, tokenizer.eos_token_id, do_sample=False, no_repeat_ngram_size=2)
    assert "no_repeat_ngram_size" in lit_sampler_unsupported(model, generation_config)
    expected = generate_completions(model, tokenizer, PROMPTS, 2, generation_config, backend="transformers")
    rollout = generate_completions(model, tokenizer, PROMPTS, 2, generation_config, backend="lit")
    assert torch.equal(rollout.completion_ids, expected.completion_ids)

    sliding = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    sliding.config.layer_types = ["full_attention", "sliding_attention"]
    assert "sliding_attention" in lit_sampler_unsupported(sliding, config(tokenizer, 1, do_sample=False))
    with pytest.raises(ValueError, match=r"generate_completions samples with \('lit', 'transformers'\), got 'sglang'"):
        generate_completions(model, tokenizer, PROMPTS, 2, generation_config, backend="sglang")
    rewards = [{"name": "char_fraction", "args": {"chars": "a"}}]
    with pytest.raises(ValueError, match=r"model.generation_backend must be one of \('lit', 'transformers', 'vllm', 'vllm_server'\), got 'sglang'"):
        GRPOModule(str(tiny_model_dir), rewards=rewards, generation_backend="sglang")
    try:
        import vllm  # noqa: F401
    except ImportError:  # without the extra, the vllm backend says how to get it
        with pytest.raises(ValueError, match=r'model.generation_backend: vllm needs vLLM: pip install "lit-grpo\[vllm\]"'):
            GRPOModule(str(tiny_model_dir), rewards=rewards, generation_backend="vllm")


def test_module_warns_when_lit_sampler_falls_back(tiny_model_dir):
    module = GRPOModule(str(tiny_model_dir), rewards=[{"name": "char_fraction", "args": {"chars": "a"}}], num_generations=2, max_completion_length=4)
    module.configure_model()
    module.generation_config.no_repeat_ngram_size = 2
    with pytest.warns(UserWarning, match="does not implement generation options \\['no_repeat_ngram_size'\\]"):
        rollout = module.generate(["a", "b"])
    assert rollout.completion_ids.size(0) == 4


# --------------------------------------------------------------------------------------------------
# group_by_length, forward_token_budget
# --------------------------------------------------------------------------------------------------


def test_length_chunks_by_hand():
    prompt_mask = torch.tensor([[1, 1], [0, 1], [1, 1], [0, 1], [1, 1]])  # prompt lengths 2 1 2 1 2
    completion_lengths = torch.tensor([6, 1, 3, 5, 2])
    completion_mask = (torch.arange(6) < completion_lengths[:, None]).long()

    def chunks(**kwargs):
        return [chunk.tolist() for chunk in length_chunks(prompt_mask, completion_mask, **kwargs)]

    # longest completion first: rows 0 (2 + 6), 3 (1 + 5), 2 (2 + 3), 4 (2 + 2), 1 (1 + 1)
    # a forward costs nothing extra: every row alone, no padding at all (8 + 6 + 5 + 4 + 2 = 25 tokens)
    assert chunks(overhead_tokens=0) == [[0], [3], [2], [4], [1]]
    # a forward costs 100 tokens: no split saves that much, one forward of 5 x 8 = 40 tokens
    assert chunks(overhead_tokens=100) == [[0, 3, 2, 4, 1]]
    # costs 5: [0, 3] + [2, 4, 1] = 2 x 8 + 3 x 5 + 2 x 5 = 41 beats one chunk (45) and every other split
    # ([0, 3, 2] + [4, 1] = 42, [0, 3] + [2, 4] + [1] = 43, [0] + [3, 2, 4, 1] = 46)
    assert chunks(overhead_tokens=5) == [[0, 3], [2, 4, 1]]
    # a budget of 16 padded tokens forbids the single chunk (40): the cheapest split within it
    assert chunks(overhead_tokens=100, token_budget=16) == [[0, 3], [2, 4, 1]]
    # a row longer than the budget is a chunk of its own
    assert chunks(overhead_tokens=100, token_budget=4) == [[0], [3], [2], [4], [1]]
    # equal lengths are never split without a budget: one forward, no padding to save
    equal = torch.ones(64, 128, dtype=torch.long)
    assert len(length_chunks(torch.ones(64, 6, dtype=torch.long), equal)) == 1


def test_chunked_logps_and_gradients_equal_one_forward(tiny_model_dir):
    """Chunking changes what runs, not what comes out: log-probs, entropy and the gradient of a loss
    over the micro-batch equal those of one padded forward."""
    torch.manual_seed(0)
    module = GRPOModule(
        str(tiny_model_dir), rewards=[{"name": "char_fraction", "args": {"chars": "a"}}],
        num_generations=4, max_completion_length=16, group_by_length=False, share_prompt_forward=False,
    )
    module.configure_model()
    module.generation_config.sequence_bias = {(module.tokenizer.eos_token_id,): 2.5}  # varied lengths
    rollout = module.generate(["a:", "Say a:", "Please say the letter b, many times:"])
    assert len(set(rollout.completion_lengths.tolist())) >= 3

    def run(budget):
        return logps_entropy_grads(module, rollout, group_by_length=budget is not None, forward_token_budget=budget)

    chunks = length_chunks(rollout.prompt_mask, rollout.completion_mask, 60)
    assert len(chunks) >= 3
    reference, chunked = run(None), run(60)
    mask = rollout.completion_mask.bool()
    assert reference[0].shape == chunked[0].shape
    torch.testing.assert_close(chunked[0][mask], reference[0][mask], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chunked[1][mask], reference[1][mask], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chunked[2], reference[2], atol=1e-5, rtol=1e-4)


def test_forward_token_budget_must_be_positive(tiny_model_dir):
    with pytest.raises(ValueError, match="model.forward_token_budget must be at least 1 or null or auto, got 0"):
        GRPOModule(str(tiny_model_dir), rewards=[{"name": "char_fraction", "args": {"chars": "a"}}], forward_token_budget=0)


def test_training_step_is_the_same_with_and_without_chunking(tiny_model_dir, say_a_or_b_file, fast_trainer):
    """A whole GRPO step (beta > 0, two iterations, micro-batches) gives the same loss, KL and weights
    whether the log-prob forwards run in length chunks or one padded forward each."""
    import lightning.pytorch as pl

    from lit_grpo.data import GRPODataModule

    def train(budget):
        pl.seed_everything(0, verbose=False)
        module = GRPOModule(
            str(tiny_model_dir), rewards=[{"name": "char_fraction", "args": {"chars": "a"}}], num_generations=4,
            max_completion_length=12, beta=0.1, num_iterations=2, micro_batch_size=4,
            group_by_length=budget is not None, forward_token_budget=budget, share_prompt_forward=False,
            log_completions_every_n_steps=0, optimizer=lambda params: torch.optim.SGD(params, lr=0.5),
        )
        module.configure_model()
        module.generation_config.sequence_bias = {(module.tokenizer.eos_token_id,): 2.0}  # lengths vary
        logged = {}
        module.log = lambda name, value, **kwargs: logged.setdefault(name, []).append(float(value))
        data = GRPODataModule(path="json", data_files=str(say_a_or_b_file), batch_size=2, seed=0)
        gradient_forwards = []
        module.policy.register_forward_pre_hook(lambda m, args: gradient_forwards.append(torch.is_grad_enabled()))
        fast_trainer(max_steps=4).fit(module, datamodule=data)
        weights = torch.cat([p.detach().flatten() for p in module.policy.parameters()])
        return logged, weights, sum(gradient_forwards)

    one_forward, weights, forwards = train(None)
    chunked, chunked_weights, chunked_forwards = train(24)
    assert chunked_forwards > forwards  # the budget really split the micro-batches
    for name in ("loss", "kl", "entropy", "reward", "completions/mean_length"):
        torch.testing.assert_close(torch.tensor(chunked[name]), torch.tensor(one_forward[name]), atol=1e-5, rtol=1e-4)
    assert (weights != 0).any()
    torch.testing.assert_close(chunked_weights, weights, atol=1e-5, rtol=1e-4)


class EchoEngine(GenerationEngine):
    """A fifth engine as its author writes it: a class that checks a run's settings and builds itself,
    named by one line of the registry."""

    checked: list[str] = []

    @classmethod
    def check_run(cls, hp) -> None:
        cls.checked.append(hp.generation_backend)

    @classmethod
    def for_run(cls, hp, model_source, precision, grows_with_tools):
        return cls()


class EchoServerEngine(EchoEngine):
    """A fifth engine that samples on servers elsewhere, as ``vllm_server`` does."""

    samples_elsewhere = True


def test_server_addresses_are_refused_by_what_the_engine_class_says_not_by_its_name(monkeypatch):
    """Issue 52 leftover: whether model.vllm_server_urls may be given is the engine class's answer
    (``samples_elsewhere``), so a fifth engine that samples on servers takes them, and one that samples
    on the trainer's devices refuses them."""
    from types import SimpleNamespace

    from lit_grpo.errors import ConfigError
    from lit_grpo.rollout import engines

    monkeypatch.setitem(engines.ENGINES, "echo", f"{EchoEngine.__module__}:EchoEngine")
    monkeypatch.setitem(engines.ENGINES, "echo_server", f"{EchoServerEngine.__module__}:EchoServerEngine")
    monkeypatch.setattr(EchoEngine, "checked", [])
    urls = ["http://localhost:8000"]
    engines.check_backend(SimpleNamespace(generation_backend="echo_server", vllm_server_urls=urls))
    assert EchoEngine.checked == ["echo_server"]
    with pytest.raises(ConfigError, match="model.vllm_server_urls is set but model.generation_backend is 'echo':"):
        engines.check_backend(SimpleNamespace(generation_backend="echo", vllm_server_urls=urls))


def test_a_backend_is_a_registry_line_naming_its_engine_class(monkeypatch):
    """Issue 52.1: model.generation_backend picks its engine from the registry (no if/elif): the four
    built-in backends in their order (the error message lists them), a fifth added by one entry; a
    backend not in it, or server addresses given to another backend, is refused as before."""
    from types import SimpleNamespace

    from lit_grpo.errors import ConfigError
    from lit_grpo.rollout import engines
    from lit_grpo.rollout.engines.policy import PolicyEngine

    assert engines.GENERATION_BACKENDS == tuple(engines.ENGINES) == ("lit", "transformers", "vllm", "vllm_server")
    transformers = SimpleNamespace(generation_backend="transformers", vllm_server_urls=None)
    engines.check_backend(transformers)
    engine = engines.engine_for_run(transformers, None, "32-true", grows_with_tools=False)
    assert type(engine) is PolicyEngine and engine.backend == "transformers"

    monkeypatch.setitem(engines.ENGINES, "echo", f"{EchoEngine.__module__}:EchoEngine")
    monkeypatch.setattr(EchoEngine, "checked", [])
    echo = SimpleNamespace(generation_backend="echo", vllm_server_urls=None)
    engines.check_backend(echo)
    assert EchoEngine.checked == ["echo"]
    assert type(engines.engine_for_run(echo, None, "32-true", grows_with_tools=False)) is EchoEngine
    with pytest.raises(ConfigError, match="model.vllm_server_urls is set but model.generation_backend is 'echo'"):
        engines.check_backend(SimpleNamespace(generation_backend="echo", vllm_server_urls=["http://localhost:8000"]))
    with pytest.raises(ConfigError, match=r"must be one of \('lit', 'transformers', 'vllm', 'vllm_server'\), got 'sglang'"):
        engines.engine_for_run(SimpleNamespace(generation_backend="sglang"), None, "32-true", grows_with_tools=False)
