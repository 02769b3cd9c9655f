"""Bad input fails early with a message that names the offending thing.

Every case fails before the first optimizer step: settings and reward names when the module is
built, data and batch sizes in ``setup``, misbehaving rewards in the first ``training_step`` (checked
with ``trainer.global_step == 0`` and unchanged weights).
"""

from __future__ import annotations

import math
import re
import warnings

import lightning.pytorch as pl
import pytest
import test_module
import torch
from test_module import make_data

from lit_grpo.plugins import UnknownRewardError
from lit_grpo.scoring import RewardError
from lit_grpo.train.module import GRPOModule

PROMPTS = [{"prompt": f"Say {c}:", "target": c} for c in "ab" * 4]


def make_module(model_dir, rewards=None, **overrides) -> GRPOModule:
    """test_module's tiny GRPO module with groups of 2 (``rewards`` default: char_fraction)."""
    return test_module.make_module(model_dir, **{"rewards": rewards or [{"name": "char_fraction"}],
                                                 "num_generations": 2, **overrides})


def fit_expecting(error_type, module, data, fast_trainer, match=None):
    """Fit one step, expect ``error_type``; the policy must not have taken an optimizer step."""
    pl.seed_everything(0)
    module.configure_model()
    before = [p.detach().clone() for p in module.policy.parameters()]
    trainer = fast_trainer(max_steps=1)
    with pytest.raises(error_type, match=match) as error:
        trainer.fit(module, data)
    assert trainer.global_step == 0
    assert all(torch.equal(p, b) for p, b in zip(module.policy.parameters(), before))
    return error.value


# --------------------------------------------------------------------------------------------------
# Rewards
# --------------------------------------------------------------------------------------------------


def test_unknown_reward_name_lists_installed_rewards(tiny_model_dir):
    with pytest.raises(UnknownRewardError) as error:
        make_module(tiny_model_dir, rewards=[{"name": "char_fractoin"}])
    message = str(error.value)
    assert "'char_fractoin'" in message
    assert "Did you mean 'char_fraction'?" in message
    assert "char_fraction (lit-grpo-rewards" in message  # each installed reward with its package
    assert "shouts (lit-grpo-test-plugin" in message
    assert "lit-grpo rewards" in message  # how to list them


class Boom(Exception):
    pass


def test_reward_that_raises_names_reward_prompt_and_completion(
    tiny_model_dir, write_jsonl, fast_trainer, reward_plugin
):
    seen = {}

    def explodes(prompts, completions, **kwargs):
        seen["prompt"], seen["completion"] = prompts[0], completions[0]
        raise Boom("kaboom")

    reward_plugin(explodes=explodes)
    module = make_module(tiny_model_dir, rewards=[{"name": "explodes"}])
    error = fit_expecting(RewardError, module, make_data(write_jsonl(PROMPTS)), fast_trainer)
    message = str(error)
    assert "'explodes'" in message and "test-rewards" in message  # the reward and its package
    assert "Boom: kaboom" in message
    assert repr(seen["prompt"]) in message
    assert repr(seen["completion"]) in message
    assert isinstance(error.__cause__, Boom) and str(error.__cause__) == "kaboom"


def test_reward_returning_wrong_number_of_values(tiny_model_dir, write_jsonl, fast_trainer, reward_plugin):
    reward_plugin(one_short=lambda completions, **kwargs: [0.0] * (len(completions) - 1))
    module = make_module(tiny_model_dir, rewards=[{"name": "one_short"}])
    error = fit_expecting(RewardError, module, make_data(write_jsonl(PROMPTS)), fast_trainer)
    # 2 prompts * 2 generations = 4 completions
    assert "'one_short'" in str(error)
    assert "returned 3 values; expected 4" in str(error)


def test_reward_returning_nan_says_to_return_none(tiny_model_dir, write_jsonl, fast_trainer, reward_plugin):
    reward_plugin(nan_reward=lambda completions, **kwargs: [1.0] + [math.nan] * (len(completions) - 1))
    module = make_module(tiny_model_dir, rewards=[{"name": "nan_reward"}])
    error = fit_expecting(RewardError, module, make_data(write_jsonl(PROMPTS)), fast_trainer)
    assert "'nan_reward'" in str(error)
    assert "NaN for sample 1" in str(error)
    assert "return None" in str(error)


def test_reward_returning_non_numbers(tiny_model_dir, write_jsonl, fast_trainer, reward_plugin):
    reward_plugin(judge=lambda completions, **kwargs: ["good"] * len(completions))
    module = make_module(tiny_model_dir, rewards=[{"name": "judge"}])
    error = fit_expecting(RewardError, module, make_data(write_jsonl(PROMPTS)), fast_trainer)
    message = str(error)
    assert "'judge'" in message
    assert "str 'good' for sample 0" in message
    assert "numbers" in message and "None" in message


def test_reward_returning_a_scalar(tiny_model_dir, write_jsonl, fast_trainer, reward_plugin):
    reward_plugin(scalar=lambda completions, **kwargs: 1.0)
    module = make_module(tiny_model_dir, rewards=[{"name": "scalar"}])
    error = fit_expecting(RewardError, module, make_data(write_jsonl(PROMPTS)), fast_trainer)
    assert "'scalar'" in str(error) and "returned float" in str(error)
    assert "one per completion" in str(error)


# --------------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------------


def test_missing_prompt_column_lists_columns(tiny_model_dir, write_jsonl, fast_trainer):
    data = make_data(write_jsonl([{"question": "Say a:", "target": "a"}] * 4), prompt_column="prompt")
    error = fit_expecting(ValueError, make_module(tiny_model_dir), data, fast_trainer)
    message = str(error)
    assert "prompt_column='prompt'" in message
    assert "['question', 'target']" in message


def test_empty_data_file(tiny_model_dir, tmp_path, fast_trainer):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    error = fit_expecting(ValueError, make_module(tiny_model_dir), make_data(empty), fast_trainer)
    assert repr(str(empty)) in str(error) and "is empty" in str(error)


def test_data_file_without_rows(tiny_model_dir, tmp_path, fast_trainer):
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n\n")
    error = fit_expecting(ValueError, make_module(tiny_model_dir), make_data(blank), fast_trainer)
    assert str(blank) in str(error) and "holds only blank lines: no rows" in str(error)


def test_fewer_rows_than_batch_size(tiny_model_dir, write_jsonl, fast_trainer):
    data = make_data(write_jsonl(PROMPTS[:3]), batch_size=4)
    error = fit_expecting(ValueError, make_module(tiny_model_dir), data, fast_trainer)
    assert "3 rows" in str(error) and "batch_size=4" in str(error)


# --------------------------------------------------------------------------------------------------
# Settings
# --------------------------------------------------------------------------------------------------


def test_num_generations_one(tiny_model_dir):
    with pytest.raises(ValueError, match=r"model\.num_generations must be at least 2 \(got 1\)"):
        make_module(tiny_model_dir, num_generations=1)


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"kl_estimator": "k4"}, r"model\.kl_estimator must be one of \('k1', 'k2', 'k3'\), got 'k4'"),
        ({"delta": 1.1, "epsilon_high": 0.28}, r"model\.delta must be above 1 \+ epsilon_high = 1\.28, got 1\.1"),
        ({"loss_type": "cispo"}, r"model\.loss_type cispo uses model\.epsilon_high as the upper bound.*got 0\.2"),
        ({"top_entropy_quantile": 0.0}, r"model\.top_entropy_quantile must be in \(0, 1\], got 0\.0"),
        ({"loss_type": "sapo", "sapo_temperature_neg": 0.0}, r"model\.sapo_temperature_pos and model\.sapo_temperature_neg must be > 0"),
    ],
)
def test_policy_loss_settings_that_cannot_work(tiny_model_dir, settings, message):
    with pytest.raises(ValueError, match=message):
        make_module(tiny_model_dir, **settings)


def test_steps_per_generation_not_dividing(tiny_model_dir, write_jsonl, fast_trainer):
    module = make_module(tiny_model_dir, num_generations=2, steps_per_generation=4)
    data = make_data(write_jsonl(PROMPTS), batch_size=3)
    error = fit_expecting(ValueError, module, data, fast_trainer)
    message = str(error)
    assert "model.steps_per_generation = 4" in message
    assert "3 * 2 = 6" in message and "data.batch_size" in message


def test_micro_batch_size_not_dividing(tiny_model_dir, write_jsonl, fast_trainer):
    module = make_module(tiny_model_dir, num_generations=4, micro_batch_size=3)
    data = make_data(write_jsonl(PROMPTS), batch_size=2)
    error = fit_expecting(ValueError, module, data, fast_trainer)
    message = str(error)
    assert "model.micro_batch_size = 3" in message
    assert "mini-batch of 8 completions" in message


def test_model_path_that_does_not_exist(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError) as error:
        make_module(missing)
    assert repr(str(missing)) in str(error.value)
    assert "init-tiny" in str(error.value)


def test_tokenizer_without_pad_token_falls_back_to_eos(tiny_model_dir_no_pad, write_jsonl, fast_trainer):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = make_module(tiny_model_dir_no_pad)
    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert any("no pad token" in m and re.search(r"EOS token '</s>'", m) for m in messages), messages
    tokenizer = module.tokenizer
    assert tokenizer.pad_token == tokenizer.eos_token == "</s>"
    assert tokenizer.pad_token_id == tokenizer.eos_token_id

    pl.seed_everything(0)
    trainer = fast_trainer(max_steps=1)
    trainer.fit(module, make_data(write_jsonl(PROMPTS)))
    assert trainer.global_step == 1
    metrics = trainer.logged_metrics
    assert math.isfinite(float(metrics["loss"])) and 0.0 <= float(metrics["reward"]) <= 1.0
    assert 1 <= float(metrics["completions/min_length"]) <= float(metrics["completions/max_length"]) <= 8
