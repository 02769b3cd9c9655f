"""vLLM as the colocated generation engine (``lit_grpo.rollout.engines.vllm_colocated``), run for real with vLLM's CPU build.

These tests run in the environment of the README's vLLM block (``.ci/run`` builds it and runs this
file there). Where vLLM is not installed they are skipped with the reason, unless
``LIT_GRPO_REQUIRE_VLLM=1`` (set by ``.ci/run``): then a missing vLLM is a failure, not a skip.

vLLM's parallel state is module-global, so one engine per process: the in-process tests share one
engine (reset to the base weights by a push before each test); whatever needs another engine (the
bfloat16 check, the ``lit-grpo fit`` runs, two processes) runs in a subprocess.

The tiny model has 2 attention heads (head size 32): vLLM's CPU attention implements head sizes
32, 64, 80, ... only (``lit-grpo init-tiny DIR --num-heads 2``).
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import types
import warnings
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Self

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # before vllm is imported

import pytest
import torch

try:
    import vllm  # noqa: F401
except ImportError:
    if os.environ.get("LIT_GRPO_REQUIRE_VLLM") == "1":
        raise
    pytest.skip('vLLM is not installed (the README\'s vLLM block, or pip install "lit-grpo[vllm]")', allow_module_level=True)

import yaml  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig  # noqa: E402

from lit_grpo.rollout.engines import vllm_colocated  # noqa: E402
from lit_grpo.rollout.engines.lit_sampler import generation_config_eos_ids  # noqa: E402
from lit_grpo.rollout.engines.policy import generate_completions  # noqa: E402
from lit_grpo.rollout.engines.vllm_colocated import build_engine, push_weights, sample  # noqa: E402
from lit_grpo.errors import ConfigError  # noqa: E402
from lit_grpo.train.module import GRPOModule  # noqa: E402
from lit_grpo.rollout.engines.policy_weights import hf_named_weights  # noqa: E402
from lit_grpo.tiny import build_tiny_model  # noqa: E402
from conftest import cached_warm_tool_model, set_hparams  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
LIT_GRPO = str(Path(sys.executable).with_name("lit-grpo"))
TINY = dict(num_attention_heads=2, num_key_value_heads=1)  # head size 64 / 2 = 32
PROMPTS = ["Hello there", "a", "The quick brown fox jumps", "1+1=", "<|user|>what?\n<|assistant|>"]
MAX_NEW = 24
# Both sides in float32. The engine multiplies with oneDNN and has its own attention and RMSNorm
# kernels, transformers uses MKL and SDPA: the logits differ by summation order only (about 1e-6
# relative), so log-probs agree to ~2e-5; 1e-4 leaves room for other CPUs' vector widths. A stale
# weight or a wrong temperature moves them by 1e-2 or more.
LOGPROB_ATOL = 1e-4


def perturbed_model(path: Path, seed: int = 1, scale: float = 0.1):
    """The tiny model with noise added: the random init (std 0.02) gives almost flat logits and
    completions that repeat one character; with noise the greedy paths are varied."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * scale)
    return model.eval()


PROCESS_ENGINE: dict = {}  # the one colocated engine of this process, once built (shared_colocated_engine)


def shared_colocated_engine(request, tmp_path_factory) -> dict:
    """This process's colocated engine on the perturbed 2-head tiny model, built on first use and shut
    down when the session ends: one engine per process, which tests/rollout/test_vllm_server.py's
    comparison with a server samples on too (instead of starting another in a subprocess)."""
    if not PROCESS_ENGINE:
        path = tmp_path_factory.mktemp("tiny-vllm")
        build_tiny_model(path, **TINY)
        base = perturbed_model(path)
        base.save_pretrained(path)  # the engine starts from the perturbed weights
        tokenizer = AutoTokenizer.from_pretrained(path)
        rng_before = (torch.get_rng_state(), __import__("random").getstate())
        # with its tokenizer (skip_tokenizer_init False) for every test here: structured outputs build their grammar
        # over its vocabulary (test_structured_outputs_*); a run without structured outputs builds it with True
        # (token ids only, ColocatedVLLMEngine)
        llm = build_engine(path, dtype="float32", seed=0, max_model_len=256, num_threads=torch.get_num_threads(),
                           skip_tokenizer_init=False)
        rng_after = (torch.get_rng_state(), __import__("random").getstate())
        # vLLM's engine freezes vllm.envs for the rest of the process (as a server owns its own); the tests after it
        # here set VLLM_* variables (monkeypatch), as its shutdown would let them: read them afresh again
        vllm.envs.disable_envs_cache()
        PROCESS_ENGINE.update(path=path, base=base, tokenizer=tokenizer, llm=llm, rng=(rng_before, rng_after))
        request.session.addfinalizer(shut_down_the_process_engine)
    return PROCESS_ENGINE


def shut_down_the_process_engine() -> None:
    vllm_colocated.shutdown_engine(PROCESS_ENGINE["llm"])
    PROCESS_ENGINE.clear()


@pytest.fixture(scope="module")
def setup(request, tmp_path_factory):
    return shared_colocated_engine(request, tmp_path_factory)


@pytest.fixture
def engine(setup):
    """The shared engine, reset to the base model's weights."""
    push_weights(setup["llm"], hf_named_weights(setup["base"]))
    return setup["llm"]


def prompt_ids(tokenizer, texts=PROMPTS) -> list[list[int]]:
    return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]


def generation_config(tokenizer, eos=None, **kwargs) -> GenerationConfig:
    return GenerationConfig(
        max_new_tokens=MAX_NEW,
        do_sample=False,
        eos_token_id=eos if eos is not None else tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        **kwargs,
    )


@torch.no_grad()
def hf_greedy(model, ids: list[list[int]], config: GenerationConfig) -> list[list[int]]:
    """transformers' greedy tokens, one unpadded prompt at a time, cut after the first EOS."""
    out = []
    for prompt in ids:
        tokens = model.generate(
            input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            generation_config=config,
        )[0, len(prompt):].tolist()
        eos = set(generation_config_eos_ids(config))
        for position, token in enumerate(tokens):
            if token in eos:
                tokens = tokens[: position + 1]
                break
        out.append(tokens)
    return out


def backend_tokens(model, tokenizer, config, backend) -> list[list[int]]:
    """lit-grpo's own samplers (batched, left-padded) through generate_completions."""
    rollout = generate_completions(model, tokenizer, PROMPTS, 1, config, backend=backend)
    return [ids[mask.bool()].tolist() for ids, mask in zip(rollout.completion_ids, rollout.completion_mask)]


def min_greedy_margin(model, ids, completions) -> float:
    """Smallest gap between the top two logits along the greedy paths (how close to a tie)."""
    margin = float("inf")
    with torch.no_grad():
        for prompt, completion in zip(ids, completions):
            logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : len(prompt) + len(completion) - 1]
            top2 = logits.topk(2, dim=-1).values
            margin = min(margin, float((top2[:, 0] - top2[:, 1]).min()))
    return margin


@torch.no_grad()
def hf_logprobs(model, prompt, completion, temperature) -> torch.Tensor:
    """log_softmax(logits / T) at the sampled tokens, float32, as the trainer recomputes them."""
    logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : len(prompt) + len(completion) - 1]
    return torch.log_softmax(logits.float() / temperature, dim=-1).gather(1, torch.tensor(completion)[:, None])[:, 0]


def train_a_little(model, tokenizer, steps=3, lr=0.5):
    """A copy of ``model`` after a few SGD steps of language modelling on one string."""
    model = copy.deepcopy(model).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    batch = torch.tensor(prompt_ids(tokenizer, ["abcabcabcabc"]))
    for _ in range(steps):
        optimizer.zero_grad()
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
    return model.eval()


# ----------------------------------------------------------------------------------------------
# Greedy tokens equal transformers', before and after weight updates
# ----------------------------------------------------------------------------------------------


def test_greedy_equals_transformers_and_lit_backends(setup, engine):
    tokenizer, model = setup["tokenizer"], setup["base"]
    config = generation_config(tokenizer)
    ids = prompt_ids(tokenizer)
    out = sample(engine, ids, 1, temperature=0.0, max_tokens=MAX_NEW, stop_token_ids=generation_config_eos_ids(config))
    expected = hf_greedy(model, ids, config)
    assert out.completion_ids == expected
    assert out.completion_ids == backend_tokens(model, tokenizer, config, "transformers")
    assert out.completion_ids == backend_tokens(model, tokenizer, config, "lit")
    assert len({tuple(c) for c in expected}) == len(expected)  # varied completions, not one repeated char
    assert min_greedy_margin(model, ids, expected) > 1e-3  # no near-tie that float noise could flip
    for completion, reason in zip(out.completion_ids, out.finish_reasons):
        assert reason == ("stop" if completion[-1] == tokenizer.eos_token_id else "length")
    # greedy with G > 1 (vLLM refuses n > 1 when greedy: sample() sends G requests instead)
    repeated = sample(engine, ids[:2], 3, temperature=0.0, max_tokens=MAX_NEW, stop_token_ids=generation_config_eos_ids(config))
    assert repeated.completion_ids == [expected[0]] * 3 + [expected[1]] * 3


def test_greedy_equals_transformers_after_training_steps_and_push(setup, engine):
    tokenizer = setup["tokenizer"]
    config = generation_config(tokenizer)
    ids = prompt_ids(tokenizer)
    before = sample(engine, ids, 1, temperature=0.0, max_tokens=MAX_NEW, stop_token_ids=generation_config_eos_ids(config))
    model = train_a_little(setup["base"], tokenizer)

    push_weights(engine, hf_named_weights(model))
    after = sample(engine, ids, 1, temperature=0.0, max_tokens=MAX_NEW, stop_token_ids=generation_config_eos_ids(config))
    expected = hf_greedy(model, ids, config)
    assert after.completion_ids == expected
    assert after.completion_ids != before.completion_ids  # the push changed the engine
    assert after.completion_ids == backend_tokens(model, tokenizer, config, "transformers")


def with_an_adapter(model):
    """A copy of ``model`` with a LoRA adapter that changes its outputs (B starts at zero: drawn here)."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(
        copy.deepcopy(model), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"]),
    )
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)
    return model


def test_lora_merged_into_pushed_weights(setup, engine):
    tokenizer = setup["tokenizer"]
    config = generation_config(tokenizer)
    ids = prompt_ids(tokenizer)
    model = with_an_adapter(setup["base"])
    base_weight = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight.clone()
    push_weights(engine, hf_named_weights(model))
    out = sample(engine, ids, 1, temperature=0.0, max_tokens=MAX_NEW, stop_token_ids=generation_config_eos_ids(config))
    assert out.completion_ids == hf_greedy(model.eval(), ids, config)
    assert out.completion_ids != hf_greedy(setup["base"], ids, config)
    # merged on the fly: the adapters stay unmerged and the base weights untouched
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    assert not layer.merged and torch.equal(layer.base_layer.weight, base_weight)


# ----------------------------------------------------------------------------------------------
# The module's backend: GRPOModule(generation_backend="vllm") with the shared engine
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def vllm_module(setup, engine, monkeypatch):
    """A GRPOModule on the tiny model whose ColocatedVLLMEngine uses the shared engine (one per process:
    configure_model builds the engine, here handed the shared one)."""
    monkeypatch.setattr(vllm_colocated, "build_engine", lambda *args, **kwargs: engine)
    module = GRPOModule(
        str(setup["path"]),
        [{"name": "char_fraction", "args": {"chars": "a"}}],
        generation_backend="vllm",
        num_generations=4,
        max_completion_length=MAX_NEW,
        temperature=0.7,
        temperature_eval=0.0,
    )
    module.configure_model()
    assert module.engine.llm is engine
    return module


def rows(rollout) -> list[list[int]]:
    return [ids[mask.bool()].tolist() for ids, mask in zip(rollout.completion_ids, rollout.completion_mask)]


def test_module_greedy_equals_transformers_before_and_after_the_policy_changes(vllm_module, setup):
    module, tokenizer = vllm_module, setup["tokenizer"]
    config = module.eval_generation_config
    transformers_rows = lambda: rows(generate_completions(  # noqa: E731
        module.policy, tokenizer, PROMPTS, 2, config, backend="transformers"))
    before = rows(module.generate(PROMPTS, 2, config))
    assert before == transformers_rows()

    trained = train_a_little(module.policy, tokenizer)
    with torch.no_grad():  # the policy as an optimizer step leaves it, in place
        for parameter, new in zip(module.policy.parameters(), trained.parameters()):
            parameter.copy_(new)
    stale = rows(module.generate(PROMPTS, 2, config))  # same version: nothing pushed
    assert stale == before and stale != transformers_rows()  # so the check below can fail
    assert module.engine.sync_weights(module.policy, version="after a step") > 0
    assert module.engine.sync_weights(module.policy, version="after a step") == 0.0  # already there
    assert rows(module.generate(PROMPTS, 2, config)) == transformers_rows()


def test_module_rollout_carries_the_samplers_logps_equal_to_the_trainers(vllm_module):
    """The engine's log-probs of its samples (after temperature 0.7) against the trainer's own
    recomputation, which decides the loss: equal within LOGPROB_ATOL on every completion token."""
    module = vllm_module
    torch.manual_seed(0)
    rollout = module.generate(PROMPTS)  # the training sampling settings: temperature 0.7, G = 4
    assert rollout.completion_ids.shape[0] == len(PROMPTS) * 4
    assert len({tuple(row) for row in rows(rollout)}) > len(PROMPTS)  # really sampled
    trainer_logps, _ = module.logprobs.completion_logps(module.policy, rollout)
    mask = rollout.completion_mask[:, : trainer_logps.size(1)].bool()
    difference = (rollout.sampling_logps[:, : trainer_logps.size(1)] - trainer_logps).abs()[mask]
    assert difference.max() < LOGPROB_ATOL
    assert (rollout.sampling_logps[~rollout.completion_mask.bool()] == 0).all()
    # and the trainer at another temperature is far off: the check can tell
    set_hparams(module, temperature=1.0)
    wrong, _ = module.logprobs.completion_logps(module.policy, rollout)
    assert (rollout.sampling_logps[:, : wrong.size(1)] - wrong).abs()[mask].max() > 100 * LOGPROB_ATOL


def test_module_ratio_is_one_on_policy_with_truncated_sampling(setup, engine, monkeypatch):
    """top_p 0.9, top_k 20, min_p 0.05 and a repetition penalty: vLLM's processed log-probs are over
    the penalised, truncated, renormalised distribution, and so are the trainer's (issue 49.9):
    exp(trainer - engine) is 1 on every token, where the full vocabulary is off by the kept mass."""
    monkeypatch.setattr(vllm_colocated, "build_engine", lambda *args, **kwargs: engine)
    module = GRPOModule(str(setup["path"]), [{"name": "char_fraction", "args": {"chars": "a"}}], generation_backend="vllm",
                        num_generations=4, max_completion_length=MAX_NEW, temperature=0.7,
                        top_p=0.9, top_k=20, min_p=0.05, repetition_penalty=1.2)
    module.configure_model()
    torch.manual_seed(0)
    rollout = module.generate(PROMPTS)
    trainer_logps, _ = module.logprobs.completion_logps(module.policy, rollout)
    mask = rollout.completion_mask[:, : trainer_logps.size(1)].bool()
    log_ratio = (trainer_logps - rollout.sampling_logps[:, : trainer_logps.size(1)])[mask]
    assert log_ratio.abs().max() < LOGPROB_ATOL
    full = [hf_logprobs(module.policy, ids[mask_row.bool()].tolist(), row, 0.7)
            for ids, mask_row, row in zip(rollout.prompt_ids, rollout.prompt_mask, rows(rollout))]
    full_log_ratio = torch.cat(full) - rollout.sampling_logps[rollout.completion_mask.bool()]
    assert full_log_ratio.exp().mean() < 0.97  # what the trainer computed before: the check can tell


def test_module_seeds_come_from_the_checkpointed_torch_generator(vllm_module):
    """Each generate call draws its seed from torch's global generator (saved in checkpoints):
    the same torch state gives the same completions; the next call differs."""
    module = vllm_module
    torch.manual_seed(123)
    first = rows(module.generate(PROMPTS[:2]))
    second = rows(module.generate(PROMPTS[:2]))
    torch.manual_seed(123)
    assert rows(module.generate(PROMPTS[:2])) == first
    assert second != first


def test_one_engine_seed_per_call_samples_the_batch_reproducibly(setup, engine):
    """No seed per request (vLLM would sample row by row): the engine's generators are seeded once
    per call; the same seed and batch give the same tokens, another seed others."""
    ids = prompt_ids(setup["tokenizer"])
    common = dict(temperature=1.0, max_tokens=MAX_NEW, stop_token_ids=[setup["tokenizer"].eos_token_id])
    first = sample(engine, ids, 4, engine_seed=11, **common).completion_ids
    assert sample(engine, ids, 4, engine_seed=11, **common).completion_ids == first
    assert sample(engine, ids, 4, engine_seed=12, **common).completion_ids != first
    assert len({tuple(row) for row in first}) > 1  # the rows of one call are not copies of each other


def test_module_truncates_prompts_and_flags_them(vllm_module, setup):
    module = vllm_module
    set_hparams(module, max_prompt_length=5)  # and module.apply_settings(): the collector reads the records
    rollout = module.generate(["The quick brown fox jumps", "a"], 1, module.eval_generation_config)
    assert rollout.prompt_truncated.tolist() == [True, False]
    assert int(rollout.prompt_mask[0].sum()) == 5
    # greedy from the kept (last five) characters equals transformers from those characters
    kept = setup["tokenizer"]("The quick brown fox jumps", add_special_tokens=False)["input_ids"][-5:]
    assert rows(rollout)[0] == hf_greedy(module.policy, [kept], module.eval_generation_config)[0]


# issue 54: model.vllm_structured_outputs_regex, model.generation_kwargs on the colocated engine
STRUCTURED_REGEX = "(yes|no|[ab]{2,5})!"


def test_structured_outputs_regex_constrains_every_completion_and_generation_kwargs_reach_vllm(setup, engine,
                                                                                             monkeypatch):
    """TRL's vllm_structured_outputs_regex (vLLM's StructuredOutputsParams): every completion matches it; the
    engine is built with its tokenizer (the grammar's vocabulary). generation_kwargs reach each request
    (allowed_token_ids: only 'x' and EOS), and an argument vLLM does not take is one line at start."""
    built = {}
    monkeypatch.setattr(vllm_colocated, "build_engine", lambda *args, **kwargs: built.update(kwargs) or engine)
    tokenizer = setup["tokenizer"]
    module = GRPOModule(str(setup["path"]), ["char_fraction"], generation_backend="vllm", num_generations=4,
                        max_completion_length=MAX_NEW, vllm_structured_outputs_regex=STRUCTURED_REGEX)
    module.configure_model()
    assert built["skip_tokenizer_init"] is False
    torch.manual_seed(0)
    texts = [tokenizer.decode(row, skip_special_tokens=True) for row in rows(module.generate(PROMPTS))]
    assert all(re.fullmatch(STRUCTURED_REGEX, text) for text in texts), texts
    assert len(set(texts)) > 2  # sampled, not one forced answer

    x, eos = tokenizer.convert_tokens_to_ids("x"), tokenizer.eos_token_id
    free = GRPOModule(str(setup["path"]), ["char_fraction"], generation_backend="vllm", num_generations=4,
                      max_completion_length=MAX_NEW, generation_kwargs={"allowed_token_ids": [x, eos]})
    free.configure_model()
    assert built["skip_tokenizer_init"] is True  # no structured outputs: token ids only, as before
    tokens = {token for row in rows(free.generate(PROMPTS)) for token in row}
    assert x in tokens and tokens <= {x, eos}
    with pytest.raises(ConfigError) as error:
        GRPOModule(str(setup["path"]), ["char_fraction"], generation_backend="vllm", generation_kwargs={"suppress_tokens": [x]})
    assert str(error.value) == ("model.generation_kwargs.suppress_tokens: model.generation_backend vllm takes vLLM's "
                                "SamplingParams fields, which have no 'suppress_tokens'")


def generation_settings(**settings):
    """The settings a vLLM engine's check_run reads of model.generation_kwargs (no model, no engine)."""
    defaults = dict(generation_backend="vllm", generation_kwargs=None, vllm_structured_outputs_regex=None, max_completion_length=8)
    return types.SimpleNamespace(**{**defaults, **settings})


@pytest.mark.parametrize(("generation_kwargs", "message"), [
    ({"stop": ["x"]}, "model.generation_kwargs.stop: stop strings are only supported when detokenize is True. Set detokenize=True "
                      "to use stop."),  # lit-grpo's requests are token ids only
    ({"presence_penalty": "x"}, "model.generation_kwargs.presence_penalty: '<=' not supported between instances of 'float' and 'str'"),
    ({"min_tokens": 9}, "model.generation_kwargs.min_tokens: min_tokens must be less than or equal to max_tokens=8, got 9."),
])
def test_a_value_vllm_refuses_is_one_line_at_start(generation_kwargs, message):
    """SamplingParams built at check_run with the values as every request builds them, not at the first request."""
    with pytest.raises(ConfigError) as error:
        vllm_colocated.ColocatedVLLMEngine.check_run(generation_settings(generation_kwargs=generation_kwargs))
    assert str(error.value) == message


def test_arguments_the_trainers_logprobs_ignore_are_named_in_one_warning_at_start():
    """vLLM's processed log-probs follow presence_penalty and the regex, the trainer's do not: the correction would
    measure that difference on-policy, so one warning says so; the recomputed arguments (temperature) warn nothing."""
    settings = generation_settings(generation_kwargs={"presence_penalty": 0.5, "temperature": 0.7, "ignore_eos": False},
                                   vllm_structured_outputs_regex="(yes|no)")
    with pytest.warns(UserWarning) as caught:
        vllm_colocated.ColocatedVLLMEngine.check_run(settings)
    messages = [str(warning.message) for warning in caught if "log-probs ignore" in str(warning.message)]
    assert messages == [
        "model.generation_kwargs.presence_penalty, model.vllm_structured_outputs_regex change the distribution the "
        "completions are sampled from, but the trainer's log-probs ignore them (as TRL's): the engine's log-probs follow them, "
        "so the importance-sampling correction's ratios (trainer / engine) and off_policy_mask_threshold's KL measure that "
        "difference even on-policy: consider model.vllm_importance_sampling_correction: false"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        vllm_colocated.ColocatedVLLMEngine.check_run(generation_settings(generation_kwargs={"temperature": 0.7}))


# ----------------------------------------------------------------------------------------------
# Sampling semantics and log-probs of the engine
# ----------------------------------------------------------------------------------------------


def test_sampled_logprobs_match_transformers_float32(setup, engine):
    tokenizer, model = setup["tokenizer"], setup["base"]
    ids = prompt_ids(tokenizer)
    G, T = 4, 0.7
    out = sample(engine, ids, G, temperature=T, max_tokens=MAX_NEW, stop_token_ids=[tokenizer.eos_token_id], seed=11)
    worst = 0.0
    for row, (completion, logprobs) in enumerate(zip(out.completion_ids, out.logprobs)):
        assert len(logprobs) == len(completion)
        expected = hf_logprobs(model, ids[row // G], completion, T)
        worst = max(worst, float((torch.tensor(logprobs) - expected).abs().max()))
    assert worst < LOGPROB_ATOL


def test_logprobs_are_renormalised_after_top_k(setup, engine):
    """processed_logprobs come after top-k/top-p masking: log_softmax over the kept tokens only, so
    they exceed the trainer's full-vocabulary log_softmax(logits / T) by -log(kept mass)."""
    tokenizer, model = setup["tokenizer"], setup["base"]
    ids = prompt_ids(tokenizer)[:2]
    T, K = 0.7, 5
    out = sample(engine, ids, 2, temperature=T, top_k=K, max_tokens=8, stop_token_ids=[tokenizer.eos_token_id], seed=5)
    for row, completion in enumerate(out.completion_ids):
        prompt = ids[row // 2]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1] / T
        kept = logits.topk(K, dim=-1).values
        expected = logits.gather(1, torch.tensor(completion)[:, None])[:, 0] - kept.logsumexp(dim=-1)
        assert torch.allclose(torch.tensor(out.logprobs[row]), expected, atol=LOGPROB_ATOL)
        full = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(completion)[:, None])[:, 0]
        assert (torch.tensor(out.logprobs[row]) >= full - LOGPROB_ATOL).all()


def test_top_k_1_and_repetition_penalty_match_transformers(setup, engine):
    tokenizer, model = setup["tokenizer"], setup["base"]
    ids = prompt_ids(tokenizer)
    stop = [tokenizer.eos_token_id]
    greedy = hf_greedy(model, ids, generation_config(tokenizer))
    top1 = sample(engine, ids, 2, temperature=1.0, top_k=1, max_tokens=MAX_NEW, stop_token_ids=stop, seed=4)
    assert top1.completion_ids == [row for row in greedy for _ in range(2)]
    penalised = hf_greedy(model, ids, generation_config(tokenizer, repetition_penalty=1.8))
    assert penalised != greedy
    out = sample(engine, ids, 1, temperature=0.0, repetition_penalty=1.8, max_tokens=MAX_NEW, stop_token_ids=stop)
    assert out.completion_ids == penalised


def test_stops_at_every_eos_id_of_the_generation_config(setup, engine):
    tokenizer, model = setup["tokenizer"], setup["base"]
    ids = prompt_ids(tokenizer)
    free = hf_greedy(model, ids, generation_config(tokenizer))
    # a second EOS id that the greedy path of the longest completion emits in its middle
    longest = max(free, key=len)
    second = next(token for token in longest[2:] if token != tokenizer.eos_token_id)
    config = generation_config(tokenizer, eos=[tokenizer.eos_token_id, second])
    stop_ids = generation_config_eos_ids(config)
    out = sample(engine, ids, 1, temperature=0.0, max_tokens=MAX_NEW, stop_token_ids=stop_ids)
    assert out.completion_ids == hf_greedy(model, ids, config)
    assert out.completion_ids == backend_tokens(model, tokenizer, config, "transformers")
    assert any(c[-1] == second for c in out.completion_ids)
    # sampled: every completion stops at the first EOS of either kind, or runs to max_tokens
    sampled = sample(engine, ids, 8, temperature=1.0, max_tokens=MAX_NEW, stop_token_ids=stop_ids, seed=1)
    for completion, reason, stopped in zip(sampled.completion_ids, sampled.finish_reasons, sampled.stop_token_ids):
        assert not set(completion[:-1]) & set(stop_ids)
        if reason == "stop":
            assert completion[-1] in stop_ids and stopped == completion[-1]
        else:
            assert reason == "length" and len(completion) == MAX_NEW and completion[-1] not in stop_ids


def test_same_seed_same_samples_independent_of_batch(setup, engine):
    tokenizer = setup["tokenizer"]
    ids = prompt_ids(tokenizer)
    kwargs = dict(temperature=1.0, max_tokens=MAX_NEW, stop_token_ids=[tokenizer.eos_token_id])
    first = sample(engine, ids, 4, seed=77, **kwargs)
    again = sample(engine, ids, 4, seed=77, **kwargs)
    other = sample(engine, ids, 4, seed=1077, **kwargs)
    assert first.completion_ids == again.completion_ids and first.logprobs == again.logprobs
    assert first.completion_ids != other.completion_ids
    assert len({tuple(c) for c in first.completion_ids[:4]}) > 1  # seed + g per completion
    # per-prompt seeds: a prompt's samples do not depend on what else is in the batch
    seeds = [1000 + 31 * index for index in range(len(ids))]
    batch = sample(engine, ids, 4, seed=seeds, **kwargs)
    alone = sample(engine, ids[2:3], 4, seed=seeds[2:3], **kwargs)
    assert batch.completion_ids[8:12] == alone.completion_ids


def test_engine_leaves_global_random_state_alone(setup, engine):
    (torch_before, python_before), (torch_after, python_after) = setup["rng"]
    assert torch.equal(torch_before, torch_after) and python_before == python_after  # building
    state = torch.get_rng_state()
    sample(engine, prompt_ids(setup["tokenizer"]), 2, temperature=1.0, max_tokens=8, seed=3)
    assert torch.equal(state, torch.get_rng_state())  # the CPU sampler's randint is undone


def test_sleep_and_wake_up_are_noops_on_cpu(setup, engine):
    assert vllm_colocated.is_cpu_platform()
    assert vllm_colocated.sleep(engine, level=1) is False
    assert vllm_colocated.wake_up(engine) is False


def test_unsupported_head_size_is_refused_before_building(tmp_path):
    build_tiny_model(tmp_path)  # hidden 64 / 4 heads = head size 16
    with pytest.raises(ConfigError, match="head sizes .* --num-heads 2"):
        build_engine(tmp_path)


class SideBySide:
    """Commands run side by side from worker threads, each process in a session (process group) of its own, so
    that none outlives its test: leaving the ``with`` block (the fixture's or test's end) kills every group whose
    process still runs, as when the test fails or pytest is interrupted (the interrupt reaches only the main
    thread, which waits on a worker: enter this block after the thread pool's, so it exits first)."""

    def __init__(self) -> None:
        self.processes: list[subprocess.Popen] = []
        self.killed = False
        self.lock = threading.Lock()  # a worker starting its process while the finalizer kills

    def run(self, command: list[str], *, timeout: float, capture_output: bool = True, text: bool = True,
            **options) -> subprocess.CompletedProcess:
        """:func:`subprocess.run` (output captured unless ``capture_output=False``), the process in a new session."""
        output = subprocess.PIPE if capture_output else None
        with self.lock:
            if self.killed:
                raise RuntimeError(f"{command} not started: its test has ended")
            process = subprocess.Popen(command, stdout=output, stderr=output, text=text, start_new_session=True, **options)
            self.processes.append(process)
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_process_group(process)
            process.communicate()
            raise
        return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exception) -> None:
        with self.lock:
            self.killed = True
        for process in self.processes:
            kill_process_group(process)


def kill_process_group(process: subprocess.Popen) -> None:
    """SIGKILL to the group of ``process`` (also its children) while it runs (once reaped, its id may be another's)."""
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:  # it has just ended
            pass


@pytest.fixture(scope="module", autouse=True)
def interrupt_on_sigterm():
    """SIGTERM (``timeout pytest ...``, a CI job cancelled) ends pytest as Ctrl-C does, through the finalizers that
    kill the process groups started here (in sessions of their own, a signal to pytest's group misses them)."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    yield
    signal.signal(signal.SIGTERM, previous)


BF16_SCRIPT = """
import json, os
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from transformers import AutoModelForCausalLM
from lit_grpo.rollout.engines.vllm_colocated import build_engine, push_weights, sample
from lit_grpo.rollout.engines.policy_weights import hf_named_weights
llm = build_engine({start!r}, dtype="bfloat16", max_model_len=128)
if {push!r}:
    push_weights(llm, hf_named_weights(AutoModelForCausalLM.from_pretrained({target!r})))
prompts = [[5, 6, 7, 8], [20, 30, 40]]
greedy = sample(llm, prompts, 1, temperature=0.0, max_tokens=16, stop_token_ids=[2])
sampled = sample(llm, prompts, 2, temperature=0.7, max_tokens=16, stop_token_ids=[2], seed=3)
print(json.dumps(dict(greedy=greedy.completion_ids, sampled=sampled.completion_ids, logprobs=sampled.logprobs)))
"""


def test_bfloat16_pushed_engine_equals_engine_loaded_from_disk(setup, tmp_path):
    """In bfloat16 the CPU linear layers run on prepacked (AMX / oneDNN) weights; an engine that
    received the weights by push_weights must give the same tokens and log-probs, bit for bit, as
    one built from the same weights on disk (the push re-runs the prepacking). Also guards the AMX
    permission request: without it the first bfloat16 forward dies with SIGILL on AMX machines."""
    start = tmp_path / "start"
    build_tiny_model(start, seed=5, **TINY)  # other weights than setup["path"]

    def run(start_dir, push):
        script = BF16_SCRIPT.format(start=str(start_dir), push=push, target=str(setup["path"]))
        one_thread = {**os.environ, "OMP_NUM_THREADS": "1"}  # side by side: one core each
        result = engines.run([sys.executable, "-c", script], env=one_thread, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        return json.loads(result.stdout.strip().splitlines()[-1])

    # the two engines start side by side, each in its own process
    with ThreadPoolExecutor(2) as processes, SideBySide() as engines:
        from_disk, pushed = processes.map(run, [setup["path"], start], [False, True])
    assert pushed == from_disk
    assert len({tuple(c) for c in from_disk["sampled"]}) > 1


@pytest.fixture(scope="module")
def warm_tool_model(request, tmp_path_factory):
    """examples/environment-plugin's warm-started tiny model (head size 32): the main suite's, from pytest's
    cache (tests/conftest.py: trained in a subprocess where the cache has none)."""
    return cached_warm_tool_model(request.config, tmp_path_factory.mktemp("kv-model"))


TOOLS_SCRIPT = """
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
sys.path.insert(0, {example!r})
import lit_grpo_kv_lookup
from lit_grpo import plugins
from lit_grpo.train.module import GRPOModule
plugins.register_plugin(lit_grpo_kv_lookup, package="lit-grpo-kv-lookup")
rows = [json.loads(line) for line in open({data!r})][:4]
columns = {{"store": [r["store"] for r in rows], "key": [r["key"] for r in rows]}}
prompts = [[{{"role": "user", "content": r["prompt"]}}] for r in rows]
out = {{}}
for backend in ("vllm", "transformers"):
    module = GRPOModule({path!r}, [{{"name": "kv_answer"}}], generation_backend=backend, num_generations=2,
                        max_completion_length=96, environment={{"name": "kv_lookup"}}, temperature_eval=0.0)
    module.configure_model()
    rollout = module.generate(prompts, 2, module.eval_generation_config, columns)
    out[backend] = [dict(ids=c.token_ids, mask=c.tool_mask, messages=c.messages, logps=c.sampling_logps)
                    for c in rollout.conversations]
    if module.engine is not None:
        module.engine.close()
print(json.dumps(out))
"""


def test_multi_turn_tool_rollouts_with_vllm_equal_transformers_greedy(warm_tool_model):
    """The example environment's warm-started tiny model (it calls the lookup tool) in a multi-turn
    rollout, greedy: vLLM's conversations, token by token and loss mask, equal transformers' (a
    subprocess: another model, another engine)."""
    script = TOOLS_SCRIPT.format(example=str(REPO / "examples/environment-plugin"), path=str(warm_tool_model),
                                 data=str(REPO / "configs/data/kv_lookup.jsonl"))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    for engine, reference in zip(out["vllm"], out["transformers"]):
        assert engine["ids"] == reference["ids"] and engine["mask"] == reference["mask"]
        assert engine["messages"] == reference["messages"]
    assert any(message["role"] == "tool" for row in out["vllm"] for message in row["messages"])
    for row in out["vllm"]:  # no engine log-prob on the tool's tokens
        assert all(logp == 0.0 for logp, own in zip(row["logps"], row["mask"]) if not own)


def test_a_row_the_engine_capped_at_max_model_len_is_truncated_not_finished(setup, engine):
    """vLLM ends a row at the engine's max_model_len ("length") before max_tokens; padded next to a
    longer row with a pad id that is also an EOS id (as Qwen's <|endoftext|>), it must not count as
    finished, nor train on a pad token it never sampled: the mask comes from the engine's lengths."""
    tokenizer = setup["tokenizer"]
    sampler = vllm_colocated.ColocatedVLLMEngine.__new__(vllm_colocated.ColocatedVLLMEngine)
    sampler.llm, sampler.pushed_version, sampler.settings = engine, 0, vllm_colocated.VLLMSettings()
    sampler.asleep, sampler.phases = False, 0  # awake, outside a generation phase (sleep mode is off on the CPU)
    long_prompt = prompt_ids(tokenizer, ["ab" * 125])[0][:250]  # the engine takes 256 tokens: room for 6
    short_prompt = prompt_ids(tokenizer, ["Hello there"])[0]
    ids = torch.full((2, 250), tokenizer.pad_token_id)
    mask = torch.zeros((2, 250), dtype=torch.long)
    ids[0], mask[0] = torch.tensor(long_prompt), 1
    ids[1, -len(short_prompt):], mask[1, -len(short_prompt):] = torch.tensor(short_prompt), 1
    config = generation_config(tokenizer, eos=[tokenizer.eos_token_id, tokenizer.pad_token_id])
    rollout = sampler.generate(ids, mask, torch.zeros(2, dtype=torch.bool), 1, config, tokenizer.pad_token_id)
    assert int(rollout.completion_mask[0].sum()) == 256 - 250 and bool(rollout.is_truncated[0])
    assert tokenizer.pad_token_id not in rollout.completion_ids[0][rollout.completion_mask[0].bool()].tolist()
    assert rollout.completion_ids.size(1) > 6  # the other row is longer: row 0 was padded


def test_long_tool_results_neither_crash_the_engine_nor_pass_its_max_model_len(tmp_path, warm_tool_model):
    """A tool returning 500 characters with max_prompt_length: 64 (tests/long_tool_run.py). The engine
    takes the model's own length with tools (not prompt + completion, which one result passes); made
    shorter, a round of results that would pass it is dropped instead of failing inside vLLM."""
    sys.path.insert(0, str(REPO / "tests"))
    import long_tool_run

    with ThreadPoolExecutor(2) as runs, SideBySide() as fits:  # the two fits side by side, each in its own process
        kept_run = runs.submit(long_tool_run.fit_with_long_tool_results, tmp_path / "fits", warm_tool_model, "vllm",
                               run=fits.run)
        dropped_run = runs.submit(long_tool_run.fit_with_long_tool_results, tmp_path / "dropped", warm_tool_model, "vllm",
                                  "--model.vllm_max_model_length", "300", run=fits.run)
        wait([kept_run, dropped_run])  # in the block: leaving it kills what still runs
    logged, records = kept_run.result()
    assert min(logged["tools/calls_per_rollout"]) > 0 and logged["tools/dropped_frac"] == [0.0, 0.0]
    assert all(len(result) == long_tool_run.CHARACTERS for result in long_tool_run.tool_messages(records))
    logged, records = dropped_run.result()
    assert logged["tools/dropped_frac"] == [1.0, 1.0] and long_tool_run.tool_messages(records) == []


# ----------------------------------------------------------------------------------------------
# lit-grpo fit with the vllm backend, as users run it: one process learns; two processes (gloo)
# under DDP and FSDP2, each with its own engine
# ----------------------------------------------------------------------------------------------


def scalars(log_dir: Path) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: [event.value for event in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def fit_quickstart(tmp_path: Path, *overrides: str, config: dict | None = None) -> dict[str, list[float]]:
    """``lit-grpo fit --config configs/quickstart.yaml`` with the vllm backend on a 2-head tiny model."""
    return run_fit(tmp_path, quickstart_command(tmp_path, *overrides, config=config))


def quickstart_command(tmp_path: Path, *overrides: str, config: dict | None = None) -> list[str]:
    """The command of :func:`fit_quickstart`, with the tiny model and the configs it reads written to ``tmp_path``."""
    build_tiny_model(tmp_path / "tiny-model", num_attention_heads=2)  # `lit-grpo init-tiny DIR --num-heads 2`, in this process
    quickstart = yaml.safe_load((REPO / "configs/quickstart.yaml").read_text())
    quickstart["data"]["data_files"] = str(REPO / quickstart["data"]["data_files"])
    (tmp_path / "quickstart.yaml").write_text(yaml.safe_dump(quickstart))
    command = [LIT_GRPO, "fit", "--config", "quickstart.yaml", "--model.generation_backend", "vllm", *overrides]
    if config is not None:
        (tmp_path / "extra.yaml").write_text(yaml.safe_dump(config))
        command[4:4] = ["--config", "extra.yaml"]
    return command


def run_fit(tmp_path: Path, command: list[str], run=subprocess.run) -> dict[str, list[float]]:
    """Run ``command`` (one thread per process) in ``tmp_path`` with ``run`` (or :meth:`SideBySide.run`); the scalars it logged."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    result = run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"{command} failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return scalars(tmp_path / "runs" / "quickstart" / "version_0")


def assert_engine_had_the_trained_weights(logged: dict[str, list[float]], steps: int) -> None:
    """The engine's log-probs of its own samples equal the trainer's at every step: had a weight
    push been missed, the trainer's (updated) policy would differ from the engine's (old) one."""
    differences = logged["sampling/sampling_logp_difference/max"]
    assert len(differences) == steps and max(differences) < LOGPROB_ATOL, differences
    assert all(ratio == pytest.approx(1.0, abs=1e-3) for ratio in logged["sampling/importance_sampling_ratio/mean"])
    assert len(logged["time/weight_sync"]) == steps and all(seconds > 0 for seconds in logged["time/weight_sync"])
    assert len(logged["time/generate"]) == steps


@pytest.fixture(scope="module")
def one_process_fits(tmp_path_factory) -> dict:
    """The two one-process fits below, started side by side (each runs one thread: two cores take both
    in the time of the longer); each test waits for its own."""
    commands = {}
    for name, overrides in (("learns", ("--trainer.max_steps", "60")),
                            ("one_step_off", ("--trainer.max_steps", "6", "--model.max_staleness", "1"))):
        run_dir = tmp_path_factory.mktemp(name)
        commands[name] = (run_dir, quickstart_command(run_dir, *overrides))  # in this thread: torch's random state
    # at the end, a fit still running (its test failed, was interrupted or not selected) is killed, not awaited
    with ThreadPoolExecutor(len(commands)) as fits, SideBySide() as processes:
        yield {name: fits.submit(run_fit, run_dir, command, processes.run) for name, (run_dir, command) in commands.items()}


def test_quickstart_learns_with_the_vllm_backend(one_process_fits):
    """The quickstart as shipped, with ``--model.generation_backend vllm``: the reward rises as with
    the other backends (0.02 -> 0.25 in 60 steps for all three: bench/backends.py)."""
    logged = one_process_fits["learns"].result()
    rewards = logged["reward"]
    assert len(rewards) == 60 and all(math.isfinite(value) for value in logged["loss"])
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > first + 0.1, f"reward went from {first:.3f} to {last:.3f}"
    assert_engine_had_the_trained_weights(logged, 60)


def test_one_step_off_with_the_colocated_engine_trains_on_its_older_samples(one_process_fits):
    """``model.max_staleness: 1`` with the in-process engine (lit_grpo.rollout.async_pipeline): each step samples its
    batch, then trains on the previous step's, one optimizer step stale; the engine's log-probs are those
    of the weights that sampled (equal to the trainer's before the first step, apart after: the
    importance-sampling correction reweights them)."""
    logged = one_process_fits["one_step_off"].result()
    assert logged["async/staleness_max"] == [0.0] + [1.0] * 5
    differences = logged["sampling/sampling_logp_difference/max"]
    assert differences[0] < LOGPROB_ATOL and min(differences[1:]) > LOGPROB_ATOL, differences
    assert all(math.isfinite(value) for value in logged["loss"])


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_processes_each_with_its_own_engine(tmp_path, strategy):
    fsdp2 = {
        "class_path": "lightning.pytorch.strategies.ModelParallelStrategy",
        "init_args": {"data_parallel_size": 2, "tensor_parallel_size": 1},
    }
    config = {"trainer": {"devices": 2, "max_steps": 4, "strategy": "ddp" if strategy == "ddp" else fsdp2},
              "data": {"batch_size": 4}}
    logged = fit_quickstart(tmp_path, config=config)
    assert len(logged["reward"]) == 4 and all(math.isfinite(value) for value in logged["loss"])
    assert_engine_had_the_trained_weights(logged, 4)
