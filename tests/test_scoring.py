"""RewardScorer: resolving configured rewards, the [N, K] matrix and return-value validation."""

from __future__ import annotations

import math
import sys
import types

import numpy as np
import pytest
import torch

import lit_grpo
from lit_grpo import plugins
from lit_grpo.plugins import RewardArgumentError, UnknownRewardError
from lit_grpo.scoring import RewardError, RewardScorer, RewardSpec

PLUGIN = "scoring_test_rewards"
CALLS: list[dict] = []


# Tiny rewards, registered directly (no entry point) as package "scoring_test_rewards".


def length(completions, **kwargs):
    """Number of characters."""
    return [float(len(c)) for c in completions]


def none_for_odd(completions, **kwargs):
    return [None if i % 2 else 1.0 for i in range(len(completions))]


def recorder(*, prompts, completions, completion_ids, **columns):  # keyword-only on purpose
    CALLS.append(dict(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns))
    return [0.0] * len(completions)


def scaled(completions, scale=1.0, **kwargs):
    return [scale * len(c) for c in completions]


def divides(completions, **kwargs):
    return [1 / 0 for _ in completions]


def short(completions, **kwargs):
    return [0.0] * (len(completions) - 1)


def scalar(completions, **kwargs):
    return 0.5


def with_nan(completions, **kwargs):
    return [0.0, float("nan")] + [0.0] * (len(completions) - 2)


def with_string(completions, **kwargs):
    return [0.0, 1.0, "0.5"][: len(completions)]


def with_inf(completions, **kwargs):
    return [0.0, 0.0, -math.inf][: len(completions)]


def as_tensor(completions, **kwargs):
    return torch.arange(len(completions), dtype=torch.float64)


def as_matrix(completions, **kwargs):
    return torch.zeros(len(completions), 1)


def as_ndarray(completions, **kwargs):
    return np.array([0.25] * len(completions), dtype=np.float32)


def as_mixed(completions, **kwargs):
    return (True, False, np.float64(0.5), torch.tensor(2.0), 3)[: len(completions)]


@pytest.fixture(autouse=True)
def registry(monkeypatch):
    monkeypatch.delenv("LIT_GRPO_PLUGINS", raising=False)
    monkeypatch.delenv("LIT_GRPO_STRICT_PLUGINS", raising=False)
    plugins.reset_plugins()
    module = types.ModuleType(PLUGIN)
    rewards = {
        f.__name__: f
        for f in (length, none_for_odd, recorder, scaled, divides, short, scalar, with_nan, with_string,
                  with_inf, as_tensor, as_matrix, as_ndarray, as_mixed)
    }

    @lit_grpo.hookimpl
    def register_rewards(register):
        for name, fn in rewards.items():
            register(fn, name=name)

    module.register_rewards = register_rewards
    plugins.register_plugin(module)
    CALLS.clear()
    yield
    plugins.reset_plugins()


def score(names, completions, columns=None, prompts=None):
    scorer = RewardScorer([RewardSpec(n) for n in names])
    n = len(completions)
    prompts = prompts if prompts is not None else [f"p{i}" for i in range(n)]
    return scorer(prompts, completions, [[i] for i in range(n)], columns or {})


# --------------------------------------------------------------------------------------------------


def test_matrix_columns_follow_specs_and_none_becomes_nan():
    scorer = RewardScorer([RewardSpec("length", weight=2.0), RewardSpec("none_for_odd", weight=0.5)])
    assert scorer.names == ["length", "none_for_odd"]
    assert scorer.weights.dtype == torch.float32
    assert scorer.weights.tolist() == [2.0, 0.5]
    out = scorer(["p"] * 3, ["a", "bbb", ""], [[1], [2, 2, 2], []], {})
    assert out.shape == (3, 2) and out.dtype == torch.float32
    expected = torch.tensor([[1.0, 1.0], [3.0, float("nan")], [0.0, 1.0]])
    assert torch.equal(out.isnan(), expected.isnan())
    assert torch.equal(out.nan_to_num(-1.0), expected.nan_to_num(-1.0))


def test_reward_is_called_with_keyword_arguments_and_columns():
    prompts = [[{"role": "user", "content": "hi"}]] * 2
    completions = [[{"role": "assistant", "content": "a"}], [{"role": "assistant", "content": "b"}]]
    scorer = RewardScorer([RewardSpec("recorder")])
    scorer(prompts, completions, [[5], [6, 7]], {"answer": ["x", None], "level": [1, 2]})
    (call,) = CALLS
    assert call == {
        "prompts": prompts,
        "completions": completions,
        "completion_ids": [[5], [6, 7]],
        "answer": ["x", None],
        "level": [1, 2],
    }


def test_args_are_bound_and_specs_may_be_dicts():
    scorer = RewardScorer([{"name": "scaled", "weight": 3, "args": {"scale": 0.5}}, "length"])
    assert scorer.names == ["scaled", "length"]
    assert scorer.weights.tolist() == [3.0, 1.0]
    assert scorer(["p", "p"], ["ab", "abcd"], [[], []], {}).tolist() == [[1.0, 2.0], [2.0, 4.0]]


def test_tensor_ndarray_tuple_bool_and_numpy_values_are_accepted():
    out = score(["as_tensor", "as_ndarray", "as_mixed"], ["a", "b", "c", "d", "e"])
    assert out[:, 0].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert out[:, 1].tolist() == [0.25] * 5
    assert out[:, 2].tolist() == [1.0, 0.0, 0.5, 2.0, 3.0]  # True/False count as 1.0/0.0


def test_zero_completions_returns_empty_matrix_without_calling():
    scorer = RewardScorer([RewardSpec("recorder"), RewardSpec("length")])
    out = scorer([], [], [], {})
    assert out.shape == (0, 2)
    assert CALLS == []


# --------------------------------------------------------------------------------------------------
# Validation of what rewards return
# --------------------------------------------------------------------------------------------------


def test_reward_that_raises_names_reward_shows_first_sample_and_chains():
    long_prompt = "Q" * 1000
    with pytest.raises(RewardError) as excinfo:
        score(["length", "divides"], ["first answer", "second"], prompts=[long_prompt, "other"])
    message = str(excinfo.value)
    assert message.startswith(f"Reward 'divides' ({PLUGIN}) raised ZeroDivisionError: division by zero")
    assert "while scoring 2 completions" in message
    assert "completion: 'first answer'" in message
    prompt_line = next(line for line in message.splitlines() if "prompt:" in line)
    assert prompt_line.strip().startswith("prompt:     'QQQ")
    assert prompt_line.endswith("...") and len(prompt_line) < 230  # truncated to ~200 chars
    assert "other" not in message and "second" not in message
    assert isinstance(excinfo.value.__cause__, ZeroDivisionError)


def test_missing_column_is_reported_as_reward_error():
    def needs_answer(completions, answer, **kwargs):
        return [0.0] * len(completions)

    module = types.ModuleType("needs_answer_mod")

    @lit_grpo.hookimpl
    def register_rewards(register):
        register(needs_answer)

    module.register_rewards = register_rewards
    plugins.register_plugin(module)
    with pytest.raises(RewardError, match=r"Reward 'needs_answer' \(needs_answer_mod\) raised TypeError: .*'answer'") as excinfo:
        score(["needs_answer"], ["x"])
    assert isinstance(excinfo.value.__cause__, TypeError)


def test_wrong_length_says_expected_and_got():
    with pytest.raises(RewardError, match=rf"^Reward 'short' \({PLUGIN}\) returned 2 values; expected 3 \(one per completion\)$"):
        score(["short"], ["a", "b", "c"])


def test_non_sequence_return_is_an_error():
    with pytest.raises(RewardError, match=r"Reward 'scalar' .* returned float \(0\.5\); expected a list of 2 floats or None"):
        score(["scalar"], ["a", "b"])


def test_two_dimensional_tensor_is_an_error():
    with pytest.raises(RewardError, match=r"returned a Tensor of shape \(2, 1\); expected a 1-D sequence of 2 values"):
        score(["as_matrix"], ["a", "b"])


def test_nan_is_an_error_suggesting_none():
    with pytest.raises(RewardError) as excinfo:
        score(["with_nan"], ["a", "b", "c"])
    assert str(excinfo.value) == (
        f"Reward 'with_nan' ({PLUGIN}) returned NaN for sample 1; "
        "return None to mark a sample as not applicable"
    )


def test_string_value_names_sample_and_value():
    with pytest.raises(RewardError) as excinfo:
        score(["with_string"], ["a", "b", "third completion"])
    message = str(excinfo.value)
    assert f"Reward 'with_string' ({PLUGIN}) returned str '0.5' for sample 2" in message
    assert "'third completion'" in message
    assert "numbers (float, int, bool) or None" in message


def test_infinity_is_an_error():
    with pytest.raises(RewardError, match=r"'with_inf' .* returned -inf for sample 2 .*must be finite"):
        score(["with_inf"], ["a", "b", "c"])


# --------------------------------------------------------------------------------------------------
# Configuration errors, raised when the scorer is built
# --------------------------------------------------------------------------------------------------


def test_empty_reward_list_is_an_error():
    with pytest.raises(ValueError, match=r"model\.rewards is empty.*lit-grpo rewards"):
        RewardScorer([])


def test_reward_configured_twice_says_which():
    with pytest.raises(ValueError, match=r"reward 'length' is configured twice in model\.rewards \(entries 0 and 2\)"):
        RewardScorer([RewardSpec("length"), RewardSpec("scaled"), RewardSpec("length", weight=2.0)])


def test_unknown_name_fails_at_construction():
    with pytest.raises(UnknownRewardError, match=r"Unknown reward 'lenght'\. Did you mean 'length'\?.*length \(scoring_test_rewards\)"):
        RewardScorer([RewardSpec("length"), RewardSpec("lenght")])


def test_bad_args_fail_at_construction():
    with pytest.raises(RewardArgumentError, match="args may not set 'prompts'"):
        RewardScorer([RewardSpec("scaled", args={"prompts": []})])


@pytest.mark.parametrize("weight", [float("nan"), float("inf"), "1.0", True])
def test_bad_weight_is_an_error(weight):
    with pytest.raises(ValueError, match=r"model\.rewards\[0\] \('length'\): weight must be a finite number"):
        RewardScorer([RewardSpec("length", weight=weight)])


def test_malformed_dict_spec_is_an_error():
    with pytest.raises(ValueError, match=r"model\.rewards\[1\] must look like \{name: \.\.\., weight: 1\.0, args: \{\.\.\.\}\}"):
        RewardScorer([{"name": "length"}, {"name": "scaled", "wieght": 2}])


def test_input_length_mismatches_are_errors():
    scorer = RewardScorer([RewardSpec("length")])
    with pytest.raises(ValueError, match="got 1 prompts, 2 completions, 2 completion_ids"):
        scorer(["p"], ["a", "b"], [[], []], {})
    with pytest.raises(ValueError, match="column 'answer' has 1 values for 2 completions"):
        scorer(["p", "p"], ["a", "b"], [[], []], {"answer": ["x"]})
    with pytest.raises(ValueError, match="dataset column 'completions' clashes"):
        scorer(["p", "p"], ["a", "b"], [[], []], {"completions": ["x", "y"]})


def test_installed_plugin_rewards_work_through_the_scorer():
    scorer = RewardScorer([RewardSpec("shouts"), RewardSpec("contains_word", weight=0.5, args={"word": "OK"})])
    out = scorer(["p", "p", "p"], ["OK GO", "ok", "nope OK"], [[], [], []], {})
    assert out.tolist() == [[1.0, 1.0], [0.0, 0.0], [0.0, 1.0]]
