"""TRL 1.16's sampling-side keys (issue 54) on the ``lit`` and ``transformers`` backends: ``model.generation_kwargs``
(its temperature, top_k, top_p, min_p and repetition_penalty become the named keys' values, which the trainer
recomputes its log-probs with; the rest goes to the backend as ``GenerationConfig`` fields), a setting the
backend cannot take as one line at start (``vllm_structured_outputs_regex`` needs vLLM), ``disable_dropout``
and the deprecated ``vllm_importance_sampling_cap``. The vLLM backends' cases are in test_vllm.py and
test_vllm_server.py (vLLM's own environment)."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
from test_errors import error_line, quickstart_writer  # noqa: F401 (tests/cli: the one-line error of lit-grpo)
from test_module import make_data, make_module, sgd
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

from lit_grpo.errors import ConfigError
from lit_grpo.models import disable_dropout


def fit_two_optimizer_steps(model_dir, data_file, fast_trainer, **settings) -> tuple[dict[str, float], list[torch.Tensor]]:
    """One generation batch, two optimizer steps on it (``num_iterations: 2``: the second step's ratio and
    gradient follow the trainer's log-probs), seeded: the logged metrics and the policy's weights after."""
    pl.seed_everything(0)
    module = make_module(model_dir, num_iterations=2, optimizer=sgd(0.5), **settings)
    trainer = fast_trainer(max_steps=2)
    trainer.fit(module, make_data(data_file))
    metrics = {name: float(value) for name, value in trainer.logged_metrics.items()}
    return metrics, [parameter.detach().clone() for parameter in module.policy.parameters()]


def test_a_temperature_given_only_in_generation_kwargs_trains_as_model_temperature(tiny_model_dir, say_a_or_b_file,
                                                                                    fast_trainer):
    """TRL: generation_kwargs override the named keys. Its temperature is model.temperature everywhere: what
    the backend samples at and what the trainer recomputes the log-probs (ratio, loss, entropy) at."""
    named, named_weights = fit_two_optimizer_steps(tiny_model_dir, say_a_or_b_file, fast_trainer, temperature=0.5)
    given, given_weights = fit_two_optimizer_steps(tiny_model_dir, say_a_or_b_file, fast_trainer,
                                                   generation_kwargs={"temperature": 0.5})
    for name in ("loss", "entropy", "reward", "completions/mean_length"):
        assert given[name] == named[name], name
    assert all(torch.equal(a, b) for a, b in zip(given_weights, named_weights))
    default, _ = fit_two_optimizer_steps(tiny_model_dir, say_a_or_b_file, fast_trainer)  # temperature 1.0
    assert default["entropy"] != named["entropy"] and default["loss"] != named["loss"]  # the check can tell


def test_the_sampling_distribution_arguments_become_the_named_settings(tiny_model_dir):
    module = make_module(tiny_model_dir, temperature=0.9, generation_kwargs={
        "temperature": 0.6, "top_k": -1, "top_p": 0.8, "min_p": 0.05, "repetition_penalty": 1.1, "suppress_tokens": [7]})
    sampling = module.settings.sampling
    assert (sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p, sampling.repetition_penalty) == (
        0.6, 0, 0.8, 0.05, 1.1)  # vLLM's top_k -1 (off) is lit-grpo's 0
    assert (module.hparams.temperature, module.hparams.top_p) == (0.6, 0.8)  # saved with the run, as it ran
    module.configure_model()
    config = module.generation_config
    assert (config.temperature, config.top_k, config.top_p, config.min_p, config.repetition_penalty) == (0.6, 0, 0.8, 0.05, 1.1)
    assert module.engine.generation_kwargs == {"suppress_tokens": [7]}  # the rest: the backend's


@pytest.mark.parametrize("backend", ["lit", "transformers"])
def test_other_arguments_reach_the_backend_the_lit_sampler_falling_back_to_generate(tiny_model_dir, backend):
    """suppress_tokens (a GenerationConfig field the lit sampler does not implement): every token but one
    character and the EOS ids suppressed, the completions hold nothing else; lit hands it to generate, warning."""
    probe = make_module(tiny_model_dir)
    tokenizer = probe.tokenizer
    allowed = {tokenizer.convert_tokens_to_ids("x"), *probe.tokenizer.all_special_ids}
    vocab_size = AutoModelForCausalLM.from_pretrained(tiny_model_dir).config.vocab_size
    suppressed = [token for token in range(vocab_size) if token not in allowed]
    module = make_module(tiny_model_dir, generation_backend=backend, generation_kwargs={"suppress_tokens": suppressed})
    module.configure_model()
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rollout = module.generate(["Say a:", "Say b:"])
    tokens = set(rollout.completion_ids[rollout.completion_mask.bool()].tolist())
    assert tokenizer.convert_tokens_to_ids("x") in tokens and tokens <= allowed
    fallback = [str(warning.message) for warning in caught if "does not implement" in str(warning.message)]
    assert fallback == (["model.generation_backend=lit does not implement generation options ['suppress_tokens']; "
                         "sampling with transformers' generate"] if backend == "lit" else [])


@pytest.mark.parametrize(("settings", "message"), [
    ({"generation_kwargs": {"foo": 1}},
     "model.generation_kwargs.foo: model.generation_backend lit takes transformers' GenerationConfig fields, which have no 'foo'"),
    ({"generation_kwargs": {"presence_penalty": 0.5}, "generation_backend": "transformers"},  # vLLM's, not transformers'
     "model.generation_kwargs.presence_penalty: model.generation_backend transformers takes transformers' GenerationConfig "
     "fields, which have no 'presence_penalty'"),
    ({"generation_kwargs": {"max_new_tokens": 3}}, "model.generation_kwargs.max_new_tokens: lit-grpo sets it from "
     "model.max_completion_length"),
    ({"generation_kwargs": {"num_return_sequences": 3}}, "model.generation_kwargs.num_return_sequences: lit-grpo sets it "
     "from model.num_generations"),
    ({"generation_kwargs": {"temperature": 0}}, "model.generation_kwargs.temperature must be > 0 (sampling), got 0"),
    ({"generation_kwargs": {"top_p": "most"}}, "model.generation_kwargs.top_p must be a number, got 'most'"),
    ({"generation_kwargs": {"top_k": 50.5}}, "model.generation_kwargs.top_k must be an integer, got 50.5"),
    ({"generation_kwargs": {"validate": 1}},  # a method of GenerationConfig, not a field: update would overwrite it
     "model.generation_kwargs.validate: model.generation_backend lit takes transformers' GenerationConfig fields, which "
     "have no 'validate'"),
    ({"generation_kwargs": {"to_dict": 1}, "generation_backend": "transformers"},
     "model.generation_kwargs.to_dict: model.generation_backend transformers takes transformers' GenerationConfig fields, "
     "which have no 'to_dict'"),
    ({"generation_kwargs": {"early_stopping": "x"}}, "model.generation_kwargs.early_stopping: `early_stopping` must be a boolean or "
     "'never', but is x."),
    ({"generation_kwargs": {"cache_implementation": "fast"}, "generation_backend": "transformers"},
     "model.generation_kwargs.cache_implementation: Invalid `cache_implementation` (fast). Choose one of: ('static', 'offloaded_static', "
     "'sliding_window', 'hybrid', 'hybrid_chunked', 'offloaded_hybrid', 'offloaded_hybrid_chunked', 'dynamic', "
     "'offloaded', 'quantized', 'paged')"),
    ({"vllm_structured_outputs_regex": "(yes|no)"}, "model.vllm_structured_outputs_regex needs a vLLM backend (vLLM's "
     "structured outputs): set model.generation_backend: vllm or vllm_server, got lit"),
    ({"vllm_importance_sampling_cap": 2.0, "vllm_importance_sampling_clip_max": 4.0},
     "model.vllm_importance_sampling_cap (2.0, deprecated) and model.vllm_importance_sampling_clip_max (4.0) differ: "
     "give only vllm_importance_sampling_clip_max"),
])
def test_a_setting_the_backend_cannot_take_is_one_line_at_start(tiny_model_dir, settings, message):
    with pytest.raises(ConfigError) as error:
        make_module(tiny_model_dir, **settings)
    assert str(error.value) == message


@pytest.mark.parametrize("backend", ["lit", "transformers"])
def test_arguments_the_trainers_logprobs_ignore_are_named_in_one_warning_at_start(tiny_model_dir, backend):
    """suppress_tokens and min_new_tokens change what the policy samples, not the log-probs the trainer recomputes:
    one warning names both; the recomputed arguments (top_p) and the others (use_cache) warn nothing."""
    with pytest.warns(UserWarning) as caught:
        make_module(tiny_model_dir, generation_backend=backend,
                    generation_kwargs={"suppress_tokens": [7], "top_p": 0.9, "min_new_tokens": 2, "use_cache": True})
    assert [str(warning.message) for warning in caught if "log-probs ignore" in str(warning.message)] == [
        "model.generation_kwargs.suppress_tokens, model.generation_kwargs.min_new_tokens change the distribution the "
        "completions are sampled from, but the trainer's log-probs ignore them (as TRL's): the completions are off-policy by "
        "that difference, which nothing corrects"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_module(tiny_model_dir, generation_backend=backend, generation_kwargs={"top_p": 0.9, "use_cache": True})
    assert not [warning for warning in caught if "log-probs ignore" in str(warning.message)]


def test_arguments_valid_only_together_pass_and_the_one_refused_alone_is_named(tiny_model_dir):
    """length_penalty alone has no effect when sampling (strict validation refuses it), with num_beams it has."""
    make_module(tiny_model_dir, generation_backend="transformers", generation_kwargs={"num_beams": 2, "length_penalty": 2.0})
    with pytest.raises(ConfigError) as error:
        make_module(tiny_model_dir, generation_kwargs={"num_beams": 2, "early_stopping": "x", "length_penalty": 2.0})
    assert str(error.value) == "model.generation_kwargs.early_stopping: `early_stopping` must be a boolean or 'never', but is x."


def test_an_unknown_generation_argument_ends_lit_grpo_fit_with_one_line(tmp_path, tiny_model_dir, capsys, fresh_cli):
    path = quickstart_writer(tmp_path, tiny_model_dir)(model={"generation_kwargs": {"foo": 1}})
    assert error_line(capsys, "fit", "--config", str(path)) == (
        "model.generation_kwargs.foo: model.generation_backend lit takes transformers' GenerationConfig fields, which have "
        "no 'foo'")


def test_the_deprecated_cap_sets_clip_max_with_trls_warning(tiny_model_dir):
    with pytest.warns(FutureWarning) as caught:
        module = make_module(tiny_model_dir, vllm_importance_sampling_cap=2.5)
    assert [str(warning.message) for warning in caught if warning.category is FutureWarning] == [
        "The `vllm_importance_sampling_cap` argument is deprecated and will be removed in v2.0.0. Use "
        "`vllm_importance_sampling_clip_max` instead."]
    assert module.hparams.vllm_importance_sampling_clip_max == 2.5
    assert module.settings.logprobs.vllm_importance_sampling_clip_max == 2.5  # what the correction reads
    # given both, equal: as one
    with pytest.warns(FutureWarning):
        both = make_module(tiny_model_dir, vllm_importance_sampling_cap=2.5, vllm_importance_sampling_clip_max=2.5)
    assert both.settings.logprobs.vllm_importance_sampling_clip_max == 2.5


def forward_twice_in_training_mode(model: torch.nn.Module, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    model.train()
    with torch.no_grad():
        return model(input_ids).logits, model(input_ids).logits


@pytest.fixture(scope="module")
def dropout_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny Llama with attention dropout 0.5 (a rate its attention reads at each forward in training mode)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attention_dropout=0.5)
    path = tmp_path_factory.mktemp("dropout-model")
    model.save_pretrained(path)
    make_module(tiny_model_dir).tokenizer.save_pretrained(path)
    return path


def test_disable_dropout_turns_the_policys_and_references_dropout_off(dropout_model_dir):
    input_ids = torch.arange(3, 19).view(2, 8)
    kept = make_module(dropout_model_dir, beta=0.1)
    kept.configure_model()
    first, second = forward_twice_in_training_mode(kept.policy, input_ids)
    assert not torch.allclose(first, second)  # dropout is on: the check can tell
    module = make_module(dropout_model_dir, beta=0.1, disable_dropout=True)
    module.configure_model()
    for model in (module.policy, module.ref_model):
        first, second = forward_twice_in_training_mode(model, input_ids)
        assert torch.equal(first, second)
        assert model.config.attention_dropout == 0.0


def test_disable_dropout_zeroes_every_dropout_module_and_config_rate():
    """GPT-2 has torch.nn.Dropout modules (embeddings, attention, residuals), as TRL's disable_dropout_in_model sets."""
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, bos_token_id=0, eos_token_id=0))
    assert {module.p for module in model.modules() if isinstance(module, torch.nn.Dropout)} == {0.1}
    disable_dropout(model, None)
    assert {module.p for module in model.modules() if isinstance(module, torch.nn.Dropout)} == {0.0}
    assert (model.config.resid_pdrop, model.config.embd_pdrop, model.config.attn_pdrop) == (0.0, 0.0, 0.0)
    first, second = forward_twice_in_training_mode(model, torch.arange(16).view(2, 8))
    assert torch.equal(first, second)


class AttentionWithADropoutRate(torch.nn.Module):
    """As CLIP's and Whisper's attention: a float rate kept as an attribute, read at each forward in training mode."""

    def __init__(self) -> None:
        super().__init__()
        self.dropout = 0.5
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(self.proj(hidden), p=self.dropout, training=self.training)


def test_disable_dropout_zeroes_the_rates_modules_keep_as_attributes():
    model = torch.nn.Sequential(AttentionWithADropoutRate())
    hidden = torch.ones(4, 8)
    model.train()
    assert not torch.equal(model(hidden), model(hidden))  # the check can tell
    disable_dropout(model)
    assert model[0].dropout == 0.0 and torch.equal(model(hidden), model(hidden))
