"""RewardScorer: resolving configured rewards, the [N, K] matrix, return-value validation and on_error."""

from __future__ import annotations

import inspect
import logging
import math
import types

import numpy as np
import pytest
import torch

import lit_grpo
from lit_grpo import plugins
from lit_grpo.errors import DataError
from lit_grpo.plugins import RewardArgumentError, UnknownRewardError
from lit_grpo.scoring import RewardError, RewardScorer, RewardSpec
from lit_grpo.scoring.failures import SUMMARY_EVERY

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


def picky(completions, **kwargs):
    """Fails the whole batch when any completion contains 'bad' (as a vectorised reward would)."""
    for c in completions:
        if "bad" in c:
            raise ValueError(f"cannot parse {c!r}")
    return [float(len(c)) for c in completions]


def deep(completions, depth=7, **kwargs):
    if depth == 0:
        raise KeyError("bottom")
    return deep(completions, depth - 1)


def batch_only(completions, **kwargs):
    if len(completions) > 1:
        raise RuntimeError(f"{len(completions)} at once")
    return [1.0]


def graded(completions, answer, level=1, **kwargs):
    """Takes the column ``answer``; ``level`` is optional."""
    return [float(c == a) for c, a in zip(completions, answer)]


def above(completions, threshold, **kwargs):
    return [float(len(c) > threshold) for c in completions]


def nan_for_bad(completions, **kwargs):
    if len(completions) > 1:
        raise RuntimeError("batch failed")
    return [float("nan") if "bad" in c else 1.0 for c in completions]


@pytest.fixture(autouse=True)
def registry(monkeypatch):
    monkeypatch.delenv("LIT_GRPO_PLUGINS", raising=False)
    monkeypatch.delenv("LIT_GRPO_STRICT_PLUGINS", raising=False)
    plugins.reset_plugins()
    module = types.ModuleType(PLUGIN)
    rewards = {
        f.__name__: f
        for f in (length, none_for_odd, recorder, scaled, divides, short, scalar, with_nan, with_string,
                  with_inf, as_tensor, as_matrix, as_ndarray, as_mixed, picky, nan_for_bad, deep, batch_only,
                  graded, above)
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


def line_of(function, text: str) -> int:
    """The line number of ``text`` in ``function``'s source."""
    lines, first = inspect.getsourcelines(function)
    return first + next(i for i, line in enumerate(lines) if text in line)


def test_reward_that_raises_names_the_failing_sample_its_own_frames_and_on_error():
    long_prompt = "Q" * 1000
    with pytest.raises(RewardError) as excinfo:
        score(["length", "picky"], ["first answer", "a bad one"], prompts=["other", long_prompt])
    lines = str(excinfo.value).splitlines()
    assert lines[0] == f"Reward 'picky' ({PLUGIN}) raised ValueError: cannot parse 'a bad one'"
    assert lines[1] == "  while scoring sample 1 of 2 (found by calling the reward again with each sample alone)"
    assert lines[2].startswith("  prompt:     'QQQ") and lines[2].endswith("...") and len(lines[2]) < 230  # ~200 chars
    assert lines[3] == "  completion: 'a bad one'"
    assert lines[4:-1] == [  # the reward's frames, none of lit-grpo's
        "  Traceback (most recent call last):",
        f'    File "{__file__}", line {line_of(picky, "raise ValueError")}, in picky',
        '      raise ValueError(f"cannot parse {c!r}")',
        "  ValueError: cannot parse 'a bad one'",
    ]
    assert lines[-1] == (
        "To keep training, set model.rewards[1].on_error: none (or zero): the samples it fails on then score None "
        "(or 0.0), each failure is logged, and they are counted in rewards/<name>/errors."
    )
    assert "other" not in str(excinfo.value) and "first answer" not in str(excinfo.value)
    assert isinstance(excinfo.value.__cause__, ValueError) and str(excinfo.value.__cause__) == "cannot parse 'a bad one'"


def test_a_failure_deep_in_the_reward_shows_its_last_frames():
    with pytest.raises(RewardError) as excinfo:
        score(["deep"], ["abc"])
    lines = str(excinfo.value).splitlines()
    traceback = lines[lines.index("  Traceback (most recent call last):") : -1]
    assert traceback[1] == "    ... 3 earlier frames of the reward"
    assert traceback[2:] == [
        f'    File "{__file__}", line {line_of(deep, "return deep(")}, in deep',
        "      return deep(completions, depth - 1)",
    ] * 4 + [
        f'    File "{__file__}", line {line_of(deep, "raise KeyError")}, in deep',
        '      raise KeyError("bottom")',
        "  KeyError: 'bottom'",
    ]


def test_a_reward_that_fails_only_on_the_whole_batch_says_so():
    with pytest.raises(RewardError) as excinfo:
        score(["batch_only"], ["a", "b", "c"])
    lines = str(excinfo.value).splitlines()
    assert lines[:2] == [
        f"Reward 'batch_only' ({PLUGIN}) raised RuntimeError: 3 at once",
        "  while scoring 3 completions in one call; called again with each sample alone, it failed on none",
    ]
    assert f"line {line_of(batch_only, 'raise RuntimeError')}, in batch_only" in lines[3]
    assert lines[-1].startswith("To keep training, set model.rewards[0].on_error: none (or zero)")
    assert isinstance(excinfo.value.__cause__, RuntimeError)


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
    with pytest.raises(ValueError, match=r"model\.rewards\[1\] must look like \{name: \.\.\., weight: 1\.0, args: \{\.\.\.\}\}") as excinfo:
        RewardScorer([{"name": "length"}, {"name": "scaled", "wieght": 2}])
    message = str(excinfo.value)
    assert "(optional: on_error: raise|none|zero, num_workers: 0, timeout: null)" in message
    assert "(unknown key 'wieght')" in message
    with pytest.raises(ValueError, match=r"model\.rewards\[0\] must look like .*\(no 'name'\)"):
        RewardScorer([{"weight": 2}])


def test_dict_spec_accepts_on_error_num_workers_and_timeout():
    scorer = RewardScorer([{"name": "length", "on_error": "zero"}, {"name": "scaled", "num_workers": 0, "timeout": None}])
    assert [(s.on_error, s.num_workers, s.timeout) for s in scorer.specs] == [("zero", 0, None), ("raise", 0, None)]
    assert scorer.modes == ["local", "local"]


@pytest.mark.parametrize("value", ["ignore", "Raise", None, 0])
def test_bad_on_error_names_the_key(value):
    with pytest.raises(ValueError, match=r"^model\.rewards\[1\]\.on_error \('scaled'\) must be one of raise, none, zero, got"):
        RewardScorer([RewardSpec("length"), RewardSpec("scaled", on_error=value)])


@pytest.mark.parametrize("value", [-1, 1.5, True, "4"])
def test_bad_num_workers_names_the_key(value):
    with pytest.raises(ValueError, match=r"^model\.rewards\[0\]\.num_workers \('length'\) must be a whole number >= 0"):
        RewardScorer([RewardSpec("length", num_workers=value)])


@pytest.mark.parametrize("value", [0, -1.0, float("inf"), float("nan"), "10", True])
def test_bad_timeout_names_the_key(value):
    with pytest.raises(ValueError, match=r"^model\.rewards\[0\]\.timeout \('length'\) must be a number of seconds > 0"):
        RewardScorer([RewardSpec("length", timeout=value)])


def test_timeout_on_an_in_process_reward_is_an_error():
    with pytest.raises(ValueError, match=r"model\.rewards\[0\]\.timeout \('length'\): a timeout needs num_workers > 0"):
        RewardScorer([RewardSpec("length", timeout=5)])


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


# --------------------------------------------------------------------------------------------------
# on_error for in-process rewards
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("on_error, fill", [("zero", 0.0), ("none", None)])
def test_in_process_failure_scores_only_the_failing_sample(on_error, fill, caplog):
    scorer = RewardScorer([RewardSpec("length"), RewardSpec("picky", on_error=on_error)])
    assert scorer.last_error_counts == {"length": 0, "picky": 0}
    prompts, completions = ["p0", "p1", "p2"], ["ab", "a bad one", "abcd"]
    with caplog.at_level(logging.WARNING, logger="lit_grpo.scoring"):
        out = scorer(prompts, completions, [[], [], []], {})
    values = [None if math.isnan(v) else v for v in out[:, 1].tolist()]
    assert values == [2.0, fill, 4.0]
    assert out[:, 0].tolist() == [2.0, 9.0, 4.0]
    assert scorer.last_error_counts == {"length": 0, "picky": 1}
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert record.message.startswith(f"Reward 'picky' ({PLUGIN}) failed on 1 of 3 samples (1 ValueError)")
    assert "sample 1: ValueError: cannot parse 'a bad one'" in record.message
    assert "completion: 'a bad one'" in record.message
    assert "Traceback (most recent call last):" in record.message and "in picky" in record.message

    assert "Further failures of this reward are counted in rewards/picky/errors" in record.message

    # Counts are per call; an error type is reported in full once per reward, then summed up in one
    # line every SUMMARY_EVERY calls that failed (issue 51.9: not three lines every step)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lit_grpo.scoring"):
        scorer(prompts, ["bad", "bad", "ok"], [[], [], []], {})
        assert scorer.last_error_counts == {"length": 0, "picky": 2}
        assert caplog.records == []
        scorer(prompts, ["a", "b", "c"], [[], [], []], {})
        assert scorer.last_error_counts == {"length": 0, "picky": 0}
        for _ in range(SUMMARY_EVERY - 1):
            scorer(prompts, ["bad", "ok", "ok"], [[], [], []], {})
    (record,) = caplog.records
    assert record.message == (
        f"Reward 'picky' ({PLUGIN}) failed on {2 + SUMMARY_EVERY - 1} of {3 * SUMMARY_EVERY} samples in the last "
        f"{SUMMARY_EVERY} calls that failed ({2 + SUMMARY_EVERY - 1} ValueError); they score {fill if fill is not None else 'None (NaN)'} "
        f"(on_error: {on_error}), counted in rewards/picky/errors"
    )


def test_invalid_values_are_errors_whatever_on_error():
    with pytest.raises(RewardError, match=r"'with_nan' .* returned NaN for sample 1"):
        RewardScorer([RewardSpec("with_nan", on_error="zero")])(["p"] * 3, ["a", "b", "c"], [[]] * 3, {})
    # Also when found by the per-sample retry after a failed batch call; the sample is named.
    with pytest.raises(RewardError, match=r"'nan_for_bad' .* returned NaN for sample 2;"):
        RewardScorer([RewardSpec("nan_for_bad", on_error="none")])(["p"] * 3, ["a", "b", "bad"], [[]] * 3, {})


def test_on_error_raise_is_the_default_and_counts_nothing():
    scorer = RewardScorer([RewardSpec("picky")])
    assert scorer.specs[0].on_error == "raise"
    with pytest.raises(RewardError, match=r"^Reward 'picky' .* raised ValueError: cannot parse 'bad'\n  while scoring sample 1 of 2"):
        scorer(["p", "p"], ["ok", "bad"], [[], []], {})


def test_zero_completions_counts_no_errors():
    scorer = RewardScorer([RewardSpec("picky", on_error="zero")])
    scorer([], [], [], {})
    assert scorer.last_error_counts == {"picky": 0}


def test_scorer_pickles_and_deep_copies():
    import copy
    import pickle

    scorer = RewardScorer([RewardSpec("shouts"), RewardSpec("contains_word", args={"word": "OK"}, on_error="none")])
    for clone in (pickle.loads(pickle.dumps(scorer)), copy.deepcopy(scorer)):
        assert clone.specs == scorer.specs and clone.modes == ["local", "local"]
        assert clone(["p"], ["OK"], [[]], {}).tolist() == [[1.0, 1.0]]
        clone.close()


# --------------------------------------------------------------------------------------------------
# The columns rewards and environments take, checked before the run
# --------------------------------------------------------------------------------------------------


def test_columns_a_reward_takes_are_checked_against_the_data():
    # graded takes answer (level has a default); length takes what there is (**kwargs); recorder only
    # the arguments every reward gets; above's threshold is bound by its args
    scorer = RewardScorer(["graded", "length", "recorder", {"name": "above", "args": {"threshold": 2}}])
    scorer.check_columns(["answer"], "dataset path='json' (split='train')")
    with pytest.raises(DataError) as error:
        scorer.check_columns(["answr", "level"], "dataset path='json' (split='train')")
    assert str(error.value) == (
        f"Reward 'graded' ({PLUGIN}) takes 'answer', a parameter without a default, but the dataset path='json' "
        "(split='train') has no column 'answer' (did you mean 'answr'?); the columns it passes on to rewards and "
        "environments: answr, level (model.rewards[0])"
    )
    with pytest.raises(DataError, match=r"^Reward 'above' .* takes 'threshold', .* no column 'threshold'; .*: none \(model.rewards\[0\]\)$"):
        RewardScorer(["above"]).check_columns([], "dataset path='json' (split='train')")


class Shop:
    """An environment built from the sample's ``store`` and ``budget`` columns (or args)."""

    def __init__(self, store, budget):
        self.store, self.budget = store, budget


def test_each_split_is_checked_with_its_rewards_and_the_environments(write_jsonl):
    from lit_grpo.data import GRPODataModule
    from lit_grpo.rollout.tools.environments import Environments
    from lit_grpo.scoring import check_data_columns

    train = write_jsonl([{"prompt": "p", "answer": "a", "store": "s"}] * 2, "train.jsonl")
    val = write_jsonl([{"prompt": "p", "store": "s", "budget": 3}] * 2, "val.jsonl")
    data = GRPODataModule("json", data_files=str(train), val_split="train", val_data_files=str(val), batch_size=1)
    data.setup("fit")
    scorer = RewardScorer(["graded"])
    with pytest.raises(DataError, match=rf"^Reward 'graded' .* the dataset path='json' \(data_files='{val}', split='train'\) "
                                        r"has no column 'answer'; the columns it passes on .*: store, budget \(model.rewards\[0\]\)$"):
        check_data_columns(data, scorer, scorer, None)
    eval_scorer = RewardScorer(["length"], key="model.eval_rewards")
    check_data_columns(data, scorer, eval_scorer, None)

    shop = Environments([{"name": "shop"}], get_environment=lambda name: Shop, shared_tools=[])
    with pytest.raises(DataError) as error:
        check_data_columns(data, scorer, eval_scorer, shop)
    assert str(error.value) == (
        f"environment 'shop' takes 'budget', a parameter without a default, but the dataset path='json' "
        f"(data_files='{train}', split='train') has no column 'budget'; the columns it passes on to rewards and "
        "environments: answer, store (model.environment)"
    )
    shop = Environments([{"name": "shop", "args": {"budget": 5}}], get_environment=lambda name: Shop, shared_tools=[])
    check_data_columns(data, scorer, eval_scorer, shop)
