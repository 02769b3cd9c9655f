"""numeric_accuracy and the final-answer parsing it shares with math_accuracy, on hand-known inputs;
every parser of model text on 100,000-character worst cases under a time bound."""

from __future__ import annotations

import json
import time
from fractions import Fraction

import pytest
from lit_grpo_rewards import answer_match, exact_match, math_accuracy, numeric_accuracy, think_format
from lit_grpo_rewards.answer import last_boxed
from lit_grpo_rewards.final_answer import final_answer, normalize_answer_text, plain_number
from lit_grpo_rewards.text import last_tag_content

from lit_grpo import plugins
from lit_grpo.scoring import build_reward

REASONING = "<think>\nShe sells 48 in April and 48 / 2 = 24 in May, so 48 + 24 = 72 in all.\n</think>\n"


def chat(text):
    return [{"role": "assistant", "content": text}]


def in_block(answer: str) -> str:
    return f"{REASONING}<answer>{answer}</answer>"


# --------------------------------------------------------------------------------------------------
# values, not strings
# --------------------------------------------------------------------------------------------------

# Each issue-44 form of a right answer: exact_match, the GSM8K recipe's reward until then, gave 0 to all.
RIGHT_28080 = [
    in_block("28080.0"),
    in_block("28080.00"),
    in_block("28080."),
    in_block("28,080"),
    in_block("$28,080"),
    in_block("28080 pebbles"),
    in_block(r"\boxed{28080}"),
    in_block(r"\( 28080 \)"),
    in_block("#### 28080"),
    in_block("The answer is 28080."),
    in_block(r"$28{,}080$"),
    in_block(r"28\,080"),
    in_block(r"\$28,080.00"),
    in_block(r"$28080 \text{ pebbles}$"),
    in_block("**28080**"),
    in_block("In all, Michael has 28,080 pebbles."),
    "He has 28080 pebbles.\n#### 28080",  # GSM8K's own layout, no block
    r"He has 28080 pebbles, so the final answer is $\boxed{28080}$.",
    "He has 28080 pebbles.\n\n**Answer:** 28080",
    "### Final Answer\n28,080",
    "28080",
]


@pytest.mark.parametrize("completion", RIGHT_28080)
def test_every_way_of_writing_the_right_value_scores_1(completion):
    assert numeric_accuracy([completion], answer=["... so he has 28080.\n#### 28080"]) == [1.0]
    assert math_accuracy([completion], answer=["... so he has 28080.\n#### 28080"]) == [1.0]


def test_before_issue_44_the_recipe_reward_missed_those_forms():
    # the recipe's reward until issue 44, for the record: only the plain string matched
    scores = exact_match(RIGHT_28080, answer=["#### 28080"] * len(RIGHT_28080), answer_pattern=r"####\s*(.+)$")
    assert scores == [0.0] * (len(RIGHT_28080) - 1) + [1.0]


@pytest.mark.parametrize(
    ("completion", "gold"),
    [
        ("8", "#### 8.0"),  # GSM8K-style gold with a trailing .0
        ("8.0", "8"),
        ("1600", "#### 1,600"),
        ("8", 8),  # a JSON number
        ("0.5", 0.5),
        ("1/2", 0.5),
        ("0.75", r"\frac{3}{4}"),
        (r"\frac{3}{4}", "0.75"),
        (r"\dfrac{242}{311}", r"$\dfrac{242}{311}$"),  # reasoning-gym's fraction_simplification gold
        ("242/311", r"$\frac{242}{311}$"),
        ("-61", "-61"),
        ("\u221261", "-61"),  # the minus sign
        ("-$61", "-61"),
        ("$-61$", "#### -61"),
        ("25%", "25"),
        (r"$25\%$", "25"),
        ("25 percent", "#### 25"),
        ("74.91610", "74.9161"),
        (".5", "0.5"),
        ("2^{10}", "1024"),  # a formula: Math-Verify's case
        (r"The answer is $\boxed{42}$.", r"So $x = 6 \cdot 7 = \boxed{42}$."),  # a MATH solution
    ],
)
def test_gold_and_completion_compared_as_values(completion, gold):
    assert numeric_accuracy([in_block(completion)], answer=[gold]) == [1.0]


@pytest.mark.parametrize(
    ("completion", "gold"),
    [
        ("28080.5", "28080"),
        ("2808", "28080"),
        ("280800", "28080"),
        ("28,08", "28080"),  # not a thousands separator: two numbers, Math-Verify reads the last
        ("61", "-61"),  # the sign lost
        ("74.916", "74.9161"),  # rounded
        ("0.25", "25"),  # a fraction is not the percentage
        ("311/242", "242/311"),
        ("twenty", "20"),  # number words are not read
    ],
)
def test_other_values_score_0(completion, gold):
    assert numeric_accuracy([in_block(completion)], answer=[gold]) == [0.0]


# --------------------------------------------------------------------------------------------------
# the final committed answer
# --------------------------------------------------------------------------------------------------


def test_the_last_committed_answer_counts():
    completions = [
        f"{REASONING}<answer>71</answer> Wait, that is wrong. <answer>72</answer>",
        f"{REASONING}<answer>72</answer> Wait, that is wrong. <answer>71</answer>",
        r"So the answer is $\boxed{71}$. No: 48 + 24 = 72, the answer is $\boxed{72}$.",
        r"\boxed{72}, no, \boxed{71}",
        "<think>My first guess: the answer is 71. But 48 + 24 = 72.</think><answer>72</answer>",  # the block wins
        r"<think>\boxed{71}?</think><answer>72</answer>",
        "The answer is 71. Let me recheck: 48 + 24 = 72.\nThe answer is 72.",
        "<answer>72</answer>\n<answer>7",  # a second block cut off: the last complete one stands
    ]
    assert numeric_accuracy(completions, answer=["72"] * len(completions)) == [1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0]


def test_a_completion_without_a_final_answer_scores_0_whatever_number_it_wrote_last():
    truncated = [
        "<think>\nShe sells 48 in April and 48 / 2 = 24 in May, so 48 + 24 = 72",  # cut off in the reasoning
        "She sells 48 in April and 48 / 2 = 24 in May, so 48 + 24 = 72",  # the same without tags
        f"{REASONING}<answer>\n72",  # cut off inside the block, before </answer>
        f"{REASONING}The answer is",  # cut off right after the marker
        "She sells 48 in April, then 24 in May; altogether 72",
        "",
    ]
    golds = ["#### 72"] * len(truncated)
    assert numeric_accuracy(truncated, answer=golds) == [0.0] * len(truncated)
    assert math_accuracy(truncated, answer=golds) == [0.0] * len(truncated)
    # before issue 44 math_accuracy read the last number of the reasoning: 1.0 for the first two


def test_cut_off_negated_and_corrected_answers_read_as_a_careful_grader_reads_them():
    """Issue 49: a sentence cut off after a number commits to nothing; "not 72" says what the answer
    is not; a correction after the answer replaces it (the last committed answer counts)."""
    assert final_answer("Natalia sold 48 clips in April and") is None  # before: "Natalia sold 48 clips in April and"
    assert final_answer("Natalia sold 48") is None
    assert final_answer("The answer is not 72.") == ""  # before: "not 72", which scored 72
    assert final_answer("The answer is definitely not 72.") == ""
    assert final_answer("The answer isn't 72.") is None
    assert final_answer("The answer is not 71 but 72.") == "72"
    assert final_answer("The answer is 7.\n3 + 4 = 7, check.\nWait, it is 9.") == "9"  # before: "7"
    assert final_answer("So the answer is 72. Actually, it's 70.") == "70"
    assert final_answer("So the answer is 72. Wait, let me check: 48 + 24 = 72. Yes, it is right.") == "72"
    assert final_answer("The answer is 72. Wait, it is not 72.") == ""
    # still answers: a number with a unit, a sentence that ends
    assert [final_answer(text) for text in ["72 clips", "$72$", "72 square meters", "She sold 72 clips!"]] == [
        "72 clips", "$72$", "72 square meters", "She sold 72 clips!",
    ]
    completions = ["Natalia sold 72 clips in April and", "The answer is not 72.", "The answer is 71.\nWait, it is 72."]
    assert numeric_accuracy(completions, answer=["#### 72"] * 3) == [0.0, 0.0, 1.0]
    assert math_accuracy(completions, answer=["#### 72"] * 3) == [0.0, 0.0, 1.0]


def test_prose_that_names_the_tag_does_not_start_the_block():
    completions = [
        "<think>I will put the final number inside the <answer> tag. 48 + 24 = 72.</think><answer>72</answer>",
        "<think>The result goes between <answer> and </answer>. 48 + 24 = 72.</think>\n<answer> 72 </answer>",
    ]
    golds = ["72", "72"]
    assert numeric_accuracy(completions, answer=golds) == [1.0, 1.0]
    assert math_accuracy(completions, answer=golds) == [1.0, 1.0]
    assert exact_match(completions, answer=golds) == [1.0, 1.0]  # the same bug, fixed there too
    assert answer_match(completions, answer=golds, extract="answer_tag") == [1.0, 1.0]
    assert last_tag_content("named <answer> in prose, then <answer>72</answer>", "answer") == "72"
    assert last_tag_content("<answer>72", "answer") is None


def test_final_answer_markers():
    assert final_answer("work\n#### 72") == "72"
    assert final_answer("#### 3. Totals\nShe has 72 in all, since 48 + 24 = 72") is None  # a numbered heading
    assert final_answer("#### Step 2\n48 + 24 = 72") is None  # a heading: no value follows ####
    assert final_answer("### Final Answer\n\n72 clips") == "72 clips"
    assert final_answer("The final answer is: 72 clips. I hope it is correct.") == "72 clips"
    assert final_answer("**Answer:** $72$") == "$72$"
    assert final_answer(r"The answer is $\boxed{72}$.") == "72"  # the box starts last
    assert final_answer(r"\boxed{72}. The answer is 72 clips.") == "72 clips"
    assert final_answer("<answer>The answer is 72.</answer>") == "72"  # markers inside the block too
    assert final_answer("<final>72</final> <answer>71</answer>", answer_tag="final") == "72"
    assert final_answer("<answer>71</answer>", answer_tag=None) is None  # markers only
    # nothing but an answer: one number among words, or a formula without words and "="
    assert [final_answer(text) for text in ["72", "She sold 72 clips.", r"$\frac{1}{2}$", "48 + 24 = 72", "so 48 and 24"]] == [
        "72", "She sold 72 clips.", r"$\frac{1}{2}$", None, None,
    ]


def test_plain_numbers():
    def value(text):
        return plain_number(normalize_answer_text(text))

    assert value("$28,080.50") == Fraction(56161, 2)
    assert value("28080.") == 28080
    assert value("-$5") == value("$-5") == value("\u22125 dollars") == value("(-5)") == -5
    assert value("a 5-day week") == 5  # a hyphen in a word is no sign
    assert value(r"\( 1\,000\,000 \)") == 1_000_000
    assert value(r"$72 \text{ cm}$") == 72
    assert value("25%") == value(r"25\%") == 25
    assert value("1,0000") is None  # not groups of three: two numbers
    for formula in ["3/4", r"\frac{3}{4}", r"\sqrt{16}", "2^{10}", "x = 5", "5 + 3", "#5"]:
        assert value(formula) is None, formula  # Math-Verify's case


# --------------------------------------------------------------------------------------------------
# columns, arguments, errors, registration
# --------------------------------------------------------------------------------------------------


def test_gold_column_none_pattern_conversational():
    assert numeric_accuracy([chat("<answer>72</answer>"), chat("72")], answer=[None, "#### 72"]) == [None, 1.0]
    # answer_pattern cuts the gold out; a gold it does not match is not applicable, as in exact_match
    golds = ["Final: 72 (checked)", "no marker"]
    assert numeric_accuracy(["72", "72"], answer=golds, answer_pattern=r"Final: (\S+)") == [1.0, None]
    assert numeric_accuracy(["72", "71"], answer="72") == [1.0, 0.0]  # one gold for every completion


def test_bad_golds_are_errors_naming_the_sample():
    with pytest.raises(ValueError, match=r"the gold answer of sample 1, 'Paris', states no number or formula"):
        numeric_accuracy(["72", "72"], answer=["72", "Paris"])
    with pytest.raises(ValueError, match="sample 0 is True, not a number"):
        numeric_accuracy(["72"], answer=[True])
    with pytest.raises(ValueError, match="got 2 completions but 1 gold answers"):
        numeric_accuracy(["72", "72"], answer=["72"])


def test_registered_through_the_entry_point_and_built_from_yaml_args(monkeypatch):
    monkeypatch.delenv("LIT_GRPO_PLUGINS", raising=False)
    plugins.reset_plugins()
    try:
        entry = plugins.get_rewards()["numeric_accuracy"]
        assert entry.package == "lit-grpo-rewards" and entry.obj is numeric_accuracy
        reward = build_reward("numeric_accuracy", {"answer_tag": "final"})
        out = reward(prompts=["q"] * 2, completions=["<final>$72</final>", "<answer>72</answer>"],
                     completion_ids=[[1], [2]], answer=["#### 72"] * 2)
        assert out == [1.0, 0.0]
    finally:
        plugins.reset_plugins()


def test_listed_by_lit_grpo_rewards(capsys, monkeypatch):
    from lit_grpo.cli import main

    monkeypatch.delenv("LIT_GRPO_PLUGINS", raising=False)
    plugins.reset_plugins()
    main(["rewards", "--json"])
    listed = {entry["name"]: entry for entry in json.loads(capsys.readouterr().out)}
    assert listed["numeric_accuracy"]["package"] == "lit-grpo-rewards"
    assert listed["numeric_accuracy"]["description"].startswith("1.0 if the completion's final answer has the gold")


# --------------------------------------------------------------------------------------------------
# linear in the length of the text
# --------------------------------------------------------------------------------------------------

N = 100_000
# Worst cases for each parser of model text: each repeats what makes a pattern try again, and
# before issue 44 several took seconds to minutes (the non-greedy tag match, the forward scan from
# each \boxed, think_format's pattern before its tag counts).
WORST_CASES = {
    "unclosed answer tags": "<answer>" * (N // 8),
    "unclosed boxes": "\\boxed{" * (N // 7),
    "nested braces": "{" * (N // 2) + "}" * (N // 2),
    "think then answer tags": "<think>" + "</think><answer>" * (N // 16),
    "answer phrases": "The answer is " * (N // 14),
    "hashes": "#" * N,
    "digits with commas": "1," * (N // 2),
    "digits with dots": "1." * (N // 2),
    "spaces after a marker": "answer" + " " * N,
    "sum of ones in a block": "<answer>" + "1 + " * (N // 4) + "</answer>",
    "words and one number": "a " * (N // 2) + "72",
    "corrections after an answer": "The answer is 7. " + "Wait, no, hmm, " * (N // 15),
    "sentence ends": "72" + ". " * (N // 2),
}


@pytest.mark.parametrize("name", list(WORST_CASES))
def test_every_parser_is_linear_on_100k_character_worst_cases(name):
    text = WORST_CASES[name]
    assert len(text) >= 0.99 * N
    start = time.perf_counter()
    numeric_accuracy([text], answer=["72"], timeout_seconds=None)
    math_accuracy([text], answer=["72"], timeout_seconds=None)
    think_format([text])
    exact_match([text], answer=["72"])
    answer_match([text], answer=["72"])
    last_boxed(text)
    elapsed = time.perf_counter() - start
    # about 0.1 s here on a busy 2-core machine; the quadratic parsers took 2 s to minutes
    assert elapsed < 1.5, f"{name}: {elapsed:.2f} s for {len(text)} characters"


@pytest.mark.parametrize("completion, value", [
    ("The answer is 72. Hmm, that is 6 + 6 per row.", 72),  # a computation after the answer is no correction
    ("The answer is 72. Hmm, that is 6 \\times 12.", 72),
    ("The answer is 72, no, it is 70.", 70),  # a correction within the sentence
])
def test_a_remark_after_the_answer_that_computes_does_not_replace_it(completion, value):
    assert numeric_accuracy([completion], answer=[str(value)]) == [1.0]
