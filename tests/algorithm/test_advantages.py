"""The advantage estimators' registry (``model.scale_rewards``): a registered estimator is what a run's
advantages come from, and an unknown name is one error naming the key."""

from __future__ import annotations

import pytest
import torch

from lit_grpo import algorithm
from lit_grpo.algorithm import ADVANTAGE_ESTIMATORS, GroupedRewards, group_advantages, register_advantage_estimator
from lit_grpo.errors import ConfigError


@pytest.fixture
def constant_estimator():
    """An estimator ``test_constant`` that gives every completion advantage 7, recording what it got."""
    seen = []

    @register_advantage_estimator("test_constant")
    def constant(grouped: GroupedRewards) -> torch.Tensor:
        seen.append(grouped)
        return torch.full_like(grouped.rewards, 7.0)

    yield seen
    del ADVANTAGE_ESTIMATORS["test_constant"]


def test_the_built_in_estimators_are_registered_in_order():
    assert tuple(ADVANTAGE_ESTIMATORS)[:3] == ("group", "batch", "none")


def test_a_registered_estimator_gets_the_grouped_rewards(constant_estimator):
    rewards = torch.tensor([1.0, 0.0, 2.0, 2.0, float("nan"), 3.0])
    out = group_advantages(rewards, num_generations=3, scale_rewards="test_constant")
    assert out.advantages.tolist() == [7.0] * 6
    (grouped,) = constant_estimator
    assert grouped.rewards.shape == (2, 3) and grouped.group_std.shape == (2, 1)
    # centred on the group mean: group 0's mean is 1; group 1's is 2.5 over its two rewards
    torch.testing.assert_close(grouped.centered, torch.tensor([[0.0, -1.0, 1.0], [-0.5, float("nan"), 0.5]]), equal_nan=True)
    assert out.group_mean.tolist() == [1.0, 1.0, 1.0, 2.5, 2.5, 2.5]  # the shared statistics are unchanged


def test_a_registered_estimator_is_used_by_a_runs_advantages(
    constant_estimator, tiny_model_dir, say_a_or_b_file, fast_trainer, monkeypatch
):
    from test_module import make_data, make_module

    losses_saw = []
    original = algorithm.grpo_loss

    def recording(inputs, settings):
        losses_saw.append(inputs.advantages.clone())
        return original(inputs, settings)

    monkeypatch.setattr(algorithm, "grpo_loss", recording)
    module = make_module(tiny_model_dir, scale_rewards="test_constant")
    fast_trainer(max_steps=1).fit(module, make_data(say_a_or_b_file))

    assert constant_estimator and all(grouped.rewards.size(1) == 4 for grouped in constant_estimator)  # G = 4
    assert losses_saw and all((advantages == 7.0).all() for advantages in losses_saw)


def test_an_unknown_estimator_is_one_error_naming_the_key(tiny_model_dir):
    from test_module import make_module

    with pytest.raises(ValueError, match=r"scale_rewards must be one of \('group', 'batch', 'none'\), got 'rank'"):
        group_advantages(torch.zeros(4), 2, "rank")
    with pytest.raises(ConfigError, match=r"^model.scale_rewards must be one of \('group', 'batch', 'none'\), got 'rank'$"):
        make_module(tiny_model_dir, scale_rewards="rank")
