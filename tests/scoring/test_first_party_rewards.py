"""The first-party rewards of the lit-grpo-rewards distribution, on inputs with hand-known answers."""

from __future__ import annotations

import math

import pytest
import torch
from lit_grpo_rewards import char_fraction, completion_text, exact_match, think_format

from lit_grpo import plugins
from lit_grpo.scoring import RewardScorer, RewardSpec, build_reward


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch):
    monkeypatch.delenv("LIT_GRPO_PLUGINS", raising=False)
    plugins.reset_plugins()
    yield
    plugins.reset_plugins()


def chat(text):
    return [{"role": "assistant", "content": text}]


def test_first_party_rewards_are_registered_through_the_entry_point():
    rewards = plugins.get_rewards()
    for name in ("char_fraction", "exact_match", "think_format"):
        assert rewards[name].package == "lit-grpo-rewards"
        assert rewards[name].doc  # `lit-grpo rewards` shows a description
    assert rewards["char_fraction"].obj is char_fraction


# --------------------------------------------------------------------------------------------------
# completion_text
# --------------------------------------------------------------------------------------------------


def test_completion_text_forms():
    assert completion_text("plain") == "plain"
    assert completion_text(chat("hello")) == "hello"
    assert completion_text([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]) == "a"
    assert completion_text(chat(None)) == ""
    assert completion_text([]) == ""
    parts = [{"role": "assistant", "content": [{"type": "text", "text": "ab"}, {"type": "image"}, {"type": "text", "text": "c"}]}]
    assert completion_text(parts) == "abc"
    with pytest.raises(TypeError, match="got int"):
        completion_text(3)


# --------------------------------------------------------------------------------------------------
# char_fraction
# --------------------------------------------------------------------------------------------------


def test_char_fraction_with_chars_arg():
    scores = char_fraction(completions=["aaba", "", "xyz", "a a"], chars="a")
    assert scores == [0.75, 0.0, 0.0, pytest.approx(2 / 3)]  # whitespace counts as a character


def test_char_fraction_with_target_column_per_sample():
    scores = char_fraction(completions=["abc", "abc", "abc"], target=["a", "bc", None])
    assert scores == [pytest.approx(1 / 3), pytest.approx(2 / 3), None]


def test_char_fraction_conversational():
    assert char_fraction(completions=[chat("aaaa"), chat("ab"), chat("")], chars="a") == [1.0, 0.5, 0.0]


def test_char_fraction_needs_a_char_set():
    with pytest.raises(TypeError, match="args: {chars: ...}.*`target` dataset column"):
        char_fraction(completions=["a"])


def test_char_fraction_configured_chars_win_over_a_target_column():
    reward = build_reward("char_fraction", {"chars": "b"})
    assert reward.__name__ == "char_fraction"
    assert reward(prompts=["p"], completions=["abbb"], completion_ids=[[]], target=["a"]) == [0.75]


def test_char_fraction_quickstart_signal():
    """A uniformly random string over ~50 characters scores ~1/50; an all-target string scores 1."""
    gen = torch.Generator().manual_seed(0)
    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWX"  # 50 chars
    idx = torch.randint(len(alphabet), (64, 32), generator=gen)
    randoms = ["".join(alphabet[i] for i in row) for row in idx.tolist()]
    mean = sum(char_fraction(completions=randoms, chars="a")) / len(randoms)
    assert 0.005 < mean < 0.04
    assert char_fraction(completions=["a" * 32], chars="a") == [1.0]


# --------------------------------------------------------------------------------------------------
# exact_match
# --------------------------------------------------------------------------------------------------


def test_exact_match_whole_completion_stripped():
    assert exact_match(completions=[" 42\n", "43", "42 apples"], answer=["42", "42", "42"]) == [1.0, 0.0, 0.0]


def test_exact_match_uses_last_answer_tag():
    completions = [
        "<think>maybe 41</think><answer> 42 </answer>",
        "<answer>41</answer> no wait <answer>42</answer>",
        "<answer>42</answer> no wait <answer>41</answer>",
        "<answer>\n42\n</answer>",
    ]
    assert exact_match(completions=completions, answer=["42"] * 4) == [1.0, 1.0, 0.0, 1.0]


def test_exact_match_none_answer_and_non_string_answer():
    assert exact_match(completions=["42", "42", "7"], answer=[None, 42, " 7 "]) == [None, 1.0, 1.0]


def test_exact_match_conversational():
    assert exact_match(completions=[chat("<answer>Paris</answer>"), chat("paris")], answer=["Paris", "Paris"]) == [1.0, 0.0]


# --------------------------------------------------------------------------------------------------
# think_format
# --------------------------------------------------------------------------------------------------


def test_think_format():
    completions = [
        "<think>x</think><answer>y</answer>",
        "<think>line 1\nline 2</think>\n\n<answer>\n42\n</answer>\n",  # newlines inside and around
        "  <think>a</think> <answer>b</answer>",  # surrounding whitespace ignored
        "<think>x</think>",  # no answer
        "<answer>y</answer>",  # no think
        "<think>x</think><answer>y</answer> trailing",
        "preamble <think>x</think><answer>y</answer>",
        "<answer>y</answer><think>x</think>",  # wrong order
        "",
    ]
    assert think_format(completions=completions) == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]


def test_think_format_custom_tags_and_conversational():
    assert think_format(
        completions=[chat("<reasoning>r</reasoning><final>f</final>"), chat("<think>r</think><answer>f</answer>")],
        think_tag="reasoning",
        answer_tag="final",
    ) == [1.0, 0.0]
    # tag names are literal text, not regex
    assert think_format(completions=["<a.b>x</a.b><c>y</c>", "<aXb>x</aXb><c>y</c>"], think_tag="a.b", answer_tag="c") == [1.0, 0.0]


def test_first_party_rewards_through_the_scorer_conversational():
    scorer = RewardScorer(
        [
            RewardSpec("think_format", weight=0.5),
            RewardSpec("exact_match"),
            RewardSpec("char_fraction", args={"chars": "<>"}),
        ]
    )
    prompts = [[{"role": "user", "content": "6*7?"}]] * 2
    completions = [chat("<think>6*7</think><answer>42</answer>"), chat("42")]
    out = scorer(prompts, completions, [[1, 2], [3]], {"answer": ["42", None]})
    assert out[:, 0].tolist() == [1.0, 0.0]
    assert out[0, 1].item() == 1.0 and math.isnan(out[1, 1].item())
    assert out[:, 2].tolist() == [pytest.approx(8 / 37), 0.0]  # 8 angle brackets in 37 characters


def test_exact_match_answer_pattern_extracts_gsm8k_final_answer():
    from lit_grpo_rewards import exact_match

    gold = ["Natalia sold 48/2 = 24 clips in May.\n#### 72", "no final answer here"]
    completions = ["<think>48+24</think><answer>72</answer>", "72"]
    assert exact_match(completions, answer=gold, answer_pattern=r"####\s*(.+)$") == [1.0, None]
    # without a group the whole match is the reference
    assert exact_match(["ab"], answer=["xx ab yy"], answer_pattern=r"a\w") == [1.0]
    assert exact_match(["72 "], answer=["#### 71"], answer_pattern=r"####\s*(.+)$") == [0.0]
