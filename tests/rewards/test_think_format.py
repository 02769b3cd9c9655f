"""think_format: order, repeated tags, custom tags and the strict (open-r1) layout."""

from __future__ import annotations

import pytest
from lit_grpo_rewards import think_format


def test_think_must_come_before_answer():
    assert think_format(["<think>a</think><answer>b</answer>", "<answer>b</answer><think>a</think>"]) == [1.0, 0.0]


def test_each_tag_exactly_once():
    completions = [
        "<think>a</think><answer>b</answer><answer>c</answer>",  # a second answer block
        "<think>a</think><think>b</think><answer>c</answer>",  # a second think block
        "<think>a <think>b</think><answer>c</answer>",  # an unclosed nested think
        "<think>a</think><answer>b <answer> c</answer>",
        "<think></think><answer></answer>",  # empty blocks are still the format
    ]
    assert think_format(completions) == [0.0, 0.0, 0.0, 0.0, 1.0]


def test_custom_tags_keep_the_order():
    kwargs = dict(think_tag="reasoning", answer_tag="solution")
    assert think_format(["<reasoning>r</reasoning>\n<solution>s</solution>", "<solution>s</solution><reasoning>r</reasoning>"], **kwargs) == [1.0, 0.0]
    with pytest.raises(ValueError, match="two different non-empty names"):
        think_format(["x"], think_tag="t", answer_tag="t")


def test_strict_layout_as_open_r1():
    completions = [
        "<think>\nreasoning\n</think>\n<answer>\n42\n</answer>",
        "<think>\nreasoning\n</think>\n<answer>\n42\n</answer>\n",  # one trailing newline is allowed
        "<think>\nline 1\nline 2\n</think>\n<answer>\n42\n</answer>",
        "<think>reasoning</think>\n<answer>\n42\n</answer>",  # missing newlines inside think
        "<think>\nreasoning\n</think>\n\n<answer>\n42\n</answer>",  # blank line between blocks
        " <think>\nreasoning\n</think>\n<answer>\n42\n</answer>",  # leading space
        "<think>\nr\n</think>\n<answer>\n42\n</answer>\n<answer>\n43\n</answer>",
    ]
    assert think_format(completions, strict=True) == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert think_format(completions) == [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0]
