"""answer_match: extraction modes and normalisation on hand-known inputs."""

from __future__ import annotations

import pytest
from lit_grpo_rewards import answer_match
from lit_grpo_rewards.answer import extract_answer, last_boxed

from lit_grpo import plugins
from lit_grpo.scoring import build_reward


def chat(text):
    return [{"role": "assistant", "content": text}]


def test_last_boxed_handles_nested_braces():
    assert last_boxed(r"\boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert last_boxed(r"first \boxed{1} then \boxed{ {a}{b{c}} } end") == " {a}{b{c}} "
    assert last_boxed(r"\boxed {7}") == "7"
    assert last_boxed(r"\boxed{2} and an unclosed \boxed{3") == "2"
    assert last_boxed("no box") is None
    assert last_boxed(r"\boxed{}") == ""


def test_extract_modes():
    text = r"<think>\boxed{1}</think><answer>Paris</answer> Final: London"
    assert extract_answer(text, "boxed") == "1"
    assert extract_answer(text, "answer_tag") == "Paris"
    assert extract_answer(text, "regex", r"Final:\s*(\w+)") == "London"
    assert extract_answer(text, "auto") == "1"  # boxed first
    assert extract_answer("<answer>a</answer><answer>b</answer>", "auto") == "b"
    assert extract_answer("  just this \n", "auto") == "just this"
    assert extract_answer("plain", "boxed") is None


def test_boxed_mode():
    completions = [r"so \boxed{\frac{1}{2}}", r"\boxed{1/2}", r"\frac{1}{2}", r"\boxed{x} then \boxed{\frac{1}{2}}"]
    assert answer_match(completions, answer=[r"\frac{1}{2}"] * 4, extract="boxed") == [1.0, 0.0, 0.0, 1.0]


def test_answer_tag_mode():
    completions = ["<think>B?</think><answer> b </answer>", "b", "<answer>a</answer><answer>B</answer>", "<ans>b</ans>"]
    assert answer_match(completions, answer=["B"] * 4, extract="answer_tag") == [1.0, 0.0, 1.0, 0.0]
    assert answer_match(["<ans>b</ans>"], answer=["B"], extract="answer_tag", answer_tag="ans") == [1.0]


def test_regex_mode_last_match_first_group():
    completions = ["Answer: A ... Answer: C", "answer: c", "The choice is C", "Answer:C"]
    scores = answer_match(completions, answer=["C"] * 4, extract="regex", pattern=r"Answer:\s*([A-D])")
    assert scores == [1.0, 0.0, 0.0, 1.0]  # the pattern itself is case-sensitive
    assert answer_match(["x = 42;"], answer=["42"], extract="regex", pattern=r"\d+") == [1.0]  # no group
    with pytest.raises(ValueError, match="needs a `pattern`"):
        answer_match(["x"], answer=["x"], extract="regex")
    with pytest.raises(ValueError, match="not a valid regular expression"):
        answer_match(["x"], answer=["x"], extract="regex", pattern="(")


def test_auto_mode():
    completions = [r"\boxed{\text{Paris}}", "<answer>Paris</answer>", "  Paris \n", r"<answer>Rome</answer> \boxed{Paris}", "Paris, France"]
    assert answer_match(completions, answer=["Paris"] * 5) == [0.0, 1.0, 1.0, 1.0, 0.0]
    assert answer_match([r"\boxed{\text{Paris}}"], answer=[r"\text{Paris}"]) == [1.0]


def test_case_and_whitespace_normalisation():
    completions = ["New  York\nCity", "new york city", "NEW YORK CITY"]
    assert answer_match(completions, answer=["New York City"] * 3) == [1.0, 1.0, 1.0]
    assert answer_match(completions, answer=["New York City"] * 3, case_sensitive=True) == [1.0, 0.0, 0.0]
    assert answer_match(completions, answer=["New York City"] * 3, normalize_whitespace=False) == [0.0, 1.0, 1.0]
    assert answer_match(["Straße"], answer=["STRASSE"]) == [1.0]  # casefold


def test_none_answers_aliases_and_numbers():
    assert answer_match(["a", "a", "42", "NYC", "x"], answer=[None, [None], 42, ["New York", "nyc"], []]) == [None, None, 1.0, 1.0, None]


def test_answer_pattern_and_conversational():
    assert answer_match([chat("<answer>72</answer>"), chat("71")], answer=["...\n#### 72"] * 2, answer_pattern=r"####\s*(.+)$") == [1.0, 0.0]


def test_bad_extract_mode():
    with pytest.raises(ValueError, match="extract must be one of auto, boxed, answer_tag, regex"):
        answer_match(["a"], answer=["a"], extract="last_line")


def test_built_from_yaml_args():
    plugins.reset_plugins()
    reward = build_reward("answer_match", {"extract": "boxed", "case_sensitive": True})
    out = reward(prompts=["q"] * 2, completions=[r"\boxed{A}", r"\boxed{a}"], completion_ids=[[1], [2]], answer=["A", "A"])
    assert out == [1.0, 0.0]
