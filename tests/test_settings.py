"""The setting records built once from a module's hyperparameters (lit_grpo.settings)."""

from __future__ import annotations

import dataclasses
import inspect

from lit_grpo.settings import LogProbSettings, LossSettings, RunSettings, SamplingSettings
from lit_grpo.train.module import GRPOModule

# held resolved in the records: the correction's "auto" (a mode and a range), epsilon_high's None (epsilon)
RESOLVED = {"vllm_importance_sampling_mode", "vllm_importance_sampling_clip_min", "vllm_importance_sampling_clip_max",
            "epsilon_high"}
# the records' names for module parameters of another name
RENAMED = {"epsilon_low": "epsilon"}


def test_the_records_defaults_are_the_modules():
    """A record made without the config (a test, a script) means what GRPOModule's defaults mean."""
    parameters = inspect.signature(GRPOModule).parameters
    for record in (LossSettings, SamplingSettings, LogProbSettings):
        for field in dataclasses.fields(record):
            name = RENAMED.get(field.name, field.name)
            if name in RESOLVED or field.default is dataclasses.MISSING:
                continue
            assert field.default == parameters[name].default, f"{record.__name__}.{field.name}"


def test_the_records_of_a_module(tiny_model_dir):
    from test_module import make_module

    module = make_module(tiny_model_dir, epsilon=0.1, beta=0.04, loss_type="grpo", top_k=5)
    settings = RunSettings.from_hparams(module.hparams)
    assert settings.loss == LossSettings(loss_type="grpo", max_completion_length=8, beta=0.04, epsilon_low=0.1, epsilon_high=0.1)
    assert module.logprobs.settings == settings  # the passes were built with these
    assert settings.sampling.top_k == 5 and settings.sampling.generation_backend == "lit"
    # the correction's "auto", resolved for a synchronous run (TRL's defaults)
    passes = settings.logprobs
    assert (passes.vllm_importance_sampling_mode, passes.vllm_importance_sampling_clip_min,
            passes.vllm_importance_sampling_clip_max) == ("sequence_mask", None, 3.0)

    higher = RunSettings.from_hparams(make_module(tiny_model_dir, epsilon=0.1, epsilon_high=0.28).hparams)
    assert (higher.loss.epsilon_low, higher.loss.epsilon_high) == (0.1, 0.28)
