"""soft_overlong_punishment (DAPO) and cosine_scaled_accuracy (Yeo et al. 2025) with hand values."""

from __future__ import annotations

import math

import pytest
from lit_grpo_rewards import cosine_scaled_accuracy, soft_overlong_punishment

from lit_grpo import plugins
from lit_grpo.scoring import build_reward


def ids(n):
    return list(range(n))


def test_soft_overlong_punishment_hand_values():
    # L_max = 10, L_cache = 4: free up to 6 tokens, then -1/4 per token, -1 beyond 10
    lengths = [0, 5, 6, 7, 8, 9, 10, 11, 100]
    scores = soft_overlong_punishment(completion_ids=[ids(n) for n in lengths], max_completion_len=10, soft_punish_cache=4)
    assert scores == [0.0, 0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0, -1.0]


def test_soft_overlong_punishment_zero_cache_is_a_hard_limit():
    assert soft_overlong_punishment(completion_ids=[ids(10), ids(11)], max_completion_len=10, soft_punish_cache=0) == [0.0, -1.0]


@pytest.mark.parametrize(
    "args, message",
    [
        ({}, "needs args `max_completion_len` and `soft_punish_cache`"),
        ({"max_completion_len": 10, "soft_punish_cache": 11}, r"soft_punish_cache \(11\) must not exceed max_completion_len \(10\)"),
        ({"max_completion_len": 0, "soft_punish_cache": 0}, "max_completion_len must be an integer >= 1"),
        ({"max_completion_len": 10, "soft_punish_cache": -1}, "soft_punish_cache must be an integer >= 0"),
        ({"max_completion_len": 10.5, "soft_punish_cache": 1}, "max_completion_len must be an integer"),
    ],
)
def test_soft_overlong_punishment_bad_args(args, message):
    with pytest.raises(ValueError, match=message):
        soft_overlong_punishment(completion_ids=[ids(3)], **args)


def test_soft_overlong_punishment_from_yaml_args():
    plugins.reset_plugins()
    reward = build_reward("soft_overlong_punishment", {"max_completion_len": 8, "soft_punish_cache": 2})
    out = reward(prompts=["p"] * 3, completions=["a"] * 3, completion_ids=[ids(6), ids(7), ids(8)])
    assert out == [0.0, -0.5, -1.0]


ANSWER = "<answer>1/2</answer>"  # 20 characters


def test_cosine_scaled_accuracy_hand_values_chars():
    n = len(ANSWER)
    assert n == 20
    right, wrong = [0.5], [0.25]
    # correct: 1.0 at length 0 ... 0.75 at max_len / 2 ... 0.5 at max_len (and beyond)
    assert cosine_scaled_accuracy([ANSWER], answer=right, max_len=20) == [pytest.approx(0.5)]
    assert cosine_scaled_accuracy([ANSWER], answer=right, max_len=40) == [pytest.approx(0.75)]
    assert cosine_scaled_accuracy([ANSWER], answer=right, max_len=10) == [pytest.approx(0.5)]  # clamped
    assert cosine_scaled_accuracy([ANSWER], answer=right, max_len=60) == [pytest.approx(0.5 + 0.25 * (1 + math.cos(math.pi / 3)))]
    # wrong: -1.0 at length 0 ... -0.75 at max_len / 2 ... -0.5 at max_len
    assert cosine_scaled_accuracy([ANSWER], answer=wrong, max_len=20) == [pytest.approx(-0.5)]
    assert cosine_scaled_accuracy([ANSWER], answer=wrong, max_len=40) == [pytest.approx(-0.75)]
    assert cosine_scaled_accuracy([ANSWER], answer=wrong, max_len=10**9) == [pytest.approx(-1.0)]


def test_cosine_scaled_accuracy_token_lengths_and_custom_range():
    completions = [ANSWER] * 4
    completion_ids = [ids(0), ids(50), ids(100), ids(0)]
    out = cosine_scaled_accuracy(
        completions, completion_ids=completion_ids, answer=["0.5", "0.5", "0.5", "3"], max_len=100, length_unit="tokens"
    )
    assert out == [pytest.approx(1.0), pytest.approx(0.75), pytest.approx(0.5), pytest.approx(-1.0)]
    out = cosine_scaled_accuracy(
        [ANSWER, ANSWER], completion_ids=[ids(0), ids(0)], answer=["0.5", "3"], length_unit="tokens",
        min_value_correct=0.0, max_value_correct=2.0, min_value_wrong=-3.0, max_value_wrong=0.0,
    )
    assert out == [pytest.approx(2.0), pytest.approx(-3.0)]


def test_cosine_scaled_accuracy_none_and_errors():
    assert cosine_scaled_accuracy(["1", "1"], answer=["not math", None]) == [None, None]
    with pytest.raises(ValueError, match="length_unit must be 'chars' or 'tokens'"):
        cosine_scaled_accuracy(["1"], answer=["1"], length_unit="words")
    with pytest.raises(ValueError, match="max_len must be an integer >= 1"):
        cosine_scaled_accuracy(["1"], answer=["1"], max_len=0)
    with pytest.raises(ValueError, match="length_unit='tokens' needs `completion_ids`"):
        cosine_scaled_accuracy(["1"], answer=["1"], length_unit="tokens")


def test_cosine_scaled_accuracy_from_yaml_args_gsm8k():
    plugins.reset_plugins()
    reward = build_reward("cosine_scaled_accuracy", {"max_len": 4, "answer_pattern": r"####\s*(.+)$"})
    out = reward(prompts=["q"] * 2, completions=["72", "7"], completion_ids=[[1], [2]], answer=["#### 72"] * 2)
    assert out == [pytest.approx(0.75), pytest.approx(-1.0 + 0.25 * (1 - math.cos(math.pi / 4)))]
