"""math_accuracy (Math-Verify) on inputs with hand-known answers."""

from __future__ import annotations

import threading

import pytest
from lit_grpo_rewards import math_accuracy
from lit_grpo_rewards.math_rewards import _timeout, parse_math_answer

from lit_grpo import plugins
from lit_grpo.scoring import build_reward

HALF_FORMS = ["1/2", "0.5", r"\frac{1}{2}", r"\boxed{\frac{1}{2}}", r"$\frac12$", "The answer is 1/2.", "<answer>.5</answer>"]


def chat(text):
    return [{"role": "assistant", "content": text}]


@pytest.mark.parametrize("gold", ["0.5", r"\frac12", r"\frac{1}{2}", r"\boxed{\frac{1}{2}}", "1/2"])
def test_equivalent_forms_of_one_half(gold):
    assert math_accuracy(completions=HALF_FORMS, answer=[gold] * len(HALF_FORMS)) == [1.0] * len(HALF_FORMS)


def test_wrong_or_missing_answers_score_zero():
    completions = ["0.6", "1/3", "one half", "", r"\boxed{2}", "<answer></answer>"]
    assert math_accuracy(completions=completions, answer=["0.5"] * len(completions)) == [0.0] * len(completions)


def test_unparseable_or_missing_gold_is_none():
    assert math_accuracy(completions=["1", "2", "3", "4"], answer=["no number here", "hello", "", None]) == [None] * 4


def test_gsm8k_gold_with_answer_pattern():
    gold = "Natalia sold 48/2 = 24 clips in May.\nNatalia sold 48+24 = 72 clips altogether.\n#### 72"
    completions = ["72", "<think>48+24</think><answer>72</answer>", "So she sold $72$ clips.", "71", "24"]
    assert math_accuracy(completions, answer=[gold] * 5, answer_pattern=r"####\s*(.+)$") == [1.0, 1.0, 1.0, 0.0, 0.0]
    # a gold the pattern does not match is not applicable
    assert math_accuracy(["72"], answer=["72 with no marker"], answer_pattern=r"####\s*(.+)$") == [None]


def test_only_the_last_answer_tag_is_checked():
    # Math-Verify alone picks 41 out of the thinking (and finds nothing inside a bare <answer> tag)
    completion = "<think>I guess 41</think><answer>42</answer>"
    assert math_accuracy([completion, "<answer>41</answer> no: <answer>42</answer>"], answer=["42", "42"]) == [1.0, 1.0]
    assert math_accuracy([completion], answer=["42"], answer_tag=None) == [0.0]
    assert math_accuracy(["<final>1/2</final>"], answer=["0.5"], answer_tag="final") == [1.0]


def test_bare_latex_is_parsed_as_latex():
    # parsed as plain text, "3\sqrt{2}" would be 3
    assert math_accuracy([r"<answer>3\sqrt{2}</answer>", "<answer>3</answer>", r"$3\sqrt{2}$"], answer=[r"3\sqrt{2}"] * 3) == [1.0, 0.0, 1.0]
    assert math_accuracy([r"<answer>3\sqrt{2}</answer>", "<answer>3</answer>"], answer=["3"] * 2) == [0.0, 1.0]
    assert math_accuracy([r"<answer>\dfrac{1}{2}</answer>"], answer=["0.5"]) == [1.0]


def test_open_r1_solution_column_and_conversational():
    solution = r"Halve it: $\frac{1}{2} \cdot 1$, so the answer is $\boxed{\frac{1}{2}}$."
    assert math_accuracy(completions=[chat(r"\boxed{0.5}"), chat("0.25")], solution=[solution] * 2) == [1.0, 0.0]
    with pytest.raises(TypeError, match="`answer` \\(or `solution`\\) dataset column"):
        math_accuracy(completions=["1"])


def test_gold_numbers_from_json():
    assert math_accuracy(["72", "0.5", "1/2"], answer=[72, 0.5, 0.5]) == [1.0, 1.0, 1.0]


def test_built_from_yaml_args():
    plugins.reset_plugins()
    reward = build_reward("math_accuracy", {"answer_pattern": r"####\s*(.+)$", "timeout_seconds": 2})
    out = reward(prompts=["q", "q"], completions=["72", "7"], completion_ids=[[1], [2]], answer=["#### 72"] * 2)
    assert out == [1.0, 0.0]


def test_timeout_is_disabled_outside_the_main_thread():
    assert _timeout(5) == 5 and _timeout(0.2) == 1 and _timeout(None) is None and _timeout(0) is None
    results = {}

    def work():
        results["timeout"] = _timeout(5)
        results["scores"] = math_accuracy(HALF_FORMS, answer=[r"\frac12"] * len(HALF_FORMS))

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert results == {"timeout": None, "scores": [1.0] * len(HALF_FORMS)}


def test_parse_math_answer_keeps_prose_as_text():
    assert parse_math_answer("hello") == []
    assert str(parse_math_answer(r"\frac12")[0]) == "1/2"
    assert str(parse_math_answer(r"18 \text{ cm}")[0]) == "18"
