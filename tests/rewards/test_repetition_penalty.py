"""repetition_penalty (open-r1) with hand values."""

from __future__ import annotations

import pytest
from lit_grpo_rewards import repetition_penalty

from lit_grpo import plugins
from lit_grpo.scoring import build_reward


def test_hand_values():
    # bigrams of "a b a b a b": ab ba ab ba ab -> 5 total, 2 unique -> (1 - 2/5) * -1 = -0.6
    assert repetition_penalty(["a b a b a b"], ngram_size=2) == [pytest.approx(-0.6)]
    # trigrams of "a b c a b c": abc bca cab abc -> 4 total, 3 unique -> -0.25
    assert repetition_penalty(["a b c a b c"]) == [pytest.approx(-0.25)]
    assert repetition_penalty(["a b c a b c"], max_penalty=-0.5) == [pytest.approx(-0.125)]
    assert repetition_penalty(["the quick brown fox jumps"]) == [0.0]


def test_lowercase_whitespace_words_and_short_completions():
    assert repetition_penalty(["The the\nTHE\tthe"], ngram_size=1) == [pytest.approx(-0.75)]  # 4 words, 1 unique
    assert repetition_penalty(["", "one two", "one two one"], ngram_size=3) == [0.0, 0.0, 0.0]
    assert repetition_penalty([[{"role": "assistant", "content": "x y x y"}]], ngram_size=2) == [pytest.approx(-1 / 3)]


def test_zero_penalty_and_no_negative_zero():
    out = repetition_penalty(["a a a a", "a b c d"], ngram_size=1, max_penalty=0.0)
    assert out == [0.0, 0.0]
    assert str(repetition_penalty(["a b c d"], ngram_size=1)[0]) == "0.0"


@pytest.mark.parametrize(
    "args, message",
    [({"max_penalty": 0.5}, "max_penalty must be a number <= 0; got 0.5"), ({"ngram_size": 0}, "ngram_size must be an integer >= 1")],
)
def test_bad_args(args, message):
    with pytest.raises(ValueError, match=message):
        repetition_penalty(["a b c"], **args)
    plugins.reset_plugins()
    reward = build_reward("repetition_penalty", args)
    with pytest.raises(ValueError, match=message):
        reward(prompts=["p"], completions=["a b c"], completion_ids=[[1]])
